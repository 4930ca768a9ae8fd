"""Branch attention forward and backward on CUDA against the fp64 dense oracle (torch autograd on
the CPU), skipped without CUDA. Imports only torch and cotrain; flash-attn is used where it is
installed (detected, never imported at collection).

Kernels: TorchBlockKernel (any dtype) and the default CUDA kernel (FlashVarlenBlockKernel when
flash-attn 2.7-2.8 imports, else the torch kernel), at CP = 1 (local_branch_attention) and at
CP = 2 and 4 with every rank's share computed in turn on the one GPU (the partitions mode of
bench/cp_attention.py: the ring replayed from the other ranks' K/V; outputs and dQ are exact there,
dK/dV are not: see that module). Head dims 64 and 12 (12 and the LSE-gradient fold's 13 and 65 are
not multiples of 8: flash-attn's backward needs them padded). The losses weigh the LSE outputs too,
so their gradient (folded into one more head column for flash-attn) is checked.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from cotrain.parallel import (TorchBlockKernel, cu_seqlens_from_lengths, default_kernel, dense_branch_attention,
                              dflash_layout, eagle3_ttt_layout, local_branch_attention, sample_anchors)

HAS_FLASH = importlib.util.find_spec("flash_attn") is not None
SEQLENS = [37, 12, 64, 5, 29]


def _layout(family: str, window):
    cu = cu_seqlens_from_lengths(SEQLENS)
    g = torch.Generator().manual_seed(7)
    if family == "dflash":
        return dflash_layout(cu, sample_anchors(cu, 3, g), 4, window=window)
    T = int(cu[-1])
    positions = torch.unique(torch.cat([torch.randperm(T, generator=g)[: T // 2], cu[:-1]]))
    return eagle3_ttt_layout(cu, 3, positions=positions, window=window)


def _inputs(layout, dtype, head_dim, heads=(4, 2), seed=0):
    g = torch.Generator().manual_seed(seed)
    H, Hk = heads
    T, NB = layout.total_len, layout.total_branch_tokens
    xs = [torch.randn(n, h, head_dim, generator=g, dtype=torch.float64).to(dtype).double()
          for n, h in [(T, H), (T, Hk), (T, Hk), (NB, H), (NB, Hk), (NB, Hk)]]  # rounded once: the oracle sees them
    ws = [torch.randn(T, H, head_dim, generator=g, dtype=torch.float64), torch.randn(T, H, generator=g, dtype=torch.float64),
          torch.randn(NB, H, head_dim, generator=g, dtype=torch.float64), torch.randn(NB, H, generator=g, dtype=torch.float64)]
    return xs, ws


def _loss(outs, ws):
    return sum((o.double() * w.to(o.device)).sum() for o, w in zip(outs, ws))


def _oracle(layout, xs, ws):
    x = [t.clone().requires_grad_() for t in xs]
    outs = dense_branch_attention(*x, layout)
    _loss(outs, ws).backward()
    return [o.detach() for o in outs], [t.grad for t in x]


def _close(got, want, dtype, what):
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = float((got.double().cpu() - want).abs().max()) if want.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    assert err <= tol * (1 + scale), f"{what}: max error {err:.3e} (reference max {scale:.3e})"


KERNELS = ["torch", "default"]


@pytest.mark.gpu
@pytest.mark.parametrize("family,window", [("dflash", None), ("dflash", 9), ("eagle3", None), ("eagle3", 6)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 12])
@pytest.mark.parametrize("kernel", KERNELS)
def test_cuda_branch_attention_matches_dense_fp64(family, window, dtype, head_dim, kernel):
    layout = _layout(family, window)
    xs, ws = _inputs(layout, dtype, head_dim)
    want_out, want_grads = _oracle(layout, xs, ws)
    k = TorchBlockKernel() if kernel == "torch" else default_kernel("cuda")
    x = [t.to("cuda", dtype).requires_grad_() for t in xs]
    outs = local_branch_attention(*x, layout, kernel=k)
    _loss(outs, ws).backward()
    for name, got, want in zip(("out", "lse", "bout", "blse"), outs, want_out):
        _close(got.detach(), want, dtype, f"{name} ({type(k).__name__})")
    for name, t, want in zip(("dq", "dk", "dv", "dbq", "dbk", "dbv"), x, want_grads):
        assert t.grad is not None and t.grad.is_cuda and t.grad.dtype == dtype
        _close(t.grad, want, dtype, f"{name} ({type(k).__name__})")


@pytest.mark.gpu
def test_default_cuda_kernel_is_flash_attn_exactly_when_a_supported_one_is_installed():
    k = default_kernel("cuda")
    if not HAS_FLASH:
        assert isinstance(k, TorchBlockKernel)
        return
    import flash_attn

    from cotrain.parallel.kernels import FlashVarlenBlockKernel, _major_minor

    supported = _major_minor(flash_attn.__version__) in FlashVarlenBlockKernel.SUPPORTED_VERSIONS
    assert isinstance(k, FlashVarlenBlockKernel) == supported, flash_attn.__version__


@pytest.mark.gpu
@pytest.mark.parametrize("cp", [2, 4])
def test_cuda_cp_partitions_match_dense_fp64(load_bench, cp):
    """Every rank's share at CP = cp, computed in turn on the GPU (bf16): outputs and dQ of both
    bench arms (ours: the ring on zigzag shards; USP: padded segments) against the oracle."""
    bench = load_bench("cp_attention")
    args = SimpleNamespace(seed=3, num_seqs=4, min_len=16, max_len=96, blocks_per_seq=3, block_size=4, heads=4,
                           kv_heads=2, head_dim=64, warmup=1, rounds=1, budget_s=0.0, cp=[cp])
    layout, tensors, weights, arms, _ = bench.build_partitions(args, cp, torch.device("cuda"), torch.bfloat16)
    x = [t.double().cpu().requires_grad_() for t in tensors]
    out, _, bout, _ = dense_branch_attention(*x, layout.with_cp(1))
    ((out * weights[0].double().cpu()).sum() + (bout * weights[1].double().cpu()).sum()).backward()
    for name, ranks in arms.items():
        got = bench.assemble(layout, ranks, [arm.step() for arm in ranks], args.heads, args.head_dim, "cuda")
        _close(got[0], out.detach(), torch.bfloat16, f"{name} out")
        _close(got[1], bout.detach(), torch.bfloat16, f"{name} bout")
        grads = [(arm.inputs[0].grad, arm.inputs[3].grad) for arm in ranks]
        dq, dbq = bench.assemble(layout, ranks, grads, args.heads, args.head_dim, "cuda")
        _close(dq, x[0].grad, torch.bfloat16, f"{name} dq")
        _close(dbq, x[3].grad, torch.bfloat16, f"{name} dbq")
