"""cuda_ipc and nccl transports (need CUDA; skipped elsewhere)."""

import pytest
import torch

from cotrain.distributed import spawn_local

import _tap_workers as w


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
def test_gpu_transport_roundtrip(transport):
    if transport == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("nccl p2p needs two GPUs (one rank per GPU)")
    _, got = spawn_local(w.gpu_roundtrip, 2, transport, timeout_s=300)
    assert len(got) == 10
    for step, mb, n, device, tap0, tap1 in got:
        assert device == "cuda"
        expect = (torch.arange(n * w.W).view(n, w.W) + 100 * mb + 1000 * step).to(torch.bfloat16).float()
        assert torch.equal(tap0, expect) and torch.equal(tap1, expect)


@pytest.mark.gpu
def test_cuda_ipc_slot_is_not_overwritten_before_the_readers_gpu_read_it():
    """A writer already waiting for the slot gets it only once the reader's queued copy-out (and the
    kernel reading a zero-copy view) has run on its deliberately slow stream."""
    writer, reader = spawn_local(w.gpu_release_order, 2, timeout_s=300)
    assert reader["uniform"]
    assert reader["got"] == [1.0, 2.0, 3.0, 4.0]  # not 3.0 / 4.0 in the first two: nothing overwritten early
    # microbatches 2 and 3 waited for the reader's sleeping stream, not just for its CPU
    assert min(writer["write_s"][2:]) > 0.5 * reader["sleep_s"], writer["write_s"]
