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


#: ``tap/transport/<layer>`` metric values: how each tap reached the drafter's stage
TRANSPORT_CODES: dict[str, int] = {"local": 0, "shm": 1, "cuda_ipc": 2, "gloo": 3, "nccl": 4}


def make_transport(name: str) -> TapTransport:
    if name not in TRANSPORTS:
        raise ValueError(f"TapChannel transport {name!r} is not known (allowed: {', '.join(TRANSPORTS)})")
    return TRANSPORTS[name]()


def register_transport(name: str, cls: type[TapTransport]) -> None:
    TRANSPORTS[name] = cls


__all__ = ["TRANSPORTS", "TRANSPORT_CODES", "make_transport", "register_transport", "ShmTransport", "GlooTransport", "NcclTransport",
           "CudaIpcTransport"]
