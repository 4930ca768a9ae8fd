"""The mailbox: per tap a ring of pre-allocated slots, each with a sequence stamp; back-pressure.

Layout. The mailbox is a block of int64 control words plus, per tap, a data tensor
``[slots, max_tokens, width]``. Where the words and the data live is the transport's business (a
``/dev/shm`` mapping for ``shm``, CUDA memory for ``cuda_ipc``'s data, plain memory on the reader for
``gloo``/``nccl``); the protocol below is the same for all.

Control words (int64)::

    header  [0:16)    MAGIC, VERSION, num_taps, slots, max_tokens, ...
    tap t   [16+16t)  layer, width, dtype code, source rank, writer pid (0 until registered), head, claim
    slot    (t, k)    stamp, ntok, released   (8 words, one per ring slot k of tap t)

Protocol for microbatch sequence number ``seq`` (the channel's running microbatch count): slot
``k = seq % slots``; ``stamp = seq + 1`` once the data is in (0 = never written); ``released = seq + 1``
once the reader is done with it; per tap, ``head`` = 1 + the last microbatch published and ``claim`` =
1 + the microbatch the writer is busy with.

- Writer (every microbatch, in increasing order per tap): store ``claim = seq + 1``; if ``head < seq``
  the writer skipped microbatches ``head .. seq - 1`` (its step numbering is ahead of the reader's):
  lapped, an error on the writer (the claim is already visible, so the reader fails too). Otherwise
  wait until ``released[k] >= seq + 1 - slots`` (the slot's previous occupant, ``seq - slots``, has
  been released: back-pressure, never overwrite), copy the rows, store ``ntok``, store ``stamp``
  **last**, then advance ``head`` to ``seq + 1``.
- Reader: load ``claim`` and ``head``, then ``stamp[k]``. ``stamp == seq + 1``: ready. ``stamp > seq + 1``:
  the source has lapped the reader (error). ``claim`` or ``head`` ``> seq + 1`` with the stamp still
  short: the source is already past this microbatch without having written it (skipped, or its step
  numbering is ahead of the reader's): error, not a wait. (A writer claims ``seq' > seq`` only after
  it stamped ``seq``, and that stamp stays until the reader releases it, so a short stamp next to a
  later claim is always a skip.) This catches a lapping writer whatever the ring size, also one that
  is itself stuck waiting for a slot the reader will never release (``slots = 2``, two steps ahead).
  Otherwise wait. Read ``ntok`` and the rows, re-check the stamp after reading (a change means the
  slot was overwritten during the read: error), then store ``released``.

Memory ordering. Each word is an aligned 8-byte numpy store/load (single-copy atomic on x86-64 and
aarch64). The data copy (``Tensor.copy_``) returns before the stamp store is issued, and the stamp is
the last store of a write. On x86-64 (TSO) stores become visible to other cores in program order and
loads are not reordered with older loads, so a reader that sees the stamp sees the data, and the
before/after stamp check brackets the data loads; no fence instruction is needed. On weakly ordered
CPUs (aarch64) that argument does not hold for plain stores; use the ``gloo`` transport there (the
shm transport refuses to start on a non-x86 machine unless ``TAPCHANNEL_ALLOW_WEAK_ORDERING=1``).
For CUDA data the writer synchronises its stream before the stamp store.
"""

from __future__ import annotations

import os
import platform
import socket
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from cotrain.tapchannel.errors import (
    TapLappedError,
    TapReaderDeadError,
    TapSourceDeadError,
    TapSpecMismatchError,
    TapTimeoutError,
)
from cotrain.tapchannel.spec import CODE_DTYPES, TapSpec, dtype_code

MAGIC = 0x7A9C4A11
VERSION = 2  # 2: the claim word
HEADER_WORDS = 16
TAP_WORDS = 16
SLOT_WORDS = 8
STAMP, NTOK, RELEASED = 0, 1, 2
HEAD = 5  # tap word: 1 + the last microbatch published on this tap
CLAIM = 6  # tap word: 1 + the microbatch the writer is writing (stored before it waits for the slot)
LIVENESS_EVERY_S = 0.02


def strongly_ordered_cpu() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


