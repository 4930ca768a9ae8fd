"""Co-training faults: a dead training rank fails the step at once with an error naming it (no hang).
(A drafter push the engines reject is reported, never silently ignored: tests/rl/test_driver_contract.py.)"""

from __future__ import annotations

import time

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
