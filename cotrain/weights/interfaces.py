"""The weight-transport interface: named tensors from a trainer to the engines, as a handle.

``send`` turns ``{name: tensor}`` into a small picklable handle (:mod:`cotrain.weights.checks`
says what it holds) that crosses a Ray call or a vLLM ``collective_rpc`` (which would turn raw
tensors into nested lists); ``receive`` turns it back into tensors on the receiving side;
``release`` frees what ``send`` allocated, once every receiver is done. :func:`push_through` is
the one send -> load -> release sequence.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Callable

import torch


class WeightTransport(ABC):
    """How a set of named tensors travels from a trainer to an engine process."""

    name: str

    @abstractmethod
    def send(self, named_tensors: dict[str, torch.Tensor], version: int) -> dict:
        """Publish the tensors; returns a small picklable handle for the receiver."""

    @abstractmethod
    def receive(self, handle: dict) -> dict[str, torch.Tensor]:
        """Materialise the tensors on the receiving side."""

    def release(self, handle: dict) -> None:  # noqa: B027 - optional
        """Free what :meth:`send` allocated, once every receiver is done."""


def push_through(transport: WeightTransport, named_tensors: dict[str, torch.Tensor], version: int,
                 load: Callable[[dict], dict[str, Any]]) -> dict[str, Any]:
    """``send`` the tensors, ``load(handle)`` them into the engine(s), and ``release`` the handle
    whatever ``load`` did; returns ``load``'s timings plus ``send_s``."""
    t0 = time.perf_counter()
    handle = transport.send(named_tensors, version)
    send_s = time.perf_counter() - t0
    try:
        stats = load(handle)
    finally:
        transport.release(handle)
    return {**stats, "send_s": send_s}
