"""Stamps the reader must refuse, and a TapChannel read with copy=True that releases its slot only
after the copy is taken (one process, no torch.distributed)."""

import time

import pytest
import torch

from cotrain.tapchannel import PipelineLayout, TapChannel, TapLappedError, TapSpec, TapTimeoutError

from test_mailbox import MAX_T, W, make_mailbox, past, rows


def test_read_of_a_never_written_slot_raises():
    mb = make_mailbox(slots=2)
    with pytest.raises(TapTimeoutError) as e:
        mb.read(0, 0)
    assert (e.value.expected, e.value.seen) == (1, 0)


@pytest.mark.parametrize("copy", [True, False])
def test_read_of_a_slot_holding_an_older_stamp_raises(copy):
    """Slot 0 holds microbatch 0 (stamp 1); a read of microbatch 2 (stamp 3, same slot) called
    without waiting must not hand out microbatch 0's rows as microbatch 2's."""
    mb = make_mailbox(slots=2)
    for s in range(2):
        mb.put(0, s, rows(s, 2))
        mb.wait_stamp(0, s, past())
        mb.read(0, s)
        mb.release(0, s)
    with pytest.raises(TapTimeoutError, match="does not hold this microbatch") as e:
        mb.read(0, 2, copy=copy)
    assert (e.value.slot, e.value.expected, e.value.seen) == (0, 3, 1)
    with pytest.raises(TapTimeoutError):  # and waiting for it times out rather than accepting stamp 1
        mb.wait_stamp(0, 2, past())
    with pytest.raises(TapLappedError):  # nor can the old microbatch's slot be released as the new one
        mb.release(0, 2)


def test_read_of_a_slot_holding_a_newer_stamp_raises():
    mb = make_mailbox(slots=1)
    mb.put(0, 0, rows(0, 1))
    mb.release(0, 0)
    mb.put(0, 1, rows(1, 1))
    with pytest.raises(TapLappedError) as e:
        mb.read(0, 0)
    assert (e.value.expected, e.value.seen) == (1, 2)


class RecordingTransport:
    """The reader side of a transport over a real mailbox, with a writer that overwrites a slot the
    moment it is released (the worst legal timing) and a log of the calls."""

    name = "recording"

    def __init__(self, slots=1):
        self.mb = make_mailbox(slots=slots)
        self.log = []
        self.released = set()

    def wait(self, t, seq, deadline):
        return self.mb.wait_stamp(t, seq, deadline)

    def read(self, t, seq, copy=True):
        assert seq not in self.released, f"microbatch {seq} read after its slot was released"
        x = self.mb.read(t, seq, copy)
        self.log.append(("read", seq, copy))
        return x

    def release(self, t, seq):
        self.mb.release(t, seq)
        self.released.add(seq)
        self.log.append(("release", seq))
        nxt = seq + self.mb.slots  # the writer was waiting for this very slot
        self.mb.wait_free(t, nxt, past())
        self.mb.put(t, nxt, rows(nxt, MAX_T))

    def close(self):
        pass


def _channel_with_one_remote_tap(tr):
    """A one-rank channel whose tap is routed through ``tr`` as if it came from another stage."""
    layout = PipelineLayout.even([0], num_layers=2)
    spec = TapSpec(0, W).resolve(layout)
    ch = TapChannel([spec], layout, "shm", max_tokens=MAX_T)
    ch.remote = [spec]
    ch._remote_index = {0: 0}
    ch._route = {0: (tr, 0)}
    return ch


def test_channel_read_with_copy_releases_the_slot_only_after_the_copy():
    tr = RecordingTransport(slots=1)
    ch = _channel_with_one_remote_tap(tr)
    ch.begin_step(2)
    tr.mb.put(0, 0, rows(0, 3))
    got = ch.read(0, copy=True)[0]
    assert tr.log == [("read", 0, True), ("release", 0)]
    # the writer has overwritten slot 0 with microbatch 1 since: the copy still holds microbatch 0
    assert tr.mb.stamp(0, 1) == 2
    assert torch.equal(got, rows(0, 3))
    got1 = ch.read(1)[0]
    assert torch.equal(got1, rows(1, MAX_T)) and torch.equal(got, rows(0, 3))
    ch.end_step()


def test_channel_zero_copy_read_keeps_the_slot_until_release():
    tr = RecordingTransport(slots=1)
    ch = _channel_with_one_remote_tap(tr)
    ch.begin_step(1)
    tr.mb.put(0, 0, rows(0, 2))
    with ch.reading(0) as taps:
        assert tr.log == [("read", 0, False)]  # not released while the view is in use
        assert torch.equal(taps[0], rows(0, 2))
        with pytest.raises(TapTimeoutError):  # a writer for the next microbatch must wait
            tr.mb.wait_free(0, 1, time.monotonic() + 0.05)
    assert tr.log[-1] == ("release", 0)
    ch.end_step()


def test_a_writer_skipping_a_single_microbatch_fails_at_its_claim():
    mb = make_mailbox(slots=4)
    mb.claim(0, 0)
    mb.put(0, 0, rows(0, 1))
    with pytest.raises(TapLappedError, match="skipped 1") as e:
        mb.claim(0, 2)  # microbatch 1 never written
    assert (e.value.expected, e.value.seen) == (2, 3)
    with pytest.raises(TapLappedError, match="never wrote this microbatch"):
        mb.wait_stamp(0, 1, time.monotonic() + 30)
