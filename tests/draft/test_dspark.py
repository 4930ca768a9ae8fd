"""DSpark: distilled and measured offline on CPU; served by vLLM only where a GPU is present.

vLLM implements DSpark only in its V2 (GPU, Triton) model runner, so on CPU the drafter is trained
and its acceptance estimated offline; test_export.py loads its checkpoint into vLLM's DSpark class.
"""

import pytest
import torch

import _serving as S

pytestmark = pytest.mark.slow

KIND, K = "dspark", 7  # anchor-as-first: a block of 7 drafts 7 tokens


@pytest.fixture(scope="module")
def prepared(target, hf_target):
    with S.one_thread():
        yield S.prepare(KIND, K, hf_target, target)


def test_distilled_dspark_offline_acceptance(prepared):
    from cotrain.draft.cache import distilled_summary

    off = prepared.offline
    assert off.walk_len >= 2.0, off
    # the estimate is a property of the exported weights: the distillation measured the same
    summary = distilled_summary(prepared.drafter_dir.parent)
    assert summary["k"] == K and summary["acceptance_walk_len"] == pytest.approx(off.walk_len, abs=1e-9)
    # prefix survival decreases with the draft position and starts high
    assert off.per_position[0] > 0.6 and all(a >= b for a, b in zip(off.per_position, off.per_position[1:]))


def test_confidence_head_predicts_acceptance(prepared):
    from cotrain.draft.acceptance import greedy_matches

    d, b = prepared.drafter, prepared.batch
    with torch.no_grad():
        out = d(b, d.build_layout(b, all_anchors=True))
    from cotrain.draft.losses import overlap, target_probs

    match = greedy_matches(out, b.target_logits)[out.valid]
    conf = torch.sigmoid(out.confidence)[out.valid]
    # ranking: a draft the target accepts (greedy) mostly gets more confidence than one it rejects
    pos, neg = conf[match], conf[~match]
    auc = (pos[:, None] > neg[None, :]).double().mean().item()
    assert auc > 0.75 and match.any() and (~match).any(), auc
    # calibration: the head was trained on the overlap 1 - TV(p, q), its mean matches
    a = overlap(out.logits, target_probs(b.target_logits, out))[out.valid]
    assert abs(conf.mean().item() - a.mean().item()) < 0.05, (conf.mean(), a.mean())


@pytest.mark.gpu
def test_dspark_served_by_vllm_on_gpu(prepared, tiny_model_path):
    S.start_engine(tiny_model_path, prepared)
    try:
        S.check_acceptance_matches_offline(prepared)
    finally:
        S.stop_engine(prepared)
