"""PPO-style updates in the Megatron trainer: one rollout batch of B sequences is grpo.epochs passes
of B / grpo.global_batch_size mini-batches, one optimizer step each, against fixed old log-probs.

- The number of optimizer steps is (B / global_batch_size) x epochs per rollout batch: counted by
  Adam itself (its per-parameter step in the checkpointed optimizer state), and the clipped
  surrogate acts (clip_frac > 0 on on-policy batches, where one step per batch always gives 0).
- The whole update equals a one-process reference: a Hugging Face copy of the policy and
  torch.optim.Adam taking the same mini-batch steps in the documented order, each mini-batch's
  loss its own token mean (the losses written out by hand), each step at the learning rate of the
  warm-up + cosine formula computed by hand; at DP=2 too (each mini-batch split over the
  data-parallel ranks).
- The learning rate after k optimizer steps is that formula's (train/lr, up to the run's last step
  at min_lr), and a trainer resumed from a checkpoint continues exactly: same learning rate, loss,
  gradient norm and weights as the uninterrupted one.
- Validation refuses a warm-up that does not end within the run and a cosine min_lr above lr.

The reference runs Adam with eps = 1, so that an update is ~lr * g and weights after the steps
compare gradients linearly (Adam's usual eps turns a 1e-9 gradient difference into a sign flip).
"""

import math

import pytest
import ray
import torch

from _trainer_utils import fake_rollout_batch

from cotrain.config import load_config

B, SEED = 16, 0
BASE = ["policy.micro_batch_size=4", "grpo.prompts_per_step=4", "grpo.group_size=4", "policy.reference_model=false",
        f"run.seed={SEED}"]
STEPS = BASE + ["grpo.global_batch_size=4", "grpo.epochs=2"]  # 4 mini-batches x 2 epochs = 8 steps per batch
# 2 mini-batches x 2 epochs x 3 GRPO steps = 12 optimizer steps: warm-up over 3, cosine to min_lr at 12
LR, MIN_LR, WARMUP, TOTAL = 0.05, 0.005, 3, 12
REF = BASE + ["grpo.global_batch_size=8", "grpo.epochs=2", "grpo.num_steps=3", "policy.optimizer.eps=1.0",
              f"policy.optimizer.lr={LR}", f"policy.optimizer.min_lr={MIN_LR}", f"policy.optimizer.warmup_steps={WARMUP}",
              "policy.optimizer.schedule=cosine", "grpo.clip_eps_low=0.1", "grpo.clip_eps_high=0.1"]


NEW_LR = 0.02  # a resume with a changed learning rate


def lr_by_hand(k: int, lr: float = LR) -> float:
    """The learning rate of the k-th optimizer step (from 1): linear warm-up, then cosine to MIN_LR."""
    if k <= WARMUP:
        return lr * k / WARMUP
    return MIN_LR + (lr - MIN_LR) * (1 + math.cos(math.pi * (k - WARMUP) / (TOTAL - WARMUP))) / 2


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def on_policy(group, seed):
    """A rollout batch whose old log-probs are the trainer's own (as the driver fills them in)."""
    batch = fake_rollout_batch(seed=seed)
    assert len(batch) == B
    batch.old_logprobs = group.logprobs(batch).logprobs
    return batch


def test_optimizer_steps_per_rollout_batch_and_clipping(ray_local, tiny_model_path, tmp_path):
    from cotrain.rl.workers import TrainerGroup

    group = TrainerGroup(load_config("configs/grpo.yaml", STEPS), tiny_model_path)
    try:
        metrics = [group.train_step(on_policy(group, seed)) for seed in (0, 1)]
        group.save_checkpoint(str(tmp_path))
    finally:
        group.shutdown()
    per_batch = (B // 4) * 2
    assert [m["optimizer_steps"] for m in metrics] == [per_batch, 2 * per_batch]
    state = torch.load(tmp_path / "trainer_rank0000.pt", weights_only=False)["optimizer"]["state"]
    assert {float(s["step"]) for s in state.values()} == {2.0 * per_batch}  # Adam's own count
    for m in metrics:
        # on-policy batches: only steps after the first see a ratio other than 1
        assert m["clip_frac"] > 0 and m["ratio_max"] > 1


def _hf_logprobs(model, batch):
    logits = model(input_ids=batch.inputs).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, batch.targets[..., None])[..., 0]


def reference_update(cfg, model_path, batch, update_index=0):
    """The update the config asks for, in one process: HF model, torch Adam, global-norm clipping."""
    from transformers import AutoModelForCausalLM

    from cotrain.rl.grpo import grpo_token_losses

    g, opt_cfg = cfg.grpo, cfg.policy.optimizer
    hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    params = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=opt_cfg.lr, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps)
    assert opt_cfg.lr == LR and opt_cfg.schedule == "cosine"  # lr_by_hand's settings
    n_mini = B // g.global_batch_size
    order = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + update_index)  # the documented order
    losses, norms, clip = [], [], []
    for _ in range(g.epochs):
        for j in torch.randperm(n_mini, generator=order).tolist():
            mb = batch.select(slice(j * g.global_batch_size, (j + 1) * g.global_batch_size))
            logp = _hf_logprobs(hf, mb)
            tok, info = grpo_token_losses(logp, mb.old_logprobs, mb.advantages[:, None].expand_as(logp),
                                          g.clip_eps_low, g.clip_eps_high)
            m = mb.mask
            loss = (tok * m).sum() / m.sum()  # this mini-batch's token mean
            opt.zero_grad()
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, opt_cfg.clip_grad)))
            for group in opt.param_groups:
                group["lr"] = lr_by_hand(len(losses) + 1)
            opt.step()
            losses.append(loss.item())
            clip.append(((info["clipped"] * m).sum() / m.sum()).item())
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return dict(loss=sum(losses) / len(losses), grad_norm=sum(norms) / len(norms), clip_frac=sum(clip) / len(clip),
                steps=len(losses), weights=weights)


