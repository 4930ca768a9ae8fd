"""A RolloutGroup of two engines through Ray, built from the demo config with speculative decoding
(``draft_model`` = the tiny policy itself: a perfect drafter until the policy changes).

* order and shapes: prompts split across the engines come back in prompt order, n samples each,
  with the engine's weight version; seeded sampling does not depend on the split;
* lossless speculation: greedy output equals Hugging Face's target-only greedy, and acceptance
  statistics are reported (a perfect drafter accepts everything at greedy);
* the CPU rejection-sampler repair: at temperature 1, the 2nd generated token (the first one
  produced by a verify step) follows the target's exact distribution (chi-square, 1,000
  samples). Run with ``COTRAIN_VLLM_SAMPLER_FIX=0`` to see it fail without the repair
  (total variation ~0.5 instead of ~0.03);
* drafter pushes change acceptance but never the output; policy pushes through the group reach
  every engine; a bad push is rejected before any engine changes.
"""

from __future__ import annotations

import os

import pytest
import torch

from _rollout_helpers import (
    chi_square,
    load_hf,
    random_policy_state,
    sampling_tv,
    second_token_distribution,
    start_ray,
    stop_ray,
    total_variation,
)
from cotrain.models.build_tiny import greedy_answers
from cotrain.rl.interfaces import SamplingSpec
from cotrain.weights import WeightPushError

pytestmark = pytest.mark.slow

