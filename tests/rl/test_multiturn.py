"""Multi-turn rollouts (cotrain.rl.multiturn, cotrain.envs) on a scripted generation backend: the
two-turn calculator conversation against a hand-built reference (tokens, log-probs, loss mask,
reward, the requests and their seeds), the batch and packed micro batch it becomes, the named
errors of a tool that raises, hangs or replies untokenizable text, the turn and token budgets, and
the config checks. No engine: the backend is a deterministic function of the history and seed."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from cotrain.envs import EnvStep, Environment, RewardValues, SingleTurnEnv, Turn, make_env
from cotrain.envs.calculator import CalculatorEnv, evaluate, reply, tool_call
from cotrain.models.tokenizer import build_tokenizer
from cotrain.rl.batch import build_batch
from cotrain.rl.interfaces import GenerationBackend, GenerationResult, Sample, SamplingSpec
from cotrain.rl.multiturn import ENV_ERRORS, TurnLoop, turn_seed
from cotrain.tasks.data import Problem

TOK = build_tokenizer()
EOS = TOK.eos_token_id


def lp_of(k: int, seed: int) -> float:
    return -0.01 * (k + 1) - 1e-4 * (seed % 7)


class ScriptedBackend(GenerationBackend):
    """Answers each request with ``policy(history_text, seed)`` + <eos>; log-prob of the k-th token
    ``lp_of(k, seed)``. Seeds as the engines give them: request i, sample j -> seed + i * n + j."""

    def __init__(self, policy):
        self.policy, self.calls = policy, []

    def generate(self, prompts, sampling, n):
        self.calls.append({"prompts": list(prompts), "seed": sampling.seed, "n": n, "max_tokens": sampling.max_tokens})
        out = []
        for i, p in enumerate(prompts):
            ids = TOK.encode(p) if isinstance(p, str) else list(p)
            row = []
            for j in range(n):
                seed = sampling.seed + i * n + j
                text = self.policy(TOK.decode(ids, skip_special_tokens=True), seed)
                toks = (TOK.encode(text) + [EOS])[: sampling.max_tokens]
                row.append(Sample(prompt_index=i, prompt_token_ids=list(ids), token_ids=toks,
                                  logprobs=[lp_of(k, seed) for k in range(len(toks))], text=TOK.decode(toks, skip_special_tokens=True),
                                  finish_reason="stop" if toks[-1] == EOS else "length", weight_version=3))
            out.append(row)
        return GenerationResult(out, {"time_s": 0.01})

    def push(self, kind, handle, version):
        return {}

    def sleep(self):
        pass

    def wake_up(self):
        pass


def calc_policy(history: str, seed: int) -> str:
    """Calls the calculator on the prompt's expression, then copies its reply (wrong when seed % 3 == 0)."""
    if "[" not in history:
        return f"<calc>{history.split('=')[0]}</calc>"
    got = history.rsplit("[", 1)[1].split("]")[0]
    return got if seed % 3 else got + "1"


SAMPLING = SamplingSpec(temperature=1.0, max_tokens=24, seed=1000)


