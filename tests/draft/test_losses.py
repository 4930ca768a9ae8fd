"""Drafter losses against hand-computed values and gradients."""

import math

import pytest
import torch

from cotrain.draft.common import DraftOutput
from cotrain.draft.losses import draft_loss, dspark_l1, e2e_tv, forward_kl, hard_ce, overlap, soft_ce


def chains(logits, valid=None, weight=None, confidence=None):
    logits = torch.as_tensor(logits, dtype=torch.float32).clone().requires_grad_(True)
    N, W, _ = logits.shape
    valid = torch.ones(N, W, dtype=torch.bool) if valid is None else torch.as_tensor(valid)
    rows = torch.arange(N * W).view(N, W)
    return DraftOutput(logits=logits, bonus_pos=torch.arange(N), target_rows=rows, valid=valid,
                       confidence=confidence, loss_weight=weight)


def test_e2e_tv_value_and_gradient_by_hand():
    # one chain, two drafts, vocabulary of 2:
    #   q0 = softmax(0, 0) = (.5, .5),   p0 = (.7, .3)  ->  a0 = min(.7,.5) + min(.3,.5) = .8
    #   q1 = softmax(ln 3, 0) = (.75, .25), p1 = (.2, .8)  ->  a1 = .2 + .25 = .45
    #   L = -(S0 + S1) / 2 = -(.8 + .8 * .45) / 2 = -.58
    p = torch.tensor([[[0.7, 0.3], [0.2, 0.8]]])
    out = chains([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    loss = e2e_tv(out.logits, p, out.valid)
    assert loss.item() == pytest.approx(-0.58, abs=1e-6)
    loss.backward()
    # da0/dq0 = (1, 0) (q0 < p0 only in token 0); dq/dz = diag(q) - q q^T -> da0/dz0 = (.25, -.25)
    # dL/dz0 = -(1 + a1)/2 * da0/dz0 = -.725 * (.25, -.25)
    # da1/dq1 = (0, 1) -> da1/dz1 = (.75 * -.25, .25 * .75) = (-.1875, .1875); dL/dz1 = -a0/2 * that
    expected = torch.tensor([[[-0.18125, 0.18125], [0.075, -0.075]]])
    torch.testing.assert_close(out.logits.grad, expected, atol=1e-6, rtol=0)


def test_e2e_tv_masking_and_weights():
    p = torch.tensor([[[0.7, 0.3], [0.2, 0.8], [0.5, 0.5]]])
    z = [[[0.0, 0.0], [math.log(3.0), 0.0], [0.0, 5.0]]]
    # an invalid middle position neither counts nor breaks the chain: S = (.8, -, .8 * a2)
    out = chains(z, valid=[[True, False, True]])
    q2 = torch.softmax(torch.tensor([0.0, 5.0]), 0)
    a2 = torch.minimum(p[0, 2], q2).sum().item()
    assert e2e_tv(out.logits, p, out.valid).item() == pytest.approx(-(0.8 + 0.8 * a2) / 2, abs=1e-6)
    # position weights w_j: L = -sum w_j S_j / sum w_j
    w = torch.tensor([1.0, 0.5, 0.25])
    out = chains(z, weight=w)
    S = [0.8, 0.8 * 0.45, 0.8 * 0.45 * a2]
    assert e2e_tv(out.logits, p, out.valid, w).item() == pytest.approx(-(S[0] + 0.5 * S[1] + 0.25 * S[2]) / 1.75,
                                                                      abs=1e-6)


def test_e2e_tv_target_gets_no_gradient():
    p = torch.tensor([[[0.7, 0.3], [0.2, 0.8]]], requires_grad=True)
    out = chains([[[0.0, 0.0], [1.0, 0.0]]])
    e2e_tv(out.logits, p, out.valid).backward()
    assert p.grad is None and out.logits.grad is not None


def test_soft_ce_forward_kl_hard_ce_by_hand():
    p = torch.tensor([[[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]]])
    z = [[[0.0, 0.0, 0.0], [math.log(2.0), 0.0, 0.0]]]  # q0 = (1/3, 1/3, 1/3), q1 = (.5, .25, .25)
    out = chains(z)
    ce = soft_ce(out.logits, p, out.valid)
    ce0 = math.log(3.0)  # -sum p log(1/3)
    ce1 = -math.log(0.5)
    assert ce.item() == pytest.approx((ce0 + ce1) / 2, abs=1e-6)
    ce.backward()
    q = torch.softmax(torch.tensor(z[0]), -1)
    torch.testing.assert_close(out.logits.grad[0], (q - p[0]) / 2, atol=1e-6, rtol=0)  # d CE / dz = q - p

    out = chains(z)
    kl = forward_kl(out.logits, p, out.valid)
    h0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))  # entropy of p0 (p1 is one-hot: 0)
    assert kl.item() == pytest.approx((ce0 - h0 + ce1) / 2, abs=1e-6)
    out_same = chains(torch.log(torch.tensor([[[0.5, 0.25, 0.25]]])))
    assert forward_kl(out_same.logits, p[:, :1], out_same.valid).item() == pytest.approx(0.0, abs=1e-6)

    out = chains(z)
    labels = torch.tensor([[2, 0]])
    assert hard_ce(out.logits, labels, out.valid).item() == pytest.approx(
        (math.log(3.0) - math.log(0.5)) / 2, abs=1e-6)


