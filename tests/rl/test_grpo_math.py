"""GRPO loss and advantages against a hand-computed example."""

import math

import pytest
import torch

from cotrain.rl.grpo import aggregate, group_advantages, grpo_token_losses, k3_kl


def test_advantages_mean_baseline_with_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # mean 0.5, unbiased std = sqrt(1/3)
    want = torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / math.sqrt(1 / 3)
    torch.testing.assert_close(group_advantages(r, eps=0.0), want)


def test_advantages_leave_one_out_without_std():
    r = torch.tensor([[3.0, 0.0, 0.0]])
    # baselines: (0+0)/2=0, (3+0)/2=1.5, 1.5
    torch.testing.assert_close(group_advantages(r, "leave_one_out", normalize_std=False),
                               torch.tensor([[3.0, -1.5, -1.5]]))


def test_all_equal_rewards_give_zero_advantage():
    assert torch.all(group_advantages(torch.ones(3, 4)) == 0)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="group_size>=2"):
        group_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match="grpo.baseline.*allowed: mean, leave_one_out"):
        group_advantages(torch.ones(2, 2), "median")
    with pytest.raises(ValueError, match="grpo.loss_agg"):
        aggregate(torch.ones(1, 1), torch.ones(1, 1), "sum")


def test_clipped_surrogate_hand_computed():
    # token 1: ratio e^0.5=1.6487 with A=+1 -> clipped at 1.2 -> loss -1.2
    # token 2: ratio e^-0.5=0.6065 with A=+1 -> unclipped smaller -> loss -0.6065
    # token 3: ratio 1.6487 with A=-2 -> min(-3.297, -2.4) = -3.297 -> loss 3.297 (pessimistic side)
    # token 4: ratio 1 with A=0 -> 0
    logp = torch.tensor([0.0, -0.5, 0.0, -1.0])
    old = torch.tensor([-0.5, 0.0, -0.5, -1.0])
    adv = torch.tensor([1.0, 1.0, -2.0, 0.0])
    loss, info = grpo_token_losses(logp, old, adv, clip_low=0.2, clip_high=0.2)
    want = torch.tensor([-1.2, -math.exp(-0.5), 2 * math.exp(0.5), 0.0])
    torch.testing.assert_close(loss, want)
    assert info["clipped"].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_gradient_of_clipped_token_is_zero_and_unclipped_is_ratio_times_adv():
    logp = torch.tensor([0.0, -0.5], requires_grad=True)
    old = torch.tensor([-0.5, 0.0])
    loss, _ = grpo_token_losses(logp, old, torch.tensor([1.0, 1.0]), 0.2, 0.2)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -math.exp(-0.5)]))


def test_kl_penalty_and_k3():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -2.0])
    d = -0.5
    torch.testing.assert_close(k3_kl(logp, ref), torch.tensor([math.exp(d) - d - 1, 0.0]))
    loss, info = grpo_token_losses(logp, logp, torch.zeros(2), 0.2, 0.2, ref_logp=ref, kl_coef=0.1)
    torch.testing.assert_close(loss, 0.1 * k3_kl(logp, ref))
    assert "kl_ref" in info


def test_aggregation_modes():
    tl = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(tl, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(tl, mask, "seq_mean").item() == pytest.approx((2 + 4) / 2)
    # splitting into micro-batches with global counts sums back to the global value
    parts = sum(aggregate(tl[i:i + 1], mask[i:i + 1], "token_mean", num_tokens=4) for i in range(2))
    assert parts.item() == pytest.approx(10 / 4)
