"""TapChannel errors. Every fault names what the reader was waiting for, so a log line is enough.

Stamps: the slot for microbatch sequence number ``seq`` carries stamp ``seq + 1`` once written (0 = never
written); ``expected`` and ``seen`` in these errors are such stamps.
"""

from __future__ import annotations


class TapError(RuntimeError):
    """Base class of TapChannel faults."""


class TapSpecMismatchError(TapError, ValueError):
    """A writer's tap (width, dtype, token count) does not match the mailbox slot it registers for."""


class _SlotError(TapError):
    def __init__(self, message: str, *, layer: int, rank: int, slot: int, expected: int, seen: int, **extra):
        self.layer, self.rank, self.slot, self.expected, self.seen = layer, rank, slot, expected, seen
        for k, v in extra.items():
            setattr(self, k, v)
        super().__init__(
            f"{message} [tap layer {layer} from rank {rank}, slot {slot}, expected stamp {expected}, seen stamp {seen}]"
        )


class TapTimeoutError(_SlotError, TimeoutError):
    """A read (or a writer's back-pressure wait) lasted longer than the channel's timeout."""


class TapLappedError(_SlotError):
    """The slot holds a newer microbatch than the one asked for: the source has lapped the reader."""


class TapPeerDeadError(_SlotError):
    """The process on the other side of a slot is gone."""


class TapSourceDeadError(TapPeerDeadError):
    """The source (writer) of a tap died: the reader fails instead of waiting forever."""


class TapReaderDeadError(TapPeerDeadError):
    """The drafter's stage (reader) died while a writer waited for a slot."""
