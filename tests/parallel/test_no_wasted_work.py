"""No wasted work: the tiles cp_branch_attention computes hold only pairs the attention rule allows.

Branch-local attention is block-diagonal (no pair outside a branch's own block), checked against the
dense oracle's mask (an independent construction of the rule); the block-diagonal kernel against
per-branch attention written out in fp64. Ring tiles: without a window every tile is exact
(computed = allowed) when the kernel's tile cost is 0, and for chains at consecutive positions
(EAGLE-3 TTT, DFlash at every position) also at the default cost; the repeat_causal tiles that make
this possible are checked kernel against kernel. (Correctness of every plan against the oracle:
test_cp_branch_attention, cases *_exact.)
"""

from __future__ import annotations

import pytest
import torch

from cotrain.parallel import (
    BranchLayout,
    TorchBlockKernel,
    branch_attention_mask,
    cp_branch_attention,
    cu_seqlens_from_lengths,
    dflash_layout,
    eagle3_ttt_layout,
    ring_plan,
    sample_anchors,
)
from cotrain.parallel import blockdiag, rank_work
from cotrain.parallel.kernels import CAUSAL, FULL, REPEAT_CAUSAL, BlockMask, CpuFusedBlockKernel, Tile


def _layouts(cp_size: int) -> dict[str, BranchLayout]:
    g = torch.Generator().manual_seed(0)
    cu = cu_seqlens_from_lengths([37, 5, 64, 12])
    anchors = sample_anchors(cu, 5, g)
    order = torch.randperm(anchors.numel(), generator=g)
    return {
        "dflash": dflash_layout(cu, anchors, 6, cp_size=cp_size),
        "eagle3": eagle3_ttt_layout(cu, 4, cp_size=cp_size),
        "uneven_random_order_full": BranchLayout(cu, anchors[order], torch.randint(1, 9, (anchors.numel(),), generator=g),
                                                 context="inclusive", intra="full", cp_size=cp_size),
        "uneven_causal": BranchLayout(cu, anchors, torch.randint(1, 9, (anchors.numel(),), generator=g),
                                      context="inclusive", intra="causal", window=7, cp_size=cp_size),
    }


def test_issue_example_computes_only_the_allowed_pairs():
    # 16 DFlash blocks of 16 in one sequence: one merged tile used to compute 65,536 pairs for 4,096.
    layout = dflash_layout(cu_seqlens_from_lengths([512]), range(16, 512, 32), 16)
    plan = ring_plan(layout, 0)
    assert plan.intra_blocks.pairs_computed() == plan.intra_mask.pairs_computed() == 16 * 16 * 16
    assert plan.intra_mask.pairs_allowed() == 16 * 16 * 16
    assert len(plan.intra_blocks.groups) == 1  # one batched call for all 16 blocks


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("name", ["dflash", "eagle3", "uneven_random_order_full", "uneven_causal"])
def test_intra_pairs_computed_equal_pairs_allowed_by_the_oracle(cp_size, name):
    layout = _layouts(cp_size)[name]
    T = layout.total_len
    intra = branch_attention_mask(layout.with_cp(1))[T:, T:]  # branch -> branch part of the oracle's mask
    for rank in range(cp_size):
        plan = ring_plan(layout, rank)
        rows = layout.local_branch_token_index(rank)
        allowed = int(intra[rows][:, rows].sum())
        if not rows.numel():
            assert plan.intra_blocks is None
            continue
        assert plan.intra_blocks.pairs_computed() == allowed
        assert plan.intra_mask.pairs_computed() == plan.intra_mask.pairs_allowed() == allowed
        for t in plan.intra_mask.tiles:  # no tile reaches into another branch
            assert t.k1 - t.k0 == t.q1 - t.q0 and (t.k0, t.k1) == (t.q0, t.q1)