def test_dspark_l1_with_confidence_head_by_hand():
    p = torch.tensor([[[1.0, 0.0]]])
    out = chains([[[0.0, 0.0]]], confidence=torch.zeros(1, 1, requires_grad=True))  # q = (.5, .5)
    loss, m = dspark_l1(out.logits, p, out.valid, confidence=out.confidence, l1_weight=2.0, confidence_weight=0.5)
    # CE = ln 2, L1 = |1 - .5| + |0 - .5| = 1, label = 1 - .5 * 1 = .5, BCE(sigmoid(0), .5) = ln 2
    assert m["ce"] == pytest.approx(math.log(2), abs=1e-6) and m["l1"] == pytest.approx(1.0, abs=1e-6)
    assert loss.item() == pytest.approx(math.log(2) + 2.0 * 1.0 + 0.5 * math.log(2), abs=1e-6)
    loss.backward()
    # d BCE / dc = sigmoid(c) - label = 0: the label is detached, the head only chases it
    assert out.confidence.grad.abs().max().item() == pytest.approx(0.0, abs=1e-7)
    # logits: d(CE)/dz = q - p = (-.5, .5); d(L1)/dz0: L1 = (1 - q0) + q1 = 2 - 2 q0, dq0/dz0 = .25 -> -.5
    torch.testing.assert_close(out.logits.grad, torch.tensor([[[-0.5 + 2 * -0.5, 0.5 + 2 * 0.5]]]), atol=1e-6, rtol=0)


def test_overlap_is_one_minus_tv():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 3, 7, generator=g), -1)
    z = torch.randn(5, 3, 7, generator=g)
    tv = 0.5 * (p - torch.softmax(z, -1)).abs().sum(-1)
    torch.testing.assert_close(overlap(z, p), 1 - tv, atol=1e-6, rtol=0)


def test_draft_loss_dispatch_and_errors():
    p = torch.softmax(torch.randn(2, 3, 5), -1)
    out = chains(torch.randn(2, 3, 5))
    for name in ("soft_ce", "forward_kl", "e2e_tv", "dspark_l1"):
        loss, m = draft_loss(name, out, p)
        assert torch.isfinite(loss) and 0 <= m["overlap"] <= 1
    with pytest.raises(ValueError, match="labels"):
        draft_loss("hard_ce", out, p)
    with pytest.raises(ValueError, match="unknown drafter loss"):
        draft_loss("reverse_kl", out, p)
    with pytest.raises(ValueError, match="do not match"):
        draft_loss("soft_ce", out, p[:, :2])
    # no valid position: a zero loss that still backpropagates
    empty = chains(torch.randn(1, 2, 5), valid=torch.zeros(1, 2, dtype=torch.bool))
    loss, _ = draft_loss("soft_ce", empty, p[:1, :2])
    loss.backward()
    assert loss.item() == 0.0


