"""Cross-field validation: resolve the null defaults, then check what single fields cannot.

Every check returns ``(key_path, message)`` issues whose message states the allowed values;
all issues are collected and raised together as one :class:`ConfigError`. The checks run before
any worker starts, reading only the model's ``config.json`` (or the built-in tiny model's
constants) and the file system.

Resources (see docs/config.md): a training rank takes 1 GPU (cuda) and
``policy.cpus_per_worker`` CPUs; an engine takes ``rollout.gpus_per_engine`` GPUs (cuda) and
``rollout.cpus_per_engine`` CPUs. Training and rollout must fit the cluster together
(``num_nodes * per_node``), or each on its own when ``rollout.colocate`` is true.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from .errors import ConfigError, from_validation_error
from .derived import engine_defaults, packing_budget, total_optimizer_steps
from .schema import CotrainConfig, DraftKindConfig, draft_kinds, get_draft_kind, on_policy_kinds

__all__ = ["ModelArch", "load_model_arch", "check_config", "config_from_dict", "CHECKS"]

Issue = tuple[str, str]


@dataclass(frozen=True)
class ModelArch:
    """The architecture numbers validation needs, from a HF ``config.json``."""

    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size: int
    max_position_embeddings: int | None = None
    vocab_size: int | None = None
    model_type: str | None = None
    source: str = ""


_BUILTIN_PREFIX = "builtin:"


def _builtin_config(name: str, key: str = "policy.model_path") -> dict[str, Any]:
    """The architecture of built-in model ``name`` (cotrain.models.builtin: tiny, small), without building it."""
    from cotrain.models.builtin import get_builtin

    try:
        return get_builtin(name).config_dict()
    except ValueError as e:
        raise ConfigError([(key, str(e))]) from None


def load_model_arch(model_path: str, key: str = "policy.model_path") -> ModelArch:
    """Read the architecture of a built-in model (``builtin:tiny``, ``builtin:small``) or of a HF
    checkpoint directory."""
    if model_path.startswith(_BUILTIN_PREFIX):
        raw = _builtin_config(model_path[len(_BUILTIN_PREFIX):], key)
        source = model_path
    else:
        p = Path(model_path)
        if not p.exists():
            raise ConfigError([(key, f"{model_path!r} does not exist (allowed: builtin:tiny, builtin:small, or a "
                                "HF checkpoint directory with config.json)")])
        cfg_file = p / "config.json" if p.is_dir() else p
        if not cfg_file.is_file() or cfg_file.name != "config.json":
            raise ConfigError([(key, f"{model_path!r} has no config.json (allowed: builtin:tiny, builtin:small, "
                                "or a HF checkpoint directory with config.json)")])
        try:
            raw = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError([(key, f"cannot read {cfg_file}: {e}")]) from None
        raw = raw.get("text_config", raw) if "num_hidden_layers" not in raw else raw
        source = str(cfg_file)
        from cotrain.models.hf_io import safetensors_problems

        bad = [m for f in sorted(cfg_file.parent.glob("*.safetensors")) if (m := safetensors_problems(f))]
        if bad:
            raise ConfigError([(key, f"{'; '.join(bad)} (allowed: a checkpoint whose weight files are complete)")])
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size") if not isinstance(raw.get(k), int)]
    if missing:
        raise ConfigError([(key, f"{source} lacks integer {', '.join(missing)}")])
    return ModelArch(
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        hidden_size=raw["hidden_size"],
        max_position_embeddings=raw.get("max_position_embeddings"),
        vocab_size=raw.get("vocab_size"),
        model_type=raw.get("model_type"),
        source=source,
    )


# ------------------------------------------------------------------------------------ helpers
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt(values: list[int], limit: int = 12) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (", ..." if len(values) > limit else "")


def _kind(cfg: CotrainConfig) -> DraftKindConfig | None:
    return cfg.draft.settings


# ------------------------------------------------------------------------------------ resolve
def resolve(cfg: CotrainConfig, arch: ModelArch | None) -> None:
    """Replace the documented null / auto values by concrete ones (in place)."""
    c, r = cfg.cluster, cfg.rollout
    if c.device == "auto":
        c.device = "cuda" if c.gpus_per_node > 0 else "cpu"
    if c.cpus_per_node is None:
        c.cpus_per_node = os.cpu_count() or 1
    cuda = c.device == "cuda"
    if cfg.run.output_dir is None:
        cfg.run.output_dir = f"runs/{cfg.run.name}"
    out = cfg.run.output_dir.rstrip("/") or "."
    if cfg.checkpoint.dir is None:
        cfg.checkpoint.dir = f"{out}/checkpoints"
    if cfg.logging.tensorboard_dir is None:
        cfg.logging.tensorboard_dir = f"{out}/tensorboard"
    if cfg.logging.mlflow.tracking_uri is None:
        cfg.logging.mlflow.tracking_uri = f"{out}/mlruns"
    if r.gpus_per_engine is None:  # colocated: a share of each trainer GPU (cotrain.placement.colocated_plan)
        from cotrain.placement import COLOCATED_ENGINE_GPU_SHARE

        share = COLOCATED_ENGINE_GPU_SHARE if r.colocate else 1.0
        r.gpus_per_engine = share * r.tensor_parallel if cuda else 0.0
    engine = engine_defaults(cuda, r.colocate)
    if r.enforce_eager is None:
        r.enforce_eager = engine["enforce_eager"]
    if r.gpu_memory_utilization is None and r.kv_cache_memory_bytes is None:
        r.gpu_memory_utilization = engine["gpu_memory_utilization"]
        r.kv_cache_memory_bytes = engine["kv_cache_memory_bytes"]
    multi = c.num_nodes > 1
    if r.weight_transport == "auto":
        # several nodes: engines beside other ranks than trainer rank 0 (the sender) cannot map its IPC handles
        r.weight_transport = ("cuda_ipc" if r.colocate and not multi else "nccl") if cuda else \
            ("object_store" if multi else "shm")
    if cfg.draft.tap_transport == "auto" and not multi and not cuda:  # one CPU node: shared memory
        cfg.draft.tap_transport = "shm"
    # several nodes, or CUDA (cuda_ipc only to a source that sees the reader's GPU, else nccl): auto
    # stays, resolved per source stage at start (TapChannel.choose)
    kind = _kind(cfg)
    if kind is not None:
        if cfg.draft.loss is None:
            cfg.draft.loss = cfg.draft.record.default_loss
        if arch is not None:
            kind.resolve(arch.num_hidden_layers)
    spec = r.speculative
    if spec.method is not None and spec.num_speculative_tokens is None:
        served = kind if kind is not None and cfg.draft.record.vllm_method == spec.method else None
        spec.num_speculative_tokens = served.default_num_speculative_tokens() if served else 3
    if cfg.grpo.global_batch_size is None:
        cfg.grpo.global_batch_size = cfg.rollout_batch_size


# ------------------------------------------------------------------------------------- checks
def check_model(cfg: CotrainConfig, arch: ModelArch) -> list[Issue]:
    """Parallel degrees and lengths against the model."""
    issues: list[Issue] = []
    p, L = cfg.policy.parallel, arch.num_hidden_layers
    if L % p.pipeline:
        issues.append(("policy.parallel.pipeline", f"{p.pipeline} does not divide num_hidden_layers={L} "
                       f"(allowed: {_fmt(_divisors(L))})"))
    heads, kv = arch.num_attention_heads, arch.num_key_value_heads
    if heads % p.tensor or kv % p.tensor:
        allowed = [d for d in _divisors(heads) if kv % d == 0]
        issues.append(("policy.parallel.tensor", f"{p.tensor} does not divide num_attention_heads={heads} "
                       f"and num_key_value_heads={kv} (allowed: {_fmt(allowed)})"))
    tp = cfg.rollout.tensor_parallel
    if heads % tp:
        issues.append(("rollout.tensor_parallel", f"{tp} does not divide num_attention_heads={heads} "
                       f"(allowed: {_fmt(_divisors(heads))})"))
    S = cfg.policy.max_seq_len
    if arch.max_position_embeddings and S > arch.max_position_embeddings:
        issues.append(("policy.max_seq_len", f"{S} exceeds the model's max_position_embeddings="
                       f"{arch.max_position_embeddings} (allowed: 2..{arch.max_position_embeddings})"))
    return issues


def check_lengths(cfg: CotrainConfig) -> list[Issue]:
    """Context parallel and sequence lengths."""
    issues: list[Issue] = []
    cp, S = cfg.policy.parallel.context, cfg.policy.max_seq_len
    if cp > 1 and S % (2 * cp):
        allowed = [c for c in range(1, S // 2 + 1) if S % (2 * c) == 0 or c == 1]
        issues.append(("policy.parallel.context", f"{cp} needs policy.max_seq_len={S} divisible by "
                       f"2*context={2 * cp} for the zigzag layout (allowed: {_fmt(allowed, 8)})"))
    impl = cfg.policy.context_parallel_impl
    if impl == "megatron_te":
        where = "policy.context_parallel_impl"
        if cfg.cluster.device != "cuda":
            issues.append((where, "megatron_te runs Megatron's context parallelism inside transformer-engine's "
                           f"attention, which needs CUDA; cluster.device={cfg.cluster.device} (allowed on cpu: "
                           "cotrain)"))
        elif importlib.util.find_spec("transformer_engine") is None:
            issues.append((where, "megatron_te needs transformer-engine, which is not installed here (pip install "
                           "'transformer-engine[pytorch]'; allowed without it: cotrain)"))
        elif cp > 1 and cfg.policy.dtype != "bfloat16":
            issues.append((where, f"megatron_te at policy.parallel.context={cp} needs policy.dtype=bfloat16: "
                           "transformer-engine's context parallelism runs only in its flash / fused attention "
                           f"(fp16/bf16), policy.dtype={cfg.policy.dtype} (allowed with float32: cotrain)"))
    if cfg.policy.layer_spec == "transformer_engine":
        if cfg.cluster.device != "cuda":
            issues.append(("policy.layer_spec", "transformer_engine is Megatron's fused transformer-engine layer "
                           f"spec, which needs CUDA; cluster.device={cfg.cluster.device} (allowed on cpu: local, auto)"))
        elif importlib.util.find_spec("transformer_engine") is None:
            issues.append(("policy.layer_spec", "transformer_engine needs transformer-engine, which is not installed "
                           "here (pip install 'transformer-engine[pytorch]'; allowed without it: local, auto)"))
    mt = cfg.rollout.sampling.max_tokens
    if mt >= S:
        issues.append(("rollout.sampling.max_tokens", f"{mt} leaves no room for the prompt in "
                       f"policy.max_seq_len={S} (allowed: 1..{S - 1})"))
    return issues


def check_resources(cfg: CotrainConfig) -> list[Issue]:
    """World size and rollout engines against the cluster."""
    issues: list[Issue] = []
    c, r, pol = cfg.cluster, cfg.rollout, cfg.policy
    cuda = c.device == "cuda"
    if cuda and c.gpus_per_node == 0:
        issues.append(("cluster.device", "cuda needs cluster.gpus_per_node >= 1 (allowed: cpu, auto; or "
                       "set cluster.gpus_per_node)"))
        return issues
    W, E = cfg.world_size, r.num_engines
    p = pol.parallel
    ws = f"TP*PP*CP*DP = {p.tensor}*{p.pipeline}*{p.context}*{p.data} = {W}"
    mode = "colocated: each must fit" if r.colocate else "not colocated: the sum must fit"

    def fit(unit: str, per_node: int, train_each: float, engine_each: float) -> None:
        total = c.num_nodes * per_node
        avail = f"cluster.num_nodes={c.num_nodes} x cluster.{unit}s_per_node={per_node} = {total} {unit.upper()}s"
        train, roll = W * train_each, E * engine_each
        if roll > total:
            issues.append(("rollout.num_engines", f"{E} engines x {engine_each:g} {unit.upper()}s = {roll:g} "
                           f"exceed {avail} (allowed: at most {int(total // engine_each) if engine_each else E} engines)"))
        if train > total:
            issues.append(("policy.parallel", f"world size {ws} training ranks x {train_each:g} "
                           f"{unit.upper()}s = {train:g} exceed {avail} (allowed: world size <= "
                           f"{int(total // train_each)})"))
        if not r.colocate and roll <= total and train <= total and train + roll > total:
            issues.append(("policy.parallel", f"world size {ws} ranks ({train:g} {unit.upper()}s) + "
                           f"rollout.num_engines={E} engines ({roll:g} {unit.upper()}s) = {train + roll:g} "
                           f"exceed {avail} ({mode}; allowed: training + rollout <= {total}"
                           + (", or rollout.colocate=true)" if cuda else ")")))

    fit("cpu", c.cpus_per_node or 1, pol.cpus_per_worker, r.cpus_per_engine)
    if cuda:
        gpe = r.gpus_per_engine if r.gpus_per_engine is not None else r.tensor_parallel
        fit("gpu", c.gpus_per_node, 1, gpe)
        if r.tensor_parallel > c.gpus_per_node:
            issues.append(("rollout.tensor_parallel", f"{r.tensor_parallel} exceeds cluster.gpus_per_node="
                           f"{c.gpus_per_node}: an engine's GPUs are on one node (allowed: 1..{c.gpus_per_node})"))
        if gpe < r.tensor_parallel and not r.colocate:
            issues.append(("rollout.gpus_per_engine", f"{gpe:g} is less than rollout.tensor_parallel="
                           f"{r.tensor_parallel} (allowed: >= {r.tensor_parallel}, or rollout.colocate=true)"))
    if not issues:  # the totals fit: now node by node (cotrain.placement, the layout the run uses)
        issues += check_placement(cfg)
    return issues


def check_placement(cfg: CotrainConfig) -> list[Issue]:
    """Every trainer rank and engine on a node (cotrain.placement.node_layout): TP and CP groups
    inside a node, cluster.engine_nodes below cluster.num_nodes, each node's share within its
    resources."""
    from cotrain.placement import layout_issues

    return layout_issues(cfg)[1]


def check_batches(cfg: CotrainConfig) -> list[Issue]:
    """Group size, rollout batch, global batch and micro batches."""
    issues: list[Issue] = []
    g, pol = cfg.grpo, cfg.policy
    if g.group_size < 2:
        issues.append(("grpo.group_size", f"{g.group_size}: GRPO needs at least 2 samples per prompt to "
                       "compare them (allowed: >= 2)"))
    if g.min_groups_with_signal > g.prompts_per_step:
        issues.append(("grpo.min_groups_with_signal", f"{g.min_groups_with_signal} is more than a step's "
                       f"grpo.prompts_per_step={g.prompts_per_step} groups: no step would ever update the policy "
                       f"(allowed: 0..{g.prompts_per_step})"))
    issues += _check_async(cfg)
    B = cfg.rollout_batch_size
    if pol.packing:  # micro batches by token budget: every data-parallel rank needs one sequence
        unit = pol.parallel.data
        desc = f"policy.parallel.data = {unit}"
        budget = packing_budget(cfg)
        unit_len = 2 * pol.parallel.context if pol.parallel.context > 1 else 1
        longest = -(-pol.max_seq_len // unit_len) * unit_len
        if budget < longest and pol.max_seq_len % unit_len == 0:  # (else policy.parallel.context says why)
            key = "policy.max_tokens_per_microbatch" if pol.max_tokens_per_microbatch else "policy.micro_batch_size"
            issues.append((key, f"the token budget {budget} is below the longest sequence's {longest} tokens "
                           f"(policy.max_seq_len={pol.max_seq_len}, rounded up to a multiple of {unit_len}; allowed "
                           f"policy.max_tokens_per_microbatch: >= {longest})"))
    else:
        unit = pol.parallel.data * pol.micro_batch_size
        desc = (f"policy.parallel.data*policy.micro_batch_size = {pol.parallel.data}*{pol.micro_batch_size} = {unit}")
        if pol.max_tokens_per_microbatch is not None:
            issues.append(("policy.max_tokens_per_microbatch", f"{pol.max_tokens_per_microbatch} acts only with "
                           "policy.packing=true (allowed with packing=false: null; the padded layout's micro batches "
                           "are policy.micro_batch_size rows)"))
    if B % unit:
        ok = [n for n in range(1, 4 * g.prompts_per_step + unit + 1) if (n * g.group_size) % unit == 0][:6]
        issues.append(("grpo.prompts_per_step", f"prompts_per_step*group_size = {g.prompts_per_step}*"
                       f"{g.group_size} = {B} is not divisible by {desc} (allowed prompts_per_step: "
                       f"{_fmt(ok, 6)}, ...; or change the micro batch / data parallel size)"))
    gbs = g.global_batch_size if g.global_batch_size is not None else B
    if B % unit == 0 and B % gbs:
        issues.append(("grpo.global_batch_size", f"{gbs} does not divide prompts_per_step*group_size={B} "
                       f"(allowed: {_fmt([d for d in _divisors(B) if d % unit == 0] or _divisors(B))})"))
    elif B % unit == 0 and gbs % unit:
        allowed = [d for d in _divisors(B) if d % unit == 0]
        issues.append(("grpo.global_batch_size", f"{gbs} is not a multiple of {desc} "
                       f"(allowed: {_fmt(allowed) if allowed else 'none for this batch'})"))
    if g.kl_coef > 0 and not pol.reference_model:
        issues.append(("grpo.kl_coef", f"{g.kl_coef:g} > 0 needs policy.reference_model=true (allowed: 0, "
                       "or enable policy.reference_model)"))
    opt = pol.optimizer
    total = total_optimizer_steps(cfg)
    if total is not None and opt.warmup_steps >= total:
        issues.append(("policy.optimizer.warmup_steps", f"{opt.warmup_steps} is not below the run's {total} "
                       f"optimizer steps (grpo.num_steps * prompts_per_step*group_size / global_batch_size * "
                       f"epochs = {g.num_steps} * {B // gbs} * {g.epochs}; allowed: 0..{total - 1})"))
    if opt.schedule == "cosine" and opt.min_lr > opt.lr:
        issues.append(("policy.optimizer.min_lr", f"{opt.min_lr:g} exceeds policy.optimizer.lr={opt.lr:g}: the "
                       f"cosine schedule decays from lr to min_lr (allowed: 0..{opt.lr:g})"))
    return issues


def _check_async(cfg: CotrainConfig) -> list[Issue]:
    """grpo.max_staleness needs engines and trainers on their own resources; importance_cap acts
    only with a correction."""
    g, issues = cfg.grpo, []
    if g.max_staleness and cfg.rollout.colocate:
        issues.append(("grpo.max_staleness", f"{g.max_staleness}: rollout.colocate=true makes the engines and the "
                       "trainers take turns on the same devices, so there is nothing to overlap (allowed with "
                       "colocate: 0; or rollout.colocate=false)"))
    if g.importance_correction == "none" and g.importance_cap != type(g)().importance_cap:
        issues.append(("grpo.importance_cap", "acts only with grpo.importance_correction: tis or mis "
                       "(none: no correction)"))
    return issues


def check_rollout(cfg: CotrainConfig) -> list[Issue]:
    """Engine memory, weight transport, speculative decoding."""
    issues: list[Issue] = []
    c, r = cfg.cluster, cfg.rollout
    cuda = c.device == "cuda"
    if r.gpu_memory_utilization is not None and r.kv_cache_memory_bytes is not None:
        issues.append(("rollout.kv_cache_memory_bytes", "is exclusive with rollout.gpu_memory_utilization "
                       "(allowed: set one of them, the other null)"))
    if r.colocate and not cuda:
        issues.append(("rollout.colocate", "true needs cluster.device=cuda: colocated engines sleep while the trainers "
                       "run (vLLM's sleep mode: weights to host memory, KV cache freed), and vLLM's CPU backend has no "
                       "sleep mode (allowed on cpu: false)"))
    wt = r.weight_transport
    if wt in ("cuda_ipc", "nccl") and not cuda:
        issues.append(("rollout.weight_transport", f"{wt} needs cluster.device=cuda (allowed on cpu: shm, auto)"))
    elif wt == "cuda_ipc" and not r.colocate:
        issues.append(("rollout.weight_transport", "cuda_ipc needs rollout.colocate=true (allowed: nccl, auto)"))
    elif wt == "cuda_ipc" and c.num_nodes > 1:
        from cotrain.placement import layout_issues

        layout, _ = layout_issues(cfg)
        away = [e for e, n in enumerate(layout.engine_node) if n != layout.rank_node[0]] if layout else []
        if away:
            issues.append(("rollout.weight_transport", f"cuda_ipc works within one node: engine(s) {away} run on "
                           "another node than trainer rank 0, the sender (allowed: nccl, auto)"))
    if wt == "shm" and c.num_nodes > 1:
        issues.append(("rollout.weight_transport", f"shm works within one node, cluster.num_nodes="
                       f"{c.num_nodes} (allowed: nccl on cuda, object_store, auto)"))
    issues += check_speculative(cfg)
    return issues


def check_speculative(cfg: CotrainConfig) -> list[Issue]:
    issues: list[Issue] = []
    spec, d = cfg.rollout.speculative, cfg.draft
    m = spec.method
    if spec.ngram.prompt_lookup_min > spec.ngram.prompt_lookup_max:
        issues.append(("rollout.speculative.ngram.prompt_lookup_min", f"{spec.ngram.prompt_lookup_min} > "
                       f"prompt_lookup_max={spec.ngram.prompt_lookup_max} (allowed: <= prompt_lookup_max)"))
    if spec.draft_model is not None and not Path(spec.draft_model).exists():
        issues.append(("rollout.speculative.draft_model", f"{spec.draft_model!r} does not exist (allowed: a "
                       "directory of drafter weights, or null)"))
    if spec.batch_size_schedule is not None:
        issues += check_batch_size_schedule(spec)
    if m is None:
        return issues
    if m == "suffix":
        why = suffix_decoding_unavailable()
        if why is not None:
            issues.append(("rollout.speculative.method", f"suffix needs the arctic-inference package (vLLM's suffix "
                           f"decoding runs arctic_inference.suffix_decoding in each engine): {why}. Install it with "
                           f"`{SUFFIX_INSTALL}` (the pin of the 'suffix' extra; builds a small C++ extension with the system's "
                           "cmake and g++; see docs/rollout.md), or use a "
                           "model-free method that needs nothing: ngram (allowed: null, ngram, draft_model, or a "
                           "drafter method)"))
    if m == "draft_model" and spec.draft_model is None:
        issues.append(("rollout.speculative.draft_model", "is required by method draft_model (allowed: a "
                       "HF checkpoint directory of the draft model)"))
    served_kinds = [k for k in draft_kinds() if get_draft_kind(k).vllm_method == m]
    if served_kinds:
        record = get_draft_kind(served_kinds[0])
        if d.kind not in served_kinds and spec.draft_model is None:
            issues.append(("rollout.speculative.method", f"{m} needs a drafter: draft.kind={served_kinds[0]} "
                           f"(got {d.kind or 'null'}) or rollout.speculative.draft_model (allowed with "
                           f"draft.kind={d.kind or 'null'}: null, ngram, draft_model"
                           + (f", {d.record.vllm_method}" if d.kind else "") + ")"))
        if not record.serves_on_cpu and cfg.cluster.device == "cpu":
            cpu_ok = ["null", "ngram", "draft_model"] + [
                get_draft_kind(k).vllm_method for k in draft_kinds()
                if get_draft_kind(k).serves_on_cpu and get_draft_kind(k).vllm_method]
            issues.append(("rollout.speculative.method", f"{m} serving on CPU is not supported by vLLM (its "
                           f"{m} runner is GPU-only; allowed on cpu: {', '.join(cpu_ok)}). To co-train a "
                           f"{m} drafter on CPU set rollout.speculative.method=null and keep "
                           f"draft.kind={served_kinds[0]} draft.cotrain=true: it is trained online and its "
                           "acceptance measured offline"))
        kind = d.settings
        if kind is not None and d.kind in served_kinds and spec.num_speculative_tokens is not None:
            most = kind.max_speculative_tokens()
            if most is not None and spec.num_speculative_tokens > most:
                issues.append(("rollout.speculative.num_speculative_tokens", f"{spec.num_speculative_tokens} "
                               f"exceeds what the {d.kind} drafter predicts per block ({most}; "
                               f"allowed: 1..{most})"))
    return issues


#: how to install what method "suffix" needs (docs/rollout.md, "Model-free speculation")
SUFFIX_INSTALL = "pip install nanobind==2.9.2 && pip install --no-build-isolation arctic-inference==0.3.0"


def suffix_decoding_unavailable() -> str | None:
    """Why vLLM's ``suffix`` method cannot run in this environment (None = it can).

    vLLM imports ``arctic_inference.suffix_decoding`` (a nanobind extension) when the engine starts
    its drafter; importing it here catches a missing package and a broken build alike, without
    loading vLLM."""
    import importlib
    import importlib.util

    try:
        if importlib.util.find_spec("arctic_inference") is None:
            return "it is not installed"
        importlib.import_module("arctic_inference.suffix_decoding")
    except Exception as e:  # noqa: BLE001 - any failure to load means the engines would fail too
        return f"it does not load ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    return None


def check_batch_size_schedule(spec) -> list[Issue]:
    """vLLM's rules for num_speculative_tokens_per_batch_size, checked before any engine starts."""
    key, sched = "rollout.speculative.batch_size_schedule", spec.batch_size_schedule
    if spec.method is None:
        return [(key, "needs rollout.speculative.method (allowed with method null: null)")]
    if not sched:
        return [(key, "is empty (allowed: [[1, last, k], ...] or null)")]
    k_max = spec.num_speculative_tokens
    prev_end = 0
    for i, (first, last, k) in enumerate(sched):
        where = f"{key}[{i}]"
        if i == 0 and first != 1:
            return [(where, f"starts at {first}: the first range must start at batch size 1 so every batch "
                     "size has a k (allowed: [1, last, k])")]
        if first < 1 or first > last:
            return [(where, f"[{first}, {last}, {k}] is not a range first <= last, both >= 1")]
        if first <= prev_end:
            return [(where, f"[{first}, {last}, {k}] overlaps or precedes the previous range (ending at "
                     f"{prev_end}); ranges are sorted and disjoint")]
        if k_max is not None and k > k_max:
            return [(where, f"k = {k} exceeds rollout.speculative.num_speculative_tokens={k_max} "
                     f"(allowed: 0..{k_max})")]
        prev_end = last
    return []


