"""BranchLayout: which query sees which key in branch attention, and builders for the drafter families.

Semantics (the single-process oracle `dense_branch_attention` implements exactly this):

- Main sequence: S sequences packed back to back, sequence s at packed positions [cu[s], cu[s+1]).
  Main token at position p of s attends to main tokens of s at positions k with
      k <= p                      (no window)
      p - window < k <= p         (window = w: the last w positions, itself included).
- Branch b belongs to the sequence holding its anchor a_b (a packed main position) and has W_b
  tokens. Let c_b = a_b (context="inclusive") or a_b - 1 (context="exclusive"), as a position in its
  sequence. Branch token (b, j), 0 <= j < W_b, attends to
    * main tokens of its sequence at positions k with k <= c_b (and c_b - window < k if a window is
      set: the window is counted back from the last visible context position), and
    * tokens (b, j') of its own branch with j' <= j (intra="causal") or any j' (intra="full").
  The window applies to main keys only; inside a branch the intra rule alone decides.
  Main tokens never see branch tokens. Every query sees at least itself, so no softmax is empty.

Drafter families:
- EAGLE-3 with train-time test (TTT), k passes: pass 0 is the main sequence; passes 1..k-1 at
  position p form a branch of k-1 tokens anchored at p, seeing the trunk up to p ("inclusive") and
  the earlier passes at p ("causal").
- DFlash, block size B: a block of B tokens at anchor a sees the trunk strictly before a
  ("exclusive") and all of its own block ("full").
- DSpark: DFlash's layout (same backbone and block attention; only its head differs).

The layout also carries the CP size it is sharded for (`cp_size`); `with_cp` re-targets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from cotrain.parallel import zigzag

CONTEXT_RULES = ("inclusive", "exclusive")
INTRA_RULES = ("causal", "full")

IntLike = Union[torch.Tensor, Sequence[int]]


def _as_index_tensor(name: str, value: IntLike) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.numel() == 0:
        t = t.to(torch.int64)  # an empty list comes in as float
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t.to(device="cpu", dtype=torch.int64).contiguous()


@dataclass(frozen=True, eq=False)
class BranchLayout:
    """Packed main sequences plus branches; see the module docstring for the attention rule.

    Fields:
      cu_seqlens   (S+1,) cumulative sequence lengths, cu[0] = 0, every length >= 1.
      anchors      (NB,) anchor of each branch, as a position in the packed main sequence.
      branch_lens  (NB,) tokens per branch, each >= 1.
      context      "inclusive" | "exclusive": does a branch see its anchor's main token.
      intra        "causal" | "full": attention among a branch's own tokens.
      window       None or w >= 1: sliding window over main keys.
      cp_size      CP group size the layout is sharded for (>= 1).
      branch_seqs  optional (NB,) sequence of each branch; if given, each anchor must lie in it.
    Branch tensors are packed branch after branch in branch index order (total_branch_tokens rows).
    """

    cu_seqlens: torch.Tensor
    anchors: torch.Tensor
    branch_lens: torch.Tensor
    context: str = "exclusive"
    intra: str = "full"
    window: Optional[int] = None
    cp_size: int = 1
    branch_seqs: Optional[torch.Tensor] = None
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        cu = _as_index_tensor("cu_seqlens", self.cu_seqlens)
        anchors = _as_index_tensor("anchors", self.anchors)
        lens = _as_index_tensor("branch_lens", self.branch_lens)
        if cu.numel() < 2 or int(cu[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0 and hold at least 2 entries, got {cu.tolist()}")
        seqlens = cu[1:] - cu[:-1]
        if bool((seqlens < 1).any()):
            bad = int(torch.nonzero(seqlens < 1)[0])
            raise ValueError(f"cu_seqlens: sequence {bad} has length {int(seqlens[bad])}; lengths must be >= 1")
        if anchors.numel() != lens.numel():
            raise ValueError(
                f"anchors has {anchors.numel()} entries but branch_lens has {lens.numel()}; one per branch"
            )
        if bool((lens < 1).any()):
            bad = int(torch.nonzero(lens < 1)[0])
            raise ValueError(f"branch_lens[{bad}] = {int(lens[bad])}; branch lengths must be >= 1")
        total = int(cu[-1])
        outside = (anchors < 0) | (anchors >= total)
        if bool(outside.any()):
            bad = int(torch.nonzero(outside)[0])
            raise ValueError(
                f"anchors[{bad}] = {int(anchors[bad])} lies outside the packed main sequence [0, {total})"
            )
        seqs = torch.searchsorted(cu, anchors, right=True) - 1
        if self.branch_seqs is not None:
            given = _as_index_tensor("branch_seqs", self.branch_seqs)
            if given.numel() != anchors.numel():
                raise ValueError(f"branch_seqs has {given.numel()} entries, expected {anchors.numel()} (one per branch)")
            if bool(((given < 0) | (given >= seqlens.numel())).any()):
                bad = int(torch.nonzero((given < 0) | (given >= seqlens.numel()))[0])
                raise ValueError(f"branch_seqs[{bad}] = {int(given[bad])}; sequences are 0..{seqlens.numel() - 1}")
            wrong = given != seqs
            if bool(wrong.any()):
                b = int(torch.nonzero(wrong)[0])
                s = int(given[b])
                raise ValueError(
                    f"anchors[{b}] = {int(anchors[b])} lies outside its sequence branch_seqs[{b}] = {s}, "
                    f"which holds packed positions [{int(cu[s])}, {int(cu[s + 1])})"
                )
        if self.context not in CONTEXT_RULES:
            raise ValueError(f"context must be one of {CONTEXT_RULES}, got {self.context!r}")
        if self.intra not in INTRA_RULES:
            raise ValueError(f"intra must be one of {INTRA_RULES}, got {self.intra!r}")
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"window must be None or an int >= 1, got {self.window!r}")
        if not isinstance(self.cp_size, int) or self.cp_size < 1:
            raise ValueError(f"cp_size must be an int >= 1, got {self.cp_size!r}")
        object.__setattr__(self, "cu_seqlens", cu)
        object.__setattr__(self, "anchors", anchors)
        object.__setattr__(self, "branch_lens", lens)
        object.__setattr__(self, "branch_seqs", seqs)

    # ----- sizes -------------------------------------------------------------------------------
    @property
    def seqlens(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def total_len(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def num_branches(self) -> int:
        return self.anchors.numel()

    @property
    def branch_offsets(self) -> torch.Tensor:
        """(NB+1,) where each branch starts in the packed branch tensor."""
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(self.branch_lens, 0)])

    @property
    def total_branch_tokens(self) -> int:
        return int(self.branch_lens.sum())

    @property
    def anchor_positions(self) -> torch.Tensor:
        """Anchor of each branch as a position inside its own sequence."""
        return self.anchors - self.cu_seqlens[self.branch_seqs]

    @property
    def context_last(self) -> torch.Tensor:
        """c_b: last main position (in its sequence) each branch sees; -1 when it sees none."""
        return self.anchor_positions - (1 if self.context == "exclusive" else 0)

    # ----- zigzag sharding ---------------------------------------------------------------------
    @property
    def padded_seqlens(self) -> torch.Tensor:
        return zigzag.padded_seqlens(self.seqlens, self.cp_size)

    @property
    def local_len(self) -> int:
        """Rows of every rank's main shard: sum_s P_s / C."""
        return int(self.padded_seqlens.sum()) // self.cp_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank must be in [0, {self.cp_size}) for layout.cp_size = {self.cp_size}, got {rank}")

    def zigzag_runs(self, rank: int) -> list[zigzag.ZigzagRun]:
        self._check_rank(rank)
        key = ("runs", rank)
        if key not in self._cache:
            self._cache[key] = zigzag.zigzag_runs(self.seqlens, self.cp_size, rank)
        return self._cache[key]

    def zigzag_index(self, rank: int) -> torch.Tensor:
        """Packed main index of each row of rank's shard, -1 for padding rows."""
        self._check_rank(rank)
        key = ("index", rank)
        if key not in self._cache:
            self._cache[key] = zigzag.zigzag_index(self.cu_seqlens, self.cp_size, rank)
        return self._cache[key]

    @property
    def branch_owner(self) -> torch.Tensor:
        """(NB,) rank that owns each branch: the one holding its anchor."""
        key = ("owner",)
        if key not in self._cache:
            self._cache[key] = zigzag.anchor_owner(self.cu_seqlens, self.anchors, self.cp_size)
        return self._cache[key]

    def local_branches(self, rank: int) -> torch.Tensor:
        """Indices of the branches rank owns, increasing."""
        self._check_rank(rank)
        return torch.nonzero(self.branch_owner == rank).squeeze(1)

    def local_branch_token_index(self, rank: int) -> torch.Tensor:
        """Rows of the packed branch tensor that rank holds, in local order."""
        key = ("btok", rank)
        if key not in self._cache:
            ids = self.local_branches(rank)
            offsets = self.branch_offsets
            pieces = [torch.arange(int(offsets[b]), int(offsets[b + 1])) for b in ids.tolist()]
            self._cache[key] = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
        return self._cache[key]

    def local_branch_tokens(self, rank: int) -> int:
        return int(self.branch_lens[self.local_branches(rank)].sum())

    def with_cp(self, cp_size: int) -> "BranchLayout":
        return BranchLayout(
            self.cu_seqlens, self.anchors, self.branch_lens, self.context, self.intra, self.window, cp_size
        )

    def subset(self, branch_ids: IntLike) -> "BranchLayout":
        """The same main sequences with only the given branches (in the given order)."""
        ids = _as_index_tensor("branch_ids", branch_ids)
        return BranchLayout(
            self.cu_seqlens, self.anchors[ids], self.branch_lens[ids], self.context, self.intra, self.window,
            self.cp_size,
        )


