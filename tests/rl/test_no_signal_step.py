"""A GRPO step without a learning signal takes no optimizer step (grpo.min_groups_with_signal),
on the real workers: the policy's weights, its Adam moments, the LR schedule and the step counters
in the checkpoint after such a step are bit-identical to those before it, while the co-trained
drafter still trains on its rollouts (they are the current policy's real outputs).

One in-process run of the demo (tiny model, DFlash co-trained): step 1 on the arithmetic task
(the warm-started policy answers some samples right: a signal), step 2 on the same kind of prompts
with answers no sample can give (every reward equal: no signal)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

OVERRIDES = ["grpo.num_steps=2", "grpo.prompts_per_step=4", "grpo.group_size=4", "rollout.sampling.max_tokens=8",
             "data.eval.every=0", "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.every=1000",
             "draft.init=null", "draft.compare_frozen=false"]


def _equal(a, b, path="") -> list[str]:
    """The paths where two nested checkpoint states differ (tensors bit for bit)."""
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in _equal(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _equal(x, y, f"{path}/{i}")]
    if isinstance(a, torch.Tensor):
        return [] if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) else [path]
    return [] if a == b else [path]


def test_a_step_without_signal_leaves_the_policy_and_its_optimizer_bit_identical(tmp_path, tiny_model_path):
    import ray

    from cotrain.config import load_config
    from cotrain.checkpoint import load_plain
    from cotrain.rl.driver import GrpoRun
    from cotrain.tasks.data import Problem, PromptStream

    cfg = load_config("configs/demo.yaml", [f"run.output_dir={tmp_path}", *OVERRIDES])
    run = GrpoRun(cfg)
    try:
        run.setup(resume=False)
        first = run.step(1)
        assert first["train/skipped"] == 0.0 and first["grpo/groups_with_signal"] >= 1  # (the case: a real update)
        run.save_checkpoint(1)
        before_draft = run.trainer.named_weights("draft")
        # the same kind of prompts, with answers no sample gives: every reward is reward.incorrect
        impossible = [Problem(p.prompt, "-1") for p in run.stream.problems[:8]]
        run.stream = PromptStream(impossible, seed=0, shuffle=False)
        second = run.step(2)
        run.save_checkpoint(2)
        after_draft = run.trainer.named_weights("draft")
    finally:
        run.shutdown()
        ray.shutdown()
    assert second["train/skipped"] == 1.0 and second["grpo/groups_with_signal"] == 0.0
    assert "train/grad_norm" not in second and second["reward/mean"] == cfg.reward.incorrect
    ckpt = tmp_path / "checkpoints"
    s1, s2 = (load_plain(ckpt / f"step_00000{k}" / "trainer_rank0000.pt", map_location="cpu") for k in (1, 2))
    for key in ("model", "optimizer", "scheduler", "steps_done", "updates_done"):
        assert not _equal(s1[key], s2[key], key), f"the step without signal changed {key}: {_equal(s1[key], s2[key], key)[:5]}"
    assert s1["optimizer"]["state"]  # Adam's moments exist (step 1 stepped): they, too, stayed
    # ... and the drafter trained on step 2's rollouts
    assert "draft/loss" in second
    assert any(not torch.equal(before_draft[k], after_draft[k]) for k in before_draft)