def test_two_turn_calculator_sample_by_hand():
    backend = ScriptedBackend(calc_policy)
    env = CalculatorEnv(RewardValues(1.0, 0.0, -0.5), call_cost=0.125)
    loop = TurnLoop(env, TOK, max_turns=3, max_seq_len=128, timeout_s=5.0)
    problems = [Problem("12*34=", "408"), Problem("7*8=", "56")]
    res = loop.generate(backend, problems, SAMPLING, n=2)

    # the requests: turn 1 one per problem with n samples (as single-turn), turn 2 one per conversation
    assert [c["n"] for c in backend.calls] == [2, 1]
    assert backend.calls[0]["prompts"] == ["12*34=", "7*8="] and backend.calls[0]["seed"] == 1000
    assert backend.calls[1]["seed"] == turn_seed(1000, 2) == 1000 + 2**48

    prompt = TOK.encode("12*34=")
    t1 = TOK.encode("<calc>12*34</calc>") + [EOS]
    obs = TOK.encode("[408]")
    for j, s in enumerate(res.samples[0]):
        seed1 = 1000 + j  # turn 1: problem 0, sample j
        seed2 = turn_seed(1000, 2) + j  # turn 2: the j-th live conversation
        answer = "408" if seed2 % 3 else "4081"
        t2 = TOK.encode(answer) + [EOS]
        assert backend.calls[1]["prompts"][j] == prompt + t1 + obs  # the whole history, as token ids
        assert s.prompt_token_ids == prompt
        assert s.token_ids == t1 + obs + t2
        assert s.loss_mask == [1] * len(t1) + [0] * len(obs) + [1] * len(t2)
        assert s.logprobs == ([lp_of(k, seed1) for k in range(len(t1))] + [0.0] * len(obs)
                              + [lp_of(k, seed2) for k in range(len(t2))])
        assert s.text == answer and s.finish_reason == "stop" and s.env_error is None
        assert s.reward == pytest.approx((1.0 if answer == "408" else 0.0) - 0.125)
        assert [t["observation"] for t in s.turns] == ["[408]", None]
        assert [t["tokens"] for t in s.turns] == [len(t1), len(t2)]
        assert [t["reward"] for t in s.turns] == [-0.125, 1.0 if answer == "408" else 0.0]
        assert s.weight_version == 3
    assert res.metrics["env/tool_calls"] == 4 and res.metrics["env/steps"] == 8 and res.metrics["turns_mean"] == 2
    assert res.metrics["env/errors"] == 0 and res.metrics["env_tokens"] == 2 * 5 + 2 * 4  # [408], [56]
    n_right = sum(s.text == p.answer for row, p in zip(res.samples, problems) for s in row)
    assert res.metrics["accuracy"] == n_right / 4

    # the same seeds give the same groups
    again = TurnLoop(env, TOK, max_turns=3, max_seq_len=128, timeout_s=5.0).generate(
        ScriptedBackend(calc_policy), problems, SAMPLING, n=2)
    assert [[s.token_ids for s in row] for row in again.samples] == [[s.token_ids for s in row] for row in res.samples]

    # the training batch: only the policy's tokens are response targets, the reply's log-probs are 0
    s = res.samples[0][0]
    batch = build_batch([s], [1.0], pad_id=TOK.pad_token_id)
    start = len(prompt) - 1
    want = torch.zeros(batch.seq_len)
    want[start:start + len(s.token_ids)] = torch.tensor(s.loss_mask, dtype=torch.float32)
    assert torch.equal(batch.mask[0], want)
    assert batch.targets[0][batch.mask[0].bool()].tolist() == t1 + s.token_ids[len(t1) + len(obs):]
    assert bool((batch.rollout_logprobs[0][~batch.mask[0].bool()] == 0).all())
    assert batch.lengths.tolist() == [len(prompt) + len(s.token_ids) - 1]  # the last token is no input


def test_single_turn_batch_unchanged_by_the_loss_mask_field():
    """A sample without a loss mask lays out as before; an all-ones mask gives the identical batch."""
    from dataclasses import replace

    a = Sample(0, [5, 6, 7], [8, 9, 2], [-0.1, -0.2, -0.3], "", "stop", 0)
    b = Sample(1, [5, 6], [4, 3], [-0.5, -0.25], "", "stop", 0)
    ref = build_batch([a, b], [1.0, -1.0], pad_id=0, multiple_of=4)
    ones = build_batch([replace(a, loss_mask=[1, 1, 1]), replace(b, loss_mask=[1, 1])], [1.0, -1.0], pad_id=0,
                       multiple_of=4)
    for f in ("inputs", "targets", "mask", "rollout_logprobs", "lengths", "advantages"):
        assert torch.equal(getattr(ref, f), getattr(ones, f)), f
    with pytest.raises(ValueError, match="loss_mask has 2 entries for 3 response tokens"):
        build_batch([replace(a, loss_mask=[1, 1])], [0.0], pad_id=0)


def test_packed_micro_batch_keeps_the_turn_mask():
    """The packed update (cotrain.rl.packing) trains on the batch's mask: env tokens stay out."""
    from cotrain.rl.packing import pack

    a = Sample(0, [5, 6], [8, 9, 2, 40, 41, 7, 2], [-0.1, -0.2, -0.3, 0, 0, -0.4, -0.5], "", "stop", 0,
               loss_mask=[1, 1, 1, 0, 0, 1, 1])
    b = Sample(1, [5, 6, 7], [4, 2], [-0.5, -0.25], "", "stop", 0)
    batch = build_batch([a, b], [1.0, -1.0], pad_id=0)
    for cp in (1, 2):
        ranks = [pack(batch, [0, 1], cp=cp, rank=r) for r in range(cp)]
        got = torch.zeros_like(batch.mask)
        for mb in ranks:
            mb.scatter(mb.mask, got)
        assert torch.equal(got, batch.mask)
        assert ranks[0].seq_tokens.tolist() == [5.0, 2.0]  # policy tokens per sequence (seq_mean's divisor)
    assert batch.mask[0].tolist()[:8] == [0, 1, 1, 1, 0, 0, 1, 1]


