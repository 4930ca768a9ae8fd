"""EAGLE-3's reduced draft vocabulary (d2t): the mapping, the loss over it, the acceptance estimator,
the drafter and its export, config validation, and co-training (OnlineDraftTrainer against the
offline distillation step with the same mapping; the mapping built from rollout tokens, rebuilt)."""

import math

import pytest
import torch
import torch.nn.functional as F

from cotrain.config.schema import DraftConfig, Eagle3Config
from cotrain.draft.acceptance import estimate_acceptance, greedy_matches
from cotrain.draft.common import DraftBatch, DraftOutput
from cotrain.draft.losses import draft_loss
from cotrain.draft.registry import build_drafter
from cotrain.draft.vocab import DraftVocab, token_counts


# ------------------------------------------------------------------------------------- the mapping
def test_mapping_from_counts_in_vllm_and_specforge_formats():
    counts = torch.tensor([0, 5, 9, 5, 0, 7, 1, 0, 5, 2], dtype=torch.float64)  # V = 10
    v = DraftVocab.from_counts(counts, 4)
    # the 4 most frequent: 2 (9), 5 (7), then the 5s by ascending id: 1, 3 (8 loses the tie); sorted
    assert v.target_ids.tolist() == [1, 2, 3, 5] and v.source == "counts"
    # vLLM: target id = draft id + d2t[draft id]
    assert v.d2t.dtype == torch.int64 and v.d2t.tolist() == [1, 1, 1, 2]
    assert (torch.arange(4) + v.d2t).tolist() == v.target_ids.tolist()
    # SpecForge's consistency rule: nonzero(t2d) == arange(N) + d2t
    assert torch.nonzero(v.t2d).flatten().tolist() == v.target_ids.tolist()
    assert v.draft_index.tolist() == [-1, 0, 1, 2, -1, 3, -1, -1, -1, -1]
    assert v.to_target(torch.tensor([[3, 0]])).tolist() == [[5, 1]]
    assert v.to_draft(torch.tensor([5, 4, -1, 2])).tolist() == [3, -1, -1, 1]
    assert v.coverage(counts) == pytest.approx((5 + 9 + 5 + 7) / 34)
    assert DraftVocab.from_d2t(v.d2t, 10).target_ids.tolist() == [1, 2, 3, 5]
    # fewer seen tokens than N: unseen ones fill in by ascending id (SpecForge pads with low ids)
    assert DraftVocab.from_counts(torch.tensor([0, 0, 3, 0, 1.0]), 3).target_ids.tolist() == [0, 2, 4]
    assert token_counts(torch.tensor([2, 2, 4, 1]), torch.tensor([1, 1, 1, 0]), 5).tolist() == [0, 0, 2, 0, 1]
    with pytest.raises(ValueError, match="ascending"):
        DraftVocab(torch.tensor([3, 1]), 10)
    with pytest.raises(ValueError, match="integers"):
        DraftVocab.from_d2t(torch.tensor([0.0, 1.0]), 10)
    with pytest.raises(ValueError, match="not in 1..10"):
        DraftVocab.from_counts(counts, 11)
    # spread: draft-vocabulary distributions over the target's ids, by hand; restrict undoes it
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.0, 0.5, 0.0, 0.5]])
    assert torch.equal(v.spread(q), torch.tensor([[0, 0.1, 0.2, 0.3, 0, 0.4, 0, 0, 0, 0],
                                                  [0, 0.0, 0.5, 0.0, 0, 0.5, 0, 0, 0, 0]]))
    assert torch.equal(v.restrict(v.spread(q)).p, q)
    with pytest.raises(ValueError, match="draft vocabulary has 4"):
        v.spread(torch.ones(2, 5))


def test_head_rows_follow_their_tokens():
    old, new = DraftVocab(torch.tensor([1, 2, 3, 5]), 10), DraftVocab(torch.tensor([2, 5, 7, 8]), 10)
    rows = torch.tensor([[10.0], [20.0], [30.0], [50.0]])  # row of token t = 10 t
    fill = -torch.arange(10.0)[:, None]  # new tokens: -t
    assert new.remap_rows(old, rows, fill).flatten().tolist() == [20.0, 50.0, -7.0, -8.0]


