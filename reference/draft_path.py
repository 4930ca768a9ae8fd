"""The drafter's earlier training path, kept as a reference for tests and bench/drafters.py only.

Nothing in cotrain imports this module; tests compare the training path against it and the
benchmark times it as the "before" arm.

- :func:`dense_attention`: a context manager under which every :class:`~cotrain.draft.common.BranchAttention`
  call runs the old way: at CP = 1 the explicit-mask oracle ``dense_branch_attention`` on buckets
  of whole sequences (at most ``bucket_tokens`` main + branch tokens each; sequences never see each
  other, so this equals one dense call), and without main queries (``q=None``) all-zero main queries
  whose outputs are thrown away (at CP > 1 through the ring with those zero queries); and EAGLE-3's
  passes 1..k-1 query all k-1 slots of the TTT layout (the not-yet-computed ones zero) and keep
  slot t-1, instead of the live slot alone.
- :func:`draft_loss`: the losses in plain autograd on full (N, W, V) fp32 tensors, metrics read back
  to the host (``float``) in every call; same arguments and values as
  :func:`cotrain.draft.losses.draft_loss`, which computes them in chunks on the device.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from cotrain.draft.common import BranchAttention, DraftOutput
from cotrain.draft.eagle3 import Eagle3Drafter
from cotrain.draft.losses import _weights  # the same weighting as the chunked losses
from cotrain.parallel import BranchLayout, cp_branch_attention, dense_branch_attention, eagle3_ttt_layout


# ------------------------------------------------------------------------------------ attention
def _buckets(layout: BranchLayout, bucket_tokens: int) -> list[tuple[BranchLayout, int, int, int, int]]:
    cu = layout.cu_seqlens.tolist()
    offs = layout.branch_offsets.tolist()
    first = [0] * (layout.num_seqs + 1)
    for s in layout.branch_seqs.tolist():  # branches are packed in anchor order: contiguous per sequence
        first[s + 1] += 1
    for s in range(layout.num_seqs):
        first[s + 1] += first[s]
    out, s0 = [], 0
    while s0 < layout.num_seqs:
        s1 = s0 + 1
        size = lambda a, b: (cu[b] - cu[a]) + (offs[first[b]] - offs[first[a]])  # noqa: E731
        while s1 < layout.num_seqs and size(s0, s1 + 1) <= bucket_tokens:
            s1 += 1
        b0, b1 = first[s0], first[s1]
        sub = BranchLayout(torch.tensor(cu[s0: s1 + 1]) - cu[s0], layout.anchors[b0:b1] - cu[s0],
                           layout.branch_lens[b0:b1], layout.context, layout.intra, layout.window, 1)
        out.append((sub, cu[s0], cu[s1], offs[b0], offs[b1]))
        s0 = s1
    return out


def dense_bucket_attention(q, k, v, bq, bk, bv, layout: BranchLayout, bucket_tokens: int = 128):
    """(out, bout) at CP = 1 through the dense oracle, bucket by bucket (the old CP = 1 path)."""
    if bq is None:
        bq, bk, bv = (t.new_zeros(0, *t.shape[1:]) for t in (q, k, v))
    outs, bouts = [], []
    for sub, m0, m1, b0, b1 in _buckets(layout, bucket_tokens):
        o, _, bo, _ = dense_branch_attention(q[m0:m1], k[m0:m1], v[m0:m1], bq[b0:b1], bk[b0:b1], bv[b0:b1], sub)
        outs.append(o)
        bouts.append(bo)
    return torch.cat(outs), torch.cat(bouts)


def _old_call(self: BranchAttention, q, k, v, bq, bk, bv):
    if q is None:  # the old drafters: all-zero main queries, their outputs discarded
        q = bq.new_zeros(k.shape[0], bq.shape[1], bq.shape[2])
        _, bout = _old_call(self, q, k, v, bq, bk, bv)
        return None, bout
    if self.ring:
        out, _, bout, _ = cp_branch_attention(q, k, v, bq, bk, bv, self.layout, self.group)
        return out, bout
    return dense_bucket_attention(q, k, v, bq, bk, bv, self.layout)


def _old_pass_attention(self: Eagle3Drafter, live: BranchLayout, group, t: int, trunk_kv, q, kvs):
    k = self.num_passes
    key = ("reference_ttt_layout", k)
    if key not in live._cache:  # the full TTT layout (k - 1 tokens per anchor), built once per forward
        live._cache[key] = eagle3_ttt_layout(live.cu_seqlens, k, positions=live.anchors, cp_size=live.cp_size)
    NB, nh, D = q.shape
    nkv = kvs[0][0].shape[1]
    pad = [q.new_zeros(NB, nkv, D)] * (k - 1 - t)
    bq = torch.stack([q.new_zeros(NB, nh, D)] * (t - 1) + [q] + [q.new_zeros(NB, nh, D)] * (k - 1 - t), 1)
    bk = torch.stack([kv[0] for kv in kvs] + pad, 1).reshape(-1, nkv, D)
    bv = torch.stack([kv[1] for kv in kvs] + pad, 1).reshape(-1, nkv, D)
    _, bout = BranchAttention(live._cache[key], group)(None, trunk_kv[0], trunk_kv[1], bq.reshape(-1, nh, D), bk, bv)
    return bout.view(NB, k - 1, nh, D)[:, t - 1]


@contextlib.contextmanager
def dense_attention():
    """Every BranchAttention call inside, and EAGLE-3's passes, run the old path (module doc);
    restored on exit."""
    new_call, new_pass = BranchAttention.__call__, Eagle3Drafter._pass_attention
    BranchAttention.__call__, Eagle3Drafter._pass_attention = _old_call, _old_pass_attention
    try:
        yield
    finally:
        BranchAttention.__call__, Eagle3Drafter._pass_attention = new_call, new_pass


# ----------------------------------------------------------------------------------------- losses
def _wmean(values: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    den = w.sum()
    if float(den) == 0.0:
        return values.sum() * 0.0
    return (values * w).sum() / den


def draft_loss(name: str, out: DraftOutput, p: torch.Tensor, labels: Optional[torch.Tensor] = None,
               l1_weight: float = 1.0, confidence_weight: float = 1.0, vocab=None) -> tuple[torch.Tensor, dict]:
    """The old ``draft_loss``: p (N, W, V) dense; metrics are Python floats."""
    p = p.detach()
    w, valid = out.loss_weight, out.valid
    if vocab is not None:
        r = vocab.restrict(p)
        p_ce, p_acc, ce_valid = r.p, r.p_on_draft, valid & r.in_vocab
        greedy = vocab.to_target(out.logits.argmax(-1))
        if labels is not None:
            labels = vocab.to_draft(labels)
    else:
        p_ce, p_acc, ce_valid = p, p, valid
        greedy = out.logits.argmax(-1)
    logq = F.log_softmax(out.logits.float(), dim=-1)
    q = logq.exp()
    metrics: dict = {}
    counted = ce_valid
    if name == "soft_ce":
        loss = _wmean(-(p_ce * logq).sum(-1), _weights(ce_valid, w))
    elif name == "forward_kl":
        loss = _wmean((torch.special.xlogy(p_ce, p_ce) - p_ce * logq).sum(-1), _weights(ce_valid, w))
    elif name == "hard_ce":
        counted = valid & (labels >= 0)
        loss = _wmean(-logq.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1), _weights(counted, w))
    elif name == "dspark_l1":
        ww = _weights(ce_valid, w)
        ce = _wmean(-(p_ce * logq).sum(-1), ww)
        l1 = (p_ce - q).abs().sum(-1)
        loss = ce + l1_weight * _wmean(l1, ww)
        metrics = {"ce": float(ce.detach()), "l1": float(_wmean(l1.detach(), ww))}
        if out.confidence is not None:
            label = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
            bce = F.binary_cross_entropy_with_logits(out.confidence.float(), label, reduction="none")
            conf_loss = _wmean(bce, ww)
            loss = loss + confidence_weight * conf_loss
            metrics["confidence_bce"] = float(conf_loss.detach())
    elif name == "e2e_tv":
        counted = valid
        a = torch.minimum(p_acc, q).sum(-1)
        a = torch.where(valid, a, torch.ones_like(a))
        loss = -_wmean(torch.cumprod(a, dim=-1), _weights(valid, w))
    else:
        raise ValueError(f"unknown drafter loss {name!r}")
    with torch.no_grad():
        metrics["overlap"] = float(_wmean(torch.minimum(p_acc, q).sum(-1), valid.float()))
        metrics["top1_match"] = float(_wmean((greedy == p.argmax(-1)).float(), valid.float()))
        if vocab is not None:
            metrics["in_vocab"] = float(_wmean(ce_valid.float(), valid.float()))
        kl = (torch.special.xlogy(p_ce, p_ce) - p_ce * logq).sum(-1)  # KL(p || q), p over the draft vocabulary
        metrics["kl"] = float(_wmean(kl, ce_valid.float()))
        metrics["kl_weight"] = float(ce_valid.float().sum())
    metrics["weight"] = float(_weights(counted, w).sum())
    metrics["loss"] = float(loss.detach())
    return loss, metrics
