"""cp_branch_attention: branch attention (cotrain.parallel.layout's rule) on zigzag shards of a CP group.

Rank r holds the zigzag shard of the main q, k, v (cotrain.parallel.zigzag) and the q, k, v of the
branches whose anchors it holds. With Q_r = [main queries of r; branch queries of r]:

    forward:  for step t = 0 .. C-1:  (K, V) = main shard of rank (r - t) mod C, arriving over the ring
                 (out_r, lse_r) <- LSE-merge((out_r, lse_r), block(Q_r, K, V, mask for that shard))
              plus once, locally: branch queries x own branch K/V (intra rule, block-diagonal:
              each branch against its own block only, cotrain.parallel.blockdiag), merged the same way.

Only main K/V travel (each step sends one shard, C-1 steps), so the bytes a rank sends do not
depend on the number or depth of the branches (a = accumulation dtype, see below; g = grad_comm_dtype,
a by default):
    forward   (C-1) * 2 * local_len * Hk * D * sizeof(dtype)
    backward  (C-1) * 2 * local_len * Hk * D * sizeof(dtype)     K/V around the ring again
            + (C-1) * 2 * local_len * Hk * D * sizeof(g)          dK/dV travelling back
(0 for C = 1). In the backward, dQ stays where its query lives; the dK/dV of each main shard ride
the ring behind it (as in ring-flash-attention): the first visitor starts the sum, every later
visitor adds its part (in a) and the last one sends it home, where the owner adds its own part
(C-1 hops, not C: the owner's share never travels). Sent in g = bf16, a partial sum is rounded once
per hop. Branch dK/dV are local.

Accumulation dtype a: fp32 for fp32/bf16/fp16 inputs, fp64 for fp64 inputs (fp64 is computed in
fp64 end to end; other dtypes are refused). Partial results are merged in a; out is returned in
the inputs' dtype, lse in a. The LSE outputs are differentiable. Padding rows (see the zigzag
padding rule) get out = 0, lse = -inf and no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from cotrain.parallel.blockdiag import BlockDiagonal, compute_dtype
from cotrain.parallel.kernels import (
    CAUSAL,
    DEFAULT_TILE_COST_PAIRS,
    FULL,
    MASKED,
    REPEAT_CAUSAL,
    BlockKernel,
    BlockMask,
    Tile,
    default_kernel,
)
from cotrain.parallel.layout import BranchLayout
from cotrain.parallel.lse import merge_lse_
from cotrain.parallel.ring import RingComm, group_rank_and_size

DEFAULT_MAX_TILE = 256  # tile rows/cols: small enough to skip most masked work, big enough for matmul
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass
class CPStats:
    """Counters one can pass to cp_branch_attention (they accumulate over calls)."""

    bytes_sent_forward: int = 0
    bytes_sent_backward: int = 0
    pairs_computed: int = 0  # forward query-key pairs inside computed tiles (ring + branch-local)
    pairs_allowed: int = 0  # forward query-key pairs the mask makes visible
    calls: int = 0


# ----- the plan: per (layout, rank) metadata and tiles ------------------------------------------------

@dataclass
class _QueryRun:
    seq: int
    q0: int
    q1: int
    hi_min: int
    hi_max: int
    lo_min: int
    lo_max: int
    piece: Optional[tuple[int, int]] = None  # main queries: positions [start, stop); None for branches
    branches: tuple = ()  # branch groups: (row0, row1, lo, hi) per branch; its tokens see trunk positions [lo, hi]


@dataclass
class _KeyRun:
    seq: int
    k0: int
    k1: int
    p0: int
    p1: int


@dataclass
class RingPlan:
    """Everything cp_branch_attention needs besides the tensors; cached on the layout."""

    cp_size: int
    rank: int
    local_len: int
    local_branch_tokens: int
    ring_masks: list[BlockMask]  # indexed by the rank whose main K/V shard the block holds
    intra_mask: Optional[BlockMask]  # branch-local attention as one exact tile per branch
    intra_blocks: Optional[BlockDiagonal] = None  # the same, batched per branch length (what runs)
    main_queries: bool = True  # False: query rows are the branch tokens only (no main query tiles)

    @property
    def main_rows(self) -> int:
        """Query rows before the branch rows: local_len with main queries, 0 without."""
        return self.local_len if self.main_queries else 0


def _split(start: int, stop: int, max_tile: int):
    for a in range(start, stop, max_tile):
        yield a, min(a + max_tile, stop)


def _window_lo(hi: int, window: Optional[int]) -> int:
    return 0 if window is None else hi - window + 1


def _coalesce(tiles: list[Tile], max_tile: int) -> list[Tile]:
    """Merge tiles of the same kind (full or masked) that share their rows and abut along keys, then
    those that share their keys and abut along rows, up to max_tile: the union covers exactly the
    same pairs, and fewer, larger tiles cost less dispatch. (Causal tiles stay diagonal.)"""

    def merge(tiles, along_keys):
        key = (lambda t: (t.q0, t.q1, t.k0)) if along_keys else (lambda t: (t.k0, t.k1, t.q0))
        out: list[Tile] = []
        for t in sorted(tiles, key=key):
            last = out[-1] if out else None
            if last is not None and last.kind == t.kind and t.kind in (FULL, MASKED):
                if along_keys and (last.q0, last.q1, last.k1) == (t.q0, t.q1, t.k0) and t.k1 - last.k0 <= max_tile:
                    out[-1] = Tile(t.q0, t.q1, last.k0, t.k1, t.kind)
                    continue
                if not along_keys and (last.k0, last.k1, last.q1) == (t.k0, t.k1, t.q0) and t.q1 - last.q0 <= max_tile:
                    out[-1] = Tile(last.q0, t.q1, t.k0, t.k1, t.kind)
                    continue
            out.append(t)
        return out

    return sorted(merge(merge(tiles, True), False), key=lambda t: (t.q0, t.k0))


def _branch_tiles(qr: _QueryRun, kr: _KeyRun, window: Optional[int], tile_cost: int) -> list[Tile]:
    """Tiles of a branch group against a key run that some of its branches see only in part.

    Every token of branch b sees the same trunk keys, [lo_b, hi_b] (its context, window included),
    so its part of the run is one interval, and no tile needs a pair it cannot see:
    - a staircase, i.e. consecutive branches of equal length W whose hi step up by one inside the
      run (EAGLE-3 TTT chains; DFlash blocks at every position), without a window: keys
      [p0, hi_first) full and [hi_first, hi_last] repeat_causal with rep = W (two tiles in all);
    - any other branch that sees part of the run: a full tile of exactly that part;
    - branches that see all of the run share full tiles.
    Where separate tiles would save no more than `tile_cost` pairs (the kernel's price of one more
    tile, BlockKernel.tile_cost_pairs), the branches share a masked tile instead.
    """
    m = kr.p1 - kr.p0
    tiles: list[Tile] = []
    shared: list[list] = []  # [row0, row1, every branch sees the whole run]
    stair: list[tuple[int, int, int]] = []  # (row0, row1, hi) of the staircase being collected

    def share(r0, r1, whole):
        if shared and shared[-1][1] == r0:
            shared[-1][1], shared[-1][2] = r1, shared[-1][2] and whole
        else:
            shared.append([r0, r1, whole])

    def alone(r0, r1, a, b):
        if (r1 - r0) * (m - (b - a)) > tile_cost:
            tiles.append(Tile(r0, r1, kr.k0 + a - kr.p0, kr.k0 + b - kr.p0, FULL))
        else:
            share(r0, r1, False)

    def flush():
        if len(stair) > 1:
            (r0, _, h0), (_, r1, h1) = stair[0], stair[-1]
            if (r1 - r0) * m - (stair[0][1] - r0) * sum(h + 1 - kr.p0 for _, _, h in stair) > tile_cost:
                if h0 > kr.p0:
                    tiles.append(Tile(r0, r1, kr.k0, kr.k0 + h0 - kr.p0, FULL))
                tiles.append(Tile(r0, r1, kr.k0 + h0 - kr.p0, kr.k0 + h1 + 1 - kr.p0, REPEAT_CAUSAL, stair[0][1] - r0))
            else:
                share(r0, r1, False)
        elif stair:
            r0, r1, h = stair[0]
            alone(r0, r1, kr.p0, h + 1)
        stair.clear()

    for r0, r1, lo, hi in qr.branches:
        a, b = max(lo, kr.p0), min(hi + 1, kr.p1)
        if b <= a or b - a == m:
            flush()
            if b - a == m:
                share(r0, r1, True)
        elif window is not None:
            alone(r0, r1, a, b)
        elif stair and stair[-1][1] == r0 and r1 - r0 == stair[-1][1] - stair[-1][0] and hi == stair[-1][2] + 1:
            stair.append((r0, r1, hi))
        else:
            flush()
            stair.append((r0, r1, hi))
    flush()
    return tiles + [Tile(r0, r1, kr.k0, kr.k1, FULL if whole else MASKED) for r0, r1, whole in shared]


def _key_runs(layout: BranchLayout, rank: int, max_tile: int) -> list[_KeyRun]:
    runs = []
    for r in layout.zigzag_runs(rank):
        for p0, p1 in _split(r.start, r.real_stop, max_tile):  # padding keys can never be visible
            off = r.local_start + (p0 - r.start)
            runs.append(_KeyRun(r.seq, off, off + (p1 - p0), p0, p1))
    return runs


def _build_plan(layout: BranchLayout, rank: int, device: torch.device, max_tile: int, tile_cost: int,
                main_queries: bool = True) -> RingPlan:
    C, w = layout.cp_size, layout.window
    T = layout.local_len
    base = T if main_queries else 0  # first branch query row

    # Main queries: hi = own position, lo = hi - w + 1; padding rows see nothing (hi = -1).
    # Without main queries (main_queries=False) the query rows are the branch tokens alone.
    seg, lo, hi = (torch.empty(base, dtype=torch.int64) for _ in range(3))
    qruns: list[_QueryRun] = []
    for r in layout.zigzag_runs(rank) if main_queries else ():
        rows = slice(r.local_start, r.local_start + (r.stop - r.start))
        pos = torch.arange(r.start, r.stop)
        real = pos < r.real_stop
        seg[rows] = r.seq
        hi[rows] = torch.where(real, pos, torch.full_like(pos, -1))
        lo[rows] = torch.where(real, pos - (w - 1), torch.zeros_like(pos)) if w is not None else 0
        for p0, p1 in _split(r.start, r.real_stop, max_tile):
            off = r.local_start + (p0 - r.start)
            qruns.append(_QueryRun(r.seq, off, off + p1 - p0, p0, p1 - 1, _window_lo(p0, w), _window_lo(p1 - 1, w), (p0, p1)))

    # Branch queries: every token of branch b has hi = c_b (its last visible context position).
    ids = layout.local_branches(rank)
    lens = layout.branch_lens[ids]
    NBt = int(lens.sum())
    b_seq, b_last = layout.branch_seqs[ids], layout.context_last[ids]
    b_seg = torch.repeat_interleave(b_seq, lens)
    b_hi = torch.repeat_interleave(b_last, lens)
    b_lo = b_hi - (w - 1) if w is not None else torch.zeros_like(b_hi)
    # Group consecutive branches whose anchors share a sequence and a zigzag chunk (at most max_tile
    # positions wide), up to max_tile rows: tight visibility bounds, few tiles.
    span = layout.padded_seqlens[b_seq] // (2 * C) if C > 1 else layout.seqlens[b_seq]
    span = span.clamp(max=max_tile)
    group_key = list(zip(b_seq.tolist(), (layout.anchor_positions[ids] // span).tolist()))
    offs = [0] + torch.cumsum(lens, 0).tolist()
    start = 0
    for i in range(len(group_key) + 1):
        if i == len(group_key) or (
            i > start and (group_key[i] != group_key[start] or offs[i + 1] - offs[start] > max_tile)
        ):
            if i > start:
                his, los = b_last[start:i], b_lo[offs[start] : offs[i]]
                members = tuple((base + offs[b], base + offs[b + 1], int(b_lo[offs[b]]), int(b_last[b])) for b in range(start, i))
                qruns.append(_QueryRun(group_key[start][0], base + offs[start], base + offs[i], int(his.min()),
                                       int(his.max()), int(los.min()), int(los.max()), None, members))
            start = i

    q_seg = torch.cat([seg, b_seg])
    q_lo = torch.cat([lo, b_lo])
    q_hi = torch.cat([hi, b_hi])

    by_seq: dict[int, list[_QueryRun]] = {}
    for qr in qruns:
        by_seq.setdefault(qr.seq, []).append(qr)

    ring_masks = []
    for src in range(C):
        k_seg = torch.empty(T, dtype=torch.int64)
        k_pos = torch.empty(T, dtype=torch.int64)
        for r in layout.zigzag_runs(src):
            rows = slice(r.local_start, r.local_start + (r.stop - r.start))
            k_seg[rows] = r.seq
            k_pos[rows] = torch.arange(r.start, r.stop)
        tiles = []
        for kr in _key_runs(layout, src, max_tile):
            for qr in by_seq.get(kr.seq, ()):
                if kr.p0 > qr.hi_max or kr.p1 - 1 < qr.lo_min:
                    continue  # nothing visible
                if qr.hi_min >= kr.p1 - 1 and qr.lo_max <= kr.p0:
                    kind = FULL
                elif src == rank and qr.piece == (kr.p0, kr.p1):
                    kind = CAUSAL
                elif qr.branches:
                    tiles += _branch_tiles(qr, kr, w, tile_cost)
                    continue
                else:
                    kind = MASKED
                tiles.append(Tile(qr.q0, qr.q1, kr.k0, kr.k1, kind))
        tiles = _coalesce(tiles, max_tile)
        ring_masks.append(BlockMask(tiles, q_seg, q_lo, q_hi, k_seg, k_pos, w).to(device))

    # Branch-local attention: each branch against its own block only (block-diagonal, exact).
    intra_mask = intra_blocks = None
    if NBt:
        causal = layout.intra == "causal"
        intra_blocks = BlockDiagonal.from_lengths(lens, causal, device)
        local_id = torch.repeat_interleave(torch.arange(ids.numel()), lens)
        j = torch.arange(NBt) - torch.repeat_interleave(torch.tensor(offs[:-1], dtype=torch.int64), lens)
        j_hi = j if causal else torch.repeat_interleave(lens - 1, lens)
        kind = CAUSAL if causal else FULL
        tiles = [Tile(a, b, a, b, kind) for a, b in zip(offs[:-1], offs[1:])]
        intra_mask = BlockMask(tiles, local_id, torch.zeros_like(j), j_hi, local_id, j, None).to(device)

    return RingPlan(C, rank, T, NBt, ring_masks, intra_mask, intra_blocks, main_queries)


def ring_plan(
    layout: BranchLayout, rank: int, device: torch.device | str = "cpu", max_tile: int = DEFAULT_MAX_TILE,
    tile_cost_pairs: int = DEFAULT_TILE_COST_PAIRS, main_queries: bool = True,
) -> RingPlan:
    """The (cached) plan of rank `rank` for `layout`; tile_cost_pairs: see _branch_tiles (0: every tile exact).

    main_queries=False: the plan of a call without main queries (q=None): its query rows are the
    rank's branch tokens only (row 0 = its first branch token), so there is no main query tile; the
    branch tiles are the full plan's (shifted by local_len rows; only coalescing with main tiles differs)."""
    device = torch.device(device)
    key = ("plan", rank, str(device), max_tile, tile_cost_pairs, bool(main_queries))
    if key not in layout._cache:
        layout._check_rank(rank)
        layout._cache[key] = _build_plan(layout, rank, device, max_tile, tile_cost_pairs, bool(main_queries))
    return layout._cache[key]


