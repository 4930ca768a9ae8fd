"""cuda_ipc's device logic, on CPU: the reader's GPU found by UUID among what a writer sees, the
handle reopened under that local index, and ``auto`` choosing nccl for a source that cannot see it."""

import inspect

import pytest
import torch
from torch.multiprocessing import reductions

from cotrain.tapchannel import TapChannel
from cotrain.tapchannel.transports.cuda_ipc import CudaIpcDeviceError, local_index_of, open_handle

A, B, C = "GPU-aaaa-0001", "GPU-bbbb-0002", "GPU-cccc-0003"


def test_local_index_follows_the_uuid_not_the_readers_index():
    # a Ray actor that sees only GPU B calls it 0; one that sees all three, in another order, 2
    assert local_index_of(B, [(0, B)]) == 0
    assert local_index_of(B, [(0, C), (1, A), (2, B)]) == 2
    assert local_index_of(A, [(0, A), (1, B)]) == 0


@pytest.mark.parametrize("visible", [[(0, A)], [], [(0, A), (1, C)]])
def test_a_writer_that_does_not_see_the_readers_gpu_is_refused_naming_both(visible):
    with pytest.raises(CudaIpcDeviceError) as e:
        local_index_of(B, visible, who="writer rank 3")
    msg = str(e.value)
    assert f"writer rank 3 does not see the reader's GPU {B}" in msg
    assert all(f"{i}: {u}" in msg for i, u in visible) and ("no GPU" in msg) == (not visible)
    assert "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES" in msg and "'nccl'" in msg


def test_a_uuid_seen_twice_is_refused():
    with pytest.raises(CudaIpcDeviceError, match="sees 2 times"):
        local_index_of(A, [(0, A), (1, A)])


def test_open_handle_replaces_exactly_the_storage_device_argument_of_torchs_rebuild():
    """The handle's args are rebuild_cuda_tensor's, in its order (read from torch itself): only
    storage_device changes."""
    names = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    args = tuple(f"arg:{n}" for n in names)
    got = open_handle((lambda *a: a, args), 5)
    assert len(got) == len(names)
    assert {n: g for n, g in zip(names, got)} == {n: (5 if n == "storage_device" else f"arg:{n}") for n in names}


def test_auto_uses_cuda_ipc_only_for_a_same_node_source_that_sees_the_readers_gpu():
    assert TapChannel.choose("auto", True, True, sees_reader_gpu=True) == "cuda_ipc"
    assert TapChannel.choose("auto", True, True, sees_reader_gpu=False) == "nccl"
    assert TapChannel.choose("auto", False, True, sees_reader_gpu=True) == "nccl"
    assert TapChannel.choose("auto", True, False, sees_reader_gpu=False) == "shm"
    assert TapChannel.choose("cuda_ipc", True, True, sees_reader_gpu=False) == "cuda_ipc"  # a name is kept


def test_nccl_send_wait_polls_and_raises_the_named_timeout_without_work_wait():
    """Under NCCL, Work.wait(timeout=) can take the process down; the writer polls is_completed()
    against its deadline and raises TapTimeoutError (never calling wait)."""
    import time
    from collections import deque
    from types import SimpleNamespace

    from cotrain.tapchannel import PipelineLayout, TapSpec, TapTimeoutError
    from cotrain.tapchannel.transports.p2p import NcclTransport

    class Pending:
        polls = 0

        def is_completed(self):
            Pending.polls += 1
            return False

        def wait(self, *a, **k):
            raise AssertionError("Work.wait must not be called under NCCL")

    layout = PipelineLayout.even([0, 1], num_layers=2)
    tr = NcclTransport()
    tr.ctx = SimpleNamespace(taps=[TapSpec(0, 8, torch.float32).resolve(layout)], slots=2, layout=layout)
    tr._inflight = {0: deque([(0, [Pending()], None)])}
    t0 = time.monotonic()
    with pytest.raises(TapTimeoutError, match="did not complete in time") as e:
        tr._drain(0, 0, time.monotonic() + 0.2)
    assert 0.2 <= time.monotonic() - t0 < 5 and Pending.polls > 1
    assert (e.value.layer, e.value.rank, e.value.slot) == (0, 0, 0)

    class Later:  # completes on the third poll; then wait() without a timeout (returns at once)
        polls, waits = 0, []

        def is_completed(self):
            Later.polls += 1
            return Later.polls >= 3

        def wait(self, *a, **k):
            Later.waits.append((a, k))

    tr._inflight = {0: deque([(0, [Later()], None)])}
    tr._drain(0, 0, time.monotonic() + 5)
    assert Later.polls == 3 and Later.waits == [((), {})]


def test_nccl_receive_wait_polls_and_gives_up_when_the_channel_closes():
    from types import SimpleNamespace

    from cotrain.tapchannel.transports.p2p import NcclTransport

    class Done:
        def __init__(self, after):
            self.left, self.waited = after, False

        def is_completed(self):
            self.left -= 1
            return self.left <= 0

        def wait(self, *a, **k):  # only once completed, and without a timeout
            assert self.left <= 0 and not a and not k, "wait() before completion, or with a timeout"
            self.waited = True

    tr = NcclTransport()
    work = Done(3)
    assert tr._await(work, SimpleNamespace(stopped=False)) is True and work.waited
    work = Done(10**9)
    assert tr._await(work, SimpleNamespace(stopped=True)) is False and not work.waited
