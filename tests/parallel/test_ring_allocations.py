"""The ring's backward allocates its accumulators once, not per ring step (CP = 2 and 4, gloo).

The tensor-creating torch calls the ring's backward makes itself (module
cotrain.parallel.branch_attention: torch.zeros, empty, empty_like, zeros_like, stack, cat) are
counted, and every receive is watched: the count is the same at CP = 2 and CP = 4 (one and three
ring steps after the rank's own shard), every receive lands in a buffer allocated before the loop,
and the kernel is handed the same accumulators (one dQ; dK/dV from the rank's own buffer and two
travelling ones). The gradients equal the dense oracle's.
"""

import torch
from _cp_dist import run_world

import cotrain.parallel.branch_attention as ba
from cotrain.parallel import (cp_branch_attention, cu_seqlens_from_lengths, dense_branch_attention, dflash_layout,
                              shard_branches, zigzag_shard)
from cotrain.parallel.kernels import TorchBlockKernel
from cotrain.parallel.ring import RingComm

ALLOCATORS = ("zeros", "empty", "empty_like", "zeros_like", "stack", "cat")


class _CountingTorch:
    """The torch module as the ring's module sees it, counting the tensor-creating calls."""

    def __init__(self):
        self.count = 0

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in ALLOCATORS:
            return attr

        def counted(*a, **k):
            self.count += 1
            return attr(*a, **k)

        return counted


class _SpyKernel(TorchBlockKernel):
    def __init__(self):
        self.storages = []

    def backward(self, *args, grads=None, **kw):
        self.storages.append(None if grads is None else tuple(g.untyped_storage().data_ptr() for g in grads))
        return super().backward(*args, grads=grads, **kw)


def worker(rank, world):
    cu = cu_seqlens_from_lengths([64, 40, 23])
    layout = dflash_layout(cu, torch.tensor([10, 30, 50, 70, 90, 100, 120]), 4, cp_size=world)
    g = torch.Generator().manual_seed(0)
    T, NB = layout.total_len, layout.total_branch_tokens
    full = [torch.randn(n, h, 8, generator=g) for n, h in [(T, 4), (T, 2), (T, 2), (NB, 4), (NB, 2), (NB, 2)]]
    w, bw = torch.randn(T, 4, 8, generator=g), torch.randn(NB, 4, 8, generator=g)
    x = [zigzag_shard(t, layout, rank) for t in full[:3]] + [shard_branches(t, layout, rank) for t in full[3:]]
    x = [t.clone().requires_grad_() for t in x]
    recv_allocs, send_recv = [], RingComm.send_recv

    def watch(self, to_send, recv_buffer=None):
        recv_allocs.append(recv_buffer is None)
        return send_recv(self, to_send, recv_buffer)

    counting, kernel = _CountingTorch(), _SpyKernel()
    RingComm.send_recv, ba.torch = watch, counting
    try:
        out, _, bout, _ = cp_branch_attention(*x, layout, kernel=kernel)
        loss = (out * zigzag_shard(w, layout, rank)).sum() + (bout * shard_branches(bw, layout, rank)).sum()
        before = counting.count
        loss.backward()
        backward_allocs = counting.count - before
    finally:
        RingComm.send_recv, ba.torch = send_recv, torch
    ref = [t.clone().requires_grad_() for t in full]
    o, _, bo, _ = dense_branch_attention(*ref, layout.with_cp(1))
    ((o * w).sum() + (bo * bw).sum()).backward()
    want = [zigzag_shard(t.grad, layout, rank) for t in ref[:3]] + [shard_branches(t.grad, layout, rank) for t in ref[3:]]
    err = max(float((a.grad - b).abs().max()) for a, b in zip(x, want) if b.numel())
    return {"backward_allocs": backward_allocs, "recv_allocs": recv_allocs, "storages": kernel.storages, "err": err}


def test_backward_accumulators_allocated_once():
    by_cp = {cp: run_world(worker, cp) for cp in (2, 4)}
    counts = {cp: {r["backward_allocs"] for r in ranks} for cp, ranks in by_cp.items()}
    assert counts[2] == counts[4] and len(counts[2]) == 1, counts  # independent of the ring's length
    for cp, ranks in by_cp.items():
        for r in ranks:
            assert not any(r["recv_allocs"]), cp  # every receive goes into a preallocated buffer
            calls = r["storages"]
            assert len(calls) >= 2 and all(c is not None for c in calls), cp  # ring steps get accumulators
            assert len({c[0] for c in calls}) == 1  # one dQ for every step
            assert len({p for c in calls for p in c[1:]}) <= 3  # dK/dV: own + two travelling buffers
            assert r["err"] < 1e-5, (cp, r["err"])
