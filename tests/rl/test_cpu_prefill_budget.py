"""Seeded batches past vLLM's CPU token budget per step (4096) on real CPU engines. Without cotrain's
budget (cotrain.config.derived.cpu_prefill_budget, applied to every CPU engine by
cotrain.rl.vllm.engine.engine_kwargs) vLLM prefills one prompt in chunks and then fails rewinding
its seeded generator ("CPU Generator does not use offset"). Here a multi-turn run's later turn
(builtin:calc with the calculator, 32 problems x 8 conversations, whose token-id histories together
pass the budget; one engine start, ~20 s); a single-turn batch of 1,200 seeded prompts runs in
tests/draft/test_samplers_agree.py, and the budget's arithmetic in tests/rl/test_rollout_units.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from cotrain.config import load_config
from cotrain.envs.calculator import CalculatorEnv
from cotrain.rl.interfaces import SamplingSpec
from cotrain.rl.multiturn import TurnLoop
from cotrain.tasks.data import arithmetic_dataset

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_a_turn_past_the_cpu_token_budget_runs(builtin_model_path, tmp_path):
    from transformers import AutoTokenizer

    from cotrain.rl.rollout import VllmGeneration, engine_spec_from_config

    path = builtin_model_path("calc")
    cfg = load_config(str(ROOT / "configs/calc.yaml"), [f"run.output_dir={tmp_path}", "data.eval.every=0"])
    spec = engine_spec_from_config(cfg, model_path=str(path))
    tok = AutoTokenizer.from_pretrained(str(path))
    problems = arithmetic_dataset(32, seed=3, max_digits=2, ops=("*",))
    engine = VllmGeneration(spec)
    try:
        loop = TurnLoop(CalculatorEnv(), tok, max_turns=3, max_seq_len=cfg.policy.max_seq_len, timeout_s=10)
        res = loop.generate(engine, problems, SamplingSpec(temperature=1.0, max_tokens=24, seed=1), n=8)
    finally:
        engine.shutdown()
    samples = [s for row in res.samples for s in row]
    second = [s for s in samples if len(s.turns) >= 2]
    # the histories sent at turn 2, all in one generate call, were more than one CPU step's default budget
    assert sum(len(s.prompt_token_ids) + s.turns[0]["tokens"] + s.turns[0]["observation_tokens"] for s in second) > 4096
    assert len(samples) == 256 and all(s.env_error is None for s in samples)
    assert res.metrics["accuracy"] > 0.3  # the calc policy answers about half right at temperature 1
