"""The words built-in target (``builtin:words``): a real-sized vocabulary on a tiny model.

Real targets have 150k-token vocabularies, the built-in character tokenizer 128. This target
has a word-level tokenizer of ``VOCAB_SIZE`` = 8,192 tokens (4 specials, the separator ``=`` and
8,187 pseudo-words such as ``kalo`` or ``mibure``) and a copy task over it: the prompt is 6 words
(``WORDS_TASK``) drawn from a Zipf distribution (exponent 1) followed by ``=``, the answer is the
same words. Word frequencies therefore have the long tail of natural text: in the task's answers
the 512 most frequent words carry about 71% of the tokens, the 1,024 most frequent about 78% -
what a reduced EAGLE-3 draft vocabulary (``draft.eagle3.draft_vocab_size``, ``d2t``) is about.

Only constants and the task live here (like :mod:`cotrain.models.tiny`); the tokenizer is built by
:func:`build_words_tokenizer`, the checkpoint by ``cotrain.models.build_tiny`` (``--model words``,
cached like the others). The model is the tiny model's architecture but 2 layers deep with tied
embeddings (1.4 M parameters, 1.05 M of them the embedding), so that it builds in about a minute on
one thread. It copies frequent words and guesses at rare ones (held-out answers entirely right:
23.8% greedy, 10.2% sampled); its greedy responses therefore concentrate on frequent words (512
tokens cover 89% of the held-out response tokens of configs/distill_words_eagle3.yaml).
"""

from __future__ import annotations

import bisect
import itertools
import random
from functools import lru_cache

VOCAB_SIZE = 8192
SEPARATOR = "="

WORDS_QWEN3_CONFIG = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    tie_word_embeddings=True,  # the LM head is the embedding (as in Qwen3-0.6B): copying generalises to rare words
    torch_dtype="float32",
)

# The copy task: `num_words` words per prompt, word rank r drawn with weight 1 / (r + 1)^zipf. The
# length is fixed so that copying is a fixed relative offset, which a 2-layer model learns in a few
# hundred steps (with a varying length it needs an induction mechanism: not learnt in 300 steps).
WORDS_TASK = dict(num_words=6, zipf=1.0)

# Supervised warm start on the copy task (the answer is determined by the prompt: no label noise).
WORDS_SFT = dict(steps=300, batch_size=64, lr=5e-3, warmup=30, weight_decay=0.01, seed=1234, eval_size=256)

EVAL_MAX_NEW_TOKENS = 12

# Bump when the build changes in a way the constants above do not show (it is part of the cache key).
BUILD_VERSION = 1

# One thread: the weights do not depend on the machine, and these shapes gain little from a second.
BUILD_THREADS = 1

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = tuple(c + v for c in _CONSONANTS for v in _VOWELS)  # 70


def _word(i: int) -> str:
    """The i-th pseudo-word: i + 70 written in base 70 with syllables (so at least two syllables)."""
    n, out = i + len(_SYLLABLES), []
    while n:
        n, r = divmod(n, len(_SYLLABLES))
        out.append(_SYLLABLES[r])
    return "".join(reversed(out))


@lru_cache(maxsize=1)
def words() -> tuple[str, ...]:
    """The task's words, most frequent first (rank r has weight 1 / (r + 1)^zipf)."""
    from cotrain.models.tokenizer import SPECIAL_TOKENS

    n = VOCAB_SIZE - len(SPECIAL_TOKENS) - 1
    return tuple(_word(i) for i in range(n))


def build_words_vocab() -> dict[str, int]:
    from cotrain.models.tokenizer import SPECIAL_TOKENS

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab[SEPARATOR] = len(vocab)
    for w in words():
        vocab[w] = len(vocab)
    assert len(vocab) == VOCAB_SIZE
    return vocab


def build_words_tokenizer():
    """A ``transformers.PreTrainedTokenizerFast``: one token per whitespace-separated word; decoding
    joins tokens with single spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from cotrain.models.tokenizer import EOS, MASK, PAD, UNK

    tok = Tokenizer(models.WordLevel(vocab=build_words_vocab(), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   mask_token=MASK, clean_up_tokenization_spaces=False)


@lru_cache(maxsize=4)
def _cum_weights(zipf: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (r + 1) ** zipf for r in range(len(words()))))


def words_problem(rng: random.Random, num_words: int = 6, zipf: float = 1.0):
    """One copy problem: ``"w1 ... wn ="`` answered by ``"w1 ... wn"``."""
    from cotrain.tasks.data import Problem

    cum = _cum_weights(float(zipf))
    ws = [words()[min(bisect.bisect_left(cum, rng.random() * cum[-1]), len(cum) - 1)] for _ in range(num_words)]
    return Problem(prompt=" ".join(ws) + " " + SEPARATOR, answer=" ".join(ws))


def words_dataset(n: int, seed: int, num_words: int = 6, zipf: float = 1.0) -> list:
    rng = random.Random(seed)
    return [words_problem(rng, num_words, zipf) for _ in range(n)]
