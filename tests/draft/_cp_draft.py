"""Rank function of the CP test: every drafter family on zigzag shards of a CP group."""

import contextlib
import dataclasses

import torch

from reference import draft_path
from cotrain.draft.common import DraftBatch
from cotrain.draft.cp import fetch_rows
from cotrain.draft.losses import soft_ce
from cotrain.draft.registry import build_drafter
from cotrain.draft.taps import TargetSpec
from cotrain.parallel import zigzag_shard

SETTINGS = {"eagle3": {"ttt_steps": 3}, "dflash": {"block_size": 4, "anchors_per_seq": 3},
            "dspark": {"block_size": 3, "anchors_per_seq": 3}}
LENS = (13, 6, 21)


def make_batch(drafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENS)
    ids = torch.randint(4, 100, (T,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(LENS), 0)])
    pos = torch.cat([torch.arange(n) for n in LENS])
    taps = torch.randn(T, drafter.num_taps * drafter.target_arch.hidden_size, generator=g)
    logits = torch.randn(T, drafter.target_arch.vocab_size, generator=g) * 3
    return DraftBatch(ids, cu, taps, pos >= 2, logits, torch.full((len(LENS),), 2))


def run_family(kind, target_path, rank, cp, group=None, blocks_on_rank=None, old=False):
    """Chains (bonus, logits, valid) and grads of a soft-CE step (normalised by the global count).

    blocks_on_rank (block drafters): anchors only among the candidates that CP rank (of a CP = 2
    layout) holds, the same anchors at any cp: the other rank owns no block.
    old: the earlier path (reference.draft_path: all-zero main queries, dense buckets at
    CP = 1, the loss on full tensors)."""
    target = TargetSpec.from_checkpoint(target_path)
    d = build_drafter(kind, SETTINGS[kind], target, seed=3)
    full = make_batch(d)
    if blocks_on_rank is None:
        layout = d.build_layout(full, torch.Generator().manual_seed(11), cp_size=cp)
    else:
        from cotrain.parallel import anchor_owner

        cand = d.anchor_candidates(full)
        anchors = cand[anchor_owner(full.cu_seqlens, cand, 2) == blocks_on_rank][::2]
        layout = d.build_layout(full, cp_size=cp, anchors=anchors)
    if cp > 1:
        batch = DraftBatch(full.input_ids, full.cu_seqlens, zigzag_shard(full.taps, layout, rank), full.loss_mask,
                           None, full.response_start)
    else:
        batch = full
    with draft_path.dense_attention() if old else contextlib.nullcontext():
        out = d(batch, layout, group=group)
    # targets: this rank holds only its zigzag shard of the target logits; fetch_rows brings the
    # rows its chains need from their owners
    if cp > 1:
        local_logits = zigzag_shard(full.target_logits, layout, rank)
        rows = fetch_rows(local_logits, out.target_rows, layout, group).view(*out.target_rows.shape, local_logits.shape[-1])
        ref_rows = full.target_logits[out.target_rows.clamp(min=0)] * out.valid[..., None]
        assert torch.equal(rows * out.valid[..., None], ref_rows)
    else:
        rows = full.target_logits[out.target_rows.clamp(min=0)]
    p = torch.softmax(rows, -1)
    remote = 0
    if cp > 1:
        from cotrain.parallel import anchor_owner

        r = out.target_rows[out.valid]
        remote = int((anchor_owner(full.cu_seqlens, r, cp) != rank).sum())
    n_global = int(d(full, layout.with_cp(1)).valid.sum())
    if old:  # the old loss on full tensors, unweighted like soft_ce here
        loss = draft_path.draft_loss("soft_ce", dataclasses.replace(out, loss_weight=None), p)[0]
    else:
        loss = soft_ce(out.logits, p, out.valid)
    loss = loss * out.valid.sum() / n_global
    loss.backward()
    grads = {n: q.grad.clone() if q.grad is not None else torch.zeros_like(q) for n, q in d.named_parameters()}
    return {"bonus": out.bonus_pos, "logits": out.logits.detach(), "valid": out.valid, "grads": grads,
            "remote_rows": remote}


def rank_fn(rank, world, target_path):
    torch.manual_seed(0)
    return {kind: run_family(kind, target_path, rank, world, group=None) for kind in SETTINGS}


def rank_fn_old(rank, world, target_path):
    torch.manual_seed(0)
    return {kind: run_family(kind, target_path, rank, world, group=None, old=True) for kind in SETTINGS}


def rank_fn_blocks_on_one_rank(rank, world, target_path, owner):
    """The block drafters with every anchor on rank `owner`: the other rank has no chain at all, yet
    takes part in branch attention's ring (forward and backward) through its empty block outputs."""
    torch.manual_seed(0)
    return {kind: run_family(kind, target_path, rank, world, group=None, blocks_on_rank=owner)
            for kind in ("dflash", "dspark")}


# ----------------------------------------------------------------------------- a gloo world
def _entry(rank, fn, world_size, port, outdir, args):
    import os
    import pickle

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_world(fn, world_size, *args):
    """fn(rank, world_size, *args) on each rank of a fresh gloo group (spawned); results by rank."""
    import os
    import pickle
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_entry, args=(fn, world_size, port, outdir, args), nprocs=world_size, join=True,
                           start_method="spawn")
        out = []
        for rank in range(world_size):
            with open(os.path.join(outdir, f"rank{rank}.pkl"), "rb") as f:
                out.append(pickle.load(f))
    return out
