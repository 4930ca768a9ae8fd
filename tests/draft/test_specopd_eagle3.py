"""SpecOPD on-policy branches for EAGLE-3 (cotrain.draft.specopd, Eagle3Drafter's ``next_tokens`` hook).

The chain at anchor p has bonus x_{p+1}; pass 0 predicts draft 1, pass t >= 1 reads y_t (the token
drawn from pass t-1's logits) and predicts draft t+1. References are independent of the code under
test: the drafter's ordinary teacher-forced forward on sequences stem[:p+2] + y_1..y_{k-1} (its
pass t then reads y_t from the data), and plain Hugging Face forwards of the target on
stem[:p+2] + y_1..y_{j-1}."""

import math

import pytest
import torch

from _specopd_cp import ks_statistic, make_batch, randomised_pit
from cotrain.draft import specopd
from cotrain.draft.common import DraftBatch
from cotrain.draft.registry import build_drafter
from cotrain.draft.vocab import DraftVocab, token_counts

K = 3  # ttt_steps: the branch width
VOCAB = 48  # the reduced draft vocabulary's size (the tiny target has 128 tokens)


@pytest.fixture(scope="module")
def model(hf_target):
    return hf_target[0]


def make_eagle3(target, batch_of=None, reduced=False, seed=3, sharpen=1.0):
    """An EAGLE-3 drafter (k = 3); ``reduced``: a 48-token draft vocabulary built from the counts of
    ``batch_of(drafter)``'s supervised tokens (so that the reference tokens are mostly draft tokens).
    ``sharpen``: its LM head scaled by this (a freshly built drafter's distributions are nearly flat,
    entropy 4.65 of 4.85 nats, where a wrong sampling temperature hardly shows)."""
    settings = {"ttt_steps": K, **({"draft_vocab_size": VOCAB} if reduced else {})}
    d = build_drafter("eagle3", settings, target, seed=seed).eval()
    with torch.no_grad():
        d.lm_head.weight.mul_(sharpen)
    if reduced:
        b = batch_of(d)
        d.set_vocab(DraftVocab.from_counts(token_counts(b.input_ids, b.loss_mask, d.vocab.vocab_size), VOCAB))
    return d


def _seq_start(cu, a):
    return int(cu[int(torch.searchsorted(cu, torch.tensor(a), right=True)) - 1])


def _reference_tokens(d, batch, anchors):
    """(NB, K): what the teacher-forced pass t reads at anchor p, x_{p+1+t} (pad past the
    sequence's end), in column t-1; the last column (y_K, read by no pass) likewise."""
    src = anchors[:, None] + 2 + torch.arange(K)[None, :]
    end = batch.seq_end()[anchors][:, None]
    return torch.where(src < end, batch.input_ids[src.clamp(max=batch.num_tokens - 1)],
                       torch.full_like(src, d.pad_token_id))


@torch.no_grad()
def _teacher_forced_on_branches(d, batch, br):
    """(NB, K, Vd) the drafter's ordinary forward on one sequence per branch, stem[:p+2] + y_1..y_{K-1}
    (taps after p random: the chain at p never reads them), at that sequence's anchor p."""
    cu, H = batch.cu_seqlens, batch.taps.shape[1]
    seqs, taps, anchors = [], [], []
    g = torch.Generator().manual_seed(99)
    for b, p in enumerate(br.anchors.tolist()):
        s0 = _seq_start(cu, p)
        seq = torch.cat([batch.input_ids[s0:p + 2], br.tokens[b, :K - 1]])
        taps.append(torch.cat([batch.taps[s0:p + 1], torch.randn(len(seq) - (p + 1 - s0), H, generator=g)]))
        anchors.append(sum(len(x) for x in seqs) + p - s0)
        seqs.append(seq)
    lens = torch.tensor([len(x) for x in seqs])
    step = DraftBatch(torch.cat(seqs), torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)]),
                      torch.cat(taps))
    out = d(step)
    chain = {int(bp) - 1: i for i, bp in enumerate(out.bonus_pos.tolist())}
    return out.logits[torch.tensor([chain[a] for a in anchors])]


@torch.no_grad()
def _plain_last_logits(model, seqs):
    """Last-position logits of a plain HF forward of each token list (one call per length)."""
    out, by_len = [None] * len(seqs), {}
    for i, s in enumerate(seqs):
        by_len.setdefault(len(s), []).append(i)
    for idx in by_len.values():
        logits = model(input_ids=torch.stack([seqs[i] for i in idx])).logits[:, -1]
        for r, i in enumerate(idx):
            out[i] = logits[r]
    return torch.stack(out)


