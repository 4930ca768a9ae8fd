"""A short GRPO run whose drafter co-trains on its own on-policy branches (``draft.branches:
on_policy``, E2E-TV), end to end: vLLM engines serving the DFlash drafter (pushed every step),
the Megatron trainer scoring the branches with the policy's tree forward, from a drafter built from
scratch.

Measured, against references outside the trainer (the thresholds are about half the gaps this
run measured: loss -0.015 at step 1, -0.050 over steps 5-6; expected on-policy acceptance
1.07 -> 1.46):
- the run's E2E-TV loss falls (its last two steps against its first: loss = - the weighted mean
  prefix acceptance of the drafts, so it falls as the drafter learns);
- on a fixed set of the final policy's greedy responses (Hugging Face forward, taps and targets
  recomputed here), the expected on-policy acceptance of the trained drafter's branches (SpecOPD
  scored with specopd.tree_target_logits on the HF policy) exceeds the initial drafter's by a
  margin, and its offline acceptance (cotrain.draft.acceptance) does not fall;
- every step carries the on-policy metrics (branch tokens scored, tree-forward seconds) and the
  drafter pushes were accepted.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

STEPS = 6
OVERRIDES = [f"grpo.num_steps={STEPS}", "grpo.prompts_per_step=8", "grpo.group_size=8", "policy.micro_batch_size=32",
             "draft.init=null", "draft.compare_frozen=false", "draft.branches=on_policy", "draft.loss=e2e_tv",
             "draft.optimizer.lr=1e-2",
             "draft.optimizer.warmup_steps=0", "data.eval.every=0", "logging.progress_bar=false",
             "logging.tensorboard=false", "checkpoint.every=1000",
             # the tiny model's own task, not the demo's prompt curriculum: the drafter trains 6 steps
             # and is scored on held-out prompts of the distribution it trained on
             "data.task=arithmetic", "data.shuffle=true", "data.eval.path=null"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_path):
    from cotrain.config import load_config
    from cotrain.rl.driver import GrpoRun

    out = tmp_path_factory.mktemp("specopd_e2e")
    cfg = load_config("configs/demo.yaml", [f"run.output_dir={out}", *OVERRIDES])
    run = GrpoRun(cfg)
    try:
        run.setup(resume=False)
        steps = [run.step(s) for s in range(1, STEPS + 1)]
        prompts = [p.prompt for p in run.eval_problems[:48]]
        policy = run.trainer.named_weights("policy")
        draft = run.trainer.named_weights("draft")
        yield dict(cfg=cfg, out=out, steps=steps, prompts=prompts, policy=policy, draft=draft)
    finally:
        import ray

        run.shutdown()
        ray.shutdown()  # the run started a local Ray in this process


def test_every_step_trains_on_policy_branches(trained):
    for m in trained["steps"]:
        assert m["draft/branch_tokens"] > 0 and m["draft/tree_s"] > 0
        assert m["draft/push_ok"] == 1.0
        assert m["draft/loss"] < 0  # E2E-TV: minus a mean of acceptance probabilities


def test_the_drafter_learns(trained, tiny_model_path):
    from transformers import AutoTokenizer

    from cotrain.draft import specopd
    from cotrain.draft.acceptance import estimate_acceptance
    from cotrain.draft.distill import generate_records, records_to_batch
    from cotrain.draft.export import read_export
    from cotrain.draft.registry import build_drafter
    from cotrain.draft.taps import TargetSpec, load_hf_target

    losses = [m["draft/loss"] for m in trained["steps"]]
    first, last = losses[0], sum(losses[-2:]) / 2
    print("draft/loss by step", [round(x, 4) for x in losses])
    assert last < first - 0.015, losses

    cfg = trained["cfg"]
    hf = load_hf_target(tiny_model_path)
    hf.load_state_dict(trained["policy"], strict=True)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    base = TargetSpec.from_checkpoint(tiny_model_path)
    target = TargetSpec.from_model(hf, base.mask_token_id)
    drafters = {}
    for name, state in (("init", read_export(trained["out"] / "drafter_init")[2]), ("trained", trained["draft"])):
        d = build_drafter("dflash", cfg.draft.settings, target)
        d.load_vllm_state_dict(state)
        drafters[name] = d.eval()
    records = generate_records(hf, tok, trained["prompts"], max_new_tokens=16, tail_tokens=8)
    batch = records_to_batch(records, hf, drafters["init"].tap_layers)
    k = cfg.rollout.speculative.num_speculative_tokens
    offline = {n: estimate_acceptance(d, batch, k=k, eos_token_id=target.eos_token_id).walk_len
               for n, d in drafters.items()}
    # expected on-policy acceptance: 1 + sum_j prod_{i<=j} sum_v min(p, q) over the first k drafts
    # of branches at the same seeded anchors and draws, scored by the HF policy
    expected = {}
    for n, d in drafters.items():
        layout = d.build_layout(batch, torch.Generator().manual_seed(5))
        with torch.no_grad():
            br = specopd.sample_branches(d, batch, layout, torch.Generator().manual_seed(6),
                                         eos_token_id=target.eos_token_id)
            p = specopd.branch_target_probs(specopd.tree_target_logits(hf, batch.input_ids, batch.cu_seqlens, br), br)
            q = torch.softmax(br.logits.float(), -1)
            ov = torch.minimum(p, q).sum(-1)[:, :k] * br.valid[:, :k]
            expected[n] = float((1 + torch.cumprod(ov, 1).sum(1)).mean())
    print("offline acceptance", offline, "expected on-policy acceptance", expected)
    # the objective's own quantity rises by a margin; the teacher-forced walk on greedy responses is
    # not what E2E-TV on the drafter's branches trains, and how far it moves depends on the built tiny
    # model (fp32 builds differ between CPU instruction sets: 1.13 -> 1.98 on one machine, 1.03 ->
    # 1.05 on an AVX2 one, where the expected acceptance still rose 1.04 -> 1.39): it must not fall
    assert expected["trained"] > expected["init"] + 0.2, expected
    assert offline["trained"] >= offline["init"], offline
