"""``shm``: one safetensors file per push in shared memory (``/dev/shm``): CPU engines, one node.

cotrain's own transport (vLLM has no CPU one). The handle adds ``path`` and ``nbytes``.
"""

from __future__ import annotations

import os
import tempfile
import uuid

import torch

from cotrain.weights.checks import WeightPushError, check_handle, check_received, flat_tensors, manifest_of
from cotrain.weights.interfaces import WeightTransport


def default_shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class ShmTransport(WeightTransport):
    """``send`` writes ``<dir>/cotrain-w-<pid>-<id>-v<version>.safetensors`` atomically (temporary
    name, then rename) and returns ``{"transport": "shm", "version", "manifest", "path",
    "nbytes"}``. ``receive`` reads the file (any process on the node). ``release`` deletes it;
    files of a crashed sender stay until reboot or manual cleanup (their names carry the pid).
    """

    name = "shm"

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or default_shm_dir()

    def send(self, named_tensors: dict[str, torch.Tensor], version: int) -> dict:
        from safetensors.torch import save_file

        tensors = flat_tensors(named_tensors)
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

        check_handle(handle, self.name)
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
