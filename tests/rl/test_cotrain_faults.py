"""Co-training faults: a dead training rank fails the step at once with an error naming it (no hang),
and a drafter push the engines reject is reported, never silently ignored."""

from __future__ import annotations

import time
import warnings

import pytest
import ray

from _trainer_utils import fake_rollout_batch

from cotrain.config import load_config

COTRAIN = ["policy.micro_batch_size=4", "grpo.prompts_per_step=4", "policy.parallel.pipeline=2",
           "draft.kind=dflash", "draft.cotrain=true", "draft.dflash.block_size=4", "rollout.speculative.method=null",
           "draft.tap_timeout_s=600"]


def test_a_killed_training_rank_fails_the_step_naming_it(tiny_model_path):
    from cotrain.rl.workers import TrainerGroup, TrainerRankDiedError

    if ray.is_initialized():  # an earlier in-process run's Ray
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        group = TrainerGroup(load_config("configs/grpo.yaml", COTRAIN), tiny_model_path)
        batch = fake_rollout_batch()
        group.logprobs(batch, draft_step=1)  # a healthy step first
        ray.kill(group.actors[0])  # stage 0 (the source of the layer-0 tap) dies
        t0 = time.monotonic()
        with pytest.raises(TrainerRankDiedError, match=r"training rank 0 died during logprobs"):
            group.logprobs(batch, draft_step=2)
        # rank 1 is blocked in the pipeline (and the tap wait has a 600 s timeout): not waited for
        assert time.monotonic() - t0 < 30
        t0 = time.monotonic()
        group.shutdown()
        assert time.monotonic() - t0 < 15
    finally:
        ray.shutdown()


class _Rejecting:
    """A generation backend whose engines reject drafter pushes (and accept the policy's)."""

    def __init__(self):
        self.pushed = []

    def push_handle(self, kind, handle, version):
        from cotrain.rl.weight_transport import WeightPushError

        if kind == "draft":
            raise WeightPushError(f"1 of 1 engines rejected the draft push of version {version}: shape mismatch")
        self.pushed.append((kind, version))


class _Exporting:
    def __init__(self):
        self.released = []

    def export(self, kind, version, transport):
        return {"kind": kind, "version": version}

    def release_export(self, handle):
        self.released.append(handle)


def test_a_rejected_drafter_push_is_reported(tmp_path):
    from cotrain.rl.driver import GrpoRun

    cfg = load_config("configs/demo.yaml", [f"run.output_dir={tmp_path}"])
    run = GrpoRun(cfg)
    run.trainer, run.rollout = _Exporting(), _Rejecting()
    with pytest.warns(UserWarning, match=r"step 3: the drafter push was rejected, the engines keep serving the "
                                         r"previous drafter \(1 rejected so far\).*shape mismatch"):
        m = run.push_draft(3)
    assert m["draft/push_ok"] == 0.0
    assert run.trainer.released == [{"kind": "draft", "version": 3}]  # the export is freed either way
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert run.push_draft(4)["draft/push_ok"] == 0.0
    assert run.rejected_draft_pushes == 2
    run.push("policy", 4)  # policy pushes are unaffected
    assert run.rollout.pushed == [("policy", 4)]
