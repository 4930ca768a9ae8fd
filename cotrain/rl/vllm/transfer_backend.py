"""The ``cotrain`` weight-transfer backend, inside vLLM's worker processes: one validated, atomic
push per ``update_weights`` (registered by :mod:`cotrain.rl.vllm.extension`).

One ``update_weights({"update_info": {"handle": h}})`` call carries one
:mod:`~cotrain.rl.weight_transport` handle (never tensors: ``collective_rpc`` would turn them into
nested lists). The backend checks the handle's names, shapes and dtypes against the checkpoint the
engine serves **before touching the model**, and raises
:class:`~cotrain.rl.weight_transport.WeightPushError` naming the offending tensors; the model and its
version label then stay as they were. The bytes of ``shm`` handles (CPU) are read by cotrain (vLLM
has no CPU transport); ``cuda_ipc`` and ``nccl`` handles carry vLLM's own update payload and are
received by vLLM's ``ipc`` / ``nccl`` worker engines (``vllm.distributed.weight_transfer``), which
the backend creates beside itself and points at the model being updated (policy or drafter); a
rejected ``nccl`` push is still received and dropped, so the broadcast group stays in step. After a
drafter push into a DFlash drafter its fused context-K/V buffers are rebuilt
(:mod:`cotrain.rl.vllm.dflash_rebuild`).
"""

from __future__ import annotations

import re
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
from cotrain.rl.weight_transport import (
    VLLM_BACKENDS,
    WeightPushError,
    check_manifest,
    check_vllm_handle,
    receiver_for,
    restore_update_info,
    shared_name_reasons,
)

BACKEND_NAME = "cotrain"


class _LoadRecorder:
    """Stands in for the model as the target of one of vLLM's worker engines: it forwards each
    ``load_weights`` batch to the real model (or drops it when draining a rejected broadcast),
    records the names, and keeps copies of the tensors ``keep`` matches (DFlash's K/V, which
    the rebuild needs; vLLM's packed receive reuses its buffers)."""

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


