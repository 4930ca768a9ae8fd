"""Placing the Megatron trainer on Ray: one actor per rank, driven SPMD from the GRPO driver.

:class:`TrainerGroup` is the driver's :class:`~cotrain.rl.interfaces.TrainingBackend`: it starts
``world_size = TP x PP x CP x DP`` actors, has them form one torch.distributed world (rendezvous at
actor 0's node address), calls every method on all ranks and returns the results of the ranks that
hold them. What a rank does lives in :mod:`cotrain.rl.trainer`; this module only places and calls.

Placement: without a ``placement`` (one node, not colocated) Ray schedules the actors where they
fit, as it always did (one GPU per rank on cuda). With a :class:`~cotrain.placement.ClusterPlacement`
(``cluster.num_nodes > 1`` or ``rollout.colocate``) rank ``r`` runs in bundle ``r`` of the run's
placement group with the resources the layout gives it (colocated: its share of the bundle's GPU,
the rest is the engine worker's), on the node the layout gives it, and every call watches the run's
nodes: a node that dies fails the call within about a second with a
:class:`~cotrain.placement.NodeDiedError` naming it and the ranks it held. ``node_ids`` is the Ray
node id of every rank, as reported by the ranks themselves. Start-up fails with the ranks Ray could
not place and the cluster's resources after ``start_timeout_s`` (never an endless wait).
"""

from __future__ import annotations

import ray
import torch

from cotrain.rl.batch import TrainBatch
from cotrain.rl.interfaces import PolicyLogprobs, TrainingBackend


@ray.remote
class TrainingWorker:
    """A Ray actor hosting one trainer rank (imports Megatron only inside the actor)."""

    def __init__(self, num_threads: int):
        torch.set_num_threads(num_threads)
        self.worker = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def visible_gpus(self) -> dict:
        """The GPU ids Ray gave this rank and what CUDA sees (``CUDA_VISIBLE_DEVICES``)."""
        import os

        return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()], "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def rendezvous_address(self) -> tuple[str, int]:
        from cotrain.distributed import find_free_port

        return ray.util.get_node_ip_address(), find_free_port()

    def setup(self, cfg, model_path: str, rank: int, world_size: int, addr: str, port: int,
              draft_init: str | None = None) -> dict:
        from cotrain.rl.trainer import MegatronPolicyWorker

        self.worker = MegatronPolicyWorker(cfg, model_path, rank, world_size, addr, port, draft_init)
        return self.worker.info()

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


class TrainerRankDiedError(RuntimeError):
    """A training rank's actor died; the step cannot complete."""


#: Which ranks answer each call that returns something (every rank takes part in every call; the
#: others return None) - the one place that says it, checked on every call:
#:   outputs       the last pipeline stage's TP-0, CP-0 rank of every DP rank (its rows / its parts)
#:   metrics       the first of them (DP rank 0): the reduced metrics of the whole batch
#:   rank0         global rank 0: the gathered policy / drafter, the weight-transport handle
#:   draft_holder  the rank whose drafter replica is exported (last stage, TP / CP / DP rank 0)
ANSWERS = {"logprobs": "outputs", "train_step": "metrics", "full_policy_state": "rank0",
           "full_draft_state": "rank0", "export": "rank0", "export_draft_dir": "draft_holder"}


