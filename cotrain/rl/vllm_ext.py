"""The engine side of cotrain's weight pushes, plus two repairs vLLM needs, inside vLLM's workers.

An engine made with :func:`extension_kwargs` (``weight_transfer_config={"backend": "cotrain"}``,
``worker_extension_cls="cotrain.rl.vllm_ext.CotrainWorkerExtension"``) imports this module in
each worker process, which

* registers the ``cotrain`` weight-transfer backend (:class:`CotrainWeightTransferEngine`) for
  vLLM's weight-update API. One ``update_weights({"update_info": {"handle": h}})`` call carries
  one :mod:`~cotrain.rl.weight_transport` handle (never tensors: ``collective_rpc`` would turn them
  into nested lists). The backend checks the handle's names, shapes and dtypes against the
  checkpoint the engine serves **before touching the model**, and raises
  :class:`~cotrain.rl.weight_transport.WeightPushError` naming the offending tensors; the model
  and its version label then stay as they were. The bytes of ``shm`` handles (CPU) are read by
  cotrain; ``cuda_ipc`` and ``nccl`` handles carry vLLM's own update payload and are received
  by vLLM's ``ipc`` / ``nccl`` worker engines (``vllm.distributed.weight_transfer``), which the
  backend creates beside itself and points at the model being updated (policy or drafter); a
  rejected ``nccl`` push is still received and dropped, so the broadcast group stays in step;
* on CPU, replaces vLLM's ``expand_batch_to_tokens`` in the rejection sampler by a pure-torch
  version: the CPU fallback of that kernel writes into a temporary int64 copy and returns
  uninitialised memory, so speculative decoding at temperature > 0 divides the target logits by
  garbage and stops being lossless (STACK.md). Set ``COTRAIN_VLLM_SAMPLER_FIX=0`` to see the
  defect;
* after a drafter push into a DFlash drafter, rebuilds its fused context-K/V buffers from the
  pushed tensors (on CPU the oneDNN prepack empties ``qkv_proj.weight``, from which vLLM would
  rebuild them, and the rebuild during the reload reads RoPE's cache while it is still on the
  meta device).

The client side (:func:`push_weights`, :func:`push_handle`, :func:`push_draft_weights`) drives an
``LLM``: ``start_(draft_)weight_update`` -> ``update_weights`` -> ``finish_weight_update`` ->
``reset_prefix_cache``. A push is all-or-nothing: a policy push carries every tensor of the
policy checkpoint, a draft push every tensor of the drafter's checkpoint except those it shares
with the target (``lm_head`` / ``embed_tokens`` of EAGLE-3 / DFlash drafters), which it must not
carry: writing them would overwrite the target's weights.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cotrain.rl.weight_transport import (
    SHARED_KEYS,
    VLLM_BACKENDS,
    WeightPushError,
    WeightTransport,
    check_manifest,
    check_vllm_handle,
    dtype_name,
    make_transport,
    receiver_for,
    restore_update_info,
    shared_name_reasons,
)

BACKEND_NAME = "cotrain"
WORKER_EXTENSION = "cotrain.rl.vllm_ext.CotrainWorkerExtension"


def extension_kwargs() -> dict[str, Any]:
    """The ``LLM(...)`` arguments that wire this module into an engine."""
    return {"weight_transfer_config": {"backend": BACKEND_NAME}, "worker_extension_cls": WORKER_EXTENSION}


# ------------------------------------------------------------------- CPU rejection-sampler repair
def _expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                            replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """Pure-torch ``expand_batch_to_tokens``: ``x = [a, b, c]``, ``cu = [2, 5, 6]`` ->
    ``[a, a, b, b, b, c]``, with values equal to ``replace_from`` replaced by ``replace_to``."""
    assert cu_num_tokens.shape[0] == x.shape[0]
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    src = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype, device=x.device), x)
    out = torch.repeat_interleave(src, counts.to(x.device))
    if out.shape[0] < num_tokens:  # never seen; keep the tail defined rather than uninitialised
        fill = out[-1:] if out.numel() else src.new_full((1,), replace_to)
        out = torch.cat([out, fill.expand(num_tokens - out.shape[0])])
    return out[:num_tokens]


def _on_cpu_platform() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # vLLM absent or platform not resolvable: decide by CUDA
        return not torch.cuda.is_available()


def install_cpu_rejection_sampler_fix() -> bool:
    """Patch this process's rejection sampler (CPU only, idempotent). Returns whether it is on."""
    if os.environ.get("COTRAIN_VLLM_SAMPLER_FIX", "1") == "0" or not _on_cpu_platform():
        return False
    from vllm.v1.sample import rejection_sampler as rs

    if getattr(rs.expand_batch_to_tokens, "_cotrain_fix", False):
        return True
    _expand_batch_to_tokens._cotrain_fix = True  # type: ignore[attr-defined]
    rs.expand_batch_to_tokens = _expand_batch_to_tokens  # apply_sampling_constraints looks it up here
    return True


