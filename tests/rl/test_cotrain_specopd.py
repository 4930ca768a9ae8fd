"""SpecOPD as the co-training objective in the GRPO step (``draft.branches: on_policy``).

- The Megatron policy's tree forward (the branch tokens attending to the stem keys/values captured
  in the log-prob forward, rotary by semantic position) gives, at every branch token, the logits of
  a plain Hugging Face forward of the same checkpoint on stem[:anchor+1] + branch[:j] (no tree
  mask, no custom attention); capturing the stem leaves the policy's own logits bit-identical.
  At TP = 2 too (vocab-parallel logits gathered); through the pipeline at PP = 2 and PP = 2 x CP = 2
  (the stem of every microbatch kept on both stages through Megatron's schedule, the tree forward
  after it; a microbatch never scored, a CP rank without branches).
- The policy's step is bit-identical with on-policy and teacher-forced branches: the drafter's
  objective never reaches the policy.
- The drafter's on-policy step inside the trainer (DFlash, DSpark and EAGLE-3) equals an independent
  one-process computation with cotrain.draft.specopd's offline functions (HF taps and logits, HF tree forward, the same
  anchors and branch seeds): loss, gradient norm, offline acceptance and the weights after one
  AdamW step; DP = 2, TP = 2, CP = 2 and PP = 2 take the same step as one rank (EAGLE-3: PP = 2 x
  CP = 2). EAGLE-3 with a reduced draft vocabulary: the first step builds the mapping from the
  rollout tokens, the second equals the offline computation with it.
- Validation: what is not built (transformer-engine attention, no co-training) is refused by name;
  PP > 1 and EAGLE-3 are accepted.

The drafter optimizer runs with eps = 1 and no clipping, so its first update is ~lr * g: weights
after the step compare gradients linearly.
"""

import sys
from pathlib import Path

import pytest
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))  # _cp_dist (spawned ranks)

from _trainer_utils import fake_rollout_batch, perturbed_old_logprobs  # noqa: E402

from cotrain.config import ConfigError, load_config  # noqa: E402

TEMPERATURE = 0.7  # not 1: the branch logits are tempered like the log-prob forward's
BASE = ["policy.micro_batch_size=4", "grpo.prompts_per_step=4", "policy.reference_model=false",
        "rollout.speculative.method=null", f"rollout.sampling.temperature={TEMPERATURE}"]
DRAFT = ["draft.kind=dflash", "draft.dflash.block_size=5", "draft.dflash.anchors_per_seq=3", "draft.loss=e2e_tv",
         "draft.cotrain=true", "draft.optimizer.lr=0.5", "draft.optimizer.eps=1.0", "draft.optimizer.clip_grad=0.0"]
RUNS = {"teacher_forced": [], "on_policy": ["draft.branches=on_policy"],
        "on_policy_dp2": ["draft.branches=on_policy", "policy.parallel.data=2"],
        "on_policy_tp2": ["draft.branches=on_policy", "policy.parallel.tensor=2"],
        "teacher_forced_cp2": ["policy.parallel.context=2"],
        "on_policy_cp2": ["draft.branches=on_policy", "policy.parallel.context=2"],
        "teacher_forced_pp2": ["policy.parallel.pipeline=2"],
        "on_policy_pp2": ["draft.branches=on_policy", "policy.parallel.pipeline=2"],
        "on_policy_dspark": ["draft.branches=on_policy", "draft.kind=dspark", "draft.dspark.block_size=4",
                             "draft.dspark.anchors_per_seq=3"]}