def test_optimizer_moments_follow_the_rows():
    from cotrain.draft.optim import remap_optimizer_rows

    w = torch.nn.Parameter(torch.zeros(3, 2))
    opt = torch.optim.AdamW([w])
    w.grad = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    opt.step()
    avg = opt.state[w]["exp_avg"].clone()
    remap_optimizer_rows(opt, w, torch.tensor([2, -1, 0]))  # new row 0 = old row 2, row 1 new, row 2 = old 0
    torch.testing.assert_close(opt.state[w]["exp_avg"], torch.stack([avg[2], torch.zeros(2), avg[0]]))
    assert opt.state[w]["step"].item() == 1  # scalars untouched


# ------------------------------------------------------------------------------------- the loss
def _chain(logits, valid=None):
    N, W, _ = logits.shape
    valid = torch.ones(N, W, dtype=torch.bool) if valid is None else valid
    return DraftOutput(logits=logits, bonus_pos=torch.zeros(N, dtype=torch.int64),
                       target_rows=torch.zeros(N, W, dtype=torch.int64), valid=valid)


def test_loss_over_the_draft_vocabulary_by_hand():
    """V = 4, draft tokens {1, 3}. Position 0: target greedy 1 (in), position 1: greedy 2 (outside)."""
    vocab = DraftVocab(torch.tensor([1, 3]), 4)
    p = torch.tensor([[[0.1, 0.5, 0.2, 0.2], [0.1, 0.2, 0.6, 0.1]]])
    z = torch.tensor([[[0.0, 1.0], [2.0, 0.0]]], requires_grad=True)
    out = _chain(z)
    q0 = torch.softmax(torch.tensor([0.0, 1.0]), 0)
    # soft_ce: renormalised target (0.5, 0.2) / 0.7 at position 0 only (position 1 is dropped)
    pr = torch.tensor([5 / 7, 2 / 7])
    loss, m = draft_loss("soft_ce", out, p, vocab=vocab)
    assert loss.item() == pytest.approx(float(-(pr * q0.log()).sum()), rel=1e-6)
    loss.backward()
    torch.testing.assert_close(z.grad[0, 0], q0 - pr)  # gradient q - p~ at the counted position
    assert z.grad[0, 1].abs().max() == 0 and m["weight"] == 1.0 and m["in_vocab"] == 0.5
    # forward_kl: soft_ce - H(p~)
    kl, _ = draft_loss("forward_kl", out, p, vocab=vocab)
    assert kl.item() == pytest.approx(float((pr * (pr.log() - q0.log())).sum()), rel=1e-5)
    # overlap (acceptance): the mass outside is never accepted - sum over draft tokens of min(p, q)
    q1 = torch.softmax(torch.tensor([2.0, 0.0]), 0)
    a0 = min(0.5, q0[0].item()) + min(0.2, q0[1].item())
    a1 = min(0.2, q1[0].item()) + min(0.1, q1[1].item())
    assert m["overlap"] == pytest.approx((a0 + a1) / 2, rel=1e-6)
    # top1: draft 1 -> token 3 (greedy 1: no), draft 0 -> token 1 (greedy 2: no); then a match
    assert m["top1_match"] == 0.0
    _, m2 = draft_loss("soft_ce", _chain(torch.tensor([[[3.0, 0.0], [0.0, 0.0]]])), p, vocab=vocab)
    assert m2["top1_match"] == 0.5
    # e2e_tv on the unnormalised overlaps, every valid position (an unreachable token breaks the chain)
    tv, m3 = draft_loss("e2e_tv", out, p, vocab=vocab)
    assert tv.item() == pytest.approx(-(a0 + a0 * a1) / 2, rel=1e-5) and m3["weight"] == 2.0
    # hard_ce: the labels are target ids, mapped; a label outside is not counted
    hc, m4 = draft_loss("hard_ce", out, p, labels=torch.tensor([[3, 2]]), vocab=vocab)
    assert hc.item() == pytest.approx(-math.log(q0[1].item()), rel=1e-6) and m4["weight"] == 1.0
    with pytest.raises(ValueError, match="draft vocabulary of 2"):
        draft_loss("soft_ce", _chain(torch.zeros(1, 2, 4)), p, vocab=vocab)


