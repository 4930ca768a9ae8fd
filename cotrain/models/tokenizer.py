"""A character-level tokenizer for the built-in task, built locally with the `tokenizers` library.

Every printable ASCII character is one token, so any prompt/answer text a user brings in JSONL also
tokenizes; ids 0..3 are specials. The tokenizer is saved as a Hugging Face ``PreTrainedTokenizerFast``
(tokenizer.json + tokenizer_config.json) so that transformers and vLLM load it from the checkpoint
directory like any other.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PAD, EOS, UNK, MASK = "<pad>", "<eos>", "<unk>", "<mask>"
SPECIAL_TOKENS = (PAD, EOS, UNK, MASK)
CHARS = tuple(chr(c) for c in range(32, 127))  # printable ASCII, space included


def build_vocab() -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    return vocab


def build_tokenizer():
    """Return a ``transformers.PreTrainedTokenizerFast`` over characters."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=build_vocab(), unk_token=UNK))
    # Every character is its own pre-token; decoding concatenates them back without separators.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        mask_token=MASK,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(path: str | Path):
    tok = build_tokenizer()
    tok.save_pretrained(str(path))
    return tok

