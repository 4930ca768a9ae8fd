"""``cuda_ipc``: trainer and engines share the GPUs; every engine worker maps the pushed tensors
from a copy on its own GPU.

vLLM's IPC worker engine (``IPCWeightTransferEngine.receive_weights``, unpacked mode) takes, per
tensor, a dict ``{physical GPU UUID: rebuild_cuda_tensor args}`` and opens the entry for the UUID
of the GPU it runs on (``torch.cuda.get_device_properties(index).uuid``), overwriting the args'
device index with its own: a CUDA IPC handle opens only on the GPU that holds the memory, so the
handle set must hold one copy on every GPU an engine worker uses.

Where the copies come from (choice (c) of the three): trainer rank 0 assembles the full state (the
TP / PP gather it already does), then sends it over the trainer's default process group (NCCL
point-to-point) to one trainer rank on each other engine GPU; each of those ranks exports handles
for its own copy, and rank 0 merges them. Chosen because under Ray every trainer actor sees only
its own GPU (rank 0 cannot copy to GPUs it does not see, choice (b)), and because it reuses rank
0's gather instead of running it again on every exporting rank (choice (a)). Memory: rank 0's
gathered state (as before; its tensors may alias the parameters) plus one full copy of the pushed
tensors, in their pushed dtype, on every other engine GPU, held from ``send`` until ``release``;
the copies move over NVLink / PCIe once per push.

Handle: ``{"transport": "cuda_ipc", "version", "manifest", "seq", "gpus": [UUID...],
"update_info": {names, dtype_names, shapes, ipc_handles_pickled}}`` (the IPC args travel pickled:
vLLM's msgpack channel to a multi-process engine core refuses them; cotrain's backend unpickles
them, :func:`restore_update_info`). A GPU an engine reported that no trainer rank sits on is an
error naming its UUID before anything is sent (:func:`ipc_exporters`).
"""

from __future__ import annotations

import base64
import pickle
from typing import Any, Callable, Sequence

import torch

from cotrain.weights.checks import WeightPushError, dtype_from_name, flat_tensors, manifest_of
from cotrain.weights.interfaces import WeightTransport


# ------------------------------------------------------------------------ the handle set (pure)
def ipc_exporters(rank_gpus: Sequence[str], engine_gpus: Sequence[str] | None) -> dict[str, int]:
    """``{GPU UUID: trainer rank that exports there}`` for every engine worker GPU.

    ``rank_gpus[r]``: the UUID of trainer rank ``r``'s GPU. The exporter of a GPU is rank 0 if it is
    rank 0's, else the lowest rank on it. ``engine_gpus`` None (engines that reported no GPUs, e.g.
    a lone engine in a test): rank 0's GPU only. A UUID no trainer rank sits on is an error naming
    it (CUDA IPC opens only on the GPU that holds the memory).
    """
    if not rank_gpus:
        raise ValueError("rank_gpus is empty (allowed: one UUID per trainer rank)")
    wanted = list(dict.fromkeys(engine_gpus)) if engine_gpus else [rank_gpus[0]]
    first: dict[str, int] = {}
    for r, u in enumerate(rank_gpus):
        first.setdefault(u, r)
    missing = [u for u in wanted if u not in first]
    if missing:
        raise WeightPushError(f"cuda_ipc: engine GPU(s) {', '.join(missing)} host(s) no trainer rank (the trainer "
                              f"ranks are on {', '.join(first)}); a CUDA IPC handle opens only on the GPU that holds "
                              "the memory (colocate every engine worker with a trainer rank, or use "
                              "rollout.weight_transport=nccl)")
    return {u: first[u] for u in wanted}


