"""PPO-style updates in the Megatron trainer: one rollout batch of B sequences is grpo.epochs passes
of B / grpo.global_batch_size mini-batches, one optimizer step each, against fixed old log-probs.

- The number of optimizer steps is (B / global_batch_size) x epochs per rollout batch: counted by
  Adam itself (its per-parameter step in the checkpointed optimizer state), and the clipped
  surrogate acts (clip_frac > 0 on on-policy batches, where one step per batch always gives 0).
- The whole update equals a one-process reference: a Hugging Face copy of the policy and
  torch.optim.Adam taking the same mini-batch steps in the documented order, each mini-batch's
  loss its own token mean (the losses written out by hand); at DP=2 too (each mini-batch split
  over the data-parallel ranks).

The reference runs Adam with eps = 1, so that an update is ~lr * g and weights after the steps
compare gradients linearly (Adam's usual eps turns a 1e-9 gradient difference into a sign flip).
"""

import pytest
import ray
import torch

from _trainer_utils import fake_rollout_batch

from cotrain.config import load_config

B, SEED = 16, 0
BASE = ["policy.micro_batch_size=4", "grpo.prompts_per_step=4", "grpo.group_size=4", "policy.reference_model=false",
        f"run.seed={SEED}"]
STEPS = BASE + ["grpo.global_batch_size=4", "grpo.epochs=2"]  # 4 mini-batches x 2 epochs = 8 steps per batch
REF = BASE + ["grpo.global_batch_size=8", "grpo.epochs=2", "policy.optimizer.eps=1.0", "policy.optimizer.lr=0.05",
              "grpo.clip_eps_low=0.1", "grpo.clip_eps_high=0.1"]


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
            opt.step()
            losses.append(loss.item())
            clip.append(((info["clipped"] * m).sum() / m.sum()).item())
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return dict(loss=sum(losses) / len(losses), grad_norm=sum(norms) / len(norms), clip_frac=sum(clip) / len(clip),
                steps=len(losses), weights=weights)


@pytest.fixture(scope="module")
def ref_runs(ray_local, tiny_model_path):
    from cotrain.rl.workers import TrainerGroup

    out = {}
    for layout, ov in (("pp1", []), ("dp2", ["policy.parallel.data=2"])):
        group = TrainerGroup(load_config("configs/grpo.yaml", REF + ov), tiny_model_path)
        try:
            batch = on_policy(group, 0)
            out[layout] = dict(batch=batch, metrics=group.train_step(batch), weights=group.named_weights())
        finally:
            group.shutdown()
    return out


@pytest.mark.parametrize("layout", ["pp1", "dp2"])
def test_update_equals_a_one_process_reference(ref_runs, layout, tiny_model_path):
    from cotrain.models.hf_io import load_hf_state_dict

    cfg = load_config("configs/grpo.yaml", REF)
    run = ref_runs[layout]
    ref = reference_update(cfg, tiny_model_path, run["batch"])
    m = run["metrics"]
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
