"""Rollout workers: vLLM engines that sample GRPO responses and take pushed weights.

Three layers, each a :class:`~cotrain.rl.interfaces.GenerationBackend` or a part of one:

* :class:`EngineSpec` - a picklable description of one engine (what ``RolloutConfig`` says);
* :class:`VllmGeneration` - one engine in this process: ``generate(prompts, sampling, n)`` ->
  token ids, the sampler's log-probabilities, text, finish reason, weight version and, with
  speculative decoding, per-request acceptance statistics; weight pushes by tensors or handles;
* :class:`RolloutWorker` (a :class:`VllmGeneration` as the body of a Ray actor, one engine each)
  and :class:`RolloutGroup` (E actors: splits prompts across them in contiguous chunks, gathers
  results in prompt order, broadcasts weight pushes). ``RolloutGroup.from_config(cfg)`` reads the
  ``rollout`` section.

A weight push is ``push(kind, handle, version)`` at every level: ``RolloutGroup.push`` (driver
process) -> ``RolloutWorker.push`` (the engine's actor: :func:`cotrain.rl.vllm.client.push`) ->
``update_weights`` in vLLM's workers, whose ``cotrain`` backend checks the handle, once, and loads
it (:mod:`cotrain.rl.vllm.transfer_backend`). ``push_weights(kind, tensors, version)`` sends
tensors through the level's transport and pushes the handle.

Reproducibility: with ``SamplingSpec.seed = s``, prompt ``i`` of a batch (its index in the whole
batch, not within an engine's chunk) is sampled with seed ``s + i * n`` and its ``j``-th sample
with ``s + i * n + j`` (vLLM's per-child offset), so results do not depend on how many engines
share the batch.

Weight versions: the engine's label is the version of the last *policy* push (``"default"``
before any push reads as ``initial_version``); drafter pushes are counted separately
(``draft_version``) and never relabel the engine.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from cotrain.rl.interfaces import GenerationBackend, GenerationResult, Sample, SamplingSpec, WeightKind
from cotrain.weights import WeightPushError, WeightTransport, make_transport, push_through, resolve_transport_name
from cotrain.weights.transports.object_store import localize_handle

Prompt = str | list[int]
SPEC_SCALARS = ("mean_acceptance_length", "draft_acceptance_rate", "num_spec_steps", "num_accepted_draft_tokens",
                "num_draft_tokens", "num_spec_tokens")


@dataclass
class EngineSpec:
    """Everything needed to build one engine (picklable: it travels to Ray actors).

    ``sleep_mode``: vLLM's sleep mode (GPU only), for engines that share the trainers' devices
    (``rollout.colocate``). ``speculative`` is vLLM's ``speculative_config`` (see
    :func:`cotrain.rl.vllm.engine.speculative_config`); ``multiprocess`` chooses vLLM's
    multi-process mode (None: ``COTRAIN_VLLM_MULTIPROCESS``, default on); ``extra`` goes to
    ``LLM(...)`` unchanged.
    """

    model_path: str
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int = 256
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool | None = None
    tensor_parallel_size: int = 1
    sleep_mode: bool = False
    speculative: dict | None = None
    multiprocess: bool | None = None
    max_logprobs: int = 20
    extra: dict = field(default_factory=dict)

    def build(self):
        from cotrain.rl.vllm.engine import make_cotrain_llm

        extra = dict(self.extra)
        if self.tensor_parallel_size != 1:
            extra["tensor_parallel_size"] = self.tensor_parallel_size
        if self.sleep_mode:
            extra["enable_sleep_mode"] = True
        return make_cotrain_llm(
            self.model_path, multiprocess=self.multiprocess, dtype=self.dtype, seed=self.seed,
            max_model_len=self.max_model_len, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization, enforce_eager=self.enforce_eager,
            max_logprobs=self.max_logprobs, speculative_config=self.speculative, **extra)


def _parse_version(label: str | None, default: int) -> int:
    try:
        return int(label)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default  # "default": nothing pushed yet


def sampling_params(sampling: SamplingSpec, n: int, seed: int | None = None):
    """vLLM ``SamplingParams`` for ``n`` samples with the sampled tokens' log-probabilities."""
    from vllm import SamplingParams

    if n < 1:
        raise ValueError(f"n={n} (allowed: >= 1)")
    if sampling.top_k != -1 and sampling.top_k < 1:
        raise ValueError(f"top_k={sampling.top_k} (allowed: -1 = off, or >= 1)")
    return SamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=0 if sampling.top_k == -1 else sampling.top_k, max_tokens=sampling.max_tokens,
                          seed=seed, logprobs=0, ignore_eos=sampling.ignore_eos)