def merge_handle_sets(parts: Sequence[list[dict] | None], num_tensors: int) -> list[dict]:
    """Per tensor, the union of every exporter's ``{UUID: args}`` (``parts[r]``: rank ``r``'s list,
    one dict per tensor, or None for a rank that did not export)."""
    merged: list[dict] = [{} for _ in range(num_tensors)]
    for r, part in enumerate(parts):
        if part is None:
            continue
        if len(part) != num_tensors:
            raise WeightPushError(f"cuda_ipc: rank {r} exported {len(part)} handles for {num_tensors} tensors")
        for i, h in enumerate(part):
            twice = set(h) & set(merged[i])
            if twice:
                raise WeightPushError(f"cuda_ipc: GPU {sorted(twice)[0]} exported twice (rank {r} and another)")
            merged[i].update(h)
    return merged


def check_coverage(handles: list[dict], gpus: Sequence[str]) -> None:
    """Every tensor has a handle on every GPU in ``gpus``; else an error naming the UUIDs missing."""
    missing = sorted({u for h in handles for u in gpus if u not in h})
    if missing:
        raise WeightPushError(f"cuda_ipc handle set lacks GPU(s) {', '.join(missing)}: an engine worker there "
                              "could not open the push")


def pickle_ipc_handles(info: dict) -> dict:
    """``ipc_handles`` -> ``ipc_handles_pickled`` (base64 of a pickle), as vLLM's HTTP client does."""
    out = {k: v for k, v in info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(info["ipc_handles"])).decode("ascii")
    return out


def restore_update_info(info: dict) -> dict:
    """The payload vLLM's IPC worker engine parses: ``ipc_handles_pickled`` unpickled. vLLM's worker
    unpickles it only under the process-wide ``VLLM_ALLOW_INSECURE_SERIALIZATION``; cotrain's
    backend does it here instead, for the run's own trainer's handles."""
    if "ipc_handles_pickled" not in info:
        return dict(info)
    out = {k: v for k, v in info.items() if k != "ipc_handles_pickled"}
    out["ipc_handles"] = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
    return out


