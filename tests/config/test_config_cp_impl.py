"""policy.context_parallel_impl: cotrain's ring attention (default) or Megatron's own CP in
transformer-engine's attention, which validation refuses where it cannot run, saying why."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cotrain.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "tests" / "configs" / "small.yaml"
CUDA2 = ["cluster.device=cuda", "cluster.gpus_per_node=2"]
KEY = "policy.context_parallel_impl"


def issues(overrides: list[str]) -> list[str]:
    try:
        load_config(BASE, overrides)
    except ConfigError as e:
        return [m for p, m in e.issues if p == KEY]
    return []


def test_default_is_cotrain():
    assert load_config(BASE).policy.context_parallel_impl == "cotrain"
    assert issues(["policy.parallel.context=2"]) == []


def test_megatron_te_refused_on_cpu_with_the_reason():
    (msg,) = issues([f"{KEY}=megatron_te"])
    assert "needs CUDA" in msg and "cluster.device=cpu" in msg and "allowed on cpu: cotrain" in msg


def test_megatron_te_needs_transformer_engine_and_bf16_under_cp(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformer_engine"
                        else real(name, *a))
    (msg,) = issues([*CUDA2, f"{KEY}=megatron_te"])
    assert "needs transformer-engine" in msg and "allowed without it: cotrain" in msg
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "transformer_engine"
                        else real(name, *a))
    (msg,) = issues([*CUDA2, f"{KEY}=megatron_te", "policy.parallel.context=2"])
    assert "needs policy.dtype=bfloat16" in msg and "policy.dtype=float32" in msg
    assert issues([*CUDA2, f"{KEY}=megatron_te", "policy.parallel.context=2", "policy.dtype=bfloat16"]) == []
    assert issues([*CUDA2, f"{KEY}=megatron_te"]) == []  # CP=1: TE's attention in any dtype


def test_value_is_checked():
    with pytest.raises(ConfigError, match="cotrain, megatron_te"):
        load_config(BASE, [f"{KEY}=te"])
