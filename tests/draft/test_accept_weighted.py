"""accept_weighted_tv (cotrain.draft.losses) against hand computations, values and gradients, and
its refusals; through SpecOPD's branches against an independent recomputation from the branches."""

import math

import pytest
import torch

from cotrain.draft.common import DraftOutput
from cotrain.draft.losses import accept_weighted_tv, draft_loss

# one branch, three drafts, vocabulary of 2 (drafts y = (1, 0, 1)):
#   z0 = (0, 0)       q0 = (.5, .5)    p0 = (.7, .3)  a0 = .8   r0 = min(1, p0[1]/q0[1]) = .6
#   z1 = (ln 3, 0)    q1 = (.75, .25)  p1 = (.2, .8)  a1 = .45  r1 = min(1, .2/.75) = 4/15
#   z2 = (0, ln 4)    q2 = (.2, .8)    p2 = (.5, .5)  a2 = .7
#   c = (1, r0, r0 r1) = (1, .6, .16)
#   L = [1 (1 - .8) + .6 (1 - .45) + .16 (1 - .7)] / 3 = (.2 + .33 + .048) / 3
# T = 0: c = (1, [y0 = argmax p0 = 0] = 0, 0) for y = (1, 0, 1); with y = (0, 1, 1): (1, 1, 1)
Z = [[[0.0, 0.0], [math.log(3.0), 0.0], [0.0, math.log(4.0)]]]
P = [[[0.7, 0.3], [0.2, 0.8], [0.5, 0.5]]]
Y = [[1, 0, 1]]
A = (0.8, 0.45, 0.7)
C1 = (1.0, 0.6, 0.16)


def branch(z=Z, valid=None, weight=None, on_policy=True):
    z = torch.tensor(z).requires_grad_(True)
    N, W, _ = z.shape
    valid = torch.ones(N, W, dtype=torch.bool) if valid is None else torch.tensor(valid)
    return DraftOutput(logits=z, bonus_pos=torch.arange(N), target_rows=torch.full((N, W), -1), valid=valid,
                       loss_weight=weight, extras={"on_policy": True} if on_policy else {})


def test_value_and_gradient_by_hand_at_temperature_1():
    out = branch()
    loss, m = draft_loss("accept_weighted_tv", out, torch.tensor(P), labels=torch.tensor(Y))
    assert loss.item() == pytest.approx((0.2 + 0.33 + 0.048) / 3, abs=1e-6)
    assert m["prefix_acceptance"].item() == pytest.approx(sum(C1) / 3, abs=1e-6)
    assert m["weight"].item() == pytest.approx(3.0)
    loss.backward()
    # dL/dz_j = -(c_j / 3) da_j/dz_j, da/dz = q (g - <g, q>), g = 1[q < p]; c is a constant:
    #   j=0: g = (1, 0), da/dz = (.25, -.25);  j=1: g = (0, 1), (-.1875, .1875);  j=2: g = (1, 0), (.16, -.16)
    expected = torch.tensor([[[-0.25 / 3, 0.25 / 3], [0.6 * 0.1875 / 3, -0.6 * 0.1875 / 3],
                              [-0.16 * 0.16 / 3, 0.16 * 0.16 / 3]]])
    torch.testing.assert_close(out.logits.grad, expected, atol=1e-6, rtol=0)