# ----- every loss through draft_loss against a hand computation ----------------------------------------
# two positions, vocabulary of 3:
#   z0 = (0, 0, 0)      -> q0 = (1/3, 1/3, 1/3);   p0 = (.5, .25, .25)
#   z1 = (ln 2, 0, 0)   -> q1 = (1/2, 1/4, 1/4);   p1 = (.7, .2, .1)
P = [[[0.5, 0.25, 0.25], [0.7, 0.2, 0.1]]]
Z = [[[0.0, 0.0, 0.0], [math.log(2.0), 0.0, 0.0]]]
LN2, LN3 = math.log(2.0), math.log(3.0)
CE = (LN3, 0.7 * LN2 + 0.3 * 2 * LN2)                           # -sum p log q
H = (1.5 * LN2, -(0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1)))  # entropy of p
L1 = (1 / 6 + 2 / 12, 0.2 + 0.05 + 0.15)                         # ||p - q||_1
A = (1 / 3 + 0.25 + 0.25, 0.5 + 0.2 + 0.1)                       # sum min(p, q)
HARD = (LN3, LN2)                                                # labels (2, 0): -log q0[2], -log q1[0]


def _wm(values, w):
    return sum(v * x for v, x in zip(values, w)) / sum(w)


def _hand(name, w):
    if name == "soft_ce":
        return _wm(CE, w)
    if name == "forward_kl":
        return _wm([c - h for c, h in zip(CE, H)], w)
    if name == "hard_ce":
        return _wm(HARD, w)
    if name == "dspark_l1":  # l1_weight 2
        return _wm(CE, w) + 2.0 * _wm(L1, w)
    if name == "e2e_tv":
        return -_wm([A[0], A[0] * A[1]], w)
    raise AssertionError(name)


@pytest.mark.parametrize("weight", [None, (1.0, 0.25)])
@pytest.mark.parametrize("name", ["soft_ce", "forward_kl", "hard_ce", "dspark_l1", "e2e_tv"])
def test_draft_loss_values_by_hand(name, weight):
    """draft_loss(name) computes *that* loss (the five values differ), with position weights, and the
    denominator it reports is the weight of the positions it counts."""
    w = torch.tensor(weight) if weight is not None else None
    out = chains(Z, weight=w)
    loss, m = draft_loss(name, out, torch.tensor(P), labels=torch.tensor([[2, 0]]), l1_weight=2.0)
    ww = weight or (1.0, 1.0)
    assert loss.item() == pytest.approx(_hand(name, ww), abs=1e-6)
    assert m["loss"] == pytest.approx(loss.item(), abs=1e-7)
    assert m["weight"] == pytest.approx(sum(ww))
    assert m["overlap"] == pytest.approx(sum(A) / 2, abs=1e-6)  # unweighted mean over valid positions
    assert m["top1_match"] == pytest.approx(1.0)  # argmax q = argmax p = token 0 at both positions
    loss.backward()
    assert out.logits.grad is not None and out.logits.grad.abs().sum() > 0


def test_hand_values_of_the_five_losses_are_distinct():
    vals = [_hand(n, (1.0, 1.0)) for n in ("soft_ce", "forward_kl", "hard_ce", "dspark_l1", "e2e_tv")]
    assert min(abs(a - b) for i, a in enumerate(vals) for b in vals[i + 1:]) > 0.05  # a dispatch mix-up shows


