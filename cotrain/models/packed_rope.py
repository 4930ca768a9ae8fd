"""RoPE over packed (THD) rows in one vectorised call, the same numbers as megatron-core's.

A packed row holds sequences end to end (``cu_seqlens``); token i of a sequence is rotated by the
frequencies of its own position i, so positions restart at every sequence. For x [T, h, d] and the
rotary frequencies f [max_s, 1, 1, r] (r <= d rotated dims, halves x1 | x2 of the first r):

    pos[t]  = t - cu_seqlens[seq(t)]                       (f's rows [T], when f has max_s != T rows)
    c, s    = cos(f[pos]), sin(f[pos])                     [T, 1, r]   (halves c1 | c2, s1 | s2)
    out     = [x1 c1 - x2 s1 | x2 c2 + x1 s2 | x[..., r:]]

which is megatron's ``_apply_rotary_pos_emb_thd`` at CP = 1 (x c + rotate_half(x) s per sequence,
with f[:L_s] for each) element for element: the same products and sums of the same operands
(tested bitwise, values and gradients). Megatron builds it with a Python loop over the sequences,
twice a layer (queries, keys), and its rotate_half copies; here the cos / sin of a packed row are
computed once per forward (cached for the frequency tensor and ``cu_seqlens`` that every layer of
one forward shares) and applied without the copies.

Installed into ``megatron.core.transformer.attention`` (:func:`install`, the module's global that its
``Attention.forward`` calls); everything it does not cover goes to megatron's own function: no
``cu_seqlens`` (padded rows), CP > 1 (the zigzag split of the frequencies), fused RoPE, interleaved
rotary, multi-latent attention, ``mscale != 1``.
"""

from __future__ import annotations

from typing import Optional

import torch

_MEGATRON = None  # megatron's apply_rotary_pos_emb, kept by install()
#: [(freqs, cu_seqlens, their versions, dtype, cos, sin)]: the last packed row's (every layer of a forward
#: gets the same two tensors; held here, so their identity cannot pass to another; the version
#: counters catch an in-place change)
_CACHE: list = []


def _cos_sin(freqs: torch.Tensor, cu_seqlens: torch.Tensor, total: int, dtype: torch.dtype):
    """cos / sin [T, 1, r] of the packed row's positions, as megatron's THD path gathers them."""
    versions = (freqs._version, cu_seqlens._version)
    if _CACHE:
        f, cu, v, dt, cos, sin = _CACHE[0]
        if f is freqs and cu is cu_seqlens and v == versions and dt == dtype and cos.shape[0] == total:
            return cos, sin
    if freqs.shape[0] == total:  # megatron's "exact mapping": f holds every packed position's row
        rows = freqs
    else:
        cu = cu_seqlens.to(device=freqs.device, dtype=torch.int64)
        lens = cu[1:] - cu[:-1]
        seq = torch.repeat_interleave(torch.arange(lens.numel(), device=freqs.device), lens, output_size=total)
        rows = freqs[torch.arange(total, device=freqs.device) - cu[:-1][seq]]
    rows = rows.squeeze(1)  # [T, 1, r]
    cos, sin = torch.cos(rows).to(dtype), torch.sin(rows).to(dtype)
    _CACHE[:] = [(freqs, cu_seqlens, versions, dtype, cos, sin)]
    return cos, sin


def packed_rope(t: torch.Tensor, freqs: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """t [T, h, d] packed as ``cu_seqlens``, rotated per sequence (module docstring)."""
    cos, sin = _cos_sin(freqs, cu_seqlens, t.shape[0], t.dtype)
    r = cos.shape[-1]
    half = r // 2
    x1, x2 = t[..., :half], t[..., half:r]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    parts = [x1 * c1 - x2 * s1, x2 * c2 + x1 * s2]
    if r < t.shape[-1]:
        parts.append(t[..., r:])
    return torch.cat(parts, dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens: Optional[torch.Tensor] = None,
                         mscale: float = 1.0, cp_group=None):
    """megatron's ``apply_rotary_pos_emb`` with packed rows at CP = 1 through :func:`packed_rope`."""
    if cp_group is None:
        from megatron.core import parallel_state

        cp = parallel_state.get_context_parallel_world_size()
    else:
        cp = cp_group.size()
    if (cu_seqlens is None or cp > 1 or config.apply_rope_fusion or config.rotary_interleaved
            or config.multi_latent_attention or mscale != 1.0):
        return _MEGATRON(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    return packed_rope(t, freqs, cu_seqlens)


def install() -> None:
    """Route megatron's attention through :func:`apply_rotary_pos_emb` (idempotent)."""
    global _MEGATRON
    from megatron.core.transformer import attention

    if attention.apply_rotary_pos_emb is not apply_rotary_pos_emb:
        _MEGATRON = attention.apply_rotary_pos_emb
        attention.apply_rotary_pos_emb = apply_rotary_pos_emb
