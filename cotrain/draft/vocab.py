"""Reduced draft vocabulary of EAGLE-3 drafters (``draft.eagle3.draft_vocab_size``): the d2t mapping.

A real target has a 150k-token vocabulary; an EAGLE-3 drafter with a head over all of it spends
most of its step in the head and the loss. With a *draft vocabulary* of N << V tokens (SpecForge
and vLLM default to 32k) the drafter's LM head has N rows and its loss N columns; draft id i stands
for target token ``target_ids[i]``.

**Format (vLLM 0.32, ``llama_eagle3.Eagle3LlamaForCausalLM``).** The checkpoint carries ``d2t``,
int64 of shape (N,), with target id = draft id + ``d2t[draft id]``; the config's
``draft_vocab_size`` is N, ``vocab_size`` stays the target's. vLLM loads ``d2t`` into
``draft_id_to_target_id`` (a long tensor) whenever N differs from the target's vocabulary, and
``compute_logits`` scatters the N draft logits into a V-wide row filled with -inf: a target token
outside the draft vocabulary can never be drafted (greedy or sampled). ``t2d`` (SpecForge's bool
mask over the target vocabulary) is skipped by vLLM's loader, so cotrain does not write it (every
run-time push would have to carry V more values); :meth:`DraftVocab.t2d` gives it for training.
The draft ids follow ascending target ids (SpecForge's order), so ``d2t`` is non-decreasing.

**Built from token frequencies** (:meth:`DraftVocab.from_counts`): the N most frequent tokens among
the supervised tokens (the tokens drafts predict: response tokens), ties and unseen tokens by
ascending id, then sorted by id - SpecForge's ``process_token_dict_to_mappings``, made
deterministic. Offline (``cotrain.draft.distill``): the distillation data's response tokens. In
co-training (``cotrain.draft.online``): the rollout tokens; see ``draft.eagle3.vocab_rebuild_every``
for when the mapping may change, and :meth:`remap_rows` for how the head follows it.

**Training against the reduced vocabulary** (:meth:`DraftVocab.restrict`), as SpecForge defines it
(``specforge/algorithms/eagle3/model.py``, ``_compute_target_p``): the target distribution is
restricted to the draft tokens and *renormalised* (the cross-entropy target), and positions whose
target greedy token is outside the draft vocabulary are dropped from the loss (the drafter cannot
propose it; there is nothing to learn there). The restricted but *not* renormalised probabilities
(SpecForge's ``target_p_on_draft``) measure acceptance: sum_v min(p_v, q_v) over the draft tokens,
the mass outside counting as never accepted - :mod:`cotrain.draft.losses` uses them for ``e2e_tv``
and the overlap metric.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SOURCES = ("placeholder", "counts", "checkpoint")


@dataclass(frozen=True)
class RestrictedTarget:
    """A target distribution seen through a draft vocabulary (shapes (..., N) and (...))."""

    p: torch.Tensor  # restricted to the draft tokens and renormalised: the cross-entropy target
    p_on_draft: torch.Tensor  # restricted, not renormalised: acceptance (the mass outside is never accepted)
    in_vocab: torch.Tensor  # bool: the target's greedy token is a draft token (else the position is dropped)


@dataclass(frozen=True)
class DraftVocab:
    """The draft vocabulary: ``target_ids`` (N,) int64, strictly ascending, of a V-token target.

    ``source``: ``placeholder`` (the first N ids: a drafter built without data, to be replaced by
    a mapping built from tokens), ``counts`` (built from token frequencies) or ``checkpoint``
    (read from a ``d2t``). ``version`` counts rebuilds during co-training."""

    target_ids: torch.Tensor
    vocab_size: int
    source: str = "counts"
    version: int = 0

    def __post_init__(self) -> None:
        ids = torch.as_tensor(self.target_ids, dtype=torch.int64).detach().cpu().contiguous()
        object.__setattr__(self, "target_ids", ids)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"draft vocabulary: target_ids must be a non-empty vector, got shape {tuple(ids.shape)}")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("draft vocabulary: target ids must be strictly ascending (d2t >= 0, non-decreasing)")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.vocab_size:
            raise ValueError(f"draft vocabulary: target ids must lie in 0..{self.vocab_size - 1}, got "
                             f"{int(ids[0])}..{int(ids[-1])}")
        if self.source not in SOURCES:
            raise ValueError(f"draft vocabulary: source {self.source!r} (allowed: {', '.join(SOURCES)})")

    # ------------------------------------------------------------------ construction
    @classmethod
    def first(cls, size: int, vocab_size: int) -> "DraftVocab":
        """The placeholder: target ids 0..size-1 (what a frequency table with no counts gives)."""
        return cls(torch.arange(size), vocab_size, source="placeholder")

    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int, version: int = 0) -> "DraftVocab":
        """The ``size`` most frequent tokens of ``counts`` (V,) (ties and unseen tokens: lower id first)."""
        counts = torch.as_tensor(counts).detach().cpu().double()
        V = counts.numel()
        if not 1 <= size <= V:
            raise ValueError(f"draft vocabulary size {size} is not in 1..{V} (the target's vocabulary)")
        order = torch.sort(-counts, stable=True).indices  # descending counts, ascending id among ties
        return cls(torch.sort(order[:size]).values, V, source="counts", version=version)

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int, version: int = 0) -> "DraftVocab":
        """From vLLM's ``d2t`` (target id = draft id + d2t[draft id])."""
        d2t = torch.as_tensor(d2t).detach().cpu()
        if d2t.dtype.is_floating_point:
            raise ValueError(f"d2t must hold integers, got {d2t.dtype}")
        d2t = d2t.to(torch.int64)
        return cls(torch.arange(d2t.numel()) + d2t, vocab_size, source="checkpoint", version=version)

    # ------------------------------------------------------------------ views
    @property
    def size(self) -> int:
        return self.target_ids.numel()

    @property
    def d2t(self) -> torch.Tensor:
        """vLLM's ``d2t`` (N,) int64: target id = draft id + d2t[draft id]."""
        return self.target_ids - torch.arange(self.size)

    @property
    def t2d(self) -> torch.Tensor:
        """SpecForge's ``t2d`` (V,) bool: whether each target token is a draft token."""
        m = torch.zeros(self.vocab_size, dtype=torch.bool)
        m[self.target_ids] = True
        return m

    @property
    def draft_index(self) -> torch.Tensor:
        """(V,) int64: the draft id of each target token, -1 outside the draft vocabulary."""
        idx = torch.full((self.vocab_size,), -1, dtype=torch.int64)
        idx[self.target_ids] = torch.arange(self.size)
        return idx

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids (any shape)."""
        return self.target_ids.to(draft_ids.device)[draft_ids]

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids of target ids (-1 outside the draft vocabulary, and for negative ids)."""
        idx = self.draft_index.to(target_ids.device)
        return torch.where(target_ids >= 0, idx[target_ids.clamp(min=0)], torch.full_like(target_ids, -1))

    def spread(self, q: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary distributions ``q`` (..., draft size) over the target's ids (..., V): column
        ``to_target(i)`` holds q[..., i], every other target token 0 (what vLLM's EAGLE-3 head does with
        d2t before a probabilistic draft's ratio test)."""
        if q.shape[-1] != self.size:
            raise ValueError(f"distributions have {q.shape[-1]} columns, the draft vocabulary has {self.size}")
        out = q.new_zeros(*q.shape[:-1], self.vocab_size)
        return out.index_copy_(-1, self.target_ids.to(q.device), q)

    def contains(self, target_ids: torch.Tensor) -> torch.Tensor:
        return self.t2d.to(target_ids.device)[target_ids]

    def same_tokens(self, other: Optional["DraftVocab"]) -> bool:
        return other is not None and other.vocab_size == self.vocab_size and torch.equal(other.target_ids, self.target_ids)

    # ------------------------------------------------------------------ training
    def restrict(self, p: torch.Tensor) -> RestrictedTarget:
        """The target distributions ``p`` (..., V) seen through the draft vocabulary (see the module doc)."""
        if p.shape[-1] != self.vocab_size:
            raise ValueError(f"target distributions have {p.shape[-1]} columns, the draft vocabulary maps a "
                             f"{self.vocab_size}-token target")
        on = p.index_select(-1, self.target_ids.to(p.device))
        mass = on.sum(-1, keepdim=True)
        renorm = on / mass.clamp_min(torch.finfo(on.dtype).tiny)
        return RestrictedTarget(p=renorm, p_on_draft=on, in_vocab=self.contains(p.argmax(-1)))

    def coverage(self, counts: torch.Tensor) -> float:
        """Share of the counted tokens that are draft tokens (nan without counts)."""
        counts = torch.as_tensor(counts).double()
        total = float(counts.sum())
        return float(counts[self.target_ids].sum()) / total if total > 0 else float("nan")

    def remap_rows(self, old: "DraftVocab", old_rows: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        """Rows (N, ...) for this vocabulary from ``old_rows`` of vocabulary ``old``: a token in both keeps
        its row, a new token gets ``fill[token]`` (``fill``: (V, ...) rows of every target token)."""
        src = old.to_draft(self.target_ids)  # this vocabulary's tokens in the old one (-1 = new)
        out = fill.index_select(0, self.target_ids.to(fill.device)).to(old_rows.dtype).clone()
        kept = src >= 0
        out[kept.to(out.device)] = old_rows[src[kept].to(old_rows.device)]
        return out


def token_counts(ids: torch.Tensor, mask: Optional[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """(V,) float64 occurrences of the tokens ``ids`` where ``mask`` (all when None)."""
    ids = torch.as_tensor(ids).reshape(-1)
    if mask is not None:
        ids = ids[torch.as_tensor(mask).reshape(-1).bool()]
    return torch.bincount(ids.cpu(), minlength=vocab_size).double()
