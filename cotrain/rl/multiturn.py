"""Multi-turn rollouts: the turn loop between a generation backend and an environment.

For P problems and n samples each (a group per problem)::

    turn 1       backend.generate(first observations, sampling, n)     one request per problem, as
                                                                        single-turn: sample j of
                                                                        problem i has seed s + i*n + j
    then, while some conversation is live:
      env        await env.step(problem, turns) for every live one at once, each under env.timeout_s
                 done -> it ends (its reward: the sum of its step rewards)
                 else -> the reply's tokens are appended (loss mask 0, log-prob 0)
      stop       max_turns policy turns taken, or history + reply + sampling.max_tokens over
                 max_seq_len -> it ends without an answer (reward + env.final_reward)
      turn t     backend.generate(histories as token ids, sampling, 1) one request per conversation:
                                                                        the k-th live one (in group
                                                                        order) has seed s_t + k

Every sample is its own conversation after turn 1 and is continued on its whole token history (no
re-tokenisation: the engine's prefix cache reuses the history's KV blocks). Seeds: s_t =
``turn_seed(s, t)``; given the same weights the whole group is reproducible, because which
conversations are live at turn t is itself a function of the seeded turns before it.

A step that raises (``tool_error``), takes longer than ``timeout_s`` (``tool_timeout``), returns
something else than an :class:`~cotrain.envs.base.EnvStep` (``bad_step``) or a reply that does not
tokenize (``untokenizable``: not a string, or the tokenizer's unknown token in it) ends that
conversation with the named error: ``Sample.env_error``, the metrics ``env/errors`` and
``env/error/<name>``, and reward + ``env.final_reward``. It never fails the run.

The sample of a conversation: ``prompt_token_ids`` the first prompt, ``token_ids`` every later token
(policy turns and replies, in order), ``logprobs`` the sampler's on policy tokens and 0 on replies,
``loss_mask`` 1 / 0 on them, ``text`` the last policy turn's (the final answer), ``reward`` the
environment's, ``turns`` one record per policy turn (its reply included, so a resumed run never asks
a tool again), ``weight_version`` / ``draft_version`` the oldest of its turns', ``spec_decode`` the
acceptance counters summed over its turns. ``finish_reason``: ``stop`` (the environment said done),
``length`` (the last turn hit sampling.max_tokens, or the token budget ended it), ``max_turns``,
``env_error``.

Metrics (GenerationResult.metrics, besides single-turn's ``tokens_per_s``, acceptance, ...):
``env_s`` (wall seconds in environment steps: tool execution and latency), ``generate_s``,
``turns_mean``, ``env_tokens``, ``env/steps``, ``env/tool_calls``, ``env/errors``,
``env/error/<name>``, ``accuracy`` (final answers graded correct), and per turn t
``turn<t>/mean_acceptance_length`` with speculative decoding.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Sequence

from cotrain.envs.base import Environment, EnvStep, Turn
from cotrain.rl.interfaces import GenerationBackend, GenerationResult, Sample, SamplingSpec
from cotrain.tasks.data import Problem

ENV_ERRORS = ("tool_error", "tool_timeout", "bad_step", "untokenizable")
TURN_SEED_STRIDE = 2**48  # apart from the driver's per-round stride (2**32) for < 65536 rounds
SPEC_COUNTS = ("num_spec_steps", "num_accepted_draft_tokens", "num_draft_tokens")


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The base seed of turn ``turn`` (1-based; turn 1 keeps ``seed``)."""
    if seed is None:
        return None
    return (int(seed) + (turn - 1) * TURN_SEED_STRIDE) % 2**63


