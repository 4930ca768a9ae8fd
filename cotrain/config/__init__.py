"""Typed, validated configuration of cotrain.

    from cotrain.config import load_config, ConfigError
    cfg = load_config("configs/demo.yaml", ["policy.parallel.pipeline=2"])
    cfg.policy.parallel.pipeline, cfg.world_size, cfg.draft.settings, cfg.model_arch

See docs/config.md for the schema, inheritance, overrides and the checks.
"""

from __future__ import annotations

import os
from typing import Iterable

from .errors import ConfigError
from .loader import apply_overrides, deep_merge, load_merged, parse_override, read_config_dict
from .schema import (
    CheckpointConfig,
    ClusterConfig,
    CotrainConfig,
    DataConfig,
    DFlashConfig,
    DraftConfig,
    DraftKind,
    DraftKindConfig,
    DSparkConfig,
    Eagle3Config,
    GrpoConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    PolicyConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SamplingConfig,
    SpeculativeConfig,
    draft_kinds,
    draft_losses,
    get_draft_kind,
    register_draft_kind,
    speculative_methods,
)
from .validate import ModelArch, check_config, config_from_dict, load_model_arch

__all__ = [
    "load_config",
    "config_from_dict",
    "check_config",
    "ConfigError",
    "CotrainConfig",
    "ModelArch",
    "load_model_arch",
    "register_draft_kind",
    "get_draft_kind",
    "draft_kinds",
    "speculative_methods",
    "DraftKindConfig",
    "Eagle3Config",
    "DFlashConfig",
    "DSparkConfig",
    "draft_losses",
    "DraftKind",
    "RunConfig",
    "ClusterConfig",
    "PolicyConfig",
    "ParallelConfig",
    "OptimizerConfig",
    "RolloutConfig",
    "SamplingConfig",
    "SpeculativeConfig",
    "DraftConfig",
    "GrpoConfig",
    "DataConfig",
    "RewardConfig",
    "LoggingConfig",
    "CheckpointConfig",
    "apply_overrides",
    "deep_merge",
    "load_merged",
    "parse_override",
    "read_config_dict",
]


def load_config(path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> CotrainConfig:
    """Load a YAML config (with its ``defaults:`` chain), apply dotted overrides, validate.

    Returns a CotrainConfig whose null defaults are resolved; raises ConfigError (naming the
    key path and the allowed values) on any problem."""
    data, sources = read_config_dict(path, overrides)
    try:
        return config_from_dict(data, sources)
    except ConfigError as e:
        e.source = str(path)
        raise