def test_a_target_token_outside_the_vocabulary_is_never_drafted():
    vocab = DraftVocab(torch.tensor([0, 2, 5]), 8)
    tl = F.one_hot(torch.tensor([2, 5, 7]), 8).float()  # target greedy tokens at rows 0, 1, 2
    out = DraftOutput(logits=torch.tensor([[[0.0, 9.0, 0.0], [0.0, 0.0, 9.0], [9.0, 0.0, 0.0]]]),
                      bonus_pos=torch.zeros(1, dtype=torch.int64), target_rows=torch.tensor([[0, 1, 2]]),
                      valid=torch.ones(1, 3, dtype=torch.bool))
    assert greedy_matches(out, tl, vocab).tolist() == [[True, True, False]]  # token 7 cannot be drafted
    assert greedy_matches(out, tl).tolist() == [[False, False, False]]  # unmapped ids are not target ids


# ------------------------------------------------------------------------------ drafter and export
@pytest.fixture
def reduced(target, one_thread):
    return build_drafter("eagle3", {"draft_vocab_size": 24, "ttt_steps": 3}, target, seed=0)


def test_reduced_drafter_head_export_and_load(reduced, target, tmp_path):
    from cotrain.draft.export import export_drafter, load_drafter, read_export

    d = reduced
    assert d.vocab.source == "placeholder" and d.lm_head.weight.shape == (24, target.arch.hidden_size)
    torch.testing.assert_close(d.lm_head.weight, target.lm_head[:24], atol=1e-3, rtol=0)
    v = DraftVocab.from_counts(torch.arange(128.0) % 7, 24)
    w0 = d.lm_head.weight.detach().clone()
    src = d.set_vocab(v)
    kept = src >= 0
    torch.testing.assert_close(d.lm_head.weight[kept], w0[src[kept]])  # rows follow their tokens
    torch.testing.assert_close(d.lm_head.weight[~kept], target.lm_head[v.target_ids[~kept]])
    export_drafter(d, tmp_path / "d")
    config, meta, state = read_export(tmp_path / "d")
    assert config["draft_vocab_size"] == 24 and config["vocab_size"] == 128
    assert state["d2t"].dtype == torch.int64 and torch.equal(state["d2t"], v.d2t) and "t2d" not in state
    assert state["lm_head.weight"].shape == (24, target.arch.hidden_size)
    assert "d2t" in d.push_names()
    back = load_drafter(tmp_path / "d", target)
    assert back.vocab.source == "checkpoint" and torch.equal(back.vocab.target_ids, v.target_ids)
    torch.testing.assert_close(back.lm_head.weight, d.lm_head.weight)
    # a checkpoint and a config that disagree on the vocabulary are refused, naming the setting
    full = build_drafter("eagle3", {"ttt_steps": 3}, target)
    with pytest.raises(ValueError, match="set draft.eagle3.draft_vocab_size: 24"):
        full.load_vllm_state_dict(state)
    other = build_drafter("eagle3", {"draft_vocab_size": 32, "ttt_steps": 3}, target)
    with pytest.raises(ValueError, match="d2t has 24 entries"):
        other.load_vllm_state_dict(state)
    with pytest.raises(KeyError, match="no d2t"):
        d.load_vllm_state_dict({k: t for k, t in state.items() if k != "d2t"})
    bad = dict(state, t2d=torch.zeros(128, dtype=torch.bool))
    with pytest.raises(ValueError, match="t2d does not select"):
        d.load_vllm_state_dict(bad)
    # the full-vocabulary drafter is unchanged: no d2t, draft_vocab_size = the target's
    assert "d2t" not in full.vllm_state_dict() and full.vllm_config()["draft_vocab_size"] == 128
    assert build_drafter("eagle3", {"draft_vocab_size": 128}, target).vocab is None


