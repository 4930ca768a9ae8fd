"""TapChannel: taps from any pipeline stage straight to the drafter's stage, outside the schedule.

::

    layout = PipelineLayout.from_megatron(model)              # this rank's pipeline
    specs = tap_specs([1, 3, 5], layout, width=hidden, dtype=torch.bfloat16)
    channel = TapChannel(specs, layout, "shm", max_tokens=seq_len * micro_batch)   # collective (world)
    hooks = attach_tap_hooks(model, channel)                  # writers on the configured layers

    channel.begin_step(num_microbatches)                      # every rank, every step
    def forward_step(it, model):
        mb, batch = next(it)
        hooks.set_microbatch(mb, num_tokens=batch.num_tokens)  # optional: default = next index, all tokens
        out = model(...)
        def loss(out):                                        # runs on the last stage after its forward
            taps = channel.read(mb)                           # {layer: [num_tokens, width]}
            ...
    forward_backward_func(...)
    stats = channel.end_step()

Each remote tap crosses once, from its source rank into the reader's mailbox (see
:mod:`cotrain.tapchannel.mailbox` for slots, stamps and back-pressure). Taps produced on the reader's
own rank are kept by reference and returned by ``read`` as they are: no copy, no transport.

Transports per source: ``transport`` names one transport for every remote tap (``"shm"``, ``"gloo"``,
...), or is ``"auto"``: then each source rank gets the transport its link calls for, from the node
identities the ranks give (``node=``, e.g. their Ray node id; default: the machine's boot id) - a
source on the reader's node ``shm`` (CPU) / ``cuda_ipc`` (``device`` on CUDA; ``nccl`` for a source
that does not see the reader's GPU, by UUID), a source on another node ``gloo`` / ``nccl``. One channel then runs one transport instance per name in use, each over the
same slot/stamp protocol for its own taps; ``routes`` says which layer went which way.

Microbatch numbering: ``begin_step(M)`` opens microbatches ``0..M-1`` of a step; the channel maps them
to running sequence numbers (stamps) that continue across steps, so every rank must call
``begin_step`` with the same ``M``.

Slots: with Megatron's 1F1B schedule a stage ``s`` runs at most ``pp - s`` forwards ahead of the last
stage's reads, so each ring needs ``slots >= pp - s`` for its source stage ``s`` or the writer's
back-pressure wait could block the pipeline itself; the default is ``pp`` and smaller values are
rejected.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from cotrain.tapchannel.errors import TapError, TapSpecMismatchError
from cotrain.tapchannel.interfaces import TapTransport, TransportContext
from cotrain.tapchannel.mailbox import Liveness, ProcessInfo
from cotrain.tapchannel.metrics import TapMetrics
from cotrain.tapchannel.spec import PipelineLayout, TapSpec, dtype_code
from cotrain.tapchannel.transports import make_transport
from cotrain.tapchannel.transports.cuda_ipc import device_uuid, visible_gpus


def _gather(obj, group=None) -> list:
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


class TapChannel:
    """Moves taps from their source stages to the reader (the drafter's stage) of one pipeline.

    Construction is collective over the default process group when torch.distributed is initialised
    (it creates the channel's dedicated groups for every pipeline of the world with ``dist.new_group``);
    without torch.distributed only a single-rank pipeline is allowed (all taps local).
    """

    def __init__(self, specs: Sequence[TapSpec], layout: PipelineLayout, transport: str | TapTransport = "shm", *,
                 max_tokens: int, slots: int | None = None, timeout_s: float = 60.0, name: str = "tap",
                 device: torch.device | None = None, node: str | None = None):
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.layout = layout
        self.specs = sorted((s if s.rank is not None else s.resolve(layout) for s in specs), key=lambda s: s.layer)
        layers = [s.layer for s in self.specs]
        if len(set(layers)) != len(layers):
            raise ValueError(f"tap layers repeat: {layers}")
        for s in self.specs:
            s.resolve(layout)  # re-checks an explicitly given stage/rank against the layout
        self.max_tokens = int(max_tokens)
        self.timeout_s = float(timeout_s)
        self.name = name
        self.rank = dist.get_rank() if dist.is_initialized() else layout.stage_ranks[0]
        self.stage = layout.stage_of_rank(self.rank)
        if self.stage is None:
            raise ValueError(f"rank {self.rank} is not a stage of pipeline {layout.stage_ranks}")
        self.is_reader = self.rank == layout.reader_rank
        self.remote = [s for s in self.specs if s.rank != layout.reader_rank]
        self._remote_index = {s.layer: t for t, s in enumerate(self.remote)}
        self._by_layer = {s.layer: s for s in self.specs}
        min_src_stage = min((s.stage for s in self.remote), default=layout.pp_size)
        need = max(1, layout.pp_size - min_src_stage)
        self.slots = int(slots) if slots is not None else max(layout.pp_size, 1)
        if self.slots < need:
            raise ValueError(f"slots={self.slots} < {need}: a tap from stage {min_src_stage} of {layout.pp_size} can be "
                             f"{need} microbatches ahead of the reader under 1F1B; fewer slots would stall the pipeline")
        self.metrics = TapMetrics()
        self._local: dict[tuple[int, int], torch.Tensor] = {}
        self._registered: set[int] = set()
        self._last_written: dict[int, int] = {}
        self._unreleased: dict[int, list[int]] = {}  # seq -> remote tap layers read as views
        self._read_seqs: set[int] = set()
        self._next_seq = 0
        self._step_first: int | None = None
        self._step_count = 0
        self.step = -1
        self.transports: dict[str, TapTransport] = {}  # transport name -> instance (remote taps only)
        self._route: dict[int, tuple[TapTransport, int]] = {}  # remote layer -> (transport, its tap index)
        self.routes: dict[int, str] = {s.layer: "local" for s in self.specs if s.layer not in self._remote_index}
        self.nodes: dict[int, str] = {}  # global rank -> node identity (this pipeline's ranks)
        self.transport_name = transport if isinstance(transport, str) else transport.name
        self._setup(transport, device, node)

    # ----- setup ---------------------------------------------------------------------------------------
    @property
    def transport(self) -> TapTransport | None:
        """The channel's transport when its remote taps use one (None: no remote taps)."""
        if len(self.transports) > 1:
            raise TapError(f"channel {self.name!r} uses several transports ({', '.join(self.transports)}): "
                           "see .transports and .routes")
        return next(iter(self.transports.values()), None)

    @staticmethod
    def choose(spec: str, same_node: bool, cuda: bool, sees_reader_gpu: bool = True) -> str:
        """The transport of one source: ``spec`` itself unless it is ``auto`` (then by the link; on
        CUDA, a source on the reader's node that does not see the reader's GPU - e.g. a Ray actor
        with its own ``CUDA_VISIBLE_DEVICES`` - cannot open its IPC handles: ``nccl``)."""
        if spec != "auto":
            return spec
        if same_node:
            return ("cuda_ipc" if sees_reader_gpu else "nccl") if cuda else "shm"
        return "nccl" if cuda else "gloo"

    def _setup(self, transport: str | TapTransport, device: torch.device | None, node: str | None) -> None:
        given = None if isinstance(transport, str) else transport
        if given is None and transport != "auto":
            make_transport(transport)  # an unknown name fails here, on every rank
        if not dist.is_initialized():
            if self.remote:
                raise ValueError("taps on other ranks need torch.distributed to be initialised")
            return
        info = ProcessInfo.local()
        my_node = str(node) if node is not None else info.boot_id
        cuda = device is not None and device.type == "cuda"
        sources = tuple(sorted({s.rank for s in self.remote}))
        # GPUs by UUID: the one this rank's taps live on, and every one it sees (cuda_ipc needs the
        # reader's among a source's)
        gpu = device_uuid(device) if cuda else None
        gpus = tuple(u for _, u in visible_gpus()) if cuda else ()
        # the same channel on every rank of the world: dedicated groups for every pipeline, in one order
        mine = (self.name, self.transport_name, self.layout.stage_ranks, self.layout.reader_rank, my_node, cuda,
                sources, gpu, gpus)
        everyone = _gather(mine)
        if any((e[0], e[1]) != (self.name, self.transport_name) for e in everyone):
            raise TapSpecMismatchError(f"ranks disagree on the channel: {sorted(set((e[0], e[1]) for e in everyone))}")
        node_of = {r: e[4] for r, e in enumerate(everyone)}
        pipelines = sorted(set(tuple(e[2]) for e in everyone))
        flat = [r for p in pipelines for r in p]
        if len(flat) != len(set(flat)):
            raise ValueError(f"pipelines overlap: {pipelines}")
        group_timeout = timedelta(seconds=max(self.timeout_s * 4, 600.0))
        control, data, route = None, {}, {}
        for p in pipelines:
            reader = everyone[p[0]][3]
            _, _, _, _, reader_node, reader_cuda, srcs, reader_gpu, _ = everyone[reader]  # the reader's view
            names = {src: given.name if given is not None else
                     self.choose(self.transport_name, node_of[src] == reader_node, reader_cuda,
                                 reader_gpu in everyone[src][8]) for src in srcs}
            backends = sorted({b for b in (self._backend(n, given) for n in names.values()) if b})
            g = dist.new_group(list(p), backend="gloo", timeout=group_timeout)
            d = {b: dist.new_group(list(p), backend=b, timeout=group_timeout) for b in backends}
            if self.rank in p:
                control, data, route = g, d, names
        self._control_group = control
        self.nodes = {r: node_of[r] for r in self.layout.stage_ranks}
        # every rank of the pipeline must agree on the specs (writers' registration checks the slots)
        desc = (tuple((s.layer, s.width, dtype_code(s.dtype), s.rank) for s in self.specs), self.slots, self.max_tokens)
        gathered = _gather((desc, info), group=control)
        descs = [g[0] for g in gathered]
        if any(d != descs[self.layout.reader_stage] for d in descs):
            raise TapSpecMismatchError(f"ranks of pipeline {self.layout.stage_ranks} disagree on the taps "
                                       f"((layer, width, dtype, rank), slots, max_tokens): {descs}")
        liveness = Liveness({r: g[1] for r, g in zip(self.layout.stage_ranks, gathered)}, info)
        # one transport per name in use, set up in name order on every rank of the pipeline (collective)
        for name in sorted(set(route.values())):
            taps = [s for s in self.remote if route[s.rank] == name]
            tr = given if given is not None else make_transport(name)
            ctx = TransportContext(name=self.name, rank=self.rank, layout=self.layout, taps=taps, slots=self.slots,
                                   max_tokens=self.max_tokens, timeout_s=self.timeout_s, control_group=control,
                                   data_group=data.get(tr.data_backend) if tr.data_backend else None,
                                   liveness=liveness, device=device, nodes=dict(self.nodes))
            tr.setup(ctx)
            self.transports[name] = tr
            for t, s in enumerate(taps):
                self._route[s.layer] = (tr, t)
                self.routes[s.layer] = name

    @staticmethod
    def _backend(name: str, given: TapTransport | None) -> str | None:
        from cotrain.tapchannel.transports import TRANSPORTS

        return given.data_backend if given is not None else TRANSPORTS[name].data_backend

    # ----- steps ---------------------------------------------------------------------------------------
    def begin_step(self, num_microbatches: int) -> None:
        """Open the next training step of ``num_microbatches`` microbatches (every rank, same number)."""
        if num_microbatches <= 0:
            raise ValueError("num_microbatches must be positive")
        self._step_first, self._step_count = self._next_seq, num_microbatches
        self._next_seq += num_microbatches
        self.step += 1
        self._local.clear()
        self._read_seqs.clear()
        self.metrics.begin_step(self.step)
        for tr in self.transports.values():
            tr.begin_step(self._step_first, num_microbatches)

    def end_step(self) -> dict:
        """Close the step; on the reader, every microbatch must have been read and released."""
        if self._step_first is None:
            raise TapError("end_step without begin_step")
        if self.is_reader and self.specs:
            missing = [m for m in range(self._step_count) if self._step_first + m not in self._read_seqs]
            held = sorted(s - self._step_first for s in self._unreleased)
            if missing or held:
                raise TapError(f"step {self.step}: microbatches never read {missing}, read but not released {held}; "
                               "their slots would block the sources next step")
        for tr in self.transports.values():
            tr.end_step(time.monotonic() + self.timeout_s)
        self._step_first = None
        self._local.clear()
        return self.metrics.end_step()

    def _seq(self, microbatch: int) -> int:
        if self._step_first is None:
            raise TapError("call begin_step(num_microbatches) before writing or reading taps")
        if not 0 <= microbatch < self._step_count:
            raise TapError(f"microbatch {microbatch} is outside this step's 0..{self._step_count - 1}")
        return self._step_first + microbatch

    # ----- writers -------------------------------------------------------------------------------------
    @property
    def my_layers(self) -> list[int]:
        """Tap layers produced on this rank."""
        return [s.layer for s in self.specs if s.rank == self.rank]

    def register_writer(self, layer: int, width: int, dtype: torch.dtype) -> None:
        """Declare the writer of ``layer`` on this rank; shape/dtype mismatches with the reader's slots raise."""
        spec = self._by_layer.get(layer)
        if spec is None or spec.rank != self.rank:
            where = "not a tap" if spec is None else f"produced on rank {spec.rank}"
            raise TapSpecMismatchError(f"rank {self.rank} registers a writer for layer {layer}, which is {where}")
        probe = TapSpec(layer, width, dtype, spec.stage, spec.rank)
        if layer in self._remote_index:
            tr, t = self._route[layer]
            tr.register_writer(t, probe)
        elif (width, dtype) != (spec.width, spec.dtype):
            raise TapSpecMismatchError(f"writer for local tap layer {layer} registers width {width}, dtype {dtype}; "
                                       f"the spec says width {spec.width}, dtype {spec.dtype}")
        self._registered.add(layer)

    def write(self, layer: int, microbatch: int, tensor: torch.Tensor) -> None:
        """Publish the tap of ``layer`` for ``microbatch``: ``tensor`` is ``[num_tokens, width]``."""
        t0 = time.perf_counter()
        spec = self._by_layer.get(layer)
        x = tensor.detach()
        if layer not in self._registered:
            self.register_writer(layer, x.shape[-1] if x.dim() else 0, x.dtype)
        if x.dim() != 2 or x.shape[1] != spec.width or x.dtype != spec.dtype or x.shape[0] > self.max_tokens:
            raise TapSpecMismatchError(f"tap layer {layer}: got {tuple(x.shape)} {x.dtype}, the slot takes "
                                       f"[<= {self.max_tokens}, {spec.width}] {spec.dtype}")
        seq = self._seq(microbatch)
        if seq <= self._last_written.get(layer, -1):
            raise TapError(f"tap layer {layer}: microbatch {microbatch} written after a later one (writes go in order)")
        self._last_written[layer] = seq
        if layer in self._remote_index:
            tr, t = self._route[layer]
            waited = tr.write(t, seq, x, time.monotonic() + self.timeout_s)
            nbytes = spec.nbytes(x.shape[0])
        else:
            if (layer, seq) in self._local:
                raise TapError(f"local tap layer {layer} written twice for microbatch {microbatch}")
            self._local[(layer, seq)] = x  # by reference: read returns this very tensor
            waited, nbytes = 0.0, 0
        self.metrics.record_write(layer, nbytes, time.perf_counter() - t0, waited)

    # ----- reader --------------------------------------------------------------------------------------
    def read(self, microbatch: int, *, copy: bool = True, timeout_s: float | None = None) -> dict[int, torch.Tensor]:
        """The drafter's stage: ``{layer: [num_tokens, width]}`` for ``microbatch``, waiting for the stamps.

        ``copy=True`` copies remote taps out and releases their slots at once; ``copy=False`` returns
        views of the slots, valid until :meth:`release` (or use :meth:`reading`). Local taps are always
        the producing layer's own tensor.
        """
        if not self.is_reader:
            raise TapError(f"rank {self.rank} is not the reader (rank {self.layout.reader_rank})")
        seq = self._seq(microbatch)
        if seq in self._read_seqs:
            raise TapError(f"microbatch {microbatch} was already read this step")
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        wait_s = 0.0
        for spec in self.remote:  # first every remote stamp: a failed read leaves the local taps in place
            tr, t = self._route[spec.layer]
            wait_s += tr.wait(t, seq, deadline)
        for spec in self.specs:
            if spec.layer not in self._remote_index and (spec.layer, seq) not in self._local:
                raise TapError(f"local tap layer {spec.layer} for microbatch {microbatch} is not written yet: read "
                               "it after this stage's forward of that microbatch (e.g. in the loss function)")
        out: dict[int, torch.Tensor] = {}
        copy_s = 0.0
        nbytes = moved = 0
        views = []
        for spec in self.specs:
            if spec.layer in self._remote_index:
                tr, t = self._route[spec.layer]
                c0 = time.perf_counter()
                x = tr.read(t, seq, copy)
                if copy:
                    tr.release(t, seq)
                else:
                    views.append(spec.layer)
                copy_s += time.perf_counter() - c0
                moved += spec.nbytes(x.shape[0])
            else:
                x = self._local.pop((spec.layer, seq))
            out[spec.layer] = x
            nbytes += spec.nbytes(x.shape[0])
        if views:
            self._unreleased[seq] = views
        self._read_seqs.add(seq)
        self.metrics.record_read(seq, nbytes, moved, wait_s, copy_s)
        return out

    def release(self, microbatch: int) -> None:
        """Free the slots of a microbatch read with ``copy=False``."""
        seq = self._seq(microbatch)
        for layer in self._unreleased.pop(seq, []):
            tr, t = self._route[layer]
            tr.release(t, seq)

    @contextlib.contextmanager
    def reading(self, microbatch: int, timeout_s: float | None = None) -> Iterator[dict[int, torch.Tensor]]:
        """Zero-copy read: views of the slots, released when the block exits."""
        taps = self.read(microbatch, copy=False, timeout_s=timeout_s)
        try:
            yield taps
        finally:
            self.release(microbatch)

    # ----- misc ----------------------------------------------------------------------------------------
    def tap_bytes(self, num_tokens: int) -> int:
        """Payload of one microbatch of ``num_tokens`` tokens: tokens x sum of widths x element size."""
        return sum(s.nbytes(num_tokens) for s in self.specs)

    def close(self) -> None:
        transports, self.transports = list(self.transports.values()), {}
        for tr in transports:
            tr.close()
        self._local.clear()

    def __enter__(self) -> "TapChannel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
