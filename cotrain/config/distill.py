"""The offline distillation command's config (``python -m cotrain.draft.distill --config ...``).

It lives with the other schemas so that validation can check a run's ``draft.init: distill:<yaml>``
before anything starts; the command itself is :mod:`cotrain.draft.distill`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import Field

from cotrain.config.schema import DraftConfig, GcdTaskConfig, StrictModel, on_policy_kinds


class DistillDataConfig(StrictModel):
    """Prompts and the target's responses."""

    task: Literal["arithmetic", "gcd", "words", "jsonl"] = "arithmetic"
    """Prompt source: the built-in arithmetic task, the built-in gcd task (``gcd``), the built-in
    words target's copy task (``words``, for target builtin:words), or a JSONL file (``jsonl_path``)."""
    jsonl_path: Optional[str] = None
    """JSONL file with one ``{"prompt": ...}`` object per line (task jsonl)."""
    prompt_key: str = "prompt"
    """Key of the prompt in the JSONL objects."""
    max_digits: Optional[Annotated[int, Field(ge=1, le=9)]] = None
    """Arithmetic task: most digits per operand. null = the built-in tiny model's task."""
    ops: Optional[list[Literal["+", "-", "*"]]] = None
    """Arithmetic task: its operators (builtin:calc's: ``["*"]``). null = the built-in tiny model's."""
    gcd: GcdTaskConfig = Field(default_factory=GcdTaskConfig)
    """Gcd task: its distribution (the defaults are the built-in small model's task)."""
    num_prompts: Annotated[int, Field(ge=1)] = 1000
    """Training prompts."""
    eval_prompts: Annotated[int, Field(ge=1)] = 200
    """Held-out prompts for the acceptance estimate."""
    max_new_tokens: Annotated[int, Field(ge=1)] = 16
    """Longest response."""
    tail_tokens: Annotated[int, Field(ge=0)] = 8
    """Target greedy tokens kept after EOS (at least the number of draft tokens you serve with)."""
    temperature: Annotated[float, Field(ge=0)] = 0.0
    """Sampling temperature of the responses (0 = greedy)."""
    seed: int = 7
    """Seed of the prompts and of response sampling."""


class DistillTrainConfig(StrictModel):
    """The optimisation loop."""

    steps: Annotated[int, Field(ge=1)] = 300
    """Optimizer steps."""
    batch_size: Annotated[int, Field(ge=1)] = 32
    """Sequences per step."""
    eval_every: Annotated[int, Field(ge=0)] = 50
    """Acceptance estimate every this many steps (0 = only at the end)."""
    num_speculative_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    """Draft tokens k of the acceptance estimate. null = the drafter's default."""
    seed: int = 0
    """Seed of the drafter's initialisation and of batch / anchor sampling."""


class DistillConfig(StrictModel):
    """Offline distillation of a drafter from a target."""

    target: str = "builtin:tiny"
    """The target: 'builtin:tiny', 'builtin:small', 'builtin:words' or a Hugging Face checkpoint directory."""
    output_dir: str = "runs/distill"
    """Where the drafter, metrics and curves go."""
    threads: Optional[Annotated[int, Field(ge=1)]] = 1
    """torch CPU threads (null = leave torch's default). The tiny shapes run fastest on one thread,
    and many threads on a busy machine can be much slower."""
    progress_bar: bool = True
    """Show a tqdm progress bar."""
    draft: DraftConfig = Field(default_factory=lambda: DraftConfig.model_validate(
        {"kind": "eagle3", "optimizer": {"lr": 3e-3, "warmup_steps": 20, "schedule": "cosine", "min_lr": 1e-4}}))
    """The drafter (same section as a cotrain run's ``draft``); ``kind`` must be set."""
    data: DistillDataConfig = Field(default_factory=DistillDataConfig)
    """Prompts and responses."""
    train: DistillTrainConfig = Field(default_factory=DistillTrainConfig)
    """Optimisation."""


#: draft.* keys that only a GRPO run's online co-training reads
ONLINE_ONLY_KEYS = frozenset({"cotrain", "init", "push_every", "tap_transport", "tap_timeout_s", "compare_frozen"})


def load_distill_config(path: Optional[str | Path] = None, overrides: list[str] = ()) -> DistillConfig:
    from cotrain.config.loader import deep_merge, load_merged, parse_override

    data: dict[str, Any] = {}
    if path is not None:
        data, _ = load_merged(path)
    for text in overrides:
        keys, value = parse_override(text)
        patch: Any = value
        for key in reversed(keys):
            patch = {key: patch}
        data = deep_merge(data, patch)
    cfg = DistillConfig.model_validate(data)
    if cfg.draft.kind is None:
        raise ValueError("draft.kind must name a drafter (eagle3, dflash, dspark)")
    fields = type(cfg.draft).model_fields
    unused = sorted(k for k in ONLINE_ONLY_KEYS if getattr(cfg.draft, k) != fields[k].default)
    if unused:
        raise ValueError(f"draft.{unused[0]}: used only by a GRPO run's co-training, not by offline distillation "
                         f"(remove {', '.join('draft.' + k for k in unused)})")
    if getattr(cfg.draft.settings, "vocab_rebuild_every", 0):
        raise ValueError(f"draft.{cfg.draft.kind}.vocab_rebuild_every: used only by a GRPO run's co-training; "
                         "offline distillation builds the draft vocabulary once, from its data (set it to 0)")
    cfg.draft.loss = cfg.draft.loss or cfg.draft.record.default_loss
    if cfg.draft.loss not in cfg.draft.record.losses:
        raise ValueError(f"draft.loss: {cfg.draft.loss!r} is not allowed for kind {cfg.draft.kind!r} "
                         f"(allowed: {', '.join(cfg.draft.record.losses)})")
    from cotrain.config.validate import check_accept_weighted

    for path, msg in check_accept_weighted(cfg.draft):
        raise ValueError(f"{path}: {msg}")
    if cfg.draft.branches == "on_policy" and cfg.draft.record.branches is None:
        raise ValueError(f"draft.branches: on_policy is built for kinds {', '.join(on_policy_kinds())} "
                         f"(cotrain.draft.specopd), not {cfg.draft.kind!r}")
    return cfg
