"""Co-training inside the Megatron trainer, on a fixed rollout batch.

- The policy's step is bit-identical with co-training on or off (PP=1, PP=2, CP=2, DP=2): the
  drafter's loss never reaches the policy's gradients, clipping norm or weights.
- The drafter's step inside the trainer equals the offline distillation step on the same sequences
  (taps and target logits from a Hugging Face forward of the same policy, the same anchors).
- The drafter's loss, gradient norm and weights after the step agree across layouts: PP=2, CP=2,
  DP=2 and TP=2 against PP=1 (anchors are drawn per row, so the draw does not depend on the layout).
- Before each drafter step the drafter's borrowed tensors (embedding, LM head) are the current
  policy's: after a policy update they follow it.

The drafter optimizer runs with eps = 1 and no clipping, so its first update is ~lr * g: weights
after the step then compare gradients linearly (Adam's usual eps turns a 1e-9 gradient difference
into a sign flip).
"""

import pytest
import ray
import torch

from _trainer_utils import fake_rollout_batch, perturbed_old_logprobs

from cotrain.config import load_config

BASE = ["policy.micro_batch_size=4", "grpo.prompts_per_step=4", "policy.reference_model=false",
        "rollout.speculative.method=null"]
DRAFT = {"dflash": ["draft.kind=dflash", "draft.dflash.block_size=4", "draft.dflash.anchors_per_seq=2"],
         "eagle3": ["draft.kind=eagle3", "draft.eagle3.ttt_steps=3"]}
DRAFT_OPT = ["draft.cotrain=true", "draft.optimizer.lr=0.5", "draft.optimizer.eps=1.0", "draft.optimizer.clip_grad=0.0",
             "draft.budget.mode=adaptive", "draft.budget.max_steps=3"]  # (steps with draft_updates=3: two replayed)
LAYOUTS = {"pp1": [], "pp2": ["policy.parallel.pipeline=2"], "cp2": ["policy.parallel.context=2"],
           "dp2": ["policy.parallel.data=2"], "tp2": ["policy.parallel.tensor=2"]}
# (drafter or None, layout)
RUNS = [(None, "pp1"), (None, "pp2"), (None, "cp2"), (None, "dp2"),
        ("dflash", "pp1"), ("dflash", "pp2"), ("dflash", "cp2"), ("dflash", "dp2"), ("dflash", "tp2"),
        ("eagle3", "pp1"), ("eagle3", "cp2")]
DRAFT_ATOL = {"pp2": 1e-6, "dp2": 1e-6, "cp2": 2e-5, "tp2": 2e-5}


def config(kind, layout):
    ov = BASE + LAYOUTS[layout] + (DRAFT[kind] + DRAFT_OPT if kind else [])
    return load_config("configs/grpo.yaml", ov)


@pytest.fixture(scope="module")
def runs(tiny_model_path):
    from cotrain.rl.workers import TrainerGroup

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    out = {}
    try:
        for kind, layout in RUNS:
            batch = fake_rollout_batch()
            group = TrainerGroup(config(kind, layout), tiny_model_path)
            try:
                lp = group.logprobs(batch, draft_step=1 if kind else None)
                batch.old_logprobs = perturbed_old_logprobs(lp.logprobs, batch.mask)
                metrics = group.train_step(batch)
                r = dict(batch=batch, lp=lp.logprobs, metrics=metrics, draft=lp.draft_metrics,
                         weights=group.named_weights("policy"))
                if kind:
                    r["draft_weights"] = group.named_weights("draft")
                    # an idle step of draft.budget.measure_idle: scored on the updated policy's forward, no step
                    r["measured"] = group.logprobs(batch, draft_step=2, draft_updates=0).draft_metrics
                    r["measured_weights"] = group.named_weights("draft")
                    if layout in ("pp1", "dp2") and kind == "dflash":
                        # the next drafter step starts from the updated policy's tensors, and takes two
                        # more optimizer steps on its replay window (steps 1 and 2's microbatches)
                        r["replayed"] = group.logprobs(batch, draft_step=2, draft_updates=3).draft_metrics
                        r["replayed_weights"] = group.named_weights("draft")
                        r["shared_after"] = group._all("draft_shared_tensors")[0]
                        r["weights_after"] = group.named_weights("policy")
                out[(kind, layout)] = r
            finally:
                group.shutdown()
    finally:
        ray.shutdown()
    return out