EAGLE3 = ["draft.branches=on_policy", "draft.kind=eagle3", "draft.eagle3.ttt_steps=3"]
VOCAB = 8  # a reduced EAGLE-3 draft vocabulary (the arithmetic responses use 11 distinct tokens)
RUNS.update({"on_policy_eagle3": EAGLE3,
             "on_policy_eagle3_pp2_cp2": EAGLE3 + ["policy.parallel.pipeline=2", "policy.parallel.context=2",
                                                    "cluster.cpus_per_node=5"],
             # run seed 3: a drafter whose greedy drafts, unmapped, would be accepted differently (the
             # acceptance test below is not vacuous; at seed 0 the two counts happen to coincide)
             "on_policy_eagle3_vocab": EAGLE3 + [f"draft.eagle3.draft_vocab_size={VOCAB}", "run.seed=3"]})
TWO_DRAFTER_STEPS = ("on_policy_eagle3_vocab",)  # drafter steps 1 and 2 on the same rows, no policy step
DRAFT_ATOL = {"on_policy_dp2": 1e-6, "on_policy_tp2": 2e-5, "on_policy_cp2": 2e-5, "on_policy_pp2": 1e-6,
              "on_policy_eagle3_pp2_cp2": 2e-5}


def config(name):
    return load_config("configs/grpo.yaml", BASE + DRAFT + RUNS[name])


# ------------------------------------------------------------------------------- the tree forward
@pytest.mark.parametrize("tensor", [1, 2], ids=["tp1", "tp2"])
def test_megatron_tree_forward_equals_plain_hf_forward_on_every_branch_prefix(tiny_model_path, tensor):
    import _specopd_megatron as M
    from _cp_dist import run_world

    from cotrain.draft.taps import load_hf_target

    r = run_world(M.tree_rank, tensor, str(tiny_model_path), tensor)[0]  # TP: the gathered logits
    assert r["plain_equal"]  # the capture hooks change nothing in the policy's forward
    hf = load_hf_target(tiny_model_path)
    inputs, lengths, cu, keep, anchors, tokens = M.rows(hf.config.vocab_size)
    ids = inputs.reshape(-1)[keep]
    with torch.no_grad():
        stem_ref = torch.cat([hf(input_ids=ids[cu[s]:cu[s + 1]][None]).logits[0] for s in range(len(lengths))])
        ref = []
        for a, t in zip(anchors.tolist(), tokens):
            s = int(torch.searchsorted(cu, torch.tensor(a), right=True)) - 1
            for j in range(1, M.WIDTH + 1):  # stem up to and including the anchor, then y_1..y_j
                ref.append(hf(input_ids=torch.cat([ids[cu[s]:a + 1], t[:j]])[None]).logits[0, -1])
        ref = torch.stack(ref)
    torch.testing.assert_close(r["stem_logits"], stem_ref, atol=1e-4, rtol=1e-4)
    assert r["branch_logits"].shape == ref.shape
    torch.testing.assert_close(r["branch_logits"], ref, atol=1e-4, rtol=1e-4)
    # the reference is sensitive to what the test is about: the same tokens one position later
    # (a rotary offset) or after another branch (tree mask) differ by far more than the tolerance
    assert (ref[1:M.WIDTH] - ref[0:M.WIDTH - 1]).abs().max() > 1e-2


@pytest.mark.parametrize("only_rank0", [False, True], ids=["spread", "rank1_holds_none"])
def test_megatron_tree_forward_at_cp2_equals_plain_hf_forward(tiny_model_path, only_rank0):
    """CP = 2: the zigzag stem shards captured on each rank, each branch scored on its anchor's rank
    (the ring brings the other rank's stem keys); a rank holding no branch still takes part."""
    import _specopd_megatron as M
    from _cp_dist import run_world

    from cotrain.draft.taps import load_hf_target

    res = run_world(M.tree_rank_cp, 2, str(tiny_model_path), only_rank0)
    hf = load_hf_target(tiny_model_path)
    inputs, lengths, anchors, tokens, where = M.cp_rows(hf.config.vocab_size, 2, only_rank0)
    held = sorted(i for r in res for i in r["mine"].tolist())
    assert held == list(range(len(where)))  # every branch on exactly one rank
    if only_rank0:
        assert res[1]["mine"].numel() == 0 and res[1]["branch_logits"].shape[0] == 0
    else:
        assert min(r["mine"].numel() for r in res) > 0
    with torch.no_grad():
        for r in res:
            got, ref = [], []
            for k, bi in enumerate(r["mine"].tolist()):
                i, p = where[bi]
                for j in range(1, M.WIDTH + 1):
                    ref.append(hf(input_ids=torch.cat([inputs[i, :p + 1], tokens[bi, :j]])[None]).logits[0, -1])
                    got.append(r["branch_logits"][k * M.WIDTH + j - 1])
            if ref:
                torch.testing.assert_close(torch.stack(got), torch.stack(ref), atol=1e-4, rtol=1e-4)