def test_gradient_equals_plain_autograd_with_a_detached_weight():
    """An independent implementation (softmax, min, detached cumprod of the ratios, autograd) on a
    random case with invalid positions and weights, through the chunked path (chunks of one chain)."""
    g = torch.Generator().manual_seed(3)
    N, W, V = 5, 4, 9
    z = 2 * torch.randn(N, W, V, generator=g)
    p = torch.softmax(2 * torch.randn(N, W, V, generator=g), -1)
    y = torch.multinomial(torch.softmax(z, -1).view(-1, V), 1, generator=g).view(N, W)
    valid = torch.rand(N, W, generator=g) > 0.2
    w = torch.tensor([1.0, 0.7, 0.5, 0.3])
    out = DraftOutput(logits=z.clone().requires_grad_(True), bonus_pos=torch.arange(N),
                      target_rows=torch.full((N, W), -1), valid=valid, loss_weight=w, extras={"on_policy": True})
    loss, _ = draft_loss("accept_weighted_tv", out, p, labels=y, chunk_elements=W * V)
    loss.backward()
    zz = z.clone().requires_grad_(True)
    q = torch.softmax(zz, -1)
    a = torch.minimum(p, q).sum(-1)
    r = (p.gather(-1, y[..., None]) / q.gather(-1, y[..., None])).squeeze(-1).clamp(max=1).detach()
    r = torch.where(valid, r, torch.ones_like(r))
    c = torch.ones(N, W)
    for j in range(1, W):
        c[:, j] = c[:, j - 1] * r[:, j - 1]
    ww = valid.float() * w
    ref = (ww * c * (1 - a)).sum() / ww.sum()
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.logits.grad, zz.grad, atol=1e-6, rtol=1e-5)
    # the weight is not the E2E-TV product: the two losses' gradients differ
    e2e = branch(z.tolist())
    e2e.valid = valid
    draft_loss("e2e_tv", e2e, p)[0].backward()
    assert (e2e.logits.grad - out.logits.grad).abs().max() > 1e-3


def test_greedy_branches_weight_by_the_target_argmax():
    loss, m = draft_loss("accept_weighted_tv", branch(), torch.tensor(P), labels=torch.tensor(Y), branch_temperature=0)
    assert loss.item() == pytest.approx(0.2 / 3, abs=1e-6)  # y0 = 1 is not argmax p0: c = (1, 0, 0)
    assert m["prefix_acceptance"].item() == pytest.approx(1 / 3, abs=1e-6)
    loss, _ = draft_loss("accept_weighted_tv", branch(), torch.tensor(P), labels=torch.tensor([[0, 1, 0]]),
                         branch_temperature=0)
    assert loss.item() == pytest.approx((0.2 + 0.55 + 0.3) / 3, abs=1e-6)  # both argmax: c = (1, 1, 1)
    assert accept_weighted_tv(branch().logits, torch.tensor(P), torch.tensor([[0, 1, 0]]), torch.ones(1, 3).bool(),
                              temperature=0).item() == pytest.approx((0.2 + 0.55 + 0.3) / 3, abs=1e-6)


def test_invalid_positions_and_weights():
    # position 1 invalid (after a drafted EOS it would be the last; here it only must not count nor break):
    # c = (1, -, r0) over the valid ones, L = [.2 + .6 (1 - .7)] / 2
    loss, m = draft_loss("accept_weighted_tv", branch(valid=[[True, False, True]]), torch.tensor(P),
                         labels=torch.tensor(Y))
    assert loss.item() == pytest.approx((0.2 + 0.6 * 0.3) / 2, abs=1e-6)
    assert m["weight"].item() == pytest.approx(2.0)
    w = torch.tensor([1.0, 0.5, 0.25])
    loss, _ = draft_loss("accept_weighted_tv", branch(weight=w), torch.tensor(P), labels=torch.tensor(Y))
    assert loss.item() == pytest.approx((0.2 + 0.5 * 0.33 + 0.25 * 0.048) / 1.75, abs=1e-6)


def test_reduced_draft_vocabulary_uses_the_unnormalised_target_mass_of_the_drawn_token():
    from cotrain.draft.vocab import DraftVocab

    # target vocabulary 3, draft tokens (0, 2); q over the draft ids; y = target 2 = draft id 1
    # j=0: q0 = (.5, .5), p0 = (.5, .2, .3) -> on draft (.5, .3), a0 = .5 + .3 = .8, r0 = .3 / .5 = .6
    # j=1: q1 = (.75, .25), p1 = (.1, .1, .8) -> on draft (.1, .8), a1 = .1 + .25 = .35
    vocab = DraftVocab(torch.tensor([0, 2]), 3)
    out = branch(z=[[[0.0, 0.0], [math.log(3.0), 0.0]]])
    p = torch.tensor([[[0.5, 0.2, 0.3], [0.1, 0.1, 0.8]]])
    loss, _ = draft_loss("accept_weighted_tv", out, p, labels=torch.tensor([[2, 0]]), vocab=vocab)
    assert loss.item() == pytest.approx((0.2 + 0.6 * 0.65) / 2, abs=1e-6)


