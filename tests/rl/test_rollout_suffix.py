"""Suffix decoding (vLLM's model-free ``suffix`` method) in the rollout engines, from the YAML.

The engine tests need the optional ``arctic-inference`` package (the ``suffix`` extra; how to
install it: docs/rollout.md, "Model-free speculation") and skip cleanly without it; the mapping of
``rollout.speculative.suffix`` onto vLLM's fields is checked either way.

* every ``rollout.speculative.suffix`` key and ``num_speculative_tokens`` reach the engine's vLLM
  config under vLLM's names;
* lossless: greedy output equals Hugging Face's target-only greedy, before and after the engine's
  suffix tree holds earlier responses, and after a policy push (the tree still holds the old
  policy's responses);
* the global tree acts: repeating the prompts, the engine that caches earlier responses accepts
  more than one token per verify step (mean acceptance length > 1); the same engine with
  ``max_cached_requests: 0`` (prompt + own response only) accepts no more than it did the first time;
* a drafter push into a suffix engine is refused (there are no drafter weights);
* bench/model_free.py runs (``--quick``, plain and suffix) and its greedy check holds.
"""

from __future__ import annotations

import pytest

from _rollout_helpers import load_hf, random_policy_state, start_ray, stop_ray
from cotrain.models.build_tiny import greedy_answers
from cotrain.rl.interfaces import SamplingSpec
from cotrain.weights import WeightPushError

SUFFIX = ["rollout.speculative.method=suffix", "rollout.speculative.num_speculative_tokens=6",
          "rollout.speculative.suffix.max_tree_depth=20", "rollout.speculative.suffix.max_spec_factor=2.0",
          "rollout.speculative.suffix.min_token_prob=0.2"]
LOCAL = [*SUFFIX, "rollout.speculative.suffix.max_cached_requests=0"]
# 3-digit sums: 3-4 digit answers, the longest the tiny policy writes
PROMPTS = [f"{a}+{b}=" for a, b in [(457, 86), (12, 3), (999, 1), (5, 40), (31, 69), (8, 8), (120, 45),
                                    (77, 700), (250, 250), (64, 36), (901, 99), (333, 444)]]
GREEDY = SamplingSpec(temperature=0.0, max_tokens=12)


def _has_arctic() -> bool:
    from cotrain.config.validate import suffix_decoding_unavailable

    return suffix_decoding_unavailable() is None


needs_arctic = pytest.mark.skipif(not _has_arctic(), reason="arctic-inference is not installed or does not load "
                                  "(optional extra 'suffix'; how to install it: docs/rollout.md)")


def load(overrides):
    from cotrain.config import load_config

    return load_config("configs/grpo.yaml", overrides)


# ------------------------------------------------------------------ without an engine (always run)
def test_suffix_keys_map_onto_vllm_fields(monkeypatch):
    from vllm.config import SpeculativeConfig as VllmSpec

    import cotrain.config.validate as validate
    from cotrain.config.schema import SuffixConfig
    from cotrain.rl.rollout import engine_spec_from_config
    from cotrain.rl.vllm.engine import SUFFIX_KEYS, speculative_config

    # every key of the YAML section is mapped, onto a field this vLLM has
    assert set(SUFFIX_KEYS) == set(SuffixConfig.model_fields)
    assert set(SUFFIX_KEYS.values()) <= set(VllmSpec.__dataclass_fields__)
    # the schema's defaults are vLLM's
    assert all(VllmSpec.__dataclass_fields__[v].default == SuffixConfig.model_fields[k].default
               for k, v in SUFFIX_KEYS.items())

    monkeypatch.setattr(validate, "suffix_decoding_unavailable", lambda: None)  # validate as if installed
    spec = engine_spec_from_config(load([*SUFFIX, "rollout.speculative.suffix.max_cached_requests=7"]),
                                   model_path="/m").speculative
    assert spec == {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_tree_depth": 20,
                    "suffix_decoding_max_cached_requests": 7, "suffix_decoding_max_spec_factor": 2.0,
                    "suffix_decoding_min_token_prob": 0.2}
    default = engine_spec_from_config(load(["rollout.speculative.method=suffix"]), model_path="/m").speculative
    assert default["num_speculative_tokens"] == 3 and default["suffix_decoding_max_tree_depth"] == 24
    # other methods ignore the section
    assert "suffix_decoding_max_tree_depth" not in engine_spec_from_config(
        load(["rollout.speculative.method=ngram"]), model_path="/m").speculative
    with pytest.raises(ValueError, match="unknown suffix setting.*allowed: max_tree_depth"):
        speculative_config("suffix", num_speculative_tokens=3, suffix={"depth": 3})