def _hf_branch_logits(hf, ids, a, t):
    """HF logits at y_1..y_W of the branch ``t`` anchored at ``a``: stem[:a+1] + t[:j], no tree mask."""
    return torch.stack([hf(input_ids=torch.cat([ids[:a + 1], t[:j]])[None]).logits[0, -1]
                        for j in range(1, len(t) + 1)])


@pytest.mark.parametrize("tensor, context", [(1, 1), (1, 2)], ids=["pp2", "pp2_cp2"])
def test_megatron_tree_forward_through_the_pipeline_equals_plain_hf_forward(tiny_model_path, tensor, context):
    """PP = 2: the stem through Megatron's schedule (one row per microbatch, every microbatch's
    stem keys/values captured on both stages), then the tree forward after it, microbatch by
    microbatch in another order, one microbatch never scored; under CP = 2 a rank of row 1 holds
    no branch and still takes part in both stages' rings."""
    import _specopd_megatron as M
    from _cp_dist import run_world

    from cotrain.draft.taps import load_hf_target

    skip = () if context > 1 else (1,)
    res = run_world(M.tree_rank_pp, 2 * tensor * context, str(tiny_model_path), tensor, context, (2, 0, 1), skip)
    lasts = [r for r in res if "stem_logits" in r]
    firsts = [r for r in res if "served" in r]
    assert len(lasts) == len(firsts) == tensor * context
    scored = [i for i in (2, 0, 1) if i not in skip]
    for r in res:  # every stage kept the stem of every microbatch until the tree forward
        assert r["captured"] == [0, 1, 2]
    for r in firsts:
        assert r["served"] == len(scored)
    hf = load_hf_target(tiny_model_path)
    inputs, lengths, cu, keep, anchors, tokens = M.rows(hf.config.vocab_size)
    if context == 1:
        with torch.no_grad():
            stem_ref = hf(input_ids=inputs).logits.reshape(-1, hf.config.vocab_size)
        got = lasts[0]["stem_logits"].reshape(-1, hf.config.vocab_size)
        torch.testing.assert_close(got[keep], stem_ref[keep], atol=1e-4, rtol=1e-4)
    held = {i: sorted(k for r in lasts for k in r["branches"][i].tolist()) for i in scored}
    for i in scored:  # every branch of the row on exactly one rank
        assert held[i] == torch.nonzero((anchors >= cu[i]) & (anchors < cu[i + 1]))[:, 0].tolist()
    if context > 1:
        assert min(r["branches"][1].numel() for r in lasts) == 0  # a CP rank without branches took part
    with torch.no_grad():
        for r in lasts:
            for i in scored:
                if not r["branches"][i].numel():
                    assert r["logits"][i].shape[0] == 0
                    continue
                ref = torch.cat([_hf_branch_logits(hf, inputs[i], int(anchors[k] - cu[i]), tokens[k])
                                 for k in r["branches"][i].tolist()])
                torch.testing.assert_close(r["logits"][i], ref, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------- the trainer
@pytest.fixture(scope="module")
def runs(tiny_model_path):
    from cotrain.rl.workers import TrainerGroup

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    out = {}
    try:
        for name in RUNS:
            batch = fake_rollout_batch()
            group = TrainerGroup(config(name), tiny_model_path)
            try:
                init = group.named_weights("draft")
                if name in TWO_DRAFTER_STEPS:  # the first step builds the draft vocabulary (no update)
                    first = group.logprobs(batch, draft_step=1).draft_metrics
                    after_first = group.named_weights("draft")
                    second = group.logprobs(batch, draft_step=2).draft_metrics
                    out[name] = dict(batch=batch, draft_init=init, draft1=first, draft_weights1=after_first,
                                     draft=second, draft_weights=group.named_weights("draft"))
                    continue
                lp = group.logprobs(batch, draft_step=1)
                batch.old_logprobs = perturbed_old_logprobs(lp.logprobs, batch.mask)
                metrics = group.train_step(batch)
                out[name] = dict(batch=batch, lp=lp.logprobs, metrics=metrics, draft=lp.draft_metrics,
                                 weights=group.named_weights("policy"), draft_init=init,
                                 draft_weights=group.named_weights("draft"))
            finally:
                group.shutdown()
    finally:
        ray.shutdown()
    return out


@pytest.mark.parametrize("cp", ["", "_cp2", "_pp2"])
def test_policy_step_is_bit_identical_with_on_policy_or_teacher_forced_branches(runs, cp):
    tf, op = runs["teacher_forced" + cp], runs["on_policy" + cp]
    assert op["draft"]["draft/branch_tokens"] > 0  # the tree forward did run
    assert torch.equal(op["lp"], tf["lp"])
    for k in ("loss", "grad_norm", "clip_frac"):
        assert op["metrics"][k] == tf["metrics"][k], k
    assert set(op["weights"]) == set(tf["weights"])
    for name, w in tf["weights"].items():
        assert torch.equal(op["weights"][name], w), name
    # ... while the drafters' steps differ (the objectives are not the same)
    assert op["draft"]["draft/loss"] != tf["draft"]["draft/loss"]


def _offline_specopd_step(drafter, hf, cfg, b, step, eos_token_id):
    """The drafter's on-policy step computed in this process with cotrain.draft.specopd's offline
    functions: HF taps and logits of the rows; per microbatch of 4 rows (the trainer's) the anchors
    of each row's seed (EAGLE-3: every chain anchor), branches sampled by the drafter with the
    branches' draws, scored by specopd.tree_target_logits on the HF policy, the loss; gradients
    summed over microbatches (left on ``drafter``). Returns (loss, weight, acceptance, unmapped):
    the loss normalised over the step, its weight, the teacher-forced greedy acceptance at the same
    anchors (drafted ids mapped to target ids under a reduced vocabulary) against the HF argmax, and
    that acceptance with the draft ids taken as target ids (a wrong one, under a reduced vocabulary)."""
    from cotrain.draft import specopd
    from cotrain.draft.acceptance import accept_lengths
    from cotrain.draft.online import anchor_seed, branch_uniforms, sample_block_anchors, RolloutRows, to_draft_batch
    from cotrain.draft.taps import compute_taps

    S = b.seq_len
    taps, logits = compute_taps(hf, b.inputs.reshape(-1), torch.arange(0, len(b) * S + 1, S), drafter.tap_layers)
    taps, logits = taps.view(len(b), S, -1), logits.view(len(b), S, -1)
    seed, kind, vocab = cfg.run.seed, cfg.draft.kind, getattr(drafter, "vocab", None)
    k = min(drafter.default_num_speculative_tokens(), drafter.draft_width)
    loss_sum = weight = accepted = unmapped = chains = 0.0
    for lo in range(0, len(b), 4):
        sl = slice(lo, lo + 4)
        rows = RolloutRows(b.inputs[sl], b.mask[sl], b.lengths[sl], torch.arange(lo, lo + 4))
        batch, local = to_draft_batch(rows, taps[sl].reshape(4 * S, -1), logits[sl].reshape(4 * S, -1))
        if kind == "eagle3":
            layout = drafter.build_layout(batch)
            anchors = layout.anchors
        else:
            anchors = sample_block_anchors(drafter, batch, [anchor_seed(seed, step, s) for s in range(lo, lo + 4)],
                                           cfg.draft.settings.anchors_per_seq)
            layout = drafter.build_layout(batch, anchors=anchors)
        seq = batch.seq_of[anchors]
        u = branch_uniforms(seed, step, lo + seq, anchors - batch.cu_seqlens[seq], drafter.draft_width)
        br = specopd.sample_branches(drafter, batch, layout, temperature=1.0, eos_token_id=eos_token_id, uniforms=u)
        with torch.no_grad():
            scores = specopd.tree_target_logits(hf, batch.input_ids, batch.cu_seqlens, br)
        p = specopd.branch_target_probs(scores, br, temperature=TEMPERATURE)
        loss, m = specopd.specopd_loss(br, p, "e2e_tv", getattr(drafter.cfg, "loss_gamma", None))
        (loss * m["weight"]).backward()
        loss_sum += float(m["loss"] * m["weight"])
        weight += float(m["weight"])
        with torch.no_grad():
            out = drafter(batch, layout)
            raw = out.logits.argmax(-1)
            best = local.argmax(-1)[out.target_rows.clamp(min=0)]

            def count(drafted):
                return float((accept_lengths((drafted == best) & out.valid, k) * out.valid[:, 0]).sum())
            accepted += count(vocab.to_target(raw) if vocab is not None else raw)
            unmapped += count(raw)
            chains += float(out.valid[:, 0].sum())
    return loss_sum / weight, weight, accepted / chains, unmapped / chains


def _check_step_against(r, drafter, cfg, weight, loss, acceptance, before=None):
    """The trainer's metrics and weights after its step == the reference (gradients on ``drafter``,
    divided by ``weight``, one AdamW step from ``before``: the trainer's weights before its step)."""
    from cotrain.draft.optim import lr_at, make_optimizer, set_lr

    assert r["draft"]["draft/loss"] == pytest.approx(loss, rel=1e-4)
    assert r["draft"]["draft/acceptance_offline"] == pytest.approx(acceptance, rel=1e-6)
    params = [q for q in drafter.parameters() if q.requires_grad]
    grads = [q.grad / weight if q.grad is not None else torch.zeros_like(q) for q in params]
    gn = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads])).item()
    assert r["draft"]["draft/grad_norm"] == pytest.approx(gn, rel=1e-4)
    for q, x in zip(params, grads):
        q.grad = x
    opt = make_optimizer(drafter, cfg.draft.optimizer)
    set_lr(opt, lr_at(0, cfg.grpo.num_steps, cfg.draft.optimizer))
    opt.step()
    after = drafter.vllm_state_dict()
    before = r["draft_init"] if before is None else before
    moved = max((r["draft_weights"][n] - before[n]).abs().max().item() for n in r["draft_weights"]
                if r["draft_weights"][n].is_floating_point())
    assert moved > 1e-3  # the step moved the drafter
    for name, w in r["draft_weights"].items():
        torch.testing.assert_close(w, after[name], atol=2e-5, rtol=0, msg=name)


