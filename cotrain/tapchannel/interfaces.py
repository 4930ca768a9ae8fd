"""The TapChannel transport interface. Implementations live in :mod:`cotrain.tapchannel.transports`.

A transport moves taps from the ranks that produce them (writers) into the mailbox of the drafter's
rank (reader) for the *remote* taps of one pipeline; taps produced on the reader's own rank never reach
a transport (the channel keeps them in place). Every transport implements the same slot/stamp
protocol (:mod:`cotrain.tapchannel.mailbox`): a write goes into slot ``seq % slots`` of its tap's ring,
waits while that slot is unreleased (back-pressure), and is published by a stamp ``seq + 1`` after the
data; the reader waits for the stamp it expects, reads, and releases.

Lifecycle, driven by :class:`cotrain.tapchannel.channel.TapChannel`::

    setup(ctx)                       collective over ctx.control_group (all ranks of the pipeline)
    register_writer(t, spec)         writer: shape/dtype checked against the reader's slot geometry
    begin_step(first_seq, count)     every rank, each training step
      write(t, seq, rows, deadline)  writer
      wait(t, seq, deadline)         reader: until stamp == seq + 1 (raises timeout / lapped / dead source)
      read(t, seq, copy)             reader: [ntok, width], stamps checked before and after
      release(t, seq)                reader: the slot may be written again
    end_step(deadline)
    close()
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch

from cotrain.tapchannel.mailbox import Liveness
from cotrain.tapchannel.spec import PipelineLayout, TapSpec


@dataclass
class TransportContext:
    """What a transport gets from the channel at setup."""

    name: str  # channel name (for shared-memory names, logs)
    rank: int  # this process's global rank
    layout: PipelineLayout
    taps: Sequence[TapSpec]  # the remote taps, resolved; transport tap index t = position here
    slots: int
    max_tokens: int
    timeout_s: float
    control_group: Any = None  # dedicated gloo group over this pipeline's ranks (setup, handshakes)
    data_group: Any = None  # dedicated group for p2p transports (gloo or nccl); never Megatron's
    liveness: Liveness = field(default_factory=Liveness)
    device: torch.device | None = None  # data device for nccl / cuda_ipc
    nodes: dict[int, str] = field(default_factory=dict)  # global rank -> node identity (the channel's ``node``)

    @property
    def is_reader(self) -> bool:
        return self.rank == self.layout.reader_rank

    def my_taps(self) -> list[int]:
        return [t for t, s in enumerate(self.taps) if s.rank == self.rank]


class TapTransport(ABC):
    """How remote taps reach the reader's mailbox (see the module docstring for the protocol)."""

    name: ClassVar[str]
    data_backend: ClassVar[str | None] = None  # backend of the dedicated data group, if the transport needs one

    @abstractmethod
    def setup(self, ctx: TransportContext) -> None:
        """Allocate/attach the mailbox (collective over ``ctx.control_group``)."""

    @abstractmethod
    def register_writer(self, t: int, spec: TapSpec) -> None:
        """Writer: declare tap ``t``'s layer, width and dtype; raise TapSpecMismatchError if the reader's
        slots differ."""

    def begin_step(self, first_seq: int, count: int) -> None:  # noqa: B027 - optional hook
        """Microbatches ``first_seq .. first_seq + count - 1`` make up the next step."""

    @abstractmethod
    def write(self, t: int, seq: int, rows: torch.Tensor, deadline: float) -> float:
        """Writer: put ``rows`` [n, width] into tap ``t``'s slot for ``seq`` and stamp it.
        Returns the seconds spent waiting for the slot (back-pressure)."""

    @abstractmethod
    def wait(self, t: int, seq: int, deadline: float) -> float:
        """Reader: block until tap ``t``'s slot carries ``seq``'s stamp; returns the seconds waited."""

    @abstractmethod
    def read(self, t: int, seq: int, copy: bool = True) -> torch.Tensor:
        """Reader, after :meth:`wait`: the rows [ntok, width] (copy, or a view valid until release)."""

    @abstractmethod
    def release(self, t: int, seq: int) -> None:
        """Reader: tap ``t``'s slot for ``seq`` may be reused."""

    def end_step(self, deadline: float) -> None:  # noqa: B027 - optional hook
        """End of a step (p2p writers use it to bound in-flight sends)."""

    @abstractmethod
    def close(self) -> None:
        """Release resources (idempotent)."""