@pytest.fixture(scope="module")
def ref_runs(ray_local, tiny_model_path, tmp_path_factory):
    """pp1: the run's 3 GRPO steps, a checkpoint after the first; resumed: a new trainer from that
    checkpoint takes the second; dp2: the first step."""
    from cotrain.rl.workers import TrainerGroup

    ckpt = tmp_path_factory.mktemp("ckpt")
    out = {}
    for layout, ov in (("pp1", []), ("resumed", []), ("resumed_lr", [f"policy.optimizer.lr={NEW_LR}"]),
                       ("dp2", ["policy.parallel.data=2"])):
        group = TrainerGroup(load_config("configs/grpo.yaml", REF + ov), tiny_model_path)
        try:
            if layout.startswith("resumed"):
                group.load_checkpoint(str(ckpt))
                batch = on_policy(group, 1)
                out[layout] = dict(batch=batch, metrics=[group.train_step(batch)], weights=group.named_weights())
                continue
            batch = on_policy(group, 0)
            metrics = [group.train_step(batch)]
            r = out[layout] = dict(batch=batch, metrics=metrics, weights=group.named_weights())
            if layout == "pp1":
                group.save_checkpoint(str(ckpt))
                for seed in (1, 2):
                    r[f"batch{seed}"] = on_policy(group, seed)
                    metrics.append(group.train_step(r[f"batch{seed}"]))
                    if seed == 1:
                        r["weights_after_2"] = group.named_weights()
        finally:
            group.shutdown()
    return out


@pytest.mark.parametrize("layout", ["pp1", "dp2"])
def test_update_equals_a_one_process_reference(ref_runs, layout, tiny_model_path):
    from cotrain.models.hf_io import load_hf_state_dict

    cfg = load_config("configs/grpo.yaml", REF)
    run = ref_runs[layout]
    ref = reference_update(cfg, tiny_model_path, run["batch"])
    m = run["metrics"][0]
    assert ref["steps"] == 4 and m["optimizer_steps"] == 4
    assert ref["clip_frac"] > 0  # the surrogate clipped: the comparison covers that path
    for k in ("loss", "grad_norm", "clip_frac"):
        assert m[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-7), k
    for name, w in ref["weights"].items():
        if name in run["weights"]:
            torch.testing.assert_close(run["weights"][name], w, atol=2e-6, rtol=0, msg=name)
    start = load_hf_state_dict(tiny_model_path)
    assert set(run["weights"]) == set(start)
    moved = max((ref["weights"][n] - start[n]).abs().max().item() for n in start if n in ref["weights"])
    assert moved > 1e-3  # the update moved the policy, so agreeing after it means something


def test_learning_rate_follows_warmup_and_cosine(ref_runs):
    metrics = ref_runs["pp1"]["metrics"]
    assert [m["optimizer_steps"] for m in metrics] == [4, 8, 12]
    for m in metrics:
        assert m["lr"] == pytest.approx(lr_by_hand(int(m["optimizer_steps"])), rel=1e-12)
    assert lr_by_hand(4) < LR and metrics[-1]["lr"] == pytest.approx(MIN_LR, rel=1e-12)  # decayed to the end


def test_resume_continues_exactly(ref_runs):
    run, resumed = ref_runs["pp1"], ref_runs["resumed"]
    assert torch.equal(resumed["batch"].old_logprobs, run["batch1"].old_logprobs)  # the checkpointed weights
    a, b = run["metrics"][1], resumed["metrics"][0]
    assert b["optimizer_steps"] == a["optimizer_steps"] == 8
    assert b["lr"] == a["lr"]
    for k in ("loss", "grad_norm", "clip_frac"):
        assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), k
    for name, w in run["weights_after_2"].items():
        torch.testing.assert_close(resumed["weights"][name], w, atol=1e-7, rtol=0, msg=name)


def test_resume_applies_a_changed_learning_rate(ref_runs):
    """The checkpoint's optimizer state carries its param groups' max_lr (which Megatron's scheduler
    reads first): a resume with another policy.optimizer.lr must run on the new one."""
    m = ref_runs["resumed_lr"]["metrics"][0]
    assert m["optimizer_steps"] == 8
    assert m["lr"] == pytest.approx(lr_by_hand(8, NEW_LR), rel=1e-12)
    assert m["lr"] != pytest.approx(ref_runs["resumed"]["metrics"][0]["lr"], rel=1e-3)


@pytest.mark.parametrize("overrides, key, fragments", [
    (["grpo.num_steps=2", "grpo.global_batch_size=8", "grpo.epochs=2", "policy.optimizer.warmup_steps=8"],
     "policy.optimizer.warmup_steps", ["8 is not below the run's 8 optimizer steps", "2 * 2 * 2", "allowed: 0..7"]),
    (["policy.optimizer.schedule=cosine", "policy.optimizer.lr=1e-4", "policy.optimizer.min_lr=1e-3"],
     "policy.optimizer.min_lr", ["exceeds policy.optimizer.lr=0.0001", "allowed: 0..0.0001"]),
])
def test_validation_refuses_a_schedule_the_run_cannot_follow(overrides, key, fragments):
    from cotrain.config import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config("configs/grpo.yaml", BASE + overrides)
    msgs = [m for p, m in info.value.issues if p == key]
    assert msgs, info.value.issues
    for f in fragments:
        assert f in msgs[0], (f, msgs[0])
    load_config("configs/grpo.yaml", BASE + overrides[:-1])  # the rest is fine
