"""Building blocks shared by the drafter families: inputs, outputs, layers, RoPE, branch attention.

Conventions (all drafters):

- A *batch* is S sequences packed back to back (``cu_seqlens``), ``input_ids`` (T,) holds every
  token; ``taps`` holds the target's tapped hidden states for each position, the tapped layers'
  states concatenated on the feature axis in ascending layer order (exactly what vLLM feeds a
  drafter's ``fc``; see :mod:`cotrain.draft.taps` for the layer-id convention).
- A drafter's training forward returns *draft chains*: chain n is what the drafter proposes after
  the bonus token at packed position ``bonus_pos[n]``; draft j (0-based) of the chain predicts the
  token at ``bonus_pos[n] + 1 + j``, so it is supervised by the target distribution at packed row
  ``target_rows[n, j] = bonus_pos[n] + j`` (target logits at row r predict token r+1). Rows that
  fall outside the sequence or are not supervised are marked invalid (``valid[n, j] = False``), and
  so is every draft after an invalid one: a chain ends at the first token that is not the policy's
  (a turn boundary of a multi-turn response).
  Losses (:mod:`cotrain.draft.losses`) and the acceptance estimator
  (:mod:`cotrain.draft.acceptance`) work on chains only, so they are family independent.
- Devices: index space (token ids, ``cu_seqlens``, masks, layouts, anchors) lives on the host; the
  values (taps, target logits, weights, activations) on the drafter's device. A drafter moves what
  enters its modules (ids into the embedding, RoPE positions) and its output (:class:`DraftOutput`)
  onto its device.
- Attention goes through :class:`BranchAttention`: the ring's kernel tiles at every CP size
  (``local_branch_attention`` at CP = 1, ``cp_branch_attention`` over a process group otherwise);
  with no main queries (``q=None``: DFlash/DSpark, EAGLE-3's passes 1..k-1) only the branch tiles
  are computed. Under CP > 1 every
  drafter consumes its rank's zigzag shard of the trunk (taps rows ``layout.local_len``) and the
  branches whose anchors it owns; token ids stay global (every rank has them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from cotrain.parallel import BranchLayout, cp_branch_attention, local_branch_attention


# ------------------------------------------------------------------------------------------ inputs
@dataclass
class DraftBatch:
    """Packed training sequences for a drafter.

    input_ids     (T,) int64, every token of every sequence (global, also under CP).
    cu_seqlens    (S+1,) int64 cumulative lengths.
    taps          (T, n_taps * target_hidden) at CP = 1; under CP the rank's zigzag shard
                  (layout.local_len rows, zeros on padding rows).
    loss_mask     (T,) bool: token t is supervised (a response token; in a multi-turn response
                  the policy's tokens, not the environment's replies); None = every token but the
                  first of each sequence.
    target_logits optional (T, V) target logits (row r = distribution of token r+1) at CP = 1.
    response_start optional (S,) in-sequence position of each sequence's first response token
                  (the first bonus token in serving); anchors of block drafters start there.
    """

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    taps: torch.Tensor
    loss_mask: Optional[torch.Tensor] = None
    target_logits: Optional[torch.Tensor] = None
    response_start: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        self.input_ids = torch.as_tensor(self.input_ids, dtype=torch.int64)
        self.cu_seqlens = torch.as_tensor(self.cu_seqlens, dtype=torch.int64)
        T = int(self.cu_seqlens[-1])
        if self.input_ids.shape != (T,):
            raise ValueError(f"input_ids has shape {tuple(self.input_ids.shape)}, cu_seqlens says {T} tokens")
        if self.loss_mask is None:
            m = torch.ones(T, dtype=torch.bool)
            m[self.cu_seqlens[:-1]] = False
            self.loss_mask = m
        self.loss_mask = torch.as_tensor(self.loss_mask, dtype=torch.bool)
        if self.response_start is None:
            self.response_start = torch.zeros(self.num_seqs, dtype=torch.int64)
        self.response_start = torch.as_tensor(self.response_start, dtype=torch.int64)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def seq_of(self) -> torch.Tensor:
        """(T,) sequence of each packed position."""
        return torch.repeat_interleave(torch.arange(self.num_seqs), self.cu_seqlens[1:] - self.cu_seqlens[:-1])

    @property
    def positions(self) -> torch.Tensor:
        """(T,) in-sequence position of each packed position."""
        return torch.arange(self.num_tokens) - self.cu_seqlens[self.seq_of]

    def seq_end(self) -> torch.Tensor:
        """(T,) packed end (exclusive) of the sequence of each position."""
        return self.cu_seqlens[1:][self.seq_of]


@dataclass
class DraftOutput:
    """Draft chains produced by a training forward (see the module docstring).

    logits       (N, W, V) drafter logits (in the target vocabulary).
    bonus_pos    (N,) packed position of each chain's bonus token.
    target_rows  (N, W) packed target row supervising each draft (bonus_pos + j), -1 when invalid.
    valid        (N, W) bool.
    confidence   optional (N, W) confidence-head logits (DSpark).
    loss_weight  optional (W,) per-draft-position weights (DFlash/DSpark gamma decay).

    Every field lives on the logits' device (the drafter's): the index fields, computed on the host
    from the batch and the layout, are moved there once, here, for the losses and the acceptance.
    """

    logits: torch.Tensor
    bonus_pos: torch.Tensor
    target_rows: torch.Tensor
    valid: torch.Tensor
    confidence: Optional[torch.Tensor] = None
    loss_weight: Optional[torch.Tensor] = None
    extras: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        dev = self.logits.device
        for name in ("bonus_pos", "target_rows", "valid", "confidence", "loss_weight"):
            v = getattr(self, name)
            if v is not None and v.device != dev:
                setattr(self, name, v.to(dev))

    @property
    def num_chains(self) -> int:
        return self.logits.shape[0]

    @property
    def width(self) -> int:
        return self.logits.shape[1]


def chain_rows(bonus_pos: torch.Tensor, width: int, batch: DraftBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """target_rows and valid for chains at ``bonus_pos`` (global packed positions, -1 = none)."""
    j = torch.arange(width)
    rows = bonus_pos[:, None] + j[None, :]
    ok = bonus_pos[:, None] >= 0
    end = torch.where(bonus_pos >= 0, batch.seq_end()[bonus_pos.clamp(min=0)], torch.zeros_like(bonus_pos))
    ok = ok & (rows + 1 < end[:, None])  # the predicted token rows+1 exists in the sequence
    tok = (rows + 1).clamp(max=batch.num_tokens - 1)
    ok = ok & batch.loss_mask[tok]
    # a chain stops at its first unsupervised token: a multi-turn response's environment reply ends
    # the policy's turn, and serving drafts no chain across it (single-turn: the supervised tokens
    # run to the end of the sequence, so this changes nothing)
    ok = torch.cummin(ok.to(torch.int8), dim=1).values.bool() if ok.numel() else ok
    return torch.where(ok, rows, torch.full_like(rows, -1)), ok


def turn_of(batch: DraftBatch) -> torch.Tensor:
    """(T,) the policy turn (1, 2, ...) of each supervised token, 0 on the others: a turn starts at a
    supervised token whose predecessor in its sequence is not supervised (a multi-turn response's
    environment reply, or the prompt, comes before it). A single-turn response is turn 1 throughout."""
    lm = batch.loss_mask
    if lm.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    starts_of_seq = batch.cu_seqlens[:-1][batch.cu_seqlens[:-1] < batch.num_tokens]
    prev = torch.zeros_like(lm)
    prev[1:] = lm[:-1]
    prev[starts_of_seq] = False
    start = (lm & ~prev).to(torch.int64)
    count = torch.cumsum(start, 0)
    before = torch.zeros(batch.num_seqs, dtype=torch.int64)  # turns started before each sequence
    ok = batch.cu_seqlens[:-1] < batch.num_tokens
    before[ok] = count[batch.cu_seqlens[:-1][ok]] - start[batch.cu_seqlens[:-1][ok]]
    return torch.where(lm, count - before[batch.seq_of], torch.zeros_like(count))


# ------------------------------------------------------------------------------------------ layers
class RMSNorm(nn.Module):
    """vLLM's / HF's RMSNorm: x * rsqrt(mean(x^2) + eps) * weight, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)