def _per_branch_reference(q, k, v, lens, causal, scale):
    """Each branch on its own, the softmax written out (fp64, autograd)."""
    outs, lses = [], []
    g = q.shape[1] // k.shape[1]
    start = 0
    for w in lens.tolist():
        qs, ks, vs = q[start : start + w], k[start : start + w], v[start : start + w]
        s = torch.einsum("qhd,khd->hqk", qs, ks.repeat_interleave(g, 1)) * scale
        if causal:
            s = s.masked_fill(torch.ones(w, w, dtype=torch.bool).triu(1), float("-inf"))
        lses.append(torch.logsumexp(s, -1).transpose(0, 1))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs.repeat_interleave(g, 1)))
        start += w
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("causal", [False, True])
def test_blockdiag_kernel_matches_per_branch_attention_fp64(causal):
    g = torch.Generator().manual_seed(3)
    lens = torch.tensor([3, 1, 5, 3, 2, 5, 3])
    n = int(lens.sum())
    q = torch.randn(n, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(n, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    blocks = blockdiag.BlockDiagonal.from_lengths(lens, causal)
    out, lse = blockdiag.forward(q, k, v, blocks, 0.4)
    ref_out, ref_lse = _per_branch_reference(q, k, v, lens, causal, 0.4)
    assert out.dtype == torch.float64
    assert torch.allclose(out, ref_out, atol=1e-13) and torch.allclose(lse, ref_lse, atol=1e-13)
    dout, dlse = torch.randn(n, 4, 8, generator=g, dtype=torch.float64), torch.randn(n, 4, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((ref_out * dout).sum() + (ref_lse * dlse).sum(), (q, k, v))
    got = blockdiag.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, blocks, 0.4, dlse)
    for a, b in zip(got, grads):
        assert torch.allclose(a, b, atol=1e-12), float((a - b).abs().max())


class _TileOnlyKernel:
    """A kernel written against the BlockKernel protocol alone (no forward_blocks)."""

    def __init__(self):
        self._k = TorchBlockKernel()

    def forward(self, *args):
        return self._k.forward(*args)

    def backward(self, *args, **kwargs):
        return self._k.backward(*args, **kwargs)


def test_tile_only_kernels_get_one_tile_per_branch():
    layout = _layouts(1)["uneven_random_order_full"]
    g = torch.Generator().manual_seed(1)
    T, NB = layout.total_len, layout.total_branch_tokens
    base = [torch.randn(n, h, 8, generator=g) for n, h in [(T, 4), (T, 2), (T, 2), (NB, 4), (NB, 2), (NB, 2)]]
    results = []
    for kernel in (TorchBlockKernel(), _TileOnlyKernel()):
        ts = [t.clone().requires_grad_() for t in base]
        out = cp_branch_attention(*ts, layout, kernel=kernel)
        sum(o.sum() for o in out[::2]).backward()
        results.append([o.detach() for o in out] + [t.grad for t in ts])
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-6)


def _ring_layouts(cp_size: int) -> dict[str, BranchLayout]:
    g = torch.Generator().manual_seed(4)
    cu = cu_seqlens_from_lengths([300, 41, 7, 130])
    T = int(cu[-1])
    return {
        "dflash_sparse": dflash_layout(cu, sample_anchors(cu, 4, g), 16, cp_size=cp_size),
        "dflash_every_position": dflash_layout(cu, torch.arange(T), 4, cp_size=cp_size),
        "eagle3_every_position": eagle3_ttt_layout(cu, 3, cp_size=cp_size),
        "eagle3_random_half": eagle3_ttt_layout(cu, 4, positions=torch.randperm(T, generator=g)[: T // 2], cp_size=cp_size),
        "uneven_inclusive": _layouts(cp_size)["uneven_random_order_full"],
    }


def _pairs(layout, cp_size, **kwargs):
    plans = [ring_plan(layout, r, **kwargs) for r in range(cp_size)]
    masks = [m for p in plans for m in p.ring_masks + ([p.intra_mask] if p.intra_mask else [])]
    return sum(m.pairs_computed() for m in masks), sum(m.pairs_allowed() for m in masks)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_ring_tiles_are_exact_without_a_window(cp_size):
    for name, layout in _ring_layouts(cp_size).items():
        for max_tile in (64, 256):
            computed, allowed = _pairs(layout, cp_size, max_tile=max_tile, tile_cost_pairs=0)
            assert allowed == int(rank_work(layout).sum()), name  # the allowed pairs are the rule's
            assert computed == allowed, (name, max_tile, computed, allowed)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_default_tile_cost_trades_a_little_waste_for_fewer_tiles(cp_size):
    # At the CPU kernels' cost (2048 pairs per tile), branches whose own tiles would save less than
    # that share a masked tile (short branches, short chunks): bounded waste, fewer dispatches.
    for name, layout in _ring_layouts(cp_size).items():
        computed, allowed = _pairs(layout, cp_size)
        assert allowed <= computed <= 1.35 * allowed, (name, computed / allowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeat_causal_tile_fused_matches_torch_kernel(dtype):
    # 5 consecutive chains of 3 tokens at positions 10..14 against keys 8..15: 2 full keys, then a
    # staircase; plus a plain full and causal tile on other rows, all in one mask.
    g = torch.Generator().manual_seed(0)
    n, rep = 5, 3
    q_hi = torch.cat([torch.arange(10, 15).repeat_interleave(rep), torch.arange(8, 16)])
    nq = q_hi.numel()
    k_pos = torch.arange(8, 16)
    tiles = [Tile(0, n * rep, 0, 2, FULL), Tile(0, n * rep, 2, 2 + n, REPEAT_CAUSAL, rep), Tile(n * rep, nq, 0, 8, CAUSAL)]
    mask = BlockMask(tiles, torch.zeros(nq, dtype=torch.int64), torch.zeros(nq, dtype=torch.int64), q_hi,
                     torch.zeros(8, dtype=torch.int64), k_pos)
    assert mask.pairs_computed() == mask.pairs_allowed() == 2 * 15 + rep * n * (n + 1) // 2 + 36
    q = torch.randn(nq, 4, 8, generator=g).to(dtype)
    k, v = (torch.randn(8, 2, 8, generator=g).to(dtype) for _ in range(2))
    ref, fused = TorchBlockKernel(), CpuFusedBlockKernel()
    out_r, lse_r = ref.forward(q, k, v, mask, 0.3)
    out_f, lse_f = fused.forward(q, k, v, mask, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out_f, out_r, atol=tol) and torch.allclose(lse_f, lse_r, atol=tol)
    dout = torch.randn(out_r.shape, generator=g)
    for a, b in zip(fused.backward(dout, q, k, v, out_r, lse_r, mask, 0.3), ref.backward(dout, q, k, v, out_r, lse_r, mask, 0.3)):
        assert torch.allclose(a, b, atol=tol * 4), float((a - b).abs().max())


def _plan_pairs(plan):
    masks = plan.ring_masks + ([plan.intra_mask] if plan.intra_mask is not None else [])
    return sum(m.pairs_computed() for m in masks), sum(m.pairs_allowed() for m in masks)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("tile_cost_pairs", [0, 2048])
def test_no_main_queries_plan_is_the_full_plan_minus_the_trunk(cp_size, tile_cost_pairs):
    # q=None's plan (main_queries=False) holds the branch rows only; its work is exactly the full
    # plan's minus the trunk's (the trunk-only layout's plan), computed and allowed; its allowed
    # pairs are the oracle mask's branch rows, and with exact tiles (cost 0) nothing more is computed.
    for name, layout in {**_ring_layouts(cp_size), **{f"w_{k}": v for k, v in _layouts(cp_size).items()}}.items():
        trunk = layout.subset([])
        T = layout.total_len
        branch_rows = branch_attention_mask(layout.with_cp(1))[T:]
        for rank in range(cp_size):
            kw = dict(max_tile=64, tile_cost_pairs=tile_cost_pairs)
            full = _plan_pairs(ring_plan(layout, rank, **kw))
            no_main_plan = ring_plan(layout, rank, main_queries=False, **kw)
            no_main = _plan_pairs(no_main_plan)
            only_trunk = _plan_pairs(ring_plan(trunk, rank, **kw))
            assert full == (no_main[0] + only_trunk[0], no_main[1] + only_trunk[1]), (name, rank)
            Lb = layout.local_branch_tokens(rank)
            assert no_main_plan.main_rows == 0 and all(t.q1 <= Lb for m in no_main_plan.ring_masks for t in m.tiles)
            allowed = int(branch_rows[layout.local_branch_token_index(rank)].sum())
            assert no_main[1] == allowed, (name, rank)
            if tile_cost_pairs == 0:
                assert no_main[0] == allowed, (name, rank, no_main[0], allowed)


def test_no_main_queries_on_the_drafters_workload_skip_the_trunk():
    # One sequence of 4096 tokens with 4 DFlash blocks of 16 (the issue's numbers): the trunk is
    # 4096 * 4097 / 2 pairs, the blocks at most 4 * 16 * (4096 + 16); q=None computes only the latter.
    cu = cu_seqlens_from_lengths([4096])
    layout = dflash_layout(cu, [1000, 2000, 3000, 4000], 16)
    full = _plan_pairs(ring_plan(layout, 0, tile_cost_pairs=0))
    no_main = _plan_pairs(ring_plan(layout, 0, tile_cost_pairs=0, main_queries=False))
    branch = 16 * (1000 + 2000 + 3000 + 4000) + 4 * 16 * 16
    assert no_main == (branch, branch)
    assert full[0] == branch + 4096 * 4097 // 2
