"""The slot/stamp/back-pressure protocol of the mailbox, in one process (shared by every transport)."""

import multiprocessing as mp
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cotrain.tapchannel import (
    PipelineLayout,
    TapLappedError,
    TapSourceDeadError,
    TapSpec,
    TapSpecMismatchError,
    TapTimeoutError,
)
from cotrain.tapchannel.mailbox import Liveness, Mailbox, ProcessInfo, control_words

W, MAX_T = 4, 6


def make_mailbox(slots=2, taps=1, liveness=None):
    layout = PipelineLayout.even([0, 1], num_layers=2 * taps)
    specs = [TapSpec(i, W).resolve(layout) for i in range(taps)]
    ctrl = np.zeros(control_words(taps, slots), dtype=np.int64)
    data = [torch.zeros(slots, MAX_T, W) for _ in specs]
    mb = Mailbox(ctrl, data, specs, slots, MAX_T, reader_rank=1, liveness=liveness)
    mb.format()
    return mb


def rows(seq, n):
    return torch.arange(n * W, dtype=torch.float32).view(n, W) + 1000 * seq


def past():
    return time.monotonic() - 1


@settings(max_examples=40, deadline=None)
@given(slots=st.integers(1, 4), ntoks=st.lists(st.integers(0, MAX_T), min_size=1, max_size=12),
       actions=st.lists(st.booleans(), min_size=1, max_size=60))
def test_protocol_model(slots, ntoks, actions):
    """Random interleavings of a writer and a reader: the reader gets exactly what was written, in order;
    a writer whose slot is unreleased is refused (never overwrites); a reader never sees a stamp early."""
    mb = make_mailbox(slots)
    w = r = 0  # next seq to write / read
    for writer_turn in actions + [True, False] * (2 * len(ntoks) + 2):  # then drain
        if writer_turn and w < len(ntoks):
            if w - r >= slots:  # the ring is full of unreleased microbatches: back-pressure
                with pytest.raises(TapTimeoutError):
                    mb.wait_free(0, w, past())
            else:
                assert mb.wait_free(0, w, past()) == 0.0
                mb.put(0, w, rows(w, ntoks[w]))
                w += 1
        elif r < len(ntoks):
            if r >= w:  # not written yet: the reader waits (here: times out with the stamps in the error)
                with pytest.raises(TapTimeoutError) as e:
                    mb.wait_stamp(0, r, past())
                assert e.value.expected == r + 1 and e.value.seen < r + 1
            else:
                mb.wait_stamp(0, r, past())
                got = mb.read(0, r, copy=bool(r % 2))
                assert torch.equal(got, rows(r, ntoks[r]))
                mb.release(0, r)
                r += 1
    assert r == w == len(ntoks)


def test_reader_waits_for_a_writer_thread():
    mb = make_mailbox(slots=2)
    n = 20
    ahead = []

    def writer():
        for s in range(n):
            mb.wait_free(0, s, time.monotonic() + 10)
            ahead.append(s - int(mb._slot_words[0][:, 2].max()))  # seq minus the newest released stamp
            mb.put(0, s, rows(s, 3))

    th = threading.Thread(target=writer)
    th.start()
    for s in range(n):
        mb.wait_stamp(0, s, time.monotonic() + 10)
        assert torch.equal(mb.read(0, s), rows(s, 3))
        time.sleep(0.001)
        mb.release(0, s)
    th.join()
    assert max(ahead) <= 2  # the writer was never more than `slots` microbatches ahead of the releases


def test_lapped_stamp_is_an_error():
    mb = make_mailbox(slots=2)
    mb.put(0, 0, rows(0, 2))
    mb.wait_stamp(0, 0, past())
    mb.read(0, 0)
    mb.release(0, 0)
    mb.put(0, 1, rows(1, 2))
    mb.put(0, 2, rows(2, 2))  # reuses slot 0 (released)
    with pytest.raises(TapLappedError) as e:  # a reader that asks for microbatch 0 again is behind by a lap
        mb.wait_stamp(0, 0, past())
    assert (e.value.slot, e.value.expected, e.value.seen) == (0, 1, 3)


def test_source_past_the_microbatch_is_lapped_not_a_wait():
    mb = make_mailbox(slots=4)
    mb.put(0, 2, rows(2, 2))  # microbatch 0 and 1 never written: the source is ahead
    with pytest.raises(TapLappedError) as e:
        mb.wait_stamp(0, 0, time.monotonic() + 30)
    assert (e.value.expected, e.value.seen) == (1, 3)


