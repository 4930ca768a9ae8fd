"""The CPU rejection-sampler repairs, installed in every vLLM worker process (by
:mod:`cotrain.rl.vllm.extension`).

On CPU (vLLM without Triton), speculative decoding at temperature > 0 meets two defects of vLLM 0.32's
rejection sampler (``vllm/v1/sample/rejection_sampler.py``), both repaired here:

- ``expand_batch_to_tokens`` falls back to a kernel that writes into a temporary int64 copy and
  returns uninitialised memory, so the target logits are divided by garbage temperatures and the
  sampling stops being lossless: replaced by a pure-torch version;
- with top-k (and no top-p), ``apply_sampling_constraints`` -> ``apply_top_k_top_p`` ->
  ``apply_top_k_only`` takes ``k.max()`` over the step's draft tokens, which fails on a step that
  has none (every request prefilling): an empty batch is returned as it is.

Set ``COTRAIN_VLLM_SAMPLER_FIX=0`` to see the defects.
"""

from __future__ import annotations

import os

import torch


def _expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                            replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """Pure-torch ``expand_batch_to_tokens``: ``x = [a, b, c]``, ``cu = [2, 5, 6]`` ->
    ``[a, a, b, b, b, c]``, with values equal to ``replace_from`` replaced by ``replace_to``."""
    assert cu_num_tokens.shape[0] == x.shape[0]
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    src = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype, device=x.device), x)
    out = torch.repeat_interleave(src, counts.to(x.device))
    if out.shape[0] < num_tokens:  # never seen; keep the tail defined rather than uninitialised
        fill = out[-1:] if out.numel() else src.new_full((1,), replace_to)
        out = torch.cat([out, fill.expand(num_tokens - out.shape[0])])
    return out[:num_tokens]


def _skip_empty(apply_top_k_top_p):
    """``apply_top_k_top_p`` that leaves a batch without rows alone (nothing to filter)."""

    def apply(logits: torch.Tensor, k, p):
        if logits.shape[0] == 0:
            return logits
        return apply_top_k_top_p(logits, k, p)

    apply.__wrapped__ = apply_top_k_top_p
    return apply


def _on_cpu_platform() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # vLLM absent or platform not resolvable: decide by CUDA
        return not torch.cuda.is_available()


def install_cpu_rejection_sampler_fix() -> bool:
    """Patch this process's rejection sampler (CPU only, idempotent). Returns whether it is on."""
    if os.environ.get("COTRAIN_VLLM_SAMPLER_FIX", "1") == "0" or not _on_cpu_platform():
        return False
    from vllm.v1.sample import rejection_sampler as rs

    if getattr(rs.expand_batch_to_tokens, "_cotrain_fix", False):
        return True
    _expand_batch_to_tokens._cotrain_fix = True  # type: ignore[attr-defined]
    rs.expand_batch_to_tokens = _expand_batch_to_tokens  # apply_sampling_constraints looks it up here
    rs.apply_top_k_top_p = _skip_empty(rs.apply_top_k_top_p)  # ... and this one
    return True


def cpu_rejection_sampler_fixed() -> bool:
    try:
        from vllm.v1.sample import rejection_sampler as rs
    except ImportError:
        return False
    return bool(getattr(rs.expand_batch_to_tokens, "_cotrain_fix", False))
