"""``gloo`` / ``nccl``: point-to-point sends on a dedicated process group, into a mailbox on the reader.

The channel creates the group with ``dist.new_group`` over the pipeline's ranks (gloo, or nccl for the
``nccl`` transport): never Megatron's pipeline group, so these messages cannot interleave with, or
deadlock against, the 1F1B schedule's own sends.

Writer: per tap write, ``isend`` of a header ``[seq, tap, ntok]`` then ``isend`` of the ``ntok`` rows
(both tagged; gloo matches by tag and keeps FIFO order per peer). Sends complete only when the reader
has posted the matching receive (gloo rendezvous), so a writer keeps at most ``2 x slots`` writes per
tap in flight (held by reference, not copied): before posting ``seq`` it waits for the sends of
``seq - 2 x slots``.

Reader: one mailbox thread per source rank receives that rank's headers in order, waits until the
named slot is released (back-pressure: the writer's send simply stays pending), receives the rows
straight into the slot (with the next header's receive already posted), then stores the stamp - the same slot/stamp protocol as the other transports,
in the reader's own memory. The threads only post receives for the microbatches of the current step
(``begin_step``), so an idle channel between steps has nothing pending. A source that dies closes its
TCP pair; the thread's receive fails and the reader's wait raises ``TapSourceDeadError``.

With ``nccl`` (run only where CUDA is; the CPU tests run gloo): tensors live on the reader's CUDA
device, and a second communicator runs next to Megatron's - keep NCCL's usual caveats about
concurrent communicators in mind. Streams and ordering on the reader:

- The mailbox threads post their receives from a CUDA stream of their own (``recv_stream``), never
  the default stream Megatron computes on: ProcessGroupNCCL orders an operation after the posting
  thread's current stream, and the thread waits for a receive by polling ``Work.is_completed()``,
  so neither a receive nor its wait is queued behind (or stalls) the compute, e.g. behind a
  pipeline receive that needs this very tap.
- After the rows of ``seq`` are in (``is_completed()``, then ``wait()``, which only makes
  ``recv_stream`` wait on the receive's end event), the thread records an event on ``recv_stream``
  and only then stores the stamp; the reader's ``wait`` makes its compute stream wait on that event
  (``compute.wait_event``) before anything reads the slot.
- ``release`` records an event on the compute stream (after the copy-out or the kernels that read a
  zero-copy view); before posting a receive into that slot again, the thread makes ``recv_stream``
  wait on it, so NCCL cannot overwrite rows the compute stream has not read yet.

Timeouts under NCCL: ``Work.wait(timeout=)`` on an NCCL work that times out aborts the communicator
and tears the process down through ProcessGroupNCCL's error handling instead of returning an
exception one could name, so the writer's bounded wait for its sends polls ``is_completed()``
against the deadline and raises TapTimeoutError itself (gloo keeps ``wait(timeout=)``, which raises).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from datetime import timedelta
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from cotrain.tapchannel.errors import TapError, TapLappedError, TapReaderDeadError, TapSpecMismatchError, TapTimeoutError
from cotrain.tapchannel.interfaces import TapTransport, TransportContext
from cotrain.tapchannel.mailbox import Mailbox, control_words
from cotrain.tapchannel.spec import CODE_DTYPES, TapSpec, dtype_code

HEADER_TAG = 0x7A01
DATA_TAG = 0x7A02


class _Receiver(threading.Thread):
    """Reader-side mailbox thread for one source rank."""

    def __init__(self, transport: "GlooTransport", src: int):
        super().__init__(name=f"tapchannel-recv-{src}", daemon=True)
        self.tr, self.src = transport, src
        self.cond = threading.Condition()
        self.pending = 0
        self.next_seq: dict[int, int] = {}
        self.stopped = False
        self.error: BaseException | None = None

    def expect(self, first_seq: int, count: int, taps: list[int]) -> None:
        with self.cond:
            self.pending += count * len(taps)
            for t in taps:
                self.next_seq[t] = first_seq
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()

    def reason(self) -> str | BaseException | None:
        if self.error is None:
            return None
        if isinstance(self.error, TapError):  # a protocol error: raise it as it is on the reader
            return self.error
        return f"mailbox thread for rank {self.src} failed: {type(self.error).__name__}: {str(self.error).splitlines()[0][:300]}"

    def _take(self, block: bool) -> bool:
        """Claim the next expected message (blocking until one is expected, or not)."""
        with self.cond:
            while block and self.pending == 0 and not self.stopped:
                self.cond.wait()
            if self.stopped or self.pending == 0:
                return False
            self.pending -= 1
            return True

    def run(self) -> None:
        try:
            with self.tr.receiving():
                self._run()
        except BaseException as e:  # reported to the reader through its liveness probe
            self.error = e

    def _run(self) -> None:
        tr, ctx = self.tr, self.tr.ctx
        hdrs = [torch.zeros(3, dtype=torch.int64, device=tr.device) for _ in range(2)]
        mine = {t for t, s in enumerate(ctx.taps) if s.rank == self.src}
        recv = partial(dist.irecv, src=self.src, group=ctx.data_group)
        k, next_hdr = 0, None
        while True:
            if next_hdr is None:
                if not self._take(block=True):
                    return
                next_hdr = recv(hdrs[k % 2], tag=HEADER_TAG)
            if not tr._await(next_hdr, self):
                return
            seq, t, n = (int(v) for v in hdrs[k % 2].tolist())
            next_hdr = None
            if t not in mine or not 0 <= n <= ctx.max_tokens:
                raise TapSpecMismatchError(f"bad tap header from rank {self.src}: seq {seq}, tap {t}, ntok {n}")
            mb = tr.mailbox
            with self.cond:
                want = self.next_seq.get(t, seq)
                self.next_seq[t] = seq + 1
            if seq != want:  # per tap, sources write microbatches in order
                spec = ctx.taps[t]
                raise TapLappedError(
                    "the source sent a microbatch out of order: "
                    + ("it is ahead of the reader (skipped, or its step numbering is ahead)" if seq > want else "stale"),
                    layer=spec.layer, rank=self.src, slot=mb.slot(want), expected=want + 1, seen=seq + 1)
            mb.check_writable(t, seq)
            mb.wait_free(t, seq, None, dead=lambda: "channel closed" if self.stopped else None)
            tr._slot_free(t, mb.slot(seq))  # after the reader's reads of the slot's previous rows
            data = recv(mb.data[t][mb.slot(seq), :n], tag=DATA_TAG) if n else None
            if self._take(block=False):  # the next header's receive is posted while the rows arrive
                next_hdr = recv(hdrs[(k + 1) % 2], tag=HEADER_TAG)
            if data is not None and not tr._await(data, self):
                return
            tr._received(t, mb.slot(seq))  # before the stamp: the reader's compute stream waits on it
            mb.publish(t, seq, n)
            k += 1


class GlooTransport(TapTransport):
    name = "gloo"
    data_backend = "gloo"

    def __init__(self):
        self.ctx: TransportContext | None = None
        self.mailbox: Mailbox | None = None
        self.device = torch.device("cpu")
        self._geometry: list[tuple[int, int, int]] | None = None
        self._receivers: dict[int, _Receiver] = {}
        self._taps_of_rank: dict[int, list[int]] = {}
        self._inflight: dict[int, deque] = {}

    def _pick_device(self, ctx: TransportContext) -> torch.device:
        return torch.device("cpu")

    def _sync(self) -> None:
        pass

    # ----- hooks the nccl transport overrides (gloo: plain waits, one CPU "stream") ----------------------
    def receiving(self):
        """Context of a mailbox thread's whole life (nccl: its device and its own CUDA stream)."""
        return contextlib.nullcontext()

    def _await(self, work, rcv: _Receiver) -> bool:
        """Mailbox thread: block until a posted receive has completed (False: the channel closed first)."""
        work.wait()
        self._sync()
        return True

    def _slot_free(self, t: int, slot: int) -> None:
        """Mailbox thread, before posting a receive into ``slot``: order it after the reader's reads."""

    def _received(self, t: int, slot: int) -> None:
        """Mailbox thread, after the rows of ``slot`` are in and before its stamp."""

    def _wait_send(self, work, deadline: float | None) -> None:
        """Writer: wait for one send, raising RuntimeError("... timed out ...") past ``deadline``."""
        left = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
        work.wait() if left is None else work.wait(timeout=timedelta(seconds=left))

    def setup(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self.device = self._pick_device(ctx)
        if ctx.data_group is None:
            raise RuntimeError(f"transport {self.name!r} needs a dedicated data group")
        geometry = None
        if ctx.is_reader:
            ctrl = np.zeros(control_words(len(ctx.taps), ctx.slots), dtype=np.int64)
            data = [torch.zeros(ctx.slots, ctx.max_tokens, s.width, dtype=s.dtype, device=self.device) for s in ctx.taps]
            self.mailbox = Mailbox(ctrl, data, ctx.taps, ctx.slots, ctx.max_tokens, ctx.layout.reader_rank, ctx.liveness)
            self.mailbox.format()
            geometry = [(s.layer, s.width, dtype_code(s.dtype)) for s in ctx.taps]
            for t, s in enumerate(ctx.taps):
                self._taps_of_rank.setdefault(s.rank, []).append(t)
            for src in sorted(self._taps_of_rank):
                rcv = _Receiver(self, src)
                self._receivers[src] = rcv
                ctx.liveness.probes[src] = rcv.reason
                rcv.start()
        obj = [geometry]
        dist.broadcast_object_list(obj, src=ctx.layout.reader_rank, group=ctx.control_group)
        self._geometry = obj[0]
        self._inflight = {t: deque() for t in ctx.my_taps()}

    def register_writer(self, t: int, spec: TapSpec) -> None:
        layer, width, code = self._geometry[t]
        if (spec.layer, spec.width, dtype_code(spec.dtype)) != (layer, width, code):
            raise TapSpecMismatchError(
                f"writer for tap layer {spec.layer} registers width {spec.width}, dtype {spec.dtype}; the reader's "
                f"slot {t} holds layer {layer}, width {width}, dtype {CODE_DTYPES[code]}")

    def begin_step(self, first_seq: int, count: int) -> None:
        for src, rcv in self._receivers.items():
            rcv.expect(first_seq, count, self._taps_of_rank[src])

    def _drain(self, t: int, upto_seq: int, deadline: float | None) -> float:
        q = self._inflight[t]
        t0 = time.monotonic()
        while q and q[0][0] <= upto_seq:
            seq, works, _keep = q.popleft()
            for w in works:
                try:
                    self._wait_send(w, deadline)
                except RuntimeError as e:
                    spec = self.ctx.taps[t]
                    kw = dict(layer=spec.layer, rank=spec.rank, slot=seq % self.ctx.slots, expected=seq + 1, seen=-1)
                    if "timed out" in str(e).lower():
                        raise TapTimeoutError(f"writer's send to reader rank {self.ctx.layout.reader_rank} did not "
                                              f"complete in time (reader not releasing slots?): {e}", **kw) from e
                    raise TapReaderDeadError(f"send to reader rank {self.ctx.layout.reader_rank} failed: {e}", **kw) from e
        return time.monotonic() - t0

    def write(self, t: int, seq: int, rows: torch.Tensor, deadline: float) -> float:
        # sends complete when the reader's thread posts the receive, i.e. once the slot is free; keeping
        # 2 x slots in flight lets the source run on while that thread catches up (the rows are held by
        # reference - for a batch of one they are views of layer outputs kept for backward anyway)
        waited = self._drain(t, seq - 2 * self.ctx.slots, deadline)
        rows = rows.to(self.device).contiguous()
        n = rows.shape[0]
        hdr = torch.tensor([seq, t, n], dtype=torch.int64, device=self.device)
        g, dst = self.ctx.data_group, self.ctx.layout.reader_rank
        works = [dist.isend(hdr, dst=dst, group=g, tag=HEADER_TAG)]
        if n:
            works.append(dist.isend(rows, dst=dst, group=g, tag=DATA_TAG))
        self._inflight[t].append((seq, works, (hdr, rows)))  # keep the buffers alive until sent
        return waited

    def wait(self, t: int, seq: int, deadline: float) -> float:
        return self.mailbox.wait_stamp(t, seq, deadline)

    def read(self, t: int, seq: int, copy: bool = True) -> torch.Tensor:
        return self.mailbox.read(t, seq, copy)

    def release(self, t: int, seq: int) -> None:
        self.mailbox.release(t, seq)

    def flush(self, deadline: float | None) -> None:
        for t in self._inflight:
            self._drain(t, 1 << 62, deadline)

    def close(self) -> None:
        try:
            if self.ctx is not None:
                self.flush(time.monotonic() + self.ctx.timeout_s)
        except TapError:
            pass  # closing after a fault: the peer is gone or the channel already failed
        finally:
            for rcv in self._receivers.values():
                rcv.stop()
            self._receivers = {}


class NcclTransport(GlooTransport):
    """gloo's protocol on an NCCL group, with the reader's receives on their own CUDA stream (module doc)."""

    name = "nccl"
    data_backend = "nccl"
    POLL_S = 5e-5  # the mailbox thread's and the writer's pause between is_completed() polls

    def __init__(self):
        super().__init__()
        self.recv_stream: torch.cuda.Stream | None = None
        self._recv_events: list[list] = []  # [tap][slot]: recorded on recv_stream after the rows came in
        self._release_events: list[list] = []  # [tap][slot]: recorded on the compute stream at release

    def _pick_device(self, ctx: TransportContext) -> torch.device:
        if not torch.cuda.is_available():
            raise RuntimeError("transport 'nccl' needs CUDA")
        return ctx.device or torch.device("cuda", torch.cuda.current_device())

    def setup(self, ctx: TransportContext) -> None:
        self.device = self._pick_device(ctx)
        if ctx.is_reader:
            self.recv_stream = torch.cuda.Stream(self.device)
            self._recv_events = [[None] * ctx.slots for _ in ctx.taps]
            self._release_events = [[None] * ctx.slots for _ in ctx.taps]
        super().setup(ctx)

    def _sync(self) -> None:
        self.recv_stream.synchronize()

    @contextlib.contextmanager
    def receiving(self):
        torch.cuda.set_device(self.device)
        with torch.cuda.stream(self.recv_stream):  # this thread's current stream: NCCL orders after it
            yield

    def _await(self, work, rcv: _Receiver) -> bool:
        # is_completed() polls the work's end event: no CPU block behind other work. Once it is done,
        # wait() (no timeout) only makes this thread's stream (recv_stream) wait on that event - the
        # ordering the event recorded in _received relies on - and raises a failed work's error.
        while not work.is_completed():
            if rcv.stopped:
                return False
            time.sleep(self.POLL_S)
        work.wait()
        return True

    def _slot_free(self, t: int, slot: int) -> None:
        event = self._release_events[t][slot]
        if event is not None:
            self.recv_stream.wait_event(event)

    def _received(self, t: int, slot: int) -> None:
        event = torch.cuda.Event()
        event.record(self.recv_stream)
        self._recv_events[t][slot] = event

    def _wait_send(self, work, deadline: float | None) -> None:
        while not work.is_completed():
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError("NCCL send timed out (polled is_completed() up to the channel's deadline)")
            time.sleep(self.POLL_S)
        work.wait()  # completed: returns at once (a failed work raises)

    def wait(self, t: int, seq: int, deadline: float) -> float:
        waited = super().wait(t, seq, deadline)
        event = self._recv_events[t][self.mailbox.slot(seq)]
        if event is not None:  # the compute stream reads the slot only after the rows are in
            torch.cuda.current_stream(self.device).wait_event(event)
        return waited

    def release(self, t: int, seq: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # after the copy-out / the view's readers
        self._release_events[t][self.mailbox.slot(seq)] = event  # before `released`: the thread reads it after
        super().release(t, seq)