# -------------------------------------------------------------------------------- the sender
def _reduce(t: torch.Tensor) -> tuple:
    """torch's CUDA IPC export of one tensor: ``rebuild_cuda_tensor``'s arguments."""
    from torch.multiprocessing.reductions import reduce_tensor

    return tuple(reduce_tensor(t)[1])


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class CudaIpcTransport(WeightTransport):
    """The sender. :meth:`send`: one process (this GPU's handles). :meth:`send_collective`: every
    rank of the trainer's default process group calls it, the tensors on rank 0; the handle comes
    back on rank 0 (None elsewhere). :meth:`release` on every rank that holds a copy (every rank
    may call it). ``engine_gpus``: the UUIDs of every engine worker's GPU (``RolloutGroup.gpus``).
    ``share`` / ``uuid`` stand in for torch's export and the GPU's UUID (CPU tests only)."""

    name = "cuda_ipc"

    def __init__(self, device: torch.device | str | None = None, *, engine_gpus: Sequence[str] | None = None,
                 share: Callable[[torch.Tensor], Any] | None = None, uuid: str | None = None) -> None:
        if device is None:
            if not torch.cuda.is_available():
                raise RuntimeError("cuda_ipc transport needs CUDA (allowed without a GPU: shm)")
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        self.engine_gpus = list(engine_gpus) if engine_gpus else None
        self._share = share or _reduce
        self.uuid = uuid if uuid is not None else gpu_uuid(self.device)
        self._held: dict[int, dict[str, torch.Tensor]] = {}  # seq -> the copies the engines map
        self._seq = 0
        self._rank_gpus: list[str] | None = None

    def plan(self) -> dict[str, int]:
        """``{engine GPU UUID: exporting rank}`` (:func:`ipc_exporters`); the first call gathers every
        rank's GPU over the default group (every rank calls it). An engine GPU no trainer rank sits
        on raises, naming it, on every rank alike."""
        import torch.distributed as dist

        if self._rank_gpus is None:
            if dist.is_initialized() and dist.get_world_size() > 1:
                gpus: list = [None] * dist.get_world_size()
                dist.all_gather_object(gpus, self.uuid)
                self._rank_gpus = gpus
            else:
                self._rank_gpus = [self.uuid]
        return ipc_exporters(self._rank_gpus, self.engine_gpus)

    def _stage(self, named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # the drafter's tensors reach rank 0 from the last pipeline stage (possibly on the CPU)
        return {n: t.to(self.device).contiguous() for n, t in flat_tensors(named_tensors).items()}

    def _handle(self, manifest: list, handles: list[dict], version: int) -> dict:
        info = {"names": [r[0] for r in manifest], "dtype_names": [r[2] for r in manifest],
                "shapes": [list(r[1]) for r in manifest], "ipc_handles": handles}
        return {"transport": self.name, "version": int(version), "manifest": manifest, "seq": self._seq,
                "gpus": sorted({u for h in handles for u in h}), "update_info": pickle_ipc_handles(info)}

    def _export(self, tensors: dict[str, torch.Tensor]) -> list[dict]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the engines read them from their own streams
        self._held[self._seq] = tensors
        return [{self.uuid: self._share(t)} for t in tensors.values()]

    def send(self, named_tensors: dict[str, torch.Tensor], version: int) -> dict:
        ipc_exporters([self.uuid], self.engine_gpus)  # every engine GPU must be this one
        self._seq += 1
        tensors = self._stage(named_tensors)
        return self._handle(manifest_of(tensors), self._export(tensors), version)

    def send_collective(self, named_tensors: dict[str, torch.Tensor] | None, version: int) -> dict | None:
        """Every trainer rank calls this (collectives over the default group); rank 0 gives the
        tensors. Steps: the exporters (:meth:`plan`) -> the manifest (broadcast) -> a full copy from
        rank 0 to each other exporter (send / recv) -> each exporter's handles (gather) -> rank 0
        merges them and checks that every engine GPU is covered."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.send(named_tensors, version)
        rank, world = dist.get_rank(), dist.get_world_size()
        cuda = self.device.type == "cuda"
        plan = self.plan()
        exporters = sorted(set(plan.values()))
        self._seq += 1
        tensors, box, error = None, [None], None
        if rank == 0:
            try:
                tensors = self._stage(named_tensors)
                box = [manifest_of(tensors)]
            except Exception as e:  # told to every rank, so that none waits in the collectives below
                error, box = e, [f"rank 0 could not stage the cuda_ipc push: {type(e).__name__}: {e}"]
        dist.broadcast_object_list(box, src=0, device=self.device if cuda else None)
        if isinstance(box[0], str):
            raise error if error is not None else WeightPushError(box[0])
        manifest = box[0]
        if rank == 0:
            for r in exporters:
                if r != 0:
                    for t in tensors.values():
                        dist.send(t, dst=r)
        elif rank in exporters:
            tensors = {n: torch.empty(s, dtype=dtype_from_name(d), device=self.device) for n, s, d in manifest}
            for t in tensors.values():
                dist.recv(t, src=0)
        part = self._export(tensors) if rank in exporters else None
        parts: list | None = [None] * world if rank == 0 else None
        dist.gather_object(part, parts, dst=0)
        if rank != 0:
            return None
        handles = merge_handle_sets(parts, len(manifest))
        check_coverage(handles, list(plan))
        return self._handle(manifest, handles, version)

    def receive(self, handle: dict) -> dict[str, torch.Tensor]:
        raise WeightPushError("cuda_ipc handles are received by vLLM's 'ipc' engine inside the rollout workers "
                              "(cotrain.weights.vllm_receiver), not by a cotrain transport")

    def release(self, handle: dict) -> None:
        """Drop this rank's copy of the push (idempotent; every rank may call it)."""
        seq = handle.get("seq") if isinstance(handle, dict) else None
        if self._held.pop(seq, None) is not None and self.device.type == "cuda":
            torch.cuda.ipc_collect()  # frees the blocks once the engines have closed their mappings

    def held(self) -> int:
        """How many pushes this rank still holds a copy of."""
        return len(self._held)


__all__ = ["CudaIpcTransport", "ipc_exporters", "merge_handle_sets", "check_coverage", "restore_update_info",
           "pickle_ipc_handles", "gpu_uuid"]
