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