class TrainerGroup(TrainingBackend):
    """``world_size`` :class:`TrainingWorker` actors behind one :class:`TrainingBackend`.

    ``draft_init``: directory of the co-trained drafter's initial weights (a drafter export), or
    None (from scratch); only used with ``draft.cotrain``.
    """

    def __init__(self, cfg, model_path: str, draft_init: str | None = None, placement=None,
                 start_timeout_s: float | None = None):
        from cotrain.placement import wait_placed

        self.cfg = cfg
        self.placement = placement
        n = cfg.world_size
        gpus = 1 if cfg.cluster.device == "cuda" else 0
        cpus = cfg.policy.cpus_per_worker
        self.dead: list[int] = []  # ranks whose actor died
        opts = [placement.trainer_options(r) if placement else {"num_cpus": cpus, "num_gpus": gpus} for r in range(n)]
        self.actors = [TrainingWorker.options(**o).remote(cpus) for o in opts]
        timeout = start_timeout_s or getattr(placement, "start_timeout_s", None) or 120.0
        wait_placed(self.actors, [f"training rank {r}" for r in range(n)], opts, timeout)
        self.node_ids: list[str] = self._wait([a.node_id.remote() for a in self.actors], "start-up")
        addr, port = ray.get(self.actors[0].rendezvous_address.remote())
        self.infos = self._wait([a.setup.remote(cfg, str(model_path), r, n, addr, port, draft_init)
                                 for r, a in enumerate(self.actors)], "setup")
        outputs = sorted((i["dp_rank"], i["rank"]) for i in self.infos if i["holds_outputs"])
        self.answering = {"outputs": [r for _, r in outputs], "metrics": [outputs[0][1]], "rank0": [0],
                          "draft_holder": [i["rank"] for i in self.infos if i.get("draft_holder")]}

    def _wait(self, refs: list, what: str) -> list:
        """Results of one call per rank, in rank order (:func:`cotrain.placement.wait_refs`: fails
        fast). A rank whose actor dies fails the call at once, naming the rank; with a placement, so
        does a dead node (naming it and its ranks), whether a rank reports it first or not."""
        from cotrain.placement import NodeDiedError, wait_refs

        def rank_failed(rank: int, e: Exception) -> None:
            if isinstance(e, ray.exceptions.RayActorError):
                self.dead.append(rank)
                raise TrainerRankDiedError(f"training rank {rank} died during {what}: {_cause(e)}") from None

        try:
            return wait_refs(refs, what, self.placement, on_error=rank_failed)
        except NodeDiedError as e:
            self.dead.extend(r for r in e.ranks if r not in self.dead)
            raise

    def _all(self, method: str, *args) -> list:
        """``method`` on every rank (a batch put in the object store once); every rank's result."""
        refs = [ray.put(a) if isinstance(a, TrainBatch) else a for a in args]
        return self._wait([actor.call.remote(method, *refs) for actor in self.actors], method)

    def _answers(self, method: str, *args) -> list:
        """``method`` on every rank; the results of the ranks :data:`ANSWERS` names (in their order),
        after checking that exactly those answered."""
        results = self._all(method, *args)
        ranks = self.answering[ANSWERS[method]]
        spoke = [r for r, x in enumerate(results) if x is not None]
        if spoke != sorted(ranks):
            raise RuntimeError(f"{method}: ranks {spoke} answered, but {ANSWERS[method]} is ranks {sorted(ranks)}")
        return [results[r] for r in ranks]

    def _answer(self, method: str, *args):
        answers = self._answers(method, *args)
        if len(answers) != 1:
            raise RuntimeError(f"{method}: {len(answers)} ranks answer ({ANSWERS[method]}), one was expected")
        return answers[0]

    def logprobs(self, batch: TrainBatch, draft_step: int | None = None, draft_updates: int = 1) -> PolicyLogprobs:
        """Policy (and reference) log-probs for the whole batch, [N, S] each, in batch order; with
        ``draft_step`` the co-trained drafter's step on the same forward (its metrics)."""
        parts = self._answers("logprobs", batch, draft_step, draft_updates)  # in DP-rank order
        lp = torch.zeros(len(batch), batch.seq_len)
        ref = torch.zeros(len(batch), batch.seq_len) if "ref_logprobs" in parts[0] else None
        for p in parts:  # each DP rank's rows (contiguous when padded, the packing plan's otherwise)
            lp[p["rows"]] = p["logprobs"]
            if ref is not None:
                ref[p["rows"]] = p["ref_logprobs"]
        return PolicyLogprobs(lp, ref, parts[0].get("draft_metrics"))

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self._answer("train_step", batch)

    def named_weights(self, kind: str = "policy") -> dict[str, torch.Tensor]:
        if kind not in ("policy", "draft"):
            raise ValueError(f"kind: {kind!r} (allowed: policy, draft)")
        return self._answer("full_policy_state" if kind == "policy" else "full_draft_state")

    def export(self, kind: str, version: int) -> dict:
        """Publish through ``rollout.weight_transport``; rank 0 holds the handle."""
        return self._answer("export", kind, version, self.cfg.rollout.weight_transport)

    def export_draft_dir(self, path: str) -> str:
        """Write the co-trained drafter's current weights as a vLLM drafter directory."""
        return self._answer("export_draft_dir", str(path))

    def connect(self, rollout) -> None:
        """The ``nccl`` weight transport: trainer rank 0 plus every engine worker of ``rollout`` (a
        :class:`~cotrain.rl.rollout.RolloutGroup`) in one dedicated broadcast group, both sides
        joining concurrently. ``cuda_ipc``: every rank learns the engines' GPU UUIDs (each export
        must cover them). Nothing to set up for the other transports."""
        if self.cfg.rollout.weight_transport == "cuda_ipc":
            self._all("connect_engine_gpus", list(getattr(rollout, "gpus", None) or []))
            return
        if self.cfg.rollout.weight_transport != "nccl":
            return
        addr, port = ray.get(self.actors[0].rendezvous_address.remote())
        world = 1 + rollout.num_engines * rollout.spec.tensor_parallel_size
        engine_refs = rollout.init_broadcast_group(addr, port, world)
        ray.get([self.actors[0].call.remote("connect_weight_broadcast", addr, port, world), *engine_refs])

    def release_export(self, handle: dict) -> None:
        self._all("release_export", handle)  # cuda_ipc: every rank on an engine GPU holds a copy

    def offload(self) -> None:
        """Every rank frees its device memory for colocated engines (``MegatronPolicyWorker.offload``)."""
        self._all("offload")

    def onload(self) -> None:
        """Every rank takes back what :meth:`offload` moved off the device."""
        self._all("onload")

    def save_checkpoint(self, directory: str) -> None:
        self._all("save_checkpoint", str(directory))

    def load_checkpoint(self, directory: str) -> None:
        self._all("load_checkpoint", str(directory))

    def shutdown(self) -> None:
        if self.placement is not None:  # the ranks of a dead node never answer
            for node in self.placement.dead_nodes(force=True):
                self.dead.extend(r for r in self.placement.layout.ranks_on(node) if r not in self.dead)
        from cotrain.placement import stop_actors

        # after a rank died the survivors may be stuck in a collective with it: none is waited for
        stop_actors(self.actors, skip=set(range(len(self.actors))) if self.dead else set())


def _cause(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else repr(e)