def _reload_api():
    """vLLM's layerwise reload (a seam for the CPU unit tests)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    return initialize_layerwise_reload, finalize_layerwise_reload


def _make_vllm_engine(transport: str, config, vllm_config, device, model):  # pragma: no cover - GPU
    """vLLM's own worker engine for a GPU transport (``ipc`` / ``nccl`` backend)."""
    backend = VLLM_BACKENDS[transport]
    cls = WeightTransferEngineFactory._registry[backend]()
    return cls(config, vllm_config, device, model)


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
    """vLLM weight-transfer backend ``cotrain``: one validated, atomic push per ``update_weights``.

    The bytes of ``shm`` handles are read here (vLLM has no CPU transport); ``cuda_ipc`` and
    ``nccl`` handles carry vLLM's update payload and are received by vLLM's own ``ipc`` /
    ``nccl`` worker engines, created next to this one and pointed at the model being
    updated. Either way the handle's manifest is checked first, and the load runs inside
    vLLM's layerwise reload.
    """

    init_info_cls = CotrainInitInfo
    update_info_cls = CotrainUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._vllm: dict[str, Any] = {}  # transport -> vLLM worker engine
        self._manifests: dict[str, dict] = {}
        self._shared: set[str] | None = None
        self.last_push: dict[str, Any] = {}
        self.pushes = 0
        self.drained = 0

    # -- set-up
    def vllm_engine(self, transport: str):
        """vLLM's worker engine for ``cuda_ipc`` (made on first use) or ``nccl`` (made by
        ``init_transfer_engine``)."""
        if transport not in self._vllm:
            if transport == "nccl":
                raise WeightPushError("an nccl handle reached an engine whose broadcast group was not set up "
                                      "(RolloutGroup.init_broadcast_group first)")
            eng = _make_vllm_engine(transport, self.config, self.vllm_config, self.device, self._default_model)
            eng.init_transfer_engine(eng.parse_init_info({"packed": False}))
            self._vllm[transport] = eng
        return self._vllm[transport]

    def init_transfer_engine(self, init_info) -> None:
        if init_info.transport == "nccl":
            eng = _make_vllm_engine("nccl", self.config, self.vllm_config, self.device, self._default_model)
            eng.init_transfer_engine(eng.parse_init_info(dict(init_info.options)))  # joins the group
            self._vllm["nccl"] = eng
        elif init_info.transport not in ("shm", "cuda_ipc"):
            raise WeightPushError(f"init_info.transport={init_info.transport!r} (allowed: shm, cuda_ipc, nccl)")

    def shutdown(self) -> None:
        for eng in self._vllm.values():
            eng.shutdown()
        self._vllm.clear()

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
        pass  # nothing is touched before the handle has been validated (receive_weights)

    def finish_weight_update(self) -> None:
        pass  # receive_weights applies a push completely or not at all

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class synchronises through torch.accelerator, which CPU builds lack
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available() and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _vllm_receive(self, handle: dict, target: _LoadRecorder) -> None:
        eng = self.vllm_engine(handle["transport"])
        eng.set_weight_update_target(target, self.model_config)
        try:
            eng.receive_weights(eng.parse_update_info(restore_update_info(handle["update_info"])))
        finally:
            eng.reset_weight_update_target()

    def drain(self, handle: dict) -> None:
        """Receive an ``nccl`` broadcast and drop it: a rejected push keeps the group in step."""
        if isinstance(handle, dict) and handle.get("transport") == "nccl" and "nccl" in self._vllm:
            self._vllm_receive(handle, _LoadRecorder(None))
            self.drained += 1

    def receive_weights(self, update_info) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        initialize_layerwise_reload, finalize_layerwise_reload = _reload_api()
        t0 = time.perf_counter()
        handle = update_info.handle
        kind = "draft" if self.is_draft else "policy"
        if not isinstance(handle, dict) or "manifest" not in handle:
            raise WeightPushError(f"update_info.handle must be a weight handle dict (got {type(handle).__name__})")
        transport = handle.get("transport")
        try:
            if transport in VLLM_BACKENDS:
                check_vllm_handle(handle)
                self.vllm_engine(transport)  # nccl: the group must exist
                receiver = None
            else:
                receiver = receiver_for(handle)
            expected, shared = self.expected()
            forbidden = shared_name_reasons([row[0] for row in handle["manifest"]], shared)
            check_manifest(handle["manifest"], expected, kind=kind, forbidden=forbidden, require_all=True)
        except WeightPushError:
            self.drain(handle)  # nccl: the sender is already broadcasting
            raise
        tensors: dict[str, torch.Tensor] = {}
        if receiver is not None:
            tensors = receiver.receive(handle)
        t_recv = time.perf_counter()
        # validated: from here on the model changes (vLLM's own layerwise reload, in place)
        recorder = _LoadRecorder(self.model, KV_NAME if kind == "draft" else None)
        initialize_layerwise_reload(self.model)
        try:
            with disable_mtp_completeness_check():
                if receiver is not None:
                    recorder.load_weights(iter(tensors.items()))
                else:
                    self._vllm_receive(handle, recorder)  # vLLM moves the bytes, recorder loads them
            names = [row[0] for row in handle["manifest"]]
            if sorted(recorder.names) != sorted(names):
                raise WeightPushError(f"{transport} delivered {len(recorder.names)} tensor(s) for a manifest of "
                                      f"{len(names)}")
        except BaseException as e:
            # never leave layers on the meta device: put back what was not loaded
            finalize_layerwise_reload(self.model, self.model_config)
            raise RuntimeError(f"{kind} push of version {handle.get('version')} failed while loading, after "
                               f"validation; some layers may hold the new weights: push a full set again "
                               f"({type(e).__name__}: {e})") from e
        finalize_layerwise_reload(self.model, self.model_config)
        pushed = tensors if receiver is not None else recorder.kept
        dflash = bool(kind == "draft" and rebuild_dflash_context_kv(self.model, pushed))
        self.pushes += 1
        self.last_push = {"kind": kind, "version": handle.get("version"), "transport": transport,
                          "tensors": len(recorder.names), "bytes": recorder.nbytes, "receive_s": t_recv - t0,
                          "load_s": time.perf_counter() - t_recv, "dflash_rebuilt": dflash}


def register_backend() -> None:
    """Register the ``cotrain`` backend in this process's vLLM factory (idempotent)."""
    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, CotrainWeightTransferEngine)
