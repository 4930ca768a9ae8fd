"""TapChannel transports, by name."""

from __future__ import annotations

from cotrain.tapchannel.interfaces import TapTransport
from cotrain.tapchannel.transports.cuda_ipc import CudaIpcTransport
from cotrain.tapchannel.transports.p2p import GlooTransport, NcclTransport
from cotrain.tapchannel.transports.shm import ShmTransport

TRANSPORTS: dict[str, type[TapTransport]] = {
    "shm": ShmTransport,
    "gloo": GlooTransport,
    "nccl": NcclTransport,
    "cuda_ipc": CudaIpcTransport,
}


def make_transport(name: str) -> TapTransport:
    if name not in TRANSPORTS:
        raise ValueError(f"TapChannel transport {name!r} is not known (allowed: {', '.join(TRANSPORTS)})")
    return TRANSPORTS[name]()


def register_transport(name: str, cls: type[TapTransport]) -> None:
    TRANSPORTS[name] = cls


__all__ = ["TRANSPORTS", "make_transport", "register_transport", "ShmTransport", "GlooTransport", "NcclTransport",
           "CudaIpcTransport"]
