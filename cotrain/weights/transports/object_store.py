"""``object_store``: CPU pushes to engines on several nodes, on Ray's own machinery.

``send`` writes the ``shm`` file as :class:`~cotrain.weights.transports.shm.ShmTransport` does
(the engines on this node read it in place) and puts the same bytes once into Ray's object store;
the handle adds the sender's node id and the object's reference: ``{"transport": "object_store",
..., "path", "node_id", "object": [ref]}``. An engine on another node (:func:`localize_handle`)
gets the object - Ray's object manager moves it once per node, every engine of that node maps the
same copy - writes it to its own ``/dev/shm`` file and loads that as an ``shm`` push. Nothing to
keep in step: a rejected push moves no bytes, and a dead node fails the fetch with Ray's error.
``release`` deletes the file and drops the reference (Ray frees the object once the engines have
too).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch

from cotrain.weights.checks import WeightPushError, check_handle
from cotrain.weights.transports.shm import ShmTransport, default_shm_dir


def _ray_node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001
        return None


class ObjectStoreTransport(ShmTransport):
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
    check_handle(handle, "object_store")
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
    directory = directory or default_shm_dir()
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
