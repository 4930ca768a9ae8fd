"""Run a function on every rank of a gloo process group spawned on 127.0.0.1 (one group per call)."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, outdir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    # A rank that skips a collective (e.g. one with no branches skipping the ring) makes the others
    # wait: fail after minutes instead of gloo's default half hour.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_world(fn, world_size: int, *args) -> list:
    """fn(rank, world_size, *args) on each rank of a fresh gloo group; returns the results by rank.

    fn must be importable by name (a module-level function) because ranks are spawned.
    """
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(
            _entry, args=(fn, world_size, free_port(), outdir, args), nprocs=world_size, join=True,
            start_method="spawn",
        )
        results = []
        for rank in range(world_size):
            with open(os.path.join(outdir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results
