"""Co-training an EAGLE-3 drafter with a reduced draft vocabulary inside the Megatron trainer.

Two drafter steps on fixed rollout batches (no policy update in between), at PP=1 and PP=2:

- step 1: the drafter starts from a placeholder mapping; the step's rollout tokens (summed over the
  ranks) build the mapping and the step takes no update;
- step 2 (another batch): the drafter trains over the 8 draft tokens (positions whose target token
  lies outside are dropped), then, with ``vocab_rebuild_every: 1``, the mapping is rebuilt from this
  step's tokens, the LM head rows following their tokens.

References: the mapping is the 8 most frequent response tokens of the batch (counted here from
the batch's targets and mask); the trainer's drafter after both steps equals a one-process
``OnlineDraftTrainer`` fed a Hugging Face forward of the same policy; PP=2 equals PP=1. The
pushed state carries the mapping as ``d2t``.
"""

import pytest
import ray
import torch

from _trainer_utils import fake_rollout_batch

from cotrain.config import load_config

N = 8  # draft tokens: the arithmetic responses use 11 distinct tokens (digits and EOS)
OV = ["policy.micro_batch_size=4", "grpo.prompts_per_step=4", "policy.reference_model=false",
      "rollout.speculative.method=null", "draft.kind=eagle3", "draft.eagle3.ttt_steps=3",
      f"draft.eagle3.draft_vocab_size={N}", "draft.eagle3.vocab_rebuild_every=1",
      "draft.cotrain=true", "draft.optimizer.lr=0.5", "draft.optimizer.eps=1.0", "draft.optimizer.clip_grad=0.0"]
LAYOUTS = {"pp1": [], "pp2": ["policy.parallel.pipeline=2"]}


def config(layout):
    return load_config("configs/grpo.yaml", OV + LAYOUTS[layout])


def batches():
    return fake_rollout_batch(seed=0), fake_rollout_batch(seed=1)


@pytest.fixture(scope="module")
def runs(tiny_model_path):
    from cotrain.rl.workers import TrainerGroup

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    out = {}
    try:
        for layout in LAYOUTS:
            group = TrainerGroup(config(layout), tiny_model_path)
            try:
                r = {}
                for step, b in enumerate(batches(), start=1):
                    r[f"m{step}"] = group.logprobs(b, draft_step=step).draft_metrics
                    r[f"w{step}"] = group.named_weights("draft")
                out[layout] = r
            finally:
                group.shutdown()
    finally:
        ray.shutdown()
    return out


def _top_tokens(batch, n=N):
    """The n most frequent response tokens (ties: lower id), sorted: the mapping's reference."""
    resp = batch.targets[batch.mask.bool()]
    counts = torch.bincount(resp, minlength=128)
    order = sorted(range(128), key=lambda t: (-int(counts[t]), t))
    return sorted(order[:n]), counts


def test_mapping_is_built_from_the_rollout_tokens_then_rebuilt(runs):
    b1, b2 = batches()
    for layout, r in runs.items():
        m1, m2 = r["m1"], r["m2"]
        # step 1: built from its tokens, no update
        assert m1["draft/skipped"] == 1.0 and m1["draft/vocab_rebuilt"] == 1.0 and m1["draft/vocab_version"] == 1
        want1, _ = _top_tokens(b1)
        d2t = r["w1"]["d2t"]
        assert d2t.dtype == torch.int64 and d2t.shape == (N,)
        assert (torch.arange(N) + d2t).tolist() == want1, layout
        # step 2: trained with mapping 1 (coverage of step 2's tokens), then rebuilt from step 2's tokens
        assert "draft/skipped" not in m2 or m2["draft/skipped"] == 0.0
        assert m2["draft/vocab_rebuilt"] == 1.0 and m2["draft/vocab_version"] == 2
        want2, counts2 = _top_tokens(b2)
        assert m2["draft/vocab_coverage"] == pytest.approx(float(counts2[want1].sum() / counts2.sum()))
        assert 0.0 < m2["draft/vocab_coverage"] < 1.0  # some tokens were outside the draft vocabulary
        assert (torch.arange(N) + r["w2"]["d2t"]).tolist() == want2, layout
        assert r["w2"]["lm_head.weight"].shape[0] == N
    assert want1 != want2  # the rebuild changed the mapping


def test_pp2_equals_pp1(runs):
    a, b = runs["pp1"], runs["pp2"]
    for k in ("draft/loss", "draft/grad_norm", "draft/acceptance_offline", "draft/vocab_coverage", "draft/positions"):
        assert b["m2"][k] == pytest.approx(a["m2"][k], rel=1e-5, abs=1e-9), k
    for name, w in a["w2"].items():
        torch.testing.assert_close(b["w2"][name], w, atol=1e-6, rtol=0, msg=name)


def test_trainer_steps_equal_the_one_process_reference(runs, tiny_model_path):
    """The same two steps in this process: OnlineDraftTrainer on a HF forward of the same policy."""
    from cotrain.draft.online import OnlineDraftTrainer, RolloutRows
    from cotrain.draft.registry import build_drafter
    from cotrain.draft.taps import TargetSpec, compute_taps, load_hf_target

    cfg = config("pp1")
    target = TargetSpec.from_checkpoint(tiny_model_path)
    hf = load_hf_target(tiny_model_path)
    drafter = build_drafter("eagle3", cfg.draft.settings, target, seed=cfg.run.seed)
    online = OnlineDraftTrainer(drafter, cfg.draft, total_steps=cfg.grpo.num_steps, seed=cfg.run.seed)
    r = runs["pp1"]
    for step, b in enumerate(batches(), start=1):
        rows = RolloutRows(b.inputs, b.mask, b.lengths, torch.arange(len(b)))
        S = b.seq_len
        taps, logits = compute_taps(hf, b.inputs.reshape(-1), torch.arange(0, len(b) * S + 1, S), drafter.tap_layers)
        before = {n: t.clone() for n, t in online.push_state().items()}
        online.begin_step(step)
        online.microbatch(rows, taps, logits / cfg.rollout.sampling.temperature)
        ref = online.end_step()
        got = r[f"m{step}"]
        for k in ("loss", "grad_norm", "acceptance_offline", "vocab_coverage", "vocab_version"):
            if k in ref:
                assert got[f"draft/{k}"] == pytest.approx(ref[k], rel=1e-4, nan_ok=True), (step, k)
        after = online.push_state()
        for name, w in after.items():
            torch.testing.assert_close(r[f"w{step}"][name], w, atol=2e-5, rtol=0, msg=f"step {step}: {name}")
        if step == 2:  # the step moved the drafter's own weights (not only the head's rows)
            assert (after["fc.weight"] - before["fc.weight"]).abs().max().item() > 1e-3
