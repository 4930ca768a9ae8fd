"""The cuda_ipc reader's deferred release, with fake CUDA events (runs on CPU; the real ordering test
is in test_gpu.py): a writer waiting for a slot gets it only once the reader's GPU has read it."""

import threading
import time

import pytest

from cotrain.tapchannel import TapLappedError, TapTimeoutError
from cotrain.tapchannel.transports.cuda_ipc import CudaIpcTransport
from cotrain.tapchannel.transports.release import DeferredRelease

from test_mailbox import make_mailbox, past, rows


class FakeEvent:
    """A CUDA event stand-in: completes when the test says the GPU got there."""

    def __init__(self, done: bool = False):
        self.done = threading.Event()
        if done:
            self.done.set()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait()


def full_ring():
    """slots=2, microbatches 0 and 1 written and read; the writer's next microbatch (2) needs slot 0."""
    mb = make_mailbox(slots=2)
    for s in range(2):
        mb.put(0, s, rows(s, 2))
        mb.read(0, s)
    return mb


def cuda_ipc_reader(mb, events):
    """A cuda_ipc transport on the reader side around a CPU mailbox, recording the given events."""
    tr = CudaIpcTransport()
    tr.mailbox = mb
    tr._record = lambda: events.pop(0)
    return tr


def test_cuda_ipc_release_waits_for_the_readers_gpu():
    mb = full_ring()
    ev = FakeEvent()
    tr = cuda_ipc_reader(mb, [ev])
    tr.release(0, 0)  # the copy-out of microbatch 0 is still queued on the reader's GPU
    with pytest.raises(TapTimeoutError):
        mb.wait_free(0, 2, time.monotonic() + 0.2)  # so the writer must not get slot 0 yet
    assert tr.releases.pending == 1
    ev.done.set()  # the GPU has run the copy-out
    assert mb.wait_free(0, 2, time.monotonic() + 5) < 5
    assert tr.releases.drain(5) and tr.releases.pending == 0
    tr.close()


def test_completed_event_releases_at_once_without_a_thread():
    mb = full_ring()
    d = DeferredRelease(mb.release, lambda: FakeEvent(done=True))
    d.release(0, 0)
    assert mb.wait_free(0, 2, past()) == 0.0
    assert d._thread is None
    d.close()


def test_releases_are_published_while_the_reader_is_blocked_elsewhere():
    """The publisher thread, not a later call of the reader, stores `released` (the reader may be
    blocked in the pipeline's receive, waiting for the very writer that needs the slot)."""
    mb = full_ring()
    evs = [FakeEvent(), FakeEvent()]
    d = DeferredRelease(mb.release, iter(evs).__next__)
    d.release(0, 0)
    d.release(0, 1)
    threading.Timer(0.05, evs[1].done.set).start()  # out of order: the later event completes first
    threading.Timer(0.10, evs[0].done.set).start()
    t0 = time.monotonic()
    mb.wait_free(0, 2, time.monotonic() + 5)
    mb.wait_free(0, 3, time.monotonic() + 5)
    assert 0.09 < time.monotonic() - t0 < 5
    d.close()


def test_a_failed_release_is_raised_on_the_next_call():
    mb = full_ring()
    ev = FakeEvent()
    d = DeferredRelease(mb.release, lambda: ev)
    d.release(0, 0)
    mb._slot_words[0][0, 0] = 5  # the slot changed under the reader before the release got out
    ev.done.set()
    with pytest.raises(TapLappedError, match="changed before it was released") as e:
        d.drain(5)
    assert (e.value.layer, e.value.slot, e.value.expected, e.value.seen) == (0, 0, 1, 5)
    with pytest.raises(TapLappedError):
        d.release(0, 1)
    d.close()