# ----------------------------------------------------------------------------------- bad tools
class Flaky(Environment):
    """Replies by problem: raise / hang / untokenizable / not an EnvStep / a good reply."""

    async def step(self, problem, turns):
        kind = problem.answer
        if len(turns) > 1:
            return EnvStep(reward=1.0, done=True, info={"outcome": "correct"})
        if kind == "raise":
            raise RuntimeError("the tool broke")
        if kind == "hang":
            await asyncio.sleep(30)
        if kind == "unicode":
            return EnvStep(observation="r\u00e9sultat")  # not in the character vocabulary: <unk>
        if kind == "none":
            return {"observation": "x"}
        return EnvStep(observation=" ok")

    def final_reward(self, problem, turns):
        return -1.0


def test_bad_tools_end_their_sample_with_a_named_error():
    backend = ScriptedBackend(lambda h, s: "a")
    loop = TurnLoop(Flaky(), TOK, max_turns=2, max_seq_len=64, timeout_s=0.3)
    kinds = ["raise", "hang", "unicode", "none", "good"]
    t0 = time.perf_counter()
    res = loop.generate(backend, [Problem(f"{k}=", k) for k in kinds], SAMPLING, n=2)
    assert time.perf_counter() - t0 < 10  # the hanging tool did not hold the rollout
    errors = {k: [s.env_error for s in row] for k, row in zip(kinds, res.samples)}
    assert errors == {"raise": ["tool_error"] * 2, "hang": ["tool_timeout"] * 2, "unicode": ["untokenizable"] * 2,
                      "none": ["bad_step"] * 2, "good": [None, None]}
    for k, row in zip(kinds, res.samples):
        for s in row:
            if k == "good":
                assert s.reward == 1.0 and s.finish_reason == "stop" and len(s.turns) == 2
            else:  # ended after turn 1 without a reply, rewarded by final_reward
                assert s.reward == -1.0 and s.finish_reason == "env_error" and s.loss_mask == [1, 1]
    m = res.metrics
    assert m["env/errors"] == 8 and all(m[f"env/error/{e}"] == 2 for e in ENV_ERRORS)
    assert 0.3 <= m["env_s"] < 10


def test_turn_and_token_budgets():
    class Echo(Environment):  # replies forever
        async def step(self, problem, turns):
            return EnvStep(observation="+1=", reward=0.5)

        def final_reward(self, problem, turns):
            return -2.0

    backend = ScriptedBackend(lambda h, s: "7")  # 2 tokens a turn
    res = TurnLoop(Echo(), TOK, max_turns=3, max_seq_len=64, timeout_s=5).generate(backend, [Problem("1=", "1")],
                                                                                   SAMPLING, n=1)
    s = res.samples[0][0]
    assert len(s.turns) == 3 and s.finish_reason == "max_turns"
    assert s.reward == 3 * 0.5 - 2.0  # every step's reward, then the cut-short conversation's
    assert s.loss_mask == [1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1]  # the last reply is recorded, not appended
    assert s.turns[-1]["observation"] == "+1=" and s.turns[-1]["observation_tokens"] == 0
    # token budget: a turn is taken only if history + reply + max_tokens fit max_seq_len
    tight = SamplingSpec(temperature=1.0, max_tokens=4, seed=0)
    res = TurnLoop(Echo(), TOK, max_turns=10, max_seq_len=15, timeout_s=5).generate(
        backend, [Problem("1=", "1")], tight, n=1)
    s = res.samples[0][0]
    assert len(s.turns) == 2 and s.finish_reason == "length"
    assert len(s.prompt_token_ids) + len(s.token_ids) == 9  # the next reply would leave < max_tokens


