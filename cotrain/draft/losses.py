"""Drafter losses on draft chains (see :mod:`cotrain.draft.common`), computed in chunks of positions.

Notation: for chain n and draft position j, q_{nj} = softmax(drafter logits) and p_{nj} = the
*detached* target distribution (softmax of the target logits at row ``target_rows[n, j]``).
Every loss averages over valid positions, weighted by the chain's per-position ``loss_weight`` w_j
(DFlash/DSpark position decay) when given:  L = sum_{nj valid} w_j l_{nj} / sum_{nj valid} w_j.

- ``soft_ce``:    l = -sum_v p log q                       (cross-entropy to the target distribution)
- ``forward_kl``: l = sum_v p (log p - log q) = soft_ce - H(p)   (same gradient, zero at q = p;
                  reported as the ``kl`` metric whatever the loss)
- ``hard_ce``:    l = -log q[y], y = the target's sampled / data token (``labels``)
- ``dspark_l1``:  l = soft_ce + l1_weight * ||p - q||_1, plus, with a confidence head,
                  confidence_weight * BCE(sigmoid(c), 1 - 0.5 ||p - q||_1) (label detached)
- ``e2e_tv``:     a_{nj} = sum_v min(p, q) = 1 - TV(p, q)   (probability that draft j is accepted when
                  the drafter *samples* from q and the target verifies against p, given the prefix)
                  S_{nj} = prod_{i <= j, valid} a_{ni}      (prefix survival)
                  L = -sum_{nj valid} w_j S_{nj} / sum_{nj valid} w_j
                  Gradients flow through q and the products; p is fixed. An early mismatch lowers
                  every later S, so it weighs on every later position.
- ``accept_weighted_tv`` (on-policy branches only: ``labels`` = the branch's own drafts y, drawn
                  from q at the branch temperature T):
                  r_{ni} = min(1, p_{ni}(y_{ni}) / q_{ni}(y_{ni}))   at T = 1 (the probability that
                           speculative rejection sampling accepts the drawn y_i),
                  r_{ni} = 1[y_{ni} = argmax p_{ni}]                at T = 0 (greedy verification),
                  c_{nj} = prod_{i < j, valid} r_{ni}   (detached; c_{n1} = 1)
                  L = sum_{nj valid} w_j c_{nj} (1 - a_{nj}) / sum_{nj valid} w_j
                  Position j's TV term, weighted by the acceptance probability of the prefix the
                  branch actually drew, instead of E2E-TV's expected-overlap product.
                  *Estimator.* With q_i and p_i conditioned on the branch's own y_{<i} (as serving
                  conditions on the accepted drafts), P(drafts 1..j accepted) =
                  E_{y ~ q}[c_j a_j] at T = 1, so sum_j c_j a_j is a one-sample unbiased estimate of
                  the expected accepted length at the anchor (at T = 0, c_j a_j is exact up to a_j
                  standing in for the indicator that draft j is the argmax). *Bias of the gradient.*
                  c_j is a constant: the gradient is E[sum_j w_j c_j grad a_j] (unbiased for that
                  part), and it drops the part through the prefix, E[c_j a_j sum_{i<j}
                  1[q_i(y_i) < p_i(y_i)] grad log q_i(y_i)] (how raising an earlier draft's
                  probability raises the chance that later ones are reached; the score-function and
                  the min(1, p/q) terms combined), which E2E-TV keeps through its products.
                  Teacher-forced chains have no drafted prefix: refused (``draft_loss``, and
                  validation with draft.branches: teacher_forced).

**Chunks.** Every loss is a weighted mean of per-position statistics (the V-wide sums above), so
they are computed by :class:`_PositionStats` in chunks of chains (numerator and denominator summed
over chunks, as SpecForge does): the target rows are gathered and softmaxed chunk by chunk
(``TargetDist``: the (T, V) target logits and the chains' rows, never an (N, W, V) fp32 copy), and
while a chunk's q and p are at hand the derivatives of the differentiable statistics are written
into their place in an (N, W, V) tensor, which the backward scales in place into the logits'
gradient (z = the logits, e_y the one-hot of y):

    d(-sum p log q)/dz = q sum(p) - p,      d(-log q_y)/dz = q - e_y,
    d f(q)/dz = q * (g - <g, q>)   with g = df/dq:  sign(q - p) for ||p - q||_1,
                                   1[q < p] + 1/2 1[q = p] for sum min(p, q) (torch.minimum's tie rule),

so a call holds, beyond the logits and the target logits, one (N, W, V) tensor per differentiable
statistic (one for every loss but dspark_l1's two; it becomes the logits' gradient) and
O(chunk x W x V) temporaries, where plain autograd keeps p, log q, q and their products. The
statistics, the losses and the metrics stay on the device: nothing here reads a value back to the
host (metrics are 0-dim tensors; convert them when logging).

E2E-TV caveat (SpecOPD): the product of per-position overlaps is a *biased* surrogate of the
serving acceptance. In serving, draft j's distribution is conditioned on the drafts the drafter
itself proposed at positions < j; the training chain conditions on the reference tokens instead
(teacher forcing) and multiplies overlaps as if positions were independent, so E[prod a_i] is not
the expected accepted length under conditional proposals. It is a smooth objective aligned with
acceptance, not an unbiased estimate of it; the acceptance estimator
(:mod:`cotrain.draft.acceptance`) is the metric to report.

Reduced draft vocabulary (``vocab``, an EAGLE-3 drafter's :class:`~cotrain.draft.vocab.DraftVocab`;
the drafter's logits then have N < V columns, p keeps the target's V): as SpecForge defines it, the
cross-entropies (``soft_ce``, ``forward_kl``, ``dspark_l1``) use p restricted to the draft tokens and
renormalised, and drop the positions whose target greedy token is outside the draft vocabulary
(the drafter can never propose it); ``hard_ce`` drops the positions whose label is outside.
``e2e_tv`` and the ``overlap`` metric use p restricted but *not* renormalised - the acceptance
probability sum_{v in draft} min(p_v, q_v), the mass outside never accepted - on every valid
position (an unreachable token breaks the chain, as in serving). ``top1_match`` compares the
mapped draft token with the target's greedy token. ``metrics["weight"]`` is the loss's denominator
(the weight of the positions it counts), which callers that sum losses over microbatches need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from cotrain.draft.common import DraftOutput

LOSSES = ("soft_ce", "forward_kl", "hard_ce", "dspark_l1", "e2e_tv", "accept_weighted_tv")
#: the temperatures at which accept_weighted_tv knows the acceptance of a drawn prefix
ACCEPT_TEMPERATURES = (0.0, 1.0)
#: elements (positions x vocabulary) of one chunk's fp32 temporaries, by device type: on CPU 2^20
#: (4 MiB each, 32 positions at 32k: per-chunk dispatch is negligible next to the work); on a GPU
#: 2^25 (128 MiB each: a chunk of one chain per kernel launch would make the loss launch-bound)
CHUNK_ELEMENTS = {"cpu": 1 << 20, "cuda": 1 << 25}

# per-position statistics (the columns of _PositionStats' output)
CE, PLOGP, L1, OV, NLL, MATCH, INVOCAB, RATIO, YGREEDY = range(9)
_NUM_STATS = 9
_DIFFERENTIABLE = (CE, L1, OV, NLL)


@dataclass(frozen=True)
class TargetDist:
    """The detached target distributions of N x W positions, gathered on demand:
    p[n, j] = softmax(source[rows_index[n, j]] / temperature) when ``logits``, else
    source[rows_index[n, j]] (already probabilities). ``source`` (R, V), ``rows_index`` (N, W) int64
    (clamped to >= 0)."""

    source: torch.Tensor
    rows_index: torch.Tensor
    logits: bool = True
    temperature: float = 1.0

    @classmethod
    def of(cls, p: Union[torch.Tensor, "TargetDist"]) -> "TargetDist":
        """A TargetDist for ``p``: itself, or dense probabilities (N, W, V) as views."""
        if isinstance(p, TargetDist):
            return p
        n, w, v = p.shape
        return cls(p.detach().reshape(n * w, v), torch.arange(n * w, device=p.device).view(n, w), logits=False)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.rows_index.shape, self.source.shape[-1])

    def rows(self, n0: int, n1: int) -> torch.Tensor:
        """((n1 - n0) * W, V) fp32 distributions of chains [n0, n1), positions flattened."""
        x = self.source.detach().index_select(0, self.rows_index[n0:n1].reshape(-1).clamp(min=0)).float()
        if not self.logits:
            return x
        if self.temperature != 1.0:
            x.div_(self.temperature)  # x is a fresh copy
        return F.softmax(x, dim=-1)

    def dense(self) -> torch.Tensor:
        """(N, W, V) fp32: every position at once (tests, small shapes)."""
        return self.rows(0, self.shape[0]).view(self.shape)


def target_dist(target_logits: torch.Tensor, out: DraftOutput, temperature: float = 1.0) -> TargetDist:
    """The chains' target distributions from full (T, V) target logits, gathered chunk by chunk."""
    return TargetDist(target_logits, out.target_rows.clamp(min=0), True, temperature)