def _plain_target_probs(model, batch, br):
    """(NB, K, V) p_j = softmax of a plain forward of stem[:p+2] + y_1..y_{j-1}, j = 1..K."""
    ids, cu = batch.input_ids, batch.cu_seqlens
    seqs = [torch.cat([ids[_seq_start(cu, p):p + 2], br.tokens[b, :j]])
            for b, p in enumerate(br.anchors.tolist()) for j in range(K)]
    return torch.softmax(_plain_last_logits(model, seqs).view(br.tokens.shape[0], K, -1), -1)


def test_on_policy_passes_fed_the_reference_tokens_are_the_teacher_forced_chains(model, target, one_thread):
    d = make_eagle3(target)
    batch = make_batch(model, d)
    layout = d.build_layout(batch)
    tf = d(batch, layout)
    anchors = tf.bonus_pos - 1
    br = specopd.sample_branches(d, batch, layout, tokens=_reference_tokens(d, batch, anchors))
    assert torch.equal(br.anchors, anchors) and torch.equal(br.bonus, batch.input_ids[anchors + 1])
    assert br.logits.shape == tf.logits.shape == (anchors.numel(), K, model.config.vocab_size)
    assert torch.equal(br.logits, tf.logits)  # the same operations: bit-identical
    # and the hook itself, called with pass t-1's logits before every pass t >= 1
    seen = []
    ref = _reference_tokens(d, batch, anchors)
    out = d(batch, layout, next_tokens=lambda t, logits: seen.append((t, logits.shape)) or ref[:, t - 1])
    assert torch.equal(out.logits, tf.logits)
    assert seen == [(t, (anchors.numel(), model.config.vocab_size)) for t in range(1, K)]


@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "draft_vocab"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_branch_logits_are_the_drafters_conditionals_on_its_own_draws(model, target, reduced, temperature,
                                                                     one_thread):
    """Draft j of a branch equals the teacher-forced forward on stem[:p+2] + y_1..y_{j-1} (pass t
    then reads y_t from the data), so later passes read the earlier draws; at T = 0 every draw is
    its pass's argmax, mapped to a target id under a reduced vocabulary."""
    d = make_eagle3(target, lambda d: make_batch(model, d), reduced)
    batch = make_batch(model, d)
    br = specopd.sample_branches(d, batch, d.build_layout(batch), torch.Generator().manual_seed(2),
                                 temperature=temperature)
    Vd = VOCAB if reduced else model.config.vocab_size
    assert br.tokens.shape == (br.anchors.numel(), K) and br.logits.shape[-1] == Vd
    torch.testing.assert_close(br.logits.detach(), _teacher_forced_on_branches(d, batch, br), atol=2e-5, rtol=1e-5)
    drafted = br.logits.argmax(-1)
    if reduced:
        assert br.vocab is d.vocab and bool(d.vocab.contains(br.tokens).all())
        drafted = d.vocab.to_target(drafted)
    if temperature == 0:
        assert torch.equal(br.tokens, drafted)
    else:  # the draws differ from the reference tokens somewhere after pass 1 (else the test is vacuous)
        assert not torch.equal(br.tokens[:, :K - 1], _reference_tokens(d, batch, br.anchors)[:, :K - 1])


def test_later_passes_depend_on_the_earlier_draws(model, target, one_thread):
    d = make_eagle3(target)
    batch = make_batch(model, d)
    layout = d.build_layout(batch)
    br = specopd.sample_branches(d, batch, layout, torch.Generator().manual_seed(2))
    y = br.tokens.clone()
    y[:, 0] = (y[:, 0] + 1) % model.config.vocab_size  # change y_1 only
    again = specopd.sample_branches(d, batch, layout, tokens=y)
    assert torch.equal(again.logits[:, 0], br.logits[:, 0])  # draft 1 reads no draw
    assert bool(((again.logits[:, 1] - br.logits[:, 1]).abs().amax(-1) > 1e-4).all())  # pass 2 reads y_1
    y2 = br.tokens.clone()
    y2[:, 1] = (y2[:, 1] + 1) % model.config.vocab_size  # change y_2 only: pass 3 moves, not pass 2
    again = specopd.sample_branches(d, batch, layout, tokens=y2)
    assert torch.equal(again.logits[:, :2], br.logits[:, :2])
    assert bool(((again.logits[:, 2] - br.logits[:, 2]).abs().amax(-1) > 1e-4).all())


