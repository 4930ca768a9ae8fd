"""Where every trainer rank and rollout engine runs: the node layout, and its Ray placement group.

Two layers:

* :func:`node_layout` (pure, no Ray): from a resolved config, the node of every trainer rank and
  every engine, or the issues that make the layout impossible. Validation (``check_placement``),
  the planner (``python -m cotrain.plan``) and the run all use it, so they agree.
* :class:`ClusterPlacement` (Ray): picks ``cluster.num_nodes`` alive nodes, reserves every rank's
  and engine's bundle on its node in **one** placement group (atomically: all or nothing), hands
  out the scheduling options of each actor, and tells a dead node (:meth:`~ClusterPlacement.check`)
  within about a second, naming the ranks and engines it held (:class:`NodeDiedError`).

The rules (docs/multinode.md):

- Nodes ``0 .. num_nodes - engine_nodes - 1`` run trainer ranks; with ``cluster.engine_nodes = n > 0``
  the last ``n`` nodes run engines only, with ``0`` the engines share the trainers' nodes.
- Trainer ranks are numbered as Megatron's parallel_state does (TP fastest, then CP, DP, PP) and
  go to the trainer nodes in contiguous blocks of whole TP x CP groups, spread evenly: a TP or CP
  group never straddles two nodes, and the pipeline (then DP) crosses nodes. A node holds
  ``min(cpus_per_node // cpus_per_worker, gpus_per_node on cuda)`` ranks; a TP x CP group larger than
  that is refused, naming the group that would straddle.
- Engines go to their nodes in contiguous blocks, spread evenly; an engine's GPUs are on one node.
- Colocated engines (``rollout.colocate``, cuda) share the trainers' GPU bundles, the way NeMo-RL
  and verl colocate (one bundle = one GPU, shared by fractional Ray requests, so Ray gives both
  actors of a bundle the same physical GPU in CUDA_VISIBLE_DEVICES). See :func:`colocated_plan`.
- The co-trained drafter lives on the last pipeline stage's ranks (wherever those are).
- Nodes are taken from the Ray cluster in this order: the driver's node first (when it has the
  resources), then by address and node id.
"""

from __future__ import annotations

import math
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

Issue = tuple[str, str]

#: Ray's GPU share of one colocated engine worker on its GPU (the trainer rank there takes the rest).
#: Ray does not police memory: the shares only have to add up to the bundle's one GPU, so that both
#: actors get that GPU and nothing else is scheduled onto it; memory is split by vLLM's
#: ``rollout.gpu_memory_utilization`` (the engine's part of the device), the trainer has the rest.
#: Half and half, as NeMo-RL and verl do for two colocated worker groups (1 / max_colocate_count).
COLOCATED_ENGINE_GPU_SHARE = 0.5