# ----- autograd ----------------------------------------------------------------------------------

def _intra_forward(kernel: BlockKernel, bq, bk, bv, plan: RingPlan, scale: float):
    """Branch-local attention: the kernel's block-diagonal path, or one tile per branch."""
    fwd = getattr(kernel, "forward_blocks", None)
    if fwd is not None:
        return fwd(bq, bk, bv, plan.intra_blocks, scale)
    return kernel.forward(bq, bk, bv, plan.intra_mask, scale)


def _intra_backward(kernel: BlockKernel, dout, bq, bk, bv, out, lse, plan: RingPlan, scale: float, dlse):
    bwd = getattr(kernel, "backward_blocks", None)
    if bwd is not None:
        return bwd(dout, bq, bk, bv, out, lse, plan.intra_blocks, scale, dlse)
    return kernel.backward(dout, bq, bk, bv, out, lse, plan.intra_mask, scale, dlse)


class _CPBranchAttention(torch.autograd.Function):
    """The ring (module docstring). q is None when plan.main_queries is False: the query rows are
    then the branch tokens alone, the outputs are (bout, blse) and no main query tile is computed.
    The K/V (forward) and dK/dV (backward) still travel the whole ring, on every rank, whatever its
    number of branches (zero included): every rank takes part in every exchange."""

    @staticmethod
    def forward(ctx, q, k, v, bq, bk, bv, plan: RingPlan, group, kernel: BlockKernel, scale: float, stats,
                grad_comm_dtype):
        C, rank, M = plan.cp_size, plan.rank, plan.main_rows
        ctype = compute_dtype(k.dtype)
        q_all = bq if q is None else (torch.cat([q, bq]) if bq.shape[0] else q)
        out = torch.zeros(q_all.shape, dtype=ctype, device=k.device)
        lse = torch.full(q_all.shape[:2], float("-inf"), dtype=ctype, device=k.device)
        kv = torch.stack([k, v])
        comm = RingComm(group, tag=0) if C > 1 else None
        kv_recv = [torch.empty_like(kv) for _ in range(2)] if C > 1 else None  # one in flight, one in use
        for step in range(C):
            if step + 1 < C:
                next_kv = comm.send_recv(kv, kv_recv[step % 2])
                comm.commit()
            src = (rank - step) % C
            mask = plan.ring_masks[src]
            if mask.tiles:  # no tile: nothing this rank's queries see in that shard
                block_out, block_lse = kernel.forward(q_all, kv[0], kv[1], mask, scale)
                merge_lse_(out, lse, block_out, block_lse)
            if step == 0 and plan.intra_mask is not None:
                # Branch-local attention: the branch K/V never leave this rank.
                block_out, block_lse = _intra_forward(kernel, bq, bk, bv, plan, scale)
                merge_lse_(out[M:], lse[M:], block_out, block_lse)
            if step + 1 < C:
                comm.wait()
                kv = next_kv
        if stats is not None:
            masks = [plan.ring_masks[(rank - s) % C] for s in range(C)]
            masks += [plan.intra_mask] if plan.intra_mask is not None else []
            stats.calls += 1
            stats.bytes_sent_forward += comm.bytes_sent if comm is not None else 0
            stats.pairs_computed += sum(m.pairs_computed() for m in masks)
            stats.pairs_allowed += sum(m.pairs_allowed() for m in masks)
        ctx.save_for_backward(q, k, v, bq, bk, bv, out, lse)
        ctx.set_materialize_grads(False)
        ctx.plan, ctx.group, ctx.kernel, ctx.scale, ctx.stats = plan, group, kernel, scale, stats
        ctx.grad_comm_dtype = grad_comm_dtype or ctype
        bout, blse = out[M:].to(bq.dtype, copy=True), lse[M:].clone()
        if q is None:
            return bout, blse
        return out[:M].to(q.dtype, copy=True), lse[:M].clone(), bout, blse

    @staticmethod
    def backward(ctx, *grads):
        """Every accumulator is allocated once per backward: dQ (all query rows), our own shard's
        dK/dV, two dK/dV buffers for the shards that travel (one filled while the other is in
        flight) and the two receive buffers of each ring; each ring step adds into them."""
        q, k, v, bq, bk, bv, out, lse = ctx.saved_tensors
        plan, group, kernel, scale = ctx.plan, ctx.group, ctx.kernel, ctx.scale
        C, rank, M = plan.cp_size, plan.rank, plan.main_rows
        ctype, comm_dtype = compute_dtype(k.dtype), ctx.grad_comm_dtype
        q_all = bq if q is None else (torch.cat([q, bq]) if bq.shape[0] else q)
        # gradients autograd did not materialise (set_materialize_grads(False)): outputs the loss does
        # not use; no LSE gradient at all lets the fused kernels run without a check per step
        douts = (grads[0], grads[2]) if q is not None else (grads[0],)
        dlses = (grads[1], grads[3]) if q is not None else (grads[1],)
        rows = (M, bq.shape[0]) if q is not None else (bq.shape[0],)
        dout_all = torch.cat([torch.zeros(n, *q_all.shape[1:], dtype=ctype, device=k.device) if g is None
                              else g.to(ctype) for g, n in zip(douts, rows)])
        dlse_all = None
        if any(g is not None for g in dlses):
            dlse_all = torch.cat([torch.zeros(n, q_all.shape[1], dtype=ctype, device=k.device) if g is None
                                  else g.to(ctype) for g, n in zip(dlses, rows)])
        dq_all = torch.zeros(q_all.shape, dtype=ctype, device=k.device)

        kv = torch.stack([k, v])
        own_dkv = torch.zeros(kv.shape, dtype=ctype, device=k.device)
        if C > 1:
            kv_comm, dkv_comm = RingComm(group, tag=1), RingComm(group, tag=2)
            kv_recv = [torch.empty_like(kv) for _ in range(2)]
            dkv_bufs = [torch.empty_like(own_dkv) for _ in range(2)]
            dkv_recv = [torch.empty(kv.shape, dtype=comm_dtype, device=k.device) for _ in range(2)]
            dkv_send = [torch.empty_like(r) for r in dkv_recv] if comm_dtype != ctype else dkv_bufs
        travelling = None
        for step in range(C):
            if step + 1 < C:
                next_kv = kv_comm.send_recv(kv, kv_recv[step % 2])
                kv_comm.commit()
            # step 0: our own shard, kept here until its visitors' sum comes home; later steps: the
            # visiting shard's dK/dV, summed with what its earlier visitors sent, then sent on
            acc = own_dkv if step == 0 else dkv_bufs[step % 2].zero_()
            mask = plan.ring_masks[(rank - step) % C]
            if mask.tiles:  # none: nothing seen in that shard, a zero part still travels
                kernel.backward(dout_all, q_all, kv[0], kv[1], out, lse, mask, scale, dlse_all,
                                grads=(dq_all, acc[0], acc[1]))
            if step == 0 and plan.intra_mask is not None:
                dlse_b = None if dlse_all is None else dlse_all[M:]
                dbq_b, dbk, dbv = _intra_backward(kernel, dout_all[M:], bq, bk, bv, out[M:], lse[M:], plan, scale, dlse_b)
                dq_all[M:] += dbq_b
            if step > 0:
                if step > 1:
                    dkv_comm.wait()
                    acc += travelling
                send = dkv_send[step % 2]
                if send is not acc:
                    send.copy_(acc)
                # to the next visitor, or home after the last step (in grad_comm_dtype)
                travelling = dkv_comm.send_recv(send, dkv_recv[step % 2])
                dkv_comm.commit()
            if step + 1 < C:
                kv_comm.wait()
                kv = next_kv
        if C > 1:
            dkv_comm.wait()  # our own shard's dK/dV from ranks r+1 .. r+C-1
            own_dkv += travelling
        if plan.intra_mask is None:
            dbk, dbv = torch.zeros(bk.shape, dtype=ctype, device=bk.device), torch.zeros(bv.shape, dtype=ctype, device=bv.device)
        if ctx.stats is not None and C > 1:
            ctx.stats.bytes_sent_backward += kv_comm.bytes_sent + dkv_comm.bytes_sent
        dq = None if q is None else dq_all[:M].to(q.dtype)
        return (
            dq, own_dkv[0].to(k.dtype), own_dkv[1].to(v.dtype),
            dq_all[M:].to(bq.dtype), dbk.to(bk.dtype), dbv.to(bv.dtype),
            None, None, None, None, None, None,
        )