class SwiGLU(nn.Module):
    """Qwen3/Llama MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32):
    """cos, sin (N, head_dim) for neox-style RoPE (vLLM's default and HF's rotate_half), on the positions' device."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, heads, head_dim); cos/sin (N, head_dim)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :].to(x.dtype) + rot * sin[:, None, :].to(x.dtype)


class QKV(nn.Module):
    """q/k/v/o projections with optional per-head q/k RMSNorm (Qwen3) and neox RoPE."""

    def __init__(self, in_dim: int, hidden: int, heads: int, kv_heads: int, head_dim: int, qk_norm: bool,
                 eps: float, rope_theta: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rope_theta = heads, kv_heads, head_dim, rope_theta
        self.q_proj = nn.Linear(in_dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    def q(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        q = self.q_proj(x).view(x.shape[0], self.heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_proj(x).view(x.shape[0], self.kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).view(x.shape[0], self.kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.reshape(o.shape[0], self.heads * self.head_dim))


class BranchAttention:
    """Branch attention for one layout, called once per layer / pass of a drafter forward.

    Every CP size trains through the ring's kernel tiles (``cotrain.parallel``): exact causal /
    full trunk tiles (torch's fused CPU flash-attention op on CPU, flash-attn's varlen kernel on
    GPU) and block-diagonal branch-local attention, merged by LSE; nothing materialises a mask over
    all query-key pairs. CP > 1 (or an explicit group): ``cp_branch_attention`` on this rank's
    shards; CP = 1 without a group: ``local_branch_attention`` (the same tiles, no process group).
    The explicit-mask ``dense_branch_attention`` is the tests' oracle only (docs/drafters.md,
    "Training path", has the measurements behind this choice).
    No main queries (``q=None``; the main rows only give keys and values): only the branch queries'
    tiles are computed and the call returns ``(None, bout)``. bq/bk/bv must then be tensors (0 rows
    on a CP rank that owns no branch, which still takes part in the ring).
    """

    def __init__(self, layout: BranchLayout, group=None):
        self.layout, self.group = layout, group
        self.ring = not (layout.cp_size == 1 and group is None)

    def __call__(self, q, k, v, bq, bk, bv, with_lse: bool = False):
        """(out, bout): main and branch outputs (bq/bk/bv None when there are no branch tokens);
        q=None: no main queries, out is None (see the class docstring). with_lse: (out, bout, blse),
        blse (branch tokens, heads) fp32 and differentiable."""
        if self.ring:
            out, _, bout, blse = cp_branch_attention(q, k, v, bq, bk, bv, self.layout, self.group)
        else:
            out, _, bout, blse = local_branch_attention(q, k, v, bq, bk, bv, self.layout)
        return (out, bout, blse) if with_lse else (out, bout)


def init_linear_(module: nn.Module, std: float = 0.02, generator: Optional[torch.Generator] = None) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            with torch.no_grad():
                m.weight.normal_(0.0, std, generator=generator)
                if m.bias is not None:
                    m.bias.zero_()


def local_rows(layout: BranchLayout, rank: int) -> torch.Tensor:
    """Global packed index of each local trunk row (-1 for padding); arange(T) at CP = 1."""
    if layout.cp_size == 1:
        return torch.arange(layout.total_len)
    return layout.zigzag_index(rank)


def group_rank(group) -> int:
    import torch.distributed as dist

    if group is None:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return dist.get_rank(group)


def num_params(module: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def exp_decay_weights(width: int, gamma: Optional[float], offset: int = 0) -> Optional[torch.Tensor]:
    """DFlash's position decay: weight of draft j is exp(-(j + offset)/gamma); None when gamma is None."""
    if gamma is None:
        return None
    return torch.tensor([math.exp(-(j + offset) / gamma) for j in range(width)], dtype=torch.float32)


def select_sequences(batch: DraftBatch, seqs) -> DraftBatch:
    """A CP = 1 batch made of the given sequences of ``batch`` (in the given order)."""
    seqs = torch.as_tensor(seqs, dtype=torch.int64)
    cu = batch.cu_seqlens
    pieces = [torch.arange(int(cu[s]), int(cu[s + 1])) for s in seqs.tolist()]
    idx = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    lens = cu[seqs + 1] - cu[seqs]
    return DraftBatch(
        input_ids=batch.input_ids[idx],
        cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)]),
        taps=batch.taps[idx],
        loss_mask=batch.loss_mask[idx],
        target_logits=None if batch.target_logits is None else batch.target_logits[idx],
        response_start=batch.response_start[seqs],
    )