def cpu_rejection_sampler_fixed() -> bool:
    try:
        from vllm.v1.sample import rejection_sampler as rs
    except ImportError:
        return False
    return bool(getattr(rs.expand_batch_to_tokens, "_cotrain_fix", False))


# -------------------------------------------------------------------------- expected manifests
def checkpoint_manifest(path: str | os.PathLike) -> dict[str, tuple[list[int], str]]:
    """``{name: (shape, dtype)}`` of the safetensors checkpoint in directory ``path`` (headers only)."""
    from safetensors import safe_open

    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
    index = root / "model.safetensors.index.json"
    if root.is_dir() and index.exists():
        files = sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
    if not files or not all(f.exists() for f in files):
        raise WeightPushError(f"cannot validate pushes: no safetensors checkpoint at {str(path)!r} (cotrain "
                              "validates pushed names and shapes against the checkpoint the engine loaded)")
    out: dict[str, tuple[list[int], str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                out[name] = (list(sl.get_shape()), _st_dtype(sl.get_dtype()))
    return out


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _st_dtype(code: str) -> str:
    return _ST_DTYPES.get(code, code.lower())


def shared_with_target(draft: torch.nn.Module, target: torch.nn.Module) -> set[str]:
    """Which of ``lm_head`` / ``embed_tokens`` the drafter borrows from the target (same object)."""
    target_ids = {id(p) for p in target.parameters()}
    shared = set()
    for name, p in draft.named_parameters(remove_duplicate=False):
        if id(p) in target_ids:
            shared.update(k for k in SHARED_KEYS if k in name.split("."))
    return shared


# ----------------------------------------------------------------------------- DFlash buffers
_KV_NAME = re.compile(r"(?:^|\.)(?:layers\.(\d+)|midlayer)\.self_attn\.([kv])_proj\.(weight|bias)$")


def rebuild_dflash_context_kv(draft: torch.nn.Module, pushed: dict[str, torch.Tensor]) -> bool:
    """Rebuild a DFlash drafter's fused context-K/V buffers after a reload; False if not DFlash.

    vLLM builds them at the end of ``load_weights``; during a layerwise reload that moment sees
    RoPE's cache on the meta device and (on CPU) ``qkv_proj.weight`` already emptied by the
    oneDNN prepack. Here, after the reload finished, every buffer is rebuilt from the live
    modules, and the fused K/V weight from the pushed ``k_proj`` / ``v_proj`` tensors where the
    live weight is not readable (layers the push did not carry keep their previous rows).
    """
    inner = getattr(draft, "model", None)
    if inner is None or not hasattr(inner, "_build_fused_kv_buffers"):
        return False
    old_w = getattr(inner, "_fused_kv_weight", None)
    old_b = getattr(inner, "_fused_kv_bias", None)
    inner._build_fused_kv_buffers()  # RoPE cache, k_norm stack, hidden_norm alias, layer metadata
    attns = [layer.self_attn for layer in inner.layers]
    readable = all(a.qkv_proj.weight.dim() == 2 and not a.qkv_proj.weight.is_meta
                   and a.qkv_proj.weight.shape[0] == a.q_size + 2 * a.kv_size for a in attns)
    if readable or getattr(inner, "_fused_kv_weight", None) is None and old_w is None:
        return True
    start = _draft_start_layer(inner)
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    for name, t in pushed.items():
        m = _KV_NAME.search(name)
        if m:
            idx = 0 if m.group(1) is None else int(m.group(1))
            if idx >= len(attns) and start and idx - start < len(attns):
                idx -= start
            found[(idx, m.group(2), m.group(3))] = t
    kv = attns[0].kv_size
    dtype, device = attns[0].o_proj.weight.dtype, inner.hidden_norm.weight.device

    def fused(kind: str, old: torch.Tensor | None) -> torch.Tensor | None:
        rows = []
        for i in range(len(attns)):
            k, v = found.get((i, "k", kind)), found.get((i, "v", kind))
            if k is None or v is None:
                if old is None or old.shape[0] != 2 * kv * len(attns):
                    raise WeightPushError(f"DFlash rebuild: layer {i} {kind} of k_proj/v_proj missing from the push "
                                          "and no previous fused buffer to keep it from")
                rows.append(old[i * 2 * kv:(i + 1) * 2 * kv])
            else:
                rows += [k, v]
        return torch.cat([r.to(device=device, dtype=dtype) for r in rows], dim=0).contiguous()

    inner._fused_kv_weight = fused("weight", old_w)
    if attns[0].qkv_proj.bias is not None:
        inner._fused_kv_bias = fused("bias", old_b)
    return True


def _draft_start_layer(inner: torch.nn.Module) -> int:
    try:
        first = inner.layers[0].self_attn.attn.layer_name
        return int(re.search(r"layers\.(\d+)", first).group(1))
    except Exception:
        return 0


# -------------------------------------------------------------------------- transfer engine
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
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    backend = VLLM_BACKENDS[transport]
    cls = WeightTransferEngineFactory._registry[backend]()
    return cls(config, vllm_config, device, model)


def _make_engine_cls():
    """Defined lazily so that importing this module without vLLM (docs, unit tests) works."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

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
            recorder = _LoadRecorder(self.model, _KV_NAME if kind == "draft" else None)
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

    return CotrainInitInfo, CotrainUpdateInfo, CotrainWeightTransferEngine


def register_backend() -> None:
    """Register the ``cotrain`` backend in this process's vLLM factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, _make_engine_cls()[2])


class CotrainWorkerExtension:
    """Mixed into vLLM's worker class; its methods are reachable through ``collective_rpc``."""

    def cotrain_status(self) -> dict[str, Any]:
        eng = getattr(self, "weight_transfer_engine", None)
        return {"pid": os.getpid(), "sampler_fix": cpu_rejection_sampler_fixed(),
                "backend": type(eng).__name__ if eng is not None else None,
                "pushes": getattr(eng, "pushes", 0), "last_push": getattr(eng, "last_push", {}),
                "has_draft": self.get_draft_model() is not None,  # type: ignore[attr-defined]
                "draft_class": type(self.get_draft_model()).__name__  # type: ignore[attr-defined]
                if self.get_draft_model() is not None else None}  # type: ignore[attr-defined]

    def cotrain_expected_manifest(self, kind: str = "policy") -> dict[str, Any]:
        """What a push of ``kind`` must carry: ``{"expected": {name: [shape, dtype]}, "shared": [...]}``
        (``shared``: the target modules the drafter borrows, whose names a draft push must not carry)."""
        eng = self.weight_transfer_engine  # type: ignore[attr-defined]
        if kind == "draft":
            self._set_draft_weight_update_target()  # type: ignore[attr-defined]
        try:
            exp, shared = eng.expected()
        finally:
            eng.reset_weight_update_target()
        return {"expected": {n: [s, d] for n, (s, d) in exp.items()}, "shared": sorted(shared)}

    def cotrain_drain(self, handle: dict) -> None:
        """Receive and drop an ``nccl`` push this engine will not load (see :func:`drain_broadcast`)."""
        self.weight_transfer_engine.drain(handle)  # type: ignore[attr-defined]


# import-time work inside vLLM's worker processes (and harmless elsewhere)
try:  # pragma: no branch
    import vllm  # noqa: F401

    register_backend()
    install_cpu_rejection_sampler_fix()
except ImportError:  # docs / unit tests without vLLM
    pass


# --------------------------------------------------------------------------------- client side
def _label(version: int) -> str:
    return str(int(version))


def push_handle(llm, kind: str, handle: dict, version: int | None = None) -> dict[str, Any]:
    """Push one transport handle into a running ``LLM``; returns timings.

    ``kind="policy"`` labels the engine with ``version`` (default: the handle's); ``"draft"``
    loads the drafter and leaves the label alone (the label names the policy that samples).
    On a rejected push raises :class:`WeightPushError`; the engine keeps serving the weights and
    label it had (vLLM's worker ends the session itself when ``update_weights`` raises).
    """
    if kind not in ("policy", "draft"):
        drain_broadcast(llm, handle)
        raise ValueError(f"kind={kind!r} (allowed: policy, draft)")
    version = int(handle["version"] if version is None else version)
    t0 = time.perf_counter()
    try:
        (llm.start_draft_weight_update if kind == "draft" else llm.start_weight_update)()
    except Exception as e:
        drain_broadcast(llm, handle)
        raise WeightPushError(f"{kind} push of version {version} could not start: {e}") from e
    try:
        llm.update_weights({"update_info": {"handle": handle}})  # rejected nccl pushes drain in the worker
    except Exception as e:  # the engine core re-raises worker errors with their text
        raise WeightPushError(_worker_message(str(e), kind, version)) from e
    llm.finish_weight_update(weight_version=_label(version) if kind == "policy" else None)
    llm.reset_prefix_cache()  # cached KV was computed by the old weights
    return {"push_s": time.perf_counter() - t0}


def drain_broadcast(llm, handle: dict) -> None:
    """For an ``nccl`` handle this engine will not load (rejected before reaching its worker):
    receive the broadcast and drop it, so the sender finishes and the group stays in step.
    Nothing to do for other transports."""
    if isinstance(handle, dict) and handle.get("transport") == "nccl":
        llm.collective_rpc("cotrain_drain", args=(handle,))


def _worker_message(msg: str, kind: str, version: int) -> str:
    """The worker's own message out of vLLM's wrapping (multi-process mode adds a prefix and a
    suffix pointing at the engine log)."""
    start = msg.find(f"{kind} weight push rejected")
    if start < 0:
        return f"{kind} push of version {version} failed: {msg}"
    msg = msg[start:]
    end = msg.find("', please check the stack trace")
    return msg[:end] if end >= 0 else msg


def push_weights(llm, kind: str, named_tensors: dict[str, torch.Tensor], version: int,
                 transport: WeightTransport | None = None) -> dict[str, Any]:
    """Send ``named_tensors`` through ``transport`` (default: shm / auto) and push them."""
    transport = transport or make_transport("auto")
    t0 = time.perf_counter()
    handle = transport.send(named_tensors, version)
    t_send = time.perf_counter() - t0
    try:
        stats = push_handle(llm, kind, handle, version)
    finally:
        transport.release(handle)
    stats["send_s"] = t_send
    return stats


def push_draft_weights(llm, named_tensors: dict[str, torch.Tensor], version: int,
                       transport: WeightTransport | None = None) -> dict[str, Any]:
    """A drafter push (names in the drafter checkpoint's format; never shared lm_head/embed_tokens)."""
    return push_weights(llm, "draft", named_tensors, version, transport)


def engine_status(llm) -> dict[str, Any]:
    return llm.collective_rpc("cotrain_status")[0]


__all__ = [
    "BACKEND_NAME", "WORKER_EXTENSION", "extension_kwargs", "push_weights", "push_handle", "push_draft_weights",
    "engine_status", "drain_broadcast", "install_cpu_rejection_sampler_fix", "cpu_rejection_sampler_fixed", "checkpoint_manifest",
    "shared_with_target", "rebuild_dflash_context_kv", "register_backend", "CotrainWorkerExtension",
    "WeightPushError", "dtype_name", "SHARED_KEYS",
]