def _check(name: str, t: torch.Tensor, shape: tuple, hint: str) -> None:
    if t.dim() != len(shape) or tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} ({hint})")


def cp_branch_attention(
    q: Optional[torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    bq: Optional[torch.Tensor],
    bk: Optional[torch.Tensor],
    bv: Optional[torch.Tensor],
    layout: BranchLayout,
    group: Optional[dist.ProcessGroup] = None,
    *,
    softmax_scale: Optional[float] = None,
    kernel: Optional[BlockKernel] = None,
    stats: Optional[CPStats] = None,
    max_tile: int = DEFAULT_MAX_TILE,
    grad_comm_dtype: Optional[torch.dtype] = None,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Branch attention over a CP group; same meaning as dense_branch_attention, on local shards.

    q (L, H, D), k and v (L, Hk, D): this rank's zigzag shard of the main tensors
    (L = layout.local_len; see zigzag_shard). bq (Lb, H, D), bk and bv (Lb, Hk, D): the tokens of
    the branches this rank owns, branch by branch (Lb = layout.local_branch_tokens(rank); see
    shard_branches), or None when this rank owns no branch.
    group: the CP process group (None: the default group, or no group at all when
    torch.distributed is not initialised, which means CP = 1). Its size must equal layout.cp_size.
    Returns out (L, H, D), lse (L, H), bout (Lb, H, D), blse (Lb, H); all ranks must call it (and
    its backward) together.

    q=None: no main queries (the main rows only provide keys and values, as in the block drafters
    and EAGLE-3's passes 1..k-1). Returns (None, None, bout, blse), the same branch outputs as with
    any q; only the branch query tiles are computed (ring and branch-local), and the backward gives
    the gradients that flow from them (dK/dV of the main keys from branch queries, dQ/dK/dV of the
    branches). K/V and dK/dV still go round the whole ring (same bytes as with q). bq, bk, bv must
    then be tensors, with 0 rows on a rank that owns no branch: that rank still takes part in the
    ring, forward and backward, so its (empty) bout must reach the loss like every rank's.

    dtypes: fp32, bf16, fp16 (computed in fp32) and fp64 (computed in fp64 end to end).
    grad_comm_dtype: dtype of the dK/dV partial sums that travel the ring in the backward; None
    (default) sends them in the compute dtype (fp32; fp64 for fp64 inputs). torch.bfloat16 halves
    those bytes for fp32 accumulation, at the price of one rounding per hop (C-1 hops).
    """
    rank, size = group_rank_and_size(group)
    if size != layout.cp_size:
        raise ValueError(
            f"the CP group has {size} ranks but layout.cp_size is {layout.cp_size}; "
            f"build the layout for this group (layout.with_cp({size}))"
        )
    return _branch_attention(q, k, v, bq, bk, bv, layout, group, rank, softmax_scale, kernel, stats, max_tile,
                             grad_comm_dtype)


def local_branch_attention(
    q: Optional[torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    bq: Optional[torch.Tensor],
    bk: Optional[torch.Tensor],
    bv: Optional[torch.Tensor],
    layout: BranchLayout,
    *,
    softmax_scale: Optional[float] = None,
    kernel: Optional[BlockKernel] = None,
    stats: Optional[CPStats] = None,
    max_tile: int = DEFAULT_MAX_TILE,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """cp_branch_attention at CP = 1 without any process group (also when torch.distributed is
    initialised for something else): layout.cp_size must be 1, the tensors are the full packed ones.
    The same tiles (block-diagonal branch-local attention, exact trunk tiles), q=None included."""
    if layout.cp_size != 1:
        raise ValueError(f"local_branch_attention runs CP = 1 layouts; layout.cp_size is {layout.cp_size} "
                         "(use cp_branch_attention with the CP group)")
    return _branch_attention(q, k, v, bq, bk, bv, layout, None, 0, softmax_scale, kernel, stats, max_tile, None)


def _branch_attention(q, k, v, bq, bk, bv, layout: BranchLayout, group, rank: int, softmax_scale, kernel, stats,
                      max_tile: int, grad_comm_dtype):
    L = layout.local_len
    Lb = layout.local_branch_tokens(rank)
    hint = f"rank {rank} owns {layout.local_branches(rank).numel()} branches with layout.local_branch_tokens({rank}) = {Lb} tokens"
    if q is None:
        if bq is None or bk is None or bv is None:
            raise ValueError(
                "q=None (no main queries) needs bq, bk and bv as tensors, with 0 rows on a rank that owns no "
                "branch (bq (0, H, D), bk and bv (0, Hk, D)): that rank still takes part in the ring, forward and backward"
            )
        if bq.dim() != 3:
            raise ValueError(f"bq must be (tokens, heads, head_dim), got shape {tuple(bq.shape)}")
        first, (H, D) = bq, bq.shape[1:]
    else:
        if q.dim() != 3:
            raise ValueError(f"q must be (tokens, heads, head_dim), got shape {tuple(q.shape)}")
        first, (H, D) = q, q.shape[1:]
    Hk = k.shape[1] if k.dim() == 3 else -1
    if q is not None:
        _check("q", q, (L, H, D), f"rank {rank}'s zigzag shard holds layout.local_len = {L} rows")
    _check("k", k, (L, Hk, D), "same rows and head_dim as q" if q is not None else
           f"rank {rank}'s zigzag shard holds layout.local_len = {L} rows; same head_dim as bq")
    _check("v", v, (L, Hk, D), "same shape as k")
    if H % Hk:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hk})")
    if bq is None and bk is None and bv is None:
        bq, bk, bv = q.new_zeros(0, H, D), k.new_zeros(0, Hk, D), v.new_zeros(0, Hk, D)
    elif bq is None or bk is None or bv is None:
        raise ValueError("bq, bk and bv must be given together (or all None when this rank owns no branch)")
    _check("bq", bq, (Lb, H, D), hint)
    _check("bk", bk, (Lb, Hk, D), hint)
    _check("bv", bv, (Lb, Hk, D), hint)
    if first.dtype not in SUPPORTED_DTYPES:
        name = "q" if q is not None else "bq"
        raise TypeError(f"{name} is {first.dtype}; cp_branch_attention takes {', '.join(map(str, SUPPORTED_DTYPES))}")
    if grad_comm_dtype is not None and (not isinstance(grad_comm_dtype, torch.dtype) or not grad_comm_dtype.is_floating_point):
        raise TypeError(f"grad_comm_dtype must be None or a floating torch.dtype, got {grad_comm_dtype!r}")
    ref = "q" if q is not None else "bq"
    for name, t in (("k", k), ("v", v), ("bq", bq), ("bk", bk), ("bv", bv)):
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}; {ref} is {first.dtype} on {first.device} (all must match)")
    kernel = default_kernel(first.device) if kernel is None else kernel
    plan = ring_plan(layout, rank, first.device, max_tile, getattr(kernel, "tile_cost_pairs", DEFAULT_TILE_COST_PAIRS),
                     main_queries=q is not None)
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    res = _CPBranchAttention.apply(q, k, v, bq, bk, bv, plan, group, kernel, scale, stats, grad_comm_dtype)
    if q is None:
        return (None, None) + tuple(res)
    return res
