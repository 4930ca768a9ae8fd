"""The packed update (policy.packing, cotrain.rl.packing) takes the padded update's step, on a batch with
a long tail of lengths and a token budget that cuts it into several micro batches (unequal counts on
the two DP ranks): the policy's log-probs and reference log-probs, loss, grad norm, clipped
fraction, KL and weights after the step, and the co-trained drafter's loss, gradient norm and
weights, at PP=1, PP=2, CP=2, DP=2 and TP=2 (token_mean; seq_mean at CP=2, where a rank holds only chunks
of every sequence), and with the log-probs computed in chunks (at DP=2 and TP=2).

Tolerances (fp32): the packed rows run cotrain's attention kernel where the padded ones run
Megatron's local attention, and sum in another order: log-probs within 1e-5 (absolute and relative: random tokens sit at log-probs near -18), loss / grad norm /
clipped fraction rel 1e-5, grad norm rel 5e-5 (this batch's random tokens sit at log-probs near -18:
a steep step, grad norm ~70, where the two kernels' rounding shows), policy weights within 1e-6 and
drafter weights within 2e-5 after the step. Both optimizers run with eps = 1, so their first update
is ~lr * g / (|g| + 1), linear in a small gradient (Adam's usual eps turns a 1e-9 difference on a
near-zero gradient into a sign flip of lr)."""

import pytest
import ray
import torch

from _trainer_utils import perturbed_old_logprobs

from cotrain.config import load_config
from cotrain.rl.batch import build_batch
from cotrain.rl.grpo import group_advantages
from cotrain.rl.interfaces import Sample

BASE = ["grpo.prompts_per_step=4", "grpo.group_size=4", "policy.reference_model=true", "grpo.kl_coef=0.05",
        "policy.max_seq_len=64", "rollout.sampling.max_tokens=48", "rollout.sampling.temperature=0.8",
        "rollout.speculative.method=null", "draft.kind=dflash", "draft.cotrain=true", "draft.dflash.block_size=4",
        "draft.dflash.anchors_per_seq=2", "draft.optimizer.lr=0.5", "draft.optimizer.eps=1.0",
        "draft.optimizer.clip_grad=0.0", "policy.optimizer.eps=1.0", "policy.optimizer.lr=5e-3"]
BUDGET = 72
ARMS = {"padded": ["policy.packing=false", "policy.micro_batch_size=4"],
        "packed": ["policy.packing=true", f"policy.max_tokens_per_microbatch={BUDGET}"],
        "chunked": ["policy.packing=true", f"policy.max_tokens_per_microbatch={BUDGET}", "policy.logprob_chunk_tokens=8"]}
# the off-policy correction's per-token weights (grpo.importance_correction) ride on a padded and a packed DP=2 run
ARMS.update(padded_is=ARMS["padded"], packed_is=ARMS["packed"])
LAYOUTS = {"pp1": [], "pp2": ["policy.parallel.pipeline=2"], "cp2": ["policy.parallel.context=2"],
           "dp2": ["policy.parallel.data=2"], "tp2": ["policy.parallel.tensor=2"]}
# chunked log-probs ride on the DP=2 run (two ranks, several micro batches each, chunks of 8 positions)
# and the TP=2 one (chunks of the vocabulary-parallel logits)
RUNS = [("padded", "pp1", "token_mean"), ("packed", "pp1", "token_mean"), ("packed", "pp2", "token_mean"),
        ("packed", "cp2", "token_mean"), ("chunked", "dp2", "token_mean"), ("chunked", "tp2", "token_mean"),
        ("padded", "pp1", "seq_mean"), ("packed", "cp2", "seq_mean"),
        ("padded_is", "pp1", "token_mean"), ("packed_is", "dp2", "token_mean")]


def is_weights(mask: torch.Tensor) -> torch.Tensor:
    """Seeded per-token weights in [0, 2] on the response targets (as tis / mis hand them over)."""
    w = 2 * torch.rand(mask.shape, generator=torch.Generator().manual_seed(1))
    return w * mask


def long_tail_batch(seed: int = 0):
    """16 sequences: prompts of 3-8 tokens, responses mostly 2-10 tokens and a tail to 48."""
    g = torch.Generator().manual_seed(seed)
    samples, rewards = [], []
    for i in range(4):
        prompt = torch.randint(3, 99, (int(torch.randint(3, 9, (), generator=g)),), generator=g).tolist()
        row = []
        for j in range(4):
            n = int(torch.randint(2, 11, (), generator=g)) if (i + j) % 5 else int(torch.randint(30, 49, (), generator=g))
            ids = torch.randint(3, 99, (n,), generator=g).tolist()
            samples.append(Sample(prompt_index=i, prompt_token_ids=prompt, token_ids=ids, logprobs=[-0.5] * n,
                                  text="", finish_reason="stop", weight_version=0))
            row.append(float(torch.rand((), generator=g) < 0.5))
        rewards.append(row)
    adv = group_advantages(torch.tensor(rewards)).flatten().tolist()
    return build_batch(samples, adv, pad_id=0, multiple_of=4)


