"""SpecOPD (cotrain.draft.specopd): on-policy branches and their tree-masked target scoring.

References are independent of the code under test: plain Hugging Face forwards of the target on
each branch's own prefix (no tree mask, no custom attention, positions 0..n-1), and the drafter's
own teacher-forced training forward run step by step on sequences that end with the branch."""

import math

import pytest
import torch

from _specopd_cp import LENS, SETTINGS, ks_statistic, make_batch, make_drafter, randomised_pit
from cotrain.draft import specopd
from cotrain.draft.common import DraftBatch

KINDS = list(SETTINGS)


@pytest.fixture(scope="module")
def model(hf_target):
    return hf_target[0]


def _seq_of(cu, a):
    return int(torch.searchsorted(cu, torch.tensor(a), right=True)) - 1


@torch.no_grad()
def _plain_last_logits(model, seqs):
    """Last-position logits of a plain HF forward of each token list (one call per length)."""
    out = [None] * len(seqs)
    by_len = {}
    for i, s in enumerate(seqs):
        by_len.setdefault(len(s), []).append(i)
    for n, idx in by_len.items():
        ids = torch.stack([seqs[i] for i in idx])
        logits = model(input_ids=ids).logits[:, -1]
        for r, i in enumerate(idx):
            out[i] = logits[r]
    return torch.stack(out)