def test_sampled_tokens_follow_the_drafter_distribution(model, target, one_thread):
    """Randomised probability integral transform of every draw against softmax(logits / T) of its
    pass (which the conditionals test ties to the drafter's distribution given the earlier draws):
    uniform (KS, alpha = 0.001); the same draws against T/1.25, 1.25 T, T/2 and 2T are rejected
    (8448 draws: 3x the critical value at 1.25 T)."""
    d = make_eagle3(target, sharpen=3.0)
    batch = make_batch(model, d, lens=tuple([24] * 128), seed=5)
    T = 0.8
    br = specopd.sample_branches(d, batch, d.build_layout(batch), torch.Generator().manual_seed(7), temperature=T)

    def pit(temp):
        return randomised_pit(br.logits, br.tokens, temp)

    n = br.tokens.numel()
    assert n > 8000
    crit = 1.95 / math.sqrt(n)
    assert ks_statistic(pit(T)) < crit
    for wrong in (1.25, 1 / 1.25, 2.0, 0.5):
        assert ks_statistic(pit(wrong * T)) > crit, wrong
    # inverse-CDF draws at given uniforms (the online path's rank-independent draws): reproducible
    u = torch.rand(br.tokens.shape, generator=torch.Generator().manual_seed(9))
    a = specopd.sample_branches(d, batch, d.build_layout(batch), temperature=T, uniforms=u)
    b = specopd.sample_branches(d, batch, d.build_layout(batch), temperature=T, uniforms=u)
    assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "draft_vocab"])
def test_target_branch_distributions_are_plain_forwards(model, target, reduced, one_thread):
    """p_j = the target at the branch's token j-1 (x_{p+1}, y_1, ..) = a plain forward of
    stem[:p+2] + y_1..y_{j-1}, for every branch and j (branches that run past the stem included);
    the stem rows are the plain forward's; every branch is scored whole (K tokens, bonus first)."""
    d = make_eagle3(target, lambda d: make_batch(model, d), reduced)
    batch = make_batch(model, d)
    br = specopd.sample_branches(d, batch, d.build_layout(batch), torch.Generator().manual_seed(2))
    end = batch.seq_end()[br.anchors]
    assert bool((br.anchors + 1 + K > end).any())  # some branches run past their sequence's end
    with torch.no_grad():
        sc = specopd.tree_target_logits(model, batch.input_ids, batch.cu_seqlens, br)
    NB = br.anchors.numel()
    assert sc.branch_logits.shape == (NB * K, model.config.vocab_size)
    assert torch.equal(sc.layout.anchors, br.anchors) and bool((sc.layout.branch_lens == K).all())
    torch.testing.assert_close(sc.stem_logits, batch.target_logits, atol=1e-4, rtol=1e-4)
    p = specopd.branch_target_probs(sc, br)
    torch.testing.assert_close(p, _plain_target_probs(model, batch, br), atol=1e-5, rtol=1e-4)
    # p_1 is also the stem's own row of the bonus token (the teacher-forced target of draft 1)
    torch.testing.assert_close(p[:, 0], torch.softmax(batch.target_logits[br.anchors + 1], -1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "draft_vocab"])
def test_specopd_step_is_e2e_tv_and_trains_fc_and_layers(model, target, reduced, one_thread):
    d = make_eagle3(target, lambda d: make_batch(model, d), reduced).train()
    batch = make_batch(model, d)
    loss, metrics, br = specopd.specopd_step(d, model, batch, torch.Generator().manual_seed(2))
    assert bool(torch.isfinite(loss))
    assert metrics["branches"] == br.anchors.numel() and metrics["branch_tokens_scored"] == br.anchors.numel() * K
    # by hand: p from plain forwards, restricted (not renormalised) to the draft tokens under a
    # reduced vocabulary; q the branch logits; uniform weights (EAGLE-3 has no position decay)
    p = _plain_target_probs(model, batch, br)
    if reduced:
        p = p[..., d.vocab.target_ids]
    q = torch.softmax(br.logits.detach().float(), -1)
    expected = -torch.cumprod(torch.minimum(p, q).sum(-1), 1).mean()
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-4)
    loss.backward()
    grads = dict((n, q.grad) for n, q in d.named_parameters())
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight", "lm_head.weight"):
        assert grads[name] is not None and float(grads[name].abs().sum()) > 0, name
    # hard_ce on the branches: labels are target ids, the loss maps them to draft ids
    hard, _ = specopd.specopd_loss(br, p if not reduced else _plain_target_probs(model, batch, br), "hard_ce")
    lab = br.tokens if not reduced else d.vocab.to_draft(br.tokens)
    expected = -torch.log_softmax(br.logits.detach().float(), -1).gather(-1, lab[..., None]).mean()
    torch.testing.assert_close(hard.detach(), expected, atol=1e-5, rtol=1e-4)


