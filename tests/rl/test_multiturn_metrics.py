"""Multi-turn metrics and resume refusals on the real driver with the in-process calculator fakes of
tests/rl/test_multiturn_driver.py (no Ray, vLLM or Megatron; a few seconds each):

- ``reward/accuracy`` is the fraction of right final answers, also with a call cost (the reward of a
  right answer is then reward.correct - call_cost, never reward.correct);
- ``response/length`` counts the policy's tokens only, ``response/env_tokens`` the replies', against
  the texts rebuilt by hand;
- the held-out evaluation (data.eval) runs the same turn loop and counts right final answers;
- a resume that changes the environment (env.kind, env.calculator.*) is refused naming the key, while
  its timing (env.tool_latency_s, env.timeout_s) applies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_multiturn_driver import TOK, CalcRollout, Workers

from cotrain.config import ConfigError, load_config
from cotrain.rl.driver import GrpoRun
from cotrain.rl.multiturn import turn_seed

ROOT = Path(__file__).resolve().parents[2]
BASE = ["grpo.num_steps=2", "grpo.prompts_per_step=2", "grpo.group_size=4", "policy.micro_batch_size=4",
        "logging.tensorboard=false", "logging.progress_bar=false", "checkpoint.every=1", "checkpoint.keep_last=null",
        "checkpoint.export_final=false", "data.eval.every=0"]


class Recording(CalcRollout):
    """CalcRollout, keeping the first-turn prompts (to rebuild the conversations by hand)."""

    def generate(self, prompts, sampling, n):
        if n > 1:
            self.first = [(list(prompts), sampling.seed)]
        return super().generate(prompts, sampling, n)


class RecordingWorkers(Workers):
    def rollout(self, model_path, draft_model):
        self.rollout_ = Recording()
        return self.rollout_


def _run(out: Path, *extra: str, resume=False) -> RecordingWorkers:
    cfg = load_config(str(ROOT / "configs/calc.yaml"), [f"run.output_dir={out}", *BASE, *extra])
    workers = RecordingWorkers()
    run = GrpoRun(cfg, workers=workers)
    try:
        run.setup(resume)
        run.train()
    finally:
        run.shutdown()
    return workers


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_accuracy_with_a_call_cost_and_policy_token_lengths(tmp_path):
    workers = _run(tmp_path, "env.calculator.call_cost=0.25", "grpo.num_steps=1")
    (m,) = _metrics(tmp_path)
    (prompts, seed), = workers.rollout_.first
    policy, replies, right = [], [], []
    for i, p in enumerate(prompts):  # CalcRollout: a call, then the reply copied (a 7 appended on odd seeds)
        expr = p.rstrip("=")
        value = str(eval(expr))  # noqa: S307 - two-digit products of the test's own prompts
        for j in range(4):
            ok = (turn_seed(seed, 2) + 4 * i + j) % 2 == 0  # turn 2: one request per conversation, the k-th seeded s_2 + k
            call, answer = f"<calc>{expr}</calc>", value if ok else value + "7"
            policy.append(len(TOK.encode(call)) + 1 + len(TOK.encode(answer)) + 1)  # each turn ends with <eos>
            replies.append(len(TOK.encode(f"[{value}]")))
            right.append(ok)
    assert m["reward/accuracy"] == sum(right) / len(right) == 0.5  # every other conversation is right
    assert m["reward/mean"] == pytest.approx(0.5 * 1.0 - 0.25)  # reward.correct 1, incorrect 0, one call each
    assert m["response/length"] == pytest.approx(sum(policy) / len(policy))
    assert m["response/env_tokens"] == pytest.approx(sum(replies) / len(replies))
    assert m["env/tool_calls"] == 8 and m["env/turns_mean"] == 2.0


@pytest.mark.parametrize("override, key", [("env.calculator.call_cost=0.5", "env.calculator.call_cost"),
                                           ("env.kind=single_turn", "env.kind")])
def test_resume_refuses_another_environment(tmp_path, override, key):
    out = tmp_path / "run"
    _run(out)
    extra = [override] + (["rollout.max_turns=1"] if key == "env.kind" else [])
    with pytest.raises(ConfigError) as e:
        load_config(str(ROOT / "configs/calc.yaml"), [f"run.output_dir={out}", *BASE, "grpo.num_steps=3",
                                                      "checkpoint.resume=true", *extra])
    assert key in [k for k, _ in e.value.issues] and "which a resume cannot follow" in str(e.value)


def test_resume_applies_the_tools_timing(tmp_path):
    out = tmp_path / "run"
    _run(out)
    _run(out, "grpo.num_steps=3", "env.tool_latency_s=0.01", "env.timeout_s=5", "checkpoint.resume=true", resume=True)
    assert [m["step"] for m in _metrics(out)] == [1, 2, 3]


def test_held_out_evaluation_runs_the_turn_loop(tmp_path):
    workers = _run(tmp_path, "grpo.num_steps=1", "data.eval.every=1", "data.eval.num_prompts=4")
    evals = [m for m in _metrics(tmp_path) if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 1]  # before the first step and after it
    # each evaluation: turn 1 for the 4 problems (one sample each), then turn 2 per conversation
    assert workers.rollout_.calls == [(4, 1), (4, 1), (2, 4), (8, 1), (4, 1), (4, 1)]
    # seed 0; turn 2's conversations are seeded s_2 + k: every other final answer is right
    assert all(m["eval/accuracy"] == 0.5 for m in evals)
