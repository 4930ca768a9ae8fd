"""FlashVarlenBlockKernel's calls into flash-attn, checked on CPU against stand-ins with flash-attn's signatures.

flash-attn is GPU-only and not installed here. The stand-ins below have exactly the signatures of
``flash_attn_varlen_func`` and ``_flash_attn_varlen_backward`` in Dao-AILab/flash-attention 2.8.3
(flash_attn/flash_attn_interface.py; the same since 2.6) and implement what their docstrings state in
plain torch: varlen attention with the causal mask aligned to the bottom-right corner, ``window_size
= (left, right)``, grouped-query heads, softmax_lse of shape (nheads, total_q), and a backward that
takes the rows' out and lse and writes dq, dk, dv into the given buffers. So these tests check the
kernel's keywords, shapes and layouts (not flash-attn's numerics, which the CUDA test in
test_layout_zigzag.py covers where a GPU is present).
"""

import sys
import types

import pytest
import torch

from cotrain.parallel.kernels import (CAUSAL, FULL, BlockMask, FlashVarlenBlockKernel, Tile, TorchBlockKernel, _fold_dlse,
                                      default_kernel)


def _segments(cu_q, cu_k):
    for i in range(len(cu_q) - 1):
        yield slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))


def _scores(q, k, causal, window_size, scale):
    """(H, n, m) masked scores of one varlen sequence (flash-attn's rules: bottom-right causal, window)."""
    g = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q.double(), kk.double()) * scale
    n, m = q.shape[0], k.shape[0]
    i = torch.arange(n)[:, None] + (m - n)  # query i's diagonal key
    j = torch.arange(m)[None, :]
    ok = torch.ones(n, m, dtype=torch.bool)
    left, right = window_size
    if causal:
        right = 0
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return s.masked_fill(~ok, float("-inf"))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and block_table is None
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    out = torch.zeros(q.shape, dtype=q.dtype)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
    for sq, sk in _segments(cu_seqlens_q, cu_seqlens_k):
        assert sq.stop - sq.start <= max_seqlen_q and sk.stop - sk.start <= max_seqlen_k
        s = _scores(q[sq], k[sk], causal, window_size, softmax_scale)
        lse[:, sq] = torch.logsumexp(s, -1).float()
        vv = v[sk].repeat_interleave(q.shape[1] // k.shape[1], dim=1).double()
        out[sq] = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), vv).to(q.dtype)
    return (out, lse, torch.empty(0)) if return_attn_probs else out


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    assert softmax_lse.shape == (q.shape[1], q.shape[0]) and softmax_lse.is_contiguous()
    g = q.shape[1] // k.shape[1]
    for sq, sk in _segments(cu_seqlens_q, cu_seqlens_k):
        s = _scores(q[sq], k[sk], causal, (window_size_left, window_size_right), softmax_scale)
        p = torch.exp(s - softmax_lse[:, sq].double()[..., None])  # with the given (merged) lse
        do = dout[sq].double()
        vv = v[sk].repeat_interleave(g, dim=1).double()
        kk = k[sk].repeat_interleave(g, dim=1).double()
        delta = (do * out[sq].double()).sum(-1).transpose(0, 1)  # (H, n)
        ds = p * (torch.einsum("nhd,mhd->hnm", do, vv) - delta[..., None])
        dq[sq] = (torch.einsum("hnm,mhd->nhd", ds, kk) * softmax_scale).to(dq.dtype)
        dkh = torch.einsum("hnm,nhd->mhd", ds, q[sq].double()) * softmax_scale
        dvh = torch.einsum("hnm,nhd->mhd", p, do)
        dk[sk] = dkh.view(dkh.shape[0], k.shape[1], g, -1).sum(2).to(dk.dtype)
        dv[sk] = dvh.view(dvh.shape[0], k.shape[1], g, -1).sum(2).to(dv.dtype)
    return torch.empty(0)


