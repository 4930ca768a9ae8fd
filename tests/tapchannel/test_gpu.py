"""The nccl transport between two GPUs (skipped without two); cuda_ipc's GPU tests are in
tests/gpu/test_tapchannel_cuda.py (they need no Ray or vLLM, so the GPU check runs them)."""

import pytest
import torch

from cotrain.distributed import spawn_local

import _tap_workers as w


@pytest.mark.gpu
def test_nccl_transport_roundtrip():
    if torch.cuda.device_count() < 2:
        pytest.skip("nccl p2p needs two GPUs (one rank per GPU)")
    _, got = spawn_local(w.gpu_roundtrip, 2, "nccl", timeout_s=300)
    assert len(got) == 10
    for step, mb, n, device, tap0, tap1 in got:
        assert device == "cuda"
        expect = (torch.arange(n * w.W).view(n, w.W) + 100 * mb + 1000 * step).to(torch.bfloat16).float()
        assert torch.equal(tap0, expect) and torch.equal(tap1, expect)