def _aggregate(samples: list[list[Sample]], seconds: float) -> dict[str, float]:
    flat = [s for group in samples for s in group]
    tokens = sum(len(s.token_ids) for s in flat)
    m: dict[str, float] = {"num_samples": float(len(flat)), "num_tokens": float(tokens), "time_s": seconds,
                           "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                           "mean_response_len": tokens / len(flat) if flat else 0.0,
                           "stop_fraction": sum(s.finish_reason == "stop" for s in flat) / len(flat) if flat else 0.0}
    specs = [s.spec_decode for s in flat if s.spec_decode]
    if specs:
        steps = sum(d["num_spec_steps"] for d in specs)
        acc = sum(d["num_accepted_draft_tokens"] for d in specs)
        drafted = sum(d["num_draft_tokens"] for d in specs)
        # token-weighted over all verify steps, like vLLM's own counters
        m.update(mean_acceptance_length=1.0 + acc / steps if steps else 1.0,
                 draft_acceptance_rate=acc / drafted if drafted else 0.0, num_spec_steps=float(steps),
                 num_accepted_draft_tokens=float(acc), num_draft_tokens=float(drafted))
    return m


# --------------------------------------------------------------------------------- one engine
class VllmGeneration(GenerationBackend):
    """One vLLM engine in this process, with cotrain's extension (see :mod:`cotrain.rl.vllm`).

    ``VllmGeneration(EngineSpec(path))`` builds the engine; ``VllmGeneration(llm=...)`` wraps one
    built by :func:`cotrain.rl.vllm.engine.make_cotrain_llm`. ``transport`` carries
    :meth:`push_weights` (default: ``auto`` = shm on CPU, cuda_ipc on GPU). ``gpus``: the UUID of
    each of its workers' GPUs (empty on CPU).
    """

    def __init__(self, spec: EngineSpec | None = None, *, llm=None, initial_version: int = 0,
                 transport: WeightTransport | None = None) -> None:
        if (spec is None) == (llm is None):
            raise ValueError("give exactly one of spec (to build an engine) or llm (an engine made by make_cotrain_llm)")
        t0 = time.perf_counter()
        self.spec = spec
        self.llm = llm if llm is not None else spec.build()
        self.startup_s = time.perf_counter() - t0
        self.initial_version = int(initial_version)
        self.llm.update_weight_version(str(self.initial_version))
        self._transport = transport
        self.draft_version: int | None = None
        self.speculative = bool(self.llm.llm_engine.vllm_config.speculative_config)
        self.gpus: list[str] | None = None
        self.relayed_pushes = 0  # object_store pushes whose bytes came from another node

    # -- generation
    def generate(self, prompts: Sequence[Prompt], sampling: SamplingSpec, n: int = 1,
                 prompt_offset: int = 0) -> GenerationResult:
        """``n`` samples per prompt; ``prompt_offset`` = index of ``prompts[0]`` in the whole batch
        (sets ``Sample.prompt_index`` and the per-prompt seeds)."""
        from vllm.inputs import TokensPrompt

        prompts = list(prompts)
        if not prompts:
            return GenerationResult(samples=[], metrics=_aggregate([], 0.0))
        # vLLM refuses n > 1 at temperature 0: ask for n identical single-sample requests instead
        copies = n if sampling.temperature == 0 and n > 1 else 1
        per_request = n // copies
        inputs, params = [], []
        for i, p in enumerate(prompts):
            seed = None if sampling.seed is None else int(sampling.seed) + (prompt_offset + i) * n
            inp = TokensPrompt(prompt_token_ids=list(p)) if not isinstance(p, str) else p
            for _ in range(copies):
                inputs.append(inp)
                params.append(sampling_params(sampling, per_request, seed))
        t0 = time.perf_counter()
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        current = self.weight_version()
        samples = []
        for i in range(len(prompts)):
            group = outs[i * copies:(i + 1) * copies]
            samples.append([self._sample(prompt_offset + i, out, c, current) for out in group for c in out.outputs])
        return GenerationResult(samples=samples, metrics=_aggregate(samples, seconds))

    def _sample(self, index: int, out, c, current: int) -> Sample:
        lps = []
        for tok, row in zip(c.token_ids, c.logprobs or []):
            lps.append(float(row[tok].logprob) if row and tok in row else float("nan"))
        if len(lps) != len(c.token_ids):
            raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(c.token_ids)} tokens (prompt {index})")
        spans = getattr(c, "weight_versions", None) or []
        # the version that sampled the first token: the oldest weights behind this response
        version = _parse_version(spans[0].version, self.initial_version) if spans else current
        spec = None
        m = getattr(c, "spec_decode_metrics", None)
        if m is not None:
            d = m.to_dict()
            spec = {k: float(d[k]) for k in SPEC_SCALARS if k in d}
            if "acceptance_histogram" in d:
                spec["acceptance_histogram"] = [int(x) for x in d["acceptance_histogram"]]
        return Sample(prompt_index=index, prompt_token_ids=list(out.prompt_token_ids), token_ids=list(c.token_ids),
                      logprobs=lps, text=c.text, finish_reason=str(c.finish_reason), weight_version=version,
                      spec_decode=spec, draft_version=self.draft_version if spec is not None else None)

    # -- weights
    def weight_version(self) -> int:
        return _parse_version(self.llm.get_weight_version(), self.initial_version)

    @property
    def transport(self) -> WeightTransport:
        if self._transport is None:
            self._transport = make_transport("auto")
        return self._transport

    def push_weights(self, kind: WeightKind, named_tensors: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        """Send through :attr:`transport` and :meth:`push`; raises :class:`WeightPushError` (engine unchanged)."""
        return push_through(self.transport, named_tensors, version, lambda h: self.push(kind, h, version))

    def push(self, kind: WeightKind, handle: dict, version: int | None = None) -> dict[str, Any]:
        """Load a handle a trainer's :class:`WeightTransport` made (the sender releases it)."""
        from cotrain.rl.vllm.client import push

        version = int(handle.get("version", 0) if version is None else version)
        # object_store: bytes from another node land in a /dev/shm file of this one (vLLM reads shm)
        local, cleanup = localize_handle(handle)
        try:
            stats = push(self.llm, kind, local, version)
        finally:
            cleanup()
        if local.get("relayed"):
            self.relayed_pushes += 1
        if kind == "draft":
            self.draft_version = version
        return stats

    def gpu_uuids(self) -> list[str]:
        """The UUID of every worker's GPU (empty on CPU): the GPUs a ``cuda_ipc`` push must reach."""
        if self.gpus is None:
            from cotrain.rl.vllm.client import gpu_uuids

            self.gpus = gpu_uuids(self.llm)
        return self.gpus

    def sleep(self) -> None:
        """vLLM's sleep mode, level 1: the weights move to host memory, the KV cache is freed."""
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def init_broadcast_group(self, options: dict) -> None:
        """Join a trainer's broadcast group (``nccl`` transport): ``options`` are the fields of
        vLLM's ``NCCLWeightTransferInitInfo`` (see :meth:`RolloutGroup.init_broadcast_group`)."""
        self.llm.init_weight_transfer_engine({"init_info": {"transport": "nccl", "options": dict(options)}})

    def status(self) -> dict[str, Any]:
        from cotrain.rl.vllm.client import engine_status

        st = engine_status(self.llm)
        st.update(weight_version=self.weight_version(), draft_version=self.draft_version, gpus=self.gpu_uuids(),
                  speculative=self.speculative, startup_s=self.startup_s, relayed_pushes=self.relayed_pushes)
        return st

    def shutdown(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
            del llm


# ------------------------------------------------------------------------------- Ray actors
class RolloutWorker(VllmGeneration):
    """The body of a rollout Ray actor: a :class:`VllmGeneration` whose process is set up first.

    Create it through :class:`RolloutGroup` (or ``ray.remote(RolloutWorker)``); ``env`` is set
    before the engine is built (e.g. ``COTRAIN_VLLM_MULTIPROCESS``).
    """

    def __init__(self, spec: EngineSpec, initial_version: int = 0, env: dict[str, str] | None = None) -> None:
        os.environ.update(env or {})
        if not torch.cuda.is_available():
            # one OpenMP thread per reserved CPU (Ray sets OMP_NUM_THREADS from num_cpus): more
            # threads than cores make OpenMP spin-waits starve vLLM's serial loop (13x slower)
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
            if os.environ.get("COTRAIN_VLLM_DYNAMO", "0") != "1":
                # enforce_eager already keeps the model out of torch.compile; this also skips
                # compiling vLLM's log-prob gather on the first request (3-10 s per engine on CPU)
                from torch import _dynamo

                _dynamo.config.disable = True
        super().__init__(spec, initial_version=initial_version)

    def ready(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
                "startup_s": self.startup_s, "torch_threads": torch.get_num_threads(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpu_uuids": self.gpu_uuids()}


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(start, stop)`` ranges covering ``range(count)``, sizes differing by <= 1."""
    base, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        out.append((start, stop))
        start = stop
    return out


class RolloutGroup(GenerationBackend):
    """``num_engines`` :class:`RolloutWorker` actors behind one :class:`GenerationBackend`.

    Needs a running Ray (``ray.init`` first). ``generate`` gives each engine a contiguous chunk
    of the prompts and returns samples in prompt order. ``push`` forwards a handle a trainer made
    to every engine at once (each engine's backend checks it before its model changes; all serve
    the same checkpoint, so they accept or refuse it alike); ``push_weights`` sends tensors once
    through ``transport`` (``shm`` by default on CPU: one file that every engine on the node
    reads) and pushes that handle. ``gpus``: the GPU UUIDs of every engine worker (empty on CPU),
    which a ``cuda_ipc`` handle set must cover.

    Placement: ``placement`` (a :class:`~cotrain.placement.ClusterPlacement`, several nodes) puts
    engine ``e`` in its bundle of the run's placement group, on the node the layout gives it, and
    makes every call fail within about a second with a
    :class:`~cotrain.placement.NodeDiedError` when a node of the run dies. Without it Ray places
    the engines as it always did. ``node_ids``: the Ray node id of every engine.
    """

    def __init__(self, spec: EngineSpec, num_engines: int = 1, *, cpus_per_engine: float = 1,
                 gpus_per_engine: float = 0, transport: str | WeightTransport = "auto", initial_version: int = 0,
                 env: dict[str, str] | None = None, actor_options: dict | None = None, placement=None) -> None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RolloutGroup needs Ray: call ray.init first (on one machine: "
                               "ray.init(address='local', num_cpus=..., include_dashboard=False))")
        if num_engines < 1:
            raise ValueError(f"num_engines={num_engines} (allowed: >= 1)")
        self.spec = spec
        self.num_engines = num_engines
        self._transport_choice = transport
        self._transport: WeightTransport | None = transport if isinstance(transport, WeightTransport) else None
        self.initial_version = int(initial_version)
        self.draft_version: int | None = None
        self.placement = placement
        from cotrain.placement import wait_placed

        opts = {"num_cpus": cpus_per_engine, "num_gpus": gpus_per_engine, **(actor_options or {})}
        # with a placement each engine's resources, bundle and (colocated TP > 1) vLLM's worker
        # placement come from the layout (cotrain.placement.NodeLayout.engine_resources / engine_env)
        per_engine = [{**opts, **(placement.engine_options(e) if placement else {})} for e in range(num_engines)]
        envs = [{**(env or {}), **(placement.engine_env(e) if placement is not None and hasattr(placement, "engine_env")
                                   else {})} for e in range(num_engines)]
        cls = ray.remote(RolloutWorker)
        t0 = time.perf_counter()
        self.actors = [cls.options(**o).remote(spec, initial_version, en) for o, en in zip(per_engine, envs)]
        wait_placed(self.actors, [f"rollout engine {e}" for e in range(num_engines)], per_engine,
                    getattr(placement, "start_timeout_s", None) or 120.0)
        self.ready_info = self._get([a.ready.remote() for a in self.actors], "engine start-up")
        self.node_ids: list[str | None] = [info.get("node_id") for info in self.ready_info]
        self.gpus: list[str] = [u for info in self.ready_info for u in info.get("gpu_uuids", [])]
        self.startup_s = time.perf_counter() - t0

    def _get(self, refs: list, what: str) -> list:
        """``ray.get``; with a placement, a dead node of the run fails it within about a second."""
        from cotrain.placement import wait_refs

        return wait_refs(refs, what, self.placement)

    @classmethod
    def from_config(cls, cfg, *, model_path: str | None = None, draft_model: str | None = None,
                    multiprocess: bool | None = None, env: dict[str, str] | None = None, **kwargs: Any) -> "RolloutGroup":
        """Engines as ``cfg.rollout`` (and ``policy.model_path``, ``policy.dtype``,
        ``policy.max_seq_len``, ``run.seed``) say. ``draft_model`` overrides
        ``rollout.speculative.draft_model`` (e.g. the co-trained drafter's initial export)."""
        spec = engine_spec_from_config(cfg, model_path=model_path, draft_model=draft_model, multiprocess=multiprocess)
        r = cfg.rollout
        gpus = r.gpus_per_engine if r.gpus_per_engine is not None else (0.0 if not torch.cuda.is_available()
                                                                         else float(r.tensor_parallel))
        if r.colocate and r.tensor_parallel > 1:
            # the TP workers go into the trainer ranks' GPU bundles through vLLM's Ray executor
            # (cotrain.placement.NodeLayout.engine_env), named here rather than left to vLLM's guess,
            # and run in the actor's process (as NeMo-RL does), where Ray is connected and
            # ray.util.get_current_placement_group() is the run's
            spec.extra.setdefault("distributed_executor_backend", "ray")
            if multiprocess is None:
                spec.multiprocess = False
        transport = kwargs.pop("transport", None) or (r.weight_transport if r.weight_transport != "auto" else "auto")
        return cls(spec, r.num_engines, cpus_per_engine=r.cpus_per_engine, gpus_per_engine=gpus,
                   transport=transport, env=env, **kwargs)  # placement=: see the class docstring

    # -- generation
    def generate(self, prompts: Sequence[Prompt], sampling: SamplingSpec, n: int = 1) -> GenerationResult:
        prompts = list(prompts)
        t0 = time.perf_counter()
        chunks = [(a, lo, hi) for a, (lo, hi) in zip(self.actors, split_evenly(len(prompts), self.num_engines))
                  if hi > lo]
        results = self._get([a.generate.remote(prompts[lo:hi], sampling, n, lo) for a, lo, hi in chunks], "rollout")
        seconds = time.perf_counter() - t0
        samples = [group for r in results for group in r.samples]
        metrics = _aggregate(samples, seconds)
        metrics["engine_time_s_max"] = max((r.metrics["time_s"] for r in results), default=0.0)
        metrics["num_engines_used"] = float(len(chunks))
        return GenerationResult(samples=samples, metrics=metrics)

    # -- weights
    @property
    def transport(self) -> WeightTransport:
        if self._transport is None:
            name = resolve_transport_name(str(self._transport_choice))
            if name == "nccl":
                raise WeightPushError("with the nccl transport the trainer broadcasts: make the handle with its "
                                      "NcclBroadcastTransport and call push (after init_broadcast_group)")
            self._transport = make_transport(name)
        return self._transport

    def push_weights(self, kind: WeightKind, named_tensors: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
        """Send once through :attr:`transport` and :meth:`push` into every engine."""
        return push_through(self.transport, named_tensors, version, lambda h: self.push(kind, h, version))

    def push(self, kind: WeightKind, handle: dict, version: int | None = None) -> dict[str, Any]:
        """Every engine loads ``handle`` (or all refuse it: :class:`WeightPushError`); returns timings."""
        from cotrain.placement import wait_refs

        version = int(handle.get("version", 0) if version is None else version)
        t0 = time.perf_counter()
        # every engine's answer, so that none is left mid-push when one fails (a dead node fails it at once)
        results = wait_refs([a.push.remote(kind, handle, version) for a in self.actors], f"the {kind} weight push",
                            self.placement, settle=True)
        errors = [r for r in results if isinstance(r, Exception)]
        stats = [r for r in results if not isinstance(r, Exception)]
        if errors:
            raise WeightPushError(f"{len(errors)} of {self.num_engines} engines rejected the {kind} push of version "
                                  f"{version}: {_unwrap(errors[0])}")
        if kind == "draft":
            self.draft_version = version
        return {"push_s": time.perf_counter() - t0, "engine_push_s_max": max(s["push_s"] for s in stats)}

    def sleep(self) -> None:
        self._get([a.sleep.remote() for a in self.actors], "the engines' sleep")

    def wake_up(self) -> None:
        self._get([a.wake_up.remote() for a in self.actors], "the engines' wake-up")

    def weight_version(self) -> int:
        versions = self._get([a.weight_version.remote() for a in self.actors], "the weight-version query")
        if len(set(versions)) != 1:
            raise RuntimeError(f"rollout engines serve different weight versions: {versions}")
        return versions[0]

    def init_broadcast_group(self, master_addr: str, master_port: int, world_size: int, *,
                             wire: dict | None = None, first_rank: int = 1) -> list:
        """Start every engine joining a trainer's broadcast group (vLLM's NCCL weight-transfer
        engine in each worker); returns Ray refs to wait on *after* the trainer side has called
        ``NcclBroadcastTransport.connect()`` concurrently. Engine ``e`` takes ranks
        ``first_rank + e * tensor_parallel_size`` onwards (vLLM adds each worker's rank within
        the engine). ``wire`` (packing, buffer sizes) must be the sender's: default
        :func:`~cotrain.weights.transports.nccl.nccl_wire`, as ``NcclBroadcastTransport``'s."""
        from cotrain.weights.transports.nccl import nccl_wire

        tp = self.spec.tensor_parallel_size
        need = first_rank + self.num_engines * tp
        if world_size != need:
            raise ValueError(f"world_size={world_size}, but {first_rank} sender rank(s) + {self.num_engines} engines x "
                             f"{tp} workers need {need}")
        wire = dict(wire) if wire is not None else nccl_wire()
        return [a.init_broadcast_group.remote({"master_address": master_addr, "master_port": int(master_port),
                                               "world_size": world_size, "rank_offset": first_rank + e * tp, **wire})
                for e, a in enumerate(self.actors)]

    def status(self) -> list[dict[str, Any]]:
        return self._get([a.status.remote() for a in self.actors], "the engine status query")

    def shutdown(self) -> None:
        from cotrain.placement import stop_actors

        placement = getattr(self, "placement", None)
        dead = placement.dead_nodes(force=True) if placement is not None else {}
        actors = getattr(self, "actors", [])
        # an engine on a dead node never answers: it is not waited for
        stop_actors(actors, skip={e for e in range(len(actors)) if dead and placement.layout.engine_node[e] in dead})
        self.actors = []


def _unwrap(e: Exception) -> str:
    """The innermost message of a Ray-wrapped error (Ray prefixes tracebacks)."""
    cause = getattr(e, "cause", None)
    if cause is not None:
        return str(cause)
    text = str(e)
    return text.strip().splitlines()[-1] if text.strip() else repr(e)


def engine_spec_from_config(cfg, *, model_path: str | None = None, draft_model: str | None = None,
                            multiprocess: bool | None = None) -> EngineSpec:
    """An :class:`EngineSpec` from a validated ``CotrainConfig`` (its ``rollout`` section)."""
    from cotrain.rl.vllm.engine import speculative_config

    r = cfg.rollout
    path = model_path or cfg.policy.model_path
    if path == "builtin:tiny":
        from cotrain.models.build_tiny import ensure_tiny_model

        path = str(ensure_tiny_model(progress=False))
    s = r.speculative
    method = s.method
    spec_cfg = None
    if method is not None:
        spec_cfg = speculative_config(
            method, num_speculative_tokens=s.num_speculative_tokens or 3,
            draft_model=draft_model or s.draft_model, prompt_lookup_min=s.ngram.prompt_lookup_min,
            prompt_lookup_max=s.ngram.prompt_lookup_max, draft_sample_method=s.draft_sample_method,
            suffix=s.suffix.model_dump(), batch_size_schedule=s.batch_size_schedule)
    return EngineSpec(model_path=str(path), dtype=cfg.policy.dtype, seed=cfg.run.seed,
                      max_model_len=cfg.policy.max_seq_len, kv_cache_memory_bytes=r.kv_cache_memory_bytes,
                      gpu_memory_utilization=r.gpu_memory_utilization, enforce_eager=r.enforce_eager,
                      tensor_parallel_size=r.tensor_parallel, sleep_mode=r.colocate, speculative=spec_cfg,
                      multiprocess=multiprocess)


def sampling_from_config(cfg, seed: int | None = None) -> SamplingSpec:
    """``cfg.rollout.sampling`` as a :class:`SamplingSpec`."""
    s = cfg.rollout.sampling
    return SamplingSpec(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens, seed=seed)


__all__ = ["EngineSpec", "VllmGeneration", "RolloutWorker", "RolloutGroup", "engine_spec_from_config",
           "sampling_from_config", "sampling_params", "split_evenly", "WeightPushError"]