@pytest.mark.parametrize("name", ["soft_ce", "forward_kl", "hard_ce", "dspark_l1", "e2e_tv"])
def test_invalid_positions_do_not_count(name):
    out = chains(Z, valid=[[False, True]])
    loss, m = draft_loss(name, out, torch.tensor(P), labels=torch.tensor([[2, 0]]), l1_weight=2.0)
    if name == "e2e_tv":  # an invalid position does not break the chain: S1 = a1
        want = -A[1]
    else:
        want = {"soft_ce": CE[1], "forward_kl": CE[1] - H[1], "hard_ce": HARD[1], "dspark_l1": CE[1] + 2 * L1[1]}[name]
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert m["weight"] == pytest.approx(1.0)
    # hard_ce also drops positions without a label (-1)
    out = chains(Z)
    loss, m = draft_loss("hard_ce", out, torch.tensor(P), labels=torch.tensor([[-1, 0]]))
    assert loss.item() == pytest.approx(HARD[1], abs=1e-6) and m["weight"] == pytest.approx(1.0)


def _target():
    """A target distribution that is a function of a leaf: any gradient reaching it shows in theta.grad."""
    theta = torch.tensor(P).log().clone().requires_grad_(True)
    return theta, torch.softmax(theta, -1)


@pytest.mark.parametrize("fn", ["soft_ce", "forward_kl", "dspark_l1", "e2e_tv", "l1_distance", "overlap"])
def test_target_gets_no_gradient(fn):
    """Each loss detaches the target itself (not only draft_loss): the drafter chases the target, the
    target is never pulled towards the drafter."""
    from cotrain.draft import losses

    theta, p = _target()
    out = chains(Z, confidence=torch.zeros(1, 2, requires_grad=True))
    f = getattr(losses, fn)
    if fn in ("l1_distance", "overlap"):
        loss = f(out.logits, p).sum()
    elif fn == "dspark_l1":
        loss = f(out.logits, p, out.valid, confidence=out.confidence)[0]
    else:
        loss = f(out.logits, p, out.valid)
    loss.backward()
    assert theta.grad is None or theta.grad.abs().max().item() == 0.0, fn
    assert out.logits.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["soft_ce", "forward_kl", "dspark_l1", "e2e_tv"])
def test_draft_loss_target_gets_no_gradient(name):
    theta, p = _target()
    loss, _ = draft_loss(name, chains(Z), p)
    loss.backward()
    assert theta.grad is None or theta.grad.abs().max().item() == 0.0


def test_target_probs_are_detached_tempered_softmax_of_the_rows():
    from cotrain.draft.losses import target_probs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=g).requires_grad_(True)
    out = chains(torch.zeros(1, 2, 5))
    out.target_rows = torch.tensor([[4, -1]])  # -1: a position past the sequence (clamped to row 0)
    p = target_probs(logits, out, temperature=0.5)
    assert not p.requires_grad
    want = torch.stack([torch.exp(2 * logits[4]) / torch.exp(2 * logits[4]).sum(),
                        torch.exp(2 * logits[0]) / torch.exp(2 * logits[0]).sum()]).detach()[None]
    torch.testing.assert_close(p, want, atol=1e-6, rtol=1e-6)


def test_dspark_confidence_label_is_detached():
    """With c != 0 the BCE's derivative in its label is -c: a label left in the graph would push the
    drafter's logits. The logits' gradient is that of CE + L1 alone, whatever the confidence head says."""
    p = torch.tensor(P)
    conf = torch.tensor([[1.0, -2.0]], requires_grad=True)
    out = chains(Z, confidence=conf)
    loss, _ = dspark_l1(out.logits, p, out.valid, confidence=out.confidence, l1_weight=2.0, confidence_weight=1.0)
    loss.backward()
    ref = chains(Z)
    dspark_l1(ref.logits, p, ref.valid, l1_weight=2.0)[0].backward()
    torch.testing.assert_close(out.logits.grad, ref.logits.grad, atol=1e-7, rtol=0)
    # the head chases the label 1 - L1/2: d BCE / dc = (sigmoid(c) - label) / 2 positions
    label = torch.tensor([1 - L1[0] / 2, 1 - L1[1] / 2])
    torch.testing.assert_close(conf.grad[0], (torch.sigmoid(conf.detach()[0]) - label) / 2, atol=1e-6, rtol=0)


