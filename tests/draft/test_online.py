"""The drafter's side of co-training without Megatron: rows -> DraftBatch, anchors, sampling options."""

import pytest
import torch

from cotrain.config.schema import DraftConfig
from cotrain.draft.online import OnlineDraftTrainer, RolloutRows, anchor_seed, to_draft_batch
from cotrain.draft.registry import build_drafter
from cotrain.draft.taps import TargetSpec
from cotrain.parallel import work_imbalance


def rows_example():
    # two rows of S = 8: prompt [5, 6, 7] + response [8, 9, 2(eos)], and prompt [5, 6] + response [4]
    inputs = torch.tensor([[5, 6, 7, 8, 9, 2, 0, 0], [5, 6, 4, 0, 0, 0, 0, 0]])
    mask = torch.zeros(2, 8)
    mask[0, 2:5] = 1  # targets 8, 9, 2
    mask[1, 1:2] = 1  # target 4
    return RolloutRows(inputs, mask, torch.tensor([6, 3]), torch.tensor([10, 11]))


def test_rows_become_packed_sequences():
    rows = rows_example()
    H, V = 3, 11
    taps = torch.arange(16 * H, dtype=torch.float32).view(16, H)
    logits = torch.arange(16 * V, dtype=torch.float32).view(16, V)
    batch, tl = to_draft_batch(rows, taps, logits, cp_size=1)
    assert batch.cu_seqlens.tolist() == [0, 6, 9]  # padding dropped
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9, 2, 5, 6, 4]
    # token t is supervised iff it is a response token
    assert batch.loss_mask.tolist() == [False, False, False, True, True, True, False, False, True]
    assert batch.response_start.tolist() == [3, 2]
    assert torch.equal(batch.taps, taps[[0, 1, 2, 3, 4, 5, 8, 9, 10]]) and torch.equal(tl, logits[[0, 1, 2, 3, 4, 5, 8, 9, 10]])
    # under CP the rows stay whole (their zigzag shards arrive in the policy's order)
    batch2, tl2 = to_draft_batch(rows, taps[:8], logits[:8], cp_size=2)
    assert batch2.cu_seqlens.tolist() == [0, 8, 16] and batch2.taps.shape[0] == 8 and tl2.shape[0] == 8
    assert batch2.loss_mask.reshape(2, 8)[:, :6].tolist() == [
        [False, False, False, True, True, True], [False, False, True, False, False, False]]


def _trainer(tiny_model_path, sampling="uniform", cp=1, per_seq=2):
    cfg = DraftConfig.model_validate({"kind": "dflash", "loss": "soft_ce",
                                      "dflash": {"block_size": 4, "anchors_per_seq": per_seq,
                                                 "anchor_sampling": sampling}})
    target = TargetSpec.from_checkpoint(tiny_model_path)
    drafter = build_drafter("dflash", cfg.settings, target, seed=0)
    return OnlineDraftTrainer(drafter, cfg, total_steps=10, seed=7, cp_size=cp)


