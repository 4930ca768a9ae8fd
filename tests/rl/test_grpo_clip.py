"""GRPO's clipped surrogate with asymmetric bounds and its KL term, by hand (every other
test uses clip 0.2/0.2, where swapping the bounds changes nothing)."""

import math

import pytest
import torch

from cotrain.rl.grpo import grpo_token_losses


def test_asymmetric_clip_bounds_by_hand():
    # eps_low = 0.1, eps_high = 0.3: ratios are clipped to [0.9, 1.3]
    ratio = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.1])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    logp = ratio.log().clone().requires_grad_(True)
    loss, info = grpo_token_losses(logp, torch.zeros(5), adv, clip_low=0.1, clip_high=0.3, clip_ratio_c=None)
    # A > 0, ratio 1.5: min(1.5, 1.3) = 1.3;  A < 0, ratio 0.5: min(-0.5, -0.9) = -0.9
    # A < 0, ratio 1.5: min(-1.5, -1.3) = -1.5 (unclipped); A > 0, ratio 0.5: min(0.5, 0.9) = 0.5
    # inside the bounds: 1.1
    torch.testing.assert_close(loss, torch.tensor([-1.3, 0.9, 1.5, -0.5, -1.1]), atol=1e-6, rtol=0)
    assert info["clipped"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    loss.sum().backward()
    # clipped tokens get no gradient; the others d(-ratio * A)/dlogp = -ratio * A
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.0, 1.5, -0.5, -1.1]), atol=1e-6, rtol=0)


def test_swapped_bounds_give_another_loss():
    ratio = torch.tensor([1.5, 0.5])
    adv = torch.tensor([1.0, -1.0])
    a, _ = grpo_token_losses(ratio.log(), torch.zeros(2), adv, clip_low=0.1, clip_high=0.3)
    b, _ = grpo_token_losses(ratio.log(), torch.zeros(2), adv, clip_low=0.3, clip_high=0.1)
    torch.testing.assert_close(b, torch.tensor([-1.1, 0.7]), atol=1e-6, rtol=0)
    assert not torch.allclose(a, b)


def test_k3_penalty_and_its_clamp_by_hand():
    # d = ref - logp; k3 = e^d - d - 1: d = 1 -> e - 2; d = -0.5 -> e^-0.5 - 0.5; d = 3 -> e^3 - 4 = 16.09 -> clamped 10
    logp = torch.tensor([-1.0, -1.0, -4.0])
    ref = torch.tensor([0.0, -1.5, -1.0])
    adv = torch.zeros(3)
    loss, info = grpo_token_losses(logp, logp.clone(), adv, 0.2, 0.2, ref_logp=ref, kl_coef=0.5, kl_clamp=10.0)
    k3 = [math.e - 2, math.exp(-0.5) - 0.5, math.exp(3) - 4]
    torch.testing.assert_close(info["kl_ref"], torch.tensor(k3), atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, 0.5 * torch.tensor([k3[0], k3[1], 10.0]), atol=1e-5, rtol=0)
    assert float(info["kl_ref"].min()) > 0


@pytest.mark.parametrize("adv, want", [(-1.0, 3.0), (1.0, -1.3)])
def test_dual_clip_with_asymmetric_bounds(adv, want):
    # ratio 4: A < 0 -> min(-4, -1.3) = -4, floored at c * A = -3 -> loss 3; A > 0 -> min(4, 1.3) -> -1.3
    loss, info = grpo_token_losses(torch.tensor([math.log(4.0)]), torch.zeros(1), torch.tensor([adv]), 0.1, 0.3,
                                   clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert info["dual_clipped"].item() == (1.0 if adv < 0 else 0.0)
