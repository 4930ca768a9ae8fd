"""The typed configuration schema of cotrain.

Every section is a strict pydantic v2 model: unknown keys are errors, values are not coerced
between types (``"2"`` is not an int, ``true`` is not a number), and every field has a default so a
config file only states what differs from ``configs/base.yaml``. Each field's docstring is its
documentation (``docs/config.md`` is generated from them by ``python -m cotrain.config.docgen``).

Values left ``null`` with a documented "null = ..." meaning are resolved by
:func:`cotrain.config.validate.check_config`, so a validated :class:`CotrainConfig` holds concrete
values (``cluster.device`` is ``cpu`` or ``cuda``, ``run.output_dir`` is set, ...).

Drafter kinds come from a registry (:func:`register_draft_kind`): one :class:`DraftKind` record per
kind names its config model (a :class:`DraftKindConfig` subclass, the ``draft.<kind>`` section),
its drafter class (imported on first use, by :mod:`cotrain.draft.registry`: this layer stays
torch-free), the vLLM method that serves it and the losses it trains with; the schema, validation
and the drafter registry all read that record. ``eagle3``, ``dflash`` and ``dspark`` are
registered here; a new kind plugs in by registering its record, without editing any union.
"""

from __future__ import annotations

import importlib
import re
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

__all__ = [
    "StrictModel",
    "RunConfig",
    "ClusterConfig",
    "ParallelConfig",
    "OptimizerConfig",
    "PolicyConfig",
    "SamplingConfig",
    "NgramConfig",
    "SuffixConfig",
    "SpeculativeConfig",
    "RolloutConfig",
    "DraftKindConfig",
    "DraftKind",
    "Eagle3Config",
    "DFlashConfig",
    "DSparkConfig",
    "DraftConfig",
    "GrpoConfig",
    "ArithmeticConfig",
    "JsonlConfig",
    "EvalConfig",
    "DataConfig",
    "RewardConfig",
    "CalculatorEnvConfig",
    "EnvConfig",
    "WandbConfig",
    "MlflowConfig",
    "LoggingConfig",
    "CheckpointConfig",
    "CotrainConfig",
    "draft_losses",
    "register_draft_kind",
    "get_draft_kind",
    "draft_kinds",
    "speculative_methods",
]

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
PosFloat = Annotated[float, Field(gt=0)]


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are errors, no type coercion, docs from docstrings."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        validate_default=True,
        use_attribute_docstrings=True,
        allow_inf_nan=False,  # lr=.inf or reward.correct=.nan would validate and train on NaN
    )


