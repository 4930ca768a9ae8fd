"""cotrain.parallel.varlen: packed causal attention batched by length equals the ring kernel's packed
attention (per-sequence blocks) in values and gradients, grouped-query heads and lengths from 1 to 40."""

import torch

from cotrain.parallel.branch_attention import cp_branch_attention
from cotrain.parallel.kernels import TorchBlockKernel
from cotrain.parallel.layout import BranchLayout, cu_seqlens_from_lengths
from cotrain.parallel.varlen import VarlenPlan, varlen_causal_attention


def test_varlen_equals_the_ring_kernel_in_values_and_gradients():
    lens = [5, 6, 1, 6, 7, 13, 40, 14, 38, 2, 33]
    cu = cu_seqlens_from_lengths(lens)
    T = int(cu[-1])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    up = torch.randn(T, 4, 8, generator=g, dtype=torch.float64)
    plan = VarlenPlan(cu)
    assert 1 < plan.num_buckets < len(lens)  # batched, not one call per sequence
    out = varlen_causal_attention(q, k, v, plan, scale=0.3)
    grads = torch.autograd.grad((out * up).sum(), (q, k, v))
    layout = BranchLayout(cu, [], [], cp_size=1)
    ref, _, _, _ = cp_branch_attention(q, k, v, None, None, None, layout, None, softmax_scale=0.3,
                                       kernel=TorchBlockKernel())
    ref_grads = torch.autograd.grad((ref * up).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