# ----- builders ----------------------------------------------------------------------------------

def cu_seqlens_from_lengths(seqlens: IntLike) -> torch.Tensor:
    lengths = _as_index_tensor("seqlens", seqlens)
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])


def spans(starts: IntLike, lengths: IntLike) -> torch.Tensor:
    """The positions [starts[i], starts[i] + lengths[i]) of every span i, concatenated in order (int64):
    e.g. the real positions of rows laid end to end (starts = the rows' offsets)."""
    starts, lengths = _as_index_tensor("starts", starts), _as_index_tensor("lengths", lengths)
    offsets = torch.cumsum(lengths, 0) - lengths  # where each span starts in the output
    return torch.repeat_interleave(starts - offsets, lengths) + torch.arange(int(lengths.sum()))


def eagle3_ttt_layout(
    cu_seqlens: IntLike,
    num_passes: int,
    positions: Optional[IntLike] = None,
    window: Optional[int] = None,
    cp_size: int = 1,
) -> BranchLayout:
    """EAGLE-3 train-time test with `num_passes` passes (pass 0 = the main sequence).

    One branch of num_passes - 1 tokens per anchor; anchors are every main position, or the packed
    `positions` given. Branch token j is pass j+1 at the anchor: it sees the trunk up to and
    including the anchor and passes 1..j+1 there (context="inclusive", intra="causal").
    """
    if not isinstance(num_passes, int) or num_passes < 1:
        raise ValueError(f"num_passes must be an int >= 1, got {num_passes!r}")
    cu = _as_index_tensor("cu_seqlens", cu_seqlens)
    anchors = torch.arange(int(cu[-1])) if positions is None else _as_index_tensor("positions", positions)
    if num_passes == 1:
        anchors = anchors[:0]
    anchors = torch.sort(anchors, stable=True).values
    lens = torch.full_like(anchors, num_passes - 1)
    return BranchLayout(cu, anchors, lens, context="inclusive", intra="causal", window=window, cp_size=cp_size)