def test_estimator_maps_draft_ids(reduced, target, hf_target):
    """The estimator's matches are the drafted *target* tokens: a drafter whose head rows are moved
    to other tokens (the same logits, another mapping) gets another acceptance."""
    from cotrain.draft.taps import compute_taps

    model, tok = hf_target
    seqs = [tok.encode(f"{a}+{b}=") for a, b in [(12, 34), (5, 77), (40, 2), (9, 9)]]
    ids = torch.tensor([t for s in seqs for t in s])
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor([len(s) for s in seqs]), 0)))
    taps, logits = compute_taps(model, ids, cu, reduced.tap_layers)
    # the draft vocabulary of the target's own greedy tokens: the drafter can match them
    batch = DraftBatch(ids, cu, taps, None, logits)
    greedy = logits.argmax(-1)
    v = DraftVocab.from_counts(token_counts(greedy, None, 128), 24)
    reduced.set_vocab(v)
    rep = estimate_acceptance(reduced, batch, k=3)
    out = reduced(batch)
    m = greedy_matches(out, logits, reduced.vocab)
    first = out.valid[:, 0]
    assert rep.mean_len == pytest.approx(float((1 + torch.cumprod(m[first].long(), 1).sum(1)).double().mean()))
    drafted = v.to_target(out.logits.argmax(-1))
    assert bool(v.contains(drafted).all())  # only draft tokens are ever proposed


# ---------------------------------------------------------------------------------- configuration
def test_grpo_config_validates_draft_vocab_size():
    from cotrain.config import ConfigError, load_config

    base = ["policy.model_path=builtin:tiny"]
    cfg = load_config("configs/demo_eagle3.yaml", base + ["draft.init=null", "draft.eagle3.draft_vocab_size=64",
                                                           "draft.eagle3.vocab_rebuild_every=5"])
    assert cfg.draft.eagle3.draft_vocab_size == 64 and cfg.draft.eagle3.vocab_rebuild_every == 5
    with pytest.raises(ConfigError) as e:
        load_config("configs/demo_eagle3.yaml", base + ["draft.init=null", "draft.eagle3.draft_vocab_size=200"])
    assert any(p == "draft.eagle3.draft_vocab_size" and "exceeds the target's vocabulary of 128" in m
               for p, m in e.value.issues), e.value.issues
    with pytest.raises(ConfigError) as e:
        load_config("configs/demo_eagle3.yaml", base + ["draft.init=null", "draft.eagle3.vocab_rebuild_every=5"])
    assert any(p == "draft.eagle3.vocab_rebuild_every" for p, _ in e.value.issues), e.value.issues
    # draft.init distilled with the full vocabulary does not fit a reduced one
    with pytest.raises(ConfigError) as e:
        load_config("configs/demo_eagle3.yaml", base + ["draft.eagle3.draft_vocab_size=64"])
    assert any(p == "draft.eagle3.draft_vocab_size" and "differs from the drafter distilled" in m
               for p, m in e.value.issues), e.value.issues


def test_distill_config_refuses_a_rebuild_schedule():
    from cotrain.config.distill import load_distill_config

    cfg = load_distill_config("configs/distill_words_eagle3.yaml")
    assert cfg.draft.eagle3.draft_vocab_size == 512 and cfg.data.task == "words"
    with pytest.raises(ValueError, match="vocab_rebuild_every: used only by a GRPO run"):
        load_distill_config("configs/distill_words_eagle3.yaml", ["draft.eagle3.vocab_rebuild_every=2"])
    assert Eagle3Config(draft_vocab_size=5).reduced_vocab(10) and not Eagle3Config(draft_vocab_size=10).reduced_vocab(10)


# ------------------------------------------------------------------------------------ co-training
def _rollout(tiny_model_path, hf_target, prompts, S=16):
    """Rows as the policy sees them (the target's greedy responses), and the HF target's taps and logits."""
    from cotrain.draft.distill import generate_records
    from cotrain.draft.online import RolloutRows
    from cotrain.draft.taps import compute_taps

    model, tok = hf_target
    recs = generate_records(model, tok, prompts, max_new_tokens=6, tail_tokens=0)
    b = len(recs)
    inputs = torch.zeros(b, S, dtype=torch.int64)
    mask = torch.zeros(b, S)
    lengths = torch.zeros(b, dtype=torch.int64)
    for i, r in enumerate(recs):
        seq = (r.prompt + r.response)[:S]
        inputs[i, :len(seq)] = torch.tensor(seq)
        mask[i, len(r.prompt) - 1: len(seq) - 1] = 1  # target t (token t + 1) is a response token
        lengths[i] = len(seq)
    rows = RolloutRows(inputs, mask, lengths, torch.arange(b))
    taps, logits = compute_taps(model, inputs.reshape(-1), torch.arange(0, b * S + 1, S), [0, 2, 3])
    return rows, taps, logits