# ----- chunked on the device against the old full-tensor autograd (reference.draft_path) ----------
def _random_case(seed, N=5, W=3, V=37, vocab=None):
    from cotrain.draft.vocab import DraftVocab

    g = torch.Generator().manual_seed(seed)
    Vd = V if vocab is None else vocab
    logits = (3 * torch.randn(N, W, Vd, generator=g, dtype=torch.float64)).float()
    target_logits = 3 * torch.randn(11, V, generator=g)
    rows = torch.randint(0, 11, (N, W), generator=g)
    rows[0, 2] = -1  # a position past the sequence: clamped, invalid
    valid = torch.rand(N, W, generator=g) > 0.25
    valid[0, 2] = False
    labels = torch.randint(0, V, (N, W), generator=g)
    labels[1, 0] = -1
    conf = torch.randn(N, W, generator=g)
    dv = None if vocab is None else DraftVocab(torch.sort(torch.randperm(V, generator=g)[:vocab]).values, V)
    return logits, target_logits, rows, valid, labels, conf, dv


@pytest.mark.parametrize("vocab", [None, 13])
@pytest.mark.parametrize("name", ["soft_ce", "forward_kl", "hard_ce", "dspark_l1", "e2e_tv"])
def test_chunked_loss_equals_the_full_tensor_autograd(name, vocab):
    """Every loss, chunked over chains (chunks of 2 chains of 5, the last one short) and with the
    target rows gathered chunk by chunk from the target logits (temperature 0.7), equals the old
    implementation on full (N, W, V) tensors (plain autograd): value, every metric, and the gradients
    of the logits and the confidence head; one chunk gives the same."""
    from reference import draft_path
    from cotrain.draft.losses import target_dist

    logits, tl, rows, valid, labels, conf, dv = _random_case(7, vocab=vocab)
    w = torch.tensor([1.0, 0.6, 0.3])

    def run(impl, **kw):
        z = logits.clone().requires_grad_(True)
        c = conf.clone().requires_grad_(True)
        out = DraftOutput(logits=z, bonus_pos=torch.arange(5), target_rows=rows, valid=valid, loss_weight=w,
                          confidence=c if name == "dspark_l1" else None)
        p = target_dist(tl, out, 0.7) if impl is draft_loss else torch.softmax(tl[rows.clamp(min=0)] / 0.7, -1)
        loss, m = impl(name, out, p, labels=labels, l1_weight=0.5, confidence_weight=2.0, vocab=dv, **kw)
        loss.backward()
        return loss, {k: float(v) for k, v in m.items()}, z.grad, c.grad

    ref = run(draft_path.draft_loss)
    for kw in ({"chunk_elements": 2 * 3 * 37}, {}):
        got = run(draft_loss, **kw)
        torch.testing.assert_close(got[0], ref[0], atol=1e-6, rtol=1e-6)
        assert got[1].keys() == ref[1].keys()
        for key in ref[1]:
            assert got[1][key] == pytest.approx(ref[1][key], abs=1e-6), key
        torch.testing.assert_close(got[2], ref[2], atol=1e-6, rtol=1e-5)
        if name == "dspark_l1":
            torch.testing.assert_close(got[3], ref[3], atol=1e-6, rtol=1e-5)
    assert ref[2].abs().sum() > 0


def test_chunk_boundaries_cover_every_position_once():
    """Per-position statistics and their gradients with chunks of 1, 2, 4 and 16 chains (N = 5) equal
    one chunk, row by row: a chain skipped or counted twice at a boundary shows."""
    from cotrain.draft.losses import _NUM_STATS, CE, L1, MATCH, OV, position_stats

    logits, tl, rows, _, _, _, _ = _random_case(3)
    p = torch.softmax(tl[rows.clamp(min=0)], -1)
    cols = [CE, L1, OV, MATCH]
    w = torch.randn(5, 3, _NUM_STATS)

    def run(elements):
        z = logits.clone().requires_grad_(True)
        s = position_stats(z, p, cols, chunk_elements=elements)
        (s * w).sum().backward()
        return s.detach(), z.grad

    whole, dwhole = run(1 << 30)
    for per in (1, 2, 4, 16):
        got, dgot = run(per * 3 * 37)
        torch.testing.assert_close(got, whole, atol=1e-6, rtol=0)
        torch.testing.assert_close(dgot, dwhole, atol=1e-6, rtol=0)
    assert float(whole[..., CE].std()) > 0.1  # the rows differ, so a shifted row would show


