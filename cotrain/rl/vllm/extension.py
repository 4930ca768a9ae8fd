"""cotrain's worker extension of vLLM (``worker_extension_cls``): importing this module in a vLLM
worker process registers the ``cotrain`` weight-transfer backend
(:mod:`cotrain.rl.vllm.transfer_backend`) and installs the CPU rejection-sampler repair
(:mod:`cotrain.rl.vllm.sampler_fix`); :class:`CotrainWorkerExtension`'s methods are reachable
through ``collective_rpc``. Engines are wired to it by :func:`cotrain.rl.vllm.engine.make_cotrain_llm`.
"""

from __future__ import annotations

import os
from typing import Any

from cotrain.rl.vllm.sampler_fix import cpu_rejection_sampler_fixed, install_cpu_rejection_sampler_fix
from cotrain.rl.vllm.transfer_backend import register_backend

register_backend()
install_cpu_rejection_sampler_fix()


class CotrainWorkerExtension:
    """Mixed into vLLM's worker class; its methods are reachable through ``collective_rpc``."""

    def cotrain_status(self) -> dict[str, Any]:
        eng = getattr(self, "weight_transfer_engine", None)
        return {"pid": os.getpid(), "sampler_fix": cpu_rejection_sampler_fixed(),
                "backend": type(eng).__name__ if eng is not None else None,
                "pushes": getattr(eng, "pushes", 0), "last_push": getattr(eng, "last_push", {}),
                "gpu_uuid": self.cotrain_gpu_uuid(),
                "has_draft": self.get_draft_model() is not None,  # type: ignore[attr-defined]
                "draft_class": type(self.get_draft_model()).__name__  # type: ignore[attr-defined]
                if self.get_draft_model() is not None else None}  # type: ignore[attr-defined]

    def cotrain_gpu_uuid(self) -> str | None:
        """The UUID of this worker's GPU (None on CPU): the GPU a ``cuda_ipc`` push must reach."""
        dev = getattr(self, "device", None)
        if dev is None or getattr(dev, "type", None) != "cuda":
            return None
        import torch

        return str(torch.cuda.get_device_properties(dev).uuid)

    def cotrain_drain(self, handle: dict) -> None:
        """Receive and drop an ``nccl`` push this engine will not load (see
        :func:`cotrain.rl.vllm.client.drain`)."""
        self.weight_transfer_engine.drain(handle)  # type: ignore[attr-defined]
