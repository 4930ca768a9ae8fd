"""The CPU rejection-sampler repair, installed in every vLLM worker process (by
:mod:`cotrain.rl.vllm.extension`).

On CPU, vLLM's ``expand_batch_to_tokens`` (rejection sampler) falls back to a kernel that writes into
a temporary int64 copy and returns uninitialised memory, so speculative decoding at temperature > 0
divides the target logits by garbage and stops being lossless (STACK.md). This module replaces it by
a pure-torch version. Set ``COTRAIN_VLLM_SAMPLER_FIX=0`` to see the defect.
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
    return True


def cpu_rejection_sampler_fixed() -> bool:
    try:
        from vllm.v1.sample import rejection_sampler as rs
    except ImportError:
        return False
    return bool(getattr(rs.expand_batch_to_tokens, "_cotrain_fix", False))
