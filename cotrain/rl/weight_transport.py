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
                                                               ``/dev/shm`` (memory, not disk)
``cuda_ipc``       GPU, trainer and engine on the same GPU(s)  CUDA IPC handles of the sender's
                                                               tensors (zero copy until loading)
``nccl``           GPU, engines on other GPUs / nodes          a dedicated broadcast group (rank 0 =
                                                               trainer, 1.. = engine workers); gloo
                                                               runs the same code on CPU (tests)
=================  ==========================================  ======================================

:func:`make_transport` picks one by name (``auto``: ``shm`` without CUDA, ``cuda_ipc`` with it).
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import uuid
from datetime import timedelta
from typing import Any, Iterable

import torch

from cotrain.rl.interfaces import WeightTransport

TRANSPORTS = ("shm", "cuda_ipc", "nccl")

Manifest = list[list[Any]]  # [[name, [dims...], dtype_name], ...]


class WeightPushError(ValueError):
    """A weight push was rejected (names, shapes, dtypes or handle); the engine kept its weights."""


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


# ------------------------------------------------------------------------------------- cuda_ipc
def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class CudaIpcTransport(WeightTransport):
    """CUDA IPC handles of the sender's GPU tensors: trainer and engine colocated on one node.

    ``send`` keeps a reference to every (contiguous, on-GPU) tensor until ``release``, and returns
    ``{"transport": "cuda_ipc", "version", "manifest", "id", "ipc": [{gpu_uuid: args}, ...]}``
    where ``args`` are :func:`torch.multiprocessing.reductions.reduce_tensor`'s rebuild arguments.
    ``receive`` maps them into the receiving process on *its* current device (the GPU is found by
    UUID, so differing ``CUDA_VISIBLE_DEVICES`` orders are fine). The received tensors alias the
    sender's memory (for contiguous parameters: the parameters themselves): the sender must not
    modify them (no optimizer step) until every engine has loaded them and ``release`` ran.
    """

    name = "cuda_ipc"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("cuda_ipc transport needs CUDA (allowed without a GPU: shm)")
        self._live: dict[str, dict[str, torch.Tensor]] = {}

    def send(self, named_tensors: dict[str, torch.Tensor], version: int) -> dict:
        from torch.multiprocessing.reductions import reduce_tensor

        tensors = _flat_tensors(named_tensors)
        keep, ipc = {}, []
        for n, t in tensors.items():
            if not t.is_cuda:
                raise WeightPushError(f"cuda_ipc sends GPU tensors; {n!r} is on {t.device} (allowed: shm for CPU "
                                      "tensors)")
            t = t.contiguous()
            keep[n] = t
            _, args = reduce_tensor(t)
            ipc.append({_device_uuid(t.device.index): args})
        torch.cuda.synchronize()  # the receiver must see finished values
        hid = uuid.uuid4().hex
        self._live[hid] = keep
        return {"transport": self.name, "version": int(version), "manifest": manifest_of(keep), "id": hid,
                "ipc": ipc}

    def receive(self, handle: dict) -> dict[str, torch.Tensor]:
        return receive_cuda_ipc(handle)

    def release(self, handle: dict) -> None:
        if self._live.pop(handle.get("id"), None) is not None:
            torch.cuda.ipc_collect()


