"""Cases for the CP branch-attention tests, and the per-rank worker that runs all of them.

Every rank builds the same layout and the same global tensors from a seed, computes the dense
oracle on the full tensors (fp64), runs cp_branch_attention on its zigzag shard, and compares its
local outputs and gradients with the oracle's rows for that shard. The loss weights are random on
padding rows too, so any leak of padding into an output or gradient shows up as an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from cotrain.parallel import (
    BranchLayout,
    CPStats,
    TorchBlockKernel,
    anchor_owner,
    branch_attention_mask,
    cp_branch_attention,
    cu_seqlens_from_lengths,
    default_kernel,
    dense_branch_attention,
    dflash_layout,
    dspark_layout,
    eagle3_ttt_layout,
    sample_anchors,
    shard_branches,
    zigzag_shard,
)

UNEVEN = [13, 3, 29, 1, 8]  # includes sequences shorter than 2C at CP = 2 and 4


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # main | eagle3 | dflash | dspark | custom
    window: Optional[int] = None
    heads: tuple[int, int] = (4, 2)  # (query heads, key/value heads)
    dtype: str = "float32"
    max_tile: int = 1024
    seqlens: tuple[int, ...] = tuple(UNEVEN)
    seed: int = 0
    lse_grad: bool = True  # False: the loss ignores the LSEs, so the fused kernels run the backward too
    kernel: str = "default"  # "torch": the plain TorchBlockKernel for every tile; "exact", "exact_torch":
    # the default / torch kernel with tile_cost_pairs = 0, so the plan gives every branch exact tiles
    grad_comm: Optional[str] = None  # grad_comm_dtype of cp_branch_attention (None: the accumulation dtype)


CASES = [
    Case("main", "main"),
    Case("main_window", "main", window=5, max_tile=4),
    Case("eagle3", "eagle3"),
    Case("eagle3_window_tiles", "eagle3", window=4, max_tile=5),
    Case("dflash", "dflash"),
    Case("dflash_window", "dflash", window=6),
    Case("dflash_mha_tiles", "dflash", heads=(2, 2), max_tile=3),
    Case("dspark", "dspark", seed=3),
    Case("custom_inclusive_full_window", "custom", window=3, seed=5),
    Case("main_window_fused_bwd", "main", window=5, lse_grad=False, max_tile=6),
    Case("dflash_fused_bwd", "dflash", lse_grad=False, seed=4),
    Case("eagle3_torch_kernel", "eagle3", window=4, kernel="torch", max_tile=6, seed=6),
    Case("bf16_dflash", "dflash", dtype="bfloat16", seed=1),
    Case("bf16_eagle3_window", "eagle3", window=6, dtype="bfloat16", seed=2),
    Case("bf16_main_fused_bwd", "main", dtype="bfloat16", lse_grad=False, seed=3),
    # The same inputs as bf16_dflash / dflash, with dK/dV sent around the ring in bf16.
    Case("bf16_dflash_bf16_grad_comm", "dflash", dtype="bfloat16", seed=1, grad_comm="bfloat16"),
    Case("dflash_bf16_grad_comm", "dflash", grad_comm="bfloat16"),
    # Exact tiles everywhere: per-branch full tiles and repeat_causal staircases (fused and torch paths).
    Case("eagle3_all_exact", "eagle3_all", kernel="exact", lse_grad=False, seed=8),
    Case("eagle3_all_exact_lse", "eagle3_all", kernel="exact", max_tile=8, seed=9),
    Case("eagle3_exact_torch", "eagle3", kernel="exact_torch", seed=10),
    Case("dflash_all_exact", "dflash_all", kernel="exact", lse_grad=False, seed=11),
    Case("dflash_exact_window", "dflash", kernel="exact", window=5, lse_grad=False, seed=12),
    Case("bf16_eagle3_all_exact", "eagle3_all", kernel="exact", dtype="bfloat16", lse_grad=False, seed=13),
    Case("fp16_dflash", "dflash", dtype="float16", seed=3),
    # fp64 end to end: the oracle's own precision.
    Case("fp64_dflash_window", "dflash", window=6, dtype="float64", seed=2),
    Case("fp64_eagle3_tiles", "eagle3", dtype="float64", max_tile=5, seed=7),
]

HEAD_DIM = 8


def make_layout(case: Case, cp_size: int) -> BranchLayout:
    g = torch.Generator().manual_seed(1000 + case.seed)
    cu = cu_seqlens_from_lengths(list(case.seqlens))
    if case.family == "main":
        return BranchLayout(cu, [], [], window=case.window, cp_size=cp_size)
    if case.family == "eagle3":
        # TTT with 3 passes at a random half of the positions (plus every sequence's first one).
        T = int(cu[-1])
        pick = torch.randperm(T, generator=g)[: T // 2]
        positions = torch.unique(torch.cat([pick, cu[:-1]]))
        return eagle3_ttt_layout(cu, 3, positions=positions, window=case.window, cp_size=cp_size)
    if case.family == "eagle3_all":  # a chain at every position: staircases of consecutive anchors
        return eagle3_ttt_layout(cu, 4, window=case.window, cp_size=cp_size)
    if case.family == "dflash":
        return dflash_layout(cu, sample_anchors(cu, 3, g), 4, window=case.window, cp_size=cp_size)
    if case.family == "dflash_last_rank":
        # Blocks only at positions the last rank holds: every other rank owns no branch (at CP > 1),
        # yet holds trunk keys those blocks see (its dK/dV come back over the ring).
        T = int(cu[-1])
        mine = torch.nonzero(anchor_owner(cu, torch.arange(T), cp_size) == cp_size - 1).squeeze(1)
        pick = mine[torch.randperm(mine.numel(), generator=g)[: 2 * (len(case.seqlens))]]
        return dflash_layout(cu, torch.sort(pick).values, 3, window=case.window, cp_size=cp_size)
    if case.family == "dflash_all":  # a block at every position (the drafters' acceptance estimate)
        return dflash_layout(cu, torch.arange(int(cu[-1])), 3, window=case.window, cp_size=cp_size)
    if case.family == "dspark":
        # Include anchors at sequence starts: an exclusive block there sees no context at all.
        anchors = torch.unique(torch.cat([sample_anchors(cu, 2, g), cu[:-1]]))
        return dspark_layout(cu, anchors, 3, window=case.window, cp_size=cp_size)
    if case.family == "custom":
        # Inclusive context, full intra, uneven branch lengths, branches in random order.
        anchors = sample_anchors(cu, 3, g)
        order = torch.randperm(anchors.numel(), generator=g)
        lens = torch.randint(1, 6, (anchors.numel(),), generator=g)
        return BranchLayout(cu, anchors[order], lens, context="inclusive", intra="full",
                            window=case.window, cp_size=cp_size)
    raise ValueError(case.family)


def make_inputs(case: Case, layout: BranchLayout):
    g = torch.Generator().manual_seed(case.seed)
    H, Hk = case.heads
    T, NBt = layout.total_len, layout.total_branch_tokens
    shapes = [(T, H), (T, Hk), (T, Hk), (NBt, H), (NBt, Hk), (NBt, Hk)]
    tensors = [torch.randn(n, h, HEAD_DIM, generator=g, dtype=torch.float64) for n, h in shapes]
    dtype = getattr(torch, case.dtype)
    # Round to the compute dtype once, so the oracle sees exactly the CP inputs.
    tensors = [t.to(dtype).to(torch.float64) for t in tensors]
    weights = [  # loss weights for out, lse, bout, blse
        torch.randn(T, H, HEAD_DIM, generator=g, dtype=torch.float64),
        torch.randn(T, H, generator=g, dtype=torch.float64),
        torch.randn(NBt, H, HEAD_DIM, generator=g, dtype=torch.float64),
        torch.randn(NBt, H, generator=g, dtype=torch.float64),
    ]
    if not case.lse_grad:
        weights[1].zero_()
        weights[3].zero_()
    return tensors, weights


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _max_excess(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> float:
    """max(|a - b| - rtol |b|): the absolute error beyond the relative allowance (TE's allclose rule)."""
    if not a.numel():
        return 0.0
    a, b = a.double(), b.double()
    return float(((a - b).abs() - rtol * b.abs()).max())


def run_case(case: Case, rank: int, cp_size: int, group=None) -> dict:
    layout = make_layout(case, cp_size)
    (q, k, v, bq, bk, bv), (w_out, w_lse, w_bout, w_blse) = make_inputs(case, layout)

    ref_in = [t.clone().requires_grad_() for t in (q, k, v, bq, bk, bv)]
    ref = dense_branch_attention(*ref_in, layout)
    sum((r * w).sum() for r, w in zip(ref, (w_out, w_lse, w_bout, w_blse))).backward()

    dtype = getattr(torch, case.dtype)
    real = layout.zigzag_index(rank) >= 0

    def main_shard(x, pad_fill: Optional[torch.Generator] = None):
        s = zigzag_shard(x, layout, rank)
        if pad_fill is not None:  # random values on padding rows: they must have no effect
            s[~real] = torch.randn(s[~real].shape, generator=pad_fill, dtype=s.dtype)
        return s

    gpad = torch.Generator().manual_seed(77 + rank)
    local = [main_shard(t, gpad).to(dtype) for t in (q, k, v)]
    local += [shard_branches(t, layout, rank).to(dtype) for t in (bq, bk, bv)]
    local = [t.requires_grad_() for t in local]
    stats = CPStats()
    kernel = _kernel(case)
    grad_comm = getattr(torch, case.grad_comm) if case.grad_comm else None
    out = cp_branch_attention(*local, layout, group, stats=stats, max_tile=case.max_tile, kernel=kernel,
                              grad_comm_dtype=grad_comm)
    local_w = [main_shard(w_out, gpad), main_shard(w_lse, gpad),
               shard_branches(w_bout, layout, rank), shard_branches(w_blse, layout, rank)]
    sum((o.double() * w).sum() for o, w in zip(out, local_w)).backward()

    names = ["out", "lse", "bout", "blse"]
    expect = [main_shard(ref[0].detach()), main_shard(ref[1].detach()),
              shard_branches(ref[2].detach(), layout, rank), shard_branches(ref[3].detach(), layout, rank)]
    got = [out[0][real], out[1][real], out[2], out[3]]
    expect = [expect[0][real], expect[1][real], expect[2], expect[3]]
    for i, t in enumerate(ref_in[:3]):
        names.append("d" + "qkv"[i])
        got.append(local[i].grad[real])
        expect.append(main_shard(t.grad)[real])
    for i, t in enumerate(ref_in[3:]):
        names.append("db" + "qkv"[i])
        got.append(local[3 + i].grad)
        expect.append(shard_branches(t.grad, layout, rank))

    result = {"abs": {}, "excess": {}}
    for name, a, b in zip(names, got, expect):
        result["abs"][name] = _max_err(a, b)
        result["excess"][name] = _max_excess(a, b, 0.0, 2.5e-2)
    # Padding rows: zero output, -inf LSE, zero gradient.
    pad = ~real
    result["pad_out"] = float(out[0][pad].abs().max()) if pad.any() else 0.0
    result["pad_lse_all_neg_inf"] = bool(torch.isneginf(out[1][pad]).all()) if pad.any() else True
    result["pad_grad"] = max(float(t.grad[pad].abs().max()) if pad.any() else 0.0 for t in local[:3])
    result["stats"] = stats
    return result


# Cases run again without main queries (q=None): branch outputs and the gradients that flow from them.
NO_MAIN_CASES = [c for c in CASES if c.family != "main" and c.name in {
    "eagle3", "eagle3_window_tiles", "dflash", "dflash_window", "dflash_mha_tiles", "dspark",
    "custom_inclusive_full_window", "dflash_fused_bwd", "eagle3_torch_kernel", "bf16_dflash", "fp16_dflash",
    "dflash_bf16_grad_comm", "eagle3_all_exact", "eagle3_exact_torch", "dflash_all_exact", "dflash_exact_window",
    "fp64_dflash_window", "fp64_eagle3_tiles",
}] + [
    Case("dflash_last_rank", "dflash_last_rank", seed=14),
    Case("dflash_last_rank_exact", "dflash_last_rank", kernel="exact", lse_grad=False, seed=15),
    Case("dflash_last_rank_window_torch", "dflash_last_rank", window=4, kernel="torch", max_tile=5, seed=16),
    Case("no_branches", "main", seed=17),  # every rank owns no branch: empty outputs, zero dK/dV, no deadlock
]


def _kernel(case: Case):
    kernel = {"default": None, "torch": TorchBlockKernel(), "exact": default_kernel(), "exact_torch": TorchBlockKernel()}[case.kernel]
    if case.kernel.startswith("exact"):
        kernel.tile_cost_pairs = 0
    return kernel


def run_case_no_main(case: Case, rank: int, cp_size: int, group=None) -> dict:
    """cp_branch_attention(q=None, ...) against the oracle's branch rows, the loss on branch outputs only."""
    layout = make_layout(case, cp_size)
    (q, k, v, bq, bk, bv), (_, _, w_bout, w_blse) = make_inputs(case, layout)
    H, Hk = case.heads
    ref_in = [t.clone().requires_grad_() for t in (q, k, v, bq, bk, bv)]
    ref = dense_branch_attention(*ref_in, layout)
    ((ref[2] * w_bout).sum() + (ref[3] * w_blse).sum()).backward()

    dtype = getattr(torch, case.dtype)
    real = layout.zigzag_index(rank) >= 0
    gpad = torch.Generator().manual_seed(78 + rank)

    def main_shard(x):
        s = zigzag_shard(x, layout, rank)
        s[~real] = torch.randn(s[~real].shape, generator=gpad, dtype=s.dtype)  # must stay inert
        return s

    local = [main_shard(t).to(dtype) for t in (k, v)]
    # Branch tensors always (0 rows on a rank that owns no branch): q=None takes them as the queries.
    local += [shard_branches(t, layout, rank).reshape(-1, *t.shape[1:]).to(dtype) for t in (bq, bk, bv)]
    local = [t.requires_grad_() for t in local]
    stats = CPStats()
    grad_comm = getattr(torch, case.grad_comm) if case.grad_comm else None
    out, lse, bout, blse = cp_branch_attention(None, *local, layout, group, stats=stats, max_tile=case.max_tile,
                                               kernel=_kernel(case), grad_comm_dtype=grad_comm)
    w = [shard_branches(w_bout, layout, rank).reshape(-1, H, HEAD_DIM), shard_branches(w_blse, layout, rank).reshape(-1, H)]
    ((bout.double() * w[0]).sum() + (blse.double() * w[1]).sum()).backward()

    names = ["bout", "blse", "dk", "dv", "dbq", "dbk", "dbv"]
    got = [bout.detach(), blse.detach(), local[0].grad[real], local[1].grad[real], local[2].grad, local[3].grad,
           local[4].grad]
    expect = [shard_branches(ref[2].detach(), layout, rank), shard_branches(ref[3].detach(), layout, rank),
              zigzag_shard(ref_in[1].grad, layout, rank)[real], zigzag_shard(ref_in[2].grad, layout, rank)[real]]
    expect += [shard_branches(t.grad, layout, rank) for t in ref_in[3:]]
    result = {"abs": {}, "excess": {}, "main_is_none": out is None and lse is None}
    for name, a, b in zip(names, got, expect):
        b = b.reshape(a.shape)
        result["abs"][name] = _max_err(a, b)
        result["excess"][name] = _max_excess(a, b, 0.0, 2.5e-2)
    pad = ~real
    result["pad_grad"] = max(float(t.grad[pad].abs().max()) if pad.any() else 0.0 for t in local[:2])
    result["local_branch_tokens"] = layout.local_branch_tokens(rank)
    result["dkv_nonzero"] = bool(local[0].grad.abs().sum() > 0)
    # The pairs the oracle's mask allows the rank's branch queries (trunk keys + own block).
    T = layout.total_len
    rows = T + layout.local_branch_token_index(rank)
    result["oracle_pairs"] = int(branch_attention_mask(layout.with_cp(1))[rows].sum())
    result["stats"] = stats
    return result


# ----- byte counts and balance ---------------------------------------------------------------------

def bytes_case(rank: int, cp_size: int, num_blocks: int, block_size: int, dtype: str, grad_comm: Optional[str] = None,
               group=None) -> CPStats:
    """Forward + backward on fixed main sequences with a varying number/depth of DFlash branches."""
    cu = cu_seqlens_from_lengths([21, 7, 40])
    g = torch.Generator().manual_seed(9)
    anchors = sample_anchors(cu, num_blocks, g) if num_blocks else torch.zeros(0, dtype=torch.int64)
    layout = dflash_layout(cu, anchors, block_size, cp_size=cp_size)
    H, Hk = 4, 2
    dt = getattr(torch, dtype)
    L, Lb = layout.local_len, layout.local_branch_tokens(rank)
    ts = [torch.randn(n, h, HEAD_DIM, dtype=dt, requires_grad=True)
          for n, h in [(L, H), (L, Hk), (L, Hk), (Lb, H), (Lb, Hk), (Lb, Hk)]]
    stats = CPStats()
    out = cp_branch_attention(*ts, layout, group, stats=stats,
                              grad_comm_dtype=getattr(torch, grad_comm) if grad_comm else None)
    sum(o.float().sum() for o in out).backward()
    stats.local_len = L  # type: ignore[attr-defined]
    return stats


def balance_case(rank: int, cp_size: int, with_branches: bool, group=None) -> CPStats:
    """Equal-length sequences; with_branches adds DFlash blocks at every 4th position."""
    seqlens = [64, 64, 64]
    cu = cu_seqlens_from_lengths(seqlens)
    if with_branches:
        anchors = torch.cat([torch.arange(int(cu[s]) + 1, int(cu[s + 1]), 4) for s in range(len(seqlens))])
        layout = dflash_layout(cu, anchors, 4, cp_size=cp_size)
    else:
        layout = BranchLayout(cu, [], [], cp_size=cp_size)
    L, Lb = layout.local_len, layout.local_branch_tokens(rank)
    ts = [torch.randn(n, 2, HEAD_DIM) for n in (L, L, L, Lb, Lb, Lb)]
    stats = CPStats()
    with torch.no_grad():
        cp_branch_attention(*ts, layout, group, stats=stats, max_tile=8)
    return stats


def error_cases(rank: int, cp_size: int, group=None) -> dict:
    """The messages cp_branch_attention gives for a wrong CP size and wrong branch tensor sizes."""
    layout = dflash_layout(cu_seqlens_from_lengths(UNEVEN), [2, 20, 40], 3, cp_size=cp_size)
    L, Lb = layout.local_len, layout.local_branch_tokens(rank)
    msgs = {}
    ts = [torch.zeros(n, 2, HEAD_DIM) for n in (L, L, L, Lb, Lb, Lb)]
    try:
        cp_branch_attention(*ts, layout.with_cp(cp_size + 1), group)
    except ValueError as e:
        msgs["cp_size"] = str(e)
    bad = ts[:3] + [torch.zeros(Lb + 1, 2, HEAD_DIM)] + ts[4:]
    try:
        cp_branch_attention(*bad, layout, group)
    except ValueError as e:
        msgs["bq"] = str(e)
    return msgs


def worker(rank: int, cp_size: int, cases: list[Case] = CASES) -> dict:
    """Everything the tests need from one CP degree, in one process group."""
    results = {"cases": {}, "bytes": {}, "bytes_bf16_grad_comm": {}, "balance": {}}
    for case in cases:
        results["cases"][case.name] = run_case(case, rank, cp_size)
    results["no_main"] = {case.name: run_case_no_main(case, rank, cp_size) for case in NO_MAIN_CASES}
    for num_blocks, block_size in [(0, 1), (1, 4), (3, 4), (6, 16)]:
        for dtype in ("float32", "bfloat16", "float64"):
            results["bytes"][(num_blocks, block_size, dtype)] = bytes_case(rank, cp_size, num_blocks, block_size, dtype)
        for dtype in ("float32", "bfloat16"):
            results["bytes_bf16_grad_comm"][(num_blocks, block_size, dtype)] = bytes_case(
                rank, cp_size, num_blocks, block_size, dtype, "bfloat16")
    for with_branches in (False, True):
        results["balance"][with_branches] = balance_case(rank, cp_size, with_branches)
    results["errors"] = error_cases(rank, cp_size)
    return results
