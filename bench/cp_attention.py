"""Benchmark: CP branch attention (packed zigzag ring + block-diagonal branch attention) vs two padded baselines.

Workload: S packed sequences of mixed lengths (prompt + response), DFlash blocks of B tokens at
anchors drawn among the response positions (exclusive context, full attention inside a block), GQA,
CPU over gloo, one thread per rank; a step is forward + backward of sum(out * w) + sum(bout * bw).

Arms (all three run in the same process group, on the same layout and the same inputs):
- ours:      cotrain.parallel.cp_branch_attention on zigzag shards (bytes counted by its RingComm).
- allgather: every sequence padded to the longest (rounded to 2C), zigzag-sharded, K/V all-gathered
             (torch.distributed.nn, differentiable; its backward is a reduce-scatter), then attention
             with torch's fused CPU flash op: per local chunk i, keys [0, i c) full + [i c, (i+1) c)
             causal; each branch against exactly its context prefix (a view), the blocks batched.
- usp:       SpecForge's USP: Ulysses all-to-all (heads scattered, sequence gathered, u = gcd(C, Hk))
             then a ring of C/u over contiguous padded segments (Lp = Lmax rounded to C) that skips
             the causally masked steps (ring-flash-attn: dK/dV in fp32 travel the ring and come home,
             C/u hops); branch queries ride the ring with the trunk (full against earlier segments,
             exact prefix views in their own segment), blocks batched; all-to-all back.
Both baselines: no dense masks, no K/V copies per branch, no fully masked blocks; padding rows are
computed as a padded batch computes them (that is the cost of padding).

Measured, with the arms interleaved round by round (arm order rotated every round):
- wall time per step (max over ranks; between barriers) and CPU time per step (summed over ranks),
  medians and [min, max] over rounds, and the per-round paired ratios ours / baseline;
- peak resident memory per rank during one step (VmHWM after resetting it, minus VmRSS before;
  large allocations forced onto mmap), median and range over interleaved rounds;
- bytes sent per rank (ours: counted; usp: counted; allgather: the collective's nominal volume),
  also for bf16 inputs and for ours with grad_comm_dtype=bf16, and the error that option adds;
- query-key pairs computed per rank (all heads) and per-rank balance (max / mean);
- every arm's outputs and input gradients, mapped to packed tokens, against ours.
Separately (no process group): work balance of the drafters' real layouts (DFlash anchors drawn as
the drafter draws them vs cotrain.parallel.balanced_anchors; EAGLE-3 TTT) over many batches.
Drafter-style calls (branch outputs only, the loss on them): cp_branch_attention with main queries
(q = zeros, what BlockDrafter.backbone passed before: every main tile computed and thrown away) vs
without (q=None), interleaved round by round, on the workload above ("mixed") and on one long
sequence ("long": --long-len tokens, the same blocks per sequence): wall and CPU time, pairs, bytes,
and the branch outputs and input gradients of both checked equal.

    python bench/cp_attention.py            # defaults: a few minutes on 2 cores
    python bench/cp_attention.py --quick    # seconds, for a smoke test
    python bench/cp_attention.py --report bench/results/cp_attention.json   # the docs' tables and PNG from a JSON
    python bench/cp_attention.py --drafter-only   # only the drafter-style calls, with vs without main queries

Partitions mode (one process, no process group; see the section "CP partitions on one device"): every
CP rank's share of a step, forward + backward, computed in turn on one device with the ring replayed,
ours against the padded USP baseline, both on the same plain torch tiles; per rank the median step
time over rounds and, on CUDA, the peak memory it holds. Writes
``<--out-dir>/cp_attention_partitions_<device>.json``::

    python bench/cp_attention.py --device cuda --out $OUT   # the GPU check: --preset qwen3-0.6b --cp 2 4 8
    python bench/cp_attention.py --partitions --quick --cp 2 4 --out-dir /tmp/x                  # CPU smoke run
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.paths import recorded_args  # noqa: E402
# Large tensors on mmap: freed memory is returned at once, so the peak-RSS measurement is honest.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

# torch.distributed.nn.functional.all_gather still works; its replacement is a private API.
warnings.filterwarnings("ignore", message=".*all_gather is deprecated.*", category=FutureWarning)

ARMS = ("ours", "allgather", "usp")
BASELINES = ("allgather", "usp")


# ----- memory measurement (Linux) ---------------------------------------------------------------------

def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> int:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    return _status_kb("VmRSS")


def _peak_since(rss_before_kb: int) -> int:
    return max(0, _status_kb("VmHWM") - rss_before_kb) * 1024


# ----- workload -------------------------------------------------------------------------------------------

def make_batch(seed: int, num_seqs: int, min_len: int, max_len: int):
    """Sequence lengths (one at the maximum) and prompt lengths of an RL-style batch."""
    g = torch.Generator().manual_seed(seed)
    seqlens = torch.randint(min_len, max_len + 1, (num_seqs,), generator=g)
    seqlens[0] = max_len
    prompt = torch.minimum(torch.randint(max(1, min_len // 2), max(2, max_len // 4) + 1, (num_seqs,), generator=g), seqlens // 2)
    return seqlens, prompt, g


def draft_batch(seqlens, prompt):
    """A DraftBatch with those lengths; loss on the response tokens (the drafters' training input)."""
    from cotrain.draft.common import DraftBatch
    from cotrain.parallel import cu_seqlens_from_lengths

    cu = cu_seqlens_from_lengths(seqlens)
    pos = torch.cat([torch.arange(int(n)) for n in seqlens])
    seq = torch.repeat_interleave(torch.arange(len(seqlens)), seqlens)
    T = int(cu[-1])
    return DraftBatch(torch.zeros(T, dtype=torch.int64), cu, torch.zeros(T, 1), pos >= prompt[seq], None, prompt)


def dflash_candidates(batch):
    """The DFlash drafter's own anchor candidates (BlockDrafter.anchor_candidates uses only the batch)."""
    from cotrain.draft.dflash import BlockDrafter

    return BlockDrafter.anchor_candidates(None, batch)


def drafter_random_anchors(batch, per_seq, g):
    """Anchors exactly as the DFlash drafter draws them today (BlockDrafter.sample_anchors)."""
    from types import SimpleNamespace

    from cotrain.draft.dflash import BlockDrafter

    shim = SimpleNamespace(anchor_candidates=lambda b: BlockDrafter.anchor_candidates(None, b))
    return BlockDrafter.sample_anchors(shim, batch, per_seq, g)


def make_workload(args, cp_size: int, dtype=torch.float32):
    from cotrain.parallel import balanced_anchors, dflash_layout

    seqlens, prompt, g = make_batch(args.seed, args.num_seqs, args.min_len, args.max_len)
    batch = draft_batch(seqlens, prompt)
    if args.anchors == "balanced":
        anchors = balanced_anchors(batch.cu_seqlens, dflash_candidates(batch), args.blocks_per_seq, cp_size,
                                   torch.Generator().manual_seed(args.seed + 1), block_size=args.block_size)
    else:
        anchors = drafter_random_anchors(batch, args.blocks_per_seq, torch.Generator().manual_seed(args.seed + 1))
    layout = dflash_layout(batch.cu_seqlens, anchors, args.block_size, cp_size=cp_size)
    T, NBt = layout.total_len, layout.total_branch_tokens
    H, Hk, D = args.heads, args.kv_heads, args.head_dim
    tensors = [torch.randn(n, h, D, generator=g, dtype=torch.float64).to(dtype)
               for n, h in [(T, H), (T, Hk), (T, Hk), (NBt, H), (NBt, Hk), (NBt, Hk)]]
    weights = [torch.randn(T, H, D, generator=g, dtype=torch.float64).to(dtype),
               torch.randn(NBt, H, D, generator=g, dtype=torch.float64).to(dtype)]
    return layout, tensors, weights


# ----- ours -----------------------------------------------------------------------------------------------

class Ours:
    def __init__(self, layout, tensors, weights, rank, grad_comm_dtype=None):
        from cotrain.parallel import shard_branches, zigzag_shard

        self.layout, self.rank, self.grad_comm_dtype = layout, rank, grad_comm_dtype
        self.inputs = [zigzag_shard(t, layout, rank).requires_grad_() for t in tensors[:3]]
        self.inputs += [shard_branches(t, layout, rank).requires_grad_() for t in tensors[3:]]
        self.w = [zigzag_shard(weights[0], layout, rank), shard_branches(weights[1], layout, rank)]

    def step(self, stats=None):
        from cotrain.parallel import cp_branch_attention

        for t in self.inputs:
            t.grad = None
        out, _, bout, _ = cp_branch_attention(*self.inputs, self.layout, None, stats=stats,
                                              grad_comm_dtype=self.grad_comm_dtype)
        ((out * self.w[0]).sum() + (bout * self.w[1]).sum()).backward()
        return out.detach(), bout.detach()

    def token_map(self):
        """Packed index of every local main row (-1: padding) and packed branch-token index of every branch row."""
        return self.layout.zigzag_index(self.rank), self.layout.local_branch_token_index(self.rank)

    def grads(self):
        return [t.grad for t in self.inputs]


# ----- padded baselines: shared pieces ---------------------------------------------------------------------

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _bhsd(x, groups=1):
    """(B, n, h, D) -> (B, h * groups, n, D), K/V heads repeated for grouped-query attention."""
    if groups > 1:
        x = x.repeat_interleave(groups, dim=2)
    return x.transpose(1, 2)


def flash_fwd(q, k, v, causal, scale):
    """torch's fused CPU flash attention on (B, n, H, D) x (B, m, Hk, D): out (B, n, H, D), lse (B, n, H) fp32."""
    g = q.shape[2] // k.shape[2]
    o, lse = _FWD(_bhsd(q), _bhsd(k, g), _bhsd(v, g), 0.0, causal, scale=scale)
    return o.transpose(1, 2), lse.transpose(1, 2)


def flash_bwd(dout, q, k, v, out, lse, causal, scale):
    """Its backward given the rows' final out and lse: dq (B, n, H, D), dk and dv (B, m, Hk, D), fp32."""
    B, m, hk, d = k.shape
    g = q.shape[2] // hk
    dq, dk, dv = _BWD(_bhsd(dout.to(q.dtype)), _bhsd(q), _bhsd(k, g), _bhsd(v, g), _bhsd(out.to(q.dtype)),
                      lse.transpose(1, 2).contiguous(), 0.0, causal, scale=scale)
    fold = lambda x: x.reshape(B, hk, g, m, d).sum(2).transpose(1, 2).float()  # noqa: E731
    return dq.transpose(1, 2).float(), fold(dk), fold(dv)


def merge_(out, lse, o, l):
    """In place: (out, lse) <- the log-sum-exp merge of (out, lse) and (o, l)."""
    new = torch.logaddexp(lse, l)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o.float() * torch.exp(l - new).unsqueeze(-1))
    lse.copy_(new)


