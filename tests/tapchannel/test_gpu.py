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
