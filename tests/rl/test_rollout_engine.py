"""One rollout engine (a RolloutWorker Ray actor, no speculative decoding) on the tiny policy.

* train-inference agreement: vLLM's sampling log-probs vs Hugging Face on the same weights (fp32);
* a policy push: greedy output then equals Hugging Face greedy with the pushed weights, and the
  version label follows; pushing the original back restores the original output;
* rejected pushes (unknown / missing names, wrong shapes, wrong dtypes, a drafter push without a
  drafter) name the offending tensors and leave weights and version untouched.

(The GPU transports, cuda_ipc and nccl, are vLLM's own engines: test_weight_push_gpu.py.)

One engine for the module (start-up dominates); the tests run in file order and each leaves the
engine serving the original tiny policy.
"""

from __future__ import annotations

import pytest
import torch

from _rollout_helpers import load_hf, random_policy_state, start_ray, stop_ray, token_logprobs
from cotrain.models.build_tiny import greedy_answers
from cotrain.rl.interfaces import SamplingSpec
from cotrain.weights import WeightPushError

pytestmark = pytest.mark.slow

PROMPTS = ["457+86=", "12+3=", "999+1=", "5+40=", "1+", "55+", "9", "31+69="]
GREEDY = SamplingSpec(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def worker(tiny_model_path):
    import ray

    from cotrain.rl.rollout import EngineSpec, RolloutWorker

    started = start_ray()
    actor = ray.remote(RolloutWorker).options(num_cpus=1).remote(EngineSpec(str(tiny_model_path)))
    info = ray.get(actor.ready.remote())
    assert info["torch_threads"] == 1
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)
    stop_ray(started)


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    return load_hf(tiny_model_path)


def generate(worker, prompts, sampling, n=1):
    import ray

    return ray.get(worker.generate.remote(prompts, sampling, n))


def version(worker) -> int:
    import ray

    return ray.get(worker.weight_version.remote())


def texts(result) -> list[str]:
    return [group[0].text for group in result.samples]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_match_hf(worker, hf, temperature):
    """The sampler's log-probs (after temperature) equal HF's recomputation: KL ~ 0 in fp32."""
    model, tok = hf
    res = generate(worker, PROMPTS, SamplingSpec(temperature=temperature, max_tokens=12, seed=0), n=4)
    assert len(res.samples) == len(PROMPTS) and all(len(g) == 4 for g in res.samples)
    diffs, log_ratio = [], []
    for i, group in enumerate(res.samples):
        for s in group:
            assert s.prompt_index == i and s.prompt_token_ids == tok.encode(PROMPTS[i])
            assert s.weight_version == 0 and s.finish_reason in ("stop", "length")
            assert len(s.logprobs) == len(s.token_ids) > 0
            ref = token_logprobs(model, s.prompt_token_ids, s.token_ids, temperature)
            got = torch.tensor(s.logprobs)
            diffs.append((got - ref).abs())
            log_ratio.append(got - ref)
    d = torch.cat(diffs)
    assert d.mean() < 1e-4 and d.max() < 1e-3, (d.mean().item(), d.max().item())
    # the k1 estimate of KL(vLLM || trainer) on the sampled tokens
    assert abs(torch.cat(log_ratio).mean().item()) < 1e-4
    m = res.metrics
    assert m["num_samples"] == 4 * len(PROMPTS) and m["tokens_per_s"] > 0
    assert m["num_tokens"] == sum(len(s.token_ids) for g in res.samples for s in g)


def test_seeded_sampling_is_reproducible(worker):
    spec = SamplingSpec(temperature=1.0, max_tokens=8, seed=11)
    a, b = generate(worker, PROMPTS[:3], spec, n=3), generate(worker, PROMPTS[:3], spec, n=3)
    assert [[s.token_ids for s in g] for g in a.samples] == [[s.token_ids for s in g] for g in b.samples]


def test_policy_push_then_greedy_matches_hf(worker, hf):
    import ray

    model, tok = hf
    original = texts(generate(worker, PROMPTS, GREEDY))
    assert original == greedy_answers(model, tok, PROMPTS, 8)
    other, state = random_policy_state(tok, seed=7)
    expected = greedy_answers(other, tok, PROMPTS, 8)
    assert expected != original  # the push must be visible

    stats = ray.get(worker.push_weights.remote("policy", state, 1))
    assert stats["push_s"] < 5
    res = generate(worker, PROMPTS, GREEDY)
    assert texts(res) == expected
    assert version(worker) == 1 and all(g[0].weight_version == 1 for g in res.samples)

    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ray.get(worker.push_weights.remote("policy", base, 2))
    assert texts(generate(worker, PROMPTS, GREEDY)) == original and version(worker) == 2


def _bad_pushes(state: dict[str, torch.Tensor]):
    """(label, push, expected message) for each way a push can be wrong; sizes from the state."""
    name = "model.layers.0.self_attn.k_proj.weight"  # not square (GQA), so its transpose is wrong
    rows, cols = state[name].shape
    up = state["model.layers.0.mlp.up_proj.weight"]
    last = max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
    unknown = dict(state)
    unknown[f"model.layers.{last + 5}.mlp.up_proj.weight"] = torch.zeros_like(up)
    shape = dict(state)
    shape[name] = state[name].t().contiguous()
    missing = {k: v for k, v in state.items() if f"layers.{last}." not in k}
    dtype = dict(state)
    dtype["model.norm.weight"] = torch.ones(state["model.norm.weight"].shape, dtype=torch.int64)
    renamed = {k.replace("model.layers.", "decoder.layers."): v for k, v in state.items()}
    n_missing, n_layers = len(state) - len(missing), sum(k.startswith("model.layers.") for k in state)
    return [
        ("unknown", unknown, rf"1 unknown name\(s\): 'model.layers.{last + 5}.mlp.up_proj.weight'"),
        ("shape", shape, rf"1 shape mismatch\(es\): '{name}' expected \[{rows}, {cols}\] got \[{cols}, {rows}\]"),
        ("missing", missing, rf"{n_missing} missing name\(s\): 'model.layers.{last}.input_layernorm.weight'"),
        ("dtype", dtype, r"'model.norm.weight' expected float32 got int64"),
        ("renamed", renamed, rf"{n_layers} unknown name\(s\): 'decoder.layers.0.*{n_layers} missing name\(s\): "
                             r"'model.layers.0"),
    ]


def test_bad_pushes_are_rejected_and_engine_keeps_serving(worker, hf):
    import ray

    model, tok = hf
    before_text, before_version = texts(generate(worker, PROMPTS, GREEDY)), version(worker)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # a change the engine would show if any rejected push leaked into it
    poisoned = {k: v + 0.5 if v.is_floating_point() else v for k, v in state.items()}
    for label, push, pattern in _bad_pushes(poisoned):
        with pytest.raises(WeightPushError, match=r"policy weight push rejected: .*" + pattern):
            ray.get(worker.push_weights.remote("policy", push, 99))
        assert version(worker) == before_version, label
    with pytest.raises(WeightPushError, match="draft push into an engine without speculative decoding"):
        ray.get(worker.push_weights.remote("draft", state, 99))
    assert texts(generate(worker, PROMPTS, GREEDY)) == before_text
    assert version(worker) == before_version
