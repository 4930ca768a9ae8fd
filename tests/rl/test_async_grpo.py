"""Asynchronous GRPO (grpo.max_staleness = 1) on the real workers: Megatron trainer and vLLM engines
in Ray actors, the DFlash drafter co-trained and serving, the draw of step t+1 running in the
driver's background thread beside step t's update.

What the real stack adds to the driver-contract tests (tests/rl/test_driver_contract.py, fakes):
vLLM's own weight-version labels follow the schedule (the driver refuses a step whose samples do
not carry its draw's version), the staleness is real (step 1 is on-policy: the engines' and the
trainer's log-probs agree; from step 2 on the samples come from the policy one update older, so
they disagree and the truncated IS weights leave 1), the drafter version on every speculative
sample is the last drafter push before its draw, and the checkpoint holds the samples in flight -
exactly the ones the next step trains on, which is what makes a resume continue the schedule (the
resume itself: the driver-contract tests, and tests/rl/test_grpo_e2e.py for the workers)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

OVERRIDES = ["grpo.num_steps=3", "grpo.prompts_per_step=4", "grpo.group_size=4", "rollout.sampling.max_tokens=8",
             "data.eval.every=0", "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.every=2",
             "checkpoint.keep_last=null", "draft.init=null", "draft.compare_frozen=false", "grpo.max_staleness=1",
             "grpo.importance_correction=tis", "policy.optimizer.lr=1e-3", "checkpoint.export_final=false"]


def test_staleness_one_on_the_real_workers(tmp_path, tiny_model_path):
    import ray

    from cotrain.config import load_config
    from cotrain.checkpoint import CheckpointManager
    from cotrain.rl.driver import GrpoRun
    from cotrain.rl.inflight import groups_from_state

    cfg = load_config("configs/demo.yaml", [f"run.output_dir={tmp_path}", *OVERRIDES])
    run = GrpoRun(cfg)
    trained = {}
    draw = run.draw_groups

    def recording_draw(step, version=None):
        trained[step] = g = draw(step, version)
        return g

    run.draw_groups = recording_draw
    try:
        run.setup(resume=False)
        m = {}
        for step in (1, 2, 3):
            m[step] = run.run_step(step)
            run.state.step, run.state.data = step, run.stream.state()
            if step == 2:
                run.save_checkpoint(2)
    finally:
        run.shutdown()
        ray.shutdown()
    # the schedule, in vLLM's labels: steps 1 and 2 by the initial policy, step 3 by step 1's
    assert [trained[s].version for s in (1, 2, 3)] == [0, 0, 1]
    assert [{x.weight_version for row in trained[s].samples for x in row} for s in (1, 2, 3)] == [{0}, {0}, {1}]
    assert [m[s]["async/policy_lag"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    # the drafter that drafted each sample: the initial one for steps 1-2, step 1's push for step 3
    assert {x.draft_version for row in trained[3].samples for x in row} == {1}
    # on-policy at step 1 (the fp32 trainer and engines agree), one update stale at step 2
    assert m[1]["kl/train_infer"] < 1e-6 and m[1]["train/is_ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert m[2]["kl/train_infer"] > 1e3 * max(m[1]["kl/train_infer"], 1e-12)
    assert m[2]["train/is_ratio_mean"] != pytest.approx(1.0, abs=1e-3)
    # the checkpoint of step 2 holds step 3's samples (drawn beside step 2's update): those step 3 trained on
    saved = CheckpointManager.load_driver_state(CheckpointManager(tmp_path / "checkpoints").step_dir(2))
    assert sorted(saved["ahead"]) == ["3"]
    restored = groups_from_state(saved["ahead"]["3"])
    assert restored.samples == trained[3].samples and restored.version == 1
    assert torch.equal(restored.rewards, trained[3].rewards)
    assert m[3]["reward/mean"] == pytest.approx(restored.first_rewards.mean().item())