@pytest.mark.parametrize("name", ["on_policy", "on_policy_dspark", "on_policy_eagle3"])
def test_drafter_on_policy_step_equals_the_offline_specopd_computation(runs, tiny_model_path, name):
    """Reference, in this process (``_offline_specopd_step``): HF taps and logits of the same rows,
    the same anchors and draws, specopd.tree_target_logits on the HF policy, E2E-TV; gradients
    divided by the total weight, one AdamW step. EAGLE-3: its k passes on its own draws, the branch
    scored with its bonus token (p_1 from the bonus token's branch row)."""
    from cotrain.draft.registry import build_drafter
    from cotrain.draft.taps import TargetSpec, load_hf_target

    cfg = config(name)
    r = runs[name]
    target = TargetSpec.from_checkpoint(tiny_model_path)
    drafter = build_drafter(cfg.draft.kind, cfg.draft.settings, target, seed=cfg.run.seed).train()
    for key, w in drafter.vllm_state_dict().items():  # the same initial drafter as the trainer's
        if key in r["draft_init"]:
            assert torch.equal(r["draft_init"][key], w), key
    hf = load_hf_target(tiny_model_path)
    loss, weight, acc, _ = _offline_specopd_step(drafter, hf, cfg, r["batch"], 1, target.eos_token_id)
    if cfg.draft.kind == "eagle3":  # k scored tokens per branch (bonus included), one branch per chain anchor
        assert r["draft"]["draft/branch_tokens"] == r["draft"]["draft/chains"] * cfg.draft.settings.ttt_steps
    _check_step_against(r, drafter, cfg, weight, loss, acc)