# ------------------------------------------------------------------------------------- the layout
@dataclass(frozen=True)
class NodeLayout:
    """The node index of every trainer rank (Megatron order) and engine, and what each node reserves."""

    num_nodes: int
    trainer_nodes: int  # nodes 0 .. trainer_nodes - 1 may hold trainer ranks
    engine_nodes: int  # the last engine_nodes nodes run engines only (0: engines share the trainers' nodes)
    rank_node: tuple[int, ...]
    engine_node: tuple[int, ...]
    ranks_per_node: int
    rank_bundle: dict = field(default_factory=dict)  # Ray resources of one trainer rank
    engine_bundle: dict = field(default_factory=dict)  # ... of one engine (empty when colocated)
    colocate: bool = False
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    # colocated (cuda) only: worker i of engine e runs on the GPU of trainer rank engine_bundles[e][i]
    engine_bundles: tuple[tuple[int, ...], ...] = ()
    engine_gpu_share: float = 0.0  # Ray GPUs of one colocated engine worker (the rank there: 1 - this)
    engine_cpus: float = 0.0  # Ray CPUs of one colocated engine actor
    gpu_memory_utilization: float | None = None  # the engines' part of each shared GPU's memory

    @property
    def world_size(self) -> int:
        return len(self.rank_node)

    def stage_of(self, rank: int) -> int:
        return rank // (self.tp * self.cp * self.dp)

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.rank_node) if n == node]

    def engines_on(self, node: int) -> list[int]:
        return [e for e, n in enumerate(self.engine_node) if n == node]

    @property
    def shared(self) -> bool:
        """Colocated on GPUs: engines inside the trainers' bundles (:func:`colocated_plan`)."""
        return bool(self.engine_bundles)

    def leader_of(self, rank: int) -> int | None:
        """The colocated engine whose actor sits in ``rank``'s bundle (its first GPU), or None."""
        return next((e for e, b in enumerate(self.engine_bundles) if b[0] == rank), None)

    def bundles(self) -> list[tuple[dict, int]]:
        """``(resources, node)`` of every bundle of the run's placement group, in order: one per
        trainer rank (bundle ``r`` = rank ``r``), then one per engine unless colocated. A shared
        bundle holding an engine's actor has ``max(cpus_per_worker, cpus_per_engine)`` CPUs: the
        rank and the engine take turns on its CPUs as on its GPU (split like the GPU in Ray's books)."""
        out = []
        for r, n in enumerate(self.rank_node):
            b = dict(self.rank_bundle)
            if self.shared and self.leader_of(r) is not None:
                b["CPU"] = max(b["CPU"], self.engine_cpus)
            out.append((b, n))
        if not self.colocate:
            out += [(dict(self.engine_bundle), n) for n in self.engine_node]
        return out

    def node_demand(self, node: int) -> dict[str, float]:
        """Resources the placement group reserves on ``node``."""
        out: dict[str, float] = {}
        for b, n in self.bundles():
            if n == node:
                for k, v in b.items():
                    out[k] = out.get(k, 0.0) + v
        return out

    def trainer_resources(self, rank: int) -> dict[str, float]:
        """``num_cpus`` / ``num_gpus`` of rank ``rank``'s actor: its bundle, less a colocated engine's share."""
        b = self.bundles()[rank][0]
        gpus, cpus = b.get("GPU", 0.0), b["CPU"]
        if self.shared:
            share = self.engine_gpu_share
            gpus = 1.0 - share
            if self.leader_of(rank) is not None:
                cpus = cpus * (1.0 - share)
        return {"num_cpus": cpus, "num_gpus": gpus}

    def engine_resources(self, engine: int) -> dict[str, float]:
        """``num_cpus`` / ``num_gpus`` of engine ``engine``'s actor. Colocated at TP = 1 the actor is
        the engine's one worker (the GPU share of its bundle); at TP > 1 it takes no GPU and vLLM's
        Ray executor starts the TP workers in the engine's bundles (:meth:`engine_env`)."""
        if not self.shared:
            return {"num_cpus": self.engine_bundle.get("CPU", 0.0), "num_gpus": self.engine_bundle.get("GPU", 0.0)}
        lead = self.bundles()[self.engine_bundles[engine][0]][0]
        share = self.engine_gpu_share
        return {"num_cpus": lead["CPU"] * share, "num_gpus": share if len(self.engine_bundles[engine]) == 1 else 0.0}

    def engine_env(self, engine: int) -> dict[str, str]:
        """Environment of a colocated TP > 1 engine's actor: vLLM's Ray executor
        (``RayDistributedExecutor._init_workers_ray``) starts worker ``i`` in bundle
        ``VLLM_RAY_BUNDLE_INDICES[i]`` of the actor's own placement group
        (``ray.util.get_current_placement_group()``, which ``EngineArgs`` hands to the engine core)
        with ``num_gpus = VLLM_RAY_PER_WORKER_GPUS``: the engine's share of each trainer rank's GPU.
        Empty otherwise."""
        if not self.shared or len(self.engine_bundles[engine]) == 1:
            return {}
        return {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, self.engine_bundles[engine])),
                "VLLM_RAY_PER_WORKER_GPUS": repr(self.engine_gpu_share)}

    def describe_gpus(self) -> str:
        """Colocated: who shares which bundle (GPU), with Ray's shares and the memory split."""
        if not self.shared:
            return ""
        u = self.gpu_memory_utilization
        mem = (f"memory: engine {u:g} of the device (rollout.gpu_memory_utilization), trainer the rest"
               if u is not None else "memory: engine by rollout.kv_cache_memory_bytes, trainer the rest")
        lines = []
        for r, n in enumerate(self.rank_node):
            tr = self.trainer_resources(r)
            what = [f"trainer rank {r} ({tr['num_gpus']:g} GPU, {tr['num_cpus']:g} CPU)"]
            for e, bs in enumerate(self.engine_bundles):
                if r in bs:
                    i = bs.index(r)
                    who = "actor + worker" if len(bs) == 1 else ("actor, worker" if i == 0 else "worker")
                    what.append(f"engine {e} {who} {i} ({self.engine_gpu_share:g} GPU"
                                + (f", {self.engine_resources(e)['num_cpus']:g} CPU" if i == 0 else "") + ")")
            lines.append(f"bundle {r} (node {n}, one GPU): " + " + ".join(what))
        return "\n".join(lines + [mem])

    def describe(self, labels: list[str] | None = None) -> str:
        lines = []
        for n in range(self.num_nodes):
            ranks, engines = self.ranks_on(n), self.engines_on(n)
            stages = sorted({self.stage_of(r) for r in ranks})
            what = []
            if ranks:
                what.append(f"trainer ranks {_span(ranks)} (stage{'s' if len(stages) > 1 else ''} {_span(stages)})")
            if engines:
                what.append(f"engine{'s' if len(engines) > 1 else ''} {_span(engines)}")
            name = labels[n] if labels else f"node {n}"
            lines.append(f"{name}: {', '.join(what) or 'nothing'}")
        return "\n".join(lines)