# ---------------------------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def groups(tiny_model_path):
    from cotrain.rl.rollout import RolloutGroup

    started = start_ray()
    made = {}
    try:
        for name, overrides in (("global", SUFFIX), ("local", LOCAL)):
            made[name] = RolloutGroup.from_config(load(overrides), model_path=str(tiny_model_path))
        yield made
    finally:
        for g in made.values():
            g.shutdown()
        stop_ray(started)


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    return load_hf(tiny_model_path)


@pytest.mark.slow
@needs_arctic
def test_yaml_keys_reach_the_engine(groups):
    import ray

    def engine_fields(worker):  # runs inside the actor (a nested function travels by value)
        sc = worker.llm.llm_engine.vllm_config.speculative_config
        return {k: getattr(sc, k) for k in ("method", "num_speculative_tokens", "suffix_decoding_max_tree_depth",
                                            "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
                                            "suffix_decoding_min_token_prob")}

    fields = ray.get(groups["local"].actors[0].__ray_call__.remote(engine_fields))
    assert fields == {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_tree_depth": 20,
                      "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2.0,
                      "suffix_decoding_min_token_prob": 0.2}
    assert ray.get(groups["global"].actors[0].__ray_call__.remote(engine_fields))[
        "suffix_decoding_max_cached_requests"] == 10000


@pytest.mark.slow
@needs_arctic
def test_lossless_and_the_global_tree_accepts(groups, hf):
    model, tok = hf
    want = greedy_answers(model, tok, PROMPTS, GREEDY.max_tokens)
    acc = {}
    for name, g in groups.items():
        first, again = g.generate(PROMPTS, GREEDY), g.generate(PROMPTS, GREEDY)
        for res in (first, again):
            assert [s[0].text for s in res.samples] == want, name
            assert res.metrics["num_spec_steps"] > 0
        acc[name] = (first.metrics["mean_acceptance_length"], again.metrics["mean_acceptance_length"])
    # measured: global 1.19 -> 1.95 (the repeat drafts from the first pass's responses); local 1.0 -> 1.0
    assert acc["global"][1] > 1.2, acc
    assert acc["local"][1] <= acc["local"][0] + 1e-9 < acc["global"][1], acc


@pytest.mark.slow
@needs_arctic
def test_policy_push_stays_lossless_and_drafter_push_is_refused(groups, hf):
    model, tok = hf
    g = groups["global"]
    with pytest.raises(WeightPushError, match="no drafter"):
        g.push_weights("draft", {k: v.detach().clone() for k, v in model.state_dict().items()}, 1)
    other, state = random_policy_state(tok, seed=7)
    g.push_weights("policy", state, 1)
    # the suffix tree still holds the old policy's answers to these prompts: drafts go wrong, output does not
    res = g.generate(PROMPTS, GREEDY)
    assert [s[0].text for s in res.samples] == greedy_answers(other, tok, PROMPTS, GREEDY.max_tokens)
    assert all(s[0].weight_version == 1 for s in res.samples)
    g.push_weights("policy", {k: v.detach().clone() for k, v in model.state_dict().items()}, 2)
    assert [s[0].text for s in g.generate(PROMPTS, GREEDY).samples] == greedy_answers(
        model, tok, PROMPTS, GREEDY.max_tokens)



@pytest.mark.slow
@needs_arctic
def test_model_free_bench_runs(tmp_path):
    """bench/model_free.py --quick: its arms agree with plain greedy decoding (numbers not asserted)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "mf.json"
    proc = subprocess.run([sys.executable, str(root / "bench" / "model_free.py"), "--quick", "--arms", "plain",
                           "suffix", "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"plain", "suffix"}
    assert all(s["greedy_identical_to_plain"] for s in summary.values())
    assert summary["suffix"]["mean_acceptance_length"]["median"] >= 1.0
    assert out.with_suffix(".png").stat().st_size > 10_000
