"""Driving a running ``LLM`` with cotrain's extension (:mod:`cotrain.rl.vllm.extension`): weight
pushes and status.

A push is ``start_(draft_)weight_update`` -> ``update_weights`` -> ``finish_weight_update`` ->
``reset_prefix_cache``, all or nothing: a policy push carries every tensor of the policy
checkpoint, a draft push every tensor of the drafter's checkpoint except those it shares with the
target (``lm_head`` / ``embed_tokens`` of EAGLE-3 / DFlash drafters), which it must not carry:
writing them would overwrite the target's weights.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from cotrain.rl.weight_transport import WeightPushError, WeightTransport, make_transport, push_through


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
    """Send ``named_tensors`` through ``transport`` (default: shm / auto) and push them (a draft
    push: names in the drafter checkpoint's format, never the shared lm_head / embed_tokens)."""
    return push_through(transport or make_transport("auto"), named_tensors, version,
                        lambda handle: push_handle(llm, kind, handle, version))


def engine_status(llm) -> dict[str, Any]:
    return llm.collective_rpc("cotrain_status")[0]