def test_draft_loss_reads_nothing_back_to_the_host(monkeypatch):
    """No host sync in a loss call or its backward: every way a tensor's value reaches Python
    (item, float, int, bool, tolist, numpy) raises inside; the metrics stay tensors."""
    logits, tl, rows, valid, labels, conf, dv = _random_case(5, vocab=13)
    from cotrain.draft.losses import target_dist

    def sync(*a, **k):
        raise AssertionError("host sync")

    results = []
    for vocab in (None, dv):
        z = (logits if vocab is not None else torch.randn(5, 3, 37)).clone().requires_grad_(True)
        out = DraftOutput(logits=z, bonus_pos=torch.arange(5), target_rows=rows, valid=valid,
                          loss_weight=torch.tensor([1.0, 0.5, 0.25]), confidence=conf.clone().requires_grad_(True))
        with monkeypatch.context() as mp:
            for attr in ("item", "__float__", "__int__", "__bool__", "tolist", "numpy"):
                mp.setattr(torch.Tensor, attr, sync)
            for name in ("soft_ce", "forward_kl", "hard_ce", "dspark_l1", "e2e_tv"):
                loss, m = draft_loss(name, out, target_dist(tl, out), labels=labels, vocab=vocab, chunk_elements=64)
                loss.backward()
                results.append(m)
    assert all(torch.is_tensor(v) and v.dim() == 0 for m in results for v in m.values())
    with pytest.raises(AssertionError, match="host sync"):  # the trap works
        with monkeypatch.context() as mp:
            mp.setattr(torch.Tensor, "__float__", sync)
            float(torch.ones(()))


def test_loss_backward_runs_once():
    """The loss consumes its saved derivatives: a second backward through the same graph raises
    instead of returning a wrong gradient."""
    logits, tl, rows, valid, labels, _, _ = _random_case(1)
    from cotrain.draft.losses import target_dist

    z = logits.clone().requires_grad_(True)
    out = DraftOutput(logits=z, bonus_pos=torch.arange(5), target_rows=rows, valid=valid)
    loss, _ = draft_loss("soft_ce", out, target_dist(tl, out))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("name", ["soft_ce", "e2e_tv", "hard_ce"])
def test_kl_metric_is_zero_for_a_perfect_drafter_and_ignores_the_policys_entropy(name):
    """``kl`` = KL(p || q) on the supervised positions, whatever the loss: 0 when q = p, and unchanged
    when the policy's entropy rises with the drafter matching it (soft cross-entropy rises with it)."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, 3, 9, generator=g)
    labels = torch.randint(0, 9, (4, 3), generator=g)
    for temperature in (1.0, 3.0):  # a flatter policy: higher entropy
        p = torch.softmax(z / temperature, -1)
        out = chains(z / temperature)
        _, m = draft_loss(name, out, p, labels=labels)
        assert float(m["kl"]) == pytest.approx(0.0, abs=1e-5)
        ce = float(draft_loss("soft_ce", chains(z / temperature), p)[1]["loss"])
        assert ce == pytest.approx(float(-(p * p.log()).sum(-1).mean()), abs=1e-5)  # = H(p) here
    q_logits = torch.randn(4, 3, 9, generator=g)
    p = torch.softmax(z, -1)
    q = torch.softmax(q_logits, -1)
    by_hand = (p * (p.log() - q.log())).sum(-1).mean()
    assert float(draft_loss(name, chains(q_logits), p, labels=labels)[1]["kl"]) == pytest.approx(float(by_hand), abs=1e-5)