# ----- process liveness -----------------------------------------------------------------------------------

def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks); None if the process is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    rest = stat[stat.rfind(")") + 2:].split()
    if rest[0] in ("Z", "X", "x"):
        return None
    return int(rest[19])


@dataclass(frozen=True)
class ProcessInfo:
    """Enough to tell from another process on the same node whether this one is still alive."""

    host: str
    boot_id: str
    pid: int
    pid_ns: int
    start_time: int | None

    @classmethod
    def local(cls) -> "ProcessInfo":
        pid = os.getpid()
        return cls(socket.gethostname(), _boot_id(), pid, _pid_ns(), _start_time(pid))

    def same_node(self, other: "ProcessInfo") -> bool:
        return self.boot_id == other.boot_id

    def dead_reason(self, observer: "ProcessInfo") -> str | None:
        """Why this process is dead as seen from ``observer``, or None (alive, or not checkable from there)."""
        if not (self.same_node(observer) and self.pid_ns == observer.pid_ns):
            return None  # another node or pid namespace: only timeouts and transport errors tell
        now = _start_time(self.pid)
        if now is None:
            return f"process {self.pid} on {self.host} has exited"
        if self.start_time is not None and now != self.start_time:
            return f"process {self.pid} on {self.host} has exited (pid reused)"
        return None


class Liveness:
    """Liveness of peers by rank: process checks on the same node, plus probes (e.g. a mailbox thread's
    failure). A probe returns None, a reason (the peer is dead) or an exception to raise as is."""

    def __init__(self, peers: dict[int, ProcessInfo] | None = None, me: ProcessInfo | None = None):
        self.peers = peers or {}
        self.me = me or ProcessInfo.local()
        self.probes: dict[int, Callable[[], str | None]] = {}

    def dead_reason(self, rank: int) -> str | BaseException | None:
        probe = self.probes.get(rank)
        if probe is not None:
            reason = probe()
            if reason:
                return reason
        info = self.peers.get(rank)
        return info.dead_reason(self.me) if info is not None else None


# ----- the mailbox ----------------------------------------------------------------------------------------

def control_words(num_taps: int, slots: int) -> int:
    return HEADER_WORDS + num_taps * TAP_WORDS + num_taps * slots * SLOT_WORDS


def _pause(spins: int) -> None:
    # short yields first (the data is usually there already), then sleeps that leave the CPU to the
    # pipeline stages (this machine class has 2 cores for 2-4 ranks)
    time.sleep(0 if spins < 20 else min(5e-5 * (spins - 19), 5e-4))


