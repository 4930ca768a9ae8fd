"""The Megatron trainer on Ray: log-probs and GRPO gradients match a Hugging Face reference
(token_mean and seq_mean, one rank). That the PP=2 / DP=2 / TP=2 / CP=2 layouts take the same step
is tests/rl/test_trainer_packing.py's (against the padded single-rank step).

The reference of ``test_second_step_matches_a_first_principles_grpo_loss`` is written out here from
the GRPO formulas (no cotrain function): asymmetric clip bounds, a sampling temperature other than 1
and a reference model that differs from the policy (the second step, after the policy has moved)."""

import pytest
import ray
import torch

from _trainer_utils import fake_rollout_batch, perturbed_old_logprobs

from cotrain.config import load_config

OVERRIDES = ["policy.micro_batch_size=4", "grpo.prompts_per_step=4", "policy.reference_model=true",
             "grpo.kl_coef=0.05", "grpo.clip_eps_low=0.2", "grpo.clip_eps_high=0.2"]
LAYOUTS = {"pp1": []}
# (layout, grpo.loss_agg)
RUNS = [("pp1", "token_mean"), ("pp1", "seq_mean")]


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def results(ray_local, tiny_model_path):
    from cotrain.rl.workers import TrainerGroup

    out = {}
    for name, agg in RUNS:
        batch = fake_rollout_batch()
        group = TrainerGroup(load_config("configs/grpo.yaml", OVERRIDES + LAYOUTS[name] + [f"grpo.loss_agg={agg}"]),
                             tiny_model_path)
        try:
            res = group.logprobs(batch)
            lp, ref = res.logprobs, res.ref_logprobs
            # perturb the "old" policy so that ratios differ from 1 and clipping and KL are exercised
            batch.old_logprobs = perturbed_old_logprobs(lp, batch.mask)
            batch.ref_logprobs = ref
            metrics = group.train_step(batch)
            out[(name, agg)] = dict(batch=batch, lp=lp, ref=ref, metrics=metrics, weights=group.named_weights())
        finally:
            group.shutdown()
    return out


def _hf_logprobs(model, batch, temperature=1.0):
    logits = model(input_ids=batch.inputs).logits.float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch.targets[..., None])[..., 0]


# asymmetric clip bounds, a temperature other than 1, a reference that is not the policy
ASYM = dict(low=0.1, high=0.3, temperature=0.7, kl=0.05, dual=3.0)
ASYM_OVERRIDES = ["policy.micro_batch_size=4", "grpo.prompts_per_step=4", "policy.reference_model=true",
                  f"grpo.kl_coef={ASYM['kl']}", f"grpo.clip_eps_low={ASYM['low']}", f"grpo.clip_eps_high={ASYM['high']}",
                  f"rollout.sampling.temperature={ASYM['temperature']}", f"grpo.clip_ratio_c={ASYM['dual']}",
                  "grpo.loss_agg=token_mean", "policy.optimizer.lr=5e-4", "grpo.kl_clamp=10.0"]


@pytest.fixture(scope="module")
def two_steps(ray_local, tiny_model_path):
    """Two train steps; the second one's log-probs, reference log-probs, batch and metrics."""
    from cotrain.rl.workers import TrainerGroup

    group = TrainerGroup(load_config("configs/grpo.yaml", ASYM_OVERRIDES), tiny_model_path)
    try:
        g = torch.Generator().manual_seed(1)
        batch = fake_rollout_batch()
        res = group.logprobs(batch)
        batch.old_logprobs = res.logprobs + 0.3 * torch.randn(res.logprobs.shape, generator=g) * batch.mask
        batch.ref_logprobs = res.ref_logprobs
        group.train_step(batch)  # the policy moves away from the reference
        weights = group.named_weights()
        res = group.logprobs(batch)
        batch2 = fake_rollout_batch(seed=3)
        res2 = group.logprobs(batch2)
        batch2.old_logprobs = res2.logprobs + 0.4 * torch.randn(res2.logprobs.shape, generator=g) * batch2.mask
        batch2.ref_logprobs = res2.ref_logprobs
        metrics = group.train_step(batch2)
    finally:
        group.shutdown()
    return dict(batch=batch, lp=res.logprobs, ref=res.ref_logprobs, weights=weights, batch2=batch2, lp2=res2.logprobs,
                metrics=metrics)


def _grpo_by_hand(logp, old, ref, adv, mask, low, high, kl, dual):
    """token_mean GRPO loss from the formulas: dual-clipped PPO surrogate + kl * min(k3, 10), k3 the
    estimator of KL(pi || ref) from pi's samples; also the clipped fraction and the unclamped k3's mean."""
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1 - low, 1 + high) * a
    obj = torch.minimum(unclipped, clipped)
    obj = torch.where(a < 0, torch.maximum(obj, dual * a), obj)
    d = ref - logp
    k3 = torch.exp(d) - d - 1
    tok = -obj + kl * torch.clamp(k3, max=10.0)
    n = mask.sum()
    return (tok * mask).sum() / n, ((clipped < unclipped).float() * mask).sum() / n, (k3 * mask).sum() / n


