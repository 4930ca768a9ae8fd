"""Zigzag sharding of packed sequences over a context-parallel (CP) group of C ranks.

Math (sequence s has length L_s and starts at offset cu[s] of the packed main sequence):

- Padding rule. For C > 1 each sequence is padded *at its end* to P_s = ceil(L_s / 2C) * 2C
  positions; for C == 1 nothing is padded (P_s = L_s). Padded positions p in [L_s, P_s) hold no
  token: sharding fills them with zeros, unsharding drops them, and attention ignores them (as keys
  they come after every real position, so no causal or branch rule can see them; as queries they are
  given an empty visible range, so their outputs are 0, their LSE is -inf and they receive and pass
  on no gradient).
- Chunks. The padded sequence is cut into 2C chunks of c_s = P_s / 2C positions; chunk i covers
  positions [i c_s, (i+1) c_s). (For C == 1 the whole sequence is a single run.)
- Rank r holds chunks r and 2C-1-r of every sequence, sequence by sequence:
      local(r) = concat_s [chunk_r(s), chunk_{2C-1-r}(s)],   len(local(r)) = sum_s P_s / C.
  Under a causal mask the queries of chunk i see about (i + 1/2) c_s keys, so pairing chunk r with
  chunk 2C-1-r gives every rank the same causal work, c_s^2 (2C-1) + c_s (c_s + 1) pairs per sequence.
- Ownership of anchors. Position p of sequence s lies in chunk i = p // c_s, owned by rank i if
  i < C, else by rank 2C-1-i. A branch lives on the rank that owns its anchor; rank r's branch
  tensors are the tokens of its branches, concatenated in increasing branch index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:  # pragma: no cover
    from cotrain.parallel.layout import BranchLayout


@dataclass(frozen=True)
class ZigzagRun:
    """One contiguous piece of a rank's shard: padded positions [start, stop) of sequence `seq`.

    `local_start` is where the piece begins in the rank's local tensor; `real_stop` =
    min(stop, L_seq) ends the real (non-padding) tokens, so the piece has real_stop - start real
    tokens (possibly none) followed by padding.
    """

    seq: int
    start: int
    stop: int
    real_stop: int
    local_start: int

    @property
    def num_real(self) -> int:
        return max(0, self.real_stop - self.start)


def padded_seqlens(seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """P_s = ceil(L_s / 2C) * 2C for C > 1, L_s for C == 1."""
    if cp_size == 1:
        return seqlens.clone()
    unit = 2 * cp_size
    return (seqlens + unit - 1) // unit * unit


def zigzag_runs(seqlens: torch.Tensor, cp_size: int, rank: int) -> list[ZigzagRun]:
    """The pieces of rank `rank`'s shard in local order (see the module docstring)."""
    if not 0 <= rank < cp_size:
        raise ValueError(f"rank must be in [0, {cp_size}), got {rank}")
    runs: list[ZigzagRun] = []
    local = 0
    for s, (length, padded) in enumerate(zip(seqlens.tolist(), padded_seqlens(seqlens, cp_size).tolist())):
        if cp_size == 1:
            runs.append(ZigzagRun(s, 0, length, length, local))
            local += length
            continue
        chunk = padded // (2 * cp_size)
        for i in (rank, 2 * cp_size - 1 - rank):
            start, stop = i * chunk, (i + 1) * chunk
            runs.append(ZigzagRun(s, start, stop, min(stop, length), local))
            local += chunk
    return runs


def zigzag_index(cu_seqlens: torch.Tensor, cp_size: int, rank: int) -> torch.Tensor:
    """For each row of rank `rank`'s shard, its index in the packed main sequence, or -1 (padding)."""
    seqlens = cu_seqlens[1:] - cu_seqlens[:-1]
    pieces = []
    for run in zigzag_runs(seqlens, cp_size, rank):
        pos = torch.arange(run.start, run.stop, dtype=torch.int64)
        idx = pos + int(cu_seqlens[run.seq])
        idx[pos >= run.real_stop] = -1
        pieces.append(idx)
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def zigzag_positions(seq_len: int, cp_size: int, rank: int) -> torch.Tensor:
    """The positions rank `rank` holds of a sequence of `seq_len` (divisible by 2C: no padding),
    in local order: chunks r and 2C-1-r. The layout of zigzag_index for one sequence."""
    if cp_size > 1 and seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context parallel size {cp_size}")
    return zigzag_index(torch.tensor([0, seq_len]), cp_size, rank)