def _draft_cfg(**eagle3):
    return DraftConfig.model_validate({
        "kind": "eagle3", "loss": "soft_ce", "cotrain": True,
        "optimizer": {"lr": 0.5, "eps": 1.0, "clip_grad": 0.0, "warmup_steps": 0, "schedule": "constant"},
        "eagle3": {"ttt_steps": 3, "draft_vocab_size": 8, **eagle3}})


PROMPTS = [f"{a}+{b}=" for a, b in [(12, 34), (5, 77), (40, 2), (9, 9), (63, 18), (7, 51), (88, 88), (30, 6)]]


def test_online_step_equals_the_distillation_step_with_the_same_mapping(tiny_model_path, hf_target, target,
                                                                         one_thread):
    """8 draft tokens of the arithmetic responses' 11 (digits + EOS): some target tokens fall outside.
    The online trainer (two microbatches, the policy's rows) and the offline distillation step (one
    batch) with the same mapping take the same step; eps = 1 and no clipping, so the weights compare
    the gradients linearly."""
    from cotrain.draft.distill import build_draft_vocab, train_step
    from cotrain.draft.online import OnlineDraftTrainer, RolloutRows, to_draft_batch
    from cotrain.draft.optim import make_optimizer, set_lr

    rows, taps, logits = _rollout(tiny_model_path, hf_target, PROMPTS)
    cfg = _draft_cfg()
    batch, batch_logits = to_draft_batch(rows, taps, logits)
    ref = build_drafter("eagle3", cfg.settings, target, seed=0)
    info = build_draft_vocab(ref, batch)  # the distillation's mapping, from the same tokens
    assert 0.3 < info["coverage_train"] < 1.0, info
    online_drafter = build_drafter("eagle3", cfg.settings, target, seed=0)
    online_drafter.set_vocab(ref.vocab)
    trainer = OnlineDraftTrainer(online_drafter, cfg, total_steps=10, seed=0)
    trainer.begin_step(1)
    S, half = rows.width, len(rows) // 2
    for sl in (slice(0, half), slice(half, None)):
        sub = RolloutRows(rows.inputs[sl], rows.mask[sl], rows.lengths[sl], rows.seq_ids[sl])
        n = len(sub)
        start = sl.start * S
        trainer.microbatch(sub, taps[start: start + n * S], logits[start: start + n * S])
    m_on = trainer.end_step()
    # the offline acceptance the trainer reports, written out on the same (pre-update) drafter's chains:
    # per chain whose first draft is supervised, 1 + the leading drafts (draft ids mapped to target
    # tokens by the mapping's own table) equal to the policy's greedy token at their row
    k = trainer.k
    with torch.no_grad():
        out = ref(batch, ref.build_layout(batch))
    drafted = ref.vocab.target_ids[out.logits[:, :k].argmax(-1)]
    ok = (drafted == batch_logits[out.target_rows[:, :k].clamp(min=0)].argmax(-1)) & out.valid[:, :k]
    lens = [1 + next((j for j in range(k) if not ok[n, j]), k) for n in range(ok.shape[0]) if out.valid[n, 0]]
    assert m_on["acceptance_offline"] == pytest.approx(sum(lens) / len(lens), rel=1e-6)
    assert len(set(lens)) > 1  # chains of different lengths: a wrong count or mapping shows
    opt = make_optimizer(ref, cfg.optimizer)
    set_lr(opt, cfg.optimizer.lr)
    m_off = train_step(ref, batch, "soft_ce", opt, 0.0, torch.Generator())
    assert 0.0 < m_off["in_vocab"] < 1.0  # positions were dropped
    assert m_on["loss"] == pytest.approx(m_off["loss"], rel=1e-5)
    assert m_on["grad_norm"] == pytest.approx(m_off["grad_norm"], rel=1e-4)
    assert m_on["vocab_version"] == 0 and m_on["vocab_rebuilt"] == 0
    assert m_on["vocab_coverage"] == pytest.approx(info["coverage_train"])
    on, off = online_drafter.vllm_state_dict(), ref.vllm_state_dict()
    assert torch.equal(on["d2t"], off["d2t"])
    for name, w in off.items():
        torch.testing.assert_close(on[name], w, atol=1e-6, rtol=0, msg=name)
    push = trainer.push_state()
    assert push["d2t"].dtype == torch.int64 and push["lm_head.weight"].shape[0] == 8


