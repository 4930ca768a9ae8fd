"""cotrain's side of the GPU weight transports, on CPU with stand-ins for vLLM's engines.

The bytes of ``cuda_ipc`` and ``nccl`` pushes are moved by vLLM's weight-transfer engines
(``vllm.distributed.weight_transfer``), which need CUDA; what cotrain adds around them runs here:

* the ``nccl`` sender: vLLM's trainer engine runs in a background thread, its update payload
  comes back in the handle, ``release`` ends the round trip and reports its errors, one push at
  a time;
* engine (``CotrainWeightTransferEngine`` over ``cotrain.weights.vllm_receiver``): the one check
  before anything moves, vLLM's worker engine pointed at the model being updated, a rejected
  ``nccl`` push drained (the broadcast group stays in step), an incomplete delivery refused;
* the engine's push (``VllmGeneration.push`` / ``cotrain.rl.vllm.client.push``): a push refused
  before it reaches the worker still drains an ``nccl`` broadcast.

The real engines run in test_weight_push_gpu.py (``gpu``); the ``cuda_ipc`` sender and its handle
set in tests/weights/test_cuda_ipc.py. Also here: the CPU ``object_store`` transport (several
nodes) on a local Ray.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from cotrain.rl.vllm import client
from cotrain.weights import WeightPushError, check_vllm_handle, manifest_of, update_info_manifest
from cotrain.weights.transports.cuda_ipc import CudaIpcTransport
from cotrain.weights.transports.nccl import NcclBroadcastTransport

pytest.importorskip("vllm")
from vllm.distributed.weight_transfer.clients import _json_safe_update_info  # noqa: E402

from cotrain.rl.vllm import transfer_backend  # noqa: E402
from cotrain.weights import vllm_receiver  # noqa: E402


def _weights(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {"a.weight": torch.full((3, 4), scale), "b.bias": torch.arange(5, dtype=torch.float32) * scale}


def _payload(tensors: dict[str, torch.Tensor]) -> dict:
    return {"names": list(tensors), "dtype_names": [str(t.dtype).split(".")[-1] for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()]}


# ----------------------------------------------------------------------------------- sender
class FakeNcclTrainerEngine:
    """Shaped like vLLM's NCCLTrainerWeightTransferEngine.send_weights: the payload goes to the
    client (concurrently with the broadcast), then the "broadcast" waits for a receiver."""

    def __init__(self) -> None:
        self.client = self.source = None
        self.wire: list = []  # what was "broadcast"
        self.receivers = threading.Semaphore(0)
        self.fail = False
        self.shut = False

    def send_weights(self) -> None:
        meta = self.source.metadata()
        self.client.start_weight_update()
        self.client.update_weights({"names": [m.name for m in meta],
                                    "dtype_names": [str(m.dtype).split(".")[-1] for m in meta],
                                    "shapes": [list(m.shape) for m in meta]})
        if not self.receivers.acquire(timeout=30):
            raise TimeoutError("no receiver")
        if self.fail:
            raise RuntimeError("NCCL error: peer gone")
        self.wire.append({n: t.clone() for n, t in self.source})
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.shut = True


def _sender(cls, engine):
    t = cls("127.0.0.1", 1, 0, 2, wire={}, device="cpu", timeout_s=20)  # a CPU "device" only with a stand-in engine
    t._engine = engine
    return t


def test_nccl_sender_hands_vllms_payload_back_and_waits_on_release():
    eng = FakeNcclTrainerEngine()
    t = _sender(NcclBroadcastTransport, eng)
    for version in (1, 2):
        w = _weights(version)
        h = t.send(w, version)  # returns while the "broadcast" still waits for its receivers
        assert h["transport"] == "nccl" and h["version"] == version and h["seq"] == version
        assert h["manifest"] == manifest_of(w) and h["update_info"] == _payload(w)
        check_vllm_handle(h)
        with pytest.raises(RuntimeError, match="is not released yet"):
            t.send(w, version + 10)
        eng.receivers.release()  # the engines receive
        t.release(h)
        assert all(torch.equal(eng.wire[-1][n], w[n]) for n in w)
    t.release(h)  # idempotent
    eng.fail = True
    h = t.send(_weights(), 3)
    eng.receivers.release()
    with pytest.raises(RuntimeError, match="peer gone"):
        t.release(h)
    t.close()
    assert eng.shut


def test_nccl_sender_release_times_out_when_nobody_receives():
    eng = FakeNcclTrainerEngine()
    t = _sender(NcclBroadcastTransport, eng)
    t.timeout_s = 0.5
    h = t.send(_weights(), 1)
    with pytest.raises(TimeoutError, match="did every engine receive it"):
        t.release(h)
    with pytest.raises(RuntimeError, match="not released yet"):  # the group is stuck: no next push
        t.send(_weights(), 2)
    eng.receivers.release()
    t.timeout_s = 20
    t.release(h)


def test_sender_errors_before_the_payload_surface_in_send():
    class Broken(FakeNcclTrainerEngine):
        def send_weights(self):
            raise ValueError("WeightSource metadata() disagrees with iteration")

    t = _sender(NcclBroadcastTransport, Broken())
    with pytest.raises(ValueError, match="disagrees"):
        t.send(_weights(), 1)
    with pytest.raises(WeightPushError, match="nothing to send"):
        t.send({}, 1)


def test_nccl_sender_arguments():
    with pytest.raises(ValueError, match="rank=1"):
        NcclBroadcastTransport("127.0.0.1", 1234, 1, 3)
    with pytest.raises(ValueError, match="world_size=1"):
        NcclBroadcastTransport("127.0.0.1", 1234, 0, 1)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            NcclBroadcastTransport("127.0.0.1", 1234, 0, 2)
        with pytest.raises(RuntimeError, match="needs CUDA"):
            CudaIpcTransport()


def test_vllm_handles_must_agree_with_their_payload():
    w = _weights()
    h = {"transport": "nccl", "version": 1, "manifest": manifest_of(w), "update_info": _payload(w)}
    check_vllm_handle(h)
    assert update_info_manifest(h["update_info"]) == manifest_of(w)
    bad = dict(h, update_info={**_payload(w), "shapes": [[4, 3], [5]]})
    with pytest.raises(WeightPushError, match="differs from its vLLM update_info"):
        check_vllm_handle(bad)
    with pytest.raises(WeightPushError, match="lacks vLLM's update_info"):
        check_vllm_handle({k: v for k, v in h.items() if k != "update_info"})
    with pytest.raises(WeightPushError, match="of one length"):
        update_info_manifest({"names": ["a"], "dtype_names": [], "shapes": [[1]]})


# ----------------------------------------------------------------------------------- engine
class ToyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 3, bias=False)
        self.b = torch.nn.Module()
        self.b.bias = torch.nn.Parameter(torch.zeros(5))
        self.loaded: list[list[str]] = []

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        batch = list(weights)
        self.loaded.append([n for n, _ in batch])
        for n, t in batch:
            params[n].data.copy_(t)
        return {n for n, _ in batch}


def _fake_vllm_engine_cls():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    class FakeVllmWorkerEngine(WeightTransferEngine):
        """Receives like vLLM's worker engines: tensors from "the wire", into ``self.model.load_weights``."""

        init_info_cls = dict
        update_info_cls = NCCLWeightTransferUpdateInfo
        wire: dict = {}
        drop: int = 0  # deliver this many tensors fewer (a truncated stream)
        received: list = []

        def init_transfer_engine(self, init_info) -> None:
            self.init_info = init_info

        def parse_init_info(self, d):
            return dict(d)

        def parse_update_info(self, d):
            d = dict(d)
            self.ipc_handles = d.pop("ipc_handles", None)  # IPC: must arrive unpickled
            return super().parse_update_info(d)

        def start_weight_update(self) -> None:  # cotrain runs the reload itself
            raise AssertionError("not used by cotrain")

        def finish_weight_update(self) -> None:
            raise AssertionError("not used by cotrain")

        def receive_weights(self, info) -> None:
            type(self).received.append(list(info.names))
            names = info.names[:len(info.names) - type(self).drop]
            for i in range(0, len(names), 1):  # one batch per tensor, as the unpacked path does
                self.model.load_weights([(names[i], type(self).wire[names[i]].clone())])

        def shutdown(self) -> None:
            pass

    return FakeVllmWorkerEngine


