"""The receiving end inside a vLLM worker process: every transport's bytes into a loader.

``shm`` / ``object_store`` bytes are read by cotrain (:func:`~cotrain.weights.factory.receiver_for`;
vLLM has no CPU transport); ``cuda_ipc`` / ``nccl`` handles carry vLLM's update payload and are
received by vLLM's own worker engines (``ipc``: made on first use; ``nccl``: made when the engine
joins the trainer's broadcast group, :meth:`VllmReceivers.join`), pointed at a *loader* (anything
with vLLM's ``load_weights(iterable of (name, tensor))``). :meth:`VllmReceivers.drain` is the one
place a rejected ``nccl`` push is taken off the wire and dropped, so that the sender finishes and
the group stays in step. vLLM is imported only when a GPU receiver is made.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from cotrain.weights.checks import VLLM_BACKENDS, WeightPushError
from cotrain.weights.factory import receiver_for


class LoadRecorder:
    """A loader that forwards each ``load_weights`` batch to ``model`` (or drops it when ``model``
    is None: draining), records the names and bytes, and keeps copies of the tensors ``keep``
    matches (vLLM's packed receive reuses its buffers)."""

    def __init__(self, model: torch.nn.Module | None, keep: re.Pattern | None = None) -> None:
        self.model, self.keep = model, keep
        self.names: list[str] = []
        self.kept: dict[str, torch.Tensor] = {}
        self.nbytes = 0

    def load_weights(self, weights):
        batch = list(weights)
        for name, t in batch:
            self.names.append(name)
            self.nbytes += t.numel() * t.element_size()
            if self.keep is not None and self.keep.search(name):
                self.kept[name] = t.detach().clone()
        if self.model is not None:
            return self.model.load_weights(iter(batch))
        return set()


def _make_vllm_engine(transport: str, config, vllm_config, device, model):  # pragma: no cover - GPU
    """vLLM's own worker engine for a GPU transport (``ipc`` / ``nccl`` backend)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    cls = WeightTransferEngineFactory._registry[VLLM_BACKENDS[transport]]()
    return cls(config, vllm_config, device, model)


class VllmReceivers:
    """vLLM's worker engines for one vLLM worker, by transport (``config``, ``vllm_config``,
    ``device``, ``model``: what vLLM gives a weight-transfer engine)."""

    def __init__(self, config, vllm_config, device, model) -> None:
        self._args = (config, vllm_config, device, model)
        self._engines: dict[str, Any] = {}
        #: this worker's GPU UUID (None on CPU): a ``cuda_ipc`` set must hold a handle for it
        self.gpu: str | None = None
        if getattr(device, "type", None) == "cuda":
            from cotrain.weights.transports.cuda_ipc import gpu_uuid

            self.gpu = gpu_uuid(device)

    def engine(self, transport: str):
        if transport not in self._engines:
            if transport == "nccl":
                raise WeightPushError("an nccl handle reached an engine whose broadcast group was not set up "
                                      "(RolloutGroup.init_broadcast_group first)")
            eng = _make_vllm_engine(transport, *self._args)
            eng.init_transfer_engine(eng.parse_init_info({"packed": False}))
            self._engines[transport] = eng
        return self._engines[transport]

    def join(self, options: dict) -> None:
        """Join the trainer's ``nccl`` broadcast group (``options``: the fields of vLLM's
        ``NCCLWeightTransferInitInfo``); blocks until the group is complete."""
        eng = _make_vllm_engine("nccl", *self._args)
        eng.init_transfer_engine(eng.parse_init_info(dict(options)))
        self._engines["nccl"] = eng

    def fetch(self, handle: dict) -> dict[str, torch.Tensor] | None:
        """CPU transports: the tensors (read now). GPU transports: None (vLLM moves the bytes
        during :meth:`load`); their engine must exist (``nccl``: the group), and a ``cuda_ipc`` set
        must cover this worker's GPU (else an error naming it, before the model changes)."""
        transport = handle["transport"]
        if transport in VLLM_BACKENDS:
            if transport == "cuda_ipc" and self.gpu is not None:
                from cotrain.weights.transports.cuda_ipc import check_coverage, restore_update_info

                check_coverage(restore_update_info(handle["update_info"])["ipc_handles"], [self.gpu])
            self.engine(transport)
            return None
        return receiver_for(handle).receive(handle)

    def load(self, handle: dict, fetched: dict[str, torch.Tensor] | None, loader, model_config=None) -> None:
        """Deliver the push into ``loader``: the fetched tensors, or vLLM's engine receiving (for
        the model whose ``model_config`` is given: the policy's or the drafter's)."""
        if fetched is not None:
            loader.load_weights(iter(fetched.items()))
            return
        from cotrain.weights.transports.cuda_ipc import restore_update_info

        model_config = model_config if model_config is not None else self._args[1].model_config
        eng = self.engine(handle["transport"])
        eng.set_weight_update_target(loader, model_config)
        try:
            eng.receive_weights(eng.parse_update_info(restore_update_info(handle["update_info"])))
        finally:
            eng.reset_weight_update_target()

    def drain(self, handle: dict) -> bool:
        """Receive an ``nccl`` broadcast and drop it (a push this engine will not load); False when
        there is nothing to drain (other transports, or no group)."""
        if isinstance(handle, dict) and handle.get("transport") == "nccl" and "nccl" in self._engines:
            self.load(handle, None, LoadRecorder(None))
            return True
        return False

    def shutdown(self) -> None:
        for eng in self._engines.values():
            eng.shutdown()
        self._engines.clear()