@pytest.mark.parametrize("layout", ["pp1", "pp2", "cp2", "dp2"])
def test_policy_step_is_bit_identical_with_cotraining_on_or_off(runs, layout):
    off, on = runs[(None, layout)], runs[("dflash", layout)]
    assert torch.equal(on["lp"], off["lp"])
    for k in ("loss", "grad_norm", "clip_frac"):
        assert on["metrics"][k] == off["metrics"][k], k
    assert set(on["weights"]) == set(off["weights"])
    for name, w in off["weights"].items():
        assert torch.equal(on["weights"][name], w), name
    if layout == "pp1":
        assert torch.equal(runs[("eagle3", "pp1")]["weights"]["lm_head.weight"], off["weights"]["lm_head.weight"])


@pytest.mark.parametrize("kind, layout", [("dflash", "pp2"), ("dflash", "cp2"), ("dflash", "dp2"), ("dflash", "tp2"),
                                          ("eagle3", "cp2")])
def test_drafter_step_is_the_same_in_every_layout(runs, kind, layout):
    base, other = runs[(kind, "pp1")], runs[(kind, layout)]
    for k in ("draft/loss", "draft/grad_norm", "draft/acceptance_offline", "draft/chains", "draft/positions"):
        assert other["draft"][k] == pytest.approx(base["draft"][k], rel=1e-5, abs=1e-9), k
    for name, w in base["draft_weights"].items():
        torch.testing.assert_close(other["draft_weights"][name], w, atol=DRAFT_ATOL[layout], rtol=0, msg=name)


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_drafter_step_equals_the_offline_distillation_step(runs, kind, tiny_model_path):
    """Reference: the HF policy's taps and logits on the same rows, the drafter built as the
    distillation builds it, one AdamW step of the same loss on the same chains."""
    from cotrain.draft.taps import load_hf_target
    from cotrain.draft.online import OnlineDraftTrainer, RolloutRows, to_draft_batch
    from cotrain.draft.registry import build_drafter
    from cotrain.draft.taps import TargetSpec, compute_taps  # noqa: F811

    cfg = config(kind, "pp1")
    r = runs[(kind, "pp1")]
    b = r["batch"]
    target = TargetSpec.from_checkpoint(tiny_model_path)
    drafter = build_drafter(kind, cfg.draft.settings, target, seed=cfg.run.seed)
    init = {n: p.detach().clone() for n, p in drafter.vllm_state_dict().items()}
    hf = load_hf_target(tiny_model_path)
    rows = RolloutRows(b.inputs, b.mask, b.lengths, torch.arange(len(b)))
    S = b.seq_len
    taps, logits = compute_taps(hf, b.inputs.reshape(-1), torch.arange(0, len(b) * S + 1, S), drafter.tap_layers)
    online = OnlineDraftTrainer(drafter, cfg.draft, total_steps=cfg.grpo.num_steps, seed=cfg.run.seed)
    online.begin_step(1)
    online.microbatch(rows, taps, logits / cfg.rollout.sampling.temperature)
    ref = online.end_step()
    # the one-process reference agrees with the trainer's 4 microbatches on 1 rank
    for k in ("loss", "grad_norm", "acceptance_offline", "chains"):
        assert r["draft"][f"draft/{k}"] == pytest.approx(ref[k], rel=1e-4), k
    after = drafter.vllm_state_dict()
    assert max((after[n] - init[n]).abs().max().item() for n in init) > 1e-3  # the step moved the drafter
    for name, w in after.items():
        if name in r["draft_weights"]:
            torch.testing.assert_close(r["draft_weights"][name], w, atol=2e-5, rtol=0, msg=name)
    # ... and the one-process reference is the distillation's own step on the same chains
    from cotrain.draft.distill import train_step
    from cotrain.draft.optim import make_optimizer, set_lr

    again = build_drafter(kind, cfg.draft.settings, target, seed=cfg.run.seed)
    batch, _ = to_draft_batch(rows, taps, logits / cfg.rollout.sampling.temperature)
    layout = online._layout_for(batch, rows.seq_ids, step=1)  # the same anchors
    again.build_layout = lambda *args, **kwargs: layout
    opt = make_optimizer(again, cfg.draft.optimizer)
    set_lr(opt, cfg.draft.optimizer.lr)
    m = train_step(again, batch, cfg.draft.loss, opt, cfg.draft.optimizer.clip_grad, torch.Generator())
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    for name, w in again.vllm_state_dict().items():
        torch.testing.assert_close(after[name], w, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("kind, layout", [(k, lay) for k, lay in RUNS if k])
def test_a_measure_only_step_scores_the_drafter_without_moving_it(runs, kind, layout):
    """draft_updates=0: the drafter's acceptance on the step's chains, the same in every layout and
    (pp1, dp2) exactly what the training step 2 that follows reports before its update; the drafter's
    weights untouched."""
    r, base = runs[(kind, layout)], runs[(kind, "pp1")]
    m = r["measured"]
    assert m["draft/updates"] == 0.0 and m["draft/time_s"] == 0.0 and "draft/loss" not in m and m["draft/chains"] > 0
    assert m["draft/acceptance_offline"] == pytest.approx(base["measured"]["draft/acceptance_offline"], rel=1e-6)
    assert m["draft/chains"] == base["measured"]["draft/chains"]
    if "replayed" in r:
        assert m["draft/acceptance_offline"] == r["replayed"]["draft/acceptance_offline"]
    for name, w in r["draft_weights"].items():
        assert torch.equal(r["measured_weights"][name], w), name


def test_replayed_drafter_steps_are_the_same_in_every_layout(runs):
    """draft.budget's extra steps on the replay window: each rank replays its own microbatches and the
    gradients are reduced per step, so DP=2 takes the steps PP=1 takes (the same weights)."""
    base, other = runs[("dflash", "pp1")], runs[("dflash", "dp2")]
    assert base["replayed"]["draft/updates"] == other["replayed"]["draft/updates"] == 3.0
    assert other["replayed"]["draft/replay_loss"] == pytest.approx(base["replayed"]["draft/replay_loss"], rel=1e-5)
    moved = 0.0
    for name, w in base["replayed_weights"].items():
        torch.testing.assert_close(other["replayed_weights"][name], w, atol=1e-5, rtol=0, msg=name)
        moved = max(moved, (w - base["draft_weights"][name]).abs().max().item())
    assert moved > 1e-3


def test_tap_bytes_are_what_the_planner_predicts(runs):
    """The reader's measured payload (both taps of layers 0 and 3, one crossing from stage 0 at PP=2)
    equals cotrain.plan's formula: tokens x hidden x 4 bytes x taps, the tokens the packed rows'
    real ones (no padding travels; a PP=2 filler is not tapped)."""
    from cotrain.plan import load_arch, tap_bytes

    arch = load_arch("builtin:tiny")
    for layout in ("pp1", "pp2"):
        r = runs[("dflash", layout)]
        b = r["batch"]
        tokens = int(b.lengths.sum())
        assert tokens < len(b) * b.seq_len  # the batch is padded: the packed taps carry less
        assert r["draft"]["tap/bytes"] == tap_bytes(tokens, arch.hidden, 4, 2)
    assert runs[("dflash", "pp2")]["draft"]["tap/moved_bytes"] == tap_bytes(tokens, arch.hidden, 4, 1)
    assert runs[("dflash", "pp1")]["draft"]["tap/moved_bytes"] == 0
