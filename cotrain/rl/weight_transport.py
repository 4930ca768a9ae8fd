"""How named tensors travel from a trainer to the rollout engines (the :class:`WeightTransport`s).

Every transport turns ``{name: tensor}`` into a small picklable *handle* (``send``) that crosses a
Ray call or a vLLM ``collective_rpc`` (which would turn raw tensors into nested lists), and back
into tensors on the receiving side (``receive``); ``release`` frees what ``send`` allocated once
every receiver is done. A handle always carries::

    {"transport": <name>, "version": <int>, "manifest": [[name, [shape...], "float32"], ...], ...}

so that the engine can validate names, shapes and dtypes *before* it touches any bytes
(:func:`check_manifest`).

=================  ==========================================  ======================================
transport          where                                       how the bytes move
=================  ==========================================  ======================================
``shm``            CPU, or any sender/receiver on one node     one safetensors file per push under
                                                               ``/dev/shm`` (memory, not disk);
                                                               cotrain's own (vLLM has no CPU path)
``object_store``   CPU, engines on several nodes               ``shm`` for the engines on the
                                                               sender's node; the same bytes in Ray's
                                                               object store for the others: Ray moves
                                                               them once per node, each engine there
                                                               writes its own ``/dev/shm`` file
``cuda_ipc``       GPU, trainer and engine on the same GPU(s)  vLLM's IPC weight-transfer engines
                                                               (CUDA IPC handle per tensor)
``nccl``           GPU, engines on other GPUs / nodes          vLLM's NCCL weight-transfer engines
                                                               (a dedicated broadcast group: rank 0
                                                               = trainer, 1.. = engine workers)
=================  ==========================================  ======================================

For ``cuda_ipc`` and ``nccl`` the handle also carries vLLM's update payload (``update_info``),
and the bytes are moved by vLLM's ``TrainerWeightTransferEngine`` on the sender and its worker
engine inside the rollout workers; cotrain keeps versions and manifest validation on top.

:func:`make_transport` picks one by name (``auto``: ``shm`` without CUDA, ``cuda_ipc`` with it).
"""

from __future__ import annotations

import base64
import os
import pickle
import queue
import tempfile
import threading
import time
import uuid
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterable

import torch

TRANSPORTS = ("shm", "object_store", "cuda_ipc", "nccl")

Manifest = list[list[Any]]  # [[name, [dims...], dtype_name], ...]


class WeightPushError(ValueError):
    """A weight push was rejected (names, shapes, dtypes or handle); the engine kept its weights."""


class WeightTransport(ABC):
    """How a set of named tensors travels from a trainer to an engine process."""

    name: str

    @abstractmethod
    def send(self, named_tensors: dict[str, torch.Tensor], version: int) -> dict:
        """Publish the tensors; returns a small picklable handle for the receiver."""

    @abstractmethod
    def receive(self, handle: dict) -> dict[str, torch.Tensor]:
        """Materialise the tensors on the receiving side."""

    def release(self, handle: dict) -> None:  # noqa: B027 - optional
        """Free what :meth:`send` allocated, once every receiver is done."""


def push_through(transport: WeightTransport, named_tensors: dict[str, torch.Tensor], version: int,
                 load: Callable[[dict], dict[str, Any]]) -> dict[str, Any]:
    """The one push sequence: ``send`` the tensors, ``load(handle)`` them into the engine(s), and
    ``release`` the handle whatever ``load`` did; returns ``load``'s timings plus ``send_s``."""
    t0 = time.perf_counter()
    handle = transport.send(named_tensors, version)
    send_s = time.perf_counter() - t0
    try:
        stats = load(handle)
    finally:
        transport.release(handle)
    return {**stats, "send_s": send_s}


# ------------------------------------------------------------------------------------ manifests
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise WeightPushError(f"unknown dtype {name!r} in a weight handle (allowed: torch dtype names "
                              "such as float32, bfloat16, float16, int64)")
    return dt