def test_eagle3_on_policy_step_with_a_draft_vocabulary(runs, tiny_model_path):
    """EAGLE-3 with a reduced draft vocabulary (8 of 128 tokens), two drafter steps on the same
    rows. Step 1 (placeholder mapping): the on-policy step counts the rollout tokens, the mapping is
    built from them (the 8 most frequent response tokens) and the step takes no update. Step 2 ==
    the offline computation with that mapping: draws over draft ids mapped to target ids, p
    restricted to the draft tokens, the acceptance of the drafted ids mapped to target ids."""
    from cotrain.draft.registry import build_drafter
    from cotrain.draft.taps import TargetSpec, load_hf_target

    cfg = config("on_policy_eagle3_vocab")
    r = runs["on_policy_eagle3_vocab"]
    b = r["batch"]
    m1 = r["draft1"]
    assert m1["draft/skipped"] == 1.0 and m1["draft/vocab_rebuilt"] == 1.0 and m1["draft/vocab_version"] == 1
    V = 128
    counts = torch.bincount(b.targets[b.mask.bool()], minlength=V)
    want = sorted(sorted(range(V), key=lambda t: (-int(counts[t]), t))[:VOCAB])
    assert (torch.arange(VOCAB) + r["draft_weights1"]["d2t"]).tolist() == want
    m2 = r["draft"]
    assert m2.get("draft/skipped", 0.0) == 0.0 and m2["draft/vocab_version"] == 1
    assert 0.0 < m2["draft/vocab_coverage"] < 1.0  # some response tokens lie outside the draft vocabulary
    target = TargetSpec.from_checkpoint(tiny_model_path)
    drafter = build_drafter("eagle3", cfg.draft.settings, target, seed=cfg.run.seed).train()
    drafter.load_vllm_state_dict(r["draft_weights1"])  # the trainer's drafter after step 1 (mapping included)
    hf = load_hf_target(tiny_model_path)
    loss, weight, acc, unmapped = _offline_specopd_step(drafter, hf, cfg, b, 2, target.eos_token_id)
    # comparing unmapped draft ids would show: at least one chain's count differs (how many depends on
    # the built tiny model, whose fp32 build differs between CPU instruction sets, e.g. AVX2 and AVX-512)
    assert acc != unmapped
    _check_step_against(r, drafter, cfg, weight, loss, acc, before=r["draft_weights1"])


