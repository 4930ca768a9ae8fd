"""spawn_local's twin for fault tests: some ranks are *meant* to die (SIGKILL), the others report."""

from __future__ import annotations

import io
import queue as queue_mod
import traceback

import torch
import torch.multiprocessing as mp

from cotrain.distributed import find_free_port, init_local_group


def _worker(rank, world, port, fn, args, q):
    torch.set_num_threads(1)
    try:
        init_local_group(rank, world, port, timeout_s=60)
        out = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(out, buf)
        q.put((rank, "ok", buf.getvalue()))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    # no destroy_process_group: a peer is dead on purpose; the process exits and the OS closes the sockets


def spawn_expecting_deaths(fn, world: int, *args, dies=(), timeout_s: float = 120) -> tuple[dict, dict]:
    """Run ``fn(rank, world, *args)``; wait for the ranks not in ``dies``. Returns (results, exit codes)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world - len(dies)):
            try:
                rank, status, value = q.get(timeout=timeout_s)
            except queue_mod.Empty:
                errors.append(f"no result within {timeout_s}s (a rank hangs)")
                break
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return results, {r: p.exitcode for r, p in enumerate(procs)}