def test_refused_without_the_branchs_own_drafts():
    p = torch.tensor(P)
    with pytest.raises(ValueError, match="on-policy branches"):
        draft_loss("accept_weighted_tv", branch(on_policy=False), p, labels=torch.tensor(Y))  # teacher-forced chains
    with pytest.raises(ValueError, match="on-policy branches"):
        draft_loss("accept_weighted_tv", branch(), p)  # no drafts
    with pytest.raises(ValueError, match="allowed: 0, 1"):
        draft_loss("accept_weighted_tv", branch(), p, labels=torch.tensor(Y), branch_temperature=0.5)


def test_validation_refuses_it_with_teacher_forced_chains():
    from pathlib import Path

    from cotrain.config import load_config
    from cotrain.config.errors import ConfigError
    from cotrain.draft.distill import load_distill_config

    root = Path(__file__).resolve().parents[2]
    with pytest.raises(ConfigError) as info:
        load_config(root / "tests" / "configs" / "small.yaml", ["draft.kind=dflash", "draft.loss=accept_weighted_tv"])
    msgs = [m for path, m in info.value.issues if path == "draft.loss"]
    assert msgs and "draft.branches=teacher_forced" in msgs[0] and "set draft.branches=on_policy" in msgs[0]
    cfg = load_config(root / "tests" / "configs" / "small.yaml",
                      ["draft.kind=dflash", "draft.loss=accept_weighted_tv", "draft.branches=on_policy"])
    assert cfg.draft.loss == "accept_weighted_tv"
    with pytest.raises(ValueError, match="draft.loss: accept_weighted_tv .*set draft.branches=on_policy"):
        load_distill_config(root / "configs" / "distill_dflash.yaml", ["draft.loss=accept_weighted_tv"])
    cfg = load_distill_config(root / "configs" / "distill_dspark.yaml",
                              ["draft.loss=accept_weighted_tv", "draft.branches=on_policy"])
    assert cfg.draft.loss == "accept_weighted_tv"


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_specopd_step_weights_by_the_drawn_prefix(hf_target, target, kind, temperature, one_thread):
    """Through specopd_step: the loss equals the formula on the branches it drew (tokens, logits, the
    tree forward's p), with the acceptance at the temperature they were drawn at."""
    from _specopd_cp import make_batch, make_drafter
    from cotrain.draft import specopd

    model = hf_target[0]
    d = make_drafter(kind, target).train()
    batch = make_batch(model, d)
    layout = d.build_layout(batch, torch.Generator().manual_seed(1))
    loss, m, br = specopd.specopd_step(d, model, batch, torch.Generator().manual_seed(2), temperature=temperature,
                                       loss="accept_weighted_tv", layout=layout)
    with torch.no_grad():
        p = specopd.branch_target_probs(specopd.tree_target_logits(model, batch.input_ids, batch.cu_seqlens, br), br)
    q = torch.softmax(br.logits.detach().float(), -1)
    y = br.tokens[..., None]
    r = ((p.gather(-1, y) / q.gather(-1, y)).clamp(max=1) if temperature else (p.argmax(-1, keepdim=True) == y).float())
    c = torch.cumprod(torch.cat([torch.ones_like(r[:, :1, 0]), r[:, :-1, 0]], 1), 1)
    W = br.width
    w = torch.tensor([math.exp(-j / d.cfg.loss_gamma) for j in range(W)])
    expected = (w * c * (1 - torch.minimum(p, q).sum(-1))).sum() / (w.sum() * c.shape[0])
    assert br.valid.all()  # no EOS rule here: every position counts
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-4)
    if temperature:  # the weights are neither all 1 nor all 0 on this case
        assert 0 < float(c[:, 1:].mean()) < 1
    else:  # indicators (a random drafter rarely drafts the target's argmax: mostly 0)
        assert set(c.unique().tolist()) <= {0.0, 1.0}
    loss.backward()
    assert float(d.layers[0].self_attn.q_proj.weight.grad.abs().sum()) > 0
