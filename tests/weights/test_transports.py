"""The CPU transports (shm), the factory and the push sequence (send, load, release)."""

from __future__ import annotations

import os

import pytest
import torch

from _named_tensors import sample_weights as _weights

from cotrain.weights import WeightPushError, WeightTransport, make_transport, push_through, receiver_for, resolve_transport_name
from cotrain.weights.transports.shm import ShmTransport


def test_shm_round_trip_and_release(tmp_path):
    t = ShmTransport(str(tmp_path))
    w = _weights()
    h = t.send(w, 7)
    assert h["transport"] == "shm" and h["version"] == 7 and os.path.exists(h["path"])
    assert [row[0] for row in h["manifest"]] == list(w)  # the sender's order
    got = receiver_for(h).receive(h)  # a fresh receiver, as in the engine process
    assert list(got) == list(w)
    for n in w:
        assert got[n].dtype == w[n].dtype and torch.equal(got[n], w[n])
    t.release(h)
    assert not os.path.exists(h["path"])
    t.release(h)  # idempotent
    with pytest.raises(WeightPushError, match="does not exist"):
        receiver_for(h).receive(h)


def test_shm_defaults_to_dev_shm():
    assert ShmTransport().directory in ("/dev/shm", __import__("tempfile").gettempdir())


def test_transport_factory():
    assert resolve_transport_name("auto") == ("cuda_ipc" if torch.cuda.is_available() else "shm")
    assert resolve_transport_name("auto", colocated=False) == ("nccl" if torch.cuda.is_available() else "shm")
    assert isinstance(make_transport("shm"), ShmTransport)
    with pytest.raises(ValueError, match="allowed: auto, shm, object_store, cuda_ipc, nccl"):
        make_transport("carrier-pigeon")
    with pytest.raises(ValueError, match="master_addr, master_port, world_size"):
        make_transport("nccl")
    with pytest.raises(WeightPushError, match="allowed: shm, object_store, cuda_ipc, nccl"):
        receiver_for({"transport": "floppy", "version": 1, "manifest": []})
    for name, backend in (("nccl", "'nccl'"), ("cuda_ipc", "'ipc'")):  # vLLM's engines receive those
        with pytest.raises(WeightPushError, match=f"received by vLLM's {backend} weight-transfer engine"):
            receiver_for({"transport": name, "version": 1, "manifest": []})


def test_push_through_releases_whatever_the_load_does():
    class Recording(WeightTransport):
        name = "rec"

        def __init__(self):
            self.log = []

        def send(self, named_tensors, version):
            self.log.append(("send", version))
            return {"version": version}

        def receive(self, handle):
            raise NotImplementedError

        def release(self, handle):
            self.log.append(("release", handle["version"]))

    t = Recording()
    stats = push_through(t, {}, 3, lambda h: {"push_s": 1.0, "seen": h["version"]})
    assert stats["seen"] == 3 and stats["send_s"] >= 0 and t.log == [("send", 3), ("release", 3)]

    def reject(h):
        t.log.append(("load", h["version"]))
        raise WeightPushError("rejected")

    with pytest.raises(WeightPushError, match="rejected"):
        push_through(t, {}, 4, reject)
    assert t.log[2:] == [("send", 4), ("load", 4), ("release", 4)]