@pytest.fixture
def fake_flash(monkeypatch):
    """flash_attn with the 2.8.3 signatures (module doc); returns the interface module."""
    pkg, iface = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
    pkg.flash_attn_varlen_func = iface.flash_attn_varlen_func = flash_attn_varlen_func
    iface._flash_attn_varlen_backward = _flash_attn_varlen_backward
    pkg.flash_attn_interface = iface
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    return iface


@pytest.mark.parametrize("window", [None, 3])
def test_flash_kernel_calls_match_flash_attn_signatures(fake_flash, window):
    """Full and causal tiles (two of each kind, sharing query rows) through the kernel's flash-attn
    calls equal the torch kernel: forward out and lse, and dq, dk, dv from the merged rows."""
    g = torch.Generator().manual_seed(0)
    n = 12
    pos = torch.arange(n)
    k_pos = torch.cat([pos + 6, torch.arange(6)])  # keys 0..11 at positions 6..17, then 6 earlier keys
    q_hi = pos + 6
    q_lo = q_hi - (window - 1) if window else torch.zeros(n, dtype=torch.int64)
    tiles = [Tile(0, 6, 0, 6, CAUSAL), Tile(6, n, 6, n, CAUSAL), Tile(6, n, 0, 6, FULL)]
    if window is None:
        tiles += [Tile(0, n, n, n + 6, FULL)]
    mask = BlockMask(tiles, torch.zeros(n, dtype=torch.int64), q_lo, q_hi, torch.zeros(n + 6, dtype=torch.int64),
                     k_pos, window)
    if window is not None:  # a full tile must see all of its keys: only the causal ones keep the window
        mask = BlockMask(tiles[:2], mask.q_seg, mask.q_lo, mask.q_hi, mask.k_seg, mask.k_pos, window)
    q = torch.randn(n, 4, 8, generator=g)
    k, v = (torch.randn(n + 6, 2, 8, generator=g) for _ in range(2))
    flash, ref = FlashVarlenBlockKernel(), TorchBlockKernel()
    fused, _ = flash._split(mask)
    out = torch.zeros(n, 4, 8)
    lse = torch.full((n, 4), float("-inf"))
    flash._fused_forward(q, k, v, mask, fused, 0.3, out, lse)
    out_r, lse_r = ref.forward(q, k, v, mask, 0.3)
    torch.testing.assert_close(out, out_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_r, atol=1e-5, rtol=1e-5)
    dout = torch.randn(n, 4, 8, generator=g)
    grads = tuple(torch.zeros(t.shape) for t in (q, k, v))
    flash._fused_backward(dout, q, k, v, out_r, lse_r, mask, fused, 0.3, *grads)
    for name, a, b in zip("qkv", grads, ref.backward(dout, q, k, v, out_r, lse_r, mask, 0.3)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"d{name}")
    # an LSE gradient, folded into one more head dimension (flash-attn's backward has no dlse input)
    dlse = torch.randn(n, 4, generator=g)
    grads = tuple(torch.zeros(t.shape) for t in (q, k, v))
    flash._fused_backward(*_fold_dlse(dout, q, k, v, out_r, dlse), lse_r, mask, fused, 0.3, *grads)
    for name, a, b in zip("qkv", grads, ref.backward(dout, q, k, v, out_r, lse_r, mask, 0.3, dlse)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"d{name} with dlse")


def test_flash_version_with_other_backward_parameters_falls_back(fake_flash, monkeypatch):
    """flash-attn < 2.6 took window_size as one tuple: the kernel refuses it by name, and
    default_kernel("cuda") falls back to the torch kernel with a warning instead of miscalling it."""

    def old_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                     deterministic, rng_state=None):
        raise AssertionError("must not be called")

    monkeypatch.setattr(fake_flash, "_flash_attn_varlen_backward", old_backward)
    with pytest.raises(ImportError, match="window_size_left, window_size_right"):
        FlashVarlenBlockKernel()
    with pytest.warns(UserWarning, match="torch kernel"):
        assert isinstance(default_kernel("cuda"), TorchBlockKernel)
