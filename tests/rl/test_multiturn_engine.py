"""The turn loop on a real vLLM engine (the tiny policy, in this process): two-turn conversations
continued on their token-id history, the engine's log-probs of every policy token against Hugging
Face's teacher-forced recomputation of the whole conversation, 0 on the environment's reply, and
the same groups again from the same seeds."""

from __future__ import annotations

import pytest
import torch

from _rollout_helpers import load_hf, token_logprobs
from cotrain.envs import EnvStep, Environment
from cotrain.rl.interfaces import SamplingSpec
from cotrain.rl.multiturn import TurnLoop
from cotrain.tasks.data import Problem

pytestmark = pytest.mark.slow

REPLY = "+1="


class AddOne(Environment):
    """Replies '+1=' to turn 1; done after turn 2."""

    async def step(self, problem, turns):
        if len(turns) == 1:
            return EnvStep(observation=REPLY)
        return EnvStep(reward=float(len(turns)), done=True)

    def final_reward(self, problem, turns):
        return -1.0


def test_two_turn_logprobs_match_hf(tiny_model_path):
    from cotrain.rl.rollout import EngineSpec, VllmGeneration

    model, tok = load_hf(tiny_model_path)
    engine = VllmGeneration(EngineSpec(str(tiny_model_path)))
    try:
        loop = TurnLoop(AddOne(), tok, max_turns=2, max_seq_len=128, timeout_s=10)
        problems = [Problem("12+3=", "15"), Problem("57+86=", "143")]
        spec = SamplingSpec(temperature=1.0, max_tokens=8, seed=5)
        res = loop.generate(engine, problems, spec, n=2)
        again = loop.generate(engine, problems, spec, n=2)
    finally:
        engine.shutdown()
    reply = tok.encode(REPLY)
    diffs = []
    for row, p in zip(res.samples, problems):
        for s in row:
            assert s.prompt_token_ids == tok.encode(p.prompt) and s.env_error is None and len(s.turns) == 2
            n1 = s.turns[0]["tokens"]
            assert s.token_ids[n1:n1 + len(reply)] == reply
            assert s.loss_mask == [1] * n1 + [0] * len(reply) + [1] * s.turns[1]["tokens"]
            ref = token_logprobs(model, s.prompt_token_ids, s.token_ids)  # the whole conversation, teacher-forced
            got, m = torch.tensor(s.logprobs), torch.tensor(s.loss_mask, dtype=torch.bool)
            assert bool((got[~m] == 0).all())
            diffs.append((got[m] - ref[m]).abs())
            assert s.reward == 2.0 and s.finish_reason in ("stop", "length")
    d = torch.cat(diffs)
    assert d.max() < 1e-3 and d.mean() < 1e-4, (d.mean().item(), d.max().item())
    assert [[s.token_ids for s in row] for row in again.samples] == [[s.token_ids for s in row] for row in res.samples]