def _check_on_policy(cfg: CotrainConfig) -> list[Issue]:
    """draft.branches: on_policy in co-training (SpecOPD in the GRPO step, docs/cotrain.md): every
    drafter kind (dflash, dspark, eagle3), cotrain's attention (the tree forward replaces the
    policy's core_attention); any PP, CP, TP and DP (at PP > 1 the tree forward runs through the
    pipeline after the log-prob schedule)."""
    d = cfg.draft
    if not d.cotrain:
        return [("draft.branches", "on_policy is used only when co-training (draft.cotrain=false: the engines "
                 "serve rollout.speculative.draft_model as it is)")]
    if d.record.branches is None:  # a kind whose record names no branch sampling
        return [("draft.branches", f"on_policy is built for kinds {', '.join(on_policy_kinds())} "
                 f"(cotrain.draft.specopd), not {d.kind}")]
    issues = []
    if cfg.policy.context_parallel_impl == "megatron_te":
        issues.append(("policy.context_parallel_impl", "draft.branches: on_policy replaces the policy's "
                       "core_attention for its tree forward with cotrain's branch attention; not with "
                       "transformer-engine's attention (allowed: cotrain)"))
    return issues


def check_accept_weighted(d) -> list[Issue]:
    """draft.loss: accept_weighted_tv weights position j by the acceptance of the drafts drawn before
    it (cotrain.draft.losses): only on-policy branches have drafts of their own."""
    if d.loss == "accept_weighted_tv" and d.branches != "on_policy":
        return [("draft.loss", f"accept_weighted_tv weights each position by the acceptance probability of the "
                 f"drafts the branch itself drew before it; draft.branches={d.branches} chains are the reference "
                 "tokens, which the drafter did not draw (set draft.branches=on_policy, or use e2e_tv)")]
    return []


