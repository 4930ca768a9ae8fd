"""Transports by name: :func:`make_transport` on the sending side, :func:`receiver_for` on the
receiving side (``shm`` / ``object_store``; GPU handles go to vLLM's engines)."""

from __future__ import annotations

from typing import Any

import torch

from cotrain.weights.checks import TRANSPORTS, VLLM_BACKENDS, WeightPushError, check_handle
from cotrain.weights.interfaces import WeightTransport


def resolve_transport_name(name: str, *, colocated: bool = True) -> str:
    """``auto`` -> ``shm`` without CUDA, else ``cuda_ipc`` (colocated) or ``nccl`` (validation
    resolves the run's ``auto`` itself: ``object_store`` on several CPU nodes)."""
    if name == "auto":
        if not torch.cuda.is_available():
            return "shm"
        return "cuda_ipc" if colocated else "nccl"
    if name not in TRANSPORTS:
        raise ValueError(f"weight transport {name!r} is unknown (allowed: auto, {', '.join(TRANSPORTS)})")
    return name


def make_transport(name: str = "auto", *, colocated: bool = True, **kwargs: Any) -> WeightTransport:
    """A sender by name (``auto``, ``shm``, ``object_store``, ``cuda_ipc``, ``nccl``).

    ``nccl`` needs ``master_addr``, ``master_port``, ``world_size`` and a later
    :meth:`~cotrain.weights.transports.nccl.NcclBroadcastTransport.connect` (concurrently with the
    engines joining); ``cuda_ipc`` takes ``engine_gpus`` (the engines' GPU UUIDs).
    """
    name = resolve_transport_name(name, colocated=colocated)
    if name == "shm":
        from cotrain.weights.transports.shm import ShmTransport

        return ShmTransport(**kwargs)
    if name == "object_store":
        from cotrain.weights.transports.object_store import ObjectStoreTransport

        return ObjectStoreTransport(**kwargs)
    if name == "cuda_ipc":
        from cotrain.weights.transports.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(**kwargs)
    missing = [k for k in ("master_addr", "master_port", "world_size") if k not in kwargs]
    if missing:
        raise ValueError(f"nccl transport needs {', '.join(missing)}")
    from cotrain.weights.transports.nccl import NcclBroadcastTransport

    return NcclBroadcastTransport(**kwargs)


def receiver_for(handle: dict) -> WeightTransport:
    """The receiving-side cotrain transport for a handle: ``shm`` or ``object_store``. ``cuda_ipc``
    and ``nccl`` handles are received by vLLM's own engines (:mod:`cotrain.weights.vllm_receiver`)."""
    name = check_handle(handle)
    if name in VLLM_BACKENDS:
        raise WeightPushError(f"{name} handles are received by vLLM's {VLLM_BACKENDS[name]!r} weight-transfer engine "
                              "inside a rollout worker (cotrain.weights.vllm_receiver), not by a cotrain transport")
    if name == "shm":
        from cotrain.weights.transports.shm import ShmTransport

        return ShmTransport()
    from cotrain.weights.transports.object_store import ObjectStoreTransport

    return ObjectStoreTransport()