@pytest.fixture
def engine(tmp_path, monkeypatch):
    """A cotrain backend on a toy model whose checkpoint is in tmp_path, with vLLM's worker
    engines and its layerwise reload replaced by stand-ins."""
    from safetensors.torch import save_file
    from vllm.config.weight_transfer import WeightTransferConfig

    model = ToyModel()
    save_file({"a.weight": torch.zeros(3, 4), "b.bias": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    fake = _fake_vllm_engine_cls()
    fake.received, fake.drop = [], 0
    made: list = []

    def make(transport, config, vllm_config, device, m):
        e = fake(config, vllm_config, device, m)
        made.append((transport, e))
        return e

    reloads: list = []
    monkeypatch.setattr(vllm_receiver, "_make_vllm_engine", make)
    monkeypatch.setattr(transfer_backend, "_reload_api", lambda: (lambda m: reloads.append("init"),
                                                                  lambda m, c: reloads.append("finalize")))
    cls = transfer_backend.CotrainWeightTransferEngine
    vcfg = SimpleNamespace(parallel_config=SimpleNamespace(), model_config=SimpleNamespace(model=str(tmp_path)))
    eng = cls(WeightTransferConfig(backend="cotrain"), vcfg, torch.device("cpu"), model)
    return SimpleNamespace(eng=eng, model=model, fake=fake, made=made, reloads=reloads)


def _handle(transport: str, tensors: dict[str, torch.Tensor], version: int = 1) -> dict:
    info = _payload(tensors)
    if transport == "cuda_ipc":
        info = _json_safe_update_info({**info, "ipc_handles": [{"gpu-uuid": (n,)} for n in tensors]})
    return {"transport": transport, "version": version, "manifest": manifest_of(tensors),
            "update_info": info, "id": "x"}


def _push(eng, handle):
    eng.update_weights({"handle": handle})


def test_nccl_push_goes_through_vllms_engine_into_the_model(engine):
    e = engine
    e.eng.init_transfer_engine(e.eng.parse_init_info({"transport": "nccl", "options": {"master_address": "h"}}))
    assert [t for t, _ in e.made] == ["nccl"] and e.made[0][1].init_info == {"master_address": "h"}
    w = _weights(2.0)
    e.fake.wire = w
    _push(e.eng, _handle("nccl", w, 7))
    assert torch.equal(e.model.a.weight, w["a.weight"]) and torch.equal(e.model.b.bias, w["b.bias"])
    assert e.reloads == ["init", "finalize"] and e.model.loaded == [["a.weight"], ["b.bias"]]
    assert e.eng.last_push["version"] == 7 and e.eng.last_push["tensors"] == 2 and e.eng.pushes == 1
    assert e.made[0][1].model is e.model  # target restored after the push (vLLM's default)


def test_rejected_nccl_push_is_drained_and_the_model_untouched(engine):
    e = engine
    e.eng.init_transfer_engine(e.eng.parse_init_info({"transport": "nccl", "options": {}}))
    bad = {"a.weight": torch.ones(4, 3), "b.bias": torch.ones(5)}  # transposed
    e.fake.wire = bad
    with pytest.raises(WeightPushError, match=r"shape mismatch\(es\): 'a.weight' expected \[3, 4\] got \[4, 3\]"):
        _push(e.eng, _handle("nccl", bad))
    assert e.fake.received == [["a.weight", "b.bias"]]  # the broadcast was taken off the wire ...
    assert e.model.loaded == [] and e.reloads == [] and e.eng.drained == 1  # ... and dropped
    assert float(e.model.b.bias.detach().abs().sum()) == 0.0
    # a handle whose manifest is not its payload is refused the same way
    h = _handle("nccl", _weights())
    h["manifest"][0][1] = [3, 5]
    e.fake.wire = _weights()
    with pytest.raises(WeightPushError, match="differs from its vLLM update_info"):
        _push(e.eng, h)
    assert e.eng.drained == 2 and e.model.loaded == []


def test_nccl_push_without_a_group_and_truncated_delivery(engine):
    e = engine
    w = _weights(3.0)
    with pytest.raises(WeightPushError, match="broadcast group was not set up"):
        _push(e.eng, _handle("nccl", w))
    e.eng.init_transfer_engine(e.eng.parse_init_info({"transport": "nccl", "options": {}}))
    e.fake.wire, e.fake.drop = w, 1
    with pytest.raises(RuntimeError, match=r"delivered 1 tensor\(s\) for a manifest of 2"):
        _push(e.eng, _handle("nccl", w))
    assert e.reloads == ["init", "finalize"]  # no layer left on the meta device


def test_cuda_ipc_push_makes_vllms_ipc_engine_on_first_use(engine):
    e = engine
    w = _weights(5.0)
    e.fake.wire = w
    _push(e.eng, _handle("cuda_ipc", w))
    assert [t for t, _ in e.made] == ["cuda_ipc"] and e.made[0][1].init_info == {"packed": False}
    assert e.made[0][1].ipc_handles == [{"gpu-uuid": ("a.weight",)}, {"gpu-uuid": ("b.bias",)}]
    assert torch.equal(e.model.a.weight, w["a.weight"])
    with pytest.raises(WeightPushError, match="missing name"):
        _push(e.eng, _handle("cuda_ipc", {"a.weight": w["a.weight"]}))
    assert e.eng.drained == 0  # nothing to drain for IPC
    # a set without this worker's GPU is refused before the model changes, naming the GPU
    e.eng.receivers.gpu = "GPU-other"
    loads = len(e.model.loaded)
    with pytest.raises(WeightPushError, match="cuda_ipc handle set lacks GPU\\(s\\) GPU-other"):
        _push(e.eng, _handle("cuda_ipc", w))
    assert len(e.model.loaded) == loads and e.reloads == ["init", "finalize"]
    e.eng.receivers.gpu = "gpu-uuid"
    _push(e.eng, _handle("cuda_ipc", w))  # its own GPU's handles: loaded


# ----------------------------------------------------------------------------------- clients
class FakeLLM:
    def __init__(self, speculative=None, start_fails: bool = False) -> None:
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=speculative))
        self.rpcs: list = []
        self.start_fails = start_fails

    def update_weight_version(self, v):
        self.version = v

    def collective_rpc(self, method, args=()):
        self.rpcs.append((method, args))
        return [None]

    def start_weight_update(self):
        if self.start_fails:
            raise RuntimeError("a weight update is already in progress")


