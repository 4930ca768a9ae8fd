"""``nccl``: a broadcast group of trainer rank 0 (rank 0 here) and every engine worker (ranks 1..).

vLLM's NCCL engines move the bytes: ``NCCLTrainerWeightTransferEngine`` here (its own
``StatelessProcessGroup`` + ``PyNcclCommunicator``, never the default group; packed
double-buffered broadcast), ``NCCLWeightTransferEngine`` in the engine workers, which join through
``RolloutGroup.init_broadcast_group`` while :meth:`NcclBroadcastTransport.connect` runs (both block
until the group is complete). ``send`` stages the tensors on this process's GPU, starts vLLM's
``send_weights`` in a background thread with a :class:`_Handoff` client and returns as soon as
vLLM has built the update payload: ``{"transport", "version", "manifest", "id", "seq",
"update_info"}``. The engines receive inside ``update_weights``; ``release`` waits for the
broadcast to finish and reports its errors. Pushes reach the engines in ``seq`` order, one at a
time (``send`` refuses while another is unreleased). On a rejected push the engines still receive
the bytes and drop them (the receiver's ``drain``), so the group stays in step. One sender carries
both kinds (``policy`` and ``draft``). vLLM is imported only when a sender starts.
"""

from __future__ import annotations

import queue
import threading
import uuid

import torch

from cotrain.weights.checks import WeightPushError, flat_tensors, update_info_manifest
from cotrain.weights.interfaces import WeightTransport


def nccl_wire(packed: bool = True, buffer_bytes: int | None = None, num_buffers: int | None = None) -> dict:
    """The wire parameters both ends must agree on (vLLM's names; defaults: vLLM's packed
    broadcast, 1 GiB x 2 buffers)."""
    from vllm.distributed.weight_transfer.packed_tensor import (
        DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        DEFAULT_PACKED_NUM_BUFFERS,
    )

    return {"packed": bool(packed),
            "packed_buffer_size_bytes": int(buffer_bytes or DEFAULT_PACKED_BUFFER_SIZE_BYTES),
            "packed_num_buffers": int(num_buffers or DEFAULT_PACKED_NUM_BUFFERS)}


def _dict_source(tensors: dict[str, torch.Tensor]):
    """A vLLM ``WeightSource`` over a ready ``{name: tensor}`` (rank 0 holds the whole state)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class DictSource(WeightSource):
        def metadata(self) -> list:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]

        def __iter__(self):
            return iter(list(tensors.items()))

    return DictSource()


class _Handoff:
    """The ``VLLMWeightSyncClient`` vLLM's trainer engine drives, from the background thread: the
    driver, not the trainer, talks to the engines, so this client hands vLLM's update payload back
    to :meth:`NcclBroadcastTransport.send`, which puts it in the handle."""

    def __init__(self) -> None:
        self.payloads: queue.Queue = queue.Queue()
        self.worker_init: dict | None = None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.worker_init = dict(init_info)  # the engines join through RolloutGroup.init_broadcast_group

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info) -> None:
        self.payloads.put(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


class NcclBroadcastTransport(WeightTransport):
    name = "nccl"

    def __init__(self, master_addr: str, master_port: int, rank: int = 0, world_size: int = 2, *,
                 wire: dict | None = None, device: torch.device | str | None = None, timeout_s: float = 600) -> None:
        if rank != 0:
            raise ValueError(f"rank={rank}: cotrain's side of the nccl group is the sender, rank 0 (the engines' "
                             "workers join through RolloutGroup.init_broadcast_group, as vLLM's NCCL engine)")
        if world_size < 2:
            raise ValueError(f"world_size={world_size} (allowed: >= 2: the sender plus every engine worker)")
        if device is None:
            if not torch.cuda.is_available():
                raise RuntimeError("nccl transport needs CUDA (allowed without a GPU: shm)")
            device = torch.device("cuda", torch.cuda.current_device())
        # (an explicit CPU device only makes sense with a stand-in engine: the unit tests)
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.master_addr, self.master_port, self.world_size = master_addr, int(master_port), int(world_size)
        self.wire = dict(wire) if wire is not None else nccl_wire()
        self._engine = None
        self._pending: dict[str, tuple[threading.Thread, list]] = {}
        self._seq = 0

    def connect(self) -> None:  # pragma: no cover - GPU
        """Open the group (blocks until every engine worker has joined)."""
        if self._engine is not None:
            return
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        torch.cuda.set_device(self.device)
        info = NCCLTrainerInitInfo(master_address=self.master_addr, master_port=self.master_port,
                                   world_size=self.world_size, rank=0, **self.wire)
        self._engine = WeightTransferTrainerFactory.trainer_init(info, client=_Handoff(), source=_dict_source({}))

    def send(self, named_tensors: dict[str, torch.Tensor], version: int) -> dict:
        if self._pending:
            raise RuntimeError(f"{self.name}: push {sorted(self._pending)} is not released yet (release each "
                               "handle once the engines have loaded it, before the next send)")
        tensors = {n: t.to(self.device).contiguous() for n, t in flat_tensors(named_tensors).items()}
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)  # vLLM's producers read them from their own streams
        if self._engine is None:
            raise RuntimeError("NcclBroadcastTransport.connect() was not called (TrainerGroup.connect sets the "
                               "group up with the engines)")
        engine, client, errors = self._engine, _Handoff(), []

        def run() -> None:
            try:
                if cuda:
                    torch.cuda.set_device(self.device)
                engine.client, engine.source = client, _dict_source(tensors)
                engine.send_weights()
            except BaseException as e:  # reported by send (before the payload) or release
                errors.append(e)
                client.payloads.put(e)

        self._seq += 1
        hid = f"{self._seq}-{uuid.uuid4().hex[:8]}"
        th = threading.Thread(target=run, name=f"cotrain-{self.name}-{self._seq}", daemon=True)
        th.start()
        try:
            payload = client.payloads.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: vLLM's trainer engine built no update payload within "
                               f"{self.timeout_s:g} s") from None
        if isinstance(payload, BaseException):
            th.join(self.timeout_s)
            raise payload
        if isinstance(payload, list):  # a chunked payload: cotrain forwards one update per push
            raise RuntimeError(f"{self.name}: vLLM sent a chunked update ({len(payload)} parts); cotrain pushes "
                               "one update per handle")
        self._pending[hid] = (th, errors)
        info = dict(payload)
        return {"transport": self.name, "version": int(version), "manifest": update_info_manifest(info),
                "id": hid, "seq": self._seq, "update_info": info}

    def receive(self, handle: dict) -> dict[str, torch.Tensor]:
        raise WeightPushError("nccl handles are received by vLLM's 'nccl' engine inside the rollout workers "
                              "(cotrain.weights.vllm_receiver), not by a cotrain transport")

    def release(self, handle: dict) -> None:
        entry = self._pending.pop(handle.get("id") if isinstance(handle, dict) else None, None)
        if entry is None:
            return
        th, errors = entry
        th.join(self.timeout_s)
        if th.is_alive():
            self._pending[handle["id"]] = entry  # still in flight: the next send must not start
            raise TimeoutError(f"{self.name} push {handle.get('seq')} (version {handle.get('version')}) did not "
                               f"finish within {self.timeout_s:g} s (did every engine receive it?)")
        if errors:
            raise errors[0]

    def close(self) -> None:
        for hid in list(self._pending):
            try:
                self.release({"id": hid})
            except Exception:
                pass
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