def receive_cuda_ipc(handle: dict, device_index: int | None = None) -> dict[str, torch.Tensor]:
    """Rebuild a ``cuda_ipc`` handle's tensors on this process's GPU (no sender object needed)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    _check_handle(handle, "cuda_ipc")
    if not torch.cuda.is_available():
        raise WeightPushError("a cuda_ipc handle reached a process without CUDA (allowed on CPU engines: shm)")
    index = torch.cuda.current_device() if device_index is None else device_index
    me = _device_uuid(index)
    out = {}
    for (n, _, _), per_gpu in zip(handle["manifest"], handle["ipc"]):
        if me not in per_gpu:
            raise WeightPushError(f"cuda_ipc handle for {n!r} lives on GPU(s) {list(per_gpu)}, not on this "
                                  f"process's GPU {me}: cuda_ipc needs colocated trainer and engine (allowed "
                                  "otherwise: nccl)")
        args = list(per_gpu[me])
        args[6] = index  # the sender's device index means nothing here; the UUID matched
        out[n] = rebuild_cuda_tensor(*args)
    check_received(handle, out)
    return out


# ----------------------------------------------------------------------------------------- nccl
class NcclBroadcastTransport(WeightTransport):
    """A dedicated broadcast group: rank 0 (the trainer) sends, ranks 1.. (engine workers) receive.

    The group is separate from every other torch.distributed group in the processes involved
    (its own TCP store and process group object, never the default group), so it can join a
    trainer rank and vLLM workers that each already have their own world. All members call
    :meth:`connect` concurrently (the rendezvous blocks until the group is complete).

    ``send`` (rank 0) broadcasts the tensors in manifest order from a background thread and
    returns ``{"transport": "nccl", "version", "manifest", "seq"}`` at once, so the caller can
    forward the handle to the receivers while the bytes are in flight; ``receive`` (ranks >= 1)
    allocates the tensors on its device and joins the same broadcasts; ``release`` waits for the
    sender's broadcasts to finish. Pushes must reach every receiver in ``seq`` order.

    ``backend="gloo"`` runs the same protocol on CPU tensors (used by the CPU tests); ``"nccl"``
    is the GPU path.
    """

    name = "nccl"

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int, *,
                 backend: str = "nccl", device: torch.device | str | None = None, timeout_s: float = 600) -> None:
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend={backend!r} (allowed: nccl, gloo)")
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size} (allowed: world_size >= 2, 0 <= rank < world_size)")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("nccl transport needs CUDA (allowed without a GPU: shm, or backend='gloo')")
        self.master_addr, self.master_port = master_addr, int(master_port)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        self.timeout = timedelta(seconds=timeout_s)
        self._pg = None
        self._store = None
        self._seq = 0
        self._threads: dict[int, tuple[threading.Thread, list]] = {}

    @classmethod
    def from_init_info(cls, info: dict, local_rank_in_engine: int = 0) -> "NcclBroadcastTransport":
        """Receiver side, from ``{"master_addr", "master_port", "world_size", "rank_offset", "backend"}``."""
        return cls(info["master_addr"], info["master_port"], int(info["rank_offset"]) + local_rank_in_engine,
                   int(info["world_size"]), backend=info.get("backend", "nccl"))

    def connect(self) -> None:
        import torch.distributed as dist

        if self._pg is not None:
            return
        listen_fd = None
        if self.rank == 0:
            # bind the rendezvous to master_addr only (torch's own server would listen on every
            # interface): on one machine everything stays on loopback
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.master_addr, self.master_port))
            sock.listen(max(16, self.world_size))
            listen_fd = sock.detach()  # the store owns (and closes) the listening socket from here
        store = dist.TCPStore(self.master_addr, self.master_port, self.world_size, is_master=self.rank == 0,
                              timeout=self.timeout, wait_for_workers=True, master_listen_fd=listen_fd)
        self._store = store  # kept for the group's lifetime; close() drops it after the group
        store = dist.PrefixStore("cotrain-weights", store)
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            self._pg = dist.ProcessGroupNCCL(store, self.rank, self.world_size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            loopback = self.master_addr in ("127.0.0.1", "localhost")
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if loopback
                             else dist.ProcessGroupGloo.create_default_device()]
            self._pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, opts)
        # one small collective so that communicator set-up happens here, not inside the first push
        probe = torch.ones(1, device=self.device)
        self._broadcast(probe).wait()

    def _broadcast(self, t: torch.Tensor):
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        return self._pg.broadcast([t], opts)

    def _require(self, sender: bool) -> None:
        if self._pg is None:
            raise RuntimeError("NcclBroadcastTransport.connect() was not called")
        if sender != (self.rank == 0):
            raise RuntimeError(f"rank {self.rank} cannot {'send' if sender else 'receive'} (rank 0 sends)")

    def send(self, named_tensors: dict[str, torch.Tensor], version: int) -> dict:
        self._require(sender=True)
        tensors = {n: t.to(self.device).contiguous() for n, t in _flat_tensors(named_tensors).items()}
        self._seq += 1
        seq = self._seq
        errors: list = []

        def run() -> None:
            try:
                for t in tensors.values():
                    self._broadcast(t).wait()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            except BaseException as e:  # reported by release()
                errors.append(e)

        th = threading.Thread(target=run, name=f"cotrain-bcast-{seq}", daemon=True)
        self._threads[seq] = (th, errors)
        th.start()
        return {"transport": self.name, "version": int(version), "manifest": manifest_of(tensors), "seq": seq}

    def receive(self, handle: dict) -> dict[str, torch.Tensor]:
        _check_handle(handle, self.name)
        self._require(sender=False)
        out = {}
        for n, shape, dt in handle["manifest"]:
            t = torch.empty(shape, dtype=dtype_from_name(dt), device=self.device)
            self._broadcast(t).wait()
            out[n] = t
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out

    def release(self, handle: dict) -> None:
        entry = self._threads.pop(handle.get("seq"), None)
        if entry is None:
            return
        th, errors = entry
        th.join(self.timeout.total_seconds())
        if th.is_alive():
            raise TimeoutError(f"weight broadcast {handle.get('seq')} did not finish within {self.timeout}")
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Wait for pending broadcasts and drop the group. Call it before the process exits: a
        gloo group still alive at interpreter teardown aborts the process."""
        for th, _ in self._threads.values():
            th.join(self.timeout.total_seconds())
        self._threads.clear()
        self._pg = None
        self._store = None