def _check_against_plain_forward(model, ids, cu, anchors, tokens, stem_index, stem_logits, branch_logits):
    W = tokens.shape[1]
    # stem rows: plain forward of each whole sequence
    with torch.no_grad():
        for s in range(cu.numel() - 1):
            ref = model(input_ids=ids[cu[s]:cu[s + 1]][None]).logits[0]
            rows = ((stem_index >= cu[s]) & (stem_index < cu[s + 1])).nonzero().squeeze(1)
            torch.testing.assert_close(stem_logits[rows], ref[stem_index[rows] - cu[s]], atol=1e-4, rtol=1e-4)
    # branch token j (1-based, j <= W-1): plain forward of stem[:a+1] + y_1..y_j
    seqs = [torch.cat([ids[cu[_seq_of(cu, a)]:a + 1], tokens[b, :j]])
            for b, a in enumerate(anchors.tolist()) for j in range(1, W)]
    ref = _plain_last_logits(model, seqs)
    assert branch_logits.shape == ref.shape
    torch.testing.assert_close(branch_logits, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_tree_forward_equals_plain_forward_on_every_branch_prefix(model, target, kind, one_thread):
    d = make_drafter(kind, target)
    batch = make_batch(model, d)
    ids, cu = batch.input_ids, batch.cu_seqlens
    # seeded anchors plus the revealing ones: a sequence's first and last positions (the branch then
    # runs past the stem's end), and neighbours in one sequence
    seeded = d.build_layout(batch, torch.Generator().manual_seed(1)).anchors
    extra = torch.tensor([0, int(cu[1]) - 1, int(cu[2]), int(cu[2]) + 1, int(cu[3]) - 1])
    anchors = torch.unique(torch.cat([seeded, extra]))
    layout = d.build_layout(batch, anchors=anchors)
    br = specopd.sample_branches(d, batch, layout, torch.Generator().manual_seed(2))
    assert br.tokens.shape == (anchors.numel(), d.draft_width)
    sc = specopd.tree_target_logits(model, ids, cu, br)
    assert torch.equal(sc.stem_index, torch.arange(batch.num_tokens))
    _check_against_plain_forward(model, ids, cu, br.anchors, br.tokens, sc.stem_index, sc.stem_logits,
                                 sc.branch_logits)
    # and p: p_1 from the anchor's stem row, p_j from branch token j-1
    p = specopd.branch_target_probs(sc, br)
    assert p.shape == (anchors.numel(), d.draft_width, model.config.vocab_size)
    torch.testing.assert_close(p[:, 0], torch.softmax(batch.target_logits[br.anchors], -1), atol=1e-5, rtol=1e-4)
    W = d.draft_width
    torch.testing.assert_close(p[:, 1:], torch.softmax(sc.branch_logits.view(-1, W - 1, p.shape[-1]), -1))


def test_tree_forward_puts_the_branch_at_its_semantic_position(model, target, one_thread):
    # the same branch tokens at two anchors of equal content but different positions must be
    # scored differently (RoPE by position), and equal to the plain forward at each
    d = make_drafter("dflash", target)
    ids = torch.tensor([5, 9, 5, 9, 5, 9, 5, 9, 11, 12], dtype=torch.int64)
    cu = torch.tensor([0, ids.numel()])
    batch = DraftBatch(ids, cu, torch.zeros(ids.numel(), d.num_taps * d.target_arch.hidden_size))
    layout = d.build_layout(batch, anchors=torch.tensor([1, 5]))
    tok = torch.tensor([[7, 8, 21], [7, 8, 21]])
    br = specopd.sample_branches(d, batch, layout, tokens=tok)
    sc = specopd.tree_target_logits(model, ids, cu, br)
    _check_against_plain_forward(model, ids, cu, br.anchors, br.tokens, sc.stem_index, sc.stem_logits,
                                 sc.branch_logits)
    assert (sc.branch_logits[0] - sc.branch_logits[2]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_branches_are_reproducible_from_the_seed(model, target, kind, one_thread):
    d = make_drafter(kind, target)
    batch = make_batch(model, d)

    def draw(anchor_seed, sample_seed):
        layout = d.build_layout(batch, torch.Generator().manual_seed(anchor_seed))
        return specopd.sample_branches(d, batch, layout, torch.Generator().manual_seed(sample_seed))

    a, b = draw(1, 2), draw(1, 2)
    assert torch.equal(a.anchors, b.anchors) and torch.equal(a.tokens, b.tokens)
    assert not torch.equal(draw(1, 3).tokens, a.tokens)
    assert not torch.equal(draw(4, 2).anchors, a.anchors)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_branch_logits_are_the_drafters_own_conditionals_step_by_step(model, target, kind, temperature, one_thread):
    """Reference: for step i, the drafter's ordinary (teacher-forced) forward on sequences
    stem[:a+1] + y_1..y_i, one per anchor; its draft i+1 must equal the branch's logits at i+1,
    and at temperature 0 the branch token is that draft's argmax."""
    d = make_drafter(kind, target)
    batch = make_batch(model, d)
    layout = d.build_layout(batch, torch.Generator().manual_seed(1))
    br = specopd.sample_branches(d, batch, layout, torch.Generator().manual_seed(2), temperature=temperature)
    cu, H = batch.cu_seqlens, batch.taps.shape[1]
    W = br.width
    with torch.no_grad():
        for i in range(W):
            seqs, taps, anchors = [], [], []
            for b, a in enumerate(br.anchors.tolist()):
                s0 = int(cu[_seq_of(cu, a)])
                seq = torch.cat([batch.input_ids[s0:a + 1], br.tokens[b, :i]])
                # taps after the anchor are never read by the block (context strictly before a)
                tp = torch.cat([batch.taps[s0:a + 1], torch.randn(i, H)])
                anchors.append(sum(len(x) for x in seqs) + a - s0)
                seqs.append(seq)
                taps.append(tp)
            lens = torch.tensor([len(x) for x in seqs])
            step = DraftBatch(torch.cat(seqs), torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)]),
                              torch.cat(taps))
            out = d(step, d.build_layout(step, anchors=torch.tensor(anchors)))
            torch.testing.assert_close(br.logits[:, i].detach(), out.logits[:, i], atol=2e-5, rtol=1e-5)
            if temperature == 0:
                assert torch.equal(br.tokens[:, i], out.logits[:, i].argmax(-1))


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_tokens_follow_the_drafter_distribution(model, target, kind, one_thread):
    """Randomised probability integral transform of every draw against softmax(logits / T) of the
    position it was drawn at (which the step-by-step test ties to the drafter's conditionals):
    uniform under the right distribution whatever it is (KS, alpha = 0.001); the same draws against
    a wrong temperature are rejected, so the test has power."""
    d = make_drafter(kind, target)
    lens = tuple([24] * 24)
    batch = make_batch(model, d, lens=lens, seed=5)
    layout = d.build_layout(batch, all_anchors=True)
    T = 0.8
    br = specopd.sample_branches(d, batch, layout, torch.Generator().manual_seed(7), temperature=T)

    def pit(temp):
        return randomised_pit(br.logits, br.tokens, temp)

    n = br.tokens.numel()
    assert n > 1000
    crit = 1.95 / math.sqrt(n)
    assert ks_statistic(pit(T)) < crit
    assert ks_statistic(pit(2.0 * T)) > crit and ks_statistic(pit(0.5 * T)) > crit