def test_calculator_tool_and_rewards():
    assert tool_call("<calc>12*34</calc>") == "12*34" and tool_call(" x<calc>1+2</calc> ") == "1+2"
    assert tool_call("408") is None and tool_call("</calc>") is None
    assert evaluate("12*34") == 408 and evaluate("-(2+3)*4") == -20
    assert reply("12*34") == "[408]"
    for bad in ("", "12/4", "2**8", "__import__('os')", "1+", "9" * 70):
        assert reply(bad) == "[error]", bad
    env = CalculatorEnv(RewardValues(1.0, 0.0, -0.5), call_cost=0.25)
    p = Problem("12*34=", "408")

    def step(*texts):
        return asyncio.run(env.step(p, [Turn(t, (), "stop") for t in texts]))

    assert step("<calc>12*34</calc>") == EnvStep(observation="[408]", reward=-0.25, info={"tool_call": True})
    assert step("<calc>12*34</calc>", "408") == EnvStep(reward=1.0, done=True,
                                                        info={"outcome": "correct", "tool_call": False})
    assert step("409").reward == 0.0 and step("x").reward == -0.5
    assert env.final_reward(p, [Turn("<calc>1</calc>", (), "stop")]) == -0.5  # no answer: a format error
    # JSONL / built-in tasks are one-turn environments with the exact-match reward
    one = SingleTurnEnv(RewardValues(2.0, 0.0, -1.0))
    assert asyncio.run(one.step(p, [Turn("408", (), "stop")])) == EnvStep(reward=2.0, done=True,
                                                                          info={"outcome": "correct"})


def test_tool_latency_overlaps_and_times_out():
    env = CalculatorEnv(tool_latency_s=0.4)
    backend = ScriptedBackend(calc_policy)
    problems = [Problem(f"{a}*3=", str(3 * a)) for a in range(4)]
    res = TurnLoop(env, TOK, max_turns=2, max_seq_len=128, timeout_s=5).generate(backend, problems, SAMPLING, n=2)
    assert 0.4 <= res.metrics["env_s"] < 0.4 * 8 / 2  # the 8 calls of the turn wait at once
    res = TurnLoop(env, TOK, max_turns=2, max_seq_len=128, timeout_s=0.1).generate(backend, problems, SAMPLING, n=2)
    assert res.metrics["env/error/tool_timeout"] == 8


# ----------------------------------------------------------------------------------- config
def _cfg(*overrides):
    from cotrain.config import load_config

    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return load_config(root / "configs" / "grpo.yaml", ["data.eval.every=0", *overrides])


@pytest.mark.parametrize("overrides,key,words", [
    (["rollout.max_turns=2"], "rollout.max_turns", "needs an environment that replies"),
    (["env.kind=calculator"], "env.kind", "needs rollout.max_turns >= 2"),
    (["env.timeout_s=5.0"], "env.timeout_s", "acts only with a multi-turn environment"),
    (["env.tool_latency_s=0.5"], "env.tool_latency_s", "acts only with a multi-turn environment"),
    (["env.calculator.call_cost=0.1"], "env.calculator", "acts only with env.kind=calculator"),
])
def test_config_refuses_keys_that_cannot_act(overrides, key, words):
    from cotrain.config import ConfigError

    with pytest.raises(ConfigError) as e:
        _cfg(*overrides)
    assert any(k == key and words in msg for k, msg in e.value.issues), e.value.issues


def test_config_builds_the_environment():
    cfg = _cfg("env.kind=calculator", "rollout.max_turns=3", "env.calculator.call_cost=0.1", "env.tool_latency_s=0.2",
               "reward.format_error=-0.5")
    env = make_env(cfg)
    assert isinstance(env, CalculatorEnv) and env.call_cost == 0.1 and env.tool_latency_s == 0.2
    assert env.rewards == RewardValues(1.0, 0.0, -0.5)
    assert isinstance(make_env(_cfg()), SingleTurnEnv)


def test_multi_turn_samples_round_trip_through_json():
    """The pending-samples checkpoint writes Samples with dataclasses.asdict -> JSON: the multi-turn
    fields (mask, reward, turn records with the tool's replies) come back equal."""
    import json
    from dataclasses import asdict

    res = TurnLoop(CalculatorEnv(call_cost=0.5), TOK, max_turns=3, max_seq_len=128, timeout_s=5).generate(
        ScriptedBackend(calc_policy), [Problem("12*34=", "408")], SAMPLING, n=2)
    for s in res.samples[0]:
        back = Sample(**json.loads(json.dumps(asdict(s))))
        assert back == s and back.turns[0]["observation"] == "[408]"