def dflash_layout(
    cu_seqlens: IntLike,
    anchors: IntLike,
    block_size: int,
    window: Optional[int] = None,
    cp_size: int = 1,
    branch_seqs: Optional[IntLike] = None,
) -> BranchLayout:
    """DFlash: a block of `block_size` tokens at each anchor (packed positions), in the given order.

    A block sees the trunk strictly before its anchor and all of its own tokens
    (context="exclusive", intra="full").
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    a = _as_index_tensor("anchors", anchors)
    return BranchLayout(
        cu_seqlens, a, torch.full_like(a, block_size), context="exclusive", intra="full", window=window,
        cp_size=cp_size, branch_seqs=branch_seqs,
    )


def dspark_layout(
    cu_seqlens: IntLike,
    anchors: IntLike,
    block_size: int,
    window: Optional[int] = None,
    cp_size: int = 1,
    branch_seqs: Optional[IntLike] = None,
) -> BranchLayout:
    """DSpark: DFlash's layout (anchor + block_size - 1 noise tokens per block)."""
    return dflash_layout(cu_seqlens, anchors, block_size, window, cp_size, branch_seqs)


def draw_anchors(
    candidates: torch.Tensor,
    seq_of: torch.Tensor,
    num_seqs: int,
    per_seq: int,
    generator: Union[None, torch.Generator, Sequence[torch.Generator]] = None,
    draw_when_all_fit: bool = False,
) -> torch.Tensor:
    """The one anchor sampler: up to ``per_seq`` distinct anchors per sequence among ``candidates``
    (ascending packed positions; ``seq_of`` their sequences), returned sorted.

    Sequence s with candidates c (n of them) keeps ``sort(c[randperm(n, g_s)[:per_seq]])``, g_s being
    ``generator`` (one stream, sequences in order) or ``generator[s]`` (one per sequence). With
    n <= per_seq it keeps all of c, drawing (advancing the stream) only if ``draw_when_all_fit``
    and n > 0.
    """
    out = []
    for s in range(num_seqs):
        c = candidates[seq_of == s]
        if c.numel() > per_seq or (draw_when_all_fit and c.numel() > 0):
            g = generator[s] if isinstance(generator, Sequence) else generator
            c = torch.sort(c[torch.randperm(c.numel(), generator=g)[:per_seq]]).values
        out.append(c)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def sample_anchors(
    cu_seqlens: IntLike,
    per_seq: int,
    generator: Optional[torch.Generator] = None,
    min_position: int = 0,
) -> torch.Tensor:
    """Up to `per_seq` distinct random anchors per sequence at in-sequence positions >= min_position,
    returned as sorted packed positions (sequences too short for any anchor get none): `draw_anchors`
    over every such position, one stream drawn for every non-empty sequence."""
    cu = _as_index_tensor("cu_seqlens", cu_seqlens)
    lengths = (cu[1:] - cu[:-1] - min_position).clamp(min=0)
    seq_of = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    candidates = spans(cu[:-1] + min_position, lengths)
    return draw_anchors(candidates, seq_of, lengths.numel(), per_seq, generator, draw_when_all_fit=True)
