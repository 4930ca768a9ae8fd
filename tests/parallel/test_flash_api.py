"""FlashVarlenBlockKernel's calls into flash-attn, checked on CPU against stand-ins with flash-attn's signatures.

flash-attn is GPU-only and not installed here. The stand-ins below have exactly the signatures of
``flash_attn_varlen_func`` and ``_flash_attn_varlen_backward`` in Dao-AILab/flash-attention 2.8.3
(flash_attn/flash_attn_interface.py; the backward's the same since 2.7.0) and implement what their docstrings state in
plain torch: varlen attention with the causal mask aligned to the bottom-right corner, ``window_size
= (left, right)``, grouped-query heads, softmax_lse of shape (nheads, total_q), and a backward that
takes the rows' out and lse and writes dq, dk, dv into the given buffers, refusing a head size that
is not a multiple of 8 or above 256 as the CUDA op does (the forward pads the head dim itself, as
``FlashAttnVarlenFunc`` does before calling that op). So these tests check the
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
    assert q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256"
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
    head_sizes.append(q.shape[-1])
    assert q.shape[-1] % 8 == 0, "head_size should be a multiple of 8"  # flash_api.cpp, mha_varlen_bwd
    assert q.shape[-1] <= 256, "FlashAttention backward only supports head dimension at most 256"
    assert all(x.shape[-1] == q.shape[-1] for x in (dout, k, v, out, dq, dk, dv))
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


head_sizes: list[int] = []  # head size of every backward call (the stand-in records them)


@pytest.fixture
def fake_flash(monkeypatch):
    """flash_attn with the 2.8.3 signatures (module doc); returns the interface module."""
    head_sizes.clear()
    pkg, iface = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
    pkg.__version__ = "2.8.3"
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


def _tiles_case(g, n, heads, kv_heads, d, dtype=torch.float32):
    """Two causal tiles and a full one sharing query rows (no window), random q, k, v, dout, dlse."""
    pos = torch.arange(n)
    tiles = [Tile(0, n // 2, 0, n // 2, CAUSAL), Tile(n // 2, n, n // 2, n, CAUSAL), Tile(n // 2, n, 0, n // 2, FULL)]
    mask = BlockMask(tiles, torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), pos,
                     torch.zeros(n, dtype=torch.int64), pos)
    q = torch.randn(n, heads, d, generator=g, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(n, kv_heads, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    dout = torch.randn(n, heads, d, generator=g, dtype=torch.float64)
    dlse = torch.randn(n, heads, generator=g, dtype=torch.float64)
    return mask, q, k, v, dout, dlse


def _autograd_reference(mask, q, k, v, dout, dlse, scale):
    """dq, dk, dv of sum(out * dout) + sum(lse * dlse) by torch autograd, in fp64, on the dense mask."""
    qq, kk, vv = (x.double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("nhd,mhd->hnm", qq, kk.repeat_interleave(g, dim=1)) * scale
    allowed = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    for t in mask.tiles:
        allowed[t.q0:t.q1, t.k0:t.k1] |= mask.allowed(t)
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)  # (H, n)
    out = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), vv.repeat_interleave(g, dim=1))
    ((out * dout).sum() + (lse.transpose(0, 1) * dlse).sum()).backward()
    return out.detach(), lse.transpose(0, 1).detach(), (qq.grad, kk.grad, vv.grad)


@pytest.mark.parametrize("d", [7, 8, 12, 16])
def test_flash_backward_gets_head_sizes_padded_to_multiples_of_8(fake_flash, d):
    """The LSE-gradient fold makes the head dim D + 1 (9 for D = 8); the private backward takes only
    multiples of 8: the kernel pads (the stand-in asserts it) and the sliced dq, dk, dv equal the
    gradients torch autograd gives for sum(out * dout) + sum(lse * dlse), with and without dlse."""
    g = torch.Generator().manual_seed(1)
    mask, q, k, v, dout, dlse = _tiles_case(g, 10, 4, 2, d)
    flash = FlashVarlenBlockKernel()
    fused, _ = flash._split(mask)
    for with_dlse in (False, True):
        out, lse, ref = _autograd_reference(mask, q, k, v, dout, dlse if with_dlse else torch.zeros_like(dlse), 0.4)
        head_sizes.clear()
        grads = tuple(torch.zeros(t.shape) for t in (q, k, v))
        args = (dout.float(), q, k, v, out.float())
        if with_dlse:
            args = _fold_dlse(*args, dlse.float())
        flash._fused_backward(*args, lse.float(), mask, fused, 0.4, *grads)
        assert head_sizes and all(h % 8 == 0 and h >= d + with_dlse for h in head_sizes), head_sizes
        for name, a, b in zip("qkv", grads, ref):
            assert a.shape == b.shape
            torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=f"d{name} (dlse: {with_dlse})")


def test_flash_backward_with_a_head_dim_past_the_limit_uses_the_torch_kernel(fake_flash):
    """D = 252: the folded, padded head dim (256 + 8) is past flash-attn's 256; the block's backward
    runs on the torch kernel (the stand-in is never called) and equals autograd's gradients."""
    g = torch.Generator().manual_seed(2)
    mask, q, k, v, dout, dlse = _tiles_case(g, 6, 2, 1, 252)
    out, lse, ref = _autograd_reference(mask, q, k, v, dout, dlse, 0.1)
    grads = FlashVarlenBlockKernel().backward(dout.float(), q, k, v, out.float(), lse.float(), mask, 0.1, dlse.float())
    assert head_sizes == []
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("version", ["2.6.3", "2.9.0", "3.0.0.b1", "unknown"])
def test_flash_versions_outside_2_7_to_2_8_are_refused_naming_the_version(fake_flash, monkeypatch, version):
    monkeypatch.setattr(sys.modules["flash_attn"], "__version__", version)
    with pytest.raises(ImportError, match=f"flash-attn {version} is installed.*2.7 - 2.8"):
        FlashVarlenBlockKernel()
    with pytest.warns(UserWarning, match="torch kernel"):
        assert isinstance(default_kernel("cuda"), TorchBlockKernel)


def test_flash_version_with_other_backward_parameters_falls_back(fake_flash, monkeypatch):
    """A 2.8 build whose backward takes window_size as one tuple (as flash-attn 2.6 did): the kernel
    refuses it by name, and default_kernel("cuda") falls back to the torch kernel with a warning
    instead of miscalling it."""

    def old_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                     deterministic, rng_state=None):
        raise AssertionError("must not be called")

    monkeypatch.setattr(fake_flash, "_flash_attn_varlen_backward", old_backward)
    with pytest.raises(ImportError, match="window_size_left, window_size_right"):
        FlashVarlenBlockKernel()
    with pytest.warns(UserWarning, match="torch kernel"):
        assert isinstance(default_kernel("cuda"), TorchBlockKernel)