def _check_budget(d) -> list[Issue]:
    """draft.budget: the adaptive keys act only in adaptive mode, the replay only with max_steps > 1
    and teacher-forced chains (an on-policy branch needs its own step's tree forward)."""
    b, defaults = d.budget, type(d.budget)()
    adaptive_keys = ("max_steps", "max_update_share", "tolerance", "recent_steps", "probe_every", "memory_steps",
                    "measure_idle")
    replay_keys = ("replay_steps", "replay_max_mib")
    issues: list[Issue] = []
    if b.mode == "fixed":
        for key in adaptive_keys + replay_keys:
            if getattr(b, key) != getattr(defaults, key):
                issues.append((f"draft.budget.{key}", "acts only with draft.budget.mode=adaptive (fixed: one "
                               "drafter step per GRPO step)"))
        return issues
    if b.recent_steps >= b.memory_steps:
        issues.append(("draft.budget.recent_steps", f"{b.recent_steps} leaves no step of the "
                       f"draft.budget.memory_steps={b.memory_steps} window to compare with (allowed: "
                       f"1..{b.memory_steps - 1})"))
    if b.max_steps > 1 and d.branches == "on_policy":
        issues.append(("draft.budget.max_steps", f"{b.max_steps}: the extra steps replay earlier steps' inputs, "
                       "and an on-policy branch (draft.branches: on_policy) needs the policy's tree forward on its "
                       "own step's stem, which is gone (allowed with on_policy: 1)"))
    if b.max_steps == 1:
        for key in replay_keys:
            if getattr(b, key) != getattr(defaults, key):
                issues.append((f"draft.budget.{key}", "acts only with draft.budget.max_steps > 1 (no replay)"))
    return issues