PROMPTS = ["457+86=", "12+3=", "999+1=", "5+40=", "31+69="]  # 5 prompts: chunks of 3 and 2
GREEDY = SamplingSpec(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def group(tiny_model_path):
    from cotrain.config import load_config
    from cotrain.rl.rollout import RolloutGroup

    cfg = load_config("configs/grpo.yaml", [
        "rollout.num_engines=2", "rollout.speculative.method=draft_model",
        f"rollout.speculative.draft_model={tiny_model_path}", "rollout.speculative.num_speculative_tokens=3"])
    started = start_ray()
    env = {k: os.environ[k] for k in ("COTRAIN_VLLM_SAMPLER_FIX",) if k in os.environ}
    g = RolloutGroup.from_config(cfg, model_path=str(tiny_model_path), env=env)
    yield g
    g.shutdown()
    stop_ray(started)


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    return load_hf(tiny_model_path)


def test_order_shapes_and_versions(group, hf):
    model, tok = hf
    assert group.num_engines == 2 and group.weight_version() == 0
    res = group.generate(PROMPTS, GREEDY, n=3)
    want = greedy_answers(model, tok, PROMPTS, 8)
    assert [len(g) for g in res.samples] == [3] * len(PROMPTS)
    for i, g in enumerate(res.samples):
        assert [s.prompt_index for s in g] == [i] * 3
        assert all(s.prompt_token_ids == tok.encode(PROMPTS[i]) for s in g)
        assert [s.text for s in g] == [want[i]] * 3  # order: prompt i's answer, from whichever engine
        assert all(s.weight_version == 0 for s in g)
    assert res.metrics["num_engines_used"] == 2 and res.metrics["num_samples"] == 15

    spec = SamplingSpec(temperature=1.0, max_tokens=8, seed=5)
    a = group.generate(PROMPTS, spec, n=4)
    tokens = [[s.token_ids for s in g] for g in a.samples]
    assert tokens == [[s.token_ids for s in g] for g in group.generate(PROMPTS, spec, n=4).samples]
    assert any(len({tuple(t) for t in g}) > 1 for g in tokens)  # samples of a prompt differ
    # seeds follow the prompt's index in the batch (seed + index * n), not the engine it lands on:
    # prompt 3 sampled alone with the seed it had in the batch gives the same samples
    shifted = group.generate(PROMPTS[3:], SamplingSpec(temperature=1.0, max_tokens=8, seed=5 + 3 * 4), n=4)
    assert [s.token_ids for s in shifted.samples[0]] == tokens[3]


def test_speculative_greedy_is_lossless_with_acceptance_stats(group, hf):
    model, tok = hf
    res = group.generate(PROMPTS, GREEDY, n=1)
    assert [g[0].text for g in res.samples] == greedy_answers(model, tok, PROMPTS, 8)
    # the drafter is the target, at greedy: every verify step drafts k = 3 tokens and accepts them all,
    # so the acceptance length is 1 + k = 4 (measured: exactly 4.0 for every sample, drafts past <eos>
    # included); a rejected draft or a short proposal shows
    for g in res.samples:
        sd = g[0].spec_decode
        assert sd is not None and sd["num_spec_tokens"] == 3
        assert sd["num_spec_steps"] >= 1 and sd["num_draft_tokens"] == 3 * sd["num_spec_steps"], sd
        assert sd["mean_acceptance_length"] == pytest.approx(1 + sd["num_accepted_draft_tokens"] / sd["num_spec_steps"])
        assert sd["mean_acceptance_length"] >= 1 + 3 * 0.95, sd
    m = res.metrics
    assert m["draft_acceptance_rate"] >= 0.95, m
    assert m["mean_acceptance_length"] == pytest.approx(1 + 3 * m["draft_acceptance_rate"]), m


def test_speculative_sampling_matches_target_distribution(group, hf):
    """Fails without the CPU rejection-sampler repair (COTRAIN_VLLM_SAMPLER_FIX=0)."""
    model, tok = hf
    prompt, n = "457+86=", 1000
    res = group.generate([prompt], SamplingSpec(temperature=1.0, max_tokens=2, seed=123), n=n)
    V = model.config.vocab_size
    counts = torch.zeros(V + 1)
    for s in res.samples[0]:
        counts[s.token_ids[1] if len(s.token_ids) > 1 else V] += 1
    assert res.metrics["num_spec_steps"] > 0  # the 2nd tokens came out of verify steps
    exact = second_token_distribution(model, tok.encode(prompt), tok.eos_token_id)
    stat, df, p = chi_square(counts, exact)
    tv, floor = total_variation(counts, exact), sampling_tv(exact, n)
    # measured: TV 0.03 (noise floor ~0.03), p ~0.1; without the repair TV ~0.6, chi2 ~1e5
    assert tv < max(0.1, 3 * floor) and p > 1e-3, f"TV={tv:.3f} (floor {floor:.3f}), chi2={stat:.1f} (df {df}), p={p:.2g}"


def test_draft_push_changes_acceptance_not_output(group, hf):
    model, tok = hf
    want = greedy_answers(model, tok, PROMPTS, 8)
    _, random_state = random_policy_state(tok, seed=9)
    group.push_weights("draft", random_state, 1)
    res = group.generate(PROMPTS, GREEDY)
    assert [g[0].text for g in res.samples] == want  # lossless whatever the drafter
    assert res.metrics["draft_acceptance_rate"] < 0.5
    assert group.weight_version() == 0 and group.draft_version == 1  # the label names the policy
    group.push_weights("draft", {k: v.detach().clone() for k, v in model.state_dict().items()}, 2)
    res = group.generate(PROMPTS, GREEDY)
    assert [g[0].text for g in res.samples] == want and res.metrics["draft_acceptance_rate"] >= 0.95


def test_policy_push_reaches_every_engine(group, hf):
    model, tok = hf
    other, state = random_policy_state(tok, seed=7)
    stats = group.push_weights("policy", state, 3)
    assert stats["push_s"] < 10
    res = group.generate(PROMPTS, GREEDY)
    # the stale drafter (the old policy) does not matter: output = the new policy's greedy
    assert [g[0].text for g in res.samples] == greedy_answers(other, tok, PROMPTS, 8)
    assert group.weight_version() == 3 and all(g[0].weight_version == 3 for g in res.samples)

    bad = dict(state)
    V, H = bad["lm_head.weight"].shape
    bad["lm_head.weight"] = bad["lm_head.weight"][:, : H // 2].contiguous()
    with pytest.raises(WeightPushError, match=rf"'lm_head.weight' expected \[{V}, {H}\] got \[{V}, {H // 2}\]"):
        group.push_weights("policy", bad, 4)
    assert group.weight_version() == 3
    group.push_weights("policy", {k: v.detach().clone() for k, v in model.state_dict().items()}, 5)
    assert [g[0].text for g in group.generate(PROMPTS, GREEDY).samples] == greedy_answers(model, tok, PROMPTS, 8)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_sampling_logprobs_match_hf(group, hf, temperature):
    """With speculative decoding the reported log-probs are still the target's (fp32: ~exact)."""
    from _rollout_helpers import token_logprobs

    model, tok = hf
    res = group.generate(PROMPTS, SamplingSpec(temperature=temperature, max_tokens=12, seed=3), n=4)
    d = torch.cat([(torch.tensor(s.logprobs) - token_logprobs(model, s.prompt_token_ids, s.token_ids, temperature)).abs()
                   for g in res.samples for s in g])
    assert res.metrics["num_accepted_draft_tokens"] > 0
    assert d.mean() < 1e-4 and d.max() < 1e-3, (d.mean().item(), d.max().item())
