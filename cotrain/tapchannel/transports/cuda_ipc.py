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

Devices. A CUDA IPC handle carries the exporting process's *index* of its device (the
``storage_device`` argument of ``torch.multiprocessing.reductions.rebuild_cuda_tensor``, which opens
the handle under that index in the opening process). Under Ray each actor sees only its own GPU
(``CUDA_VISIBLE_DEVICES`` set per actor), so indices differ between processes. The reader therefore
names its buffers' GPU by UUID (``torch.cuda.get_device_properties(i).uuid``); each writer finds the
local index of that UUID among the GPUs it sees (:func:`local_index_of`) and opens the handles under
it. A writer that does not see the reader's GPU at all cannot open the memory (torch would label it
with a wrong device): set-up fails on every rank with an error naming the UUID and the GPUs the
writer sees. The remedy: let every trainer process see all of the node's GPUs - Ray's
``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` in the actors' environment, with each rank calling
``torch.cuda.set_device`` on its own GPU - or use the ``nccl`` transport (``auto`` does that by
itself for a source that does not see the reader's GPU).

Requirements: all ranks on one node. A process cannot open its own IPC handle, so the reader's own
taps never use it (they are local). Tested only on machines with CUDA (its tests skip elsewhere;
the UUID lookup is tested on CPU).
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
import torch.distributed as dist

from cotrain.tapchannel.errors import TapError
from cotrain.tapchannel.interfaces import TransportContext
from cotrain.tapchannel.transports.release import DeferredRelease
from cotrain.tapchannel.transports.shm import ShmTransport


def _storage_device_arg() -> int:
    """Position of ``storage_device`` among ``rebuild_cuda_tensor``'s arguments (read from torch itself)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return list(inspect.signature(rebuild_cuda_tensor).parameters).index("storage_device")


def open_handle(handle: tuple, local_index: int):
    """Rebuild a ``reduce_tensor`` handle ``(rebuild_cuda_tensor, args)`` on this process's device
    ``local_index`` (the handle carries the exporter's own index of it)."""
    fn, args = handle
    at = _storage_device_arg()
    return fn(*args[:at], local_index, *args[at + 1:])


class CudaIpcDeviceError(TapError):
    """A writer does not see the GPU that holds the reader's slots (module doc: what to do)."""


REMEDY = ("CUDA IPC opens memory only on a GPU the process sees: let every trainer process see all of the node's "
          "GPUs (Ray: RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 for the actors, then torch.cuda.set_device per "
          "rank), or use the 'nccl' tap transport ('auto' picks it for such a source)")


def visible_gpus() -> list[tuple[int, str]]:
    """(local index, UUID) of every GPU this process sees."""
    return [(i, str(torch.cuda.get_device_properties(i).uuid)) for i in range(torch.cuda.device_count())]


def device_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_index_of(uuid: str, visible: Sequence[tuple[int, str]], who: str = "this process") -> int:
    """The local index of the GPU with ``uuid`` among ``visible`` ((index, UUID) pairs); raises
    CudaIpcDeviceError naming the UUID and what ``who`` sees when it is not there (or there twice)."""
    hits = [i for i, u in visible if u == uuid]
    if len(hits) == 1:
        return hits[0]
    seen = ", ".join(f"{i}: {u}" for i, u in visible) or "no GPU"
    what = "does not see" if not hits else f"sees {len(hits)} times"
    raise CudaIpcDeviceError(f"{who} {what} the reader's GPU {uuid} (it sees {seen}); {REMEDY}")


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
        handles = uuid = None
        if ctx.is_reader:
            self._buffers = [torch.zeros(ctx.slots, ctx.max_tokens, s.width, dtype=s.dtype, device=self._device)
                             for s in ctx.taps]
            torch.cuda.synchronize(self._device)
            handles = [reduce_tensor(b) for b in self._buffers]  # (rebuild function, args) per tap
            uuid = device_uuid(self._device)
        obj = [(uuid, handles)]
        dist.broadcast_object_list(obj, src=ctx.layout.reader_rank, group=ctx.control_group)
        uuid, handles = obj[0]
        index, error = None, None
        if not ctx.is_reader and ctx.my_taps():
            try:
                index = local_index_of(uuid, visible_gpus(), who=f"writer rank {ctx.rank}")
            except CudaIpcDeviceError as e:
                error = str(e)
        # every rank learns every writer's failure, so none is left waiting in the collectives below
        errors: list = [None] * dist.get_world_size(ctx.control_group)
        dist.all_gather_object(errors, error, group=ctx.control_group)
        failed = [e for e in errors if e]
        if failed:
            raise CudaIpcDeviceError(f"transport 'cuda_ipc' of channel {ctx.name!r}: " + "; ".join(failed))
        if index is not None:
            mine = set(ctx.my_taps())
            # only this writer's taps are opened, under its own index of the reader's GPU; the others
            # are placeholders never touched
            self._buffers = [open_handle(h, index) if t in mine else None for t, h in enumerate(handles)]
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