def _span(xs: list[int]) -> str:
    if not xs:
        return "[]"
    if xs == list(range(xs[0], xs[-1] + 1)) and len(xs) > 2:
        return f"{xs[0]}-{xs[-1]}"
    return ", ".join(map(str, xs))


def _bundle(cpus: float, gpus: float) -> dict:
    b = {"CPU": float(cpus)}
    if gpus:
        b["GPU"] = float(gpus)
    return b


def _capacity(node: dict, bundle: dict) -> int:
    caps = [math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if v > 0]
    return min(caps) if caps else 1 << 30


def layout_issues(cfg, *, cpus_per_node: float | None = None, gpus_per_node: float | None = None,
                  num_nodes: int | None = None, device: str | None = None,
                  gpus_per_engine: float | None = None) -> tuple[NodeLayout | None, list[Issue]]:
    """:func:`node_layout`, returning ``(layout, [])`` or ``(None, issues)``. The keyword arguments
    replace the config's cluster numbers (the planner sizes hypothetical GPU nodes)."""
    c, r, pol = cfg.cluster, cfg.rollout, cfg.policy
    p = pol.parallel
    tp, cp, dp, pp = p.tensor, p.context, p.data, p.pipeline
    W, E = tp * cp * dp * pp, r.num_engines
    N = int(num_nodes if num_nodes is not None else c.num_nodes)
    En = int(c.engine_nodes)
    cuda = (device or c.device) == "cuda"
    C = float(cpus_per_node if cpus_per_node is not None else (c.cpus_per_node or 1))
    G = float(gpus_per_node if gpus_per_node is not None else c.gpus_per_node)
    node = {"CPU": C, "GPU": G}
    rank_b = _bundle(pol.cpus_per_worker, 1 if cuda else 0)
    gpe = gpus_per_engine if gpus_per_engine is not None else (
        r.gpus_per_engine if r.gpus_per_engine is not None else (r.tensor_parallel if cuda else 0))
    engine_b = _bundle(r.cpus_per_engine, gpe if cuda else 0)
    issues: list[Issue] = []
    if En >= N:
        return None, [("cluster.engine_nodes", f"{En} leaves no node for the {W} trainer rank(s) of "
                       f"cluster.num_nodes={N} (allowed: 0..{N - 1})")]
    if r.colocate and En:
        return None, [("cluster.engine_nodes", f"{En} with rollout.colocate=true: colocated engines run on the "
                       "trainers' nodes (allowed: 0, or rollout.colocate=false)")]
    T = N - En
    cap = _capacity(node, rank_b)
    cpu_cap = int(C // pol.cpus_per_worker)
    why = (f"cluster.gpus_per_node={G:g}, one GPU per rank" if cuda and G < cpu_cap else
           f"cluster.cpus_per_node={C:g} / policy.cpus_per_worker={pol.cpus_per_worker}")
    m = tp * cp
    if m > cap:
        group, ranks = _straddling_group(tp, cp, cap)
        nodes = sorted({rk // cap for rk in ranks})
        issues.append(("policy.parallel", f"TP x CP = {tp} x {cp} = {m} ranks per group, a node holds {cap} trainer "
                       f"rank(s) ({why}): the {group} group of ranks {_span(ranks)} would straddle nodes "
                       f"{_span(nodes)} (TP and CP groups must stay inside a node; allowed: TP x CP <= {cap}, or "
                       "larger nodes)"))
        return None, issues
    groups = W // m
    per_node = math.ceil(groups / T)  # whole TP x CP groups per trainer node, spread evenly
    k = per_node * m
    if k > cap:
        fit = (cap // m) * m
        issues.append(("policy.parallel", f"world size {W} on {T} trainer node(s) needs {k} ranks per node in whole "
                       f"TP x CP groups of {m}; a node holds {cap} ({why}), i.e. {fit} in whole groups (allowed: "
                       f"world size <= {fit * T}, or more nodes: cluster.num_nodes / cluster.engine_nodes)"))
        return None, issues
    rank_node = tuple(rk // k for rk in range(W))
    engine_hosts = list(range(T, N)) if En else list(range(T))
    if not r.colocate and E:
        # an engine on a node with trainer ranks uses what they leave
        room = {n: _capacity({res: node[res] - rank_node.count(n) * rank_b.get(res, 0.0) for res in node}, engine_b)
                for n in engine_hosts}
        engine_node = _spread(E, engine_hosts, room)
        if engine_node is None:
            most = max((e for e in range(E) if _spread(e, engine_hosts, room) is not None), default=0)
            where = "engine-only nodes" if En else "trainer nodes (next to their ranks)"
            issues.append(("rollout.num_engines", f"{E} engines of {_fmt_b(engine_b)} spread evenly over the {where} "
                           f"{_span(engine_hosts)} do not fit: a node has {_fmt_b(node)}, room for "
                           f"{[room[n] for n in engine_hosts]} engine(s) (allowed: at most {most} engines, "
                           "cluster.engine_nodes > 0, or larger nodes)"))
            return None, issues
    shared: dict = {}
    if r.colocate and cuda:
        engine_node, bundles, issues = colocated_plan(rank_node, E, r.tensor_parallel, gpe, node["CPU"],
                                                      pol.cpus_per_worker, r.cpus_per_engine)
        if issues:
            return None, issues
        shared = dict(engine_bundles=bundles, engine_gpu_share=gpe / r.tensor_parallel,
                      engine_cpus=float(r.cpus_per_engine), gpu_memory_utilization=r.gpu_memory_utilization)
    elif r.colocate:  # refused on cpu by validation (vLLM's CPU backend has no sleep mode)
        hosts = sorted(set(rank_node))
        engine_node = _spread(E, hosts, {n: 1 << 30 for n in hosts}) or ()
    return NodeLayout(num_nodes=N, trainer_nodes=T, engine_nodes=En, rank_node=rank_node, engine_node=engine_node,
                      ranks_per_node=k, rank_bundle=rank_b, engine_bundle={} if r.colocate else engine_b,
                      colocate=bool(r.colocate), tp=tp, cp=cp, dp=dp, pp=pp, **shared), []


def colocated_plan(rank_node: tuple[int, ...], num_engines: int, tp: int, gpus_per_engine: float,
                   cpus_per_node: float, cpus_per_worker: float, cpus_per_engine: float
                   ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], list[Issue]]:
    """Where colocated engines run: ``(engine_node, engine_bundles, issues)``, a pure function of the
    trainer ranks' nodes and the rollout numbers.

    Every trainer rank's bundle is one GPU. Engines are spread evenly over the trainer nodes (as
    :func:`_spread` spreads them), and the ``j``-th engine of a node takes the GPUs of that node's
    ranks ``j*tp .. j*tp + tp - 1`` (in rank order): worker ``i`` of the engine on the bundle of
    its ``i``-th rank, the engine's actor in the first. On each such GPU the engine worker asks Ray
    for ``gpus_per_engine / tp`` of the GPU and the rank for the rest, so both are given that GPU.
    Refused (issues naming the keys and numbers): more engine workers than trainer GPUs, a share
    that is not strictly between 0 and 1, a node whose ranks cannot hold its engines' GPUs, or
    a node whose CPUs cannot hold its ranks and engine actors."""
    W, E = len(rank_node), num_engines
    share = gpus_per_engine / tp
    if not 0 < share < 1:
        return (), (), [("rollout.gpus_per_engine", f"{gpus_per_engine:g} GPUs over rollout.tensor_parallel={tp} "
                         f"workers is {share:g} of each GPU: a colocated engine worker shares its GPU with a trainer "
                         f"rank, whose share is 1 - {share:g} (allowed: 0 < gpus_per_engine < {tp}, default "
                         f"{COLOCATED_ENGINE_GPU_SHARE * tp:g}; or rollout.colocate=false)")]
    if E * tp > W:
        return (), (), [("rollout.num_engines", f"{E} colocated engines x rollout.tensor_parallel={tp} GPUs = {E * tp} "
                         f"exceed the {W} GPUs of the trainer ranks, which colocated engines share (allowed: at most "
                         f"{W // tp} engines, a smaller rollout.tensor_parallel, or rollout.colocate=false)")]
    hosts = sorted(set(rank_node))
    ranks = {n: [rk for rk, m in enumerate(rank_node) if m == n] for n in hosts}
    room = {n: len(ranks[n]) // tp for n in hosts}
    engine_node = _spread(E, hosts, room)
    if engine_node is None:
        most = max((e for e in range(E + 1) if _spread(e, hosts, room) is not None), default=0)
        return (), (), [("rollout.num_engines", f"{E} colocated engines of rollout.tensor_parallel={tp} GPUs spread "
                         f"evenly over the trainer nodes {_span(hosts)} do not fit: an engine's GPUs are on one node, "
                         f"and the nodes hold {[len(ranks[n]) for n in hosts]} trainer GPU(s), room for "
                         f"{[room[n] for n in hosts]} engine(s) (allowed: at most {most} engines)")]
    bundles, taken = [], {n: 0 for n in hosts}
    for n in engine_node:
        j = taken[n]
        bundles.append(tuple(ranks[n][j * tp:(j + 1) * tp]))
        taken[n] += 1
    for n in hosts:
        leaders = taken[n]
        need = (len(ranks[n]) - leaders) * cpus_per_worker + leaders * max(cpus_per_worker, cpus_per_engine)
        if need > cpus_per_node + 1e-9:
            return (), (), [("rollout.cpus_per_engine", f"node {n} holds {len(ranks[n])} trainer rank(s) of "
                             f"policy.cpus_per_worker={cpus_per_worker:g} CPUs and {leaders} colocated engine(s) of "
                             f"rollout.cpus_per_engine={cpus_per_engine:g} CPUs (a rank and the engine whose actor shares "
                             f"its GPU take turns on max of the two): {need:g} CPUs exceed "
                             f"cluster.cpus_per_node={cpus_per_node:g} (allowed: fewer CPUs per engine or worker, or "
                             "larger nodes)")]
    return tuple(engine_node), tuple(bundles), []


def _straddling_group(tp: int, cp: int, cap: int) -> tuple[str, list[int]]:
    """The first TP group (else CP group) that crosses a node boundary when ranks fill nodes of ``cap``
    ranks in Megatron's order (TP fastest, then CP): ``("TP" | "CP", its ranks)``."""
    for g in range(cp):  # TP groups of the first TP x CP block: ranks g*tp .. g*tp + tp - 1
        ranks = list(range(g * tp, (g + 1) * tp))
        if len({rk // cap for rk in ranks}) > 1:
            return "TP", ranks
    for i in range(tp):  # CP groups of the first block: i, i + tp, ..., i + (cp - 1) tp
        ranks = [i + j * tp for j in range(cp)]
        if len({rk // cap for rk in ranks}) > 1:
            return "CP", ranks
    return "TP x CP", list(range(tp * cp))  # pragma: no cover - tp * cp > cap always splits one of them


def _spread(count: int, hosts: list[int], room: dict[int, int]) -> tuple[int, ...] | None:
    """``count`` items over ``hosts`` (those with room) in contiguous blocks of equal size, or None."""
    usable = [n for n in hosts if room[n] > 0]
    if count == 0:
        return ()
    if not usable:
        return None
    per = math.ceil(count / len(usable))
    out = tuple(usable[i // per] for i in range(count))
    return out if all(out.count(n) <= room[n] for n in usable) else None


def _fmt_b(b: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in b.items()) + "}"


def node_layout(cfg, **kwargs) -> NodeLayout:
    """The node layout of a validated config (raises ValueError with the issues otherwise)."""
    layout, issues = layout_issues(cfg, **kwargs)
    if layout is None:
        raise ValueError("; ".join(f"{k}: {m}" for k, m in issues))
    return layout


# ------------------------------------------------------------------------------------- on Ray
class NodeDiedError(RuntimeError):
    """A node of the run died (its raylet is gone); names the node and the ranks and engines it held."""

    def __init__(self, message: str, node: int, node_id: str, ranks: list[int], engines: list[int]):
        super().__init__(message)
        self.node, self.node_id, self.ranks, self.engines = node, node_id, ranks, engines
        self.step: int | None = None

    def during_step(self, step: int) -> "NodeDiedError":
        """The same error, its message starting with the GRPO step it failed."""
        if self.step is not None:
            return self
        e = NodeDiedError(f"step {step}: {self}", self.node, self.node_id, self.ranks, self.engines)
        e.step = step
        return e


def current_node_id() -> str | None:
    """This process's Ray node id (hex), or None outside Ray."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - no Ray, or not connected
        return None


def _node_label_key() -> str:
    try:
        from ray._raylet import NODE_ID_LABEL_KEY  # noqa: F401 - present in some builds

        return NODE_ID_LABEL_KEY
    except Exception:  # noqa: BLE001
        return "ray.io/node-id"


class ClusterPlacement:
    """One placement group reserving every trainer rank's and engine's bundle on its node (colocated:
    the ranks' GPU bundles only, which the engines share: :func:`colocated_plan`).

    ``ClusterPlacement(cfg)`` (needs a connected Ray): picks the nodes, creates the group and waits
    until it is reserved (``timeout_s``; the actors' start-up waits as long: ``start_timeout_s``).
    ``trainer_options(rank)`` / ``engine_options(e)`` are the ``.options(...)`` of each actor (its
    resources and bundle), ``engine_env(e)`` what a colocated TP > 1 engine's actor tells vLLM;
    ``check(what)`` raises :class:`NodeDiedError` once a node of the run is gone; ``remove()`` frees
    the reservation.
    """

    PROBE_EVERY_S = 1.0

    def __init__(self, cfg, layout: NodeLayout | None = None, *, timeout_s: float = 300.0):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        self.layout = layout or node_layout(cfg)
        self.nodes = self._pick_nodes(ray.nodes())
        self.node_ids = [n["NodeID"] for n in self.nodes]
        self.addresses = [(n["NodeManagerAddress"], int(n["NodeManagerPort"])) for n in self.nodes]
        L = self.layout
        key = _node_label_key()
        bundles = [b for b, _ in L.bundles()]
        selectors = [{key: self.node_ids[n]} for _, n in L.bundles()]
        self.pg = placement_group(bundles, strategy="PACK", name=f"cotrain-{cfg.run.name}",
                                  bundle_label_selector=selectors)
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - GetTimeoutError, or the group was refused
            remove_placement_group(self.pg)
            self.pg = None
            raise RuntimeError(f"could not reserve the run's placement group within {timeout_s:g} s ({type(e).__name__}): "
                               f"{len(bundles)} bundles {[_fmt_b(b) for b in bundles]} on {self.describe()}; the "
                               f"cluster has {cluster_resources()} - are the nodes' resources taken by another "
                               "job?") from None
        self.start_timeout_s = timeout_s
        self._dead: dict[int, str] = {}
        self._last_probe = 0.0

    # -- nodes
    def _pick_nodes(self, nodes: list[dict]) -> list[dict]:
        me = current_node_id()
        # Ray's Alive flag lags a raylet's death by its health checks (~15 s by default): a node whose
        # raylet refuses connections is not taken either (e.g. --resume right after a node died)
        alive = [n for n in nodes if n.get("Alive")
                 and _raylet_down(n["NodeManagerAddress"], int(n["NodeManagerPort"])) is None]
        alive.sort(key=lambda n: (n["NodeID"] != me, n.get("NodeManagerAddress", ""), n["NodeID"]))
        L, chosen = self.layout, []
        for i in range(L.num_nodes):
            need = L.node_demand(i)
            pick = next((n for n in alive if n not in chosen and all(n.get("Resources", {}).get(k, 0.0) >= v - 1e-9
                                                                     for k, v in need.items())), None)
            if pick is None:
                have = ", ".join(f"{n['NodeID'][:8]} {_fmt_b({k: v for k, v in n.get('Resources', {}).items() if k in ('CPU', 'GPU')})}"
                                 for n in alive) or "none"
                raise RuntimeError(f"cluster.num_nodes={L.num_nodes}: no alive Ray node left with {_fmt_b(need)} for node "
                                   f"{i} of the layout (alive nodes: {have}); start more nodes (ray start --address=...) "
                                   "or lower cluster.num_nodes")
            chosen.append(pick)
        return chosen

    def label(self, node: int) -> str:
        addr, _ = self.addresses[node]
        return f"node {node} ({self.node_ids[node][:12]}, {addr})"

    def describe(self) -> str:
        text = self.layout.describe([self.label(n) for n in range(len(self.node_ids))] if hasattr(self, "node_ids")
                                    else None)
        gpus = self.layout.describe_gpus()
        return text + ("\n" + gpus if gpus else "")

    # -- actors
    def _strategy(self, bundle: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=False)}

    def trainer_options(self, rank: int) -> dict:
        """``.options(...)`` of rank ``rank``'s actor: its resources, in its bundle."""
        return {**self.layout.trainer_resources(rank), **self._strategy(rank)}

    def engine_options(self, engine: int) -> dict:
        """``.options(...)`` of engine ``engine``'s actor: its resources, in its bundle (colocated: the
        bundle of its first trainer GPU; :meth:`NodeLayout.engine_env` places its other workers)."""
        L = self.layout
        if L.colocate and not L.shared:
            raise ValueError("rollout.colocate needs cluster.device=cuda")  # validation refuses it first
        bundle = L.engine_bundles[engine][0] if L.shared else L.world_size + engine
        return {**L.engine_resources(engine), **self._strategy(bundle)}

    def engine_env(self, engine: int) -> dict[str, str]:
        return self.layout.engine_env(engine)

    def node_of_rank(self, rank: int) -> str:
        return self.node_ids[self.layout.rank_node[rank]]

    def node_of_engine(self, engine: int) -> str:
        return self.node_ids[self.layout.engine_node[engine]]

    # -- liveness
    def dead_nodes(self, force: bool = False) -> dict[int, str]:
        """``{node: reason}`` of the run's nodes found dead (looked at most once per second unless ``force``).

        Two views, either is enough. Ray's own (``ray.nodes()``: ``Alive`` false, set by the GCS once
        the node unregisters or misses its health checks - a raylet killed with SIGKILL shows as alive
        for about 15 s with Ray's defaults, measured on a ray.cluster_utils.Cluster; the state API
        needs the dashboard), and a TCP connect to the node's raylet (NodeManagerPort): refused at once
        when the raylet process is gone, and after 2 s without an answer (retried once) when the
        machine is unreachable. The worker processes of a node outlive its raylet by a few seconds
        (their calls may even complete), so an alive actor does not prove an alive node."""
        now = time.monotonic()
        if self._dead or (not force and now - self._last_probe < self.PROBE_EVERY_S):
            return dict(self._dead)
        self._last_probe = now
        for n in range(len(self.node_ids)):  # the raylets first: a GCS that is gone too would make Ray's view slow
            reason = _raylet_down(*self.addresses[n])
            if reason:
                self._dead[n] = reason
        if not self._dead:
            gone = _gcs_dead(self.node_ids)
            self._dead.update({n: gone[i] for n, i in enumerate(self.node_ids) if i in gone})
        return dict(self._dead)

    def error(self, node: int, what: str) -> NodeDiedError:
        L = self.layout
        ranks, engines = L.ranks_on(node), L.engines_on(node)
        held = []
        if ranks:
            stages = sorted({L.stage_of(r) for r in ranks})
            held.append(f"training rank{'s' if len(ranks) > 1 else ''} {ranks} (pipeline stage"
                        f"{'s' if len(stages) > 1 else ''} {stages})")
        if engines:
            held.append(f"rollout engine{'s' if len(engines) > 1 else ''} {engines}")
        msg = (f"{self.label(node)} died during {what}: {self._dead.get(node, 'unreachable')}; "
               f"{' and '.join(held) or 'nothing of this run'} {'were' if len(held) > 1 or len(ranks) + len(engines) > 1 else 'was'} "
               "on it. The step cannot complete: resume from the last checkpoint (--resume) once the node is back "
               "or replaced")
        return NodeDiedError(msg, node, self.node_ids[node], ranks, engines)

    def check(self, what: str, force: bool = False) -> None:
        """Raise :class:`NodeDiedError` if a node of the run is dead."""
        dead = self.dead_nodes(force=force)
        if dead:
            raise self.error(min(dead), what)

    def check_after_failure(self, what: str, grace_s: float = 3.0) -> None:
        """After an actor call failed: give a dying node ``grace_s`` to show as dead, then
        :meth:`check` (returns if every node is alive: the failure was something else)."""
        deadline = time.monotonic() + grace_s
        while True:
            self.check(what, force=True)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.3)

    def remove(self) -> None:
        if getattr(self, "pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - Ray already gone
                pass
            self.pg = None


def _raylet_down(addr: str, port: int, timeout_s: float = 2.0) -> str | None:
    """Why the raylet at ``addr:port`` is down (connection refused, or no answer within ``timeout_s``
    twice), or None if it accepts a connection."""
    reason = None
    for attempt in range(2):
        try:
            with socket.create_connection((addr, port), timeout=timeout_s):
                return None
        except OSError as e:
            reason = f"its raylet at {addr}:{port} does not answer ({type(e).__name__})"
            if attempt == 0:
                time.sleep(0.2)
    return reason


def _gcs_dead(node_ids: list[str]) -> dict[str, str]:
    """``{node_id: reason}`` of the given nodes that Ray's GCS reports dead (not alive, or unknown)."""
    try:
        import ray

        known = {n["NodeID"]: n for n in ray.nodes()}
    except Exception:  # noqa: BLE001 - the GCS itself unreachable: the raylet probe decides
        return {}
    out = {}
    for node_id in node_ids:
        n = known.get(node_id)
        if n is None:
            out[node_id] = "Ray no longer knows the node"
        elif not n.get("Alive"):
            why = n.get("DeathReasonMessage") or n.get("DeathReason") or "no reason given"
            out[node_id] = f"Ray reports it dead ({why})"
    return out


def cluster_resources() -> str:
    """The Ray cluster's CPUs and GPUs, available of total (for messages)."""
    try:
        import ray

        total, free = ray.cluster_resources(), ray.available_resources()
        return ", ".join(f"{k} {free.get(k, 0.0):g} free of {total[k]:g}" for k in ("CPU", "GPU") if k in total) or "none"
    except Exception as e:  # noqa: BLE001 - not connected
        return f"unknown ({type(e).__name__})"


def _actor_started(actor) -> bool | None:
    """Whether Ray has started ``actor``'s process (its resources were granted): the GCS actor
    table gives a worker ``Pid`` once the actor is placed, while its ``__init__`` may still run
    (the state stays PENDING_CREATION for both). None when the table cannot be read."""
    try:
        from ray._private import state

        return int(state.actors(actor._actor_id.hex()).get("Pid") or 0) > 0
    except Exception:  # noqa: BLE001 - a Ray without this table: do not guess
        return None


def wait_placed(actors: list, what: list[str], resources: list[dict], timeout_s: float = 120.0,
                poll_s: float = 0.5) -> None:
    """Return once Ray has placed every actor (started its process), or raise a RuntimeError after
    ``timeout_s`` naming the actors it could not place, what each asked for, and the cluster's
    resources - instead of a ``ray.get`` that waits forever for resources that never come.
    ``what[i]`` / ``resources[i]``: a name and the ``.options`` resources of ``actors[i]``."""
    deadline = time.monotonic() + timeout_s
    pending = list(range(len(actors)))
    while pending:
        pending = [i for i in pending if _actor_started(actors[i]) is False]
        if not pending:
            return
        if time.monotonic() >= deadline:
            asked = "; ".join(f"{what[i]} asks {_fmt_b({k: v for k, v in resources[i].items() if isinstance(v, (int, float))})}"
                              for i in pending)
            raise RuntimeError(f"Ray could not place {len(pending)} of {len(actors)} actors within {timeout_s:g} s: "
                               f"{asked}; the cluster has {cluster_resources()} (another job holding them, or a "
                               "cluster smaller than cluster.* says?)")
        time.sleep(poll_s)


def wait_refs(refs: list, what: str, placement: ClusterPlacement | None, poll_s: float = 1.0,
              settle: bool = False, on_error: Callable[[int, Exception], None] | None = None) -> list[Any]:
    """``ray.get(refs)`` that fails fast: the first call to fail raises as soon as it ends, whatever
    the others are doing (a survivor may be blocked in a collective with a dead rank: it is not
    waited for). With a placement, a dead node of the run raises :class:`NodeDiedError` within about
    ``poll_s`` (instead of whenever Ray notices), and so does a failed call whose cause is a dead
    node. ``on_error(i, exc)``: called with the index of the failed call before its error is raised
    (after the node check), to name what failed (it may raise an error of its own).
    ``settle``: wait for every call to finish, then return each one's result or the exception it
    raised (for calls that must all end before a failure is reported: a weight push); a dead node
    still raises."""
    import ray

    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    timeout = poll_s if placement is not None else None
    while pending and not settle:
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:
                if placement is not None:
                    placement.check_after_failure(what)
                if on_error is not None:
                    on_error(index[ref], e)
                raise
        if not done and placement is not None:
            placement.check(what)
    if not settle:
        return ray.get(refs)
    while pending and placement is not None:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
        if pending:
            placement.check(what)
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except Exception as e:  # noqa: BLE001 - returned to the caller, who reports it
            out.append(e)
    if placement is not None and any(isinstance(x, Exception) for x in out):
        placement.check_after_failure(what)
    return out


def stop_actors(actors: list, skip: set[int] = frozenset(), timeout_s: float = 60.0) -> None:
    """Ask every actor to ``shutdown()`` at once (SPMD ranks tear down together), wait at most
    ``timeout_s`` for all, then kill every one; ``skip``: the indices of actors that will never
    answer (on a dead node, or blocked in a collective with a dead rank), killed without asking.
    Errors are swallowed: the point is that nothing is left behind."""
    import ray

    refs = []
    for i, a in enumerate(actors):
        if i not in skip:
            try:
                refs.append(a.shutdown.remote())
            except Exception:  # noqa: BLE001 - already gone
                pass
    if refs:
        try:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - dead or hung: killed below either way
            pass
    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001 - its node is gone
            pass


__all__ = ["NodeLayout", "layout_issues", "node_layout", "colocated_plan", "ClusterPlacement", "NodeDiedError",
           "wait_refs", "wait_placed", "stop_actors", "current_node_id", "COLOCATED_ENGINE_GPU_SHARE"]