@pytest.mark.parametrize("name", ["on_policy_dp2", "on_policy_tp2", "on_policy_cp2", "on_policy_pp2",
                                  "on_policy_eagle3_pp2_cp2"])
def test_drafter_on_policy_step_is_the_same_at_dp2_tp2_cp2_pp2(runs, name):
    """Anchors per row and draws per branch (functions of the row and the anchor alone), every TP
    rank a replica on the TP-gathered logits, under CP each branch drafted and scored on its
    anchor's rank, under PP the drafter's microbatches deferred after the schedule and the tree
    forward run through both stages: the same step as one rank. EAGLE-3 at PP = 2 x CP = 2: its
    branches (bonus token first, also when it lies on the other CP shard) scored through the pipeline."""
    base, other = runs["on_policy_eagle3" if "eagle3" in name else "on_policy"], runs[name]
    for k in ("draft/loss", "draft/grad_norm", "draft/acceptance_offline", "draft/chains", "draft/positions",
              "draft/branch_tokens"):
        assert other["draft"][k] == pytest.approx(base["draft"][k], rel=1e-5, abs=1e-9), k
    for key, w in base["draft_weights"].items():
        torch.testing.assert_close(other["draft_weights"][key], w, atol=DRAFT_ATOL[name], rtol=0, msg=key)


