"""``cuda_ipc``: slot buffers on the reader's GPU, exported as CUDA IPC handles, written by same-node
sources; stamps in a shared-memory control block.

The reader allocates one CUDA tensor per tap (``[slots, max_tokens, width]``) and sends each writer the
tensor's IPC handle (``torch.multiprocessing.reductions.reduce_tensor``: the same handle and ref-count
machinery torch uses to pass CUDA tensors between processes). The control words (stamps,
back-pressure, liveness) are exactly those of the ``shm`` transport; what CUDA adds is ordering on
both sides of a slot:

- Writer: a writer rebuilds the tensor, which aliases the reader's memory, copies its rows into the
  slot on its current stream, **synchronises that stream** (the writer's CPU waits for the copy, i.e.
  for the GPU to catch up with the tapped layer; an asynchronous publisher thread waiting on a CUDA
  event would remove that stall), and only then stores the stamp, so the reader never sees a stamp
  before the rows are complete in device memory.
- Reader: the copy-out (``read``) is only queued on the reader's current stream, and a zero-copy view
  is read by kernels queued later, so ``release`` records an event on the reader's current stream and
  stores ``released`` only once that event has completed (:mod:`.release`): a writer waiting for the
  slot cannot overwrite rows the reader's GPU has not read yet. Kernels on other streams that use a
  zero-copy view must be ordered before the release by the caller.

Requirements: all ranks on one node, and each writer sees the reader's GPU under the same device index
as the reader (IPC handles name the device by the opener's numbering; with per-process
``CUDA_VISIBLE_DEVICES`` - as Ray sets by default - give every training worker all the node's GPUs).
A process cannot open its own IPC handle, so the reader's own taps never use it (they are local).
Tested only on machines with CUDA (its tests skip elsewhere).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cotrain.tapchannel.interfaces import TransportContext
from cotrain.tapchannel.transports.release import DeferredRelease
from cotrain.tapchannel.transports.shm import ShmTransport


class CudaIpcTransport(ShmTransport):
    name = "cuda_ipc"
    data_in_shm = False

    def __init__(self):
        super().__init__()
        self._buffers: list[torch.Tensor] = []
        self._device: torch.device | None = None
        self._releases: DeferredRelease | None = None

    def _attach_data(self, ctx: TransportContext, offsets: list[int]) -> list[torch.Tensor]:
        return self._buffers

    def setup(self, ctx: TransportContext) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("transport 'cuda_ipc' needs CUDA")
        from torch.multiprocessing.reductions import reduce_tensor

        self._device = ctx.device or torch.device("cuda", torch.cuda.current_device())
        handles = None
        if ctx.is_reader:
            self._buffers = [torch.zeros(ctx.slots, ctx.max_tokens, s.width, dtype=s.dtype, device=self._device)
                             for s in ctx.taps]
            torch.cuda.synchronize(self._device)
            handles = [reduce_tensor(b) for b in self._buffers]  # (rebuild function, args) per tap
        obj = [handles]
        dist.broadcast_object_list(obj, src=ctx.layout.reader_rank, group=ctx.control_group)
        if not ctx.is_reader and ctx.my_taps():
            mine = set(ctx.my_taps())
            # only this writer's taps are opened; the others are placeholders never touched
            self._buffers = [fn(*args) if t in mine else None for t, (fn, args) in enumerate(obj[0])]
        super().setup(ctx)

    # ----- writer ------------------------------------------------------------------------------------
    def _put(self, t: int, seq: int, rows: torch.Tensor) -> None:
        dst = self.mailbox.data[t].device
        streams = {dst} | ({rows.device} if rows.is_cuda else set())

        def sync():  # the rows must be complete in the reader's memory before the stamp is stored
            for dev in streams:
                torch.cuda.current_stream(dev).synchronize()

        with torch.cuda.device(dst):
            self.mailbox.put(t, seq, rows, sync=sync)

    # ----- reader ------------------------------------------------------------------------------------
    def _record(self) -> torch.cuda.Event:
        """An event after everything queued so far on the reader's current stream (of the slots' device)."""
        event = torch.cuda.Event(blocking=True)  # the publisher thread sleeps in synchronize(), not spins
        event.record(torch.cuda.current_stream(self._device))
        return event

    @property
    def releases(self) -> DeferredRelease:
        if self._releases is None:
            self._releases = DeferredRelease(self.mailbox.release, self._record, name=f"tapchannel-{self.name}")
        return self._releases

    def wait(self, t: int, seq: int, deadline: float) -> float:
        self.releases.check()
        return super().wait(t, seq, deadline)

    def release(self, t: int, seq: int) -> None:
        self.releases.release(t, seq)  # `released` is stored once the GPU has read the slot

    def close(self) -> None:
        if self._releases is not None:
            self._releases.close()
            self._releases = None
        super().close()
        self._buffers = []