def target_probs(target_logits: torch.Tensor, out: DraftOutput, temperature: float = 1.0) -> torch.Tensor:
    """(N, W, V) detached target distributions for the chains, from full (T, V) target logits."""
    return target_dist(target_logits, out, temperature).dense()


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a * b per row, without an (n, V) temporary."""
    return torch.bmm(a[:, None, :], b[:, :, None]).view(-1)


class _PositionStats(torch.autograd.Function):
    """(N, W, 9) fp32 per-position statistics of logits (N, W, Vd) against ``target``, computed in
    chunks of ``chunk`` chains (module doc): CE = -sum p log q, PLOGP = sum p log p, L1 = ||p - q||_1,
    OV = sum min(p_acc, q), NLL = -log q[y] (0 where y < 0), MATCH = [argmax q (as a target id) ==
    argmax p], INVOCAB (see vocab), RATIO = min(1, p_acc[y] / q[y]) and YGREEDY = [y (as a target id)
    == argmax p] (both 1 where y < 0). Only the columns in ``need`` are computed (the others are 0).

    The columns in ``grads`` (a subset of CE, L1, OV, NLL) are differentiable: while a chunk's q and
    p are at hand, the forward also writes each one's derivative d stat / dz (module doc) into an
    (N, W, Vd) fp32 tensor, and the backward scales those by the incoming per-position gradients in
    place and returns their sum (the first one *is* the logits' gradient: no recomputation, no extra
    tensor). So a call holds, beyond the logits, one (N, W, Vd) tensor per differentiable column
    (the gradient the old autograd graph also returned) and O(chunk x W x V) temporaries. The
    backward may run once (it consumes those tensors; a second call raises)."""

    @staticmethod
    def forward(ctx, logits, target: TargetDist, labels, vocab, need: frozenset, grads: frozenset, chunk: int):
        N, W, Vd = logits.shape
        stats = logits.new_zeros(N, W, _NUM_STATS, dtype=torch.float32)
        jac = {k: logits.new_empty(N, W, Vd, dtype=torch.float32) for k in sorted(grads)}
        log = bool(need & {CE, NLL})
        for n0 in range(0, N, chunk):
            n1 = min(n0 + chunk, N)
            z = logits[n0:n1].detach().reshape(-1, Vd).float()  # a copy only if logits are not contiguous
            logq = F.log_softmax(z, dim=-1) if log else None
            q = logq.exp() if log else F.softmax(z, dim=-1)
            del z
            p = target.rows(n0, n1)
            greedy = p.argmax(-1)
            inv = torch.ones_like(greedy, dtype=torch.bool)
            p_acc = p
            if vocab is not None:
                r = vocab.restrict(p)
                p, p_acc, inv = r.p, r.p_on_draft, r.in_vocab
            s = stats[n0:n1].view(-1, _NUM_STATS)
            y = labels[n0:n1].reshape(-1)
            if CE in need:
                s[:, CE] = -_rowdot(p, logq)
            if PLOGP in need:
                s[:, PLOGP] = torch.special.xlogy(p, p).sum(-1)
            if L1 in need:
                s[:, L1] = (p - q).abs_().sum(-1)
            if OV in need:
                s[:, OV] = torch.minimum(p_acc, q).sum(-1)
            if NLL in need:
                s[:, NLL] = torch.where(y >= 0, -logq.gather(-1, y.clamp(min=0)[:, None]).squeeze(-1), 0.0)
            if MATCH in need:
                drafted = q.argmax(-1)
                s[:, MATCH] = ((drafted if vocab is None else vocab.to_target(drafted)) == greedy).float()
            if RATIO in need or YGREEDY in need:
                has, yc = y >= 0, y.clamp(min=0)[:, None]
                if RATIO in need:
                    r = (p_acc.gather(-1, yc) / q.gather(-1, yc).clamp(min=torch.finfo(q.dtype).tiny)).squeeze(-1)
                    s[:, RATIO] = torch.where(has, r.clamp(max=1.0), 1.0)
                if YGREEDY in need:
                    yt = yc.squeeze(-1) if vocab is None else vocab.to_target(yc.squeeze(-1))
                    s[:, YGREEDY] = torch.where(has, (yt == greedy).float(), 1.0)
            s[:, INVOCAB] = inv.float()
            for k, j in jac.items():
                _jacobian_(j[n0:n1].view(-1, Vd), k, q, p, p_acc, y)
        ctx.jac, ctx.dtype = jac, logits.dtype
        return stats

    @staticmethod
    def backward(ctx, g):
        if ctx.jac is None:
            raise RuntimeError("the drafter loss's backward ran twice (it consumes its saved derivatives)")
        dz = None
        for k, j in ctx.jac.items():  # dz = sum_k g_k * d stat_k / dz, in place
            gk = g[..., k, None].float()
            dz = j.mul_(gk) if dz is None else dz.addcmul_(j, gk)
        ctx.jac = None
        return dz.to(ctx.dtype), None, None, None, None, None, None


def _jacobian_(out: torch.Tensor, k: int, q, p, p_acc, y) -> None:
    """out (n, Vd) <- d stat_k / dz for the rows of one chunk (module doc)."""
    if k == CE:  # q sum(p) - p
        torch.mul(q, p.sum(-1, keepdim=True), out=out).sub_(p)
    elif k == NLL:  # q - e_y, zero where y < 0
        out.copy_(q).scatter_add_(-1, y.clamp(min=0)[:, None], torch.full((y.numel(), 1), -1.0, device=q.device))
        out.mul_((y >= 0)[:, None])
    else:  # q (g - <g, q>),  g = sign(q - p) for L1, 1[q < p] + 1/2 1[q = p] for OV
        if k == L1:
            torch.sub(q, p, out=out).sign_()
        else:
            out.copy_(q < p_acc).add_((q == p_acc).float(), alpha=0.5)
        out.sub_(_rowdot(out, q)[:, None]).mul_(q)


def position_stats(logits: torch.Tensor, p: Union[torch.Tensor, TargetDist], need, labels=None, vocab=None,
                   chunk_elements: Optional[int] = None, grads=None) -> torch.Tensor:
    """(N, W, 7) statistics of the columns ``need`` (the module's constants) for logits (N, W, Vd)
    against target ``p`` ((N, W, V) probabilities or a TargetDist), in chunks of about
    ``chunk_elements`` / (W V) chains (default: CHUNK_ELEMENTS of the logits' device type);
    differentiable in the columns ``grads`` (default: the
    differentiable ones of ``need``)."""
    target = TargetDist.of(p)
    N, W, Vd = logits.shape
    if target.shape[:2] != (N, W):
        raise ValueError(f"target distributions {tuple(target.shape)} do not match the chains {tuple(logits.shape)}")
    if labels is None:
        labels = torch.full((N, W), -1, dtype=torch.int64, device=logits.device)
    if chunk_elements is None:
        chunk_elements = CHUNK_ELEMENTS.get(logits.device.type, CHUNK_ELEMENTS["cuda"])
    chunk = max(1, chunk_elements // (W * max(target.shape[2], Vd)))
    need = frozenset(need)
    grads = need & frozenset(_DIFFERENTIABLE) if grads is None else frozenset(grads)
    return _PositionStats.apply(logits, target, labels, vocab, need, grads, chunk)


def _weights(valid: torch.Tensor, loss_weight: Optional[torch.Tensor]) -> torch.Tensor:
    w = valid.to(torch.float32)
    if loss_weight is not None:
        w = w * loss_weight.to(w.device, torch.float32)[None, :]
    return w


def _wmean(values: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum w x / sum w, 0 (still differentiable) where sum w = 0; no host sync."""
    den = w.sum()
    return (values * w).sum() / torch.where(den > 0, den, torch.ones_like(den))


def soft_ce(logits: torch.Tensor, p, valid: torch.Tensor, loss_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _wmean(position_stats(logits, p, {CE})[..., CE], _weights(valid, loss_weight))


def forward_kl(logits: torch.Tensor, p, valid: torch.Tensor,
               loss_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    s = position_stats(logits, p, {CE, PLOGP})
    return _wmean(s[..., CE] + s[..., PLOGP], _weights(valid, loss_weight))


def hard_ce(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
            loss_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    N, W, V = logits.shape
    dummy = TargetDist(logits.new_zeros(1, V), torch.zeros(N, W, dtype=torch.int64, device=logits.device), False)
    nll = position_stats(logits, dummy, {NLL}, labels)[..., NLL]
    return _wmean(nll, _weights(valid & (labels >= 0), loss_weight))


def l1_distance(logits: torch.Tensor, p) -> torch.Tensor:
    """||p - q||_1 per position (= 2 TV)."""
    return position_stats(logits, p, {L1})[..., L1]


def overlap(logits: torch.Tensor, p) -> torch.Tensor:
    """a = sum_v min(p, q) = 1 - TV(p, q) per position (differentiable in q)."""
    return position_stats(logits, p, {OV})[..., OV]


def _dspark(s: torch.Tensor, w: torch.Tensor, confidence, l1_weight: float, confidence_weight: float):
    ce, l1 = _wmean(s[..., CE], w), _wmean(s[..., L1], w)
    loss = ce + l1_weight * l1
    metrics = {"ce": ce.detach(), "l1": l1.detach()}
    if confidence is not None:
        label = (1.0 - 0.5 * s[..., L1]).detach().clamp(0.0, 1.0)
        bce = F.binary_cross_entropy_with_logits(confidence.float(), label, reduction="none")
        conf_loss = _wmean(bce, w)
        loss = loss + confidence_weight * conf_loss
        metrics["confidence_bce"] = conf_loss.detach()
    return loss, metrics


def dspark_l1(logits: torch.Tensor, p, valid: torch.Tensor,
              loss_weight: Optional[torch.Tensor] = None, confidence: Optional[torch.Tensor] = None,
              l1_weight: float = 1.0, confidence_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    s = position_stats(logits, p, {CE, L1})
    return _dspark(s, _weights(valid, loss_weight), confidence, l1_weight, confidence_weight)


def _e2e(a: torch.Tensor, valid: torch.Tensor, loss_weight) -> torch.Tensor:
    a = torch.where(valid, a, torch.ones_like(a))  # invalid positions do not break the chain
    return -_wmean(torch.cumprod(a, dim=-1), _weights(valid, loss_weight))


def e2e_tv(logits: torch.Tensor, p, valid: torch.Tensor, loss_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _e2e(overlap(logits, p), valid, loss_weight)


def prefix_acceptance(r: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """c_{nj} = prod_{i < j, valid} r_{ni} (c_{n1} = 1), detached: the acceptance probability of the
    drafts drawn before position j (module doc, accept_weighted_tv)."""
    r = torch.where(valid, r.detach(), torch.ones_like(r))
    return torch.cat([torch.ones_like(r[:, :1]), torch.cumprod(r, dim=-1)[:, :-1]], dim=-1)


def _accept_weighted(a: torch.Tensor, c: torch.Tensor, valid: torch.Tensor, loss_weight) -> torch.Tensor:
    return _wmean(c * (1.0 - a), _weights(valid, loss_weight))


def accept_weighted_tv(logits: torch.Tensor, p, labels: torch.Tensor, valid: torch.Tensor,
                       loss_weight: Optional[torch.Tensor] = None, temperature: float = 1.0) -> torch.Tensor:
    """The module doc's accept_weighted_tv on branches whose drafts ``labels`` the drafter drew at
    ``temperature`` (0 or 1)."""
    col = _accept_column(temperature)
    s = position_stats(logits, p, {OV, col}, labels, grads={OV})
    return _accept_weighted(s[..., OV], prefix_acceptance(s[..., col], valid), valid, loss_weight)


def _accept_column(temperature: float) -> int:
    if float(temperature) not in ACCEPT_TEMPERATURES:
        raise ValueError(f"accept_weighted_tv: branch temperature {temperature} (the acceptance of a drawn prefix is "
                         "defined here at 1, min(1, p/q), and at 0, the target's argmax; allowed: 0, 1)")
    return RATIO if float(temperature) == 1.0 else YGREEDY


def draft_loss(name: str, out: DraftOutput, p, labels: Optional[torch.Tensor] = None, l1_weight: float = 1.0,
               confidence_weight: float = 1.0, vocab=None,
               chunk_elements: Optional[int] = None, branch_temperature: float = 1.0) -> tuple[torch.Tensor, dict]:
    """The loss ``name`` (one of LOSSES) on chains ``out`` against the target distributions ``p``:
    (N, W, V) probabilities or a :class:`TargetDist` (:func:`target_dist`: gathered from the target
    logits chunk by chunk), detached here. ``labels`` (N, W): the tokens for hard_ce; for
    accept_weighted_tv the branch's own drafts (on-policy chains, ``out.extras["on_policy"]``), drawn
    at ``branch_temperature`` (0 or 1). ``vocab``: the
    drafter's reduced draft vocabulary (its logits then have vocab.size columns; see the module doc).
    Returns (loss, metrics), every metric a detached 0-dim tensor on the logits' device (no host
    sync); ``metrics["weight"]`` is the loss's denominator."""
    if name not in LOSSES:
        raise ValueError(f"unknown drafter loss {name!r} (allowed: {', '.join(LOSSES)})")
    target = TargetDist.of(p)
    w, valid = out.loss_weight, out.valid
    if vocab is not None:
        if target.shape[:2] != out.logits.shape[:2] or out.logits.shape[-1] != vocab.size:
            raise ValueError(f"target distributions {tuple(target.shape)} and chains {tuple(out.logits.shape)} do not "
                             f"fit a draft vocabulary of {vocab.size} over {vocab.vocab_size} tokens")
        if labels is not None:
            labels = vocab.to_draft(labels)
    elif target.shape != tuple(out.logits.shape):
        raise ValueError(f"target distributions {tuple(target.shape)} do not match the chains {tuple(out.logits.shape)}")
    if name == "hard_ce" and labels is None:
        raise ValueError("hard_ce needs labels (the target's sampled tokens)")
    if name == "accept_weighted_tv" and (labels is None or not out.extras.get("on_policy")):
        raise ValueError("accept_weighted_tv weights each position by the acceptance of the drafts the branch drew "
                         "before it: it needs on-policy branches and their drafts as labels "
                         "(cotrain.draft.specopd; draft.branches: on_policy), not teacher-forced chains")
    own = {"soft_ce": {CE}, "forward_kl": {CE, PLOGP}, "hard_ce": {NLL}, "dspark_l1": {CE, L1},
           "e2e_tv": {OV}, "accept_weighted_tv": {OV}}[name]
    extra_cols = {_accept_column(branch_temperature)} if name == "accept_weighted_tv" else set()
    s = position_stats(out.logits, target, own | extra_cols | {CE, PLOGP, OV, MATCH},
                       labels if name in ("hard_ce", "accept_weighted_tv") else None,
                       vocab, chunk_elements, grads=own & set(_DIFFERENTIABLE))
    ce_valid = valid & (s[..., INVOCAB] > 0)  # a reduced vocabulary drops positions it cannot say
    counted = ce_valid
    metrics: dict = {}
    if name == "soft_ce":
        loss = _wmean(s[..., CE], _weights(ce_valid, w))
    elif name == "forward_kl":
        loss = _wmean(s[..., CE] + s[..., PLOGP], _weights(ce_valid, w))
    elif name == "hard_ce":
        counted = valid & (labels >= 0)
        loss = _wmean(s[..., NLL], _weights(counted, w))
    elif name == "dspark_l1":
        loss, metrics = _dspark(s, _weights(ce_valid, w), out.confidence, l1_weight, confidence_weight)
    elif name == "accept_weighted_tv":
        counted = valid
        c = prefix_acceptance(s[..., next(iter(extra_cols))], valid)
        loss = _accept_weighted(s[..., OV], c, valid, w)
        metrics["prefix_acceptance"] = _wmean(c, valid.float()).detach()
    else:
        counted = valid
        loss = _e2e(s[..., OV], valid, w)
    with torch.no_grad():
        vf = valid.float()
        metrics["overlap"] = _wmean(s[..., OV], vf)
        metrics["top1_match"] = _wmean(s[..., MATCH], vf)
        # KL(p || q) = CE + sum p log p on the positions the cross-entropies count (p renormalised
        # over a reduced draft vocabulary): 0 for a perfect drafter, whatever the policy's entropy
        kf = ce_valid.float()
        metrics["kl"] = _wmean(s[..., CE] + s[..., PLOGP], kf)
        metrics["kl_weight"] = kf.sum()
        if vocab is not None:
            metrics["in_vocab"] = _wmean(ce_valid.float(), vf)
        metrics["weight"] = _weights(counted, w).sum()
        metrics["loss"] = loss.detach()
    return loss, metrics