class Mailbox:
    """Slots, stamps and back-pressure over given control words and data tensors (see module doc)."""

    def __init__(self, ctrl: np.ndarray, data: Sequence[torch.Tensor], taps: Sequence[TapSpec], slots: int,
                 max_tokens: int, reader_rank: int, liveness: Liveness | None = None):
        if ctrl.dtype != np.int64 or ctrl.size < control_words(len(taps), slots):
            raise ValueError("control block too small or not int64")
        self.ctrl = ctrl
        self.data = list(data)
        self.taps = list(taps)
        self.slots = slots
        self.max_tokens = max_tokens
        self.reader_rank = reader_rank
        self.liveness = liveness or Liveness()
        base = HEADER_WORDS + len(taps) * TAP_WORDS
        # per-tap [slots, SLOT_WORDS] views of the slot words
        self._slot_words = [ctrl[base + t * slots * SLOT_WORDS: base + (t + 1) * slots * SLOT_WORDS].reshape(slots, SLOT_WORDS)
                            for t in range(len(taps))]
        self._tap_words = [ctrl[HEADER_WORDS + t * TAP_WORDS: HEADER_WORDS + (t + 1) * TAP_WORDS] for t in range(len(taps))]

    # ----- geometry (written by the reader, checked by writers) -----------------------------------
    def format(self) -> None:
        self.ctrl[:] = 0
        for t, spec in enumerate(self.taps):
            w = self._tap_words[t]
            w[0], w[1], w[2], w[3] = spec.layer, spec.width, dtype_code(spec.dtype), spec.rank if spec.rank is not None else -1
        h = self.ctrl
        h[2], h[3], h[4] = len(self.taps), self.slots, self.max_tokens
        h[1] = VERSION
        h[0] = MAGIC  # last: a mapping with MAGIC is fully formatted

    def check_format(self) -> None:
        if int(self.ctrl[0]) != MAGIC or int(self.ctrl[1]) != VERSION:
            raise TapSpecMismatchError(f"mailbox not formatted (magic {int(self.ctrl[0]):#x}, version {int(self.ctrl[1])})")
        got = (int(self.ctrl[2]), int(self.ctrl[3]), int(self.ctrl[4]))
        if got != (len(self.taps), self.slots, self.max_tokens):
            raise TapSpecMismatchError(
                f"mailbox geometry (taps, slots, max_tokens) is {got} on the reader, {(len(self.taps), self.slots, self.max_tokens)} here")

    def register_writer(self, t: int, layer: int, width: int, dtype: torch.dtype, pid: int | None = None) -> None:
        """A writer declares what it will write into tap ``t``'s slots; mismatches are rejected here."""
        w = self._tap_words[t]
        slot_layer, slot_width, code = int(w[0]), int(w[1]), int(w[2])
        slot_dtype = CODE_DTYPES.get(code)
        if layer != slot_layer or width != slot_width or dtype != slot_dtype:
            raise TapSpecMismatchError(
                f"writer for tap layer {layer} registers width {width}, dtype {dtype}; the reader's mailbox slot "
                f"{t} holds layer {slot_layer}, width {slot_width}, dtype {slot_dtype}")
        w[4] = pid if pid is not None else os.getpid()

    # ----- stamp protocol -------------------------------------------------------------------------
    def slot(self, seq: int) -> int:
        return seq % self.slots

    def stamp(self, t: int, seq: int) -> int:
        return int(self._slot_words[t][self.slot(seq), STAMP])

    def _err(self, cls, msg, t, seq, seen, **extra):
        spec = self.taps[t]
        return cls(msg, layer=spec.layer, rank=spec.rank if spec.rank is not None else -1, slot=self.slot(seq),
                   expected=seq + 1, seen=seen, **extra)

    def _poll(self, ready: Callable[[], bool], deadline: float | None, dead: Callable[[], str | None],
              on_timeout: Callable[[float], Exception], on_dead: Callable[[str], Exception]) -> float:
        t0 = time.monotonic()
        if ready():
            return 0.0
        spins, next_check = 0, t0
        while True:
            _pause(spins)
            spins += 1
            if ready():
                return time.monotonic() - t0
            now = time.monotonic()
            if now >= next_check:
                reason = dead()
                if reason:
                    if ready():  # the data made it before the source died
                        return now - t0
                    raise reason if isinstance(reason, BaseException) else on_dead(reason)
                next_check = now + LIVENESS_EVERY_S
            if deadline is not None and now > deadline:
                raise on_timeout(now - t0)

    def claim(self, t: int, seq: int) -> None:
        """Writer side, before waiting for the slot: announce ``seq``; a gap since ``head`` is a lap."""
        tap_words = self._tap_words[t]
        head = int(tap_words[HEAD])
        tap_words[CLAIM] = max(int(tap_words[CLAIM]), seq + 1)  # first: the reader sees it even if we raise
        if seq > head:
            spec = self.taps[t]
            raise TapLappedError(
                f"the writer is at microbatch stamp {seq + 1} but never wrote stamp {head + 1}: it skipped "
                f"{seq - head} microbatch(es) (its step numbering is ahead of the reader's?)",
                layer=spec.layer, rank=spec.rank if spec.rank is not None else -1, slot=self.slot(head),
                expected=head + 1, seen=seq + 1)

    def wait_free(self, t: int, seq: int, deadline: float | None, dead: Callable[[], str | None] | None = None) -> float:
        """Writer side: block until slot ``seq % slots`` no longer holds an unreleased microbatch."""
        words = self._slot_words[t][self.slot(seq)]
        need = seq + 1 - self.slots
        dead = dead or (lambda: self.liveness.dead_reason(self.reader_rank))
        return self._poll(
            lambda: int(words[RELEASED]) >= need, deadline, dead,
            lambda w: self._err(TapTimeoutError, f"writer waited {w:.3f}s for the reader to release the slot "
                                f"(released stamp {int(words[RELEASED])}, need >= {need})", t, seq, int(words[STAMP]), waited_s=w),
            lambda r: self._err(TapReaderDeadError, f"reader rank {self.reader_rank} is dead ({r}) while a writer "
                                "waited for a slot", t, seq, int(words[STAMP])),
        )

    def publish(self, t: int, seq: int, ntok: int) -> None:
        """Writer side, after the rows are in: token count, then the stamp as the last store."""
        self.check_writable(t, seq)
        words = self._slot_words[t][self.slot(seq)]
        words[NTOK] = ntok
        words[STAMP] = seq + 1
        self._tap_words[t][HEAD] = seq + 1

    def check_writable(self, t: int, seq: int) -> None:
        """A slot already stamped with this or a later microbatch is never written again."""
        seen = self.stamp(t, seq)
        if seen >= seq + 1:
            raise self._err(TapLappedError, "writer found the slot already at or past this microbatch "
                            "(duplicate or out-of-order write)", t, seq, seen)

    def put(self, t: int, seq: int, x: torch.Tensor, sync: Callable[[], None] | None = None) -> None:
        """Writer side: copy ``x`` [n, width] into the slot (already free), then publish."""
        self.check_writable(t, seq)
        n = x.shape[0]
        self.data[t][self.slot(seq), :n].copy_(x)
        if sync is not None:
            sync()  # e.g. CUDA stream sync: the rows must be complete before the stamp is visible
        self.publish(t, seq, n)

    def wait_stamp(self, t: int, seq: int, deadline: float | None, dead: Callable[[], str | None] | None = None) -> float:
        """Reader side: block until the slot carries stamp ``seq + 1``; returns the seconds waited."""
        words = self._slot_words[t][self.slot(seq)]
        tap_words = self._tap_words[t]
        spec = self.taps[t]
        expected = seq + 1

        def ready() -> bool:
            # claim and head before the stamp: the writer stores them around its stamps in the other order
            ahead = max(int(tap_words[CLAIM]), int(tap_words[HEAD]))
            s = int(words[STAMP])
            if s == expected:
                return True
            if s > expected:
                raise self._err(TapLappedError, "the source has lapped the reader: the slot already holds a later microbatch",
                                t, seq, s)
            if ahead > expected:
                raise self._err(TapLappedError, f"the source is already at stamp {ahead} and never wrote this microbatch "
                                "(skipped, or its step numbering is ahead of the reader's)", t, seq, ahead)
            return False

        dead = dead or (lambda: self.liveness.dead_reason(spec.rank))
        return self._poll(
            ready, deadline, dead,
            lambda w: self._err(TapTimeoutError, f"read timed out after {w:.3f}s waiting for the source", t, seq,
                                int(words[STAMP]), waited_s=w),
            lambda r: self._err(TapSourceDeadError, f"source rank {spec.rank} is dead ({r})", t, seq, int(words[STAMP])),
        )

    def read(self, t: int, seq: int, copy: bool = True) -> torch.Tensor:
        """Reader side, after :meth:`wait_stamp`: the rows ``[ntok, width]`` (a copy, or a view of the slot)."""
        words = self._slot_words[t][self.slot(seq)]
        before = int(words[STAMP])
        if before != seq + 1:
            raise self._err(TapLappedError if before > seq + 1 else TapTimeoutError, "slot does not hold this microbatch",
                            t, seq, before)
        n = int(words[NTOK])
        rows = self.data[t][self.slot(seq), :n]
        if copy:
            rows = rows.clone()
        after = int(words[STAMP])
        if after != before:
            raise self._err(TapLappedError, "the slot was overwritten while it was read", t, seq, after)
        return rows

    def release(self, t: int, seq: int) -> None:
        words = self._slot_words[t][self.slot(seq)]
        seen = int(words[STAMP])
        if seen != seq + 1:
            raise self._err(TapLappedError, "slot changed before it was released", t, seq, seen)
        words[RELEASED] = seq + 1
