"""``shm``: the mailbox in POSIX shared memory owned by the reader; sources write straight into it.

The reader creates a ``/dev/shm`` file holding the control words and every tap's slot ring, maps it,
formats it and tells the writers its name over the channel's control group; each writer maps it and
writes its rows with ``Tensor.copy_`` into a ``torch.frombuffer`` view, then stores the stamp (the
protocol and the memory-ordering argument are in :mod:`cotrain.tapchannel.mailbox`). Once every rank
has mapped it the reader unlinks the file, so nothing is left behind whatever happens next.

A plain file + ``mmap`` is used rather than ``multiprocessing.shared_memory``: on Python 3.11 every
process that attaches to a SharedMemory registers it with its resource tracker, which unlinks it (and
warns) when that process exits.
"""

from __future__ import annotations

import mmap
import os
import uuid

import numpy as np
import torch
import torch.distributed as dist

from cotrain.tapchannel.interfaces import TapTransport, TransportContext
from cotrain.tapchannel.mailbox import Mailbox, control_words, strongly_ordered_cpu
from cotrain.tapchannel.spec import TapSpec

SHM_DIR = "/dev/shm"
_ALIGN = 4096


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class ShmTransport(TapTransport):
    name = "shm"
    data_in_shm = True  # cuda_ipc keeps only the control words in shm

    def __init__(self):
        self.ctx: TransportContext | None = None
        self.mailbox: Mailbox | None = None
        self._mm: mmap.mmap | None = None
        self._path: str | None = None

    # ----- setup -------------------------------------------------------------------------------------
    def _check_node(self, ctx: TransportContext) -> None:
        if not strongly_ordered_cpu() and os.environ.get("TAPCHANNEL_ALLOW_WEAK_ORDERING") != "1":
            raise RuntimeError(f"transport {self.name!r}: stamps rely on x86-64 store ordering; this CPU is "
                               "weakly ordered - use the 'gloo' transport (or set TAPCHANNEL_ALLOW_WEAK_ORDERING=1)")
        reader = ctx.layout.reader_rank
        host = ctx.liveness.peers.get(reader, ctx.liveness.me)  # the mailbox lives on the reader's node
        ranks = sorted({s.rank for s in ctx.taps} | {reader})  # the ranks that share this transport's mailbox
        others = [r for r in ranks
                  if (r in ctx.liveness.peers and not ctx.liveness.peers[r].same_node(host))
                  or (ctx.nodes and ctx.nodes.get(r) != ctx.nodes.get(reader))]
        if others:
            raise RuntimeError(f"transport {self.name!r} needs its sources on the reader's node; ranks {others} are "
                               f"on another node than reader rank {reader} - use 'gloo' or 'nccl' (or 'auto')")

    def _sizes(self, ctx: TransportContext) -> tuple[int, list[int], int]:
        ctrl_bytes = _round_up(control_words(len(ctx.taps), ctx.slots) * 8, _ALIGN)
        offsets, off = [], ctrl_bytes
        for spec in ctx.taps:
            offsets.append(off)
            if self.data_in_shm:
                off += _round_up(ctx.slots * ctx.max_tokens * spec.width * spec.itemsize, 64)
        return ctrl_bytes, offsets, _round_up(off, _ALIGN)

    def setup(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self._check_node(ctx)
        reader = ctx.layout.reader_rank
        ctrl_bytes, offsets, total = self._sizes(ctx)
        if ctx.is_reader:
            free = os.statvfs(SHM_DIR)
            if free.f_bavail * free.f_frsize < total:
                raise RuntimeError(f"transport {self.name!r}: {SHM_DIR} has {free.f_bavail * free.f_frsize} bytes free, "
                                   f"the mailbox needs {total}")
            path = os.path.join(SHM_DIR, f"cotrain-tap-{ctx.name}-{os.getpid()}-{uuid.uuid4().hex[:10]}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, total)
                self._mm = mmap.mmap(fd, total)
            finally:
                os.close(fd)
            self._path = path
        obj = [self._path]
        dist.broadcast_object_list(obj, src=reader, group=ctx.control_group)
        path = obj[0]
        if not ctx.is_reader and ctx.my_taps():
            fd = os.open(path, os.O_RDWR)
            try:
                self._mm = mmap.mmap(fd, total)
            finally:
                os.close(fd)
        if self._mm is not None:
            ctrl = np.frombuffer(self._mm, dtype=np.int64, count=ctrl_bytes // 8)
            data = self._attach_data(ctx, offsets)
            self.mailbox = Mailbox(ctrl, data, ctx.taps, ctx.slots, ctx.max_tokens, reader, ctx.liveness)
            if ctx.is_reader:
                self.mailbox.format()
        dist.barrier(group=ctx.control_group)  # everyone mapped (and the reader formatted) ...
        if ctx.is_reader:
            os.unlink(path)  # ... so the name can go now: no leak whatever happens later
            self._path = None
        elif self.mailbox is not None:
            self.mailbox.check_format()

    def _attach_data(self, ctx: TransportContext, offsets: list[int]) -> list[torch.Tensor]:
        return [torch.frombuffer(self._mm, dtype=spec.dtype, count=ctx.slots * ctx.max_tokens * spec.width, offset=off)
                .view(ctx.slots, ctx.max_tokens, spec.width) for spec, off in zip(ctx.taps, offsets)]

    # ----- protocol ----------------------------------------------------------------------------------
    def register_writer(self, t: int, spec: TapSpec) -> None:
        self.mailbox.register_writer(t, spec.layer, spec.width, spec.dtype)

    def _sync(self):
        return None

    def write(self, t: int, seq: int, rows: torch.Tensor, deadline: float) -> float:
        self.mailbox.claim(t, seq)  # a writer ahead of the reader fails here, and the reader with it
        waited = self.mailbox.wait_free(t, seq, deadline)
        self._put(t, seq, rows)
        return waited

    def _put(self, t: int, seq: int, rows: torch.Tensor) -> None:
        self.mailbox.put(t, seq, rows, sync=self._sync())

    def wait(self, t: int, seq: int, deadline: float) -> float:
        return self.mailbox.wait_stamp(t, seq, deadline)

    def read(self, t: int, seq: int, copy: bool = True) -> torch.Tensor:
        return self.mailbox.read(t, seq, copy)

    def release(self, t: int, seq: int) -> None:
        self.mailbox.release(t, seq)

    def close(self) -> None:
        self.mailbox = None
        if self._path is not None:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a caller still holds a view of a slot: the mapping goes when that is collected
            self._mm = None
