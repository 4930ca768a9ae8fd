"""Target taps and target logits from a Hugging Face target, for offline drafter training.

Layer-id conventions (three of them meet here):

- **cotrain config** (``draft.<kind>.tap_layers``): 0-based decoder layers, id i = the *output* of
  decoder layer i (the residual stream after layer i, before any final norm).
- **vLLM**: aux hidden-state id L = the residual stream *entering* decoder layer L
  (``hidden_states + residual`` before layer L runs): 0 = the embeddings, num_layers = the last
  layer's output before the final norm. So cotrain tap i == vLLM id i + 1.
  EAGLE-3's ``eagle_aux_hidden_state_layer_ids`` are vLLM ids used as given (export writes i + 1);
  DFlash/DSpark's ``dflash_config.target_layer_ids`` are "output of layer i" ids to which vLLM
  adds 1 itself (export writes i).
- **Hugging Face** ``output_hidden_states``: entry L is the residual stream entering layer L for
  L < num_layers, but the last entry has the final norm applied. This module does not use it: it
  hooks the decoder layers' outputs, which is exactly the cotrain convention.

vLLM concatenates the chosen states in ascending layer order on the feature axis; so does
:func:`compute_taps`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from cotrain.models.hf_arch import ArchSpec


@dataclass
class TargetSpec:
    """What a drafter needs to know about (and borrow from) its target.

    embed (V, H) and lm_head (V, H) are the target's input embeddings and output head (frozen,
    shared with the target in vLLM); final_norm (H,) the target's final norm weight.
    """

    arch: ArchSpec
    hf_config: dict
    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    mask_token_id: int
    pad_token_id: int = 0
    eos_token_id: Optional[int] = None
    path: Optional[str] = None

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    @classmethod
    def from_checkpoint(cls, path: str | Path, mask_token_id: Optional[int] = None) -> "TargetSpec":
        from cotrain.models.hf_io import load_hf_checkpoint

        arch, hf, state = load_hf_checkpoint(path)
        embed = state["model.embed_tokens.weight"].float()
        lm_head = embed if arch.tie_word_embeddings else state["lm_head.weight"].float()
        if mask_token_id is None:
            mask_token_id = _mask_token_from_tokenizer(Path(path))
        if mask_token_id is None:
            raise ValueError(f"{path}: the tokenizer has no mask token; pass mask_token_id")
        eos = hf.get("eos_token_id")
        return cls(arch=arch, hf_config=hf, embed=embed, lm_head=lm_head,
                   final_norm=state["model.norm.weight"].float(), mask_token_id=int(mask_token_id),
                   pad_token_id=int(hf.get("pad_token_id") or 0),
                   eos_token_id=int(eos[0] if isinstance(eos, list) else eos) if eos is not None else None,
                   path=str(path))

    @classmethod
    def from_model(cls, model, mask_token_id: int) -> "TargetSpec":
        """From a loaded HF ``*ForCausalLM`` (weights are copied, detached)."""
        hf = model.config.to_dict()
        arch = ArchSpec.from_hf(hf)
        eos = hf.get("eos_token_id")
        return cls(arch=arch, hf_config=hf, embed=model.get_input_embeddings().weight.detach().float().clone(),
                   lm_head=model.get_output_embeddings().weight.detach().float().clone(),
                   final_norm=model.model.norm.weight.detach().float().clone(), mask_token_id=int(mask_token_id),
                   pad_token_id=int(hf.get("pad_token_id") or 0),
                   eos_token_id=int(eos[0] if isinstance(eos, list) else eos) if eos is not None else None)


def _mask_token_from_tokenizer(path: Path) -> Optional[int]:
    cfg = path / "tokenizer_config.json"
    tok = path / "tokenizer.json"
    if not (cfg.exists() and tok.exists()):
        return None
    name = json.loads(cfg.read_text()).get("mask_token")
    if isinstance(name, dict):
        name = name.get("content")
    if not name:
        return None
    vocab = json.loads(tok.read_text()).get("model", {}).get("vocab", {})
    for added in json.loads(tok.read_text()).get("added_tokens", []):
        if added.get("content") == name:
            return int(added["id"])
    return int(vocab[name]) if name in vocab else None


def to_vllm_ids(tap_layers: Sequence[int]) -> list[int]:
    """cotrain tap ids (output of layer i) -> vLLM aux ids (residual entering layer i + 1)."""
    return [int(i) + 1 for i in tap_layers]


def from_vllm_ids(vllm_ids: Sequence[int]) -> list[int]:
    return [int(i) - 1 for i in vllm_ids]


def load_hf_target(path: str | Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@torch.no_grad()
def compute_taps(model, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, tap_layers: Sequence[int],
                 batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Taps (T, len(tap_layers) * H) and target logits (T, V) for packed sequences.

    Sequences are run right-padded in batches of ``batch_size`` (each from position 0); tap i is
    the output of decoder layer i (cotrain convention), concatenated in ascending layer order.
    """
    layers = sorted(int(i) for i in tap_layers)
    n_layers = len(model.model.layers)
    for i in layers:
        if not 0 <= i < n_layers:
            raise ValueError(f"tap layer {i} does not exist (the target has layers 0..{n_layers - 1})")
    cu = cu_seqlens.tolist()
    lens = [cu[s + 1] - cu[s] for s in range(len(cu) - 1)]
    captured: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda mod, args, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in layers]
    taps_out, logits_out = [], []
    try:
        for s0 in range(0, len(lens), batch_size):
            idx = list(range(s0, min(s0 + batch_size, len(lens))))
            width = max(lens[s] for s in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.int64)
            mask = torch.zeros(len(idx), width, dtype=torch.int64)
            for r, s in enumerate(idx):
                ids[r, : lens[s]] = input_ids[cu[s] : cu[s + 1]]
                mask[r, : lens[s]] = 1
            dev = next(model.parameters()).device  # the batch is built on the host, the model may be on a GPU
            logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.float()
            taps = torch.cat([captured[i].float() for i in layers], dim=-1)
            for r, s in enumerate(idx):
                taps_out.append(taps[r, : lens[s]])
                logits_out.append(logits[r, : lens[s]])
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(taps_out), torch.cat(logits_out)
