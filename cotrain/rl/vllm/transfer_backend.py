"""The ``cotrain`` weight-transfer backend, inside vLLM's worker processes: one validated, atomic
push per ``update_weights`` (registered by :mod:`cotrain.rl.vllm.extension`).

One ``update_weights({"update_info": {"handle": h}})`` call carries one :mod:`cotrain.weights`
handle (never tensors: ``collective_rpc`` would turn them into nested lists). This is where a push
is checked, once (:func:`~cotrain.weights.checks.check_push`): against the checkpoint the engine
serves, **before the model is touched**; a rejection raises
:class:`~cotrain.weights.checks.WeightPushError` naming the offending tensors, drains a broadcast
(:meth:`~cotrain.weights.vllm_receiver.VllmReceivers.drain`), and leaves the model and its version
label as they were. The bytes arrive through :class:`~cotrain.weights.vllm_receiver.VllmReceivers`
(cotrain's ``shm`` reader or vLLM's ``ipc`` / ``nccl`` worker engines) inside vLLM's layerwise
reload. After a drafter push into a DFlash drafter its fused context-K/V buffers are rebuilt
(:mod:`cotrain.rl.vllm.dflash_rebuild`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from cotrain.rl.vllm.dflash_rebuild import KV_NAME, rebuild_dflash_context_kv
from cotrain.rl.vllm.manifest import checkpoint_manifest, shared_with_target
from cotrain.weights.checks import WeightPushError, check_push, shared_name_reasons
from cotrain.weights.vllm_receiver import LoadRecorder, VllmReceivers

BACKEND_NAME = "cotrain"


def _reload_api():
    """vLLM's layerwise reload (a seam for the CPU unit tests)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    return initialize_layerwise_reload, finalize_layerwise_reload


@dataclass
class CotrainInitInfo(WeightTransferInitInfo):
    """``transport``: which receiver to set up. Only ``nccl`` needs it: ``options`` =
    vLLM's ``NCCLWeightTransferInitInfo`` fields (master_address, master_port, rank_offset
    = the group rank of this engine's first worker, world_size, packed, ...)."""

    transport: str = "shm"
    options: dict = field(default_factory=dict)


@dataclass
class CotrainUpdateInfo(WeightTransferUpdateInfo):
    handle: dict = field(default_factory=dict)


class CotrainWeightTransferEngine(WeightTransferEngine):
    """vLLM weight-transfer backend ``cotrain``: check once, then fetch and load inside vLLM's
    layerwise reload (all or nothing)."""

    init_info_cls = CotrainInitInfo
    update_info_cls = CotrainUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receivers = VllmReceivers(config, vllm_config, device, self._default_model)
        self._manifests: dict[str, dict] = {}
        self._shared: set[str] | None = None
        self.last_push: dict[str, Any] = {}
        self.pushes = 0
        self.drained = 0

    # -- set-up
    def init_transfer_engine(self, init_info) -> None:
        if init_info.transport == "nccl":
            self.receivers.join(init_info.options)  # joins the group
        elif init_info.transport not in ("shm", "cuda_ipc"):
            raise WeightPushError(f"init_info.transport={init_info.transport!r} (allowed: shm, cuda_ipc, nccl)")

    def shutdown(self) -> None:
        self.receivers.shutdown()

    # -- what a push must look like
    @property
    def is_draft(self) -> bool:
        return self.model is not self._default_model

    def expected(self) -> tuple[dict, set[str]]:
        """(checkpoint manifest minus what the drafter borrows, borrowed module keys)."""
        path = str(self.model_config.model)
        if path not in self._manifests:
            self._manifests[path] = checkpoint_manifest(path)
        exp = dict(self._manifests[path])
        shared: set[str] = set()
        if self.is_draft:
            if self._shared is None:
                self._shared = shared_with_target(self.model, self._default_model)
            shared = self._shared
            for n in shared_name_reasons(list(exp), shared):
                exp.pop(n)
        return exp, shared

    # -- the push
    def start_weight_update(self) -> None:
        pass  # nothing is touched before the handle has been checked (receive_weights)

    def finish_weight_update(self) -> None:
        pass  # receive_weights applies a push completely or not at all

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class synchronises through torch.accelerator, which CPU builds lack
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available() and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def drain(self, handle: dict) -> None:
        """Take a push this engine will not load off the wire (``nccl``; nothing for the others)."""
        if self.receivers.drain(handle):
            self.drained += 1

    def receive_weights(self, update_info) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        initialize_layerwise_reload, finalize_layerwise_reload = _reload_api()
        t0 = time.perf_counter()
        handle = update_info.handle
        kind = "draft" if self.is_draft else "policy"
        try:
            expected, shared = self.expected()
            check_push(handle, expected, shared, kind=kind)
            fetched = self.receivers.fetch(handle)  # shm: the tensors; GPU: the engine exists (nccl: the group)
        except WeightPushError:
            self.drain(handle)  # nccl: the sender is already broadcasting
            raise
        t_recv = time.perf_counter()
        # checked: from here on the model changes (vLLM's own layerwise reload, in place)
        recorder = LoadRecorder(self.model, KV_NAME if kind == "draft" else None)
        initialize_layerwise_reload(self.model)
        try:
            with disable_mtp_completeness_check():
                self.receivers.load(handle, fetched, recorder, self.model_config)
            names = [row[0] for row in handle["manifest"]]
            if sorted(recorder.names) != sorted(names):
                raise WeightPushError(f"{handle['transport']} delivered {len(recorder.names)} tensor(s) for a "
                                      f"manifest of {len(names)}")
        except BaseException as e:
            # never leave layers on the meta device: put back what was not loaded
            finalize_layerwise_reload(self.model, self.model_config)
            raise RuntimeError(f"{kind} push of version {handle.get('version')} failed while loading, after "
                               f"validation; some layers may hold the new weights: push a full set again "
                               f"({type(e).__name__}: {e})") from e
        finalize_layerwise_reload(self.model, self.model_config)
        pushed = fetched if fetched is not None else recorder.kept
        dflash = bool(kind == "draft" and rebuild_dflash_context_kv(self.model, pushed))
        self.pushes += 1
        self.last_push = {"kind": kind, "version": handle.get("version"), "transport": handle["transport"],
                          "tensors": len(recorder.names), "bytes": recorder.nbytes, "receive_s": t_recv - t0,
                          "load_s": time.perf_counter() - t_recv, "dflash_rebuilt": dflash}


def register_backend() -> None:
    """Register the ``cotrain`` backend in this process's vLLM factory (idempotent)."""
    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, CotrainWeightTransferEngine)
