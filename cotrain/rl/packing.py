"""Packed micro batches: the update's sequences laid end to end (THD), filled by a token budget.

A step's :class:`~cotrain.rl.batch.TrainBatch` holds N right-padded rows [N, S]. The packed update
runs each micro batch as one row instead: its sequences s (batch row r_s, L_s = lengths[r_s]
positions: prompt and response) end to end, each padded at its end to P_s = ceil(L_s / 2C) * 2C
under context parallelism C > 1 (the zigzag rule of :mod:`cotrain.parallel.zigzag`; P_s = L_s at
C = 1), with

    cu_seqlens        = [0, L_0, L_0 + L_1, ...]      real lengths (attention; the drafter's rows)
    cu_seqlens_padded = [0, P_0, P_0 + P_1, ...]      where each sequence starts in the packed row

so that attention stays inside each sequence and rotary positions restart at 0 for each
(Megatron's THD path: ``PackedSeqParams``). A CP rank holds chunks r and 2C-1-r of every sequence
(:func:`~cotrain.parallel.zigzag.zigzag_index`): sum_s P_s / C positions.

Assignment, longest processing time first (LPT, Graham's rule: within 4/3 of the best largest
load): the sequences of a (mini-)batch are taken in decreasing P_s (ties: lower row first), each
to the data-parallel rank with the fewest tokens so far (ties: lower rank); then on each rank, the
same way, into micro batches of at most ``budget`` tokens: the fewest bins m = ceil(tokens /
budget), m + 1, ... for which LPT fits. The plan depends on the lengths alone, so every rank of the
world computes the same one.

At PP > 1 Megatron's schedule sends tensors of one fixed shape between stages: every micro batch
of a rank is then filled to the rank's longest (``width``) by one filler sequence of padding (its
own attention block, masked out of every loss).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from cotrain.parallel.layout import spans
from cotrain.parallel.zigzag import padded_seqlens, zigzag_index


def lpt(sizes: list[int], bins: int) -> list[list[int]]:
    """Indices of ``sizes`` in ``bins`` groups by LPT (see the module doc); each group sorted."""
    heap = [(0, b) for b in range(bins)]
    groups: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, b = heapq.heappop(heap)
        groups[b].append(i)
        heapq.heappush(heap, (load + sizes[i], b))
    return [sorted(g) for g in groups]


def plan_micro_batches(lengths: list[int], dp: int, budget: int, cp: int = 1) -> list[list[list[int]]]:
    """``plan[d][m]``: rows (indices into ``lengths``) of micro batch m on data-parallel rank d.
    Every rank gets at least one sequence (needs len(lengths) >= dp); no micro batch exceeds
    ``budget`` padded tokens (each sequence must fit alone)."""
    sizes = padded_seqlens(torch.tensor(lengths, dtype=torch.int64), cp).tolist()
    if len(sizes) < dp:
        raise ValueError(f"{len(sizes)} sequences cannot fill {dp} data-parallel ranks")
    too_long = [s for s in sizes if s > budget]
    if too_long:
        raise ValueError(f"a sequence of {max(too_long)} tokens exceeds the micro batch token budget {budget} "
                         "(policy.max_tokens_per_microbatch)")
    plan = []
    for rows in lpt(sizes, dp):
        mine = [sizes[r] for r in rows]
        m = max(1, -(-sum(mine) // budget))
        while True:
            bins = [g for g in lpt(mine, m) if g]
            if all(sum(mine[i] for i in g) <= budget for g in bins):
                break
            m += 1
        plan.append([[rows[i] for i in g] for g in bins])
    return plan


@dataclass
class PackedMicro:
    """One packed micro batch on one CP rank (T = this rank's positions: sum_s P_s / C, filler included).

    inputs, targets      [1, T]  token ids, next tokens (0 on padding)
    mask                 [1, T]  float, 1 on response targets
    advantages           [1, T]  the sequence's advantage at each of its positions
    old_logprobs         [1, T]  or None (as ref_logprobs, is_weights)
    seq                  [1, T]  int64, the position's sequence in ``rows`` (-1: padding, filler)
    grid                 [T]     int64, the position's index in the batch's flattened [N, S] grid (-1: none)
    rows                 [n]     the sequences' rows in the batch
    lengths, widths      [n]     L_s (real positions), P_s (positions in the packed row)
    seq_tokens           [n]     response targets of each whole sequence (seq_mean's divisor under CP)
    num_real             int     positions of the real sequences on this rank, sum_s P_s / C
    width                int     the whole packed row before the CP split (P_s summed, filler included)
    packed_seq_params    Megatron's PackedSeqParams (qkv_format 'thd')
    grid_width           int     S of the batch ``grid`` indexes
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    seq: torch.Tensor
    grid: torch.Tensor
    rows: torch.Tensor
    lengths: torch.Tensor
    widths: torch.Tensor
    seq_tokens: torch.Tensor
    num_real: int
    width: int
    packed_seq_params: object
    grid_width: int
    is_weights: torch.Tensor | None = None

    def __len__(self) -> int:  # sequences (Megatron's micro batch is one packed row)
        return len(self.rows)

    @property
    def seq_len(self) -> int:
        return self.inputs.shape[1]

    def positions(self) -> torch.Tensor:
        """[1, T] each position's place in its own sequence (rotary restarts per sequence in Megatron's
        THD path; this is for models with learned absolute positions)."""
        pos = torch.zeros(self.seq_len, dtype=torch.int64, device=self.inputs.device)
        valid = self.grid >= 0
        pos[valid] = self.grid[valid] % self.grid_width
        return pos[None]

    def to(self, device: torch.device | str) -> "PackedMicro":
        """Every tensor on ``device`` (the trainer's one move of a micro batch; ``rows``, ``lengths``,
        ``widths`` stay on the host: they index the batch)."""
        from dataclasses import fields, replace

        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if f.name not in ("rows", "lengths", "widths") and isinstance(getattr(self, f.name), torch.Tensor)}
        p = self.packed_seq_params
        params = type(p)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(p).items()})
        return replace(self, **moved, packed_seq_params=params)

    def scatter(self, values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write per-position ``values`` [1, T] into ``out`` [N, S] (the batch's grid) at this rank's real
        positions; returns ``out``."""
        valid = self.grid >= 0
        out.view(-1)[self.grid[valid]] = values.reshape(-1)[valid].to(out.dtype)
        return out


def pack(batch, rows: list[int], cp: int = 1, rank: int = 0, width: int | None = None) -> PackedMicro:
    """The packed micro batch of ``batch``'s ``rows`` on CP rank ``rank`` (tensors on the batch's device);
    ``width``: fill the packed row to this many positions (PP > 1: every micro batch alike)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    dev = batch.inputs.device
    idx = torch.tensor(rows, dtype=torch.int64)
    S = batch.seq_len
    lengths = batch.lengths[idx.to(batch.lengths.device)].cpu().to(torch.int64)
    widths = padded_seqlens(lengths, cp)
    real_len = int(widths.sum())
    seq_lens = lengths.tolist()
    pad_lens = widths.tolist()
    if width is not None and width > real_len:
        unit = 2 * cp if cp > 1 else 1
        if (width - real_len) % unit:
            raise ValueError(f"packed width {width} - {real_len} is not a multiple of {unit}")
        seq_lens.append(width - real_len)  # the filler: one sequence of padding
        pad_lens.append(width - real_len)
    cu = torch.tensor([0] + seq_lens, dtype=torch.int64).cumsum(0)
    cu_pad = torch.tensor([0] + pad_lens, dtype=torch.int64).cumsum(0)
    # every position of the packed main sequence (cu's coordinates) -> its grid index and sequence (-1: filler)
    filler = torch.full((int(cu[-1]) - int(lengths.sum()),), -1, dtype=torch.int64)
    main_grid = torch.cat([spans(idx * S, lengths), filler])
    main_seq = torch.cat([torch.repeat_interleave(torch.arange(len(rows)), lengths), filler])
    local = zigzag_index(cu, cp, rank)  # this rank's positions in the packed main sequence, -1 = padding
    grid = torch.where(local >= 0, main_grid[local.clamp(min=0)], -1)
    seq = torch.where(local >= 0, main_seq[local.clamp(min=0)], -1)
    grid_d, valid = grid.to(dev), (grid >= 0).to(dev)

    def take(x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        flat = x.reshape(-1)
        return torch.where(valid, flat[grid_d.clamp(min=0)], torch.zeros((), dtype=x.dtype, device=dev))[None]

    seq_d = seq.to(dev)
    adv = batch.advantages.to(dev)[idx.to(dev)]
    advantages = torch.where(seq_d >= 0, adv[seq_d.clamp(min=0)], torch.zeros((), device=dev))[None]
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu.to(torch.int32).to(dev), cu_seqlens_kv=cu.to(torch.int32).to(dev),
        cu_seqlens_q_padded=cu_pad.to(torch.int32).to(dev), cu_seqlens_kv_padded=cu_pad.to(torch.int32).to(dev),
        max_seqlen_q=int(max(pad_lens)), max_seqlen_kv=int(max(pad_lens)))
    return PackedMicro(
        inputs=take(batch.inputs), targets=take(batch.targets), mask=take(batch.mask), advantages=advantages,
        old_logprobs=take(batch.old_logprobs), ref_logprobs=take(batch.ref_logprobs), seq=seq_d[None], grid=grid_d,
        rows=idx, lengths=lengths, widths=widths, seq_tokens=batch.mask[idx.to(batch.mask.device)].sum(dim=1),
        num_real=real_len // cp, width=int(cu_pad[-1]), packed_seq_params=params, grid_width=S,
        is_weights=take(batch.is_weights))


def rank_micro_batches(batch, budget: int, dp: int, dp_rank: int, cp: int = 1, cp_rank: int = 0,
                       same_width: bool = False) -> list[PackedMicro]:
    """This rank's packed micro batches of ``batch`` (the plan of :func:`plan_micro_batches`); with
    ``same_width`` (PP > 1) all filled to the longest of them."""
    mine = plan_micro_batches(batch.lengths.tolist(), dp, budget, cp)[dp_rank]
    width = None
    if same_width:
        widths = padded_seqlens(batch.lengths.cpu().to(torch.int64), cp)
        width = max(int(widths[rows].sum()) for rows in mine)
    return [pack(batch, rows, cp, cp_rank, width) for rows in mine]