@pytest.fixture(scope="module")
def runs(tiny_model_path):
    from cotrain.rl.workers import TrainerGroup

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    out = {}
    try:
        for arm, layout, agg in RUNS:
            batch = long_tail_batch()
            cfg = load_config("configs/grpo.yaml", BASE + ARMS[arm] + LAYOUTS[layout] + [f"grpo.loss_agg={agg}"])
            group = TrainerGroup(cfg, tiny_model_path)
            try:
                res = group.logprobs(batch, draft_step=1)
                batch.old_logprobs = perturbed_old_logprobs(res.logprobs, batch.mask)
                batch.ref_logprobs = res.ref_logprobs
                if arm.endswith("_is"):
                    batch.is_weights = is_weights(batch.mask)
                out[(arm, layout, agg)] = dict(lp=res.logprobs, ref=res.ref_logprobs, draft=res.draft_metrics,
                                               metrics=group.train_step(batch), weights=group.named_weights(),
                                               draft_weights=group.named_weights("draft"))
            finally:
                group.shutdown()
    finally:
        ray.shutdown()
    return out


def test_the_batch_has_a_long_tail_and_the_budget_cuts_it():
    from cotrain.rl.packing import plan_micro_batches

    b = long_tail_batch()
    assert b.lengths.max() > 4 * b.lengths.float().median()
    assert len(plan_micro_batches(b.lengths.tolist(), 1, BUDGET)[0]) >= 3
    counts = [len(rank) for rank in plan_micro_batches(b.lengths.tolist(), 2, BUDGET)]
    assert min(counts) >= 1 and sum(counts) >= 3


@pytest.mark.parametrize("arm, layout, agg", [r for r in RUNS if not r[0].startswith("padded")])
def test_packed_takes_the_padded_step(runs, arm, layout, agg):
    base, other = runs[("padded_is" if arm.endswith("_is") else "padded", "pp1", agg)], runs[(arm, layout, agg)]
    torch.testing.assert_close(other["lp"], base["lp"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(other["ref"], base["ref"], atol=1e-5, rtol=1e-5)
    for k in ("loss", "grad_norm", "clip_frac", "kl_ref"):
        rel = 5e-5 if k == "grad_norm" else 1e-5
        assert other["metrics"][k] == pytest.approx(base["metrics"][k], rel=rel, abs=1e-9), k
    for name, w in base["weights"].items():
        torch.testing.assert_close(other["weights"][name], w, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    if agg == "token_mean":
        for k in ("draft/loss", "draft/grad_norm", "draft/acceptance_offline", "draft/chains", "draft/positions"):
            assert other["draft"][k] == pytest.approx(base["draft"][k], rel=1e-5, abs=1e-9), k
        for name, w in base["draft_weights"].items():
            torch.testing.assert_close(other["draft_weights"][name], w, atol=2e-5, rtol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_the_step_moved_the_policy_and_the_drafter(runs, tiny_model_path):
    """So that agreeing after the step means something."""
    from cotrain.models.hf_io import load_hf_state_dict

    init = load_hf_state_dict(tiny_model_path)
    base = runs[("packed", "pp1", "token_mean")]
    assert max((base["weights"][n] - init[n]).abs().max().item() for n in init) > 1e-4
    assert base["draft"]["draft/grad_norm"] > 0 and base["metrics"]["kl_ref"] == pytest.approx(0.0, abs=1e-12)
    assert 0 < base["metrics"]["clip_frac"] < 1


def test_the_importance_weights_scale_each_tokens_policy_gradient_term(runs):
    """The weighted step's loss is the hand-assembled one: the token mean of w_t times the clipped
    surrogate plus the KL penalty, from the policy's own log-probs before the step (cotrain.rl.grpo's
    functions, which tests/rl/test_grpo_math.py checks by hand) - and the weights moved the step."""
    from cotrain.rl.grpo import aggregate, grpo_token_losses

    batch = long_tail_batch()
    weighted, plain = runs[("padded_is", "pp1", "token_mean")], runs[("padded", "pp1", "token_mean")]
    old = perturbed_old_logprobs(weighted["lp"], batch.mask)
    adv = batch.advantages[:, None].expand_as(old)
    tok, _ = grpo_token_losses(weighted["lp"], old, adv, 0.2, 0.2, ref_logp=weighted["ref"], kl_coef=0.05,
                               is_weights=is_weights(batch.mask))
    assert weighted["metrics"]["loss"] == pytest.approx(aggregate(tok, batch.mask, "token_mean").item(), rel=1e-5)
    assert weighted["metrics"]["loss"] != pytest.approx(plain["metrics"]["loss"], rel=1e-3)
    assert max((weighted["weights"][n] - plain["weights"][n]).abs().max().item() for n in plain["weights"]) > 1e-6
