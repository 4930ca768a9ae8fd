"""The Megatron trainer on Ray: log-probs and GRPO gradients match a Hugging Face reference, and
PP=2 / DP=2 / TP=2 / CP=2 layouts take the same step as a single rank (token_mean; seq_mean on one
rank and at CP=2, where a rank holds only chunks of every sequence)."""

import pytest
import ray
import torch

from _trainer_utils import fake_rollout_batch

from cotrain.config import load_config
from cotrain.rl.grpo import grpo_token_losses

OVERRIDES = ["policy.micro_batch_size=4", "grpo.prompts_per_step=4", "policy.reference_model=true",
             "grpo.kl_coef=0.05", "grpo.clip_eps_low=0.2", "grpo.clip_eps_high=0.2"]
LAYOUTS = {"pp1": [], "pp2": ["policy.parallel.pipeline=2"], "dp2": ["policy.parallel.data=2"],
           "tp2": ["policy.parallel.tensor=2"], "cp2": ["policy.parallel.context=2"]}
# (layout, grpo.loss_agg)
RUNS = [(layout, "token_mean") for layout in LAYOUTS] + [("pp1", "seq_mean"), ("cp2", "seq_mean")]
# Tensor parallelism sums partial matmuls in another order: ~1e-6 apart in log-probs, and Adam's
# first step (lr * g / |g|) turns that into up to ~lr/10 on parameters whose gradient is ~0.
WEIGHT_ATOL = {"pp2": 1e-6, "dp2": 1e-6, "tp2": 5e-5, "cp2": 5e-5}
LOGPROB_ATOL = {"pp2": 1e-6, "dp2": 1e-6, "tp2": 1e-5, "cp2": 1e-5}


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
            batch.old_logprobs = lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(0)) * batch.mask
            batch.ref_logprobs = ref
            metrics = group.train_step(batch)
            out[(name, agg)] = dict(batch=batch, lp=lp, ref=ref, metrics=metrics, weights=group.named_weights())
        finally:
            group.shutdown()
    return out


def _hf_logprobs(model, batch):
    logits = model(input_ids=batch.inputs).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, batch.targets[..., None])[..., 0]


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
    adv = b.advantages[:, None].expand_as(logp)
    tok, _ = grpo_token_losses(logp, b.old_logprobs, adv, 0.2, 0.2, ref_logp=b.ref_logprobs, kl_coef=0.05)
    m = b.mask
    if agg == "token_mean":  # written out by hand, not through aggregate()
        loss = (tok * m).sum() / m.sum()
    else:
        loss = ((tok * m).sum(1) / m.sum(1)).mean()
    loss.backward()
    gn = torch.sqrt(sum(p.grad.pow(2).sum() for p in hf.parameters() if p.grad is not None)).item()
    assert r["metrics"]["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-6)
    assert r["metrics"]["grad_norm"] == pytest.approx(gn, rel=1e-4)
    assert r["metrics"]["kl_ref"] == pytest.approx(0.0, abs=1e-12)  # policy == reference before the step
    assert 0 < r["metrics"]["clip_frac"] < 1


@pytest.mark.parametrize("layout, agg", [("pp2", "token_mean"), ("dp2", "token_mean"), ("tp2", "token_mean"),
                                         ("cp2", "token_mean"), ("cp2", "seq_mean")])
def test_parallel_layouts_take_the_same_step(results, layout, agg, tiny_model_path):
    from cotrain.models.hf_io import load_hf_state_dict

    base, other = results[("pp1", agg)], results[(layout, agg)]
    torch.testing.assert_close(other["lp"], base["lp"], atol=LOGPROB_ATOL[layout], rtol=0)
    for k in ("loss", "grad_norm", "clip_frac"):
        assert other["metrics"][k] == pytest.approx(base["metrics"][k], rel=1e-5, abs=1e-9), k
    init = load_hf_state_dict(tiny_model_path)
    assert set(base["weights"]) == set(init)
    moved = max((base["weights"][n] - init[n]).abs().max().item() for n in init)
    assert moved > 1e-6  # the step did update the policy, so agreeing after it means something
    for name, w in base["weights"].items():
        torch.testing.assert_close(other["weights"][name], w, atol=WEIGHT_ATOL[layout], rtol=0, msg=name)