class Call:
    """One fused attention call: queries Q[qslot][qidx] against keys K[kslot][kidx] (views), full or causal."""

    __slots__ = ("qslot", "qidx", "kslot", "kidx", "causal")

    def __init__(self, qslot, qidx, kslot, kidx, causal=False):
        self.qslot, self.qidx, self.kslot, self.kidx, self.causal = qslot, qidx, kslot, kidx, causal

    def pairs(self, Q, K, heads_frac):
        q, k = Q[self.qslot][self.qidx], K[self.kslot][self.kidx]
        n, m = q.shape[1], k.shape[1]
        return int(q.shape[0] * (n * (n + 1) // 2 if self.causal else n * m) * heads_frac)


def run_forward(calls, Q, K, V, OUT, LSE, scale, fwd=flash_fwd):
    for c in calls:
        o, l = fwd(Q[c.qslot][c.qidx], K[c.kslot][c.kidx], V[c.kslot][c.kidx], c.causal, scale)
        merge_(OUT[c.qslot][c.qidx], LSE[c.qslot][c.qidx], o, l)


def run_backward(calls, dOUT, Q, K, V, OUT, LSE, dQ, dK, dV, scale, bwd=flash_bwd):
    for c in calls:
        qi, ki = c.qidx, c.kidx
        dq, dk, dv = bwd(dOUT[c.qslot][qi], Q[c.qslot][qi], K[c.kslot][ki], V[c.kslot][ki],
                               OUT[c.qslot][qi], LSE[c.qslot][qi], c.causal, scale)
        dQ[c.qslot][qi] += dq
        dK[c.kslot][ki] += dk
        dV[c.kslot][ki] += dv


def _slots(main, branch_flat, nb, B):
    """Named views: main (S, n, h, D); branch rows flat (1, NB*B, h, D) and as blocks (nb, B, h, D)."""
    return {"q": main, "bq": branch_flat, "bqb": branch_flat.view(nb, B, *branch_flat.shape[2:])}


def _zeros_like_slots(main, branch_flat, nb, B, fill=0.0, last_dim=True):
    shape_m = main.shape if last_dim else main.shape[:-1]
    shape_b = branch_flat.shape if last_dim else branch_flat.shape[:-1]
    m = torch.full(shape_m, fill, dtype=torch.float32, device=main.device)
    b = torch.full(shape_b, fill, dtype=torch.float32, device=main.device)
    return {"q": m, "bq": b, "bqb": b.view(nb, B, *b.shape[2:])}


def branch_calls(b_seq, b_ctx, B, seg_start, seg_len, own_segment: bool):
    """Calls of branch queries (flat rows, sequence-grouped) against one key segment of their sequences.

    own_segment: the segment holding the anchors: each branch sees exactly its context prefix there
    (a view of the first c_b + 1 - seg_start keys); otherwise every key of the segment (one call per
    sequence, its branches' rows together)."""
    calls = []
    if own_segment:
        for b, (s, c) in enumerate(zip(b_seq, b_ctx)):
            n = min(c + 1 - seg_start, seg_len)
            if n > 0:
                calls.append(Call("bq", (slice(0, 1), slice(b * B, (b + 1) * B)), "k", (slice(s, s + 1), slice(0, n))))
        return calls
    b = 0
    while b < len(b_seq):
        e = b
        while e < len(b_seq) and b_seq[e] == b_seq[b]:
            e += 1
        s = b_seq[b]
        calls.append(Call("bq", (slice(0, 1), slice(b * B, e * B)), "k", (slice(s, s + 1), slice(None))))
        b = e
    return calls


def pad_main(x, layout, Lp):
    """(T, ...) packed -> (S, Lp, ...) padded with zeros."""
    S = layout.num_seqs
    out = x.new_zeros(S, Lp, *x.shape[1:])
    for s in range(S):
        a, b = int(layout.cu_seqlens[s]), int(layout.cu_seqlens[s + 1])
        out[s, : b - a] = x[a:b]
    return out


class PaddedBase:
    """Padded inputs held by this rank: main rows at padded positions `pos` of every sequence, branches by owner."""

    def __init__(self, layout, tensors, weights, pos, branch_ids):
        self.layout, self.pos = layout, pos
        self.branch_ids = branch_ids
        B = int(layout.branch_lens[0]) if layout.num_branches else 1
        self.B, self.nb = B, branch_ids.numel()
        Lp = self.Lp
        q, k, v, bq, bk, bv = tensors
        self.main = [pad_main(t, layout, Lp)[:, pos].clone().requires_grad_() for t in (q, k, v)]
        self.w = pad_main(weights[0], layout, Lp)[:, pos]
        tok = self.branch_tokens()
        self.branch = [t[tok].unsqueeze(0).clone().requires_grad_() for t in (bq, bk, bv)]  # (1, nb * B, h, D)
        self.bw = weights[1][tok].unsqueeze(0)

    def branch_tokens(self):
        offs = self.layout.branch_offsets
        pieces = [torch.arange(int(offs[b]), int(offs[b + 1])) for b in self.branch_ids.tolist()]
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)

    def token_map(self):
        lens, cu = self.layout.seqlens, self.layout.cu_seqlens
        pos = self.pos[None, :].expand(self.layout.num_seqs, -1)
        idx = (cu[:-1, None] + pos).masked_fill(pos >= lens[:, None], -1)
        return idx.reshape(-1), self.branch_tokens()

    def grads(self):
        flat = lambda t: t.grad.reshape(-1, *t.shape[2:])  # noqa: E731
        return [flat(t) for t in self.main] + [flat(t) for t in self.branch]

    def zero_grads(self):
        for t in self.main + self.branch:
            t.grad = None

    def loss(self, out, bout):
        return (out * self.w).sum() + (bout * self.bw).sum()


# ----- padded all-gather ---------------------------------------------------------------------------------

class _GatheredAttention(torch.autograd.Function):
    """Local queries against the all-gathered padded K/V (plus the local branch blocks), as listed calls."""

    @staticmethod
    def forward(ctx, q, K, V, bq, bk, bv, calls, intra, nb, B, scale):
        Q = _slots(q, bq, nb, B)
        Kd, Vd = {"k": K, "bkb": bk.view(nb, B, *bk.shape[2:])}, {"k": V, "bkb": bv.view(nb, B, *bv.shape[2:])}
        OUT = _zeros_like_slots(q, bq, nb, B)
        LSE = _zeros_like_slots(q, bq, nb, B, float("-inf"), last_dim=False)
        run_forward(calls + intra, Q, Kd, Vd, OUT, LSE, scale)
        ctx.save_for_backward(q, K, V, bq, bk, bv, OUT["q"], LSE["q"], OUT["bq"], LSE["bq"])
        ctx.meta = (calls + intra, nb, B, scale)
        return OUT["q"].to(q.dtype), OUT["bq"].to(q.dtype)

    @staticmethod
    def backward(ctx, dout, dbout):
        q, K, V, bq, bk, bv, out, lse, bout, blse = ctx.saved_tensors
        calls, nb, B, scale = ctx.meta
        Q = _slots(q, bq, nb, B)
        Kd, Vd = {"k": K, "bkb": bk.view(nb, B, *bk.shape[2:])}, {"k": V, "bkb": bv.view(nb, B, *bv.shape[2:])}
        OUT, LSE, dOUT = _slots(out, bout, nb, B), _slots(lse, blse, nb, B), _slots(dout.float(), dbout.float(), nb, B)
        dQ = _zeros_like_slots(q, bq, nb, B)
        dK = {"k": torch.zeros(K.shape), "bkb": torch.zeros(nb, B, *bk.shape[2:])}
        dV = {"k": torch.zeros(V.shape), "bkb": torch.zeros(nb, B, *bv.shape[2:])}
        run_backward(calls, dOUT, Q, Kd, Vd, OUT, LSE, dQ, dK, dV, scale)
        t = q.dtype
        return (dQ["q"].to(t), dK["k"].to(t), dV["k"].to(t), dQ["bq"].to(t), dK["bkb"].reshape(bk.shape).to(t),
                dV["bkb"].reshape(bv.shape).to(t), None, None, None, None, None)


class AllGather(PaddedBase):
    def __init__(self, layout, tensors, weights, rank, cp_size):
        self.C, self.rank = cp_size, rank
        unit = 2 * cp_size if cp_size > 1 else 1
        self.Lp = math.ceil(int(layout.seqlens.max()) / unit) * unit
        self.c = self.Lp // unit
        chunks = [rank, 2 * cp_size - 1 - rank] if cp_size > 1 else [0]
        pos = torch.cat([torch.arange(i * self.c, (i + 1) * self.c) for i in chunks])
        a_pos = layout.anchor_positions
        i = a_pos // self.c
        owner = torch.where(i < cp_size, i, 2 * cp_size - 1 - i) if cp_size > 1 else torch.zeros_like(i)
        super().__init__(layout, tensors, weights, pos, torch.nonzero(owner == rank).squeeze(1))
        self.inverse = torch.argsort(torch.cat([self._positions(r) for r in range(cp_size)]))
        S, c = layout.num_seqs, self.c
        self.calls = []
        for li, ci in enumerate(chunks):  # local chunk li holds padded chunk ci of every sequence
            rows = (slice(None), slice(li * c, (li + 1) * c))
            if ci > 0:
                self.calls.append(Call("q", rows, "k", (slice(None), slice(0, ci * c))))
            self.calls.append(Call("q", rows, "k", (slice(None), slice(ci * c, (ci + 1) * c)), causal=True))
        ids = self.branch_ids
        self.calls += branch_calls(layout.branch_seqs[ids].tolist(), layout.context_last[ids].tolist(), self.B,
                                   0, self.Lp, own_segment=True)
        self.intra = [Call("bqb", (slice(None),), "bkb", (slice(None),))] if self.nb else []
        self.scale = tensors[0].shape[-1] ** -0.5
        self.bytes_fwd = self.bytes_bwd = 0

    def _positions(self, r):
        if self.C == 1:
            return torch.arange(self.Lp)
        c, C = self.c, self.C
        return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * C - 1 - r) * c, (2 * C - r) * c)])

    def step(self, count=False):
        from torch.distributed.nn.functional import all_gather

        self.zero_grads()
        q, k, v = self.main
        kv = torch.stack([k, v])
        if self.C > 1:
            kv = torch.cat(all_gather(kv), dim=2)[:, :, self.inverse]  # (2, S, Lp, Hk, D) in position order
            if count:  # the collective's nominal per-rank volume, forward and (reduce-scatter) backward
                shard = kv.numel() // self.C * kv.element_size()
                self.bytes_fwd += (self.C - 1) * shard
                self.bytes_bwd += (self.C - 1) * shard
        bq, bk, bv = self.branch
        out, bout = _GatheredAttention.apply(q, kv[0], kv[1], bq, bk, bv, self.calls, self.intra, self.nb, self.B, self.scale)
        self.loss(out, bout).backward()
        return out.detach(), bout.detach()

    def pairs(self):
        H = self.main[0].shape[2]
        Q = _slots(self.main[0], self.branch[0], self.nb, self.B)
        K = {"k": torch.empty(self.layout.num_seqs, self.Lp, 1, 1), "bkb": torch.empty(self.nb, self.B, 1, 1)}
        return sum(c.pairs(Q, K, 1.0) for c in self.calls + self.intra) if H else 0