def zigzag_split(x: torch.Tensor, cp_size: int, rank: int, dim: int) -> torch.Tensor:
    """Rank `rank`'s shard of `x` along its sequence dimension `dim` (size divisible by 2C): chunks
    r and 2C-1-r (what Megatron's get_batch_on_this_cp_rank gives a rank)."""
    return x.index_select(dim, zigzag_positions(x.shape[dim], cp_size, rank).to(x.device))


def zigzag_merge(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of zigzag_split: the whole sequences from every rank's shard (rank order)."""
    cp_size = len(parts)
    seq_len = sum(p.shape[dim] for p in parts)
    order = torch.cat([zigzag_positions(seq_len, cp_size, r) for r in range(cp_size)])
    stacked = torch.cat(list(parts), dim)
    return stacked.index_select(dim, torch.argsort(order).to(stacked.device))


def anchor_owner(cu_seqlens: torch.Tensor, anchors: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Rank that holds each anchor (a packed main position) under the zigzag layout."""
    if cp_size == 1 or anchors.numel() == 0:
        return torch.zeros_like(anchors)
    seqlens = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.searchsorted(cu_seqlens, anchors, right=True) - 1
    chunk = padded_seqlens(seqlens, cp_size)[seq] // (2 * cp_size)
    i = (anchors - cu_seqlens[seq]) // chunk
    return torch.where(i < cp_size, i, 2 * cp_size - 1 - i)


def zigzag_shard(x: torch.Tensor, layout: "BranchLayout", rank: int, dim: int = 0) -> torch.Tensor:
    """Rank `rank`'s zigzag shard of a packed main tensor (size layout.total_len along `dim`)."""
    if x.shape[dim] != layout.total_len:
        raise ValueError(
            f"main tensor has {x.shape[dim]} rows along dim {dim}, layout.total_len is {layout.total_len}"
        )
    idx = layout.zigzag_index(rank).to(x.device)
    real = idx >= 0
    out_shape = list(x.shape)
    out_shape[dim] = idx.numel()
    out = x.new_zeros(out_shape)
    # index_copy keeps this differentiable w.r.t. x (padding rows get no gradient).
    return out.index_copy(dim, real.nonzero().squeeze(1), x.index_select(dim, idx[real]))


def zigzag_unshard(shards: Sequence[torch.Tensor], layout: "BranchLayout", dim: int = 0) -> torch.Tensor:
    """Inverse of zigzag_shard: the packed main tensor from all ranks' shards (padding dropped)."""
    if len(shards) != layout.cp_size:
        raise ValueError(f"need {layout.cp_size} shards (layout.cp_size), got {len(shards)}")
    pieces, targets = [], []
    for rank, shard in enumerate(shards):
        idx = layout.zigzag_index(rank).to(shard.device)
        if shard.shape[dim] != idx.numel():
            raise ValueError(
                f"shard of rank {rank} has {shard.shape[dim]} rows along dim {dim}, "
                f"layout.local_len is {idx.numel()}"
            )
        real = idx >= 0
        pieces.append(shard.index_select(dim, real.nonzero().squeeze(1)))
        targets.append(idx[real])
    stacked = torch.cat(pieces, dim)
    order = torch.argsort(torch.cat(targets))
    return stacked.index_select(dim, order)


def shard_branches(x: torch.Tensor, layout: "BranchLayout", rank: int) -> torch.Tensor:
    """Rank `rank`'s rows of a packed branch tensor (size layout.total_branch_tokens along dim 0)."""
    if x.shape[0] != layout.total_branch_tokens:
        raise ValueError(
            f"branch tensor has {x.shape[0]} rows, layout.total_branch_tokens is {layout.total_branch_tokens}"
        )
    return x.index_select(0, layout.local_branch_token_index(rank).to(x.device))


def unshard_branches(shards: Sequence[torch.Tensor], layout: "BranchLayout") -> torch.Tensor:
    """Inverse of shard_branches: the packed branch tensor from all ranks' branch rows."""
    if len(shards) != layout.cp_size:
        raise ValueError(f"need {layout.cp_size} shards (layout.cp_size), got {len(shards)}")
    for rank, shard in enumerate(shards):
        expected = layout.local_branch_tokens(rank)
        if shard.shape[0] != expected:
            raise ValueError(f"branch shard of rank {rank} has {shard.shape[0]} rows, expected {expected}")
    idx = torch.cat([layout.local_branch_token_index(r) for r in range(layout.cp_size)])
    stacked = torch.cat(list(shards), 0)
    return stacked.index_select(0, torch.argsort(idx).to(stacked.device))
