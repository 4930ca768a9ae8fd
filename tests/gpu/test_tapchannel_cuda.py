"""TapChannel ``cuda_ipc`` between two processes that each see only their own GPU (CUDA; skipped
without it). Imports only torch and cotrain: runs on a GPU machine without Ray or vLLM.

Each rank sets ``CUDA_VISIBLE_DEVICES`` to one GPU before touching CUDA, as Ray does for its actors,
so each sees its GPU as device 0. On a machine with one GPU both ranks see the same GPU: the writer
finds the reader's GPU by UUID among what it sees and opens the IPC handles under its own index
(the lookup path under Ray's numbering), but this is a same-GPU open, not a cross-GPU one. On a
machine with two or more GPUs the ranks get different GPUs, the writer cannot see the reader's,
and the channel must refuse at set-up on both ranks with the error naming the UUID.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

W = 8


def _own_gpu(rank: int, gpus: int) -> None:
    """What Ray does for an actor: this process sees one GPU (rank % gpus), as device 0."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank % gpus)
    assert torch.cuda.device_count() == 1
    torch.cuda.set_device(0)


def _channel(name: str, slots: int = 2, dtype=torch.bfloat16, layers=(0, 1)):
    from cotrain.tapchannel import PipelineLayout, TapChannel, TapSpec

    layout = PipelineLayout.even([0, 1], num_layers=2)
    specs = [TapSpec(i, W, dtype).resolve(layout) for i in layers]
    return TapChannel(specs, layout, "cuda_ipc", max_tokens=8, slots=slots, timeout_s=60, name=name,
                      device=torch.device("cuda", 0))


def roundtrip(rank, world, gpus):
    """Rank 0 writes CUDA taps of layer 0 (layer 1 is the reader's own); rank 1 reads them."""
    _own_gpu(rank, gpus)
    from cotrain.tapchannel.transports.cuda_ipc import CudaIpcDeviceError, visible_gpus

    me = visible_gpus()
    try:
        ch = _channel("gpu-ipc")
    except CudaIpcDeviceError as e:
        return {"refused": str(e), "sees": me}
    got = []
    for step in range(2):
        ch.begin_step(5)
        for mb in range(5):
            n = 1 + (mb * 3 + step) % 8
            x = (torch.arange(n * W, device="cuda").view(n, W) + 100 * mb + 1000 * step).to(torch.bfloat16)
            ch.write(rank, mb, x)
            if rank == 1:
                taps = ch.read(mb)
                got.append((step, mb, n, str(taps[0].device), taps[0].float().cpu(), taps[1].float().cpu()))
        ch.end_step()
    routes = dict(ch.routes)
    ch.close()
    return {"got": got, "sees": me, "routes": routes}


def refused_when_the_writer_sees_another_gpu(rank, world):
    """The writer's view of the GPUs replaced by one without the reader's UUID: set-up fails on both ranks."""
    _own_gpu(rank, 1)
    from cotrain.tapchannel.transports import cuda_ipc

    if rank == 0:
        cuda_ipc.visible_gpus = lambda: [(0, "GPU-00000000-not-the-readers")]
    try:
        _channel("gpu-ipc-refused", layers=(0,)).close()
    except cuda_ipc.CudaIpcDeviceError as e:
        return str(e)
    return "no error"


def _sleep_cycles(seconds: float) -> int:
    """GPU clock cycles of ``torch.cuda._sleep`` that keep a stream busy for about ``seconds``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds / max(start.elapsed_time(end) / 1e3, 1e-6))


def release_order(rank, world, sleep_s=0.5):
    """cuda_ipc, 2 slots. The writer (rank 0) writes microbatches 0..3 back to back, so microbatch 2 waits
    for slot 0 and 3 for slot 1 and overwrites each the moment it is released. The reader (rank 1) holds
    its stream busy (``torch.cuda._sleep``) before the copy-out of microbatch 0, and before a kernel
    that reads the zero-copy view of microbatch 1: those reads must still see microbatches 0 and 1."""
    _own_gpu(rank, 1)
    ch = _channel("gpu-order", dtype=torch.float32, layers=(0,))
    value = lambda mb: torch.full((8, W), float(mb + 1), device="cuda")  # noqa: E731
    ch.begin_step(4)
    out = {}
    if rank == 0:
        waited = []
        for mb in range(4):
            t0 = time.monotonic()
            ch.write(0, mb, value(mb))
            waited.append(time.monotonic() - t0)
        out["write_s"] = waited
    else:
        cycles = _sleep_cycles(sleep_s)
        slow = torch.cuda.Stream()
        with torch.cuda.stream(slow):
            torch.cuda._sleep(cycles)  # the copy-out below runs only after this
            got0 = ch.read(0)[0]  # queued, then the slot is released: the writer is waiting for it
            torch.cuda._sleep(cycles)
            with ch.reading(1) as views:  # zero-copy: a kernel queued after the sleep reads the view
                got1 = views[0] * 1
        torch.cuda.current_stream().wait_stream(slow)
        got2, got3 = ch.read(2)[0], ch.read(3)[0]
        torch.cuda.synchronize()
        out["got"] = [g[0, 0].item() for g in (got0, got1, got2, got3)]
        out["uniform"] = all(bool((g == g[0, 0]).all()) for g in (got0, got1, got2, got3))
        out["sleep_s"] = sleep_s
    ch.end_step()
    import torch.distributed as dist

    dist.barrier()
    ch.close()
    return out


def _spawn(fn, *args):
    from cotrain.distributed import spawn_local

    return spawn_local(fn, 2, *args, timeout_s=300)


@pytest.mark.gpu
def test_cuda_ipc_between_processes_that_each_see_one_gpu():
    gpus = torch.cuda.device_count()
    writer, reader = _spawn(roundtrip, gpus)
    assert len(writer["sees"]) == len(reader["sees"]) == 1
    if gpus > 1:  # different GPUs: the writer cannot open the reader's memory, and both ranks say why
        uuid = reader["sees"][0][1]
        for r in (writer, reader):
            assert f"does not see the reader's GPU {uuid}" in r["refused"], r
            assert "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES" in r["refused"]
        return
    assert writer["sees"] == reader["sees"]  # one GPU: the same UUID, found by the writer
    assert reader["routes"] == {0: "cuda_ipc", 1: "local"}
    assert len(reader["got"]) == 10
    for step, mb, n, device, tap0, tap1 in reader["got"]:
        assert device == "cuda:0"
        expect = (torch.arange(n * W).view(n, W) + 100 * mb + 1000 * step).to(torch.bfloat16).float()
        assert torch.equal(tap0, expect) and torch.equal(tap1, expect)


@pytest.mark.gpu
def test_cuda_ipc_writer_without_the_readers_gpu_is_refused_on_both_ranks():
    for msg in _spawn(refused_when_the_writer_sees_another_gpu):
        assert "writer rank 0 does not see the reader's GPU" in msg and "GPU-00000000-not-the-readers" in msg, msg


@pytest.mark.gpu
def test_cuda_ipc_slot_is_not_overwritten_before_the_readers_gpu_read_it():
    """A writer already waiting for the slot gets it only once the reader's queued copy-out (and the
    kernel reading a zero-copy view) has run on its deliberately slow stream."""
    writer, reader = _spawn(release_order)
    assert reader["uniform"]
    assert reader["got"] == [1.0, 2.0, 3.0, 4.0]  # not 3.0 / 4.0 in the first two: nothing overwritten early
    # microbatches 2 and 3 waited for the reader's sleeping stream, not just for its CPU
    assert min(writer["write_s"][2:]) > 0.5 * reader["sleep_s"], writer["write_s"]
