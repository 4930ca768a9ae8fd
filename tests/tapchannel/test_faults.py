"""TapChannel faults across processes, for the shm and gloo transports: read timeout, lapped source,
dead source, shape/dtype mismatch at registration, back-pressure that never overwrites."""

import pytest

import _tap_workers as w

from cotrain.distributed import spawn_local, spawn_local_expecting_deaths

TRANSPORTS = ["shm", "gloo"]


@pytest.fixture(scope="module")
def faults():
    writer, reader = spawn_local(w.faults, 2, TRANSPORTS, timeout_s=180)
    return {t: (writer[t], reader[t]) for t in TRANSPORTS}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_read_timeout_names_the_slot(faults, transport):
    _, r = faults[transport]
    assert r["first"] == 1.0
    e = r["timeout"]
    assert e["type"] == "TapTimeoutError"
    assert (e["layer"], e["rank"], e["slot"], e["expected"], e["seen"]) == (0, 0, 1, 2, 0)
    for word in ("layer 0", "rank 0", "slot 1", "expected stamp 2", "seen stamp 0"):
        assert word in e["msg"]
    assert 0.45 < e["elapsed"] < 5
    assert r["late"] == (2.0, -2.0)  # a timeout is not corruption: the late microbatch still arrives intact


@pytest.mark.parametrize("slots", [2, 4])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_source_ahead_of_reader_is_lapped(faults, transport, slots):
    """A source one step ahead: the reader (and for shm the writer) report the lap within a poll, not
    after the 3 s timeout; with 2 slots the writer's microbatch needs a slot the reader never frees."""
    wr, rd = faults[transport]
    sides = {"reader": rd} | ({"writer": wr} if transport == "shm" else {})  # gloo's sends are asynchronous
    for side, r in sides.items():
        e = r[f"lapped{slots}"]
        assert e["type"] == "TapLappedError", (side, e)
        assert (e["layer"], e["rank"], e["slot"], e["expected"], e["seen"]) == (0, 0, 0, 1, 3), (side, e)
        for word in ("layer 0", "rank 0", "slot 0", "expected stamp 1", "seen stamp 3"):
            assert word in e["msg"]
        assert e["elapsed"] < 1.5, (side, e)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_registration_rejects_shape_and_dtype(faults, transport):
    wr, rd = faults[transport]
    assert "width 9" in wr["register_width"] and "width 8" in wr["register_width"]
    assert "float16" in wr["register_dtype"] and "float32" in wr["register_dtype"]
    assert "(9, 8)" in wr["too_many_tokens"]
    assert "produced on rank 1" in wr["not_mine"]
    assert "bfloat16" in rd["register_local"]
    assert "disagree" in wr["handshake"] and "disagree" in rd["handshake"]  # both sides fail, nobody hangs


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_backpressure_times_out_and_never_overwrites(faults, transport):
    wr, rd = faults[transport]
    bp = wr["backpressure"]
    assert bp["type"] == "TapTimeoutError"
    # shm: the 3rd write needs slot 0 back; gloo: 2 slots in the mailbox, then the writer waits for
    # the send of seq - 2 x slots, which the reader's thread cannot take while slot 0 is held
    assert bp["wrote"] == (2 if transport == "shm" else 6)
    assert rd["kept"] == [0.0, 1.0]


def test_dead_source_fails_the_reader_fast():
    results, codes = spawn_local_expecting_deaths(w.dead_source, 2, dies={0}, timeout_s=120)
    assert codes[0] == -9 and codes[1] == 0
    for t in TRANSPORTS:
        r = results[1][t]
        assert r["first"] == 32.0  # what arrived before the death is intact
        e = r["dead"]
        assert e["type"] == "TapSourceDeadError", r
        assert (e["layer"], e["rank"], e["slot"], e["expected"], e["seen"]) == (0, 0, 1, 2, 0)
        assert e["elapsed"] < 5  # detected, not the 30 s timeout
    assert "has exited" in results[1]["shm"]["dead"]["msg"]  # process liveness
    # the transport's own failure, whichever way gloo words it ("Connection closed by peer", or a
    # read error naming the remote worker when the peer dies mid-message under load)
    msg = results[1]["gloo"]["dead"]["msg"]
    assert "mailbox thread for rank 0 failed" in msg and "gloo" in msg, msg