@pytest.mark.parametrize("kind", KINDS)
def test_specopd_loss_is_e2e_tv_on_the_branches_with_fixed_tokens_and_targets(model, target, kind, one_thread):
    d = make_drafter(kind, target).train()
    batch = make_batch(model, d)
    layout = d.build_layout(batch, torch.Generator().manual_seed(1))
    loss, metrics, br = specopd.specopd_step(d, model, batch, layout=layout, generator=torch.Generator().manual_seed(2))
    # by hand from the branch logits and the plain-forward target distributions
    ids, cu = batch.input_ids, batch.cu_seqlens
    W = br.width
    seqs = [torch.cat([ids[cu[_seq_of(cu, a)]:a + 1], br.tokens[b, :j]])
            for b, a in enumerate(br.anchors.tolist()) for j in range(W)]
    p = torch.softmax(_plain_last_logits(model, seqs).view(br.tokens.shape[0], W, -1), -1)
    q = torch.softmax(br.logits.detach().float(), -1)
    survival = torch.cumprod(torch.minimum(p, q).sum(-1), 1)
    w = torch.tensor([math.exp(-j / d.cfg.loss_gamma) for j in range(W)]) if d.cfg.loss_gamma else torch.ones(W)
    expected = -(survival * w).sum() / (w.sum() * survival.shape[0])
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-4)
    assert metrics["branches"] == br.tokens.shape[0] and metrics["branch_tokens_scored"] == br.tokens.shape[0] * (W - 1)
    # gradients reach the drafter (its backbone; for DSpark the Markov head through the sampled tokens)
    loss.backward()
    grads = {n: p.grad for n, p in d.named_parameters()}
    assert float(grads["layers.0.self_attn.q_proj.weight"].abs().sum()) > 0
    if kind == "dspark":
        assert float(grads["markov_head.markov_w1.weight"][br.tokens[:, :-1].reshape(-1)].abs().sum()) > 0
    # re-scoring the same tokens gives the same logits: the tokens, not the draws, are the data
    again = specopd.sample_branches(d, batch, layout, tokens=br.tokens)
    torch.testing.assert_close(again.logits, br.logits)


def test_positions_after_a_sampled_eos_are_invalid(model, target, one_thread):
    d = make_drafter("dflash", target)
    batch = make_batch(model, d)
    layout = d.build_layout(batch, torch.Generator().manual_seed(1))
    br = specopd.sample_branches(d, batch, layout, torch.Generator().manual_seed(2))
    eos = int(br.tokens[0, 0])
    br2 = specopd.sample_branches(d, batch, layout, tokens=br.tokens, eos_token_id=eos)
    hit = br.tokens == eos
    first = torch.where(hit.any(1), hit.int().argmax(1), torch.full((hit.shape[0],), br.width))
    expected = torch.arange(br.width)[None, :] <= first[:, None]
    assert torch.equal(br2.valid, expected)
    assert not bool(br2.valid[0, 1:].any())


@pytest.mark.slow
def test_cp2_tree_forward_equals_plain_forward(tiny_model_path, model, one_thread):
    """CP = 2 over gloo: each rank scores its zigzag stem shard and the branches whose anchors it
    holds (drafted there too); every row equals the plain HF forward."""
    import _cp_draft
    import _specopd_cp

    ranks = _cp_draft.run_world(_specopd_cp.rank_fn, 2, str(tiny_model_path))
    for kind in SETTINGS:
        all_anchors = ranks[0][kind]["layout_anchors"]
        got = torch.cat([r[kind]["anchors"] for r in ranks])
        assert torch.equal(torch.sort(got).values, all_anchors), kind  # every branch once, on its owner
        assert all(r[kind]["anchors"].numel() > 0 for r in ranks), kind
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(LENS), 0)])
        ids = torch.randint(4, 100, (sum(LENS),), generator=torch.Generator().manual_seed(0))
        seen = torch.cat([r[kind]["stem_index"] for r in ranks])
        assert torch.equal(torch.sort(seen[seen >= 0]).values, torch.arange(sum(LENS))), kind
        for r in ranks:
            x = r[kind]
            keep = x["stem_index"] >= 0
            _check_against_plain_forward(model, ids, cu, x["anchors"], x["tokens"], x["stem_index"][keep],
                                         x["stem_logits"][keep], x["branch_logits"])


def test_distill_on_policy_branches(model, target, one_thread):
    """draft.branches: on_policy in the distill command (every kind; EAGLE-3's run is in
    test_specopd_eagle3.py); a train step runs SpecOPD (branches scored by the target) and moves the
    drafter."""
    from cotrain.config.distill import load_distill_config
    from cotrain.draft.distill import train_step
    from cotrain.draft.optim import make_optimizer

    cfg = load_distill_config(None, ["draft.kind=dflash", "draft.branches=on_policy", "draft.loss=e2e_tv"])
    assert cfg.draft.branches == "on_policy"
    assert load_distill_config(None, ["draft.kind=eagle3", "draft.branches=on_policy"]).draft.branches == "on_policy"
    d = make_drafter("dflash", target).train()
    batch = make_batch(model, d)
    opt = make_optimizer(d, cfg.draft.optimizer)
    before = {n: p.detach().clone() for n, p in d.named_parameters()}
    m = train_step(d, batch, "e2e_tv", opt, 1.0, torch.Generator().manual_seed(0), branches="on_policy",
                   target_model=model)
    assert m["branches"] > 0 and m["branch_tokens_scored"] == m["branches"] * (d.draft_width - 1)
    assert any(not torch.equal(before[n], p) for n, p in d.named_parameters())
