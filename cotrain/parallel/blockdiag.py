"""Block-diagonal attention: the branch-local part of branch attention (the intra rule).

Branch b holds rows [o_b, o_b + W_b) of a rank's branch tensors. Its queries see its own keys
only: all W_b of them (intra="full") or j' <= j (intra="causal"):

    out_i = sum_{j in blk(i), allowed} softmax_j(scale q_i . k_j) v_j,   lse_i = log sum_{j in blk(i), allowed} exp(scale q_i . k_j)

so the work is sum_b W_b^2 query-key pairs (full) or sum_b W_b (W_b + 1) / 2 (causal), never the
(sum_b W_b)^2 of one tile spanning several branches. Branches of equal length form one batched
attention of shape (m, W, ...) (rows gathered by index), so a layout whose branches all have the
same length (DFlash, DSpark, EAGLE-3 TTT) costs one batched call, whatever the number of branches.
Every row sees at least itself, so no softmax is empty.

Forward and backward are the kernels' math (cotrain.parallel.kernels) restricted to the blocks:
    P = exp(S - lse),  delta = rowsum(dout * out) - dlse,  dS = P * (dout v^T - delta),
    dq = scale dS k,  dk = scale dS^T q,  dv = P^T dout,
with the rows' final (merged) out and lse in the backward. Computed in fp32, or fp64 for fp64 inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp64 for fp64 inputs, fp32 otherwise (fp32, bf16, fp16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class BlockDiagonal:
    """Branches as diagonal blocks of the local branch rows.

    offsets (n+1,) where each branch starts (CPU); causal: the intra rule;
    groups: one (W, rows) per distinct branch length W, rows (m, W) the row indices of the m
    branches of that length (on the compute device).
    """

    offsets: torch.Tensor
    causal: bool
    groups: list[tuple[int, torch.Tensor]]

    @classmethod
    def from_lengths(cls, lens: torch.Tensor, causal: bool, device: torch.device | str = "cpu") -> "BlockDiagonal":
        lens = torch.as_tensor(lens, dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)])
        groups = []
        for w in torch.unique(lens).tolist():
            starts = offsets[:-1][lens == w]
            groups.append((int(w), (starts[:, None] + torch.arange(w)[None, :]).to(device)))
        return cls(offsets, causal, groups)

    @property
    def lens(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def pairs_computed(self) -> int:
        """Query-key pairs the blocks hand to the kernel: W^2 per branch, W(W+1)/2 when causal."""
        w = self.lens
        return int((w * (w + 1) // 2).sum()) if self.causal else int((w * w).sum())

    def to(self, device: torch.device | str) -> "BlockDiagonal":
        return BlockDiagonal(self.offsets, self.causal, [(w, rows.to(device)) for w, rows in self.groups])


def _gather(x: torch.Tensor, rows: torch.Tensor, hk: int, ctype: torch.dtype) -> torch.Tensor:
    """(N, h, D) rows (m, W) -> (m, hk, h // hk, W, D) in ctype."""
    m, w = rows.shape
    h, d = x.shape[1], x.shape[2]
    return x[rows].to(ctype).reshape(m, w, hk, h // hk, d).permute(0, 2, 3, 1, 4)


def _scatter(dst: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
    """dst[rows] = x for x (m, hk, g, W, ...) laid out as _gather makes it."""
    m, hk, g, w = x.shape[:4]
    flat = x.permute(0, 3, 1, 2, *range(4, x.dim())).reshape(m * w, hk * g, *x.shape[4:])
    dst.index_copy_(0, rows.reshape(-1), flat)


def _scores(q, k, rows, hk, scale, causal, ctype):
    qg = _gather(q, rows, hk, ctype)  # (m, Hk, g, W, D)
    kg = _gather(k, rows, hk, ctype)  # (m, Hk, 1, W, D)
    s = torch.matmul(qg, kg.transpose(-1, -2)).mul_(scale)  # (m, Hk, g, W, W)
    if causal:
        w = rows.shape[1]
        upper = torch.ones(w, w, dtype=torch.bool, device=s.device).triu_(1)
        s.masked_fill_(upper, float("-inf"))
    return qg, kg, s


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: BlockDiagonal, scale: float):
    """q (N, H, D), k/v (N, Hk, D) -> out (N, H, D), lse (N, H) in the compute dtype."""
    n, h, d = q.shape
    hk = k.shape[1]
    ctype = compute_dtype(q.dtype)
    out = torch.zeros(n, h, d, dtype=ctype, device=q.device)
    lse = torch.full((n, h), float("-inf"), dtype=ctype, device=q.device)
    for _, rows in blocks.groups:
        _, _, s = _scores(q, k, rows, hk, scale, blocks.causal, ctype)
        block_lse = torch.logsumexp(s, dim=-1)  # (m, Hk, g, W), finite: every row sees itself
        p = s.sub_(block_lse.unsqueeze(-1)).exp_()
        _scatter(out, rows, torch.matmul(p, _gather(v, rows, hk, ctype)))
        _scatter(lse, rows, block_lse)
    return out, lse


def backward(dout, q, k, v, out, lse, blocks: BlockDiagonal, scale: float, dlse: Optional[torch.Tensor] = None):
    """Gradients w.r.t. q, k, v (compute dtype) given the rows' final out and lse."""
    hk = k.shape[1]
    ctype = compute_dtype(q.dtype)
    delta = (dout.to(ctype) * out.to(ctype)).sum(-1)  # (N, H)
    if dlse is not None:
        delta = delta - dlse.to(ctype)
    dq = torch.zeros(q.shape, dtype=ctype, device=q.device)
    dk = torch.zeros(k.shape, dtype=ctype, device=k.device)
    dv = torch.zeros(v.shape, dtype=ctype, device=v.device)
    for _, rows in blocks.groups:
        qg, kg, s = _scores(q, k, rows, hk, scale, blocks.causal, ctype)
        p = s.sub_(_gather(lse.unsqueeze(-1), rows, hk, ctype)).exp_()  # (m, Hk, g, W, W)
        do = _gather(dout, rows, hk, ctype)  # (m, Hk, g, W, D)
        dp = torch.matmul(do, _gather(v, rows, hk, ctype).transpose(-1, -2))
        ds = dp.sub_(_gather(delta.unsqueeze(-1), rows, hk, ctype)).mul_(p)
        _scatter(dq, rows, torch.matmul(ds, kg).mul_(scale))
        _scatter(dk, rows, torch.matmul(ds.transpose(-1, -2), qg).sum(2, keepdim=True).mul_(scale))
        _scatter(dv, rows, torch.matmul(p.transpose(-1, -2), do).sum(2, keepdim=True))
    return dq, dk, dv