# --------------------------------------------------------------------------------------------- run
class RunConfig(StrictModel):
    """Identity of the run and where it writes."""

    name: str = "cotrain"
    """Run name: names the default output directory and the run in TensorBoard / W&B / MLflow
    (letters, digits, `.`, `_`, `-`)."""
    output_dir: str | None = None
    """Directory for everything the run writes (TensorBoard events, checkpoints, the resolved
    config). null = `runs/<name>` (relative to the working directory)."""
    seed: int = 0
    """Global seed: data order, sampling seeds, initialisation of new weights."""
    overwrite: bool = False
    """A fresh run (no `checkpoint.resume`) into a folder that already holds a run (its metrics,
    checkpoints, TensorBoard events, `run.json`): true = delete that run's files first; false =
    refused at validation, naming the folder (resume it, overwrite it, or choose another
    `run.output_dir`). `launch/grpo.py --overwrite` sets true."""

    @field_validator("name")
    @classmethod
    def _name_chars(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", v):
            raise ValueError(f"{v!r} has characters outside [A-Za-z0-9._-]")
        return v


# ----------------------------------------------------------------------------------------- cluster
_RAY_ADDRESS_FORMS = "null, 'local', 'auto', 'ray://HOST:PORT', 'http://HOST:PORT', 'HOST:PORT'"


class ClusterConfig(StrictModel):
    """The Ray cluster and the resources the run may use.

    Validation checks the run's needs against these numbers (see docs/config.md, "Resources").
    When cotrain starts a local Ray it passes `cpus_per_node` / `gpus_per_node` to `ray.init`,
    so on CPU `cpus_per_node` is a count of *logical* Ray CPUs and may exceed the cores.
    """

    ray_address: str | None = None
    """Ray cluster to join. null = the cluster of `ray job submit` if the job set RAY_ADDRESS,
    else start a local Ray; 'local' = always start a local Ray; 'auto' = an already running
    cluster on this machine; 'ray://HOST:PORT', 'http://HOST:PORT' (the dashboard, e.g.
    http://127.0.0.1:8265) or 'HOST:PORT' (the GCS) = that cluster."""
    num_nodes: PosInt = 1
    """Number of nodes the run uses. 1 = actors are scheduled as Ray places them (one machine). More:
    one placement group reserves every trainer rank's and engine's resources on a chosen node
    (docs/multinode.md): ranks in Megatron's order (TP fastest, then CP, DP, PP) in whole TP x CP
    groups per node, spread evenly over the trainer nodes, so the pipeline crosses nodes and TP / CP
    groups never do."""
    engine_nodes: NonNegInt = 0
    """With num_nodes > 1: 0 = the rollout engines share the trainers' nodes (spread evenly, next to
    the ranks); n = the last n nodes run engines only (and no trainer rank). Must be below num_nodes."""
    cpus_per_node: PosInt | None = None
    """Ray CPUs per node (every node of the run must have them). null = the CPU count of the machine
    running the driver."""
    gpus_per_node: NonNegInt = 0
    """GPUs per node (0 on CPU machines)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the trainers and engines. auto = cuda when gpus_per_node > 0, else cpu."""

    @field_validator("ray_address")
    @classmethod
    def _address_form(cls, v: str | None) -> str | None:
        if v is None or v in ("local", "auto"):
            return v
        if re.fullmatch(r"(ray|https?)://[^\s/:]+(:\d+)?/?", v) or re.fullmatch(r"[^\s/:]+:\d+", v):
            return v
        raise ValueError(f"{v!r} is not a Ray address (allowed: {_RAY_ADDRESS_FORMS})")


# ------------------------------------------------------------------------------------------ policy
class ParallelConfig(StrictModel):
    """Megatron parallel degrees of the policy. World size = tensor * pipeline * context * data."""

    tensor: PosInt = 1
    """Tensor parallel degree (TP): must divide the attention heads and the key/value heads."""
    pipeline: PosInt = 1
    """Pipeline parallel degree (PP): must divide the number of layers."""
    context: PosInt = 1
    """Context parallel degree (CP): sequences are split in 2*CP zigzag chunks, so
    policy.max_seq_len must be divisible by 2*CP."""
    data: PosInt = 1
    """Data parallel degree (DP)."""


class OptimizerConfig(StrictModel):
    """AdamW settings."""

    lr: PosFloat = 1e-5
    """Peak learning rate."""
    betas: Annotated[list[Annotated[float, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)] = [
        0.9,
        0.999,
    ]
    """Adam betas [beta1, beta2]."""
    eps: PosFloat = 1e-8
    """Adam epsilon."""
    weight_decay: NonNegFloat = 0.0
    """Decoupled weight decay."""
    clip_grad: NonNegFloat = 1.0
    """Clip the global gradient norm to this value (0 = no clipping)."""
    warmup_steps: NonNegInt = 0
    """Linear warm-up over the first warmup_steps optimizer steps: the k-th step (from 1) runs at
    lr * k / warmup_steps. For the policy it must be below the run's optimizer steps (grpo.num_steps
    * prompts_per_step * group_size / global_batch_size * epochs)."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warm-up: constant lr, or a cosine decay from lr to min_lr over
    the rest of the run's optimizer steps (the policy's is logged as train/lr)."""
    min_lr: NonNegFloat = 0.0
    """Final learning rate of the cosine schedule (at most lr)."""


class PolicyConfig(StrictModel):
    """The policy being trained (a megatron-core GPTModel built from a HF checkpoint)."""

    model_path: str = "builtin:tiny"
    """'builtin:tiny' = the built-in tiny Qwen3 model (0.8 M parameters, task arithmetic),
    'builtin:small' = the built-in small one (10.4 M, task gcd), each built and cached locally on
    first use (docs/models.md); else a Hugging Face checkpoint directory (config.json + safetensors)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter / compute dtype of trainers and engines."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """Parallel degrees."""
    context_parallel_impl: Literal["cotrain", "megatron_te"] = "cotrain"
    """The policy's attention and its context parallelism: 'cotrain' = Megatron's local attention,
    and under policy.parallel.context > 1 cotrain's zigzag ring attention (cotrain.parallel; CPU
    and GPU); 'megatron_te' = Megatron's own context parallelism inside transformer-engine's
    attention (TEDotProductAttention, at any CP degree; GPU with transformer-engine installed,
    and policy.dtype=bfloat16 when context > 1). The co-trained drafter's branch attention is
    cotrain's either way."""
    layer_spec: Literal["auto", "local", "transformer_engine"] = "auto"
    """Megatron's layer implementation of the policy: 'local' = torch modules (CPU and GPU);
    'transformer_engine' = Megatron's fused transformer-engine layer spec (the input norms folded
    into the QKV / FC1 linears; cluster.device=cuda with transformer-engine installed); 'auto' =
    transformer_engine when transformer-engine imports and cluster.device is cuda, else local.
    Under policy.parallel.context > 1 with context_parallel_impl 'cotrain', cotrain's ring
    attention is the attention core of either spec."""
    micro_batch_size: PosInt = 4
    """Sequences per micro batch on one data-parallel rank (policy.packing=false); with packing it
    sets the default token budget, micro_batch_size * max_seq_len."""
    packing: bool = True
    """The update's layout: true = each micro batch's sequences laid end to end (THD: cu_seqlens,
    attention inside each sequence, positions restarting), micro batches filled up to
    max_tokens_per_microbatch and balanced over micro batches and data-parallel ranks; false =
    every sequence right-padded to the step's longest, micro_batch_size rows per micro batch (the
    padded layout, for comparison: docs/grpo.md)."""
    max_tokens_per_microbatch: PosInt | None = None
    """Token budget of one packed micro batch on one data-parallel rank (the sequences' lengths,
    each rounded up to a multiple of 2 * context parallel size); null = micro_batch_size *
    max_seq_len. At least max_seq_len (the longest sequence fits). Only with packing=true."""
    logprob_chunk_tokens: Annotated[int, Field(ge=0)] | None = None
    """Log-probs (and their backward) computed over chunks of this many positions of a micro
    batch, so that the [tokens, vocab] logits of the whole micro batch are never alive at once
    (recomputed chunk by chunk in the backward); null = auto (chunks whose fp32 logits take at
    most 256 MiB: no chunking at a small vocabulary), 0 = the whole micro batch at once."""
    max_seq_len: Annotated[int, Field(ge=2)] = 256
    """Longest prompt + response in tokens (at most the model's max_position_embeddings)."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """Policy optimizer."""
    reference_model: bool = False
    """Keep a frozen copy of the initial policy for the KL-to-reference metric and penalty
    (required when grpo.kl_coef > 0)."""
    cpus_per_worker: PosInt = 1
    """Ray CPUs reserved by each training worker (one worker per rank)."""


# ----------------------------------------------------------------------------------------- rollout
class SamplingConfig(StrictModel):
    """Sampling parameters of the rollouts."""

    temperature: NonNegFloat = 1.0
    """Sampling temperature (0 = greedy: top_k / top_p do not apply)."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling mass (1 = off). The trainer's log-probs (and the drafter's target) are of
    the same filtered distribution: vLLM's kept set of the tempered logits, the rest at -inf."""
    top_k: int = -1
    """Top-k sampling (-1 = off, else >= 1); applied in the trainer's log-probs too, as top_p."""
    max_tokens: PosInt = 32
    """Maximum generated tokens per sample (must be < policy.max_seq_len)."""

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError(f"{v} is not allowed (allowed: -1 = off, or >= 1)")
        return v


class NgramConfig(StrictModel):
    """Prompt-lookup (n-gram) speculation settings."""

    prompt_lookup_min: PosInt = 1
    """Smallest n-gram matched in the prompt."""
    prompt_lookup_max: PosInt = 4
    """Largest n-gram matched in the prompt (>= prompt_lookup_min)."""


class SuffixConfig(StrictModel):
    """Settings of method 'suffix' (vLLM's suffix decoding; needs the arctic-inference package, the
    'suffix' extra: see docs/rollout.md)."""

    max_tree_depth: PosInt = 24
    """Depth of the suffix trees: the longest context suffix matched plus the tokens drafted from
    it (vLLM's suffix_decoding_max_tree_depth)."""
    max_cached_requests: NonNegInt = 10000
    """Earlier responses each engine keeps in its global suffix tree (oldest evicted first); 0 =
    no global tree, each request drafts from its own prompt and response only."""
    max_spec_factor: NonNegFloat = 1.0
    """Draft at most max_spec_factor x (length of the matched suffix) tokens per step (and at most
    num_speculative_tokens)."""
    min_token_prob: Annotated[float, Field(ge=0, le=1)] = 0.1
    """Draft a token only if its frequency after the matched suffix in the tree is at least this."""


class SpeculativeConfig(StrictModel):
    """Speculative decoding in the rollout engines (vLLM `speculative_config`)."""

    method: str | None = None
    """null (off), 'ngram', 'draft_model', a drafter method: 'eagle3', 'dflash', 'dspark'
    (every registered drafter kind), or 'suffix'. A drafter method needs draft.kind of the same
    name (the co-trained drafter) or an explicit draft_model. 'ngram' (prompt lookup) and 'suffix'
    (suffix trees over the prompt and the engine's earlier responses; needs the arctic-inference
    package) are model-free."""
    num_speculative_tokens: PosInt | None = None
    """Draft tokens proposed per step. null = the drafter's default (dflash: block_size - 1, the
    block being the bonus token plus its drafts; dspark: block_size; 3 otherwise). For 'suffix' the
    most per step: it drafts fewer when its match is short or uncertain."""
    draft_model: str | None = None
    """Directory of drafter weights in vLLM's format: required for 'draft_model'; for a drafter
    method it is the initial drafter (co-trained from there when draft.cotrain)."""
    ngram: NgramConfig = Field(default_factory=NgramConfig)
    """Settings of method 'ngram'."""
    suffix: SuffixConfig = Field(default_factory=SuffixConfig)
    """Settings of method 'suffix'."""
    draft_sample_method: Literal["greedy", "probabilistic"] = "greedy"
    """How the drafter proposes tokens: its argmax, or sampled from its distribution q (verified with
    min(1, p / q); lossless either way, tested). Which accepts more depends on the drafter:
    docs/specopd.md."""
    batch_size_schedule: list[Annotated[list[NonNegInt], Field(min_length=3, max_length=3)]] | None = None
    """Speculation by batch size (vLLM's num_speculative_tokens_per_batch_size): a list of
    [first, last, k] with inclusive batch-size ranges starting at 1, sorted and non-overlapping;
    k draft tokens at those batch sizes (0 = plain decoding, at most num_speculative_tokens).
    Speculation pays when few sequences are running (the rollout's tail) and can cost more than
    it saves at large batch: `python -m cotrain.rl.calibrate` measures and writes a schedule.
    null = num_speculative_tokens at every batch size."""

    @field_validator("method")
    @classmethod
    def _method(cls, v: str | None) -> str | None:
        if v is not None and v not in speculative_methods():
            allowed = ", ".join(["null", *speculative_methods()])
            raise ValueError(f"{v!r} is not a speculative method (allowed: {allowed})")
        return v


class RolloutConfig(StrictModel):
    """Rollout (generation) engines: one vLLM engine per Ray actor."""

    engine: Literal["vllm"] = "vllm"
    """Generation backend."""
    num_engines: PosInt = 1
    """Number of engines."""
    tensor_parallel: PosInt = 1
    """Tensor parallel degree inside each engine (must divide the attention heads; on cuda an
    engine's GPUs are on one node)."""
    cpus_per_engine: PosInt = 1
    """Ray CPUs reserved by each engine."""
    gpus_per_engine: NonNegFloat | None = None
    """Ray GPUs reserved by each engine. null = tensor_parallel on cuda (0.5 * tensor_parallel when
    colocated), 0 on cpu. Colocated, each of the engine's tensor_parallel workers takes
    gpus_per_engine / tensor_parallel of a trainer rank's GPU and the rank the rest (strictly
    between 0 and 1: Ray's books only; memory is split by gpu_memory_utilization)."""
    colocate: bool = False
    """Engines share the training workers' GPUs instead of having their own (cuda only): every
    trainer rank's GPU is one placement-group bundle that an engine worker shares (docs/multinode.md,
    "Colocated engines"); the engines sleep while the trainers run (vLLM's sleep mode: weights to
    host memory, KV cache freed), the trainers offload their optimizer states while the engines run,
    and the engines wake before the weight push; engines x tensor_parallel GPUs must fit the
    trainers' GPUs, and gpu_memory_utilization defaults to 0.4. vLLM's CPU backend has no sleep mode."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = None
    """Fraction of device memory for weights + KV cache (of RAM on cpu). Exclusive with
    kv_cache_memory_bytes. When both are null: cpu -> kv_cache_memory_bytes = 256 MiB;
    cuda -> 0.85 (0.4 when colocated)."""
    kv_cache_memory_bytes: PosInt | None = None
    """Explicit KV-cache size in bytes (exclusive with gpu_memory_utilization)."""
    enforce_eager: bool | None = None
    """Disable CUDA graphs / compilation. null = true on cpu, false on cuda."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling parameters."""
    max_turns: PosInt = 1
    """Policy turns per rollout (multi-turn rollouts with an environment, env.kind; docs/multiturn.md).
    1 = single-turn: one response per sample (needs env.kind=single_turn). > 1: after each turn the
    environment replies (its tokens appended, never trained) and generation continues on the whole
    history, until the environment is done, max_turns turns, or the next turn would not fit
    policy.max_seq_len (history + reply + rollout.sampling.max_tokens); each sample is its own
    conversation after turn 1."""
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    """Speculative decoding."""
    weight_transport: Literal["auto", "shm", "object_store", "cuda_ipc", "nccl"] = "auto"
    """How trained weights reach the engines: shm (CPU bytes in shared memory, one node);
    object_store (shm for the engines on trainer rank 0's node, Ray's object store for the other
    nodes: the bytes cross once per node); cuda_ipc (colocated GPUs); nccl (broadcast group of
    trainer rank 0 and every engine). auto = on cuda cuda_ipc when colocated on one node, nccl
    otherwise; on cpu shm on one node, object_store on several."""


# -------------------------------------------------------------------------------------- draft kinds
#: the losses every drafter trains with (cotrain.draft.losses); a kind's record adds its own
COMMON_LOSSES: tuple[str, ...] = ("soft_ce", "forward_kl", "hard_ce", "e2e_tv", "accept_weighted_tv")


def spread_layers(n: int, lo: int, hi: int) -> list[int]:
    """``n`` distinct layer ids spread evenly over ``[lo, hi]`` (fewer when the range is smaller)."""
    if hi < lo or n < 1:
        return []
    if n == 1:
        return [(lo + hi) // 2]
    return sorted({round(lo + i * (hi - lo) / (n - 1)) for i in range(n)})


class DraftKindConfig(StrictModel):
    """Base of a drafter kind's settings (the ``draft.<kind>`` section).

    Subclasses set the class variables and may override the ``default_*`` methods and
    :meth:`check`. Tap layer ids count decoder layers from 0 and name the layer whose *output*
    is tapped (0 <= id < num_hidden_layers); export code translates to vLLM's conventions. What
    is not a setting (the drafter class, the vLLM method, the losses) is in the kind's
    :class:`DraftKind` record.
    """

    tap_layers: list[Annotated[int, Field(ge=0)]] | None = None
    """Target layers whose outputs feed the drafter (0-based). null = the kind's default."""

    @property
    def default_loss(self) -> str:
        """The loss when draft.loss is null (the kind's record's)."""
        return next(k for k in _DRAFT_KINDS.values() if k.config is type(self)).default_loss

    def default_tap_layers(self, num_hidden_layers: int) -> list[int]:
        """Tap layers used when ``tap_layers`` is null."""
        return spread_layers(3, 0, num_hidden_layers - 1)

    def default_num_speculative_tokens(self) -> int:
        """rollout.speculative.num_speculative_tokens when it is null."""
        return 3

    def max_speculative_tokens(self) -> int | None:
        """Most draft tokens per step this drafter is trained for (None: no limit)."""
        return None

    def check(self, num_hidden_layers: int) -> list[tuple[str, str]]:
        """Cross-checks against the target; returns (path relative to the section, message)."""
        issues: list[tuple[str, str]] = []
        taps = self.tap_layers or []
        if self.tap_layers is not None and not taps:
            issues.append(("tap_layers", "must list at least one layer "
                           f"(allowed: ids in 0..{num_hidden_layers - 1}, or null = default)"))
        for i, t in enumerate(taps):
            if not 0 <= t < num_hidden_layers:
                issues.append((f"tap_layers[{i}]", f"{t} is not a layer of the target "
                               f"(allowed: 0..{num_hidden_layers - 1}; num_hidden_layers="
                               f"{num_hidden_layers})"))
        if len(set(taps)) != len(taps):
            issues.append(("tap_layers", f"{taps} has duplicates (allowed: distinct ids in "
                           f"0..{num_hidden_layers - 1})"))
        return issues

    def check_vocab(self, vocab_size: int) -> list[tuple[str, str]]:
        """Cross-checks against the target's vocabulary size (path, message)."""
        return []

    def resolve(self, num_hidden_layers: int) -> None:
        """Fill null fields that depend on the target."""
        if self.tap_layers is None:
            self.tap_layers = self.default_tap_layers(num_hidden_layers)


class Eagle3Config(DraftKindConfig):
    """EAGLE-3: taps of three target layers -> fc -> one decoder layer -> LM head, trained with
    train-time test (TTT)."""

    tap_layers: list[Annotated[int, Field(ge=0)]] | None = None
    """Target layers whose outputs feed the drafter. null = low/middle/high: (1, L/2-1, L-4)
    for L >= 8 layers, else three spread evenly over 0..L-1."""
    ttt_steps: PosInt = 3
    """Unrolled train-time-test passes k (>= 1)."""
    num_layers: PosInt = 1
    """Decoder layers of the drafter."""
    draft_vocab_size: PosInt | None = None
    """Size N of the drafter's own vocabulary: its LM head and loss cover only the N most frequent
    target tokens, and the export carries vLLM's d2t (target id = draft id + d2t[draft id]); a target
    token outside it is never drafted. Real targets (150k tokens) use 32000, SpecForge's and vLLM's
    default. Built from token counts: offline from the distillation data's response tokens; when
    co-training, the initial drafter's mapping (draft.init) or, from scratch, the first step's
    rollout tokens (that step then takes no drafter update). null (or the target's vocab_size) = the
    whole vocabulary, no d2t."""
    vocab_rebuild_every: NonNegInt = 0
    """Co-training with a reduced draft vocabulary: every this many GRPO steps, rebuild the mapping
    from the rollout tokens counted since the last rebuild (after that step's drafter update); tokens
    that stay keep their LM head rows and optimizer state, new tokens start from the policy's LM head
    rows. The next drafter push carries the new head with its d2t (every push carries both).
    0 = the mapping stays fixed."""

    def default_tap_layers(self, num_hidden_layers: int) -> list[int]:
        n = num_hidden_layers
        if n >= 8:
            return [1, n // 2 - 1, n - 4]
        return spread_layers(3, 0, n - 1)

    def check(self, num_hidden_layers: int) -> list[tuple[str, str]]:
        issues = super().check(num_hidden_layers)
        if self.vocab_rebuild_every and self.draft_vocab_size is None:
            issues.append(("vocab_rebuild_every", f"{self.vocab_rebuild_every} needs a reduced vocabulary "
                           "(set draft_vocab_size, or vocab_rebuild_every: 0)"))
        return issues

    def check_vocab(self, vocab_size: int) -> list[tuple[str, str]]:
        if self.draft_vocab_size is not None and self.draft_vocab_size > vocab_size:
            return [("draft_vocab_size", f"{self.draft_vocab_size} exceeds the target's vocabulary of {vocab_size} "
                     f"tokens (allowed: 1..{vocab_size}, or null = the whole vocabulary)")]
        return []

    def reduced_vocab(self, vocab_size: int) -> bool:
        """Whether the drafter has a reduced vocabulary (a d2t) on a target of ``vocab_size`` tokens."""
        return self.draft_vocab_size is not None and self.draft_vocab_size < vocab_size


class DFlashConfig(DraftKindConfig):
    """DFlash block drafter: a few decoder layers over projected target taps, one block of
    anchor + mask tokens, bidirectional inside the block."""

    tap_layers: list[Annotated[int, Field(ge=0)]] | None = None
    """Target layers whose outputs feed the drafter. null = num_layers layers spread from 1 to
    L-3 (the middle one when num_layers = 1); over 0..L-1 for L < 6."""
    num_layers: PosInt = 1
    """Decoder layers of the drafter."""
    block_size: Annotated[int, Field(ge=2)] = 16
    """Block length B = anchor + B-1 predicted tokens (>= 2)."""
    anchors_per_seq: PosInt = 4
    """Anchors (blocks) sampled per training sequence."""
    anchor_sampling: Literal["uniform", "balanced"] = "uniform"
    """How anchors are drawn among a sequence's response positions: uniform = uniformly per
    sequence (the same draw at any CP size); balanced = stratified by the CP rank that owns each
    anchor so that the drafter's attention work is even across CP ranks (cotrain.parallel.balance;
    the draw then depends on the CP size)."""
    loss_gamma: PosFloat | None = 7.0
    """Position decay of the loss: weight of block position k is exp(-(k-1)/gamma). null =
    uniform weights."""

    def default_tap_layers(self, num_hidden_layers: int) -> list[int]:
        n, k = num_hidden_layers, self.num_layers
        if n >= 6:
            return [n // 2] if k == 1 else spread_layers(k, 1, n - 3)
        return spread_layers(max(k, 2), 0, n - 1)

    def default_num_speculative_tokens(self) -> int:
        return self.block_size - 1

    def max_speculative_tokens(self) -> int | None:
        return self.block_size - 1


class DSparkConfig(DFlashConfig):
    """DSpark: the DFlash backbone plus a low-rank Markov head on the logits and an optional
    confidence head. vLLM serves it on GPU only."""

    block_size: Annotated[int, Field(ge=2)] = 7
    """Block length B = anchor + B-1 noise tokens (>= 2). Every block position predicts the next
    token (vLLM's anchor-as-first layout), so a block drafts B tokens."""
    markov_rank: PosInt = 16
    """Rank r of the Markov head (logits += W2 W1[previous token])."""
    markov_head: Literal["vanilla", "gated"] = "vanilla"
    """Markov head variant: vanilla (logits += W2 W1[prev]) or gated (the bias scaled by
    sigmoid(g . h)); vLLM serves only vanilla."""
    confidence_head: bool = False
    """Train a head predicting per-position acceptance (BCE against 1 - 0.5 * L1(p, q))."""
    l1_weight: NonNegFloat = 1.0
    """Weight of the L1 distance between target and drafter probabilities in the dspark_l1 loss."""
    confidence_weight: NonNegFloat = 1.0
    """Weight of the confidence head's BCE in the dspark_l1 loss."""

    def default_num_speculative_tokens(self) -> int:
        return self.block_size

    def max_speculative_tokens(self) -> int | None:
        return self.block_size


# ----------------------------------------------------------------------------- draft kind registry
@dataclass(frozen=True)
class DraftKind:
    """Everything cotrain knows about one drafter kind, registered once (:func:`register_draft_kind`)."""

    name: str
    """``draft.kind``'s value, and the section ``draft.<name>``."""
    config: type[DraftKindConfig]
    """The section's settings model."""
    model: str
    """``"module:Class"`` of its :class:`cotrain.draft.registry.Drafter` (imported on first use)."""
    vllm_method: str | None
    """The rollout.speculative.method that serves it in vLLM (None: not servable)."""
    losses: tuple[str, ...] = COMMON_LOSSES
    """The values draft.loss may take for it."""
    default_loss: str = "soft_ce"
    """draft.loss when it is null."""
    serves_on_cpu: bool = True
    """Whether vLLM serves its method on the CPU backend."""
    anchors: str = "every"
    """Where its training chains start: ``"every"`` supervised position, or ``"sampled"``: up to
    ``anchors_per_seq`` drawn among the drafter's ``anchor_candidates`` (its ``anchor_sampling``)."""
    branches: str | None = None
    """How cotrain.draft.specopd draws its on-policy branches: ``"block"`` (one drafter call) or
    ``"eagle3"`` (k passes); None: draft.branches=on_policy is refused for it."""
    vocab_rows: str | None = None
    """The parameter whose rows follow its reduced draft vocabulary (the optimizer's state moves with
    them on a rebuild); None: no reduced vocabulary."""

    def model_class(self) -> type:
        """The drafter class (imports its module)."""
        module, _, cls = self.model.partition(":")
        return getattr(importlib.import_module(module), cls)


_DRAFT_KINDS: dict[str, DraftKind] = {}
_RESERVED_DRAFT_KEYS = frozenset({"kind", "cotrain", "loss", "branches", "optimizer", "settings", "init",
                                  "push_every", "tap_transport", "tap_timeout_s"})


def register_draft_kind(kind: DraftKind, *, replace: bool = False) -> None:
    """Register a drafter kind: ``draft.kind: <kind.name>`` selects it and ``draft.<kind.name>`` holds
    its settings, validated by ``kind.config`` (a :class:`DraftKindConfig` subclass).

    Re-registering the same name needs ``replace=True`` (e.g. to extend a built-in kind with a
    settings subclass that adds fields).
    """
    name = kind.name
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"drafter kind name {name!r} must match [a-z][a-z0-9_]*")
    if name in _RESERVED_DRAFT_KEYS:
        raise ValueError(f"drafter kind name {name!r} clashes with a draft.* key")
    if not (isinstance(kind.config, type) and issubclass(kind.config, DraftKindConfig)):
        raise TypeError(f"{kind.config!r} is not a DraftKindConfig subclass")
    if kind.anchors not in ("every", "sampled"):
        raise ValueError(f"drafter kind {name!r}: anchors {kind.anchors!r} is not 'every' or 'sampled'")
    if kind.branches not in (None, "block", "eagle3"):
        raise ValueError(f"drafter kind {name!r}: branches {kind.branches!r} is not None, 'block' or 'eagle3'")
    if kind.default_loss not in kind.losses:
        raise ValueError(f"drafter kind {name!r}: default_loss {kind.default_loss!r} is not one of its losses "
                         f"{kind.losses}")
    if name in _DRAFT_KINDS and _DRAFT_KINDS[name] != kind and not replace:
        raise ValueError(f"drafter kind {name!r} is already registered "
                         f"({_DRAFT_KINDS[name].config.__name__}); pass replace=True")
    _DRAFT_KINDS[name] = kind


def get_draft_kind(name: str) -> DraftKind:
    """The record of a registered drafter kind (KeyError lists the registered kinds)."""
    try:
        return _DRAFT_KINDS[name]
    except KeyError:
        raise KeyError(f"unknown drafter kind {name!r} (registered: {', '.join(draft_kinds())})") from None


def draft_kinds() -> tuple[str, ...]:
    """Names of the registered drafter kinds, in registration order."""
    return tuple(_DRAFT_KINDS)


def draft_losses() -> tuple[str, ...]:
    """Every value draft.loss may take for some registered kind (besides null)."""
    return tuple(dict.fromkeys(loss for k in _DRAFT_KINDS.values() for loss in k.losses))


def on_policy_kinds() -> tuple[str, ...]:
    """The registered kinds whose on-policy (SpecOPD) branches cotrain.draft.specopd draws."""
    return tuple(n for n, k in _DRAFT_KINDS.items() if k.branches is not None)


def speculative_methods() -> tuple[str, ...]:
    """Values rollout.speculative.method may take (besides null)."""
    methods = ["ngram", "draft_model"]
    for kind in _DRAFT_KINDS.values():
        if kind.vllm_method and kind.vllm_method not in methods:
            methods.append(kind.vllm_method)
    if "suffix" not in methods:
        methods.append("suffix")  # model-free, like ngram (listed last: no drafter kind serves it)
    return tuple(methods)


register_draft_kind(DraftKind("eagle3", Eagle3Config, "cotrain.draft.eagle3:Eagle3Drafter", vllm_method="eagle3",
                              branches="eagle3", vocab_rows="lm_head.weight"))
register_draft_kind(DraftKind("dflash", DFlashConfig, "cotrain.draft.dflash:DFlashDrafter", vllm_method="dflash",
                              anchors="sampled", branches="block"))
register_draft_kind(DraftKind("dspark", DSparkConfig, "cotrain.draft.dspark:DSparkDrafter", vllm_method="dspark",
                              losses=COMMON_LOSSES + ("dspark_l1",), default_loss="dspark_l1", serves_on_cpu=False,
                              anchors="sampled", branches="block"))


# ------------------------------------------------------------------------------------------- draft
class DraftBudgetConfig(StrictModel):
    """How many optimizer steps the co-trained drafter takes per GRPO step (cotrain.draft.budget)."""

    mode: Literal["fixed", "adaptive"] = "fixed"
    """fixed = one drafter step on every GRPO step's rollouts. adaptive = as many as the measured
    acceptance says (0 while the drafter keeps up, more the further its recent acceptance falls
    below the window's, one while it is still improving, one every probe_every steps; changes
    within twice the measured noise do not count), within max_update_share; the extra steps train
    on the replay window. The decision reads only measured data (acceptance, token
    counts), never the clock: a run and its resume decide alike."""
    max_steps: PosInt = 4
    """adaptive: the most drafter optimizer steps in one GRPO step (> 1: the extra ones on the
    replay window; needs draft.branches: teacher_forced)."""
    max_update_share: Annotated[float, Field(gt=0, le=1)] = 0.15
    """adaptive: the drafter's share of the update's work over the run, in estimated FLOPs
    (6 x its parameters x its chain positions per step, against 2 x the policy's parameters x the
    batch's tokens per forward of the update): a credit that idle steps save and a falling
    drafter spends, at most max_steps steps' worth."""
    tolerance: PosFloat = 0.05
    """adaptive: a change of the acceptance gain (acceptance - 1) by more than this share, beyond
    the measured noise, counts: below the window's mean by more = falling behind (one more step
    per tolerance behind), above its level when it last trained by more = still improving."""
    probe_every: PosInt = 8
    """adaptive, when the engines do not serve the co-trained drafter: an idle drafter still takes
    one step every this many GRPO steps (its offline acceptance is measured only when it trains;
    the engines' acceptance of a served drafter needs no probe)."""
    recent_steps: PosInt = 3
    """adaptive: the drafter's current level is the mean acceptance of this many latest steps,
    compared with the mean of the steps before them in the memory_steps window (one step's
    acceptance varies by several percent of its gain; the thresholds add twice the measured noise)."""
    memory_steps: PosInt = 16
    """adaptive: the window of measured acceptance the decision reads (its reference is the mean
    of this window before the recent steps: a policy that moved on for good leaves it)."""
    measure_idle: bool = False
    """adaptive: on an idle step (no drafter step) the drafter - and with draft.compare_frozen its
    frozen copy - is still scored on the step's chains, as a training step scores them (one forward
    each on the log-prob recomputation's taps; no backward, no optimizer step, nothing replayed),
    so draft/acceptance_offline(_frozen) has a point every step; its seconds are draft/measure_s,
    outside time/draft. When the engines do not serve the co-trained drafter this measured
    acceptance is also the budget's signal on the next step (the probe_every probes still run). false: an idle step has no draft/*
    metrics."""
    replay_steps: PosInt = 4
    """adaptive with max_steps > 1: the replay window holds the drafter inputs (taps, the policy's
    detached logits, the rows) of the last this many GRPO steps on which it trained; older ones
    leave it (the drafter stays on the current policy)."""
    replay_max_mib: PosFloat = 1024.0
    """adaptive with max_steps > 1: the replay window's memory bound on each last-stage rank (MiB;
    the oldest microbatches leave first). The window is part of the checkpoint."""


class DraftConfig(StrictModel):
    """The drafter co-trained with the policy. Besides the keys below, ``draft.<kind>`` holds the
    settings of each registered kind (eagle3, dflash, dspark, ...); only the active kind's
    section is used and cross-checked. Access them as ``cfg.draft.settings`` (the active kind)
    or ``cfg.draft.eagle3``."""

    kind: str | None = None
    """Drafter kind: null (no drafter) or a registered kind (eagle3, dflash, dspark)."""
    cotrain: bool = True
    """Train the drafter online on the policy's rollouts (ignored when kind is null). false =
    serve fixed drafter weights (rollout.speculative.draft_model)."""
    loss: str | None = None
    """Drafter loss: soft_ce / forward_kl against the detached policy distribution, hard_ce on
    the sampled tokens, dspark_l1 (DSpark only: CE + L1 of probabilities), e2e_tv (prefix
    acceptance surrogate), accept_weighted_tv (each position's TV weighted by the detached
    acceptance probability of the drafts the branch drew before it; needs draft.branches:
    on_policy); each kind allows the losses of its registration. null = the kind's
    default (dspark_l1 for dspark, else soft_ce)."""
    branches: Literal["teacher_forced", "on_policy"] = "teacher_forced"
    """Where the supervised draft tokens come from: teacher_forced = chains on the reference
    (rollout / distillation) tokens; on_policy = SpecOPD branches the drafter samples itself from
    random anchors, scored by the target in one tree-masked forward (cotrain.draft.specopd; dflash,
    dspark and eagle3, whose branch is scored with its bonus token). In co-training the policy itself
    scores them, attending to the stem keys/values of the log-prob recomputation (docs/cotrain.md;
    at pipeline > 1 after the schedule, through the pipeline)."""
    optimizer: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig(lr=1e-4))
    """Drafter optimizer (its own AdamW, LR schedule over grpo.num_steps and gradient clipping,
    outside the policy's)."""
    init: str | None = None
    """Initial drafter weights when co-training: null = from scratch (seeded by run.seed), a
    drafter directory (the distill command's <output_dir>/drafter), or 'distill:<yaml>' = the
    cached offline distillation of that distill config (built on first use)."""
    compare_frozen: bool = False
    """Also keep a frozen copy of the initial drafter (draft.init) beside the co-trained one and
    report, every step, its offline acceptance on the same chains (draft/acceptance_offline_frozen,
    beside draft/acceptance_offline): what a frozen drafter would accept on this run's own policy
    trajectory, the drift co-training corrects. Costs one forward of the copy per microbatch (no
    backward) and the copy's memory on the last stage. Needs draft.cotrain and draft.init."""
    push_every: PosInt = 1
    """Push the co-trained drafter into the engines every this many steps."""
    budget: DraftBudgetConfig = Field(default_factory=DraftBudgetConfig)
    """Drafter optimizer steps per GRPO step: one each (fixed) or decided from the measured
    acceptance within a share of the update (adaptive; cotrain.draft.budget, docs/cotrain.md)."""
    tap_transport: Literal["auto", "shm", "gloo", "nccl", "cuda_ipc"] = "auto"
    """How taps from earlier pipeline stages reach the drafter's stage (TapChannel). auto = per
    source stage by its link: a source on the drafter's node shm (CPU) / cuda_ipc (GPU), one on
    another node gloo / nccl (from the ranks' Ray node ids at start; on one CPU node auto resolves
    to shm; on CUDA a source that does not see the drafter's GPU - Ray gives each actor its own
    GPU - gets nccl). A name = that transport for every source (shm / cuda_ipc only within a node)."""
    tap_timeout_s: PosFloat = 120.0
    """Seconds the drafter's stage waits for a tap (or a writer for a free slot) before the step
    fails with an error naming the layer and source rank."""

    _kinds: dict[str, DraftKindConfig] = PrivateAttr(default_factory=dict)

    @field_validator("kind")
    @classmethod
    def _kind_registered(cls, v: str | None) -> str | None:
        if v is not None and v not in _DRAFT_KINDS:
            allowed = ", ".join(["null", *draft_kinds()])
            raise ValueError(f"{v!r} is not a registered drafter kind (allowed: {allowed})")
        return v

    @field_validator("loss")
    @classmethod
    def _loss_known(cls, v: str | None) -> str | None:
        if v is not None and v not in draft_losses():
            raise ValueError(f"{v!r} is not a drafter loss (allowed: {', '.join(['null', *draft_losses()])})")
        return v

    @model_validator(mode="wrap")
    @classmethod
    def _split_kind_sections(cls, data: Any, handler: Any) -> DraftConfig:
        if isinstance(data, DraftConfig):
            return data
        if not isinstance(data, dict):
            return handler(data)
        rest = dict(data)
        kinds: dict[str, DraftKindConfig] = {}
        line_errors: list[dict[str, Any]] = []
        for name, kind in _DRAFT_KINDS.items():
            kcls = kind.config
            section = rest.pop(name, None)
            try:
                if isinstance(section, kcls):
                    kinds[name] = section
                else:
                    kinds[name] = kcls.model_validate({} if section is None else section)
            except ValidationError as e:
                line_errors += [_prefixed(err, name) for err in e.errors()]
        try:
            obj = handler(rest)
        except ValidationError as e:
            line_errors = [dict(err) for err in e.errors()] + line_errors
            obj = None
        if line_errors:
            raise ValidationError.from_exception_data(cls.__name__, line_errors)
        obj._kinds = kinds
        return obj

    @model_serializer(mode="wrap")
    def _dump_with_kinds(self, handler: Any, info: Any) -> dict[str, Any]:
        out = handler(self)
        for name, section in self._kinds.items():
            out[name] = section.model_dump(mode=info.mode)
        return out

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            private = object.__getattribute__(self, "__pydantic_private__") or {}
            kinds = private.get("_kinds") or {}
            if name in kinds:
                return kinds[name]
        return super().__getattr__(name)  # type: ignore[misc]

    @property
    def settings(self) -> DraftKindConfig | None:
        """Settings of the active kind (None when kind is null)."""
        return self._kinds.get(self.kind) if self.kind else None

    @property
    def record(self) -> DraftKind | None:
        """The active kind's registration (None when kind is null)."""
        return _DRAFT_KINDS[self.kind] if self.kind else None

    def kind_settings(self, name: str) -> DraftKindConfig:
        """Settings of any registered kind."""
        return self._kinds[name]


def _prefixed(err: Any, prefix: str) -> dict[str, Any]:
    out = {"type": err["type"], "loc": (prefix, *err["loc"]), "input": err["input"]}
    if err.get("ctx"):
        out["ctx"] = err["ctx"]
    return out


# -------------------------------------------------------------------------------------------- grpo
class GrpoConfig(StrictModel):
    """The GRPO algorithm."""

    num_steps: PosInt = 20
    """GRPO steps (rollout + update) to run (>= 1)."""
    prompts_per_step: PosInt = 8
    """Prompts sampled per step."""
    group_size: PosInt = 4
    """Samples per prompt (>= 2: advantages are relative within a group)."""
    clip_eps_low: NonNegFloat = 0.2
    """Lower clip range of the importance ratio (1 - eps_low)."""
    clip_eps_high: NonNegFloat = 0.2
    """Upper clip range of the importance ratio (1 + eps_high)."""
    kl_coef: NonNegFloat = 0.0
    """Weight of the KL penalty to the reference policy (> 0 needs policy.reference_model)."""
    baseline: Literal["mean", "leave_one_out"] = "mean"
    """Group baseline: the group mean, or the mean of the other samples."""
    normalize_std: bool = True
    """Divide advantages by the group's reward standard deviation."""
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """Loss aggregation: mean over all tokens, or mean over sequences of per-sequence means."""
    global_batch_size: PosInt | None = None
    """Sequences per optimizer step (a mini-batch of consecutive sequences; its loss is its own
    token or sequence mean). null = prompts_per_step * group_size (one optimizer step per epoch);
    otherwise it must divide that and be a multiple of policy.parallel.data *
    policy.micro_batch_size."""
    epochs: PosInt = 1
    """Passes over each step's rollouts: a GRPO step takes prompts_per_step * group_size /
    global_batch_size optimizer steps per pass, the mini-batches in a seeded random order, all
    against the log-probs of the policy that sampled the rollouts (PPO-style: from the second
    optimizer step on the ratio leaves 1 and the clipping acts)."""
    log_ratio_clamp: PosFloat | None = 20.0
    """Clamp the log importance ratio log(pi/pi_old), and k3's log(ref/pi), to +-this before exp()
    (verl clamps both at 20; NeMo-RL's KL input clamp is 20). It only keeps exp() finite: on-policy
    the ratio is ~1. null = no clamp."""
    clip_ratio_c: Annotated[float, Field(gt=1)] | None = 3.0
    """Dual-clip PPO (verl's clip_ratio_c, default 3): for a token with a negative advantage the
    surrogate is floored at clip_ratio_c * advantage, so a ratio that has run far above 1 cannot
    make one token's loss (and gradient) unbounded. > 1; null = no dual clip."""
    kl_clamp: PosFloat | None = 10.0
    """Cap of each token's k3 KL penalty (verl and NeMo-RL cap at 10); the kl/ref metric stays
    unclamped. null = no cap."""
    min_groups_with_signal: NonNegInt = 1
    """A step updates the policy only if at least this many of its groups carry a learning signal
    (rewards not all equal; a group of equal rewards has advantage 0 for every sample). Fewer: the
    step takes no optimizer step - the policy's weights, optimizer state and LR schedule stay
    exactly as they were - while the co-trained drafter still trains on its rollouts (the current
    policy's real outputs). 0 = always step (Adam's moments then move the weights on a zero
    gradient). At most prompts_per_step."""
    resample_rounds: NonNegInt = 0
    """DAPO's dynamic sampling: a step may draw up to this many further rounds of prompts_per_step
    prompts (each round its own seed), keeping only the groups whose rewards differ, until it holds
    prompts_per_step of them (the first in draw order: the step keeps its shape). Still short after
    the last round: the step is filled with the groups without signal it drew (advantage 0) and
    min_groups_with_signal decides whether it updates. Reported: grpo/groups_with_signal,
    grpo/resampled_prompts. reward/* stay the first round's (an unbiased sample of the policy).
    0 = off: every group drawn is trained on."""
    max_staleness: NonNegInt = 0
    """Asynchronous GRPO: the rollouts of step t are sampled by the policy of step t-1-k (k =
    max_staleness; the initial policy while t-1-k < 0), so that while step t updates, the engines
    already generate the rollouts of steps t+1..t+k. The schedule is fixed (not "at most k"), so a
    seeded run is deterministic, and the k steps of samples in flight are in every checkpoint. The
    drafter co-trains on every batch and the engines serve the newest pushed drafter. Pushes land
    between engine calls, never inside a request. Needs rollout.colocate=false (colocated engines
    and trainers take turns on the same devices: nothing to overlap). 0 = synchronous."""
    importance_correction: Literal["none", "tis", "mis"] = "none"
    """Correction of the loss for the gap between the policy that sampled (the engines' log-probs:
    stale by up to max_staleness versions, and a different implementation) and the policy the update
    starts from (the trainer's recomputed log-probs), by the per-token ratio w = pi_old / pi_behaviour:
    tis = truncated IS, each token's policy-gradient term times min(w, importance_cap); mis = masked
    IS, tokens with w > importance_cap leave the loss (its sum and its token count), the others
    weighted by w. Reported: train/is_ratio_mean, train/is_truncated_frac. none = no correction (the
    loss is exactly the uncorrected one)."""
    importance_cap: Annotated[float, Field(ge=1)] = 2.0
    """The cap C of grpo.importance_correction (tis truncates at it, mis rejects above it); >= 1."""


# -------------------------------------------------------------------------------------------- data
class ArithmeticConfig(StrictModel):
    """The built-in arithmetic task (final answer checked exactly)."""

    digits: Annotated[int, Field(ge=1, le=9)] = 2
    """Most digits per operand (each operand has 1..digits digits). The built-in tiny model is
    warm-started on 2 digits with '+'."""
    ops: Annotated[list[Literal["+", "-", "*"]], Field(min_length=1)] = ["+"]
    """Operators to draw from."""
    num_prompts: PosInt = 1000
    """Size of the generated training prompt set."""
    seed: int = 0
    """Seed of the prompt generator."""


class GcdTaskConfig(StrictModel):
    """The built-in gcd task's distribution (shared by GRPO's data.gcd and distillation's data.gcd)."""

    max_value: Annotated[int, Field(ge=1, le=9999)] = 99
    """Largest operand (both operands are drawn from 1..max_value)."""
    mean_steps: Annotated[float, Field(ge=1.0)] = 5.0
    """Mean of the geometric distribution the number of solution steps is drawn from (before the
    max_steps cut): larger = longer responses."""
    max_steps: Annotated[int, Field(ge=1, le=200)] = 15
    """Most solution steps (longer problems are not drawn); 15 steps of operands up to 99 take up to
    120 tokens, so keep rollout.sampling.max_tokens above ~8 x max_steps (a cut-off solution has no
    final answer: a format error)."""


class GcdConfig(GcdTaskConfig):
    """The built-in gcd task: ``"gcd(84,36)="`` answered with a worked solution by Euclid's
    subtractive algorithm, the final answer after ``=>`` checked exactly
    (``84-36=48,48-36=12,36-12=24,24-12=12,12-12=0=>12``; cotrain/tasks/gcd.py). Solutions take
    one step (a==b) to max_steps, about 8 tokens a step: a long tail of response lengths. The
    built-in small model is warm-started on the defaults."""

    num_prompts: PosInt = 1000
    """Size of the generated training prompt set."""
    seed: int = 0
    """Seed of the prompt generator."""


class JsonlConfig(StrictModel):
    """Prompts from a JSON-lines file (one object per line)."""

    path: str | None = None
    """The file (required when data.task is jsonl; must exist)."""
    prompt_key: str = "prompt"
    """Key of the prompt text."""
    answer_key: str = "answer"
    """Key of the reference answer."""


class EvalConfig(StrictModel):
    """Periodic evaluation on held-out prompts: an evaluation prompt is never a training prompt."""

    every: NonNegInt = 0
    """Evaluate every this many steps (0 = off)."""
    num_prompts: PosInt = 64
    """Prompts per evaluation (distinct). arithmetic, gcd: drawn from the task's distribution,
    excluding the training prompts; jsonl without path: held out of the training file (with a fixed seed),
    at most as many as leave grpo.prompts_per_step training prompts."""
    path: str | None = None
    """JSONL file of evaluation prompts (same keys as data.jsonl; prompts also in the training file
    are dropped from it). null = held-out prompts of the task: for jsonl, removed from training
    when every > 0."""
    temperature: NonNegFloat = 0.0
    """Sampling temperature of evaluation (0 = greedy)."""


class DataConfig(StrictModel):
    """Training prompts."""

    task: Literal["arithmetic", "gcd", "jsonl"] = "arithmetic"
    """Prompt source: the built-in arithmetic task (short answers; builtin:tiny's), the built-in
    gcd task (worked solutions with a long tail of lengths; builtin:small's), or a JSONL file."""
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    """Settings of task 'arithmetic'."""
    gcd: GcdConfig = Field(default_factory=GcdConfig)
    """Settings of task 'gcd'."""
    jsonl: JsonlConfig = Field(default_factory=JsonlConfig)
    """Settings of task 'jsonl'."""
    shuffle: bool = True
    """Shuffle the prompts each epoch (seeded by run.seed)."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation."""


class RewardConfig(StrictModel):
    """Reward function."""

    kind: Literal["exact_match"] = "exact_match"
    """exact_match: the final answer equals the reference."""
    correct: float = 1.0
    """Reward of a correct answer."""
    incorrect: float = 0.0
    """Reward of a wrong answer."""
    format_error: float = 0.0
    """Reward of a response without a well-formed answer (a format error): its answer (the first
    line, stripped) is empty, or the reference answer is a number and the answer is not one
    (cotrain/tasks/rewards.py). 0.0 = the same as a wrong answer; set it below reward.incorrect to
    penalise malformed output (must be < reward.correct). The fraction of format errors is the
    metric reward/format_error."""


# ---------------------------------------------------------------------------------------- env
class CalculatorEnvConfig(StrictModel):
    """The built-in calculator task (cotrain/envs/calculator.py): the policy may answer
    `<calc>37*48</calc>`, the environment replies `[1776]`, and the policy's next turn is its final
    answer, graded by exact match (reward.*)."""

    call_cost: NonNegFloat = 0.0
    """Reward subtracted per tool call (0 = calls are free)."""


class EnvConfig(StrictModel):
    """The environment the rollouts talk to between the policy's turns (cotrain/envs;
    docs/multiturn.md)."""

    kind: Literal["single_turn", "calculator"] = "single_turn"
    """single_turn: the data's problems answered in one turn, rewarded by reward.* (every run before
    multi-turn rollouts; rollout.max_turns = 1). calculator: the built-in calculator tool on the data's
    problems (rollout.max_turns >= 2; builtin:calc is warm-started on it with data.task=arithmetic,
    ops ['*'])."""
    timeout_s: PosFloat = 30.0
    """Longest wait for one environment step (a tool call): a step that takes longer ends its sample
    with the error tool_timeout (counted in the rollout metrics env/error/*, never failing the run).
    Acts only with a multi-turn env.kind."""
    tool_latency_s: NonNegFloat = 0.0
    """Artificial latency added to every tool call (seconds; the calls of a turn wait concurrently),
    for benchmarks of the environment's share of the step. Acts only with a multi-turn env.kind."""
    calculator: CalculatorEnvConfig = Field(default_factory=CalculatorEnvConfig)
    """Settings of env.kind 'calculator'."""


# ----------------------------------------------------------------------------------------- logging
class WandbConfig(StrictModel):
    """Weights & Biases."""

    enabled: bool = False
    """Log to W&B."""
    project: str = "cotrain"
    """W&B project."""
    entity: str | None = None
    """W&B entity (null = the default)."""
    mode: Literal["online", "offline"] = "online"
    """W&B mode."""


class MlflowConfig(StrictModel):
    """MLflow."""

    enabled: bool = False
    """Log to MLflow."""
    tracking_uri: str | None = None
    """Tracking URI. null = <output_dir>/mlruns."""
    experiment: str = "cotrain"
    """Experiment name."""


class LoggingConfig(StrictModel):
    """Metrics and progress output."""

    tensorboard: bool = True
    """Write TensorBoard events."""
    tensorboard_dir: str | None = None
    """Where. null = <output_dir>/tensorboard."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases."""
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    """MLflow."""
    log_every: PosInt = 1
    """Log metrics every this many steps."""
    progress_bar: bool = True
    """Show a progress bar."""


# -------------------------------------------------------------------------------------- checkpoint
class CheckpointConfig(StrictModel):
    """Checkpoints (policy, drafter, optimizers, step, RNG, data position)."""

    dir: str | None = None
    """Checkpoint directory. null = <output_dir>/checkpoints."""
    every: PosInt = 10
    """Write a checkpoint every this many steps (>= 1; the last step is always saved)."""
    keep_last: PosInt | None = 2
    """Keep only the newest this many checkpoints (null = keep all)."""
    resume: bool | str = False
    """true = continue from the newest checkpoint in dir (start fresh if there is none); a path
    = continue from that checkpoint; false = start fresh. `launch/grpo.py --resume` sets true."""
    export_final: bool = True
    """At the end of the run, export its last checkpoint into <output_dir>/export: policy/ (a
    Hugging Face checkpoint) and, when co-trained, drafter/ (vLLM's drafter format), what
    `python -m cotrain.export` writes. false = no export."""


# -------------------------------------------------------------------------------------------- root
class CotrainConfig(StrictModel):
    """The whole configuration of a cotrain run."""

    run: RunConfig = Field(default_factory=RunConfig)
    """Run identity and output directory."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Ray cluster and resources."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    """Policy model, parallelism, optimizer."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout engines, sampling, speculative decoding."""
    draft: DraftConfig = Field(default_factory=DraftConfig)
    """Co-trained drafter."""
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    """GRPO algorithm."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Prompts."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """Environment of the rollouts (multi-turn, tools)."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metrics output."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoints."""

    _arch: Any = PrivateAttr(default=None)
    _sources: list[str] = PrivateAttr(default_factory=list)

    # derived values ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Training ranks: TP * PP * CP * DP."""
        p = self.policy.parallel
        return p.tensor * p.pipeline * p.context * p.data

    @property
    def rollout_batch_size(self) -> int:
        """Sequences generated per step: prompts_per_step * group_size."""
        return self.grpo.prompts_per_step * self.grpo.group_size

    @property
    def micro_batches_per_update(self) -> int | None:
        """Padded micro batches per data-parallel rank per optimizer step (gradient accumulation;
        with policy.packing their number follows the batch's token counts)."""
        gbs = self.grpo.global_batch_size or self.rollout_batch_size
        denom = self.policy.parallel.data * self.policy.micro_batch_size
        return gbs // denom if gbs % denom == 0 else None

    @property
    def model_arch(self) -> Any:
        """The policy's architecture numbers (a :class:`cotrain.config.validate.ModelArch`), set
        by validation; None before."""
        return self._arch

    @property
    def sources(self) -> list[str]:
        """Files (in merge order) and overrides this config was loaded from."""
        return list(self._sources)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of all values (JSON/YAML-safe)."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        """YAML of all values; loading it back gives the same config."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)


# ------------------------------------------------------------------------------ schema navigation
def _unwrap(annotation: Any) -> Any:
    """Strip Annotated / Optional; return the inner type."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
            continue
        if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) == 1:
                annotation = args[0]
                continue
        return annotation


def section_class(annotation: Any) -> type[BaseModel] | None:
    """The config model class a field holds, if it is a section."""
    inner = _unwrap(annotation)
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return inner
    return None


def section_keys(cls: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    """Keys valid in a section: field name -> sub-section class (None for a leaf value)."""
    keys: dict[str, type[BaseModel] | None] = {
        name: section_class(f.annotation) for name, f in cls.model_fields.items()
    }
    if issubclass(cls, DraftConfig):
        keys.update({name: kind.config for name, kind in _DRAFT_KINDS.items()})
    return keys
