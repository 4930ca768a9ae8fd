"""Driving a running ``LLM`` with cotrain's extension (:mod:`cotrain.rl.vllm.extension`): the push
into its workers, status.

:func:`push` is ``start_(draft_)weight_update`` -> ``update_weights`` (the worker's backend checks
the handle and loads it, all or nothing) -> ``finish_weight_update`` -> ``reset_prefix_cache``. A
policy push carries every tensor of the policy checkpoint, a draft push every tensor of the
drafter's checkpoint except those it shares with the target (``lm_head`` / ``embed_tokens`` of
EAGLE-3 / DFlash drafters), which it must not carry: writing them would overwrite the target's
weights.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from cotrain.weights import WeightPushError, WeightTransport, make_transport, push_through


def _label(version: int) -> str:
    return str(int(version))


def require_drafter(speculative) -> None:
    """A draft push needs a drafter network (not off, not ``ngram`` / ``suffix``)."""
    if not speculative:
        raise WeightPushError("draft push into an engine without speculative decoding (set "
                              "rollout.speculative.method to a drafter method: draft_model, eagle3, dflash, ...)")
    method = speculative.get("method") if isinstance(speculative, dict) else getattr(speculative, "method", None)
    if method in ("ngram", "suffix"):
        raise WeightPushError(f"draft push into an engine whose speculative method {method!r} has no drafter "
                              "weights (allowed: draft_model, eagle3, dflash, ...)")


def _start(llm, kind: str, version: int) -> None:
    if kind not in ("policy", "draft"):
        raise ValueError(f"kind={kind!r} (allowed: policy, draft)")
    if kind == "draft":
        require_drafter(llm.llm_engine.vllm_config.speculative_config)
    try:
        (llm.start_draft_weight_update if kind == "draft" else llm.start_weight_update)()
    except Exception as e:
        raise WeightPushError(f"{kind} push of version {version} could not start: {e}") from e


def push(llm, kind: str, handle: dict, version: int | None = None) -> dict[str, Any]:
    """Push one transport handle into a running ``LLM``; returns timings.

    ``kind="policy"`` labels the engine with ``version`` (default: the handle's); ``"draft"``
    loads the drafter and leaves the label alone (the label names the policy that samples).
    On a rejected push raises :class:`WeightPushError`; the engine keeps serving the weights and
    label it had (vLLM's worker ends the session itself when ``update_weights`` raises).
    """
    version = int(handle.get("version", 0) if version is None else version)
    t0 = time.perf_counter()
    try:
        _start(llm, kind, version)
    except Exception:
        drain(llm, handle)  # the handle never reached the workers: take a broadcast off the wire
        raise
    try:
        llm.update_weights({"update_info": {"handle": handle}})  # the worker drains what it rejects
    except Exception as e:  # the engine core re-raises worker errors with their text
        raise WeightPushError(_worker_message(str(e), kind, version)) from e
    llm.finish_weight_update(weight_version=_label(version) if kind == "policy" else None)
    llm.reset_prefix_cache()  # cached KV was computed by the old weights
    return {"push_s": time.perf_counter() - t0}


def drain(llm, handle: dict) -> None:
    """For a handle this engine will not load: every worker takes an ``nccl`` broadcast off the
    wire and drops it (:meth:`cotrain.weights.vllm_receiver.VllmReceivers.drain`), so the sender
    finishes and the group stays in step. Nothing moves for other transports."""
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
    """Send ``named_tensors`` through ``transport`` (default: shm / auto) and :func:`push` them (a
    draft push: names in the drafter checkpoint's format, never the shared lm_head / embed_tokens)."""
    return push_through(transport or make_transport("auto"), named_tensors, version,
                        lambda handle: push(llm, kind, handle, version))


def engine_status(llm) -> dict[str, Any]:
    return llm.collective_rpc("cotrain_status")[0]


def gpu_uuids(llm) -> list[str]:
    """The GPU UUID of every worker of the engine (empty on CPU), in worker order."""
    return [u for u in llm.collective_rpc("cotrain_gpu_uuid") if u]
