"""Drafter pushes into a DFlash drafter (vLLM ``dflash``) on CPU, through a RolloutWorker actor.

Without cotrain's rebuild of the fused context-K/V buffers, the first draft step after a push
crashes (``size mismatch`` in ``_project_context_kv``: the CPU prepack emptied ``qkv_proj.weight``;
docs/rollout.md, "CPU repairs inside the workers"). Here: pushes apply (acceptance changes with the drafter, and pushing the
original back restores the original acceptance exactly), the output stays the target's greedy
output, and pushes carrying the target's shared ``lm_head`` / ``embed_tokens`` are refused.
The drafter is random (acceptance is low); the trained drafters' tests (tests/draft) test the high end.
"""

from __future__ import annotations

import pytest
import torch

from _rollout_helpers import load_hf, make_dflash_drafter, start_ray, stop_ray
from cotrain.models.build_tiny import greedy_answers
from cotrain.rl.interfaces import SamplingSpec
from cotrain.weights import WeightPushError

pytestmark = pytest.mark.slow

PROMPTS = [f"{a}+{b}=" for a, b in [(457, 86), (12, 3), (999, 1), (5, 40), (31, 69), (8, 8), (120, 45), (77, 700)]]
GREEDY = SamplingSpec(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    return load_hf(tiny_model_path)


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, hf):
    model, tok = hf
    arch = model.config.to_dict()
    root = tmp_path_factory.mktemp("dflash")
    L = model.config.num_hidden_layers
    kw = dict(target_layer_ids=(0, L // 2), mask_token_id=tok.pad_token_id)
    return (root / "a", make_dflash_drafter(root / "a", arch, seed=0, **kw),
            make_dflash_drafter(root / "b", arch, seed=1, **kw))


@pytest.fixture(scope="module")
def worker(tiny_model_path, drafters):
    import ray

    from cotrain.rl.rollout import EngineSpec, RolloutWorker
    from cotrain.rl.vllm.engine import speculative_config

    started = start_ray()
    spec = EngineSpec(str(tiny_model_path), speculative=speculative_config(
        "dflash", num_speculative_tokens=3, draft_model=str(drafters[0])))
    actor = ray.remote(RolloutWorker).options(num_cpus=1).remote(spec)
    ray.get(actor.ready.remote())
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)
    stop_ray(started)


def run(worker):
    import ray

    res = ray.get(worker.generate.remote(PROMPTS, GREEDY, 1))
    hist = [g[0].spec_decode["num_accepted_draft_tokens"] for g in res.samples]
    return [g[0].text for g in res.samples], hist, res.metrics


def test_dflash_draft_pushes_apply_and_stay_lossless(worker, hf, drafters):
    import ray

    model, tok = hf
    _, weights_a, weights_b = drafters
    status = ray.get(worker.status.remote())
    assert status["draft_class"] == "DFlashQwen3ForCausalLM"
    want = greedy_answers(model, tok, PROMPTS, GREEDY.max_tokens)
    text_a, acc_a, m = run(worker)
    assert text_a == want and m["num_spec_steps"] > 0

    ray.get(worker.push_weights.remote("draft", weights_b, 1))  # crashed here without the rebuild
    assert ray.get(worker.status.remote())["last_push"]["dflash_rebuilt"]
    text_b, acc_b, _ = run(worker)
    assert text_b == want
    assert acc_b != acc_a  # the pushed drafter is the one proposing

    ray.get(worker.push_weights.remote("draft", weights_a, 2))
    text_a2, acc_a2, _ = run(worker)
    assert text_a2 == want and acc_a2 == acc_a  # back to the original drafter, exactly
    assert ray.get(worker.weight_version.remote()) == 0  # drafter pushes never relabel the policy


@pytest.mark.parametrize("name, pattern", [
    ("lm_head.weight", r"not allowed in a draft push: 'lm_head.weight' \(the drafter shares lm_head"),
    ("embed_tokens.weight", r"not allowed in a draft push: 'embed_tokens.weight' \(the drafter shares embed_tokens"),
    ("model.embed_tokens.weight", r"not allowed in a draft push: 'model.embed_tokens.weight'"),
    (None, r"1 missing name\(s\): 'fc.weight'"),
])
def test_dflash_push_refuses_shared_and_incomplete(worker, hf, drafters, name, pattern):
    import ray

    model, _ = hf
    push = dict(drafters[1])
    if name is None:
        push.pop("fc.weight")
    else:
        push[name] = torch.zeros(model.config.vocab_size, model.config.hidden_size)
    before = run(worker)[1]
    with pytest.raises(WeightPushError, match=r"draft weight push rejected: .*" + pattern):
        ray.get(worker.push_weights.remote("draft", push, 9))
    assert run(worker)[1] == before
