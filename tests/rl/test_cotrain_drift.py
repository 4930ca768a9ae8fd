"""Co-training in the loop keeps the drafter current while the policy drifts, and the engines serve
exactly the drafter the trainer trained.

One in-process GRPO run of the demo (DFlash, initialised from the cached offline distillation)
with a high policy learning rate, so that the policy's greedy outputs move within a few steps.
Afterwards, on held-out prompts, greedily:

- the engines' output is the current policy's own greedy output (Hugging Face, same weights),
  whichever drafter they serve (speculation is lossless);
- for the co-trained drafter (pushed by the loop) and for a frozen copy of its initial weights
  (pushed by the test), vLLM's measured acceptance equals the offline estimate of that drafter on
  the current policy (the trained drafter and the served one compute the same thing);
- the co-trained drafter's acceptance beats the frozen copy's, in vLLM and offline, and in the loop
  (``draft.compare_frozen``: the frozen copy scored on every step's own chains).
"""

from __future__ import annotations

import pytest


pytestmark = pytest.mark.slow

# Forced drift: at this learning rate the policy leaves its warm start within a few steps (KL to the
# initial policy ~6 nats per token after 8 steps; its reward collapses - this is a stress test of the
# drafter, not a training recipe). At gentler rates (2e-3 for 6 steps) the distilled drafter, trained
# on the initial policy's greedy outputs, still beats the one co-trained on temperature-1 rollouts
# at greedy acceptance: see docs/cotrain.md.
STEPS = 8
OVERRIDES = [f"grpo.num_steps={STEPS}", "grpo.prompts_per_step=16", "grpo.group_size=8", "policy.micro_batch_size=32",
             "policy.optimizer.lr=5e-3", "policy.reference_model=true", "draft.optimizer.lr=3e-3",
             "data.eval.every=0", "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.every=1000",
             "draft.compare_frozen=true", "grpo.min_groups_with_signal=0"]  # (forced drift: even once the reward collapses)
K = 3  # rollout.speculative.num_speculative_tokens of the demo


def vllm_greedy(run, prompts):
    from cotrain.rl.interfaces import SamplingSpec

    gen = run.rollout.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=16, seed=0), n=1)
    samples = [row[0] for row in gen.samples]
    steps = sum(s.spec_decode["num_spec_steps"] for s in samples)
    acc = sum(s.spec_decode["num_accepted_draft_tokens"] for s in samples)
    return [s.token_ids for s in samples], 1.0 + acc / steps


@pytest.fixture(scope="module")
def drifted(tmp_path_factory, tiny_model_path):
    from transformers import AutoTokenizer

    from cotrain.config import load_config
    from cotrain.draft.distill import generate_records, records_to_batch
    from cotrain.draft.export import read_export
    from cotrain.draft.registry import build_drafter
    from cotrain.draft.taps import TargetSpec, load_hf_target
    from cotrain.rl.driver import GrpoRun

    out = tmp_path_factory.mktemp("drift")
    cfg = load_config("configs/demo.yaml", [f"run.output_dir={out}", *OVERRIDES])
    run = GrpoRun(cfg)
    try:
        run.setup(resume=False)
        first = run.step(1)
        for step in range(2, STEPS + 1):
            last = run.step(step)
        prompts = [p.prompt for p in run.eval_problems[:64]]
        # the current policy in Hugging Face form, and its greedy responses (+ tails) with taps
        hf = load_hf_target(tiny_model_path)
        hf.load_state_dict(run.trainer.named_weights("policy"), strict=True)
        tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
        base = TargetSpec.from_checkpoint(tiny_model_path)
        target = TargetSpec.from_model(hf, base.mask_token_id)
        records = generate_records(hf, tok, prompts, max_new_tokens=16, tail_tokens=8)
        cotrained = build_drafter("dflash", cfg.draft.settings, target)
        cotrained.load_vllm_state_dict(run.trainer.named_weights("draft"))
        frozen = build_drafter("dflash", cfg.draft.settings, target)
        frozen.load_vllm_state_dict(read_export(out / "drafter_init")[2])
        drafters = {"cotrained": cotrained, "frozen": frozen}
        batch = records_to_batch(records, hf, cotrained.tap_layers)
        served = {"cotrained": vllm_greedy(run, prompts)}
        run.rollout.push_weights("draft", {n: t for n, t in frozen.vllm_state_dict().items()}, version=10_000)
        served["frozen"] = vllm_greedy(run, prompts)
        yield dict(run=run, first=first, last=last, records=records, batch=batch, drafters=drafters, served=served,
                   target=target)
    finally:
        import ray

        run.shutdown()
        ray.shutdown()  # the run started a local Ray in this process


def test_the_policy_drifted(drifted):
    assert drifted["last"]["kl/ref"] > 1.0, drifted["last"]["kl/ref"]


def test_the_loop_measures_the_frozen_copy_on_its_own_chains(drifted):
    """draft.compare_frozen: before the first update the two drafters are one (equal acceptance on
    the step's chains); after the drift the co-trained one accepts more on the same chains, as the
    held-out comparison below finds."""
    first, last = drifted["first"], drifted["last"]
    assert first["draft/acceptance_offline_frozen"] == first["draft/acceptance_offline"]
    assert last["draft/acceptance_offline"] > last["draft/acceptance_offline_frozen"] + 0.3, last


def test_speculation_stays_lossless_whichever_drafter(drifted):
    want = [r.response for r in drifted["records"]]
    for name, (tokens, _) in drifted["served"].items():
        assert tokens == want, name


@pytest.mark.parametrize("name", ["cotrained", "frozen"])
def test_served_acceptance_equals_the_offline_estimate(drifted, name):
    from cotrain.draft.acceptance import estimate_acceptance

    off = estimate_acceptance(drifted["drafters"][name], drifted["batch"], k=K, eos_token_id=drifted["target"].eos_token_id)
    served = drifted["served"][name][1]
    assert served == pytest.approx(off.walk_len, rel=0.10), (served, off.walk_len)


def test_cotrained_drafter_beats_the_frozen_copy(drifted):
    from cotrain.draft.acceptance import estimate_acceptance

    served = {n: v[1] for n, v in drifted["served"].items()}
    off = {n: estimate_acceptance(d, drifted["batch"], k=K, eos_token_id=drifted["target"].eos_token_id).walk_len
           for n, d in drifted["drafters"].items()}
    # (the lead depends on the built tiny model, whose weights follow the machine's float arithmetic:
    # on an AVX-512 build 1.32 / 1.24 (served / offline) against the frozen copy's 1.00, above +0.3
    # on the AVX2 one; the bar is below both, far above zero)
    assert served["cotrained"] > served["frozen"] + 0.15, served
    assert off["cotrained"] > off["frozen"] + 0.15, off