# -------------------------------------------------------------------------------------- factory
def resolve_transport_name(name: str, *, colocated: bool = True) -> str:
    """``auto`` -> ``shm`` without CUDA, else ``cuda_ipc`` (colocated) or ``nccl``."""
    if name == "auto":
        if not torch.cuda.is_available():
            return "shm"
        return "cuda_ipc" if colocated else "nccl"
    if name not in TRANSPORTS:
        raise ValueError(f"weight transport {name!r} is unknown (allowed: auto, {', '.join(TRANSPORTS)})")
    return name


def make_transport(name: str = "auto", *, colocated: bool = True, **kwargs: Any) -> WeightTransport:
    """A sender-side transport by name (``auto``, ``shm``, ``cuda_ipc``, ``nccl``).

    ``nccl`` needs ``master_addr``, ``master_port``, ``world_size`` (and ``rank=0``, the default
    for a sender) and a later :meth:`NcclBroadcastTransport.connect`.
    """
    name = resolve_transport_name(name, colocated=colocated)
    if name == "shm":
        return ShmTransport(**kwargs)
    if name == "cuda_ipc":
        return CudaIpcTransport(**kwargs)
    kwargs.setdefault("rank", 0)
    missing = [k for k in ("master_addr", "master_port", "world_size") if k not in kwargs]
    if missing:
        raise ValueError(f"nccl transport needs {', '.join(missing)}")
    return NcclBroadcastTransport(**kwargs)


def receiver_for(handle: dict, registry: dict[str, WeightTransport] | None = None) -> WeightTransport:
    """The receiving-side transport for a handle: stateless ones are made on the spot; ``nccl``
    must have been registered (connected) in ``registry`` first."""
    if not isinstance(handle, dict) or "transport" not in handle:
        raise WeightPushError(f"not a weight handle: {type(handle).__name__} (expected a dict from a "
                              "WeightTransport.send)")
    name = handle["transport"]
    if registry and name in registry:
        return registry[name]
    if name == "shm":
        return ShmTransport()
    if name == "cuda_ipc":
        return _IpcReceiver()
    if name == "nccl":
        raise WeightPushError("an nccl handle reached an engine whose broadcast group was not set up (call "
                              "init_weight_transfer_engine with the group first)")
    raise WeightPushError(f"handle transport {name!r} is unknown (allowed: {', '.join(TRANSPORTS)})")


class _IpcReceiver(WeightTransport):
    name = "cuda_ipc"

    def send(self, named_tensors, version):  # pragma: no cover - receive-only
        raise RuntimeError("receive-only")

    def receive(self, handle: dict) -> dict[str, torch.Tensor]:
        return receive_cuda_ipc(handle)


def total_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


__all__ = [
    "TRANSPORTS", "WeightPushError", "ShmTransport", "CudaIpcTransport", "NcclBroadcastTransport",
    "make_transport", "resolve_transport_name", "receiver_for", "check_manifest", "check_received",
    "manifest_of", "dtype_name", "dtype_from_name", "receive_cuda_ipc", "total_bytes", "SHARED_KEYS",
    "shared_name_reasons",
]

