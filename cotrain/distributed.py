"""Small torch.distributed helpers for local process groups (tests, benchmarks, CPU runs)."""

from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local_group(rank: int, world_size: int, port: int, backend: str = "gloo", timeout_s: float = 120) -> None:
    """Join a process group whose rendezvous is on loopback."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, threads: int,
            peers_may_die: bool) -> None:
    torch.set_num_threads(threads)
    try:
        init_local_group(rank, world_size, port)
        result = fn(rank, world_size, *args)
        # Tensors cross as bytes: torch's shared-memory handoff would break when this process exits.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report, never hang the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        # with a peer dead on purpose, skip the collective teardown: the OS closes the sockets
        if dist.is_initialized() and not peers_may_die:
            dist.destroy_process_group()


def _spawn(fn: Callable, world_size: int, args: tuple, timeout_s: float, threads: int,
           dies: frozenset[int]) -> tuple[dict[int, Any], dict[int, int | None]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, threads, bool(dies)), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size - len(dies)):
            try:
                rank, status, value = queue.get(timeout=timeout_s)
            except queue_mod.Empty:
                errors.append(f"no result within {timeout_s:.0f} s (a rank hangs or died)")
                break
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return results, {r: p.exitcode for r, p in enumerate(procs)}


def spawn_local(fn: Callable, world_size: int, *args: Any, timeout_s: float = 600, threads: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes on a gloo group.

    Returns the per-rank return values (which must be picklable). A rank that raises makes this
    raise with that rank's traceback; a rank that dies or hangs makes it raise after ``timeout_s``.
    """
    results, _ = _spawn(fn, world_size, args, timeout_s, threads, frozenset())
    return [results[r] for r in range(world_size)]


def spawn_local_expecting_deaths(fn: Callable, world_size: int, *args: Any, dies: set[int], timeout_s: float = 120,
                                 threads: int = 1) -> tuple[dict[int, Any], dict[int, int | None]]:
    """:func:`spawn_local` for fault tests in which the ranks in ``dies`` are meant to die: waits for
    the others only; returns (results of the survivors, every rank's exit code)."""
    return _spawn(fn, world_size, args, timeout_s, threads, frozenset(dies))