def test_logprobs_match_hf(results, tiny_model_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    r = results[("pp1", "token_mean")]
    with torch.no_grad():
        ref = _hf_logprobs(hf, r["batch"]) * r["batch"].mask
    torch.testing.assert_close(r["lp"], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r["ref"], r["lp"])  # the reference model starts as the policy


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_grpo_loss_and_grad_norm_match_hf_autograd(results, agg, tiny_model_path):
    """Independent reference: the same GRPO loss through HF autograd, in one process."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    r = results[("pp1", agg)]
    b = r["batch"]
    logp = _hf_logprobs(hf, b)
    m = b.mask
    if agg == "token_mean":  # written out by hand, not through grpo_token_losses() / aggregate()
        loss = _grpo_by_hand(logp, b.old_logprobs, b.ref_logprobs, b.advantages, m, 0.2, 0.2, 0.05, 3.0)[0]
    else:  # each sequence's token mean, then the mean over sequences
        loss = sum(_grpo_by_hand(logp[i:i + 1], b.old_logprobs[i:i + 1], b.ref_logprobs[i:i + 1], b.advantages[i:i + 1],
                                 m[i:i + 1], 0.2, 0.2, 0.05, 3.0)[0] for i in range(len(b))) / len(b)
    loss.backward()
    gn = torch.sqrt(sum(p.grad.pow(2).sum() for p in hf.parameters() if p.grad is not None)).item()
    assert r["metrics"]["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-6)
    assert r["metrics"]["grad_norm"] == pytest.approx(gn, rel=1e-4)
    assert r["metrics"]["kl_ref"] == pytest.approx(0.0, abs=1e-12)  # policy == reference before the step
    assert 0 < r["metrics"]["clip_frac"] < 1


def _hf_with(tiny_model_path, weights=None):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    if weights is not None:
        hf.load_state_dict(weights, strict=True)
    return hf


def test_reference_model_stays_the_initial_policy(two_steps, tiny_model_path):
    """After a step: the policy's log-probs are HF's on the trained weights, the reference model's are
    HF's on the initial ones, both at the sampling temperature; and they differ."""
    r, T = two_steps, ASYM["temperature"]
    b = r["batch"]
    with torch.no_grad():
        init = _hf_logprobs(_hf_with(tiny_model_path), b, T) * b.mask
        now = _hf_logprobs(_hf_with(tiny_model_path, r["weights"]), b, T) * b.mask
        at_one = _hf_logprobs(_hf_with(tiny_model_path, r["weights"]), b) * b.mask
    assert (now - init).abs().max() > 1e-2  # the policy did move: the two checks below are distinct
    assert (now - at_one).abs().max() > 1e-2  # and the temperature matters
    torch.testing.assert_close(r["ref"], init, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r["lp"], now, atol=1e-5, rtol=1e-5)


def test_second_step_matches_a_first_principles_grpo_loss(two_steps, tiny_model_path):
    r = two_steps
    b = r["batch2"]
    hf = _hf_with(tiny_model_path, r["weights"])
    logp = _hf_logprobs(hf, b, ASYM["temperature"])
    args = (b.old_logprobs, b.ref_logprobs, b.advantages, b.mask)
    torch.testing.assert_close(logp.detach() * b.mask, r["lp2"], atol=1e-5, rtol=1e-5)
    loss, clip_frac, kl_ref = _grpo_by_hand(logp, *args, ASYM["low"], ASYM["high"], ASYM["kl"], ASYM["dual"])
    loss.backward()
    gn = torch.sqrt(sum(p.grad.pow(2).sum() for p in hf.parameters() if p.grad is not None)).item()
    m = r["metrics"]
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-6)
    assert m["grad_norm"] == pytest.approx(gn, rel=1e-4)
    assert m["clip_frac"] == pytest.approx(clip_frac.item(), abs=1e-6)
    assert m["kl_ref"] == pytest.approx(kl_ref.item(), rel=1e-3)
    # the reference differs from the policy: the KL term is exercised. The unclamped k3 mean is heavy-tailed
    # (one token at d = log ref - log pi = 8 contributes e^8): 0.1-5 on one build of the tiny model, 2998 on
    # another (this machine's, at 0db3c28 too), so only its finiteness is bounded above
    assert 1e-3 < kl_ref.item() < float("inf")
    # the check can fail: swapped clip bounds, or no dual clip, give another loss
    with torch.no_grad():
        lp = logp.detach()
        swapped = _grpo_by_hand(lp, *args, ASYM["high"], ASYM["low"], ASYM["kl"], ASYM["dual"])
        no_kl = _grpo_by_hand(lp, *args, ASYM["low"], ASYM["high"], 0.0, ASYM["dual"])
    for other in (swapped, no_kl):
        assert abs(other[0].item() - loss.item()) > 1e-3 * max(abs(loss.item()), 1e-3) or \
            abs(other[1].item() - clip_frac.item()) > 1e-6
