"""Causal self-attention over packed sequences, batched by length (no loop per sequence).

Packed rows hold sequences s end to end (``cu_seqlens``, lengths L_s); each position t of s attends
causally within s:

    out[t] = softmax(scale * q_t K_s[:t+1]^T) V_s[:t+1]

Sorted by length, the sequences are grouped into buckets whose lengths lie within a factor
``ratio`` of the bucket's shortest; a bucket is gathered into [n_b, heads, L_b, d] (L_b its
longest; shorter sequences padded at their end with zero rows), run through torch's
``scaled_dot_product_attention`` (is_causal, grouped-query heads) and gathered back. Padding rows
come after every real position of their sequence, so as keys the causal mask hides them from every
real query, and as queries they are dropped: each sequence's output is a function of its own rows
alone. The padded attention area of a bucket is at most ``ratio``^2 times its real one, and there
are about log(L_max / L_min) / log(ratio) buckets: a handful of batched calls where a per-sequence
kernel makes one per sequence (hundreds for a batch of short responses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class VarlenPlan:
    """The buckets of one ``cu_seqlens``: ``index[b]`` [n_b, L_b] rows of the packed tensor (T = padding,
    a zero row appended), ``order`` the packed position of each gathered real row, ``inverse`` its
    inverse permutation."""

    def __init__(self, cu_seqlens: torch.Tensor, ratio: float = 1.25):
        cu = cu_seqlens.to("cpu", torch.int64)
        lens = (cu[1:] - cu[:-1]).tolist()
        total = int(cu[-1])
        seqs = sorted((s for s in range(len(lens)) if lens[s] > 0), key=lambda s: lens[s])
        groups: list[list[int]] = []
        for s in seqs:
            if groups and lens[s] <= ratio * lens[groups[-1][0]]:
                groups[-1].append(s)
            else:
                groups.append([s])
        self.index, real = [], []
        for g in groups:
            width = max(lens[s] for s in g)
            pos = torch.arange(width)
            rows = torch.stack([torch.where(pos < lens[s], int(cu[s]) + pos, torch.tensor(total)) for s in g])
            self.index.append(rows)
            real.append(rows[rows < total])
        order = torch.cat(real) if real else torch.zeros(0, dtype=torch.int64)
        self.total = total
        self.inverse = torch.empty_like(order)
        self.inverse[order] = torch.arange(order.numel())
        self.num_buckets = len(groups)


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: VarlenPlan,
                            scale: float) -> torch.Tensor:
    """q [T, hq, d], k / v [T, hk, d] (hq a multiple of hk) packed as ``plan`` says -> [T, hq, d];
    differentiable in q, k, v."""
    if q.shape[0] != plan.total:
        raise ValueError(f"{q.shape[0]} packed rows, the plan's cu_seqlens hold {plan.total}")
    pad = lambda x: torch.cat([x, x.new_zeros(1, *x.shape[1:])])  # noqa: E731  row T: the padding
    qp, kp, vp = pad(q), pad(k), pad(v)
    outs = []
    for rows in plan.index:
        idx = rows.to(q.device)
        take = lambda x: x[idx].transpose(1, 2)  # noqa: E731  [n_b, L_b, h, d] -> [n_b, h, L_b, d]
        o = F.scaled_dot_product_attention(take(qp), take(kp), take(vp), is_causal=True, scale=scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        o = o.transpose(1, 2)  # [n_b, L_b, hq, d]
        outs.append(o[(rows < plan.total).to(q.device)])
    return torch.cat(outs)[plan.inverse.to(q.device)]