def manifest_of(named_tensors: dict[str, torch.Tensor]) -> Manifest:
    """``[[name, shape, dtype_name], ...]`` in the dict's order."""
    return [[n, list(t.shape), dtype_name(t.dtype)] for n, t in named_tensors.items()]


def _fmt_names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def check_manifest(
    got: Manifest,
    expected: dict[str, tuple[list[int], str]],
    *,
    kind: str = "policy",
    forbidden: dict[str, str] | None = None,
    require_all: bool = True,
) -> None:
    """Raise :class:`WeightPushError` unless ``got`` fits ``expected`` (name -> (shape, dtype)).

    Checks, in this order, and reports every failing category with its first offenders:
    names in ``forbidden`` (name -> why), unknown names, duplicated names, missing names (when
    ``require_all``), shape mismatches (expected vs got), dtype mismatches. Floating dtypes may
    differ (the engine casts on load: fp32 master weights into a bf16 engine is fine); a floating
    tensor for an integer parameter (or the reverse) is a mismatch.
    """
    forbidden = forbidden or {}
    names = [row[0] for row in got]
    problems: list[str] = []
    bad = [n for n in names if n in forbidden]
    if bad:
        problems.append(f"{len(bad)} name(s) not allowed in a {kind} push: {_fmt_names(bad)} "
                        f"({forbidden[bad[0]]})")
    unknown = [n for n in names if n not in expected and n not in forbidden]
    if unknown:
        sample = _fmt_names(sorted(expected)[:2], 2) if expected else "none"
        problems.append(f"{len(unknown)} unknown name(s): {_fmt_names(unknown)} (the engine's {kind} "
                        f"weights are named like {sample})")
    seen: set[str] = set()
    dups = [n for n in names if n in seen or seen.add(n)]
    if dups:
        problems.append(f"{len(dups)} duplicated name(s): {_fmt_names(dups)}")
    if require_all:
        have = set(names)
        missing = [n for n in expected if n not in have]
        if missing:
            problems.append(f"{len(missing)} missing name(s): {_fmt_names(missing)} (a {kind} push must "
                            f"carry all {len(expected)} tensors)")
    shape_bad, dtype_bad = [], []
    for name, shape, dt in got:
        if name not in expected:
            continue
        want_shape, want_dt = expected[name]
        if list(shape) != list(want_shape):
            shape_bad.append(f"{name!r} expected {list(want_shape)} got {list(shape)}")
        elif dtype_from_name(dt).is_floating_point != dtype_from_name(want_dt).is_floating_point:
            dtype_bad.append(f"{name!r} expected {want_dt} got {dt}")
    if shape_bad:
        more = f" (and {len(shape_bad) - 3} more)" if len(shape_bad) > 3 else ""
        problems.append(f"{len(shape_bad)} shape mismatch(es): " + "; ".join(shape_bad[:3]) + more)
    if dtype_bad:
        more = f" (and {len(dtype_bad) - 3} more)" if len(dtype_bad) > 3 else ""
        problems.append(f"{len(dtype_bad)} dtype mismatch(es): " + "; ".join(dtype_bad[:3]) + more)
    if problems:
        raise WeightPushError(f"{kind} weight push rejected: " + " | ".join(problems))


SHARED_KEYS = ("lm_head", "embed_tokens")  # target modules a drafter may borrow (EAGLE-3, DFlash)


def shared_name_reasons(names: Iterable[str], shared: Iterable[str]) -> dict[str, str]:
    """``{name: why}`` for the names that fall in a module the drafter borrows from the target
    (``shared`` holds keys of :data:`SHARED_KEYS`): a draft push must not carry them."""
    shared = set(shared)
    out = {}
    for n in names:
        hit = [k for k in SHARED_KEYS if k in shared and k in n.split(".")]
        if hit:
            out[n] = (f"the drafter shares {hit[0]} with the target; a draft push carries only the drafter's own "
                      "parameters (push the target's through a policy push)")
    return out


