"""Environments of multi-turn rollouts (docs/multiturn.md): the interface (:mod:`cotrain.envs.base`),
single-turn tasks as one-turn environments, the built-in calculator task
(:mod:`cotrain.envs.calculator`). Below the rollout loop (:mod:`cotrain.rl.multiturn`), beside the
tasks: imports nothing from cotrain but :mod:`cotrain.tasks`."""

from __future__ import annotations

from cotrain.envs.base import Environment, EnvStep, RewardValues, SingleTurnEnv, Turn, run_tool


def make_env(cfg) -> Environment:
    """The environment of a validated config's ``env`` section (rewards from ``reward``)."""
    from cotrain.envs.calculator import CalculatorEnv

    rewards = RewardValues.from_config(cfg.reward)
    e = cfg.env
    if e.kind == "calculator":
        return CalculatorEnv(rewards, call_cost=e.calculator.call_cost, tool_latency_s=e.tool_latency_s)
    if e.kind == "single_turn":
        return SingleTurnEnv(rewards)
    raise ValueError(f"env.kind={e.kind!r} (allowed: single_turn, calculator)")


__all__ = ["Environment", "EnvStep", "RewardValues", "SingleTurnEnv", "Turn", "make_env", "run_tool"]
