"""Drafter losses on draft chains (see :mod:`cotrain.draft.common`).

Notation: for chain n and draft position j, q_{nj} = softmax(drafter logits) and p_{nj} = the
*detached* target distribution (softmax of the target logits at row ``target_rows[n, j]``).
Every loss averages over valid positions, weighted by the chain's per-position ``loss_weight`` w_j
(DFlash/DSpark position decay) when given:  L = sum_{nj valid} w_j l_{nj} / sum_{nj valid} w_j.

- ``soft_ce``:    l = -sum_v p log q                       (cross-entropy to the target distribution)
- ``forward_kl``: l = sum_v p (log p - log q) = soft_ce - H(p)   (same gradient, zero at q = p)
- ``hard_ce``:    l = -log q[y], y = the target's sampled / data token (``labels``)
- ``dspark_l1``:  l = soft_ce + l1_weight * ||p - q||_1, plus, with a confidence head,
                  confidence_weight * BCE(sigmoid(c), 1 - 0.5 ||p - q||_1) (label detached)
- ``e2e_tv``:     a_{nj} = sum_v min(p, q) = 1 - TV(p, q)   (probability that draft j is accepted when
                  the drafter *samples* from q and the target verifies against p, given the prefix)
                  S_{nj} = prod_{i <= j, valid} a_{ni}      (prefix survival)
                  L = -sum_{nj valid} w_j S_{nj} / sum_{nj valid} w_j
                  Gradients flow through q and the products; p is fixed. An early mismatch lowers
                  every later S, so it weighs on every later position.

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

from typing import Optional

import torch
import torch.nn.functional as F

from cotrain.draft.common import DraftOutput

LOSSES = ("soft_ce", "forward_kl", "hard_ce", "dspark_l1", "e2e_tv")


def _weights(valid: torch.Tensor, loss_weight: Optional[torch.Tensor]) -> torch.Tensor:
    w = valid.to(torch.float32)
    if loss_weight is not None:
        w = w * loss_weight.to(w.device, torch.float32)[None, :]
    return w


def _wmean(values: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    den = w.sum()
    if float(den) == 0.0:
        return values.sum() * 0.0
    return (values * w).sum() / den


def soft_ce(logits: torch.Tensor, p: torch.Tensor, valid: torch.Tensor,
            loss_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    logq = F.log_softmax(logits.float(), dim=-1)
    per = -(p.detach() * logq).sum(-1)
    return _wmean(per, _weights(valid, loss_weight))


def forward_kl(logits: torch.Tensor, p: torch.Tensor, valid: torch.Tensor,
               loss_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    logq = F.log_softmax(logits.float(), dim=-1)
    p = p.detach()
    per = (torch.special.xlogy(p, p) - p * logq).sum(-1)
    return _wmean(per, _weights(valid, loss_weight))


def hard_ce(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
            loss_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    logq = F.log_softmax(logits.float(), dim=-1)
    per = -logq.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    return _wmean(per, _weights(valid & (labels >= 0), loss_weight))


def l1_distance(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """||p - q||_1 per position (= 2 TV)."""
    return (p.detach() - F.softmax(logits.float(), dim=-1)).abs().sum(-1)


def overlap(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """a = sum_v min(p, q) = 1 - TV(p, q) per position (differentiable in q)."""
    return torch.minimum(p.detach(), F.softmax(logits.float(), dim=-1)).sum(-1)


def dspark_l1(logits: torch.Tensor, p: torch.Tensor, valid: torch.Tensor,
              loss_weight: Optional[torch.Tensor] = None, confidence: Optional[torch.Tensor] = None,
              l1_weight: float = 1.0, confidence_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    w = _weights(valid, loss_weight)
    logq = F.log_softmax(logits.float(), dim=-1)
    ce = _wmean(-(p.detach() * logq).sum(-1), w)
    l1 = l1_distance(logits, p)
    loss = ce + l1_weight * _wmean(l1, w)
    metrics = {"ce": float(ce.detach()), "l1": float(_wmean(l1.detach(), w))}
    if confidence is not None:
        label = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
        bce = F.binary_cross_entropy_with_logits(confidence.float(), label, reduction="none")
        conf_loss = _wmean(bce, w)
        loss = loss + confidence_weight * conf_loss
        metrics["confidence_bce"] = float(conf_loss.detach())
    return loss, metrics


def e2e_tv(logits: torch.Tensor, p: torch.Tensor, valid: torch.Tensor,
           loss_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    a = overlap(logits, p)
    a = torch.where(valid, a, torch.ones_like(a))  # invalid positions do not break the chain
    survival = torch.cumprod(a, dim=-1)
    return -_wmean(survival, _weights(valid, loss_weight))


def target_probs(target_logits: torch.Tensor, out: DraftOutput, temperature: float = 1.0) -> torch.Tensor:
    """(N, W, V) detached target distributions for the chains, from full (T, V) target logits."""
    rows = out.target_rows.clamp(min=0)
    return F.softmax(target_logits[rows].float().detach() / temperature, dim=-1)


def draft_loss(name: str, out: DraftOutput, p: torch.Tensor, labels: Optional[torch.Tensor] = None,
               l1_weight: float = 1.0, confidence_weight: float = 1.0, vocab=None) -> tuple[torch.Tensor, dict]:
    """The loss ``name`` (one of LOSSES) on chains ``out`` against target distributions ``p``
    (N, W, V), detached here. ``labels`` (N, W): the tokens for hard_ce. ``vocab``: the drafter's
    reduced draft vocabulary (its logits then have vocab.size columns; see the module doc).
    Returns (loss, metrics); ``metrics["weight"]`` is the loss's denominator."""
    if name not in LOSSES:
        raise ValueError(f"unknown drafter loss {name!r} (allowed: {', '.join(LOSSES)})")
    p = p.detach()
    w = out.loss_weight
    valid = out.valid
    if vocab is not None:
        if p.shape[:-1] != out.logits.shape[:-1] or out.logits.shape[-1] != vocab.size:
            raise ValueError(f"target distributions {tuple(p.shape)} and chains {tuple(out.logits.shape)} do not fit "
                             f"a draft vocabulary of {vocab.size} over {vocab.vocab_size} tokens")
        r = vocab.restrict(p)
        p_ce, p_acc, ce_valid = r.p, r.p_on_draft, valid & r.in_vocab
        greedy = vocab.to_target(out.logits.argmax(-1))
        if labels is not None:
            labels = vocab.to_draft(labels)
    else:
        if p.shape != out.logits.shape:
            raise ValueError(f"target distributions {tuple(p.shape)} do not match the chains {tuple(out.logits.shape)}")
        p_ce, p_acc, ce_valid = p, p, valid
        greedy = out.logits.argmax(-1)
    metrics: dict = {}
    counted = ce_valid
    if name == "soft_ce":
        loss = soft_ce(out.logits, p_ce, ce_valid, w)
    elif name == "forward_kl":
        loss = forward_kl(out.logits, p_ce, ce_valid, w)
    elif name == "hard_ce":
        if labels is None:
            raise ValueError("hard_ce needs labels (the target's sampled tokens)")
        loss = hard_ce(out.logits, labels, valid, w)
        counted = valid & (labels >= 0)
    elif name == "dspark_l1":
        loss, metrics = dspark_l1(out.logits, p_ce, ce_valid, w, out.confidence, l1_weight, confidence_weight)
    else:
        loss = e2e_tv(out.logits, p_acc, valid, w)
        counted = valid
    with torch.no_grad():
        a = overlap(out.logits, p_acc)
        metrics["overlap"] = float(_wmean(a, valid.float()))
        metrics["top1_match"] = float(_wmean((greedy == p.argmax(-1)).float(), valid.float()))
        if vocab is not None:
            metrics["in_vocab"] = float(_wmean(ce_valid.float(), valid.float()))
    metrics["weight"] = float(_weights(counted, w).sum())
    metrics["loss"] = float(loss.detach())
    return loss, metrics