def check_draft(cfg: CotrainConfig, arch: ModelArch | None) -> list[Issue]:
    """The active drafter kind: its loss, its settings against the target, its weights."""
    issues: list[Issue] = []
    d = cfg.draft
    kind = d.settings
    if kind is None:
        if d.compare_frozen:
            issues.append(("draft.compare_frozen", "needs a co-trained drafter (draft.kind is null)"))
        if d.budget != type(d.budget)():
            issues.append(("draft.budget", "needs a co-trained drafter (draft.kind is null)"))
        return issues
    if d.loss is not None and d.loss not in d.record.losses:
        issues.append(("draft.loss", f"{d.loss} is not available for draft.kind={d.kind} (allowed: "
                       f"{', '.join(d.record.losses)})"))
    issues += check_accept_weighted(d)
    if d.branches == "on_policy":
        issues += _check_on_policy(cfg)
    if d.compare_frozen and d.cotrain and d.init is None:
        issues.append(("draft.compare_frozen", "needs draft.init (a drafter directory or 'distill:<yaml>'): a "
                       "frozen copy of a from-scratch drafter measures nothing"))
    if arch is not None:
        issues += [(f"draft.{d.kind}.{path}", msg) for path, msg in kind.check(arch.num_hidden_layers)]
        if arch.vocab_size is not None:
            issues += [(f"draft.{d.kind}.{path}", msg) for path, msg in kind.check_vocab(arch.vocab_size)]
    spec = cfg.rollout.speculative
    if not d.cotrain and spec.draft_model is None:
        issues.append(("draft.cotrain", f"false with draft.kind={d.kind} and no drafter weights: the drafter "
                       "would stay random (allowed: true, or set rollout.speculative.draft_model)"))
    if not d.cotrain:
        for key in ("init", "push_every", "tap_timeout_s", "compare_frozen", "budget"):
            if getattr(d, key) != type(d).model_fields[key].get_default(call_default_factory=True):
                issues.append((f"draft.{key}", "is used only when co-training (draft.cotrain=false: the engines "
                               "serve rollout.speculative.draft_model as it is)"))
        return issues
    issues += _check_budget(d)
    if spec.draft_model is not None:
        issues.append(("rollout.speculative.draft_model", "must be null with draft.cotrain=true: the engines serve "
                       "the co-trained drafter (set its initial weights with draft.init)"))
    cuda = cfg.cluster.device == "cuda"
    t = d.tap_transport
    if t in ("nccl", "cuda_ipc") and not cuda:
        issues.append(("draft.tap_transport", f"{t} needs cluster.device=cuda (allowed on cpu: shm, gloo, auto)"))
    if t in ("shm", "cuda_ipc") and cfg.cluster.num_nodes > 1 and cfg.policy.parallel.pipeline > 1:
        across = _taps_across_nodes(cfg, arch)
        if across:
            issues.append(("draft.tap_transport", f"{t} works within one node; with cluster.num_nodes="
                           f"{cfg.cluster.num_nodes} {across} (allowed: auto, " + ("nccl" if cuda else "gloo") + ")"))
    if d.init is not None and arch is not None:
        issues += check_draft_init(cfg, arch)
    return issues