# ----- padded USP: Ulysses all-to-all + ring -----------------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    """all_to_all_single on a flat tensor; the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, send, recv, group, counter):
        out = x.new_empty(sum(recv))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        ctx.meta = (send, recv, group, counter)
        if counter is not None:
            counter["fwd"] += (sum(send) - send[dist.get_rank(group)]) * x.element_size()
        return out

    @staticmethod
    def backward(ctx, grad):
        send, recv, group, counter = ctx.meta
        out = grad.new_empty(sum(send))
        dist.all_to_all_single(out, grad.contiguous(), send, recv, group=group)
        if counter is not None:
            counter["bwd"] += (sum(recv) - recv[dist.get_rank(group)]) * grad.element_size()
        return out, None, None, None, None


def ulysses_scatter_heads(x, u, group, counter, counts=None):
    """(R, n, H, D) rows of this rank -> (R', H/u, D...) rows of the Ulysses group, heads group of this rank.

    Main tensors (counts None): (S, n, H, D) -> (S, u n, H/u, D), sequence shards in group order.
    Branch rows (counts = rows per group member): (1, n_i, H, D) -> (1, sum n, H/u, D), by member.
    """
    if u == 1:
        return x
    R, n, H, D = x.shape
    parts = x.reshape(R, n, u, H // u, D).permute(2, 0, 1, 3, 4).reshape(-1)  # (u, R, n, H/u, D)
    if counts is None:
        per = R * n * (H // u) * D
        out = _AllToAll.apply(parts, [per] * u, [per] * u, group, counter)
        return out.view(u, R, n, H // u, D).permute(1, 0, 2, 3, 4).reshape(R, u * n, H // u, D)
    me = dist.get_rank(group)
    send = [counts[me] * (H // u) * D] * u
    recv = [c * (H // u) * D for c in counts]
    return _AllToAll.apply(parts, send, recv, group, counter).view(1, sum(counts), H // u, D)


def ulysses_gather_heads(x, u, group, counter, counts=None):
    """The inverse of ulysses_scatter_heads."""
    if u == 1:
        return x
    if counts is None:
        R, un, h, D = x.shape
        n = un // u
        parts = x.reshape(R, u, n, h, D).permute(1, 0, 2, 3, 4).reshape(-1)  # (u, R, n, h, D): member i's rows
        per = R * n * h * D
        out = _AllToAll.apply(parts, [per] * u, [per] * u, group, counter)
        return out.view(u, R, n, h, D).permute(1, 2, 0, 3, 4).reshape(R, n, u * h, D)
    me = dist.get_rank(group)
    _, _, h, D = x.shape
    send = [c * h * D for c in counts]
    recv = [counts[me] * h * D] * u
    out = _AllToAll.apply(x.reshape(-1), send, recv, group, counter)
    return out.view(u, counts[me], h, D).permute(1, 0, 2, 3).reshape(1, counts[me], u * h, D)


class _UspRing(torch.autograd.Function):
    """Ring attention over contiguous segments (ring-flash-attn's schedule), with branch queries riding along."""

    @staticmethod
    def forward(ctx, q, k, v, bq, bk, bv, usp):
        nb, B, scale = usp.nb_seg, usp.B, usp.scale
        Q = _slots(q, bq, nb, B)
        OUT = _zeros_like_slots(q, bq, nb, B)
        LSE = _zeros_like_slots(q, bq, nb, B, float("-inf"), last_dim=False)
        bkb, bvb = bk.view(nb, B, *bk.shape[2:]), bv.view(nb, B, *bv.shape[2:])
        kv = torch.stack([k, v])
        comm = usp.ring_comm(0)
        fwd = usp.attn[0]
        for step in range(usp.ring):
            if comm is not None and step + 1 < usp.ring:
                nxt = comm.send_recv(kv)
                comm.commit()
            src = (usp.g - step) % usp.ring
            run_forward(usp.calls[src], Q, {"k": kv[0]}, {"k": kv[1]}, OUT, LSE, scale, fwd)
            if step == 0:
                run_forward(usp.intra, Q, {"bkb": bkb}, {"bkb": bvb}, OUT, LSE, scale, fwd)
            if comm is not None and step + 1 < usp.ring:
                comm.wait()
                kv = nxt
        if comm is not None and usp.counter is not None:
            usp.counter["fwd"] += comm.bytes_sent
        ctx.save_for_backward(q, k, v, bq, bk, bv, OUT["q"], LSE["q"], OUT["bq"], LSE["bq"])
        ctx.usp = usp
        return OUT["q"].to(q.dtype), OUT["bq"].to(q.dtype)

    @staticmethod
    def backward(ctx, dout, dbout):
        q, k, v, bq, bk, bv, out, lse, bout, blse = ctx.saved_tensors
        usp = ctx.usp
        nb, B, scale = usp.nb_seg, usp.B, usp.scale
        Q = _slots(q, bq, nb, B)
        OUT, LSE, dOUT = _slots(out, bout, nb, B), _slots(lse, blse, nb, B), _slots(dout.float(), dbout.float(), nb, B)
        dQ = _zeros_like_slots(q, bq, nb, B)
        bkb, bvb = bk.view(nb, B, *bk.shape[2:]), bv.view(nb, B, *bv.shape[2:])
        dev, bwd = k.device, usp.attn[1]
        dB = {"bkb": torch.zeros(bkb.shape, device=dev)}, {"bkb": torch.zeros(bvb.shape, device=dev)}
        run_backward(usp.intra, dOUT, Q, {"bkb": bkb}, {"bkb": bvb}, OUT, LSE, dQ, dB[0], dB[1], scale, bwd)
        kv = torch.stack([k, v])
        kv_comm, dkv_comm = usp.ring_comm(1), usp.ring_comm(2)
        dkv = None
        for step in range(usp.ring):
            if kv_comm is not None and step + 1 < usp.ring:
                nxt = kv_comm.send_recv(kv)
                kv_comm.commit()
            src = (usp.g - step) % usp.ring
            dK, dV = {"k": torch.zeros(k.shape, device=dev)}, {"k": torch.zeros(v.shape, device=dev)}
            run_backward(usp.calls[src], dOUT, Q, {"k": kv[0]}, {"k": kv[1]}, OUT, LSE, dQ, dK, dV, scale, bwd)
            block = torch.stack([dK["k"], dV["k"]])  # fp32, like ring-flash-attn
            if step > 0:
                dkv_comm.wait()
                block = block + dkv
            if dkv_comm is not None:
                dkv = dkv_comm.send_recv(block)  # rides the ring with its K/V; after the last step, home
                dkv_comm.commit()
            else:
                dkv = block
            if kv_comm is not None and step + 1 < usp.ring:
                kv_comm.wait()
                kv = nxt
        if dkv_comm is not None:
            dkv_comm.wait()
            if usp.counter is not None:
                usp.counter["bwd"] += kv_comm.bytes_sent + dkv_comm.bytes_sent
        t = q.dtype
        return (dQ["q"].to(t), dkv[0].to(t), dkv[1].to(t), dQ["bq"].to(t), dB[0]["bkb"].reshape(bk.shape).to(t),
                dB[1]["bkb"].reshape(bv.shape).to(t), None)


class Usp(PaddedBase):
    attn = (flash_fwd, flash_bwd)  # the attention of one call: torch's fused CPU op (the partitions mode: tiles)

    def __init__(self, layout, tensors, weights, rank, cp_size, groups):
        pos, own = self._plan(layout, rank, cp_size, tensors[1].shape[1])
        self.ulysses_group, self.ring_group = groups[("u", self.g)], groups[("r", self.i)]
        super().__init__(layout, tensors, weights, pos, own)
        self._plan_calls(layout)
        self.scale = tensors[0].shape[-1] ** -0.5
        self.counter = None

    def _plan(self, layout, rank, cp_size, Hk):
        """Rank `rank`'s place (no tensors): Ulysses group and ring position; returns the padded
        positions it holds before the all-to-all and the branches it owns."""
        self.C, self.rank = cp_size, rank
        self.u = math.gcd(cp_size, Hk)
        self.ring = cp_size // self.u
        self.g, self.i = divmod(rank, self.u)  # ring position, index in the Ulysses group
        self.Lp = math.ceil(int(layout.seqlens.max()) / cp_size) * cp_size
        self.Lloc = self.Lp // cp_size
        self.seg = self.u * self.Lloc
        self.owner = layout.anchor_positions // self.Lloc  # contiguous shards: rank r holds [r Lloc, (r+1) Lloc)
        pos = torch.arange(rank * self.Lloc, (rank + 1) * self.Lloc)
        return pos, torch.nonzero(self.owner == rank).squeeze(1)

    def _plan_calls(self, layout):
        """The calls of every ring step (after the all-to-all: segment g of every sequence, H/u heads)."""
        owner = self.owner
        members = [self.g * self.u + j for j in range(self.u)]
        self.member_counts = [int((owner == m).sum()) * self.B for m in members]  # branch rows per member
        # Branches of this ring segment after the all-to-all, by member; sorted by sequence for the calls.
        seg_ids = torch.cat([torch.nonzero(owner == m).squeeze(1) for m in members])
        self.seg_order = torch.argsort(layout.branch_seqs[seg_ids], stable=True)
        self.seg_ids = seg_ids[self.seg_order]
        self.nb_seg = self.seg_ids.numel()
        rows = (self.seg_order[:, None] * self.B + torch.arange(self.B)).reshape(-1)
        self.row_order, self.row_inverse = rows, torch.argsort(rows)
        b_seq, b_ctx = layout.branch_seqs[self.seg_ids].tolist(), layout.context_last[self.seg_ids].tolist()
        self.calls = {}
        for src in range(self.ring):
            rows_all = (slice(None), slice(None))
            if src > self.g:
                self.calls[src] = []  # causally masked: skipped
                continue
            main = [Call("q", rows_all, "k", rows_all, causal=src == self.g)]
            self.calls[src] = main + branch_calls(b_seq, b_ctx, self.B, src * self.seg, self.seg, own_segment=src == self.g)
        self.intra = [Call("bqb", (slice(None),), "bkb", (slice(None),))] if self.nb_seg else []

    def ring_comm(self, tag):
        from cotrain.parallel import RingComm

        return RingComm(self.ring_group, tag=10 + tag) if self.ring > 1 else None

    def step(self, count=False):
        self.zero_grads()
        self.counter = {"fwd": 0, "bwd": 0} if count else None
        u, grp, c = self.u, self.ulysses_group, self.counter
        q, k, v = (ulysses_scatter_heads(t, u, grp, c) for t in self.main)
        bq, bk, bv = (ulysses_scatter_heads(t, u, grp, c, self.member_counts)[:, self.row_order] for t in self.branch)
        out, bout = _UspRing.apply(q, k, v, bq, bk, bv, self)
        out = ulysses_gather_heads(out, u, grp, c)
        bout = ulysses_gather_heads(bout[:, self.row_inverse].contiguous(), u, grp, c, self.member_counts)
        self.loss(out, bout).backward()
        if count:
            self.bytes_fwd, self.bytes_bwd = self.counter["fwd"], self.counter["bwd"]
        self.counter = None
        return out.detach(), bout.detach()

    def pairs(self):
        H = self.main[0].shape[2]
        S, D = self.layout.num_seqs, self.main[0].shape[-1]
        q = torch.empty(S, self.seg, 1, 1)
        bq = torch.empty(1, self.nb_seg * self.B, 1, 1)
        Q = _slots(q, bq, self.nb_seg, self.B)
        K = {"k": torch.empty(S, self.seg, 1, 1), "bkb": bq.view(self.nb_seg, self.B, 1, 1)}
        calls = [c for cs in self.calls.values() for c in cs] + self.intra
        return sum(c.pairs(Q, K, 1.0 / self.u) for c in calls) if H and D else 0


# ----- CP partitions on one device (--device cuda; --partitions runs the same on CPU) -------------------------
#
# Each rank's share of a CP step, computed in one process, one rank at a time: its inputs as that rank
# holds them, the ring replaced by ReplayRing (what would arrive from the previous rank is copied from
# the other ranks' inputs, which the process holds too). So per rank: the attention work (forward +
# backward) and the memory it allocates, with no communication at all (all-to-all and ring transfers
# cost nothing here). The K/V a rank receives are the real ones, so its outputs and dQ are exact; the
# dK/dV partial sums that travel back are stand-ins of the right shape (their values are not those of
# the other ranks), so the cross-check compares outputs only. Both arms use the same plain torch
# attention in tiles of DEFAULT_MAX_TILE rows and keys, accumulated in fp32: ours through
# TorchBlockKernel on its ring plan, USP through tiled_fwd / tiled_bwd on its padded calls (batched
# over the padded sequences). flash-attn is not used (it is absent on the machine the check runs on).

class ReplayRing:
    """RingComm's interface for one simulated rank: the i-th send_recv receives ``arrival(i, to_send)``."""

    def __init__(self, arrival):
        self.arrival, self.calls, self.bytes_sent = arrival, 0, 0

    def send_recv(self, to_send, recv_buffer=None):
        recv = torch.empty_like(to_send) if recv_buffer is None else recv_buffer
        recv.copy_(self.arrival(self.calls, to_send))
        self.calls += 1
        self.bytes_sent += to_send.numel() * to_send.element_size()
        return recv

    def commit(self):
        pass

    def wait(self):
        pass


def _tile_scores(q, k, i0, i1, j0, j1, causal, scale, ct):
    """Scores (B, Hk, g, i1-i0, j1-j0) of query rows [i0, i1) x key rows [j0, j1), causal-masked on the diagonal."""
    B, _, H, D = q.shape
    hk = k.shape[2]
    qt = q[:, i0:i1].to(ct).reshape(B, i1 - i0, hk, H // hk, D).permute(0, 2, 3, 1, 4)
    kt = k[:, j0:j1].to(ct).permute(0, 2, 1, 3).unsqueeze(2)
    s = torch.matmul(qt, kt.transpose(-1, -2)).mul_(scale)
    if causal and j1 > i0 + 1:
        ii = torch.arange(i0, i1, device=q.device)[:, None]
        jj = torch.arange(j0, j1, device=q.device)[None, :]
        s.masked_fill_(jj > ii, float("-inf"))
    return qt, kt, s


def _tiles(n, m, causal, tile):
    """(i0, i1, j0, j1) of the computed tiles: every one, or (causal, n == m) those on or below the diagonal."""
    for i0 in range(0, n, tile):
        i1 = min(i0 + tile, n)
        for j0 in range(0, i1 if causal else m, tile):
            yield i0, i1, j0, min(j0 + tile, m)


def tiled_fwd(q, k, v, causal, scale, tile=None):
    """Plain torch attention on (B, n, H, D) x (B, m, Hk, D), tile by tile: out (B, n, H, D) and lse
    (B, n, H) in fp32 (fp64 for fp64). causal (n == m): key j visible to query i iff j <= i."""
    from cotrain.parallel.branch_attention import DEFAULT_MAX_TILE

    tile = tile or DEFAULT_MAX_TILE
    B, n, H, D = q.shape
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(B, n, H, D, dtype=ct, device=q.device)
    lse = torch.full((B, n, H), float("-inf"), dtype=ct, device=q.device)
    for i0, i1, j0, j1 in _tiles(n, k.shape[1], causal, tile):
        _, _, s = _tile_scores(q, k, i0, i1, j0, j1, causal, scale, ct)
        l = torch.logsumexp(s, -1, keepdim=True)  # (B, Hk, g, nq, 1): every row sees a key (j0 <= i0)
        vt = v[:, j0:j1].to(ct).permute(0, 2, 1, 3).unsqueeze(2)
        o = torch.matmul(s.sub_(l).exp_(), vt)  # (B, Hk, g, nq, D)
        nq = i1 - i0
        merge_(out[:, i0:i1], lse[:, i0:i1], o.permute(0, 3, 1, 2, 4).reshape(B, nq, H, D),
               l.squeeze(-1).permute(0, 3, 1, 2).reshape(B, nq, H))
    return out, lse


def tiled_bwd(dout, q, k, v, out, lse, causal, scale, tile=None):
    """tiled_fwd's backward given the rows' final out and lse: dq (B, n, H, D), dk and dv (B, m, Hk, D)."""
    from cotrain.parallel.branch_attention import DEFAULT_MAX_TILE

    tile = tile or DEFAULT_MAX_TILE
    B, n, H, D = q.shape
    m, hk = k.shape[1], k.shape[2]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(B, n, H, D, dtype=ct, device=q.device)
    dk = torch.zeros(B, m, hk, D, dtype=ct, device=q.device)
    dv = torch.zeros(B, m, hk, D, dtype=ct, device=q.device)
    heads = lambda x: x.to(ct).reshape(B, x.shape[1], hk, H // hk, *x.shape[3:]).permute(0, 2, 3, 1, *range(4, x.dim() + 1))  # noqa: E731
    delta = (dout.to(ct) * out.to(ct)).sum(-1)  # (B, n, H)
    for i0, i1, j0, j1 in _tiles(n, m, causal, tile):
        qt, kt, s = _tile_scores(q, k, i0, i1, j0, j1, causal, scale, ct)
        p = s.sub_(heads(lse[:, i0:i1]).unsqueeze(-1)).exp_()  # (B, Hk, g, nq, nk)
        do = heads(dout[:, i0:i1])  # (B, Hk, g, nq, D)
        vt = v[:, j0:j1].to(ct).permute(0, 2, 1, 3).unsqueeze(2)
        ds = torch.matmul(do, vt.transpose(-1, -2)).sub_(heads(delta[:, i0:i1]).unsqueeze(-1)).mul_(p)
        nq = i1 - i0
        dq[:, i0:i1] += torch.matmul(ds, kt).mul_(scale).permute(0, 3, 1, 2, 4).reshape(B, nq, H, D)
        dk[:, j0:j1] += torch.matmul(ds.transpose(-1, -2), qt).sum(2).mul_(scale).transpose(1, 2)
        dv[:, j0:j1] += torch.matmul(p.transpose(-1, -2), do).sum(2).transpose(1, 2)
    return dq, dk, dv


def partition_workload(args, cp_size, device, dtype):
    """The timing workload (make_workload's batch and anchors) without the drafter's modules: anchor
    candidates are the response positions whose next token is in the response too (the DFlash
    drafter's rule), inputs drawn on the CPU in fp64 and moved to `device` in `dtype`."""
    from cotrain.parallel import balanced_anchors, cu_seqlens_from_lengths, dflash_layout

    seqlens, prompt, g = make_batch(args.seed, args.num_seqs, args.min_len, args.max_len)
    cu = cu_seqlens_from_lengths(seqlens)
    pos = torch.cat([torch.arange(int(n)) for n in seqlens])
    seq = torch.repeat_interleave(torch.arange(len(seqlens)), seqlens)
    cand = torch.nonzero((pos >= prompt[seq]) & (pos + 1 < seqlens[seq])).squeeze(1)
    anchors = balanced_anchors(cu, cand, args.blocks_per_seq, cp_size, torch.Generator().manual_seed(args.seed + 1),
                               block_size=args.block_size)
    layout = dflash_layout(cu, anchors, args.block_size, cp_size=cp_size)
    T, NBt = layout.total_len, layout.total_branch_tokens
    H, Hk, D = args.heads, args.kv_heads, args.head_dim
    move = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    tensors = [move(torch.randn(n, h, D, generator=g, dtype=torch.float64))
               for n, h in [(T, H), (T, Hk), (T, Hk), (NBt, H), (NBt, Hk), (NBt, Hk)]]
    weights = [move(torch.randn(T, H, D, generator=g, dtype=torch.float64)),
               move(torch.randn(NBt, H, D, generator=g, dtype=torch.float64))]
    return layout, tensors, weights


class OursPartition:
    """Rank `rank` of ours: its zigzag shards and branches; the ring replayed from every rank's K/V shard."""

    name = "ours"

    def __init__(self, layout, tensors, weights, rank, kv_shards):
        from cotrain.parallel import TorchBlockKernel, shard_branches, zigzag_shard

        self.layout, self.rank, self.kv_shards = layout, rank, kv_shards
        self.inputs = [zigzag_shard(t, layout, rank).detach().requires_grad_() for t in tensors[:3]]
        self.inputs += [shard_branches(t, layout, rank).detach().requires_grad_() for t in tensors[3:]]
        self.w = [zigzag_shard(weights[0], layout, rank), shard_branches(weights[1], layout, rank)]
        self.kernel = TorchBlockKernel()

    def input_bytes(self):
        return sum(t.numel() * t.element_size() for t in self.inputs)

    def _ring(self, group, tag=0):
        C, r = self.layout.cp_size, self.rank
        if tag == 2:  # dK/dV partial sums: shape and dtype only (module comment)
            return ReplayRing(lambda i, sent: sent)
        return ReplayRing(lambda i, sent: self.kv_shards[(r - i - 1) % C])

    def step(self):
        from unittest import mock

        import cotrain.parallel.branch_attention as ba

        for t in self.inputs:
            t.grad = None
        with mock.patch.object(ba, "RingComm", self._ring), \
                mock.patch.object(ba, "group_rank_and_size", lambda group: (self.rank, self.layout.cp_size)):
            out, _, bout, _ = ba.cp_branch_attention(*self.inputs, self.layout, None, kernel=self.kernel)
            ((out * self.w[0]).sum() + (bout * self.w[1]).sum()).backward()
        return out.detach(), bout.detach()

    def packed(self, out, bout):
        """(packed main rows, their outputs), (packed branch rows, their outputs)."""
        idx = self.layout.zigzag_index(self.rank)
        real = idx >= 0
        return (idx[real], out[real.to(out.device)]), (self.layout.local_branch_token_index(self.rank), bout)


class UspPartition:
    """Rank `rank` of the padded USP baseline after its Ulysses all-to-all: segment g of every padded
    sequence and its heads group (query heads [i H/u, (i+1) H/u)), the branches of its segment; the
    ring over segments replayed from the padded K/V."""

    name = "usp"

    def __init__(self, layout, tensors, weights, rank, cp_size, padded_kv):
        H, Hk = tensors[0].shape[1], tensors[1].shape[1]
        plan = object.__new__(Usp)  # Usp's plan only: its tensors are built here, on the device
        plan._plan(layout, rank, cp_size, Hk)
        plan.B = int(layout.branch_lens[0]) if layout.num_branches else 1
        plan.layout = layout
        plan._plan_calls(layout)
        plan.scale = tensors[0].shape[-1] ** -0.5
        plan.counter = None
        plan.attn = (tiled_fwd, tiled_bwd)
        plan.ring_comm = self._ring
        self.plan, self.layout, self.padded_kv = plan, layout, padded_kv
        u, g, i, seg = plan.u, plan.g, plan.i, plan.seg
        self.hq, self.hkv = slice(i * H // u, (i + 1) * H // u), slice(i * Hk // u, (i + 1) * Hk // u)
        self.rows = slice(g * seg, (g + 1) * seg)
        Lp = plan.Lp
        main = lambda t, h: pad_main(t, layout, Lp)[:, self.rows, h].contiguous()  # noqa: E731
        self.tok = self._tokens()
        branch = lambda t, h: t[self.tok.to(t.device)][None, :, h].contiguous()  # noqa: E731
        q, k, v, bq, bk, bv = tensors
        self.inputs = [main(q, self.hq), main(k, self.hkv), main(v, self.hkv)]
        self.inputs += [branch(bq, self.hq), branch(bk, self.hkv), branch(bv, self.hkv)]
        self.inputs = [t.requires_grad_() for t in self.inputs]
        self.w = [main(weights[0], self.hq), branch(weights[1], self.hq)]

    def _tokens(self):
        offs = self.layout.branch_offsets
        pieces = [torch.arange(int(offs[b]), int(offs[b + 1])) for b in self.plan.seg_ids.tolist()]
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)

    def input_bytes(self):
        return sum(t.numel() * t.element_size() for t in self.inputs)

    def _ring(self, tag):
        p = self.plan
        if p.ring == 1:
            return None
        if tag == 2:
            return ReplayRing(lambda i, sent: sent)
        return ReplayRing(lambda i, sent: self.padded_kv[(p.g - i - 1) % p.ring][:, :, :, self.hkv])

    def step(self):
        for t in self.inputs:
            t.grad = None
        out, bout = _UspRing.apply(*self.inputs, self.plan)
        ((out * self.w[0]).sum() + (bout * self.w[1]).sum()).backward()
        return out.detach(), bout.detach()

    def packed(self, out, bout):
        """As OursPartition.packed, for this rank's heads group only (the caller fills those heads)."""
        lens, cu = self.layout.seqlens.to(out.device), self.layout.cu_seqlens.to(out.device)
        pos = torch.arange(self.rows.start, self.rows.stop, device=out.device)[None, :].expand(self.layout.num_seqs, -1)
        real = pos < lens[:, None]
        idx = (cu[:-1, None] + pos)[real]
        return (idx, out[real]), (self.tok, bout[0])


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_partition(arm, device):
    """One step of one rank: wall seconds, and on CUDA the peak bytes the rank holds (its inputs plus
    everything the step allocates: buffers, saved tensors, gradients); None on CPU."""
    for t in arm.inputs:
        t.grad = None
    _sync(device)
    before = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    res = arm.step()
    _sync(device)
    wall = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) - before + arm.input_bytes() if device.type == "cuda" else None
    return wall, peak, res


def build_partitions(args, cp_size: int, device, dtype):
    """(layout, tensors, weights, {"ours": [rank 0 .. C-1], "usp": [...]}, the USP plan of rank 0)."""
    from cotrain.parallel import zigzag_shard

    layout, tensors, weights = partition_workload(args, cp_size, device, dtype)
    kv = [torch.stack([zigzag_shard(tensors[1], layout, r), zigzag_shard(tensors[2], layout, r)]) for r in range(cp_size)]
    probe = object.__new__(Usp)
    probe._plan(layout, 0, cp_size, args.kv_heads)
    seg = probe.seg
    padded = [pad_main(t, layout, probe.Lp) for t in tensors[1:3]]
    padded_kv = [torch.stack([p[:, s * seg:(s + 1) * seg] for p in padded]) for s in range(probe.ring)]
    del padded
    arms = {"ours": [OursPartition(layout, tensors, weights, r, kv) for r in range(cp_size)],
            "usp": [UspPartition(layout, tensors, weights, r, cp_size, padded_kv) for r in range(cp_size)]}
    return layout, tensors, weights, arms, probe


def assemble(layout, ranks, per_rank, H, D, device):
    """Packed (T, H, D) and (NBt, H, D) from every rank's (main, branch) results of one arm (outputs,
    or the gradients of q and bq): each rank fills its rows (USP: and its heads)."""
    out = torch.zeros(layout.total_len, H, D, device=device)
    bout = torch.zeros(layout.total_branch_tokens, H, D, device=device)
    for arm, (o, b) in zip(ranks, per_rank):
        (mi, mo), (bi, bo) = arm.packed(o, b)
        heads = getattr(arm, "hq", slice(None))
        out[mi.to(device), heads] = mo.float()
        bout[bi.to(device), heads] = bo.float()
    return out, bout


def run_partitions(args, cp_size: int, device, dtype) -> dict:
    """Every rank of ours and of USP at CP = cp_size on `device`: per rank median step time and peak
    memory over interleaved rounds (arm order alternating), and ours vs USP outputs by packed token."""
    layout, tensors, weights, arms, probe = build_partitions(args, cp_size, device, dtype)
    H, D = args.heads, args.head_dim
    outs = {}
    for name, ranks in arms.items():  # warm-up (plans cached), then the cross-check from the same step
        per_rank = []
        for arm in ranks:
            for _ in range(max(1, args.warmup)):
                res = arm.step()
            per_rank.append(res)
        outs[name] = assemble(layout, ranks, per_rank, H, D, device)
    wall = {a: [[] for _ in range(cp_size)] for a in arms}
    peak = {a: [None] * cp_size for a in arms}
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        for name in (ARMS_PARTITIONS if rnd % 2 == 0 else ARMS_PARTITIONS[::-1]):
            for r, arm in enumerate(arms[name]):
                w, pk, _ = measure_partition(arm, device)
                wall[name][r].append(w)
                if pk is not None:
                    peak[name][r] = pk if peak[name][r] is None else max(peak[name][r], pk)
        if args.budget_s and time.perf_counter() - t_start > args.budget_s / max(1, len(args.cp)):
            break  # enough rounds for this CP degree within the time budget
    diff = max(float((outs["ours"][0] - outs["usp"][0]).abs().max()), float((outs["ours"][1] - outs["usp"][1]).abs().max()))
    res = {"cp": cp_size, "ulysses": probe.u, "ring": probe.ring, "padded_len": probe.Lp, "rounds": len(wall["ours"][0]),
           "max_abs_diff_ours_vs_usp": diff, "arms": {}}
    for name in arms:
        med = [statistics.median(w) for w in wall[name]]
        res["arms"][name] = {"time_s_per_rank": med, "time_s_max_rank": max(med), "peak_bytes_per_rank": peak[name],
                             "peak_bytes_max_rank": max(peak[name]) if peak[name][0] is not None else None}
    o, u = res["arms"]["ours"], res["arms"]["usp"]
    res["usp_over_ours_time"] = u["time_s_max_rank"] / o["time_s_max_rank"]
    res["usp_over_ours_peak"] = (u["peak_bytes_max_rank"] / o["peak_bytes_max_rank"]) if o["peak_bytes_max_rank"] else None
    return res


ARMS_PARTITIONS = ("ours", "usp")


def partitions_main(args) -> dict:
    """--device cuda / --partitions: run_partitions for every CP degree, JSON into args.out_dir."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    results = [run_partitions(args, cp, device, dtype) for cp in args.cp]
    layout, _, _ = partition_workload(args, 1, "cpu", torch.float32)
    data = {
        "what": "CP branch attention, ours (packed zigzag ring) vs padded USP, every rank's share of one step "
                "(forward + backward) computed in turn on one device: no communication; both arms plain torch tiles",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": args.dtype, "kernel": "TorchBlockKernel / tiled_fwd (fp32 accumulation)",
        "workload": {"seqlens": layout.seqlens.tolist(), "tokens": layout.total_len, "branches": layout.num_branches,
                     "block_size": args.block_size, "heads": args.heads, "kv_heads": args.kv_heads,
                     "head_dim": args.head_dim},
        "command": "python bench/cp_attention.py " + " ".join(sys.argv[1:]),
        "seconds": None, "results": results,
    }
    data["seconds"] = time.perf_counter() - t0
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"cp_attention_partitions_{device.type}.json"
    path.write_text(json.dumps(data, indent=1))
    for r in results:
        o, u = r["arms"]["ours"], r["arms"]["usp"]
        mem = f", peak {u['peak_bytes_max_rank'] / 2**20:.0f} vs {o['peak_bytes_max_rank'] / 2**20:.0f} MiB " \
              f"(USP / ours {r['usp_over_ours_peak']:.2f}x)" if r["usp_over_ours_peak"] else ""
        print(f"CP {r['cp']}: slowest rank USP {u['time_s_max_rank'] * 1e3:.1f} ms vs ours {o['time_s_max_rank'] * 1e3:.1f} ms "
              f"(USP / ours {r['usp_over_ours_time']:.2f}x){mem}; outputs differ by {r['max_abs_diff_ours_vs_usp']:.1e}")
    print(f"wrote {path}")
    return data


# ----- per rank -------------------------------------------------------------------------------------------

def _new_groups(cp_size, u):
    """Ulysses groups (consecutive ranks) and ring groups (same index in every Ulysses group)."""
    groups = {}
    for g in range(cp_size // u):
        groups[("u", g)] = dist.new_group([g * u + i for i in range(u)])
    for i in range(u):
        groups[("r", i)] = dist.new_group([g * u + i for g in range(cp_size // u)])
    return groups


def _timed(fn):
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    c1 = time.process_time()
    dist.barrier()
    return time.perf_counter() - t0, c1 - c0


def build_arms(layout, tensors, weights, rank, cp_size, groups):
    return {
        "ours": Ours(layout, tensors, weights, rank),
        "allgather": AllGather(layout, tensors, weights, rank, cp_size),
        "usp": Usp(layout, tensors, weights, rank, cp_size, groups),
    }


def bf16_bytes_and_error(args, rank, cp_size, groups):
    """bf16 inputs: bytes of every arm, and ours' dK/dV error with fp32 vs bf16 gradient communication
    (reference: ours on the same inputs in fp64, which the tests check against the dense oracle)."""
    from cotrain.parallel import CPStats

    layout, tensors, weights = make_workload(args, cp_size, torch.bfloat16)
    res = {}
    ref = Ours(layout, [t.double() for t in tensors], [w.double() for w in weights], rank)
    ref.step()
    for name, comm in (("fp32", None), ("bf16", torch.bfloat16)):
        arm = Ours(layout, tensors, weights, rank, grad_comm_dtype=comm)
        stats = CPStats()
        arm.step(stats)
        err = {}
        for label, i in (("dk", 1), ("dv", 2)):
            real = layout.zigzag_index(rank) >= 0
            a, b = arm.grads()[i][real].double(), ref.grads()[i][real]
            err[label] = [float((a - b).abs().max()), float(b.abs().max())]
        res[f"ours_grad_comm_{name}"] = {"bytes": [stats.bytes_sent_forward, stats.bytes_sent_backward], "err": err}
    for name in BASELINES:
        arm = build_arms(layout, tensors, weights, rank, cp_size, groups)[name]
        arm.step(count=True)
        res[name] = {"bytes": [arm.bytes_fwd, arm.bytes_bwd]}
    return res


# ----- drafter-style calls: with vs without main queries ---------------------------------------------------

DRAFTER_ARMS = ("with_main", "no_main")


class DrafterCall:
    """One drafter attention call on this rank's shards, the loss on the branch outputs only.

    with_main: q = zeros (what BlockDrafter.backbone passed before q=None: all main tiles computed,
    their outputs thrown away; q needs no gradient); no_main: q=None (branch tiles only)."""

    def __init__(self, layout, tensors, weights, rank, main: bool):
        from cotrain.parallel import shard_branches, zigzag_shard

        self.layout = layout
        self.q = torch.zeros_like(zigzag_shard(tensors[0], layout, rank)) if main else None
        self.inputs = [zigzag_shard(t, layout, rank).requires_grad_() for t in tensors[1:3]]
        self.inputs += [shard_branches(t, layout, rank).requires_grad_() for t in tensors[3:]]
        self.bw = shard_branches(weights[1], layout, rank)

    def step(self, stats=None):
        from cotrain.parallel import cp_branch_attention

        for t in self.inputs:
            t.grad = None
        _, _, bout, _ = cp_branch_attention(self.q, *self.inputs, self.layout, None, stats=stats)
        (bout * self.bw).sum().backward()
        return bout.detach()


def drafter_workloads(args) -> dict:
    """name -> (seqlens, prompt lengths): the timing workload's batch, and one long sequence."""
    seqlens, prompt, _ = make_batch(args.seed, args.num_seqs, args.min_len, args.max_len)
    long = torch.tensor([args.long_len])
    return {"mixed": (seqlens, prompt), "long": (long, torch.tensor([min(args.long_len // 16, 256)]))}


def drafter_layout(args, seqlens, prompt, cp_size):
    from cotrain.parallel import balanced_anchors, dflash_layout

    batch = draft_batch(seqlens, prompt)
    anchors = balanced_anchors(batch.cu_seqlens, dflash_candidates(batch), args.blocks_per_seq, cp_size,
                               torch.Generator().manual_seed(args.seed + 1), block_size=args.block_size)
    layout = dflash_layout(batch.cu_seqlens, anchors, args.block_size, cp_size=cp_size)
    g = torch.Generator().manual_seed(args.seed + 2)
    T, NBt = layout.total_len, layout.total_branch_tokens
    H, Hk, D = args.heads, args.kv_heads, args.head_dim
    tensors = [torch.randn(n, h, D, generator=g) for n, h in [(T, H), (T, Hk), (T, Hk), (NBt, H), (NBt, Hk), (NBt, Hk)]]
    weights = [None, torch.randn(NBt, H, D, generator=g)]
    return layout, tensors, weights


def drafter_measure(args, rank, cp_size) -> dict:
    """Per workload: interleaved rounds of the two drafter calls (order alternated), wall/CPU per round,
    pairs and bytes (CPStats), and the largest difference between their branch outputs / input gradients."""
    from cotrain.parallel import CPStats

    out = {}
    for name, (seqlens, prompt) in drafter_workloads(args).items():
        layout, tensors, weights = drafter_layout(args, seqlens, prompt, cp_size)
        arms = {a: DrafterCall(layout, tensors, weights, rank, a == "with_main") for a in DRAFTER_ARMS}
        res = {"tokens": layout.total_len, "branches": layout.num_branches, "wall": {a: [] for a in DRAFTER_ARMS},
               "cpu": {a: [] for a in DRAFTER_ARMS}, "pairs": {}, "pairs_allowed": {}, "bytes": {}}
        results = {}
        for a in DRAFTER_ARMS:  # counting step (and warm-up: plans cached)
            stats = CPStats()
            bout = arms[a].step(stats)
            res["pairs"][a], res["pairs_allowed"][a] = stats.pairs_computed, stats.pairs_allowed
            res["bytes"][a] = [stats.bytes_sent_forward, stats.bytes_sent_backward]
            results[a] = [bout] + [t.grad.clone() for t in arms[a].inputs]
        res["max_diff"] = max((float((x - y).abs().max()) if x.numel() else 0.0)
                              for x, y in zip(results["with_main"], results["no_main"]))
        for i in range(args.drafter_rounds):
            for a in (DRAFTER_ARMS if i % 2 == 0 else DRAFTER_ARMS[::-1]):
                wall, cpu = _timed(arms[a].step)
                res["wall"][a].append(wall)
                res["cpu"][a].append(cpu)
        out[name] = res
    return out


def summarize_drafter(cp_size: int, ranks: list[dict]) -> dict:
    rows = {}
    for name in ranks[0]["drafter"]:
        per = [r["drafter"][name] for r in ranks]
        n = len(per[0]["wall"]["no_main"])
        row = {"cp": cp_size, "tokens": per[0]["tokens"], "branches": per[0]["branches"], "rounds": n, "arms": {},
               "max_diff": max(p["max_diff"] for p in per)}
        rounds = {}
        for a in DRAFTER_ARMS:
            wall = [max(p["wall"][a][i] for p in per) for i in range(n)]
            cpu = [sum(p["cpu"][a][i] for p in per) for i in range(n)]
            rounds[a] = (wall, cpu)
            pairs = [p["pairs"][a] for p in per]
            row["arms"][a] = {"wall_s": spread(wall), "cpu_s": spread(cpu), "pairs_per_rank": pairs, "pairs_max": max(pairs),
                              "pairs_total": sum(pairs), "pairs_allowed_total": sum(p["pairs_allowed"][a] for p in per),
                              "bytes_fwd": max(p["bytes"][a][0] for p in per), "bytes_bwd": max(p["bytes"][a][1] for p in per)}
        row["ratios"] = {
            "wall": spread([x / y for x, y in zip(rounds["no_main"][0], rounds["with_main"][0])]),
            "cpu": spread([x / y for x, y in zip(rounds["no_main"][1], rounds["with_main"][1])]),
            "pairs_total": row["arms"]["no_main"]["pairs_total"] / row["arms"]["with_main"]["pairs_total"],
        }
        rows[name] = row
    return rows


def rank_drafter_only(rank, cp_size, port, args, outdir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp_size)
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump({"rank": rank, "drafter": drafter_measure(args, rank, cp_size)}, f)
    dist.destroy_process_group()


def run_cp_drafter_only(cp_size: int, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(rank_drafter_only, args=(cp_size, free_port(), args, outdir), nprocs=cp_size, join=True,
                           start_method="spawn")
        return [json.load(open(os.path.join(outdir, f"{r}.json"))) for r in range(cp_size)]


def rank_main(rank, cp_size, port, args, outdir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp_size)
    from cotrain.parallel import CPStats, ring_plan

    layout, tensors, weights = make_workload(args, cp_size)
    u = math.gcd(cp_size, args.kv_heads)
    groups = _new_groups(cp_size, u)
    arms = build_arms(layout, tensors, weights, rank, cp_size, groups)
    result = {"rank": rank, "ulysses": u, "ring": cp_size // u, "bytes": {}, "pairs": {}, "pairs_allowed_ours": 0,
              "wall": {a: [] for a in ARMS}, "cpu": {a: [] for a in ARMS}, "peak": {a: [] for a in ARMS}}

    # Counting step (also the warm-up: plans cached, first-call allocations done).
    stats = CPStats()
    arms["ours"].step(stats)
    result["bytes"]["ours"] = [stats.bytes_sent_forward, stats.bytes_sent_backward]
    result["pairs"]["ours"] = stats.pairs_computed
    result["pairs_allowed_ours"] = stats.pairs_allowed
    exact = ring_plan(layout, rank, tile_cost_pairs=0)  # what a kernel with free tiles (varlen) would get
    result["pairs_exact_plan_ours"] = sum(m.pairs_computed() for m in exact.ring_masks + [exact.intra_mask] if m is not None)
    for name in BASELINES:
        arms[name].step(count=True)
        result["bytes"][name] = [arms[name].bytes_fwd, arms[name].bytes_bwd]
        result["pairs"][name] = arms[name].pairs()
    for _ in range(args.warmup):
        for name in ARMS:
            arms[name].step()

    # Memory, then time: arms interleaved round by round, the order rotated every round.
    for i in range(args.mem_rounds):
        for name in ARMS[i % 3:] + ARMS[: i % 3]:
            dist.barrier()
            before = _reset_peak()
            arms[name].step()
            result["peak"][name].append(_peak_since(before))
    for i in range(args.rounds):
        for name in ARMS[i % 3:] + ARMS[: i % 3]:
            wall, cpu = _timed(arms[name].step)
            result["wall"][name].append(wall)
            result["cpu"][name].append(cpu)

    # Outputs and input gradients of every arm, by packed token, for the cross-check in the parent.
    check = {}
    for name in ARMS:
        out, bout = arms[name].step()
        midx, bidx = arms[name].token_map()
        grads = arms[name].grads()
        mreal = midx >= 0
        main_vals = [out.reshape(-1, *out.shape[-2:])] + grads[:3]
        branch_vals = [bout.reshape(-1, *bout.shape[-2:])] + grads[3:]
        check[name] = (midx[mreal], [t[mreal] for t in main_vals], bidx, branch_vals)
    torch.save(check, os.path.join(outdir, f"{rank}.pt"))
    if args.bf16_bytes:
        result["bf16"] = bf16_bytes_and_error(args, rank, cp_size, groups)
    if args.drafter_rounds:
        result["drafter"] = drafter_measure(args, rank, cp_size)
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cp(cp_size: int, args) -> tuple[list[dict], dict]:
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(rank_main, args=(cp_size, free_port(), args, outdir), nprocs=cp_size, join=True, start_method="spawn")
        ranks = [json.load(open(os.path.join(outdir, f"{r}.json"))) for r in range(cp_size)]
        checks = [torch.load(os.path.join(outdir, f"{r}.pt")) for r in range(cp_size)]
    diffs = {}
    gathered = {}
    for name in ARMS:
        midx = torch.cat([c[name][0] for c in checks])
        bidx = torch.cat([c[name][2] for c in checks])
        mo, bo = torch.argsort(midx), torch.argsort(bidx)
        gathered[name] = ([torch.cat([c[name][1][j] for c in checks])[mo] for j in range(4)],
                          [torch.cat([c[name][3][j] for c in checks])[bo] for j in range(4)])
    for name in BASELINES:
        labels = ["out", "dq", "dk", "dv"], ["bout", "dbq", "dbk", "dbv"]
        for part in (0, 1):
            for label, a, b in zip(labels[part], gathered["ours"][part], gathered[name][part]):
                diffs.setdefault(name, {})[label] = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    return ranks, diffs


# ----- summaries ------------------------------------------------------------------------------------------

def spread(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(cp_size: int, ranks: list[dict], diffs: dict) -> dict:
    rounds = len(ranks[0]["wall"]["ours"])
    row = {"cp": cp_size, "ulysses": ranks[0]["ulysses"], "ring": ranks[0]["ring"], "rounds": rounds, "arms": {}}
    per_round = {}
    for a in ARMS:
        wall = [max(r["wall"][a][i] for r in ranks) for i in range(rounds)]  # a step ends when its slowest rank does
        cpu = [sum(r["cpu"][a][i] for r in ranks) for i in range(rounds)]  # CPU work of all ranks
        peak = [max(r["peak"][a][i] for r in ranks) for i in range(len(ranks[0]["peak"][a]))]
        pairs = [r["pairs"][a] for r in ranks]
        per_round[a] = (wall, cpu)
        row["arms"][a] = {
            "wall_s": spread(wall), "cpu_s": spread(cpu), "peak_mem_bytes": spread(peak),
            "bytes_fwd": max(r["bytes"][a][0] for r in ranks), "bytes_bwd": max(r["bytes"][a][1] for r in ranks),
            "pairs_per_rank": pairs, "pairs_max": max(pairs),
            "pairs_balance": max(pairs) / (sum(pairs) / len(pairs)) if sum(pairs) else 1.0,
        }
    allowed = [r["pairs_allowed_ours"] for r in ranks]
    row["arms"]["ours"]["pairs_allowed_per_rank"] = allowed
    row["arms"]["ours"]["allowed_balance"] = max(allowed) / (sum(allowed) / len(allowed))
    row["arms"]["ours"]["computed_over_allowed"] = sum(row["arms"]["ours"]["pairs_per_rank"]) / sum(allowed)
    row["arms"]["ours"]["computed_over_allowed_exact_plan"] = sum(r["pairs_exact_plan_ours"] for r in ranks) / sum(allowed)
    row["ratios"] = {}
    for b in BASELINES:
        o, p = row["arms"]["ours"], row["arms"][b]
        tot = lambda x: x["bytes_fwd"] + x["bytes_bwd"]  # noqa: E731
        row["ratios"][b] = {
            "wall": spread([x / y for x, y in zip(per_round["ours"][0], per_round[b][0])]),
            "cpu": spread([x / y for x, y in zip(per_round["ours"][1], per_round[b][1])]),
            "peak_mem": o["peak_mem_bytes"]["median"] / max(1, p["peak_mem_bytes"]["median"]),
            "bytes_fwd": o["bytes_fwd"] / p["bytes_fwd"] if p["bytes_fwd"] else None,
            "bytes_total": tot(o) / tot(p) if tot(p) else None,
            "pairs_max": o["pairs_max"] / p["pairs_max"],
        }
    row["max_diff_vs_baseline"] = max(max(d.values()) for d in diffs.values())
    row["diffs_vs_ours"] = diffs
    if "bf16" in ranks[0]:
        bf = {}
        for key in ranks[0]["bf16"]:
            bf[key] = {"bytes_fwd": max(r["bf16"][key]["bytes"][0] for r in ranks),
                       "bytes_bwd": max(r["bf16"][key]["bytes"][1] for r in ranks)}
            if "err" in ranks[0]["bf16"][key]:
                bf[key]["max_abs_err"] = {g: max(r["bf16"][key]["err"][g][0] for r in ranks) for g in ("dk", "dv")}
                bf[key]["max_abs_ref"] = {g: max(r["bf16"][key]["err"][g][1] for r in ranks) for g in ("dk", "dv")}
        row["bf16"] = bf
    row["per_rank"] = ranks
    return row


def balance_report(args) -> dict:
    """Work balance (max / mean of visible pairs per rank) of the drafters' real layouts, over batches."""
    from cotrain.parallel import balanced_anchors, dflash_layout, eagle3_ttt_layout, work_imbalance
    from cotrain.draft.eagle3 import Eagle3Drafter

    out = {"batches": args.balance_batches, "dflash": {}, "eagle3": {}}
    stats = lambda xs: {"median": statistics.median(xs), "p95": sorted(xs)[int(0.95 * (len(xs) - 1))], "max": max(xs)}  # noqa: E731
    for C in args.balance_cp:
        rand, bal, eagle = [], [], []
        for i in range(args.balance_batches):
            seqlens, prompt, _ = make_batch(10_000 + i, args.num_seqs, args.min_len, args.max_len)
            batch = draft_batch(seqlens, prompt)
            g = torch.Generator().manual_seed(i)
            a = drafter_random_anchors(batch, args.blocks_per_seq, g)
            rand.append(work_imbalance(dflash_layout(batch.cu_seqlens, a, args.block_size, cp_size=C)))
            b = balanced_anchors(batch.cu_seqlens, dflash_candidates(batch), args.blocks_per_seq, C, g, block_size=args.block_size)
            bal.append(work_imbalance(dflash_layout(batch.cu_seqlens, b, args.block_size, cp_size=C)))
            pos = Eagle3Drafter.chain_anchors(None, batch)
            eagle.append(work_imbalance(eagle3_ttt_layout(batch.cu_seqlens, args.ttt_passes, positions=pos, cp_size=C)))
        out["dflash"][str(C)] = {"random": stats(rand), "balanced": stats(bal)}
        out["eagle3"][str(C)] = stats(eagle)
    return out


# ----- report ---------------------------------------------------------------------------------------------

def _ms(x):
    return f"{x['median'] * 1e3:.0f} [{x['min'] * 1e3:.0f}, {x['max'] * 1e3:.0f}]"


def _ratio(x):
    return f"{x['median']:.2f} [{x['min']:.2f}, {x['max']:.2f}]"


def markdown(data: dict) -> str:
    """The docs' tables, from the bench's JSON (a --drafter-only JSON has only the drafter table)."""
    rows, cfg = data.get("results", []), data["config"]
    lines = [] if not rows else [f"Workload: {cfg['num_seqs']} sequences of lengths {', '.join(map(str, cfg['seqlens']))} "
             f"({sum(cfg['seqlens']):,} tokens), {cfg['num_branches']} DFlash blocks of {cfg['block_size']} "
             f"({cfg['anchors']} anchors), H = {cfg['heads']}, Hk = {cfg['kv_heads']}, D = {cfg['head_dim']}, fp32, "
             f"{cfg['rounds']} interleaved rounds, {cfg['cpu_count']} CPU cores.", ""]
    if rows:
        lines += _arm_tables(data)
    dr = data.get("drafter")
    if dr:
        lines += _drafter_table(data)
    if rows:
        lines += ["", "Ours, query-key pairs computed / allowed by the rule (all ranks): "
                  + ", ".join(f"CP {r['cp']}: {r['arms']['ours']['computed_over_allowed']:.3f} "
                              f"(tile_cost_pairs = 0: {r['arms']['ours']['computed_over_allowed_exact_plan']:.3f})" for r in rows) + "."]
        lines += ["", "Cross-check, max |ours - baseline| over outputs and all input gradients: "
                  + ", ".join(f"CP {r['cp']}: {r['max_diff_vs_baseline']:.1e}" for r in rows) + "."]
    return "\n".join(lines)


def _arm_tables(data: dict) -> list[str]:
    rows, cfg = data["results"], data["config"]
    lines = []
    lines += ["Time per step, median [min, max] over rounds (wall: slowest rank; CPU: summed over ranks):", "",
              "| CP | USP (u x ring) | wall ms ours | wall ms allgather | wall ms usp | CPU ms ours | CPU ms allgather | CPU ms usp |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["arms"]
        lines.append(f"| {r['cp']} | {r['ulysses']} x {r['ring']} | " + " | ".join(_ms(a[x]["wall_s"]) for x in ARMS) + " | "
                     + " | ".join(_ms(a[x]["cpu_s"]) for x in ARMS) + " |")
    lines += ["", "Ratios ours / baseline (time: per-round paired ratios, median [min, max]):", "",
              "| CP | baseline | wall | CPU | peak mem | bytes fwd | bytes fwd+bwd | pairs (max rank) |", "|---|---|---|---|---|---|---|---|"]
    f2 = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for r in rows:
        for b in BASELINES:
            x = r["ratios"][b]
            lines.append(f"| {r['cp']} | {b} | {_ratio(x['wall'])} | {_ratio(x['cpu'])} | {f2(x['peak_mem'])} | "
                         f"{f2(x['bytes_fwd'])} | {f2(x['bytes_total'])} | {f2(x['pairs_max'])} |")
    lines += ["", "Absolute: peak MiB per rank (median over rounds), KiB sent per rank fwd / fwd+bwd, pairs balance (max / mean over ranks):", "",
              "| CP | arm | peak MiB | KiB fwd | KiB fwd+bwd | pairs max rank | balance |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for x in ARMS:
            a = r["arms"][x]
            lines.append(f"| {r['cp']} | {x} | {a['peak_mem_bytes']['median'] / 2**20:.1f} | {a['bytes_fwd'] / 1024:.0f} | "
                         f"{(a['bytes_fwd'] + a['bytes_bwd']) / 1024:.0f} | {a['pairs_max']:,} | {a['pairs_balance']:.3f} |")
    if "bf16" in rows[-1]:
        lines += ["", "bf16 inputs: KiB sent per rank fwd+bwd, and ours' dK/dV max abs error against ours in fp64 (|ref| max in brackets):", "",
                  "| CP | ours (dK/dV fp32) | ours (grad_comm_dtype=bf16) | allgather | usp | ours/allgather fp32 / bf16 comm | ours/usp fp32 / bf16 comm | dK err fp32 / bf16 comm | dV err fp32 / bf16 comm |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["cp"] == 1 or "bf16" not in r:
                continue
            b = r["bf16"]
            t = {k: (v["bytes_fwd"] + v["bytes_bwd"]) for k, v in b.items()}
            e32, e16 = b["ours_grad_comm_fp32"], b["ours_grad_comm_bf16"]
            lines.append(
                f"| {r['cp']} | {t['ours_grad_comm_fp32'] / 1024:.0f} | {t['ours_grad_comm_bf16'] / 1024:.0f} | {t['allgather'] / 1024:.0f} | "
                f"{t['usp'] / 1024:.0f} | {t['ours_grad_comm_fp32'] / t['allgather']:.2f} / {t['ours_grad_comm_bf16'] / t['allgather']:.2f} | "
                f"{t['ours_grad_comm_fp32'] / t['usp']:.2f} / {t['ours_grad_comm_bf16'] / t['usp']:.2f} | "
                f"{e32['max_abs_err']['dk']:.1e} / {e16['max_abs_err']['dk']:.1e} [{e32['max_abs_ref']['dk']:.1f}] | "
                f"{e32['max_abs_err']['dv']:.1e} / {e16['max_abs_err']['dv']:.1e} [{e32['max_abs_ref']['dv']:.1f}] |")
    bal = data.get("balance")
    if bal:
        lines += ["", f"Work balance of the drafters' layouts, max / mean visible pairs per rank over {bal['batches']} batches "
                  "(median / p95 / max):", "",
                  "| CP | DFlash, drafter's uniform draw | DFlash, balanced_anchors | EAGLE-3 TTT (every supervised position) |", "|---|---|---|---|"]
        f3 = lambda s: f"{s['median']:.3f} / {s['p95']:.3f} / {s['max']:.3f}"  # noqa: E731
        for C in bal["dflash"]:
            d = bal["dflash"][C]
            lines.append(f"| {C} | {f3(d['random'])} | {f3(d['balanced'])} | {f3(bal['eagle3'][C])} |")
    return lines


def _drafter_table(data: dict) -> list[str]:
    dr, cfg = data["drafter"], data["config"]
    lines = []
    first = next(iter(dr.values()))[0]
    lines += ["", f"Drafter-style calls (branch outputs only, the loss on them; {cfg['block_size']}-token DFlash blocks, "
              f"{cfg['blocks_per_seq']} per sequence, balanced_anchors): with main queries (q = zeros, as the block drafters "
              f"called it before) vs without (q=None); {first['rounds']} interleaved rounds, time median [min, max], "
              "ratios per-round paired q=None / q = zeros; pairs summed over ranks:", "",
              "| workload | CP | tokens / blocks | wall ms, q = zeros | wall ms, q=None | wall ratio | CPU ms, q = zeros | "
              "CPU ms, q=None | CPU ratio | pairs, q = zeros | pairs, q=None (allowed) | max diff |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rws in dr.items():
        for r in rws:
            w, n = r["arms"]["with_main"], r["arms"]["no_main"]
            lines.append(f"| {name} | {r['cp']} | {r['tokens']:,} / {r['branches']} | {_ms(w['wall_s'])} | {_ms(n['wall_s'])} | "
                         f"{_ratio(r['ratios']['wall'])} | {_ms(w['cpu_s'])} | {_ms(n['cpu_s'])} | {_ratio(r['ratios']['cpu'])} | "
                         f"{w['pairs_total']:,} | {n['pairs_total']:,} ({n['pairs_allowed_total']:,}) | {r['max_diff']:.1e} |")
    return lines


def plot(data: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["results"]
    cps = [r["cp"] for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    styles = {"ours": ("o-", "packed zigzag ring (ours)"), "allgather": ("s--", "padded all-gather"), "usp": ("^:", "padded USP (Ulysses + ring)")}

    def spread_panel(ax, key, scale, title):
        for a, (st, label) in styles.items():
            med = [r["arms"][a][key]["median"] * scale for r in rows]
            lo = [med[i] - rows[i]["arms"][a][key]["min"] * scale for i in range(len(rows))]
            hi = [rows[i]["arms"][a][key]["max"] * scale - med[i] for i in range(len(rows))]
            ax.errorbar(cps, med, yerr=[lo, hi], fmt=st, capsize=3, label=label)
        ax.set_title(title, fontsize=10)

    spread_panel(axes[0, 0], "wall_s", 1e3, "wall ms per step (median, min-max)")
    spread_panel(axes[0, 1], "cpu_s", 1e3, "CPU ms per step, all ranks (median, min-max)")
    spread_panel(axes[0, 2], "peak_mem_bytes", 1 / 2**20, "peak MiB per rank")
    ax = axes[1, 0]
    for a, (st, label) in styles.items():
        ax.plot(cps, [(r["arms"][a]["bytes_fwd"] + r["arms"][a]["bytes_bwd"]) / 2**20 for r in rows], st, label=label)
    ax.set_title("MiB sent per rank, fwd+bwd (fp32)", fontsize=10)
    ax = axes[1, 1]
    for a, (st, label) in styles.items():
        ax.plot(cps, [r["arms"][a]["pairs_max"] / 1e6 for r in rows], st, label=label)
    ax.set_title("query-key pairs of the busiest rank (M)", fontsize=10)
    for ax in list(axes[0]) + list(axes[1, :2]):
        ax.set_xlabel("CP size")
        ax.set_xticks(cps)
        ax.grid(alpha=0.3)
    axes[0, 2].legend(fontsize=8, loc="upper right")
    ax = axes[1, 2]
    bal = data.get("balance")
    if bal:
        Cs = list(bal["dflash"])
        x = range(len(Cs))
        for off, key, label in ((-0.2, "random", "DFlash, uniform draw"), (0.2, "balanced", "DFlash, balanced_anchors")):
            med = [bal["dflash"][C][key]["median"] for C in Cs]
            top = [bal["dflash"][C][key]["max"] - m for C, m in zip(Cs, med)]
            ax.bar([i + off for i in x], [m - 1 for m in med], 0.38, bottom=1, yerr=[[0] * len(Cs), top], capsize=3, label=label)
        ax.axhline(1.05, color="k", lw=0.8, ls="--")
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"CP {C}" for C in Cs])
        ax.set_ylim(0.99, None)
        ax.set_title(f"work max/mean per rank, {bal['batches']} batches (median, bar to max)", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("CP branch attention vs padded baselines (CPU, gloo, fp32, DFlash blocks; arms interleaved)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=None, help="CP degrees (default 1 2 4; 2 4 8 with --device cuda)")
    p.add_argument("--num-seqs", type=int, default=8)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--blocks-per-seq", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--anchors", choices=["balanced", "random"], default="balanced",
                   help="timing workload: balanced_anchors (default) or the drafter's uniform draw")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--rounds", type=int, default=21, help="timed rounds (each runs every arm once, order rotated)")
    p.add_argument("--mem-rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--ttt-passes", type=int, default=3, help="EAGLE-3 TTT passes for the balance report")
    p.add_argument("--balance-batches", type=int, default=200)
    p.add_argument("--balance-cp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--no-bf16-bytes", dest="bf16_bytes", action="store_false")
    p.add_argument("--drafter-rounds", type=int, default=11,
                   help="interleaved rounds of the drafter-style calls with vs without main queries (0: skip)")
    p.add_argument("--long-len", type=int, default=4096, help="length of the drafter comparison's long sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--drafter-only", action="store_true",
                   help="only the drafter-style calls with vs without main queries (JSON: bench/results/cp_attention_drafter.json)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON to write (default bench/results/cp_attention.json; cp_attention_drafter.json with --drafter-only)")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "img" / "cp_attention.png")
    p.add_argument("--report", type=Path, help="from this JSON: print the docs' markdown tables, redraw --png, exit")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: every CP rank's share computed in turn on one GPU (the partitions mode, ours vs USP)")
    p.add_argument("--partitions", action="store_true", help="the partitions mode on --device (cpu: a smoke run)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="partitions mode: input dtype (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--preset", choices=["qwen3-0.6b", "none"], default=None,
                   help="partitions mode workload (default qwen3-0.6b with --device cuda): 8 sequences of 512-4096 "
                        "tokens, 8 DFlash blocks of 16 each, Qwen3-0.6B's attention (16 query heads, 8 KV heads, head dim 128)")
    p.add_argument("--budget-s", type=float, default=30.0, help="partitions mode: timed rounds stop past this (all CP degrees)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results",
                   help="partitions mode: folder of cp_attention_partitions_<device>.json (--out DIR: the same)")
    args = p.parse_args()
    if args.device == "cuda" or args.partitions:
        args.cp = args.cp or ([2, 4, 8] if args.device == "cuda" else [1, 2, 4])
        args.out_dir = args.out or args.out_dir  # the GPU check's interface: --device cuda --out DIR
        if args.preset == "qwen3-0.6b" or (args.preset is None and args.device == "cuda"):
            args.num_seqs, args.min_len, args.max_len, args.blocks_per_seq, args.block_size = 8, 512, 4096, 8, 16
            args.heads, args.kv_heads, args.head_dim = 16, 8, 128
        if args.quick:
            args.num_seqs, args.min_len, args.max_len, args.rounds, args.warmup = 4, 8, 64, 2, 1
        args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
        partitions_main(args)
        return
    args.cp = args.cp or [1, 2, 4]
    if args.report:
        data = json.loads(args.report.read_text())
        print(markdown(data))
        if data.get("results"):
            plot(data, args.png)
        return
    if args.quick:
        args.num_seqs, args.min_len, args.max_len, args.rounds, args.mem_rounds, args.warmup = 4, 8, 64, 2, 1, 0
        args.balance_batches, args.balance_cp = 5, [2, 4]
        args.drafter_rounds, args.long_len = min(args.drafter_rounds, 2), 256

    from tqdm import tqdm

    if args.drafter_only:
        drafter = {}
        for cp in tqdm(args.cp, desc="CP degrees", disable=not args.progress):
            for name, row in summarize_drafter(cp, run_cp_drafter_only(cp, args)).items():
                drafter.setdefault(name, []).append(row)
                if row["max_diff"] > 1e-4:
                    raise SystemExit(f"drafter call {name}, CP {cp}: q=None differs from q=zeros by {row['max_diff']:.1e}")
        config = recorded_args(args)
        config.update(torch=torch.__version__, threads_per_rank=1, cpu_count=os.cpu_count(),
                      command="python bench/cp_attention.py " + " ".join(sys.argv[1:]))
        out = args.out or ROOT / "bench" / "results" / "cp_attention_drafter.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"config": config, "drafter": drafter}, indent=1))
        print(markdown({"config": config, "drafter": drafter}))
        print(f"wrote {out}")
        return
    args.out = args.out or ROOT / "bench" / "results" / "cp_attention.json"

    rows, drafter = [], {}
    for cp in tqdm(args.cp, desc="CP degrees", disable=not args.progress):
        ranks, diffs = run_cp(cp, args)
        rows.append(summarize(cp, ranks, diffs))
        if "drafter" in ranks[0]:
            for name, row in summarize_drafter(cp, ranks).items():
                drafter.setdefault(name, []).append(row)
                if row["max_diff"] > 1e-4:
                    raise SystemExit(f"drafter call {name}, CP {cp}: q=None differs from q=zeros by {row['max_diff']:.1e}")
    balance = balance_report(args)

    config = recorded_args(args)
    layout, _, _ = make_workload(args, 1)
    config["seqlens"] = layout.seqlens.tolist()
    config["num_branches"] = layout.num_branches
    config["torch"] = torch.__version__
    config["threads_per_rank"] = 1
    config["cpu_count"] = os.cpu_count()
    config["command"] = "python bench/cp_attention.py " + " ".join(sys.argv[1:])
    data = {"config": config, "results": rows, "balance": balance}
    if drafter:
        data["drafter"] = drafter
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    plot(data, args.png)
    print(markdown(data))
    print(f"wrote {args.out} and {args.png}")


if __name__ == "__main__":
    main()
