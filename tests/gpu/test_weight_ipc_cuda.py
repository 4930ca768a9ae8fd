"""The ``cuda_ipc`` weight push's trainer side on CUDA, with torch only (no vLLM, no Ray).

Trainer ranks (one per GPU, up to two; NCCL) run ``CudaIpcTransport.send_collective`` with every
GPU as an engine GPU; one receiver process per GPU then opens the handle set exactly as vLLM's IPC
worker engine does (``IPCWeightTransferEngine.receive_weights``, unpacked: the entry keyed by its
own GPU's UUID, ``rebuild_cuda_tensor`` with the device index replaced by its own) and compares the
tensors with rank 0's. On one GPU this exercises the real CUDA export, the UUID lookup and the
release after the receiver closed its mapping, not a copy to another GPU; with two GPUs rank 1's
copy (sent by rank 0 over NCCL) backs GPU 1's handles.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp


def _state(device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    w = {"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.arange(7, dtype=torch.int64),
         "c.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16)}
    return {n: t.to(device) for n, t in w.items()}


def _uuid(i: int) -> str:
    return str(torch.cuda.get_device_properties(i).uuid)


def _trainer(rank: int, world: int, port: int, to_test, done) -> None:
    import torch.distributed as dist

    from cotrain.distributed import init_local_group
    from cotrain.weights.transports.cuda_ipc import CudaIpcTransport

    torch.cuda.set_device(rank)
    init_local_group(rank, world, port, backend="nccl")
    try:
        tx = CudaIpcTransport(engine_gpus=[_uuid(i) for i in range(world)])
        h = tx.send_collective(_state(f"cuda:{rank}") if rank == 0 else None, 1)
        if rank == 0:
            to_test.put(h)
        held = tx.held()
        dist.barrier()  # (stand-in for the driver) the test lets the ranks release once the receivers are done
        if rank == 0:
            done.get(timeout=120)
        dist.barrier()
        tx.release(h if h is not None else {"seq": 1})
        to_test.put(("held", rank, held, tx.held()))
    finally:
        dist.destroy_process_group()


def _receiver(index: int, handles, out) -> None:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from cotrain.weights.transports.cuda_ipc import restore_update_info

    torch.cuda.set_device(index)
    h = handles.get(timeout=120)
    info = restore_update_info(h["update_info"])
    me = _uuid(index)
    got = {}
    for name, per_gpu in zip(info["names"], info["ipc_handles"]):
        args = list(per_gpu[me])
        args[6] = index  # as vLLM's receiver does: its own device index
        got[name] = rebuild_cuda_tensor(*args).cpu()
    want = _state("cpu")
    out.put((index, sorted(per_gpu), {n: bool(torch.equal(got[n], want[n])) for n in want}))
    del got
    torch.cuda.synchronize()


def test_cuda_ipc_handles_open_on_every_engine_gpu():
    from cotrain.distributed import find_free_port

    world = min(2, torch.cuda.device_count())
    ctx = mp.get_context("spawn")
    to_test, done, handles, out = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    port = find_free_port()
    trainers = [ctx.Process(target=_trainer, args=(r, world, port, to_test, done)) for r in range(world)]
    for p in trainers:
        p.start()
    h = to_test.get(timeout=180)
    assert h["transport"] == "cuda_ipc" and sorted(h["gpus"]) == sorted(_uuid(i) for i in range(world))
    receivers = [ctx.Process(target=_receiver, args=(i, handles, out)) for i in range(world)]
    for p in receivers:
        p.start()
        handles.put(h)
    results = sorted(out.get(timeout=180) for _ in range(world))
    for p in receivers:
        p.join(60)
    done.put(True)
    held = sorted(to_test.get(timeout=120) for _ in range(world))
    for p in trainers:
        p.join(60)
    assert all(p.exitcode == 0 for p in trainers + receivers), [p.exitcode for p in trainers + receivers]
    for index, uuids, equal in results:
        assert uuids == sorted(_uuid(i) for i in range(world)) and all(equal.values()), (index, equal)
    # every rank on an engine GPU held one copy until release, none after
    assert [(r, a, b) for _, r, a, b in held] == [(r, 1, 0) for r in range(world)]
