"""Per-rank work of a layout under zigzag CP, and anchor sampling that keeps it even.

Work model (query-key pairs the attention rule makes visible; cp_branch_attention computes these
plus the masked remainder of its tiles):
    main query at position p:  min(p + 1, w) keys                     (w = window, inf without one)
    branch b (W_b tokens):     W_b * min(c_b + 1, w)  trunk keys       (c_b: last visible position)
                             + W_b^2 (intra="full")  or  W_b (W_b + 1) / 2 (intra="causal")
and rank r's work is the sum over its main rows and the branches it owns (the rank holding the
anchor). Zigzag sharding makes the main part even; the branch part depends on where the anchors fall.

Balanced sampling. Branches stay on their anchor's rank, so the balance is decided when anchors are
drawn. balanced_anchors draws `per_seq` anchors per sequence among given candidate positions,
stratified by owning rank: it walks the sequences longest first and gives each draw to the rank
with the least work so far (main work plus the branches drawn; ties broken at random), which then
takes one of its own candidates in that sequence uniformly at random. Greedy list scheduling in
decreasing job size: the ranks' work ends within about one branch of the shortest sequences of
each other (as far as the candidates allow).
Within a rank every candidate is equally likely; across ranks a sequence's draws follow the work,
not the candidate counts (with candidates spread evenly over a sequence, the zigzag gives every
rank the same share, and each candidate's chance is per_seq / (number of candidates), as for
uniform sampling). Only the generator is random, so every CP rank draws the same anchors from the
same seed.
"""

from __future__ import annotations

from typing import Optional

import torch

from cotrain.parallel import zigzag
from cotrain.parallel.layout import CONTEXT_RULES, BranchLayout, IntLike, _as_index_tensor


def _visible(last: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """Trunk keys seen by a query whose last visible position is `last` (-1: none)."""
    n = last + 1
    return n if window is None else n.clamp(max=window)


def rank_work(layout: BranchLayout) -> torch.Tensor:
    """(C,) int64: visible query-key pairs per rank (the module docstring's work model)."""
    C, w = layout.cp_size, layout.window
    pos = torch.cat([torch.arange(int(n)) for n in layout.seqlens]) if layout.total_len else torch.zeros(0, dtype=torch.int64)
    owner = zigzag.anchor_owner(layout.cu_seqlens, torch.arange(layout.total_len), C)
    work = torch.zeros(C, dtype=torch.int64).index_add_(0, owner, _visible(pos, w))
    lens = layout.branch_lens
    intra = lens * (lens + 1) // 2 if layout.intra == "causal" else lens * lens
    branch = lens * _visible(layout.context_last, w) + intra
    return work.index_add_(0, layout.branch_owner, branch)


def work_imbalance(layout: BranchLayout) -> float:
    """max / mean of rank_work (1.0 = perfectly even)."""
    work = rank_work(layout).double()
    return float(work.max() / work.mean()) if float(work.sum()) else 1.0


def balanced_anchors(
    cu_seqlens: IntLike,
    candidates: Optional[IntLike],
    per_seq: int,
    cp_size: int,
    generator: Optional[torch.Generator] = None,
    *,
    block_size: int = 1,
    context: str = "exclusive",
    window: Optional[int] = None,
) -> torch.Tensor:
    """Up to `per_seq` distinct anchors per sequence among `candidates`, even work per CP rank.

    cu_seqlens (S+1,); candidates: packed positions that may be anchors (any order, duplicates
    ignored; None: every position); cp_size: the CP size the layout will be sharded for;
    generator: the only source of randomness (same seed -> same anchors on every rank);
    block_size, context, window: the branches' length and rule, for the work model (DFlash/DSpark:
    block_size = B, context="exclusive"; the defaults weigh a branch by its trunk context alone).
    A sequence with fewer than per_seq candidates gets all of them. Returns sorted packed positions.
    See the module docstring for the method and what it keeps of uniform sampling.
    """
    cu = _as_index_tensor("cu_seqlens", cu_seqlens)
    total = int(cu[-1])
    cand = torch.arange(total) if candidates is None else torch.unique(_as_index_tensor("candidates", candidates))
    if cand.numel() and (int(cand[0]) < 0 or int(cand[-1]) >= total):
        bad = int(cand[0]) if int(cand[0]) < 0 else int(cand[-1])
        raise ValueError(f"candidate {bad} lies outside the packed main sequence [0, {total})")
    if not isinstance(per_seq, int) or per_seq < 0:
        raise ValueError(f"per_seq must be an int >= 0, got {per_seq!r}")
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if context not in CONTEXT_RULES:
        raise ValueError(f"context must be one of {CONTEXT_RULES}, got {context!r}")

    seq = torch.searchsorted(cu, cand, right=True) - 1
    owner = zigzag.anchor_owner(cu, cand, cp_size)
    last = cand - cu[seq] - (1 if context == "exclusive" else 0)
    cost = (block_size * (_visible(last, window) + block_size)).tolist()
    seq_l, owner_l = seq.tolist(), owner.tolist()
    by_seq: dict[int, dict[int, list[int]]] = {}
    for i, (s, r) in enumerate(zip(seq_l, owner_l)):
        by_seq.setdefault(s, {}).setdefault(r, []).append(i)

    lengths = (cu[1:] - cu[:-1]).tolist()
    # Start from the main part's work, so the branches also even out what padding leaves uneven.
    load = rank_work(BranchLayout(cu, [], [], window=window, cp_size=cp_size)).tolist()
    picked: list[int] = []
    for s in sorted(by_seq, key=lambda s: (-lengths[s], s)):  # longest first
        pools = by_seq[s]
        for _ in range(min(per_seq, sum(len(p) for p in pools.values()))):
            ranks = [r for r in sorted(pools) if pools[r]]
            tie = torch.randperm(len(ranks), generator=generator).tolist()
            r = min(range(len(ranks)), key=lambda i: (load[ranks[i]], tie[i]))
            pool = pools[ranks[r]]
            i = pool.pop(int(torch.randint(len(pool), (1,), generator=generator)))
            load[ranks[r]] += cost[i]
            picked.append(int(cand[i]))
    return torch.sort(torch.tensor(picked, dtype=torch.int64)).values