def test_online_mapping_built_from_rollouts_and_rebuilt(tiny_model_path, hf_target, target, one_thread):
    """From scratch: the first step's rollout tokens build the mapping (no update that step); with
    vocab_rebuild_every = 2 it is rebuilt from the tokens of the next two steps, the head rows and
    Adam's moments following their tokens; a checkpoint restores the mapping exactly."""
    from cotrain.draft.online import OnlineDraftTrainer, to_draft_batch

    cfg = _draft_cfg(vocab_rebuild_every=2)
    drafter = build_drafter("eagle3", cfg.settings, target, seed=0)
    trainer = OnlineDraftTrainer(drafter, cfg, total_steps=10, seed=0)
    first = _rollout(tiny_model_path, hf_target, PROMPTS[:4])
    w0 = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    trainer.begin_step(0)
    trainer.microbatch(*first)
    m = trainer.end_step()
    assert m["skipped"] == 1.0 and m["vocab_rebuilt"] == 1.0 and m["vocab_version"] == 1 and trainer.steps_done == 0
    b0, _ = to_draft_batch(*first)
    want = DraftVocab.from_counts(token_counts(b0.input_ids, b0.loss_mask, 128), 8)
    assert torch.equal(drafter.vocab.target_ids, want.target_ids) and drafter.vocab.source == "counts"
    for n, p in drafter.named_parameters():
        if n != "lm_head.weight":
            assert torch.equal(p, w0[n]), n  # no update
    # rows of tokens new to the mapping come from the (policy's) target head
    was = DraftVocab.first(8, 128).to_draft(want.target_ids)
    torch.testing.assert_close(drafter.lm_head.weight[was < 0], target.lm_head[want.target_ids[was < 0]])

    later = [_rollout(tiny_model_path, hf_target, [f"{a}{a}+{a}=" for a in range(s, s + 6)]) for s in (1, 7)]
    ms = []
    for step, data in zip((1, 2), later):
        trainer.begin_step(step)
        trainer.microbatch(*data)
        if step == 2:
            before_rows = drafter.lm_head.weight.detach().clone()
            before_vocab = drafter.vocab
            state_before = {k: v.clone() for k, v in trainer.optimizer.state[drafter.lm_head.weight].items()
                            if torch.is_tensor(v) and v.dim() == 2}
        ms.append(trainer.end_step())
    assert ms[0]["vocab_rebuilt"] == 0 and ms[1]["vocab_rebuilt"] == 1 and ms[1]["vocab_version"] == 2
    assert trainer.steps_done == 2
    counts = sum(token_counts(to_draft_batch(*d)[0].input_ids, to_draft_batch(*d)[0].loss_mask, 128) for d in later)
    new = drafter.vocab
    assert torch.equal(new.target_ids, DraftVocab.from_counts(counts, 8).target_ids)
    assert not new.same_tokens(before_vocab)
    src = before_vocab.to_draft(new.target_ids)
    kept = src >= 0
    assert bool(kept.any()) and not bool(kept.all())
    # the step-2 update happened before the rebuild: kept rows moved with their tokens, moments too
    after_update = drafter.lm_head.weight
    st = trainer.optimizer.state[after_update]
    for key in state_before:
        assert torch.all(st[key][~kept] == 0), key  # new tokens' moments start from zero
    assert bool((st["exp_avg_sq"][kept].abs().sum(-1) > 0).any())
    # a kept token's row moved with it: its row before the rebuild's update differs only by that update
    torch.testing.assert_close(after_update[kept], before_rows[src[kept]], atol=0.6, rtol=0)
    # checkpoint: the mapping, its counts and the rows come back exactly
    state = trainer.state_dict()
    fresh = OnlineDraftTrainer(build_drafter("eagle3", cfg.settings, target, seed=1), cfg, total_steps=10, seed=0)
    fresh.load_state_dict(state)
    assert fresh.drafter.vocab.same_tokens(new) and fresh.drafter.vocab.version == 2
    assert fresh.vocab_steps == trainer.vocab_steps == 0
    for name, w in trainer.drafter.vllm_state_dict().items():
        assert torch.equal(fresh.drafter.vllm_state_dict()[name], w), name