@pytest.mark.parametrize("slots", [2, 4])
def test_lapping_writer_fails_both_sides_at_once(slots):
    """A writer two microbatches ahead (its step numbering is ahead): it fails at its claim, before it
    waits for a slot (with 2 slots: one the reader would never release), and the reader, seeing the
    claim, fails instead of waiting for a stamp that never comes."""
    mb = make_mailbox(slots=slots)
    with pytest.raises(TapLappedError, match="skipped 2") as e:
        mb.claim(0, 2)
    assert (e.value.slot, e.value.expected, e.value.seen) == (0, 1, 3)
    t0 = time.monotonic()
    with pytest.raises(TapLappedError, match="never wrote this microbatch") as e:
        mb.wait_stamp(0, 0, time.monotonic() + 30)
    assert (e.value.slot, e.value.expected, e.value.seen) == (0, 1, 3)
    assert time.monotonic() - t0 < 1


def test_a_claim_ahead_of_the_reader_is_no_lap():
    """In order, a writer claims the next microbatch (and waits for its slot) while the reader still
    has to read earlier ones: those are stamped, so the reader reads them."""
    mb = make_mailbox(slots=2)
    for s in range(2):
        mb.claim(0, s)
        mb.put(0, s, rows(s, 1))
    mb.claim(0, 2)  # waits for slot 0 (not released yet)
    with pytest.raises(TapTimeoutError):
        mb.wait_free(0, 2, past())
    for s in range(2):
        assert mb.wait_stamp(0, s, past()) == 0.0
        assert torch.equal(mb.read(0, s), rows(s, 1))
        mb.release(0, s)
    mb.wait_free(0, 2, past())


def test_overwrite_during_read_is_detected():
    mb = make_mailbox(slots=1)
    mb.put(0, 0, rows(0, 2))
    real = mb.data[0]

    class Racing:  # a concurrent writer that stamps the slot while the reader copies it
        def __getitem__(self, idx):
            mb._slot_words[0][0, 0] = 2
            return real[idx]

    mb.data[0] = Racing()
    with pytest.raises(TapLappedError, match="overwritten while it was read"):
        mb.read(0, 0)


def test_duplicate_write_and_release_of_a_changed_slot():
    mb = make_mailbox(slots=2)
    mb.put(0, 0, rows(0, 1))
    with pytest.raises(TapLappedError):
        mb.put(0, 0, rows(0, 1))
    with pytest.raises(TapLappedError):
        mb.release(0, 2)  # slot 0 holds microbatch 0, not 2


def test_registration_checks_width_and_dtype():
    mb = make_mailbox()
    mb.register_writer(0, 0, W, torch.float32)
    with pytest.raises(TapSpecMismatchError, match="width 5"):
        mb.register_writer(0, 0, W + 1, torch.float32)
    with pytest.raises(TapSpecMismatchError, match="bfloat16"):
        mb.register_writer(0, 0, W, torch.bfloat16)
    other = make_mailbox(slots=3)
    other.ctrl[3] = 2  # a writer that believes in another geometry than the reader formatted
    with pytest.raises(TapSpecMismatchError, match="geometry"):
        other.check_format()


def test_dead_source_probe_and_exception_probe():
    live = Liveness()
    mb = make_mailbox(liveness=live)
    live.probes[0] = lambda: "gone"
    with pytest.raises(TapSourceDeadError, match="gone") as e:
        mb.wait_stamp(0, 0, time.monotonic() + 30)
    assert (e.value.layer, e.value.rank, e.value.expected, e.value.seen) == (0, 0, 1, 0)
    boom = TapLappedError("x", layer=0, rank=0, slot=0, expected=1, seen=9)
    live.probes[0] = lambda: boom
    with pytest.raises(TapLappedError) as e:
        mb.wait_stamp(0, 0, time.monotonic() + 30)
    assert e.value is boom
    mb.put(0, 0, rows(0, 1))  # data that made it before the death is still delivered
    live.probes[0] = lambda: "gone"
    mb.wait_stamp(0, 0, time.monotonic() + 30)


def _sleep():
    time.sleep(60)


def test_process_liveness():
    me = ProcessInfo.local()
    assert me.dead_reason(me) is None
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_sleep)
    p.start()
    from cotrain.tapchannel.mailbox import _start_time

    info = ProcessInfo(me.host, me.boot_id, p.pid, me.pid_ns, _start_time(p.pid))
    assert info.dead_reason(me) is None
    p.kill()
    deadline = time.monotonic() + 5
    while info.dead_reason(me) is None and time.monotonic() < deadline:  # a zombie counts as dead
        time.sleep(0.01)
    assert "exited" in info.dead_reason(me)
    p.join()
    assert "exited" in info.dead_reason(me)
    elsewhere = ProcessInfo("other", "another-boot", p.pid, me.pid_ns, None)
    assert elsewhere.dead_reason(me) is None  # another node: not checkable, only timeouts tell