def _taps_across_nodes(cfg: CotrainConfig, arch: ModelArch | None) -> str:
    """Which tap sources sit on another node than their drafter's stage ('' if none or unknown)."""
    from cotrain.placement import layout_issues

    layout, _ = layout_issues(cfg)
    if layout is None:
        return ""  # check_resources reports why
    p = cfg.policy.parallel
    span, pp = p.tensor * p.context * p.data, p.pipeline
    stages = set(range(pp - 1))
    kind = cfg.draft.settings
    if arch is not None and kind is not None and getattr(kind, "tap_layers", None):
        per = arch.num_hidden_layers // pp
        stages = {layer // per for layer in kind.tap_layers if layer // per < pp - 1}
    bad = sorted({s for s in stages for i in range(span)
                  if layout.rank_node[s * span + i] != layout.rank_node[(pp - 1) * span + i]})
    return f"pipeline stage(s) {bad} send taps from another node than the drafter's stage {pp - 1}" if bad else ""


#: drafter settings that shape its tensors: a drafter directory must agree with the config on them
_STRUCTURAL = ("tap_layers", "num_layers", "markov_rank", "markov_head", "confidence_head", "draft_vocab_size")


def check_draft_init(cfg: CotrainConfig, arch: ModelArch) -> list[Issue]:
    """``draft.init``: a drafter directory or ``distill:<yaml>`` that fits draft.kind and the policy."""
    d, key = cfg.draft, "draft.init"
    init = d.init
    if init.startswith("distill:"):
        from .distill import load_distill_config

        path = init[len("distill:"):]
        if not Path(path).is_file():
            return [(key, f"{path!r} does not exist (allowed: distill:<a distill config YAML>, a drafter "
                     "directory, or null = from scratch)")]
        try:
            dc = load_distill_config(path)
        except (ValidationError, ValueError, ConfigError) as e:
            return [(key, f"{path} is not a valid distill config: {' '.join(str(e).split())[:400]}")]
        try:
            target = load_model_arch(dc.target, key)
        except ConfigError as e:
            return [(key, f"{path}: target {dc.target!r}: {e.issues[0][1]}")]
        settings = dc.draft.settings.model_copy(deep=True)
        settings.resolve(target.num_hidden_layers)
        return _fits(key, f"the drafter distilled by {path}", dc.draft.kind, settings.model_dump(),
                     target.hidden_size, target.vocab_size, cfg, arch)
    p = Path(init)
    if not (p / "config.json").is_file():
        return [(key, f"{init!r} is not a drafter directory (no config.json; allowed: the distill command's "
                 "<output_dir>/drafter, distill:<yaml>, or null = from scratch)")]
    try:
        config = json.loads((p / "config.json").read_text())
        meta = json.loads((p / "cotrain_drafter.json").read_text()) if (p / "cotrain_drafter.json").is_file() else {}
    except (OSError, ValueError) as e:
        return [(key, f"cannot read {init}: {e}")]
    kind = meta.get("kind") or config.get("cotrain", {}).get("kind")
    if kind is None:
        return [(key, f"{init} is not a cotrain drafter (no cotrain_drafter.json or config.json 'cotrain' section)")]
    from cotrain.models.hf_io import safetensors_problems

    if (bad := safetensors_problems(p / "model.safetensors")) is not None:
        return [(key, f"{bad} (allowed: a complete drafter export, distill:<yaml>, or null = from scratch)")]
    settings = dict(meta.get("settings") or {})
    settings.setdefault("tap_layers", config.get("cotrain", {}).get("tap_layers"))
    hidden = config.get("target_hidden_size", config.get("hidden_size"))
    return _fits(key, f"the drafter in {init}", kind, settings, hidden, config.get("vocab_size"), cfg, arch)


def _fits(key: str, what: str, kind: str, settings: dict, hidden, vocab, cfg: CotrainConfig,
          arch: ModelArch) -> list[Issue]:
    d = cfg.draft
    if kind != d.kind:
        return [(key, f"{what} is a {kind} drafter, draft.kind is {d.kind} (allowed: a {d.kind} drafter)")]
    issues = []
    if hidden is not None and hidden != arch.hidden_size:
        issues.append((key, f"{what} was made for hidden size {hidden}, the policy's is {arch.hidden_size}"))
    if vocab is not None and arch.vocab_size is not None and vocab != arch.vocab_size:
        issues.append((key, f"{what} was made for a vocabulary of {vocab}, the policy's is {arch.vocab_size}"))
    mine = d.settings.model_dump()
    for name in _STRUCTURAL:
        if name in settings and name in mine and settings[name] != mine[name]:
            issues.append((f"draft.{d.kind}.{name}", f"{mine[name]} differs from {what} ({settings[name]}); "
                           f"set it to {settings[name]} or train from scratch (draft.init=null)"))
    return issues


def check_data(cfg: CotrainConfig) -> list[Issue]:
    """Prompt sources and the reward.

    Reads the data the way the run does (:func:`cotrain.tasks.data.load_task`): a JSONL line that
    is not JSON, not an object, or lacks a key is an issue naming the file and line; so is a prompt
    longer than the tokens it has (policy.max_seq_len - rollout.sampling.max_tokens, in tokens of
    the policy's tokenizer)."""
    issues: list[Issue] = []
    data, P = cfg.data, cfg.grpo.prompts_per_step
    readable = True
    if data.task == "jsonl":
        path = data.jsonl.path
        if path is None:
            issues.append(("data.jsonl.path", "is required when data.task=jsonl (allowed: an existing "
                           "JSONL file)"))
            readable = False
        elif not Path(path).is_file():
            issues.append(("data.jsonl.path", f"{path!r} does not exist (allowed: an existing JSONL file)"))
            readable = False
    elif getattr(data, data.task).num_prompts < P:
        n = getattr(data, data.task).num_prompts
        issues.append((f"data.{data.task}.num_prompts", f"{n} is fewer than grpo.prompts_per_step={P} "
                       f"(allowed: >= {P})"))
    if data.eval.path is not None and not Path(data.eval.path).is_file():
        issues.append(("data.eval.path", f"{data.eval.path!r} does not exist (allowed: an existing JSONL file, "
                       "or null = held-out prompts of the task)"))
        readable = False
    if readable:
        issues += _check_problems(cfg)
    rw = cfg.reward
    if rw.correct <= rw.incorrect:
        issues.append(("reward.correct", f"{rw.correct:g} must exceed reward.incorrect={rw.incorrect:g} "
                       f"(allowed: > {rw.incorrect:g})"))
    if rw.format_error >= rw.correct:
        issues.append(("reward.format_error", f"{rw.format_error:g} must be below reward.correct={rw.correct:g}, "
                       f"or a malformed answer would count as correct (allowed: < {rw.correct:g})"))
    return issues


def _check_problems(cfg: CotrainConfig) -> list[Issue]:
    """Load the problems as the run does; their count, the held-out set, the prompt lengths."""
    import warnings

    from cotrain.tasks.data import load_task

    data, P, e = cfg.data, cfg.grpo.prompts_per_step, cfg.data.eval
    key = "data.jsonl.path" if data.task == "jsonl" else f"data.{data.task}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run warns about the held-out split; here only errors count
            train, evals = load_task(data, min_train=P)
    except ValueError as err:
        msg = str(err)
        if data.eval.path is not None and msg.startswith(f"{data.eval.path}"):
            key = "data.eval.path"
        return [(key, f"{msg} (allowed: one JSON object per line with keys {data.jsonl.prompt_key!r} and "
                      f"{data.jsonl.answer_key!r})")]
    issues: list[Issue] = []
    if data.task == "jsonl" and len(train) < P:  # (prompts are held out only when P distinct ones remain)
        issues.append(("data.jsonl.path", f"{data.jsonl.path!r} has {len(train)} prompts, fewer than "
                       f"grpo.prompts_per_step={P} (allowed: a file with >= {P} lines)"))
    elif data.task == "jsonl" and (distinct := len({p.prompt for p in train})) < P:
        issues.append(("data.jsonl.path", f"{data.jsonl.path!r} has {len(train)} training prompts but only "
                       f"{distinct} distinct ones, fewer than grpo.prompts_per_step={P}: every step would repeat "
                       f"prompts within its own batch (allowed: >= {P} distinct prompts)"))
    if e.every and not evals and not issues:
        where = (f"every prompt of {e.path} is also a training prompt" if e.path is not None else
                 f"the training data has no prompts to hold out beyond one step's grpo.prompts_per_step={P}")
        issues.append(("data.eval.every", f"{e.every} but there is nothing to evaluate on: {where} (allowed: 0, "
                       "or data.eval.path with prompts that are not training prompts)"))
    elif e.every and data.task == "arithmetic" and len(evals) < e.num_prompts:
        issues.append(("data.eval.num_prompts", f"{e.num_prompts}, but the arithmetic task (digits="
                       f"{data.arithmetic.digits}, ops={data.arithmetic.ops}) has only {len(evals)} distinct "
                       f"problems outside its {data.arithmetic.num_prompts} training prompts (allowed: <= "
                       f"{len(evals)}, or more digits / operators)"))
    elif e.every and data.task == "gcd" and len(evals) < e.num_prompts:
        g = data.gcd
        issues.append(("data.eval.num_prompts", f"{e.num_prompts}, but the gcd task (max_value={g.max_value}, "
                       f"max_steps={g.max_steps}) has only {len(evals)} distinct problems outside its "
                       f"{g.num_prompts} training prompts (allowed: <= {len(evals)}, or a larger max_value)"))
    issues += check_prompt_lengths(cfg, train + evals)
    if data.task == "jsonl" or e.path is not None:  # the built-in tasks are generated inside the vocabulary
        issues += check_vocabulary(cfg, [p for p in train + evals if p.source])
    return issues


def check_vocabulary(cfg: CotrainConfig, problems: list, tokenizer: Any = None, limit: int = 3) -> list[Issue]:
    """Prompts and answers whose text the policy's tokenizer turns into its unknown token (the built-in
    character tokenizer knows printable ASCII only): the policy would see ``<unk>`` for them and an
    answer could never be matched. Named by file and line, with the characters."""
    tok = tokenizer or load_policy_tokenizer(cfg.policy.model_path)
    unk = getattr(tok, "unk_token_id", None)
    if unk is None or not problems:
        return []
    texts = [t for p in problems for t in (p.prompt, p.answer)]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    bad = []
    for i, p in enumerate(problems):
        for what, text, row in (("prompt", p.prompt, ids[2 * i]), ("answer", p.answer, ids[2 * i + 1])):
            if unk in row:
                chars = sorted({c for c in text if unk in tok(c, add_special_tokens=False)["input_ids"]})
                bad.append(f"{p.source}: the {what} {text[:30]!r} has characters the policy's tokenizer does not "
                           f"know ({''.join(chars)!r}: they become {tok.unk_token!r})")
    key = "data.eval.path" if cfg.data.task != "jsonl" else "data.jsonl.path"
    more = [f"... and {len(bad) - limit} more"] if len(bad) > limit else []
    return [(key, f"{m} (allowed: text the tokenizer covers; builtin models: printable ASCII)") for m in bad[:limit] + more]


def check_prompt_lengths(cfg: CotrainConfig, problems: list, tokenizer: Any = None) -> list[Issue]:
    """Prompts must fit policy.max_seq_len - rollout.sampling.max_tokens tokens of the policy's
    tokenizer (vLLM refuses a longer one only when the step reaches it). ``tokenizer``: the
    policy's (None = :func:`load_policy_tokenizer`, loaded only if a prompt is long enough to need it)."""
    from cotrain.tasks.data import prompt_length_errors

    S, mt = cfg.policy.max_seq_len, cfg.rollout.sampling.max_tokens
    room = S - mt
    if room < 1:
        return []  # check_lengths reports rollout.sampling.max_tokens
    tok = tokenizer

    def count(prompts: list[str]) -> list[int]:
        nonlocal tok
        tok = tok or load_policy_tokenizer(cfg.policy.model_path)
        return [len(ids) for ids in tok(prompts, add_special_tokens=True)["input_ids"]]

    key = "data.jsonl.path" if cfg.data.task == "jsonl" else f"data.{cfg.data.task}"
    try:
        errors = prompt_length_errors(problems, count, room)
    except Exception as err:  # noqa: BLE001 - a tokenizer that does not load is reported, not raised
        return [("policy.model_path", f"cannot load its tokenizer to measure the prompts ({type(err).__name__}: "
                 f"{err})")]
    return [(key, f"{msg} (policy.max_seq_len={S} - rollout.sampling.max_tokens={mt}; allowed: shorter prompts, "
             "or a larger policy.max_seq_len / smaller rollout.sampling.max_tokens)") for msg in errors]


@functools.lru_cache(maxsize=4)
def load_policy_tokenizer(model_path: str):
    """The tokenizer the engines use for ``policy.model_path`` (``builtin:tiny`` / ``builtin:small``:
    the built-in character tokenizer, without building the model)."""
    if model_path.startswith(_BUILTIN_PREFIX):
        from cotrain.models.tokenizer import build_tokenizer

        return build_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def check_checkpoint(cfg: CotrainConfig) -> list[Issue]:
    """A checkpoint named by path must exist, be complete and match its manifest (file sizes; the
    run also checks the sha256 before loading). ``true`` is checked by the run, which falls back
    past damaged checkpoints (cotrain.checkpoint)."""
    issues: list[Issue] = []
    res = cfg.checkpoint.resume
    if isinstance(res, str) and not Path(res).exists():
        issues.append(("checkpoint.resume", f"{res!r} does not exist (allowed: true, false, or an existing "
                       "checkpoint directory)"))
    elif isinstance(res, str):
        from cotrain.checkpoint import unsafe_files, verify_checkpoint

        problems = verify_checkpoint(Path(res), hashes=False) or unsafe_files(Path(res))
        if problems:
            issues.append(("checkpoint.resume", f"{res!r} is not a usable checkpoint: {'; '.join(problems)} "
                           "(allowed: true = the newest usable one, or a complete, undamaged step directory)"))
    elif res is True and cfg.checkpoint.dir is not None:
        from cotrain.checkpoint import CheckpointManager, unsafe_files

        newest = CheckpointManager(cfg.checkpoint.dir).latest()
        problems = unsafe_files(newest) if newest is not None else []
        if problems:
            issues.append(("checkpoint.resume", f"true resumes from {newest}, which is refused: {'; '.join(problems)} "
                           "(allowed: a checkpoint holding only tensors and plain containers)"))
    if not issues and res is not False:
        issues += resume_issues(cfg, Path(res) if isinstance(res, str) else None)
    from cotrain.runfolder import conflict

    why = conflict(cfg)
    if why is not None:
        issues.append(("run.output_dir", why))
    for key, folder in (("run.output_dir", cfg.run.output_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if folder is not None and (why := unwritable(Path(folder))) is not None:
            issues.append((key, f"{folder!r}: {why} (allowed: a folder this user can create and write)"))
    return issues


def unwritable(folder: Path) -> str | None:
    """Why the run could not create or write ``folder`` (None: it could)."""
    p = folder.absolute()
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        return f"{p} is a file, not a folder"
    import tempfile

    try:  # a real write (root passes os.access checks; a read-only file system does not take the file)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        what = f"{p} is not writable" if p == folder.absolute() else f"cannot be created: {p} is not writable"
        return f"{what} ({e.strerror})"
    return None


def resume_issues(cfg: CotrainConfig, step_dir: Path | None = None) -> list[Issue]:
    """The keys changed since the checkpoint a resume would continue (``step_dir``; None = the newest
    in checkpoint.dir) that it cannot apply (:mod:`cotrain.config.resume`), each at its key."""
    from cotrain.config.resume import diff_against

    if step_dir is None:
        from cotrain.checkpoint import CheckpointManager

        step_dir = CheckpointManager(cfg.checkpoint.dir).latest() if cfg.checkpoint.dir else None
    return diff_against(step_dir, cfg.to_dict())[1] if step_dir is not None else []


def check_env(cfg: CotrainConfig) -> list[Issue]:
    """env and rollout.max_turns (cotrain/envs, cotrain/rl/multiturn.py): a multi-turn environment
    needs a second turn, a one-turn one cannot use one; the keys of a tool environment act only with
    one. (Evaluation, data.eval, runs the same turn loop: GrpoRun.evaluate.)"""
    env, turns = cfg.env, cfg.rollout.max_turns
    defaults = type(env)()
    issues: list[Issue] = []
    if env.kind == "single_turn":
        if turns > 1:
            issues.append(("rollout.max_turns", f"{turns} needs an environment that replies (env.kind: "
                           "calculator); env.kind=single_turn is done after the first turn (allowed: 1)"))
        for key in ("timeout_s", "tool_latency_s"):
            if getattr(env, key) != getattr(defaults, key):
                issues.append((f"env.{key}", "acts only with a multi-turn environment (env.kind: calculator); "
                               "env.kind=single_turn calls no tool"))
    elif turns < 2:
        issues.append(("env.kind", f"{env.kind} needs rollout.max_turns >= 2 (the tool's reply is read in a "
                       f"second turn; rollout.max_turns={turns})"))
    if env.kind != "calculator" and env.calculator != defaults.calculator:
        issues.append(("env.calculator", "acts only with env.kind=calculator"))
    return issues


#: the cross-field checks, in order; each takes (cfg, arch) and returns issues
CHECKS: list[Callable[[CotrainConfig, ModelArch | None], list[Issue]]] = [
    lambda cfg, arch: check_model(cfg, arch) if arch is not None else [],
    lambda cfg, arch: check_lengths(cfg),
    lambda cfg, arch: check_resources(cfg),
    lambda cfg, arch: check_batches(cfg),
    lambda cfg, arch: check_rollout(cfg),
    check_draft,
    lambda cfg, arch: check_data(cfg),
    lambda cfg, arch: check_env(cfg),
    lambda cfg, arch: check_checkpoint(cfg),
]


def check_config(cfg: CotrainConfig) -> CotrainConfig:
    """Resolve null defaults and run every cross-field check (in place; returns ``cfg``).

    Raises ConfigError listing all issues."""
    issues: list[Issue] = []
    arch: ModelArch | None = None
    try:
        arch = load_model_arch(cfg.policy.model_path)
    except ConfigError as e:
        issues += e.issues
    resolve(cfg, arch)
    for check in CHECKS:
        issues += check(cfg, arch)
    if issues:
        raise ConfigError(issues)
    cfg._arch = arch
    return cfg


def config_from_dict(data: dict[str, Any], sources: list[str] | None = None) -> CotrainConfig:
    """Validate a raw mapping (schema, then cross-field checks) into a CotrainConfig."""
    try:
        cfg = CotrainConfig.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e, CotrainConfig) from None
    cfg._sources = list(sources or [])
    return check_config(cfg)
