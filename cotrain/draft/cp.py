"""Drafter training under context parallelism: fetching the target rows each rank's chains need.

Under CP = C a rank holds the zigzag shard of the trunk (taps, target logits) and the branches
whose anchors it owns (:mod:`cotrain.parallel.zigzag`). A drafter forward on that rank
(``drafter(batch, layout, group)``) returns the chains of its anchors, and draft j of a chain is
supervised by the target distribution at packed row ``bonus + j`` - which may sit on another rank
when a chain crosses a chunk boundary. :func:`fetch_rows` brings exactly those rows:

1. each rank all-gathers the global row ids the others need (counts first, then the ids);
2. each owner sends its rows to each requester with point-to-point messages (what one rank sends
   is what the other receives: both sides derive the sizes from step 1);
3. rows a rank owns itself are copied locally.

The bytes moved are (rows needed from other ranks) x V x element size per rank: for EAGLE-3 about
(k - 1) rows per chunk boundary and chain, for block drafters up to B rows per block near a
boundary - small next to the ring's K/V traffic. Every rank must call it (it is collective).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from cotrain.parallel import BranchLayout, anchor_owner


def _local_index(layout: BranchLayout, rank: int) -> torch.Tensor:
    """(T,) local row of each global position on ``rank`` (-1 where another rank owns it)."""
    inv = torch.full((layout.total_len,), -1, dtype=torch.int64)
    idx = layout.zigzag_index(rank)
    real = idx >= 0
    inv[idx[real]] = torch.nonzero(real).squeeze(1)
    return inv


def fetch_rows(local: torch.Tensor, rows: torch.Tensor, layout: BranchLayout, group=None) -> torch.Tensor:
    """Values (len(rows), ...) of global packed rows ``rows`` from ``local`` (this rank's zigzag
    shard of a per-position tensor, layout.local_len rows). Rows may repeat or be -1 (zeros).

    Row indices are worked out on the host (as the layout); the values, and the index lists the ranks
    exchange, travel on ``local``'s device (the backend's: NCCL carries CUDA tensors only)."""
    C = layout.cp_size
    rank = dist.get_rank(group) if C > 1 else 0
    rows = torch.as_tensor(rows).to("cpu", torch.int64).reshape(-1)
    dev = local.device
    out = local.new_zeros((rows.numel(), *local.shape[1:]))
    valid = rows >= 0
    if C == 1:
        out[valid] = local[rows[valid]]
        return out
    want = torch.unique(rows[valid])
    owner = anchor_owner(layout.cu_seqlens, want, C)
    mine = _local_index(layout, rank)
    # 1. who needs what
    n = torch.tensor([want.numel()], dtype=torch.int64, device=dev)
    counts = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(C)]
    dist.all_gather(counts, n, group=group)
    width = int(max(c.item() for c in counts))
    padded = torch.full((width,), -1, dtype=torch.int64)
    padded[: want.numel()] = want
    lists = [torch.empty(width, dtype=torch.int64, device=dev) for _ in range(C)]
    dist.all_gather(lists, padded.to(dev), group=group)
    wanted_by = [lists[s][: int(counts[s])].cpu() for s in range(C)]
    # 2. point to point: send my rows to each requester, receive mine from each owner
    ops, recv_bufs = [], {}
    for s in range(C):
        if s == rank:
            continue
        theirs = wanted_by[s]
        send_rows = theirs[anchor_owner(layout.cu_seqlens, theirs, C) == rank]
        if send_rows.numel():
            ops.append(dist.P2POp(dist.isend, local[mine[send_rows]].contiguous(), _peer(s, group), group))
        from_s = want[owner == s]
        if from_s.numel():
            buf = local.new_empty((from_s.numel(), *local.shape[1:]))
            recv_bufs[s] = (from_s, buf)
            ops.append(dist.P2POp(dist.irecv, buf, _peer(s, group), group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    # 3. assemble
    table = local.new_zeros((want.numel(), *local.shape[1:]))
    own = owner == rank
    table[own] = local[mine[want[own]]]
    for s, (from_s, buf) in recv_bufs.items():
        table[torch.searchsorted(want, from_s)] = buf
    out[valid] = table[torch.searchsorted(want, rows[valid])]
    return out


def _peer(rank_in_group: int, group: Optional[dist.ProcessGroup]) -> int:
    return rank_in_group if group is None else dist.get_global_rank(group, rank_in_group)
