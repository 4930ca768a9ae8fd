"""Placing the Megatron trainer on Ray: one actor per rank, driven SPMD from the GRPO driver.

:class:`TrainerGroup` is the driver's :class:`~cotrain.rl.interfaces.TrainingBackend`: it starts
``world_size = TP x PP x CP x DP`` actors, has them form one torch.distributed world (rendezvous at
actor 0's node address), calls every method on all ranks and returns the results of the ranks that
hold them. What a rank does lives in :mod:`cotrain.rl.trainer`; this module only places and calls.
"""

from __future__ import annotations

import ray
import torch

from cotrain.rl.batch import TrainBatch
from cotrain.rl.interfaces import TrainingBackend


@ray.remote
class TrainingWorker:
    """A Ray actor hosting one trainer rank (imports Megatron only inside the actor)."""

    def __init__(self, num_threads: int):
        torch.set_num_threads(num_threads)
        self.worker = None

    def rendezvous_address(self) -> tuple[str, int]:
        from cotrain.distributed import find_free_port

        return ray.util.get_node_ip_address(), find_free_port()

    def setup(self, cfg, model_path: str, rank: int, world_size: int, addr: str, port: int) -> dict:
        from cotrain.rl.trainer import MegatronPolicyWorker

        self.worker = MegatronPolicyWorker(cfg, model_path, rank, world_size, addr, port)
        return self.worker.info()

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)


class TrainerGroup(TrainingBackend):
    def __init__(self, cfg, model_path: str):
        self.cfg = cfg
        n = cfg.world_size
        gpus = 1 if cfg.cluster.device == "cuda" else 0
        cpus = cfg.policy.cpus_per_worker
        self.actors = [TrainingWorker.options(num_cpus=cpus, num_gpus=gpus).remote(cpus) for _ in range(n)]
        addr, port = ray.get(self.actors[0].rendezvous_address.remote())
        self.infos = ray.get([a.setup.remote(cfg, str(model_path), r, n, addr, port) for r, a in enumerate(self.actors)])

    def _all(self, method: str, *args) -> list:
        refs = [ray.put(a) if isinstance(a, TrainBatch) else a for a in args]
        return ray.get([actor.call.remote(method, *refs) for actor in self.actors])

    def logprobs(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Policy (and reference) log-probs for the whole batch, [N, S] each, in batch order."""
        parts = sorted((r for r in self._all("logprobs", batch) if r is not None), key=lambda r: r["dp_rank"])
        lp = torch.cat([p["logprobs"] for p in parts])
        ref = torch.cat([p["ref_logprobs"] for p in parts]) if "ref_logprobs" in parts[0] else None
        return lp, ref

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        (metrics,) = [m for m in self._all("train_step", batch) if m is not None]
        return metrics

    def named_weights(self, kind: str = "policy") -> dict[str, torch.Tensor]:
        if kind != "policy":
            raise ValueError(f"kind: {kind!r} is not held by the policy trainer (allowed: policy)")
        (state,) = [s for s in self._all("full_policy_state") if s is not None]
        return state

    def export_policy(self, version: int, transport: str) -> dict:
        (handle,) = [h for h in self._all("export_policy", version, transport) if h is not None]
        return handle

    def connect_weight_broadcast(self, rollout) -> None:
        """Set up the ``nccl`` weight transport: trainer rank 0 plus every engine worker in one
        dedicated group; both sides must join concurrently."""
        addr, port = ray.get(self.actors[0].rendezvous_address.remote())
        world = 1 + rollout.num_engines * rollout.spec.tensor_parallel_size
        engine_refs = rollout.init_broadcast_group(addr, port, world)
        ray.get([self.actors[0].call.remote("connect_weight_broadcast", addr, port, world), *engine_refs])

    def release_export(self, handle: dict) -> None:
        ray.get(self.actors[0].call.remote("release_export", handle))

    def save_checkpoint(self, directory: str) -> None:
        self._all("save_checkpoint", str(directory))

    def load_checkpoint(self, directory: str) -> None:
        self._all("load_checkpoint", str(directory))

    def shutdown(self) -> None:
        try:
            self._all("shutdown")
        finally:
            for a in self.actors:
                ray.kill(a)