def _long_rows(n=6, S=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(5, 20, (n,), generator=g)
    lengths = torch.randint(S // 2, S, (n,), generator=g)
    inputs = torch.randint(3, 100, (n, S), generator=g)
    mask = torch.zeros(n, S)
    for i in range(n):
        mask[i, int(prompt[i]) - 1: int(lengths[i]) - 1] = 1
    return RolloutRows(inputs, mask, lengths, torch.arange(n))


def test_uniform_anchors_do_not_depend_on_the_cp_layout(tiny_model_path):
    rows = _long_rows()
    n, S = rows.inputs.shape
    H = 2 * 128
    one = _trainer(tiny_model_path, cp=1)
    two = _trainer(tiny_model_path, cp=2)
    b1, _ = to_draft_batch(rows, torch.zeros(n * S, H), torch.zeros(n * S, 5), cp_size=1)
    b2, _ = to_draft_batch(rows, torch.zeros(n * S // 2, H), torch.zeros(n * S // 2, 5), cp_size=2)
    l1, l2 = one._layout_for(b1, rows.seq_ids, step=3), two._layout_for(b2, rows.seq_ids, step=3)
    in_seq = lambda b, lay: [(int(b.seq_of[a]), int(b.positions[a])) for a in lay.anchors]  # noqa: E731
    assert in_seq(b1, l1) == in_seq(b2, l2)
    assert len(l1.anchors) == 2 * n
    # a different step draws different anchors; the same (seed, step, row) the same ones
    assert in_seq(b1, one._layout_for(b1, rows.seq_ids, step=4)) != in_seq(b1, l1)
    assert anchor_seed(7, 3, 5) == anchor_seed(7, 3, 5) != anchor_seed(7, 3, 6)


def test_balanced_anchor_sampling_evens_the_cp_work(tiny_model_path):
    uniform, balanced = _trainer(tiny_model_path, "uniform", cp=4, per_seq=3), _trainer(tiny_model_path, "balanced", cp=4, per_seq=3)
    imb = {"uniform": [], "balanced": []}
    for seed in range(12):
        rows = _long_rows(n=4, S=64, seed=seed)
        b, _ = to_draft_batch(rows, torch.zeros(4 * 16, 256), torch.zeros(4 * 16, 5), cp_size=4)
        imb["uniform"].append(work_imbalance(uniform._layout_for(b, rows.seq_ids, step=1)))
        lay = balanced._layout_for(b, rows.seq_ids, step=1)
        assert len(lay.anchors) == 3 * 4  # the same number of blocks, placed differently
        imb["balanced"].append(work_imbalance(lay))
    # 12 blocks over 4 ranks are coarse: even so the stratified draw roughly halves the excess work
    mean = {k: sum(v) / len(v) for k, v in imb.items()}
    assert mean["balanced"] - 1 < 0.5 * (mean["uniform"] - 1), mean
    assert max(imb["balanced"]) < 1.10, imb


def test_compare_frozen_scores_the_initial_drafter_on_the_same_chains(tiny_model_path):
    """``compare_frozen``: the frozen copy's acceptance at every step is exactly what a trainer whose
    drafter never moves (lr 1e-30) measures on the same inputs, and it follows the shared tensors; the
    co-trained drafter, taught one greedy token everywhere, leaves it behind."""
    target = TargetSpec.from_checkpoint(tiny_model_path)

    def trainer(lr, compare):
        cfg = DraftConfig.model_validate({"kind": "dflash", "loss": "soft_ce", "optimizer": {"lr": lr},
                                          "dflash": {"block_size": 4, "anchors_per_seq": 3}})
        drafter = build_drafter("dflash", cfg.settings, target, seed=0)
        return OnlineDraftTrainer(drafter, cfg, total_steps=10, seed=7, compare_frozen=compare)

    trained, still = trainer(0.05, True), trainer(1e-30, False)  # lr 1e-30: updates below float32 rounding
    rows = _long_rows(n=4, S=32)
    n, S = rows.inputs.shape
    width, V = trained.drafter.num_taps * target.arch.hidden_size, target.arch.vocab_size
    g = torch.Generator().manual_seed(0)
    seen = []
    for step in (1, 2, 3, 4):
        taps = torch.randn(n * S, width, generator=g)
        logits = torch.randn(n * S, V, generator=g)
        logits[:, 9] += 8.0  # the policy's greedy token is 9 everywhere: learnable in a few steps
        lm_head = target.lm_head + 0.01 * step  # the policy's head moves; both drafters borrow it
        ms = []
        for t in (trained, still):
            t.begin_step(step, lm_head=lm_head)
            t.microbatch(rows, taps, logits)
            ms.append(t.end_step())
        assert torch.equal(trained.frozen.target_lm_head, lm_head.to(trained.frozen.target_lm_head.dtype))
        assert ms[0]["acceptance_offline_frozen"] == ms[1]["acceptance_offline"]
        assert "acceptance_offline_frozen" not in ms[1]
        seen.append(ms[0])
    # the same drafter before its first update; the frozen copy's weights are the untrained ones
    assert seen[0]["acceptance_offline"] == seen[0]["acceptance_offline_frozen"]
    frozen, kept = dict(trained.frozen.named_parameters()), dict(still.drafter.named_parameters())
    assert all(torch.equal(frozen[k], kept[k]) for k in kept)
    assert not all(torch.equal(frozen[k], p) for k, p in trained.drafter.named_parameters())
    assert seen[-1]["acceptance_offline"] > seen[-1]["acceptance_offline_frozen"] + 0.5


# ------------------------------------------------------------------ draft.budget: the replay window
def _budget_trainer(tiny_model_path, mode="adaptive", max_steps=3, replay_steps=2, replay_max_mib=1024.0, lr=0.02):
    budget = {"mode": mode}
    if mode == "adaptive":
        budget.update(max_steps=max_steps, replay_steps=replay_steps, replay_max_mib=replay_max_mib)
    cfg = DraftConfig.model_validate({"kind": "dflash", "loss": "soft_ce", "optimizer": {"lr": lr}, "budget": budget,
                                      "dflash": {"block_size": 4, "anchors_per_seq": 3}})
    target = TargetSpec.from_checkpoint(tiny_model_path)
    t = OnlineDraftTrainer(build_drafter("dflash", cfg.settings, target, seed=0), cfg, total_steps=10, seed=7)
    t.width, t.vocab = t.drafter.num_taps * target.arch.hidden_size, target.arch.vocab_size
    return t


def _step_inputs(trainer, step, n=4, S=32):
    rows = _long_rows(n=n, S=S, seed=step)
    g = torch.Generator().manual_seed(100 + step)
    width, V = trainer.width, trainer.vocab
    taps = torch.randn(n * S, width, generator=g)
    logits = torch.randn(n * S, V, generator=g)
    logits[:, 9] += 6.0
    return rows, taps, logits


def _grpo_step(trainer, step, extra):
    rows, taps, logits = _step_inputs(trainer, step)
    trainer.begin_step(step)
    half = rows.inputs.shape[0] // 2  # two microbatches
    S = rows.inputs.shape[1]
    for sl in (slice(0, half), slice(half, None)):
        sub = RolloutRows(rows.inputs[sl], rows.mask[sl], rows.lengths[sl], rows.seq_ids[sl])
        trainer.microbatch(sub, taps[sl.start * S: (sl.stop or rows.inputs.shape[0]) * S],
                           logits[sl.start * S: (sl.stop or rows.inputs.shape[0]) * S])
    m = trainer.end_step()
    m.update(trainer.replay(extra))
    return m


def test_the_replay_window_keeps_recent_steps_within_its_bound(tiny_model_path):
    t = _budget_trainer(tiny_model_path, replay_steps=2)
    for step in (1, 2, 3):
        _grpo_step(t, step, extra=0)
    assert [e.step for e in t.window.entries] == [2, 2, 3, 3]  # two microbatches per step, the last 2 steps
    # the inputs are copies: what microbatch got, not a view a caller may overwrite
    rows, taps, logits = _step_inputs(t, 3)
    assert torch.equal(t.window.entries[-1].logits, logits[2 * 32:])
    # a bound of one microbatch's bytes keeps only the newest
    one = t.window.entries[-1].nbytes
    small = _budget_trainer(tiny_model_path, replay_steps=4, replay_max_mib=1.5 * one / 2**20)
    for step in (1, 2):
        _grpo_step(small, step, extra=0)
    assert [e.step for e in small.window.entries] == [2]
    # the extra steps take the newest microbatches first, as many as the step had, then older ones
    assert [id(e) for e in t.window.select(0, 2)] == [id(t.window.entries[3]), id(t.window.entries[2])]
    assert [id(e) for e in t.window.select(1, 2)] == [id(t.window.entries[1]), id(t.window.entries[0])]


def test_replayed_steps_train_further_at_the_steps_rate_and_resume_exactly(tiny_model_path):
    """Two extra optimizer steps per GRPO step on the window: the drafter fits the policy's
    distribution better than with one step (its loss on the next step's fresh inputs, measured before
    that step's update, is lower), the LR schedule still follows GRPO steps, and a trainer restored
    from a state_dict (the window included) continues bit for bit."""
    import copy

    one, three = _budget_trainer(tiny_model_path, mode="fixed"), _budget_trainer(tiny_model_path, max_steps=3)
    for step in (1, 2, 3):
        m1 = _grpo_step(one, step, extra=0)
        m3 = _grpo_step(three, step, extra=2)
        assert m3["lr"] == m1["lr"] and three.steps_done == one.steps_done == step
        assert "replay_loss" in m3 and m3["replay_s"] > 0
    snapshot = copy.deepcopy(three.state_dict())
    fresh1, fresh3 = _grpo_step(one, 4, extra=0), _grpo_step(three, 4, extra=2)
    assert fresh3["loss"] < fresh1["loss"] - 0.05, (fresh3["loss"], fresh1["loss"])
    restored = _budget_trainer(tiny_model_path, max_steps=3)
    restored.load_state_dict(snapshot)
    assert [e.step for e in restored.window.entries] == [2, 2, 3, 3]
    again = _grpo_step(restored, 4, extra=2)
    assert again["loss"] == fresh3["loss"] and again["replay_loss"] == fresh3["replay_loss"]
    for (n, p), (_, q) in zip(three.drafter.named_parameters(), restored.drafter.named_parameters()):
        assert torch.equal(p, q), n


def test_a_measure_only_step_scores_like_a_training_step_and_changes_nothing(tiny_model_path):
    """``draft.budget.measure_idle``: an idle step's measure-only pass reports the acceptance (the
    frozen copy's too) that a training step reports on the same inputs, and leaves the drafter, its
    optimizer, schedule, replay window and vocabulary counts as they were: the next training step is
    bit-identical to that of a trainer that never measured."""
    import copy

    def make():
        t = _budget_trainer(tiny_model_path, max_steps=3, lr=0.05)
        t.frozen = copy.deepcopy(t.drafter).requires_grad_(False).eval()
        return t

    measured, trained, skipped = make(), make(), make()
    for t in (measured, trained, skipped):
        _grpo_step(t, 1, extra=0)
    before = copy.deepcopy(measured.state_dict())
    measured.begin_step(2, measure_only=True)
    rows, taps, logits = _step_inputs(measured, 2)
    assert measured.microbatch(rows, taps, logits) == {}
    m = measured.end_step()
    ref = _grpo_step(trained, 2, extra=0)  # scores its chains before its update: the same drafter as measured's
    for k in ("acceptance_offline", "chains", "acceptance_offline_frozen"):
        assert m[k] == ref[k], k
    assert m["chains"] > 0 and m["time_s"] == 0.0 and m["measure_s"] > 0
    assert not {"loss", "grad_norm", "lr", "flops"} & set(m)  # no step was taken
    after = measured.state_dict()
    assert after["steps_done"] == before["steps_done"] == 1
    assert all(torch.equal(after["drafter"][n], p) for n, p in before["drafter"].items())
    opt_a, opt_b = after["optimizer"], before["optimizer"]
    assert opt_a["param_groups"] == opt_b["param_groups"] and opt_a["state"].keys() == opt_b["state"].keys()
    assert all(torch.equal(torch.as_tensor(opt_a["state"][i][k]), torch.as_tensor(v))
               for i in opt_b["state"] for k, v in opt_b["state"][i].items())
    assert [e["step"] for e in after["window"]["entries"]] == [e["step"] for e in before["window"]["entries"]]
    # the next step (two replayed) as if step 2 had never happened
    m3, s3 = _grpo_step(measured, 3, extra=2), _grpo_step(skipped, 3, extra=2)
    assert m3["loss"] == s3["loss"] and m3["replay_loss"] == s3["replay_loss"] and m3["lr"] == s3["lr"]
    for (n, p), (_, q) in zip(measured.drafter.named_parameters(), skipped.drafter.named_parameters()):
        assert torch.equal(p, q), n


def _packed_rows(rows: RolloutRows) -> tuple[RolloutRows, torch.Tensor]:
    """``rows`` as a packed microbatch lays them out (each row's real positions end to end, then 5
    positions of filler) and the index of those positions in the padded [b * S] grid."""
    from cotrain.parallel.layout import spans

    b, S = rows.inputs.shape
    lengths = rows.lengths.to(torch.int64)
    grid = spans(torch.arange(b) * S, lengths)
    packed = RolloutRows(rows.inputs, rows.mask, rows.lengths, rows.seq_ids, widths=lengths.clone())
    return packed, torch.cat([grid, torch.full((5,), b * S - 1)])


@pytest.mark.parametrize("kind", ["dflash", "dspark", "eagle3"])
@pytest.mark.parametrize("packed", [False, True])
def test_the_compact_logits_handoff_trains_and_scores_as_the_whole_logits(tiny_model_path, kind, packed):
    """The drafter's step reads the target logits only at its chains' rows, so a microbatch may hand
    over only those (OnlineDraftTrainer.logit_rows, known before the forward): the loss, gradients,
    acceptance (the frozen copy's too), weights after two steps and a measure-only step are bit for bit
    those of the whole logits; fewer rows cross; a row missing from the compact logits is an error."""
    import copy

    settings = {"ttt_steps": 3} if kind == "eagle3" else {"block_size": 4, "anchors_per_seq": 3}
    cfg = DraftConfig.model_validate({"kind": kind, "loss": "soft_ce", "optimizer": {"lr": 0.05}, kind: settings})
    target = TargetSpec.from_checkpoint(tiny_model_path)
    whole = OnlineDraftTrainer(build_drafter(kind, cfg.settings, target, seed=0), cfg, total_steps=10, seed=7,
                               compare_frozen=True)
    compact = copy.deepcopy(whole)
    width, V = whole.drafter.num_taps * target.arch.hidden_size, target.arch.vocab_size
    kept = []

    def step(t, s, measure=False, use_rows=False):
        t.begin_step(s, measure_only=measure)
        rows, taps, logits = _long_rows(n=4, S=40, seed=s), None, None
        g = torch.Generator().manual_seed(100 + s)
        taps, logits = torch.randn(4 * 40, width, generator=g), torch.randn(4 * 40, V, generator=g)
        if packed:
            rows, at = _packed_rows(rows)
            taps, logits = taps[at], logits[at]
        for sl in (slice(0, 2), slice(2, 4)):
            sub = RolloutRows(rows.inputs[sl], rows.mask[sl], rows.lengths[sl], rows.seq_ids[sl],
                              widths=None if rows.widths is None else rows.widths[sl])
            w = sub.row_widths()
            lo = int(rows.row_widths()[:sl.start].sum())
            hi = lo + int(w.sum())
            sub_taps, sub_logits = taps[lo:hi], logits[lo:hi]
            if use_rows:
                r = t.logit_rows(sub)
                assert r is not None and torch.equal(r, torch.sort(r).values)
                kept.append((r.numel(), int(sub.lengths.sum())))
                t.microbatch(sub, sub_taps, sub_logits[r], logit_rows=r)
            else:
                t.microbatch(sub, sub_taps, sub_logits)
        return t.end_step()

    for s in (1, 2):
        a, b = step(whole, s), step(compact, s, use_rows=True)
        assert {k: v for k, v in a.items() if not k.endswith("_s")} == {k: v for k, v in b.items() if not k.endswith("_s")}
        assert a["chains"] > 0 and a["acceptance_offline_frozen"] > 0
    for (n, p), (_, q) in zip(whole.drafter.named_parameters(), compact.drafter.named_parameters()):
        assert torch.equal(p, q), n
    a, b = step(whole, 3, measure=True), step(compact, 3, measure=True, use_rows=True)
    assert a["acceptance_offline"] == b["acceptance_offline"] and a["chains"] == b["chains"] > 0
    assert a["acceptance_offline_frozen"] == b["acceptance_offline_frozen"]
    assert all(n < real for n, real in kept)  # fewer rows than the microbatch's real positions (EAGLE-3: no prompt row)
    # the drafter reading a row the handoff did not keep is refused, not a wrong target
    compact.begin_step(4)
    rows = _long_rows(n=2, S=40, seed=4)
    r = compact.logit_rows(rows)
    with pytest.raises(RuntimeError, match="did not keep"):
        compact.microbatch(rows, torch.randn(80, width), torch.randn(r.numel() - 1, V), logit_rows=r[1:])


def test_every_row_is_handed_over_where_the_step_reads_more(tiny_model_path):
    """logit_rows is None (the whole logits) under CP (rows fetched from their owners) and with a
    replay window (replays draw fresh anchors); EAGLE-3's are its response rows (chains start at every
    response position), from the one before the first supervised token to the one before the last."""
    rows = _long_rows(n=2, S=40)
    eagle = DraftConfig.model_validate({"kind": "eagle3", "eagle3": {"ttt_steps": 3}})
    target = TargetSpec.from_checkpoint(tiny_model_path)
    t = OnlineDraftTrainer(build_drafter("eagle3", eagle.settings, target, seed=0), eagle, total_steps=10)
    t.begin_step(1)
    got = t.logit_rows(rows)
    S = rows.inputs.shape[1]
    want = torch.cat([i * S + torch.nonzero(rows.mask[i]).squeeze(1) for i in range(len(rows))])
    assert torch.equal(got, want)  # target row t supervises token t + 1: the mask's rows, exactly
    cp = _trainer(tiny_model_path, cp=2)
    cp.begin_step(1)
    assert cp.logit_rows(rows) is None
    replay = _budget_trainer(tiny_model_path)
    replay.begin_step(1)
    assert replay.logit_rows(rows) is None
    fixed = _trainer(tiny_model_path)
    fixed.begin_step(1)
    assert fixed.logit_rows(rows) is not None
