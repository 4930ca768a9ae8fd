"""The run's optimizer-step count (the LR schedule's length), by hand."""

import pytest

from _config_helpers import shipped

from cotrain.config.derived import total_optimizer_steps


@pytest.mark.parametrize("gbs, epochs, want", [(None, 1, 5), (8, 1, 10), (8, 3, 30), (4, 2, 40)])
def test_total_optimizer_steps_by_hand(gbs, epochs, want):
    # 5 steps x (4 prompts x 4 samples = 16 sequences) / global batch x epochs
    over = ["grpo.num_steps=5", "grpo.prompts_per_step=4", "grpo.group_size=4", "policy.micro_batch_size=4",
            f"grpo.epochs={epochs}"] + ([f"grpo.global_batch_size={gbs}"] if gbs else [])
    assert total_optimizer_steps(shipped("grpo.yaml", over)) == want