def test_pushes_refused_before_the_worker_still_drain_a_broadcast():
    from cotrain.rl.rollout import VllmGeneration

    h = _handle("nccl", _weights())
    gen = VllmGeneration(llm=FakeLLM(speculative=None))
    with pytest.raises(WeightPushError, match="without speculative decoding"):
        gen.push("draft", h, 1)
    assert gen.llm.rpcs == [("cotrain_drain", (h,))]
    llm = FakeLLM(start_fails=True)
    with pytest.raises(WeightPushError, match="could not start: a weight update is already in progress"):
        client.push(llm, "policy", h, 1)
    assert llm.rpcs == [("cotrain_drain", (h,))]
    llm = FakeLLM(start_fails=True)
    with pytest.raises(WeightPushError, match="could not start"):
        client.push(llm, "policy", dict(h, transport="cuda_ipc"), 1)
    assert llm.rpcs == []  # IPC leaves nothing in flight


# --------------------------------------------------------------------- object_store (CPU, several nodes)
def test_object_store_push_is_shm_on_the_senders_node_and_relayed_elsewhere():
    """``object_store``: an engine on the sender's node reads the sender's /dev/shm file; one on another
    node (here: a handle whose sender node id is not ours) gets the bytes from Ray's object store into a
    file of its own, loads exactly the sent tensors, and its cleanup removes that file. The real
    cross-node fetch runs in tests/rl/test_multinode.py."""
    import os

    import ray

    from cotrain.weights.transports.object_store import ObjectStoreTransport, localize_handle
    from cotrain.weights.transports.shm import ShmTransport

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        sent = _weights(2.0)
        tx = ObjectStoreTransport()
        handle = tx.send(sent, version=7)
        assert handle["transport"] == "object_store" and handle["node_id"] == ray.get_runtime_context().get_node_id()
        local, cleanup = localize_handle(handle)
        assert local["transport"] == "shm" and local["path"] == handle["path"] and local["relayed"] is False
        cleanup()
        assert os.path.exists(handle["path"])  # the sender's file is the sender's to release

        elsewhere = dict(handle, node_id="ff" * 28)
        relayed, cleanup = localize_handle(elsewhere)
        assert relayed["relayed"] is True and relayed["path"] != handle["path"] and os.path.exists(relayed["path"])
        got = ShmTransport().receive(relayed)
        assert set(got) == set(sent) and all(torch.equal(got[k], sent[k]) for k in sent)
        cleanup()
        assert not os.path.exists(relayed["path"])
        assert all(torch.equal(v, sent[k]) for k, v in tx.receive(elsewhere).items())  # receive() relays too
        tx.release(handle)
        assert not os.path.exists(handle["path"]) and not tx._refs
        with pytest.raises(WeightPushError, match="no object reference"):
            localize_handle(dict(elsewhere, object=[]))
    finally:
        if started:
            ray.shutdown()