@dataclass
class Conversation:
    """One sample's conversation while it runs."""

    problem_index: int
    problem: Problem
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    finish_reason: str = ""
    error: str | None = None
    outcome: str | None = None
    versions: list[int] = field(default_factory=list)
    draft_versions: list[int] = field(default_factory=list)
    specs: list[dict] = field(default_factory=list)

    @property
    def history(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def add_turn(self, s: Sample) -> None:
        self.tokens += s.token_ids
        self.logprobs += [float(x) for x in s.logprobs]
        self.mask += [1] * len(s.token_ids)
        self.turns.append(Turn(text=s.text, token_ids=tuple(s.token_ids), finish_reason=s.finish_reason))
        self.versions.append(s.weight_version)
        if s.draft_version is not None:
            self.draft_versions.append(s.draft_version)
        if s.spec_decode:
            self.specs.append(s.spec_decode)
        self.records.append({"text": s.text, "tokens": len(s.token_ids), "finish_reason": s.finish_reason,
                             "observation": None, "observation_tokens": 0, "reward": 0.0,
                             "weight_version": s.weight_version, "draft_version": s.draft_version,
                             "spec_decode": s.spec_decode})

    def add_observation(self, text: str, ids: list[int]) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.turns[-1] = replace(self.turns[-1], observation=text)
        self.records[-1].update(observation=text, observation_tokens=len(ids))

    def end(self, reason: str, env: Environment | None = None, error: str | None = None) -> None:
        """End without the environment's done: the reward gets env.final_reward."""
        self.done, self.finish_reason, self.error = True, reason, error
        if env is not None:
            self.reward += float(env.final_reward(self.problem, self.turns))
        if self.turns and self.turns[-1].finish_reason == "length" and reason != "env_error":
            self.finish_reason = "length"

    def sample(self) -> Sample:
        return Sample(prompt_index=self.problem_index, prompt_token_ids=list(self.prompt_ids),
                      token_ids=list(self.tokens), logprobs=list(self.logprobs), text=self.turns[-1].text,
                      finish_reason=self.finish_reason, weight_version=min(self.versions),
                      spec_decode=sum_spec(self.specs), draft_version=min(self.draft_versions, default=None),
                      loss_mask=list(self.mask), reward=float(self.reward), turns=self.records,
                      env_error=self.error)


def sum_spec(specs: list[dict]) -> dict | None:
    """Acceptance counters summed over turns, the rates recomputed from them (None: no speculation)."""
    if not specs:
        return None
    out = {k: float(sum(d.get(k, 0.0) for d in specs)) for k in SPEC_COUNTS}
    steps, acc, drafted = out["num_spec_steps"], out["num_accepted_draft_tokens"], out["num_draft_tokens"]
    out["mean_acceptance_length"] = 1.0 + acc / steps if steps else 1.0
    out["draft_acceptance_rate"] = acc / drafted if drafted else 0.0
    hists = [d["acceptance_histogram"] for d in specs if "acceptance_histogram" in d]
    if hists:
        width = max(map(len, hists))
        out["acceptance_histogram"] = [sum(h[i] for h in hists if i < len(h)) for i in range(width)]
    return out


def run_steps(coros: list, timeout_s: float) -> list[tuple[EnvStep | None, str | None]]:
    """Await ``coros`` concurrently on a fresh event loop, each under ``timeout_s``: (step, None) or
    (None, error name). Tools still running in worker threads after a timeout are abandoned (the
    loop's executor is shut down without waiting for them)."""

    async def guarded(coro):
        try:
            step = await asyncio.wait_for(coro, timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            return None, "tool_timeout"
        except Exception:  # noqa: BLE001 - a tool's failure ends its sample, never the run
            return None, "tool_error"
        if not isinstance(step, EnvStep):
            return None, "bad_step"
        return step, None

    async def main():
        return await asyncio.gather(*(guarded(c) for c in coros))

    loop = asyncio.new_event_loop()
    pool = ThreadPoolExecutor(max_workers=max(1, min(32, len(coros))), thread_name_prefix="cotrain-env")
    loop.set_default_executor(pool)
    try:
        return loop.run_until_complete(main())
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        loop.close()


def tokenize_observation(tokenizer, text) -> list[int] | None:
    """The reply's token ids, or None when it does not tokenize (not a string, or unknown tokens)."""
    if not isinstance(text, str):
        return None
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    except Exception:  # noqa: BLE001
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and unk in ids:
        return None
    return ids


class TurnLoop:
    """Multi-turn rollouts over a :class:`~cotrain.rl.interfaces.GenerationBackend` (module docstring)."""

    def __init__(self, env: Environment, tokenizer, max_turns: int, max_seq_len: int, timeout_s: float):
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns} (allowed: >= 1)")
        self.env, self.tokenizer = env, tokenizer
        self.max_turns, self.max_seq_len, self.timeout_s = int(max_turns), int(max_seq_len), float(timeout_s)

    @classmethod
    def from_config(cls, cfg, model_path: str) -> "TurnLoop":
        from transformers import AutoTokenizer

        from cotrain.envs import make_env

        return cls(make_env(cfg), AutoTokenizer.from_pretrained(model_path), cfg.rollout.max_turns,
                   cfg.policy.max_seq_len, cfg.env.timeout_s)

    def generate(self, backend: GenerationBackend, problems: Sequence[Problem], sampling: SamplingSpec,
                 n: int) -> GenerationResult:
        """``n`` conversations per problem, in problem order (GenerationResult.samples [P][n])."""
        problems = list(problems)
        m = {"generate_s": 0.0, "env_s": 0.0, "env/steps": 0.0, "env/tool_calls": 0.0}
        errors = {name: 0 for name in ENV_ERRORS}
        per_turn_spec: dict[int, list[dict]] = {}
        first = backend.generate([self.env.first_observation(p) for p in problems], sampling, n=n)
        m["generate_s"] += float(first.metrics.get("time_s", 0.0))
        convs: list[Conversation] = []
        for i, (p, row) in enumerate(zip(problems, first.samples)):
            if len(row) != n:
                raise RuntimeError(f"the backend returned {len(row)} samples for problem {i}, expected {n}")
            for s in row:
                c = Conversation(problem_index=s.prompt_index, problem=p, prompt_ids=list(s.prompt_token_ids))
                c.add_turn(s)
                convs.append(c)
                if s.spec_decode:
                    per_turn_spec.setdefault(1, []).append(s.spec_decode)
        turn = 1
        while True:
            live = [c for c in convs if not c.done]
            if not live:
                break
            t0 = time.perf_counter()
            results = run_steps([self.env.step(c.problem, list(c.turns)) for c in live], self.timeout_s)
            m["env_s"] += time.perf_counter() - t0
            m["env/steps"] += len(live)
            budget = self.max_seq_len - sampling.max_tokens
            for c, (step, error) in zip(live, results):
                if error is not None:
                    errors[error] += 1
                    c.end("env_error", self.env, error)
                    continue
                m["env/tool_calls"] += bool(step.info.get("tool_call", False))
                c.reward += float(step.reward)
                c.records[-1]["reward"] = float(step.reward)
                if step.done:
                    c.done, c.finish_reason, c.outcome = True, "stop", step.info.get("outcome")
                    c.records[-1]["outcome"] = c.outcome  # the grading of the final answer (reward/accuracy)
                    if c.turns[-1].finish_reason == "length":
                        c.finish_reason = "length"
                    continue
                ids = tokenize_observation(self.tokenizer, step.observation)
                if ids is None:
                    errors["untokenizable"] += 1
                    c.end("env_error", self.env, "untokenizable")
                    continue
                if turn >= self.max_turns:
                    c.add_observation(step.observation, [])  # the reply is recorded, never read
                    c.end("max_turns", self.env)
                elif len(c.history) + len(ids) > budget:
                    c.add_observation(step.observation, [])
                    c.end("length", self.env)
                else:
                    c.add_observation(step.observation, ids)
            live = [c for c in convs if not c.done]
            if not live:
                break
            turn += 1
            gen = backend.generate([c.history for c in live], replace(sampling, seed=turn_seed(sampling.seed, turn)),
                                   n=1)
            m["generate_s"] += float(gen.metrics.get("time_s", 0.0))
            for c, row in zip(live, gen.samples):
                (s,) = row
                c.add_turn(s)
                if s.spec_decode:
                    per_turn_spec.setdefault(turn, []).append(s.spec_decode)
        samples = [[convs[i * n + j].sample() for j in range(n)] for i in range(len(problems))]
        return GenerationResult(samples=samples, metrics=self._metrics(m, errors, convs, per_turn_spec))

    @staticmethod
    def _metrics(m: dict, errors: dict, convs: list[Conversation], per_turn_spec: dict) -> dict[str, float]:
        policy = sum(sum(c.mask) for c in convs)
        env_tokens = sum(len(c.mask) - sum(c.mask) for c in convs)
        out = dict(m)
        out.update({
            "num_samples": float(len(convs)), "num_tokens": float(policy), "env_tokens": float(env_tokens),
            "time_s": m["generate_s"] + m["env_s"],
            "tokens_per_s": policy / m["generate_s"] if m["generate_s"] > 0 else 0.0,
            "mean_response_len": (policy + env_tokens) / len(convs) if convs else 0.0,
            "stop_fraction": sum(c.finish_reason == "stop" for c in convs) / len(convs) if convs else 0.0,
            "turns_mean": sum(len(c.turns) for c in convs) / len(convs) if convs else 0.0,
            "accuracy": sum(c.outcome == "correct" for c in convs) / len(convs) if convs else 0.0,
            "env/errors": float(sum(errors.values())),
            **{f"env/error/{k}": float(v) for k, v in errors.items()},
        })
        total = sum_spec([s for c in convs for s in c.specs])
        if total is not None:
            out.update(mean_acceptance_length=total["mean_acceptance_length"],
                       draft_acceptance_rate=total["draft_acceptance_rate"], num_spec_steps=total["num_spec_steps"],
                       num_accepted_draft_tokens=total["num_accepted_draft_tokens"],
                       num_draft_tokens=total["num_draft_tokens"])
            for t, specs in sorted(per_turn_spec.items()):
                out[f"turn{t}/mean_acceptance_length"] = sum_spec(specs)["mean_acceptance_length"]
        return out