def test_positions_after_a_sampled_eos_are_invalid(model, target, one_thread):
    d = make_eagle3(target)
    batch = make_batch(model, d)
    layout = d.build_layout(batch)
    br = specopd.sample_branches(d, batch, layout, torch.Generator().manual_seed(2))
    eos = int(br.tokens[0, 0])
    br2 = specopd.sample_branches(d, batch, layout, tokens=br.tokens, eos_token_id=eos)
    hit = br.tokens == eos
    first = torch.where(hit.any(1), hit.int().argmax(1), torch.full((hit.shape[0],), K))
    assert torch.equal(br2.valid, torch.arange(K)[None, :] <= first[:, None])
    assert not bool(br2.valid[0, 1:].any())


def test_offline_distillation_with_on_policy_eagle3_branches(tmp_path, one_thread):
    from cotrain.config.distill import load_distill_config
    from cotrain.draft.distill import distill

    cfg = load_distill_config(None, [
        "draft.kind=eagle3", "draft.branches=on_policy", "draft.loss=e2e_tv", f"draft.eagle3.ttt_steps={K}",
        f"draft.eagle3.draft_vocab_size={VOCAB}", "train.steps=3", "train.batch_size=4", "train.eval_every=0",
        "data.num_prompts=8", "data.eval_prompts=4", "data.max_new_tokens=8", "data.tail_tokens=3",
        f"output_dir={tmp_path}", "progress_bar=false"])
    summary = distill(cfg)
    assert summary["kind"] == "eagle3" and summary["steps"] == 3 and summary["loss"] == "e2e_tv"
    assert summary["draft_vocab"]["size"] == VOCAB
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] < 0  # -E2E-TV


@pytest.mark.slow
def test_cp2_eagle3_branches_equal_cp1(tiny_model_path, model, target, one_thread):
    """CP = 2 over gloo: every chain anchor is drafted and scored on one rank (the anchor's owner,
    both ranks own some); with the same per-anchor uniforms the tokens equal CP = 1's, the drafter's
    logits and the target's p equal CP = 1's, and the weighted losses and gradients summed over the
    ranks equal CP = 1's."""
    import _cp_draft
    import _specopd_cp

    ranks = _cp_draft.run_world(_specopd_cp.eagle3_rank_fn, 2, str(tiny_model_path), K)
    d = build_drafter("eagle3", {"ttt_steps": K}, target, seed=3).train()
    batch = make_batch(model, d)
    layout = d.build_layout(batch)
    u = torch.rand(batch.num_tokens, K, generator=torch.Generator().manual_seed(5))[layout.anchors]
    br = specopd.sample_branches(d, batch, layout, temperature=1.0, uniforms=u)
    with torch.no_grad():
        p = specopd.branch_target_probs(specopd.tree_target_logits(model, batch.input_ids, batch.cu_seqlens, br), br)
    loss, m = specopd.specopd_loss(br, p)
    (loss * m["weight"]).backward()
    assert all(r["anchors"].numel() > 0 for r in ranks)
    # some bonus token x_{p+1} lies on the other rank's stem shard: scored in the branch, p_1 stays local
    assert any(not bool(torch.isin(r["anchors"] + 1, r["stem_index"]).all()) for r in ranks)
    got = torch.cat([r["anchors"] for r in ranks])
    order = torch.argsort(got)
    assert torch.equal(got[order], br.anchors)  # every branch once
    cat = lambda key: torch.cat([r[key] for r in ranks])[order]  # noqa: E731
    assert torch.equal(cat("tokens"), br.tokens)
    torch.testing.assert_close(cat("draft_logits"), br.logits.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(cat("p"), p, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(sum(r["loss_sum"] for r in ranks), (loss * m["weight"]).detach(), atol=1e-5, rtol=1e-5)
    for n, q in d.named_parameters():
        if q.grad is not None:
            torch.testing.assert_close(sum(r["grads"][n] for r in ranks), q.grad, atol=1e-5, rtol=1e-4, msg=n)
