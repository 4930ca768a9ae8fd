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


# ------------------------------------------------------------------ k3 >= 0, leave-one-out, the guards
def _k3_exact(d: float) -> float:
    """exp(d) - d - 1 to 50 digits (decimal), as an independent reference."""
    from decimal import Decimal, getcontext

    getcontext().prec = 50
    x = Decimal(d)
    return float(x.exp() - x - 1)


def test_k3_is_never_negative_and_matches_high_precision():
    """float32 exp(d) - d - 1 rounds to about -1e-8 for |d| ~ 1e-4 (the negative kl/train_infer)."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4096, generator=g) * 5
    ref = logp + (torch.rand(4096, generator=g) - 0.5) * 2e-4  # train-inference sized differences
    k3 = k3_kl(logp, ref)
    assert k3.dtype == torch.float32
    assert (k3 >= 0).all()
    d = (ref.double() - logp.double()).tolist()
    want = torch.tensor([_k3_exact(x) for x in d], dtype=torch.float64)
    torch.testing.assert_close(k3.double(), want, rtol=1e-5, atol=1e-20)
    assert k3.double().mean().item() == pytest.approx(want.mean().item(), rel=1e-6)


def test_train_inference_kl_metric_is_non_negative():
    from cotrain.rl.batch import TrainBatch
    from cotrain.rl.driver import train_inference_kl

    g = torch.Generator().manual_seed(1)
    N, S = 8, 32
    mask = torch.zeros(N, S)
    mask[:, 4:] = 1
    roll = -torch.rand(N, S, generator=g) * 3 * mask
    train = (roll + (torch.rand(N, S, generator=g) - 0.5) * 1e-4) * mask
    batch = TrainBatch(inputs=torch.zeros(N, S, dtype=torch.long), targets=torch.zeros(N, S, dtype=torch.long),
                       mask=mask, advantages=torch.zeros(N), rollout_logprobs=roll, old_logprobs=train)
    m = train_inference_kl(batch)
    sel = mask.bool()
    d = (train[sel].double() - roll[sel].double()).tolist()
    want = sum(_k3_exact(x) for x in d) / len(d)
    assert m["kl/train_infer"] >= 0
    assert m["kl/train_infer"] == pytest.approx(want, rel=1e-6)


def test_leave_one_out_uses_the_groups_std_hand_example():
    """One correct answer among 4: LOO baselines [0, 1/3, 1/3, 1/3], raw advantages [1, -1/3, -1/3, -1/3];
    the group's unbiased std of [1, 0, 0, 0] is 1/2, so A = [2, -2/3, -2/3, -2/3]: G/(G-1) = 4/3 times
    the mean-baseline advantages, summing to 0 (NeMo-RL's per-sample std of the other G-1 would give
    (population std sqrt(2/9) for the wrong ones) [1, -0.707, -0.707, -0.707], which does not)."""
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    loo = group_advantages(r, "leave_one_out", normalize_std=True, eps=0.0)
    torch.testing.assert_close(loo, torch.tensor([[2.0, -2 / 3, -2 / 3, -2 / 3]]))
    torch.testing.assert_close(loo, group_advantages(r, "mean", eps=0.0) * 4 / 3)
    assert loo.sum().item() == pytest.approx(0.0, abs=1e-6)


def test_dual_clip_bounds_a_negative_advantage_token_hand_computed():
    # ratio 4 with A = -1: min(4*(-1), 1.2*(-1)) = -4 -> loss 4; the dual clip (c = 3) floors the
    # objective at c*A = -3 -> loss 3 with zero gradient. With A = +1 the dual clip does nothing.
    logp = torch.tensor([math.log(4.0), math.log(4.0), math.log(2.0)], requires_grad=True)
    old = torch.zeros(3)
    adv = torch.tensor([-1.0, 1.0, -1.0])
    loss, info = grpo_token_losses(logp, old, adv, 0.2, 0.2, clip_ratio_c=3.0)
    torch.testing.assert_close(loss, torch.tensor([3.0, -1.2, 2.0]))  # token 3: ratio 2 < 3, -min(-2, -1.2) = 2
    assert info["dual_clipped"].tolist() == [1.0, 0.0, 0.0]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.0, 2.0]))  # d(-ratio*A)/dlogp = ratio for A=-1
    off, _ = grpo_token_losses(logp.detach(), old, adv, 0.2, 0.2, clip_ratio_c=None)
    torch.testing.assert_close(off, torch.tensor([4.0, -1.2, 2.0]))
    with pytest.raises(ValueError, match="clip_ratio_c.*> 1"):
        grpo_token_losses(logp, old, adv, 0.2, 0.2, clip_ratio_c=1.0)


def test_log_ratio_clamp_keeps_the_ratio_finite_hand_computed():
    logp, old, adv = torch.tensor([100.0, -100.0]), torch.zeros(2), torch.tensor([-1.0, 1.0])
    loss, info = grpo_token_losses(logp, old, adv, 0.2, 0.2, log_ratio_clamp=20.0, clip_ratio_c=None)
    assert info["ratio"].tolist() == pytest.approx([math.exp(20.0), math.exp(-20.0)], rel=1e-6)
    # token 1: -min(-e^20, -1.2) = e^20; token 2: -min(e^-20, 0.8) = -e^-20
    assert loss.tolist() == pytest.approx([math.exp(20.0), -math.exp(-20.0)], rel=1e-6)
    free, info = grpo_token_losses(logp, old, adv, 0.2, 0.2, log_ratio_clamp=None, clip_ratio_c=None)
    assert math.isinf(free[0].item())  # e^100 overflows float32


def test_kl_penalty_is_clamped_at_kl_clamp_but_the_metric_is_not():
    logp, ref = torch.tensor([-15.0, -1.0]), torch.tensor([0.0, -1.1])
    k3 = [math.exp(15.0) - 15.0 - 1.0, _k3_exact(-0.1)]
    loss, info = grpo_token_losses(logp, logp, torch.zeros(2), 0.2, 0.2, ref_logp=ref, kl_coef=0.5, kl_clamp=10.0)
    assert info["kl_ref"].tolist() == pytest.approx(k3, rel=1e-6)
    assert loss.tolist() == pytest.approx([0.5 * 10.0, 0.5 * k3[1]], rel=1e-6)
    loss, _ = grpo_token_losses(logp, logp, torch.zeros(2), 0.2, 0.2, ref_logp=ref, kl_coef=0.5, kl_clamp=None)
    assert loss.tolist() == pytest.approx([0.5 * k3[0], 0.5 * k3[1]], rel=1e-6)
    # the log-ratio clamp applies to k3's log ratio too: d = 25 -> 20
    assert k3_kl(torch.tensor([-25.0]), torch.tensor([0.0]), log_ratio_clamp=20.0).item() == \
        pytest.approx(math.exp(20.0) - 21.0, rel=1e-6)


# ------------------------------------------------------------------ off-policy correction (TIS / MIS)
def _is_case():
    """Two sequences, three positions each; the last position of row 1 is padding (mask 0). The
    trainer's log-probs (old) against the engines' (behaviour): ratios w = e^(old - behaviour)."""
    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -3.0, 0.0]])
    behaviour = torch.tensor([[-1.0, -1.5, -1.0], [-0.7, -2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return old, behaviour, mask


def test_truncated_importance_weights_hand_computed():
    from cotrain.rl.grpo import importance_weights

    old, behaviour, mask = _is_case()
    w, keep, stats = importance_weights(old, behaviour, mask, "tis", cap=2.0)
    e = math.e
    # ratios: 1, e^1 = 2.718 (> 2: truncated), e^-1, e^0.5 = 1.649, e^-1; padding weighs 0
    expected = torch.tensor([[1.0, 2.0, 1 / e], [e ** 0.5, 1 / e, 0.0]])
    torch.testing.assert_close(w, expected)
    assert torch.equal(keep, mask)  # tis keeps every token
    assert stats["train/is_ratio_mean"] == pytest.approx((1 + e + 1 / e + e ** 0.5 + 1 / e) / 5)
    assert stats["train/is_ratio_max"] == pytest.approx(e)
    assert stats["train/is_truncated_frac"] == pytest.approx(1 / 5)


def test_masked_importance_weights_reject_tokens_above_the_cap_hand_computed():
    from cotrain.rl.grpo import importance_weights

    old, behaviour, mask = _is_case()
    w, keep, stats = importance_weights(old, behaviour, mask, "mis", cap=1.5)
    e = math.e
    # w > 1.5: e (row 0) and e^0.5 (row 1) are rejected; the others keep their ratio
    torch.testing.assert_close(keep, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
    torch.testing.assert_close(w, torch.tensor([[1.0, 0.0, 1 / e], [0.0, 1 / e, 0.0]]))
    assert stats["train/is_truncated_frac"] == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="grpo.importance_correction"):
        importance_weights(old, behaviour, mask, "none", cap=2.0)


def test_is_weights_scale_the_policy_gradient_term_only_hand_computed():
    """l_t = -w_t * min(rho A, clip(rho) A) + beta k3_t, and the loss's gradient is w_t times the
    uncorrected one's policy-gradient part; with MIS's mask the rejected token leaves the token mean's
    denominator too."""
    from cotrain.rl.grpo import importance_weights

    old, behaviour, mask = _is_case()
    logp = (old + torch.tensor([[0.1, -0.05, 0.0], [0.02, 0.3, 0.0]])).requires_grad_()
    ref = old - 0.1
    adv = torch.tensor([[1.0] * 3, [-0.5] * 3])
    w, keep, _ = importance_weights(old, behaviour, mask, "mis", cap=1.5)
    loss, _ = grpo_token_losses(logp, old, adv, 0.2, 0.2, ref_logp=ref, kl_coef=0.1, clip_ratio_c=None,
                                is_weights=w)
    plain, _ = grpo_token_losses(logp, old, adv, 0.2, 0.2, ref_logp=ref, kl_coef=0.1, clip_ratio_c=None)
    kl = k3_kl(logp, ref)
    # by hand: the surrogate (ratio within the clip range here except none), weighted, plus the KL
    rho = torch.exp(logp - old)
    surrogate = torch.minimum(rho * adv, rho.clamp(0.8, 1.2) * adv)
    torch.testing.assert_close(loss, -w * surrogate + 0.1 * kl)
    torch.testing.assert_close(plain - 0.1 * kl, -surrogate)
    total = aggregate(loss, keep, "token_mean")
    assert total.item() == pytest.approx(((-w * surrogate + 0.1 * kl) * keep).sum().item() / 3)
    (g,) = torch.autograd.grad(total, logp)
    assert g[0, 1] == 0 and g[1, 0] == 0  # rejected tokens: no gradient at all (nor the KL's)