def check_received(handle: dict, tensors: dict[str, torch.Tensor]) -> None:
    """The tensors a transport delivered are exactly what the handle's manifest announced."""
    want = {n: (list(s), d) for n, s, d in handle["manifest"]}
    got = manifest_of(tensors)
    if [r[0] for r in got] != list(want) or any(want[n] != (s, d) for n, s, d in got):
        raise WeightPushError(f"{handle.get('transport')} transport delivered tensors that differ from the "
                              f"handle's manifest (version {handle.get('version')}); the push was not applied")


def _check_handle(handle: dict, transport: str) -> None:
    if not isinstance(handle, dict) or handle.get("transport") != transport:
        got = handle.get("transport") if isinstance(handle, dict) else type(handle).__name__
        raise WeightPushError(f"handle is for transport {got!r}, not {transport!r} (allowed: {TRANSPORTS})")
    for key in ("version", "manifest"):
        if key not in handle:
            raise WeightPushError(f"{transport} handle lacks {key!r}")


def _flat_tensors(named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not named_tensors:
        raise WeightPushError("nothing to send: the push has no tensors")
    out = {}
    for n, t in named_tensors.items():
        if not isinstance(t, torch.Tensor):
            raise WeightPushError(f"{n!r} is a {type(t).__name__}, not a torch.Tensor")
        out[n] = t.detach()
    return out


# ------------------------------------------------------------------------------------------ shm
def _default_shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class ShmTransport(WeightTransport):
    """One safetensors file per push in shared memory (``/dev/shm``): CPU engines, one node.

    ``send`` writes ``<dir>/cotrain-w-<pid>-<id>-v<version>.safetensors`` atomically (temporary
    name, then rename) and returns ``{"transport": "shm", "version", "manifest", "path",
    "nbytes"}``. ``receive`` reads the file (any process on the node). ``release`` deletes it;
    files of a crashed sender stay until reboot or manual cleanup (their names carry the pid).
    """

    name = "shm"

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or _default_shm_dir()

    def send(self, named_tensors: dict[str, torch.Tensor], version: int) -> dict:
        from safetensors.torch import save_file

        tensors = _flat_tensors(named_tensors)
        seen: set[int] = set()
        out = {}
        for n, t in tensors.items():
            t = t.to("cpu").contiguous()
            # safetensors refuses tensors that share storage (tied weights): give each its own copy
            key = t.untyped_storage().data_ptr()
            if key in seen:
                t = t.clone()
            seen.add(key)
            out[n] = t
        path = os.path.join(self.directory, f"cotrain-w-{os.getpid()}-{uuid.uuid4().hex[:12]}-v{int(version)}.safetensors")
        tmp = path + ".tmp"
        try:
            save_file(out, tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return {"transport": self.name, "version": int(version), "manifest": manifest_of(out), "path": path,
                "nbytes": sum(t.numel() * t.element_size() for t in out.values())}

    def receive(self, handle: dict) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        _check_handle(handle, self.name)
        path = handle.get("path")
        if not path or not os.path.exists(path):
            raise WeightPushError(f"shm handle of version {handle['version']} points at {path!r}, which does not "
                                  "exist (released already, or sent from another node? shm works within one node)")
        loaded = load_file(path)
        # the file's key order is sorted; keep the sender's order
        tensors = {n: loaded[n] for n, _, _ in handle["manifest"] if n in loaded}
        if len(tensors) != len(loaded):
            tensors = loaded
        check_received(handle, tensors)
        return tensors

    def release(self, handle: dict) -> None:
        path = handle.get("path") if isinstance(handle, dict) else None
        if path:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


# ------------------------------------------------------------------------- CPU across nodes
def _ray_node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001
        return None


class ObjectStoreTransport(ShmTransport):
    """``object_store``: CPU pushes to engines on several nodes, on Ray's own machinery.

    ``send`` writes the ``shm`` file as :class:`ShmTransport` does (the engines on this node read it
    in place) and puts the same bytes once into Ray's object store; the handle carries the sender's
    node id and the object's reference: ``{"transport": "object_store", ..., "path", "node_id",
    "object": [ref]}``. An engine on another node (:func:`localize_handle`) gets the object - Ray's
    object manager moves it once per node, every engine of that node maps the same copy - writes it
    to its own ``/dev/shm`` file and loads that as an ``shm`` push. Nothing to keep in step: a
    rejected push moves no bytes, and a dead node fails the fetch with Ray's error. ``release``
    deletes the file and drops the reference (Ray frees the object once the engines have too).
    """

    name = "object_store"

    def __init__(self, directory: str | None = None) -> None:
        super().__init__(directory)
        self._refs: dict[str, Any] = {}

    def send(self, named_tensors: dict[str, torch.Tensor], version: int) -> dict:
        import mmap

        import numpy as np
        import ray

        if not ray.is_initialized():
            raise WeightPushError("object_store transport needs Ray (ray.init first; on one node use shm)")
        handle = super().send(named_tensors, version)
        with open(handle["path"], "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            ref = ray.put(np.frombuffer(mm, dtype=np.uint8))  # one copy, into this node's object store
        finally:
            try:
                mm.close()
            except BufferError:  # pragma: no cover - numpy view still referenced
                pass
        self._refs[handle["path"]] = ref
        handle.update(transport=self.name, node_id=_ray_node_id(), object=[ref])
        return handle

    def receive(self, handle: dict) -> dict[str, torch.Tensor]:
        local, cleanup = localize_handle(handle)
        try:
            return ShmTransport(self.directory).receive(local)
        finally:
            cleanup()

    def release(self, handle: dict) -> None:
        super().release(handle)
        if isinstance(handle, dict):
            self._refs.pop(handle.get("path"), None)


def localize_handle(handle: dict, directory: str | None = None) -> tuple[dict, Any]:
    """An ``shm`` handle this process can load, and a cleanup to call once loaded. ``shm`` and GPU
    handles come back as they are. An ``object_store`` handle from this node reads the sender's
    file; from another node its bytes are fetched from Ray's object store into a ``/dev/shm`` file
    of this node (``handle["relayed"]`` is True then; the cleanup deletes it)."""
    if not isinstance(handle, dict) or handle.get("transport") != "object_store":
        return handle, lambda: None
    _check_handle(handle, "object_store")
    local = {k: v for k, v in handle.items() if k not in ("object", "node_id")}
    local["transport"] = "shm"
    if handle.get("node_id") is not None and handle.get("node_id") == _ray_node_id():
        local["relayed"] = False
        return local, lambda: None
    import ray

    refs = handle.get("object") or []
    if len(refs) != 1:
        raise WeightPushError(f"object_store handle of version {handle['version']} carries no object reference")
    data = ray.get(refs[0])  # pulled once per node, a read-only view of that node's copy
    directory = directory or _default_shm_dir()
    path = os.path.join(directory, f"cotrain-w-relay-{os.getpid()}-{uuid.uuid4().hex[:12]}-v{int(handle['version'])}"
                        ".safetensors")
    try:
        with open(path, "wb") as f:
            f.write(memoryview(data))
    except BaseException:
        if os.path.exists(path):
            os.unlink(path)
        raise
    del data
    local.update(path=path, relayed=True)

    def cleanup() -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    return local, cleanup


# ----------------------------------------------------------------- GPU: vLLM's transfer engines
#: cotrain transport name -> vLLM weight-transfer backend that moves the bytes
VLLM_BACKENDS = {"cuda_ipc": "ipc", "nccl": "nccl"}


def nccl_wire(packed: bool = True, buffer_bytes: int | None = None, num_buffers: int | None = None) -> dict:
    """The wire parameters both ends of the ``nccl`` transport must agree on (vLLM's names;
    defaults: vLLM's packed broadcast, 1 GiB x 2 buffers)."""
    from vllm.distributed.weight_transfer.packed_tensor import (
        DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        DEFAULT_PACKED_NUM_BUFFERS,
    )

    return {"packed": bool(packed),
            "packed_buffer_size_bytes": int(buffer_bytes or DEFAULT_PACKED_BUFFER_SIZE_BYTES),
            "packed_num_buffers": int(num_buffers or DEFAULT_PACKED_NUM_BUFFERS)}


def update_info_manifest(info: dict) -> Manifest:
    """The manifest of a vLLM update payload (``names`` / ``dtype_names`` / ``shapes``)."""
    names, dts, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
    if not isinstance(names, list) or not isinstance(dts, list) or not isinstance(shapes, list) \
            or not len(names) == len(dts) == len(shapes):
        raise WeightPushError("a vLLM update payload needs names, dtype_names and shapes of one length")
    return [[n, [int(x) for x in s], d] for n, d, s in zip(names, dts, shapes)]


def restore_update_info(info: dict) -> dict:
    """vLLM's IPC payload carries CUDA IPC rebuild arguments (tuples holding classes and dtypes),
    which vLLM's msgpack channel to a multi-process engine core refuses, so the sender pickles them
    as vLLM's own HTTP client does (``_json_safe_update_info``: ``ipc_handles_pickled``, base64).
    vLLM's worker unpickles them only under the process-wide ``VLLM_ALLOW_INSECURE_SERIALIZATION``;
    cotrain's backend does it here instead, for the run's own trainer's handles: the payload vLLM's
    worker engine parses."""
    if "ipc_handles_pickled" not in info:
        return dict(info)
    out = {k: v for k, v in info.items() if k != "ipc_handles_pickled"}
    out["ipc_handles"] = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
    return out


def check_vllm_handle(handle: dict) -> None:
    """A ``cuda_ipc`` / ``nccl`` handle carries vLLM's update payload, and its manifest is that
    payload's (what cotrain validates is exactly what vLLM's engine will receive)."""
    name = handle.get("transport") if isinstance(handle, dict) else None
    if name not in VLLM_BACKENDS:
        raise WeightPushError(f"not a vLLM-transport handle: {name!r} (allowed: {', '.join(VLLM_BACKENDS)})")
    _check_handle(handle, name)
    info = handle.get("update_info")
    if not isinstance(info, dict):
        raise WeightPushError(f"{name} handle lacks vLLM's update_info")
    if update_info_manifest(info) != [[n, list(s), d] for n, s, d in handle["manifest"]]:
        raise WeightPushError(f"{name} handle's manifest differs from its vLLM update_info (version "
                              f"{handle.get('version')}); the push was not applied")


def _dict_source(tensors: dict[str, torch.Tensor]):
    """A vLLM ``WeightSource`` over a ready ``{name: tensor}`` (rank 0 holds the whole state:
    Megatron gathered it already, so there is nothing to materialise)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class DictSource(WeightSource):
        def metadata(self) -> list:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]

        def __iter__(self):
            return iter(list(tensors.items()))

    return DictSource()


class _Handoff:
    """The ``VLLMWeightSyncClient`` a vLLM trainer engine drives, run from a background thread.

    cotrain's driver, not the trainer, talks to the engines (``push_handle``), so instead of
    calling them this client hands vLLM's update payload back to :meth:`_VllmSender.send`, which
    puts it in the handle. With ``hold`` (CUDA IPC) ``update_weights`` returns only once the
    handle is released: vLLM's engine keeps the shared tensors alive until its round trip ends,
    so the round trip lasts until every rollout engine has loaded them.
    """

    def __init__(self, hold: bool) -> None:
        self.hold = hold
        self.payloads: queue.Queue = queue.Queue()
        self.released = threading.Event()
        self.worker_init: dict | None = None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.worker_init = dict(init_info)  # the engines join through RolloutGroup.init_broadcast_group

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info) -> None:
        self.payloads.put(update_info)
        if self.hold:
            self.released.wait()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


class _VllmSender(WeightTransport):
    """Sender side of a GPU transport: one of vLLM's ``TrainerWeightTransferEngine`` s, driven
    push by push. ``send`` stages the tensors on this process's GPU, starts the engine's
    ``send_weights`` in a background thread with a :class:`_Handoff` client and returns as soon
    as vLLM has built the update payload: ``{"transport", "version", "manifest", "id",
    "update_info"}``. The engine side (``cotrain.rl.vllm.transfer_backend``) validates the manifest and lets
    vLLM's matching worker engine receive. ``release`` ends the round trip and reports its
    errors. One push at a time: ``send`` refuses while another is unreleased.

    One sender carries both kinds (``policy`` and ``draft``): a push is names and tensors, the
    engines decide which model they load into.
    """

    hold = False

    def __init__(self, device: torch.device | str | None = None, timeout_s: float = 600) -> None:
        if device is None:
            if not torch.cuda.is_available():
                raise RuntimeError(f"{self.name} transport needs CUDA (allowed without a GPU: shm)")
            device = torch.device("cuda", torch.cuda.current_device())
        # (an explicit CPU device only makes sense with a stand-in engine: the unit tests)
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self._engine = None
        self._pending: dict[str, tuple[threading.Thread, _Handoff, list]] = {}
        self._seq = 0

    def _make_engine(self):  # pragma: no cover - GPU
        raise NotImplementedError

    def _stage(self, named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # the drafter's tensors reach rank 0 from the last pipeline stage (possibly on the CPU or
        # another device): everything goes out from this process's GPU
        return {n: t.to(self.device).contiguous() for n, t in _flat_tensors(named_tensors).items()}

    def send(self, named_tensors: dict[str, torch.Tensor], version: int) -> dict:
        if self._pending:
            raise RuntimeError(f"{self.name}: push {sorted(self._pending)} is not released yet (release each "
                               "handle once the engines have loaded it, before the next send)")
        tensors = self._stage(named_tensors)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)  # vLLM's producers read them from their own streams
        if self._engine is None:
            self._engine = self._make_engine()
        engine, client, errors = self._engine, _Handoff(self.hold), []

        def run() -> None:
            try:
                if cuda:
                    torch.cuda.set_device(self.device)
                engine.client, engine.source = client, _dict_source(tensors)
                engine.send_weights()
            except BaseException as e:  # reported by send (before the payload) or release
                errors.append(e)
                client.payloads.put(e)

        self._seq += 1
        hid = f"{self._seq}-{uuid.uuid4().hex[:8]}"
        th = threading.Thread(target=run, name=f"cotrain-{self.name}-{self._seq}", daemon=True)
        th.start()
        try:
            payload = client.payloads.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: vLLM's trainer engine built no update payload within "
                               f"{self.timeout_s:g} s") from None
        if isinstance(payload, BaseException):
            th.join(self.timeout_s)
            raise payload
        if isinstance(payload, list):  # a chunked payload: cotrain forwards one update per push
            client.released.set()
            raise RuntimeError(f"{self.name}: vLLM sent a chunked update ({len(payload)} parts); cotrain pushes "
                               "one update per handle (packed=False for IPC)")
        self._pending[hid] = (th, client, errors)
        from vllm.distributed.weight_transfer.clients import _json_safe_update_info

        info = _json_safe_update_info(dict(payload))
        return {"transport": self.name, "version": int(version), "manifest": update_info_manifest(info),
                "id": hid, "seq": self._seq, "update_info": info}

    def receive(self, handle: dict) -> dict[str, torch.Tensor]:
        raise WeightPushError(f"{self.name} handles are received by vLLM's {VLLM_BACKENDS[self.name]!r} engine "
                              "inside the rollout workers (cotrain.rl.vllm.transfer_backend), not by a cotrain transport")

    def release(self, handle: dict) -> None:
        entry = self._pending.pop(handle.get("id") if isinstance(handle, dict) else None, None)
        if entry is None:
            return
        th, client, errors = entry
        client.released.set()
        th.join(self.timeout_s)
        if th.is_alive():
            self._pending[handle["id"]] = entry  # still in flight: the next send must not start
            raise TimeoutError(f"{self.name} push {handle.get('seq')} (version {handle.get('version')}) did not "
                               f"finish within {self.timeout_s:g} s (did every engine receive it?)")
        if errors:
            raise errors[0]

    def close(self) -> None:
        for hid in list(self._pending):
            try:
                self.release({"id": hid})
            except Exception:
                pass
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def _rank_zero_ipc_engine_cls():
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine

    class RankZeroIPCTrainerEngine(IPCTrainerWeightTransferEngine):
        """vLLM's trainer-side IPC engine for a sender that holds the whole state by itself.

        vLLM's engine all-gathers IPC handles and barriers over the *default* process group (it
        expects every trainer rank to iterate an FSDP source). A Megatron trainer gathers the
        full state on rank 0 first and only rank 0 exports, so both steps are skipped here:
        the handles are rank 0's own, and the only post-send work is ``ipc_collect``.
        """

        def _all_gather_and_merge_handles(self, handles):
            return handles

        @staticmethod
        def _post_send_sync() -> None:
            torch.cuda.ipc_collect()

    return RankZeroIPCTrainerEngine


class CudaIpcTransport(_VllmSender):
    """``cuda_ipc``: trainer and engines share the GPU(s). vLLM's IPC engines move the bytes:
    :func:`IPCTrainerWeightTransferEngine` (one CUDA IPC handle per tensor, keyed by GPU UUID)
    on this side, ``IPCWeightTransferEngine`` in the engines. The engines map the sender's
    memory: the sender keeps the tensors alive (and unmodified) until :meth:`release`."""

    name = "cuda_ipc"
    hold = True

    def _make_engine(self):  # pragma: no cover - GPU
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        torch.cuda.set_device(self.device)
        return _rank_zero_ipc_engine_cls().trainer_init(IPCTrainerInitInfo(rank=0, packed=False),
                                                        client=_Handoff(False), source=_dict_source({}))


class NcclBroadcastTransport(_VllmSender):
    """``nccl``: a broadcast group of trainer rank 0 (rank 0 here) and every engine worker
    (ranks 1..). vLLM's NCCL engines move the bytes: ``NCCLTrainerWeightTransferEngine`` here
    (its own ``StatelessProcessGroup`` + ``PyNcclCommunicator``, never the default group; packed
    double-buffered broadcast), ``NCCLWeightTransferEngine`` in the engine workers, which join
    through ``RolloutGroup.init_broadcast_group`` while :meth:`connect` runs (both block until
    the group is complete). ``send`` returns the handle as soon as the broadcast is queued; the
    engines receive inside ``update_weights``; ``release`` waits for the broadcast to finish.
    Pushes must reach the engines in ``seq`` order. On a rejected push the engines still
    receive the bytes (and drop them), so the group stays in step.
    """

    name = "nccl"

    def __init__(self, master_addr: str, master_port: int, rank: int = 0, world_size: int = 2, *,
                 wire: dict | None = None, device: torch.device | str | None = None, timeout_s: float = 600) -> None:
        if rank != 0:
            raise ValueError(f"rank={rank}: cotrain's side of the nccl group is the sender, rank 0 (the engines' "
                             "workers join through RolloutGroup.init_broadcast_group, as vLLM's NCCL engine)")
        if world_size < 2:
            raise ValueError(f"world_size={world_size} (allowed: >= 2: the sender plus every engine worker)")
        super().__init__(device=device, timeout_s=timeout_s)
        self.master_addr, self.master_port, self.world_size = master_addr, int(master_port), int(world_size)
        self.wire = dict(wire) if wire is not None else nccl_wire()

    def connect(self) -> None:  # pragma: no cover - GPU
        """Open the group (blocks until every engine worker has joined)."""
        if self._engine is not None:
            return
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        torch.cuda.set_device(self.device)
        info = NCCLTrainerInitInfo(master_address=self.master_addr, master_port=self.master_port,
                                   world_size=self.world_size, rank=0, **self.wire)
        self._engine = WeightTransferTrainerFactory.trainer_init(info, client=_Handoff(False),
                                                                 source=_dict_source({}))

    def _make_engine(self):
        raise RuntimeError("NcclBroadcastTransport.connect() was not called (TrainerGroup.connect_weight_broadcast "
                           "sets the group up with the engines)")


# -------------------------------------------------------------------------------------- factory
def resolve_transport_name(name: str, *, colocated: bool = True) -> str:
    """``auto`` -> ``shm`` without CUDA, else ``cuda_ipc`` (colocated) or ``nccl`` (validation
    resolves the run's ``auto`` itself: ``object_store`` on several CPU nodes)."""
    if name == "auto":
        if not torch.cuda.is_available():
            return "shm"
        return "cuda_ipc" if colocated else "nccl"
    if name not in TRANSPORTS:
        raise ValueError(f"weight transport {name!r} is unknown (allowed: auto, {', '.join(TRANSPORTS)})")
    return name


def make_transport(name: str = "auto", *, colocated: bool = True, **kwargs: Any) -> WeightTransport:
    """A sender-side transport by name (``auto``, ``shm``, ``cuda_ipc``, ``nccl``).

    ``nccl`` needs ``master_addr``, ``master_port``, ``world_size`` and a later
    :meth:`NcclBroadcastTransport.connect` (concurrently with the engines joining).
    """
    name = resolve_transport_name(name, colocated=colocated)
    if name == "shm":
        return ShmTransport(**kwargs)
    if name == "object_store":
        return ObjectStoreTransport(**kwargs)
    if name == "cuda_ipc":
        return CudaIpcTransport(**kwargs)
    missing = [k for k in ("master_addr", "master_port", "world_size") if k not in kwargs]
    if missing:
        raise ValueError(f"nccl transport needs {', '.join(missing)}")
    return NcclBroadcastTransport(**kwargs)


def receiver_for(handle: dict) -> WeightTransport:
    """The receiving-side cotrain transport for a handle: ``shm`` only. ``cuda_ipc`` and ``nccl``
    handles are received by vLLM's own engines inside the rollout workers (``cotrain.rl.vllm.transfer_backend``)."""
    if not isinstance(handle, dict) or "transport" not in handle:
        raise WeightPushError(f"not a weight handle: {type(handle).__name__} (expected a dict from a "
                              "WeightTransport.send)")
    name = handle["transport"]
    if name == "shm":
        return ShmTransport()
    if name == "object_store":
        return ObjectStoreTransport()
    if name in VLLM_BACKENDS:
        raise WeightPushError(f"{name} handles are received by vLLM's {VLLM_BACKENDS[name]!r} weight-transfer engine "
                              "inside a rollout worker (cotrain.rl.vllm.transfer_backend), not by a cotrain transport")
    raise WeightPushError(f"handle transport {name!r} is unknown (allowed: {', '.join(TRANSPORTS)})")


def total_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


__all__ = [
    "TRANSPORTS", "VLLM_BACKENDS", "WeightPushError", "WeightTransport", "push_through", "ShmTransport", "ObjectStoreTransport", "localize_handle",
    "CudaIpcTransport", "NcclBroadcastTransport",
    "make_transport", "resolve_transport_name", "receiver_for", "check_manifest", "check_received",
    "check_vllm_handle", "update_info_manifest", "nccl_wire", "restore_update_info", "manifest_of", "dtype_name", "dtype_from_name",
    "total_bytes", "SHARED_KEYS", "shared_name_reasons",
]