# ------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("extra, key, fragment", [
    (["policy.context_parallel_impl=megatron_te", "policy.parallel.context=2"], "policy.context_parallel_impl",
     "draft.branches: on_policy replaces the policy's core_attention"),
    (["draft.cotrain=false", "rollout.speculative.draft_model=configs"], "draft.branches",
     "on_policy is used only when co-training"),
])
def test_on_policy_refuses_what_is_not_built(extra, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config("configs/grpo.yaml", BASE + DRAFT + ["draft.branches=on_policy"] + extra)
    msgs = [m for p, m in info.value.issues if p == key]
    assert any(fragment in m for m in msgs), info.value.issues


def test_on_policy_is_accepted_where_it_is_built(tmp_path):
    for name in ("on_policy", "on_policy_dp2", "on_policy_tp2", "on_policy_cp2", "on_policy_pp2"):
        assert config(name).draft.branches == "on_policy"
    cfg = load_config("configs/grpo.yaml", BASE + DRAFT + ["draft.branches=on_policy", "policy.parallel.pipeline=2",
                                                          "policy.parallel.context=2", "policy.parallel.tensor=2",
                                                          "cluster.cpus_per_node=9"])
    assert cfg.policy.parallel.pipeline == 2 and cfg.draft.branches == "on_policy"
    # a run folder of its own: validation refuses one that holds another run (a checkout's runs/demo)
    cfg = load_config("configs/demo.yaml", ["draft.branches=on_policy", "draft.loss=e2e_tv",
                                            f"run.output_dir={tmp_path / 'demo'}"])
    assert cfg.draft.kind == "dflash" and cfg.draft.branches == "on_policy"
    for name in ("on_policy_eagle3", "on_policy_eagle3_pp2_cp2", "on_policy_eagle3_vocab"):
        cfg = config(name)
        assert cfg.draft.kind == "eagle3" and cfg.draft.branches == "on_policy"
    cfg = load_config("configs/grpo.yaml", BASE + DRAFT + EAGLE3 + ["policy.parallel.tensor=2", "policy.parallel.data=2",
                                                                   "cluster.cpus_per_node=5"])
    assert cfg.draft.kind == "eagle3" and cfg.policy.parallel.tensor == 2


# ------------------------------------------------------------------------------- the draws
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_inverse_cdf_draws_follow_the_drafters_distribution(temperature):
    """At N evenly spaced uniforms (k + 1/2) / N the inverse-CDF draw gives token v exactly
    round(N * cdf) - round(N * cdf_prev) times: within one of N * softmax(l / T)_v, every token."""
    from cotrain.draft.specopd import _draw

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 128, generator=g) * 3
    N = 4000
    u = ((torch.arange(N) + 0.5) / N)[None].expand(3, N)
    y = _draw(logits[:, None, :].expand(3, N, 128), temperature, None, u)
    p = torch.softmax(logits / temperature, -1)
    for r in range(3):
        counts = torch.bincount(y[r], minlength=128).double()
        assert (counts - N * p[r].double()).abs().max() <= 1.0 + 1e-6
