"""Online drafter training: the drafter's side of one GRPO step (co-training), on one rank.

:class:`OnlineDraftTrainer` takes, microbatch by microbatch, what the policy's forward saw and
takes one optimizer step of its own at the end of the step::

    trainer.begin_step(step, embed=..., lm_head=...)     # the policy's current shared tensors
    for each microbatch:  trainer.microbatch(rows, taps, logits)
    metrics = trainer.end_step()                          # reduce, normalise, clip, AdamW step

    rows     RolloutRows           the rows as the policy sees them (ids, response mask, lengths, row ids)
    taps     [sum(widths)/C, n_taps*H]  the drafter's taps from that forward, this rank's positions
    logits   [>= sum(widths)/C, V]      the policy's logits, detached, at the sampling temperature

Loss normalisation, over every rank r of the reduce group (the last stage's DP x CP ranks), chain c
and valid draft position j with position weights w_j:

    L = sum_{r,c,j} w_j l_{cj} / sum_{r,c,j} w_j.

Each rank backpropagates its local weight sum D_r times its mean; the gradients and the D_r are
summed over the group and divided by D = sum_r D_r: one process's gradient on the whole batch.

- Anchors: where chains start is the kind's record's (``DraftKind.anchors``); sampled anchors are
  drawn per row, seeded by (seed, step, row index) (:func:`anchor_seed`): the same on every CP rank,
  for any DP / PP / CP layout (``anchor_sampling: balanced``: one stratified draw per CP group).
- CP (C > 1): rows whole, in their zigzag shard's order (:mod:`cotrain.parallel.zigzag`), branch
  attention over ``cp_group``, a chain's target rows from their owners
  (:func:`~cotrain.draft.cp.fetch_rows`); at C = 1 the padding is dropped.
- On-policy branches (``draft.branches: on_policy``, :mod:`cotrain.draft.specopd`): at the same
  anchors the drafter samples its own branches (:func:`branch_uniforms`) and ``scorer`` gives the
  policy's logits at their tokens (:meth:`OnlineDraftTrainer._on_policy`).
- Acceptance on the step's chains (teacher-forced greedy, first ``k`` drafts,
  :mod:`cotrain.draft.acceptance`): ``acceptance_offline``; ``acceptance_offline_frozen`` (with
  ``compare_frozen``: the drafter as built, same chains, same policy trajectory);
  ``acceptance_offline_turn<t>`` (multi-turn rows: by the policy turn of the chain's first draft).
- Reduced draft vocabulary (EAGLE-3 ``draft_vocab_size``, :mod:`cotrain.draft.vocab`): built from
  the first step's tokens (that step takes no update), rebuilt every ``vocab_rebuild_every`` steps
  after the update, identically on every rank, the optimizer's rows following their tokens
  (``DraftKind.vocab_rows``); metrics ``vocab_version``, ``vocab_coverage``, ``vocab_rebuilt``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from cotrain.draft.acceptance import accept_lengths
from cotrain.draft.common import DraftBatch, DraftOutput, turn_of
from cotrain.draft.cp import fetch_rows
from cotrain.draft.losses import TargetDist, draft_loss
from cotrain.draft.optim import apply_config, clip_, lr_at, make_optimizer, remap_optimizer_rows, set_lr
from cotrain.draft.registry import Drafter, record_of
from cotrain.draft.vocab import DraftVocab, token_counts
from cotrain.parallel.layout import spans
from cotrain.seeding import mix


#: per-turn acceptance slots: turns 1 .. TURN_SLOTS - 1, and TURN_SLOTS for that turn and later
TURN_SLOTS = 4
_TURN_KEYS = tuple(f"{k}_turn{t}" for t in range(1, TURN_SLOTS + 1) for k in ("accept_sum", "chains"))


@dataclass
class RolloutRows:
    """Rows of the training batch as the policy sees them (right-padded to S positions), on the host
    (index space; the taps and logits that come with them are on the drafter's device).

    inputs   [b, S] token ids (every position, also under CP: ids are small and global).
    mask     [b, S] 1 where the target at position t (token t + 1) is a response token.
    lengths  [b]    real tokens per row (prompt + response), at most S.
    seq_ids  [b]    index of each row in the whole rollout batch (seeds its anchors).
    widths   [b]    positions each row takes in the policy's forward, in order (its taps and logits):
                    None = S each (padded rows); packed rows (cotrain.rl.packing) P_s, the row's
                    length rounded up to a multiple of 2C under CP (= lengths at C = 1).
    """

    inputs: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    seq_ids: torch.Tensor
    widths: Optional[torch.Tensor] = None

    def row_widths(self) -> torch.Tensor:
        """[b] positions of each row in the forward (``widths``, or S each)."""
        if self.widths is None:
            return torch.full((len(self),), self.width, dtype=torch.int64)
        return self.widths.to(torch.int64)

    @property
    def width(self) -> int:
        return self.inputs.shape[1]

    def __len__(self) -> int:
        return self.inputs.shape[0]


@dataclass
class ReplayEntry:
    """One microbatch's drafter inputs, kept for replay: the rows, this rank's taps and the policy's
    detached logits exactly as :meth:`OnlineDraftTrainer.microbatch` got them, and the GRPO step."""

    step: int
    rows: RolloutRows
    taps: torch.Tensor
    logits: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.taps.numel() * self.taps.element_size() + self.logits.numel() * self.logits.element_size()


class ReplayWindow:
    """The drafter inputs of the last ``max_age`` GRPO steps it trained on (``draft.budget``), at most
    ``max_bytes`` of taps and logits (the oldest microbatches leave first), for the extra optimizer
    steps of a step (:meth:`OnlineDraftTrainer.replay`). Every rank of a CP group holds the same
    rows (its shards) in the same order, so their replays stay in step."""

    def __init__(self, max_age: int, max_bytes: float):
        self.max_age, self.max_bytes = int(max_age), float(max_bytes)
        self.entries: list[ReplayEntry] = []

    def add(self, step: int, rows: RolloutRows, taps: torch.Tensor, logits: torch.Tensor) -> None:
        self.entries.append(ReplayEntry(int(step), rows, taps.detach().clone(), logits.detach().clone()))
        self.trim(step)

    def trim(self, step: int) -> None:
        """Drop entries older than ``max_age`` steps before ``step``, then the oldest over the bound."""
        self.entries = [e for e in self.entries if e.step > step - self.max_age]
        while len(self.entries) > 1 and self.nbytes > self.max_bytes:
            self.entries.pop(0)

    def select(self, j: int, per_step: int) -> list[ReplayEntry]:
        """The microbatches of extra step ``j`` (0, 1, ...): ``per_step`` of them, the newest first,
        continuing where step j - 1 stopped (wrapping round)."""
        newest = self.entries[::-1]
        return [newest[(j * per_step + i) % len(newest)] for i in range(min(per_step, len(newest)))]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def state_dict(self) -> dict:
        return {"entries": [{"step": e.step, "taps": e.taps, "logits": e.logits, "inputs": e.rows.inputs,
                             "mask": e.rows.mask, "lengths": e.rows.lengths, "seq_ids": e.rows.seq_ids,
                             **({"widths": e.rows.widths} if e.rows.widths is not None else {})}
                            for e in self.entries]}

    def load_state_dict(self, state: dict, device=None) -> None:
        self.entries = [ReplayEntry(int(e["step"]), RolloutRows(e["inputs"], e["mask"], e["lengths"], e["seq_ids"],
                                                                widths=e.get("widths")),
                                    e["taps"].to(device) if device is not None else e["taps"],
                                    e["logits"].to(device) if device is not None else e["logits"])
                        for e in state["entries"]]


def to_draft_batch(rows: RolloutRows, taps: torch.Tensor, logits: torch.Tensor, cp_size: int = 1
                   ) -> tuple[DraftBatch, torch.Tensor]:
    """(DraftBatch, target logits in the batch's local row order).

    ``taps`` [sum(widths) / C, n_taps * H] and ``logits`` [>= sum(widths) / C, V] are this rank's
    positions in the policy's order, row after row (its zigzag shard under CP; rows of S positions
    when padded, of ``rows.widths`` when packed; logits past them, a packed row's filler, are dropped).
    """
    batch, target = draft_inputs(rows, taps, logits, cp_size)
    return batch, target.source


@dataclass
class TargetLogits:
    """The policy's target logits of one microbatch as the drafter reads them.

        source  [R, V]  logit rows (tempered, filtered, detached): the batch's rows in order (CP = 1),
                        this rank's zigzag shard (CP > 1), or only the rows the step reads (compact)
        index   [T]     compact: batch row t -> its row of ``source``, -1 where it was not kept;
                        None: row t of ``source`` itself (or, under CP, fetched from its owner)
    """

    source: torch.Tensor
    index: Optional[torch.Tensor] = None

    def at(self, target_rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Rows of ``source`` for the batch rows ``target_rows`` (clamped to >= 0 where not ``valid``);
        a valid row the compact handoff did not keep is an error, never a silently wrong target."""
        r = target_rows.clamp(min=0)
        if self.index is None:
            return r
        out = self.index[r.to(self.index.device)]
        if bool(((out < 0) & valid.to(out.device)).any()):
            raise RuntimeError("the drafter reads target rows that the compact logits handoff did not keep "
                               "(OnlineDraftTrainer.logit_rows and the drafter's forward disagree)")
        return out.clamp(min=0).to(self.source.device)


def real_positions(rows: RolloutRows) -> torch.Tensor:
    """[T] the forward position (index into the microbatch's logits rows, row after row) of each real
    token of ``rows`` in the batch's packed order (CP = 1: padding and a packed row's filler dropped)."""
    return spans(torch.cumsum(rows.row_widths(), 0) - rows.row_widths(), rows.lengths.to(torch.int64))


def draft_inputs(rows: RolloutRows, taps: Optional[torch.Tensor], logits: Optional[torch.Tensor], cp_size: int = 1,
                 logit_rows: Optional[torch.Tensor] = None) -> tuple[DraftBatch, Optional[TargetLogits]]:
    """(DraftBatch, TargetLogits) of one microbatch (see :func:`to_draft_batch`). ``logit_rows`` (CP = 1):
    ``logits`` holds only the forward positions ``logit_rows`` (sorted), row j = position
    ``logit_rows[j]`` (:meth:`OnlineDraftTrainer.logit_rows`). ``taps`` / ``logits`` None: the batch's
    index fields only (for its layout), empty taps."""
    b, S = rows.inputs.shape
    supervised = torch.zeros(b, S, dtype=torch.bool)
    supervised[:, 1:] = rows.mask[:, :-1].bool()  # token t is a response token iff target t-1 is
    any_resp = supervised.any(dim=1)
    first = torch.where(any_resp, supervised.float().argmax(dim=1), rows.lengths)
    widths = rows.row_widths()
    row_starts = torch.arange(b) * S  # each row in the flattened [b, S] grid
    target = whole = None  # whole: the batch's own target_logits (CP = 1, every row)
    if cp_size == 1:
        lengths = rows.lengths.to(torch.int64)
        keep = real_positions(rows)  # the real positions in the forward's order
        grid = spans(row_starts, lengths)
        ids, lm = rows.inputs.reshape(-1)[grid], supervised.reshape(-1)[grid]
        if taps is not None:
            taps = taps[keep.to(taps.device)]
        if logits is not None and logit_rows is None:
            whole = logits[keep.to(logits.device)]
            target = TargetLogits(whole)
        elif logits is not None:  # compact: batch row t -> its row of logits
            where = torch.full((int(widths.sum()),), -1, dtype=torch.int64)
            where[logit_rows.cpu()] = torch.arange(logit_rows.numel())
            target = TargetLogits(logits, where[keep].to(logits.device))
    else:
        if logit_rows is not None:
            raise ValueError("a compact logits handoff is for CP = 1 (under CP the rows come from their owners)")
        # whole rows as the forward laid them out (padding included): S each, or packed P_s each
        lengths = widths
        grid = spans(row_starts, widths)
        ids, lm = rows.inputs.reshape(-1)[grid], supervised.reshape(-1)[grid]
        n = int(widths.sum()) // cp_size
        taps = taps[:n] if taps is not None else None
        target = TargetLogits(logits[:n]) if logits is not None else None
    if taps is None:
        taps = torch.zeros(0, 0)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    batch = DraftBatch(input_ids=ids, cu_seqlens=cu, taps=taps, loss_mask=lm, target_logits=whole,
                       response_start=first.to(torch.int64))
    return batch, target


def _frozen_copy(drafter: Drafter) -> Drafter:
    """A copy of ``drafter`` that never trains (``compare_frozen``): no gradients, eval mode."""
    import copy

    frozen = copy.deepcopy(drafter)
    frozen.requires_grad_(False)
    return frozen.eval()


def anchor_seed(seed: int, step: int, seq_id: int) -> int:
    """The seed of one row's anchor draw (a fixed mix of the run seed, the step and the row)."""
    return mix(mix(seed, step), seq_id, 1_000_033) % (2**63 - 1)


def branch_seed(seed: int, step: int, seq_id: int, position: int) -> int:
    """The seed of one on-policy branch's draws (``draft.branches: on_policy``): a fixed mix of the
    run seed, the step, the row and the anchor's position in it (distinct from the row's anchor seed)."""
    return (anchor_seed(seed, step, seq_id) * 1_000_037 + int(position) + 1) % (2**63 - 1)


def branch_uniforms(seed: int, step: int, seq_ids: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """(NB, width) uniforms in [0, 1) of the branches at (row ``seq_ids[b]``, in-row anchor position
    ``positions[b]``): draft j of branch b is drawn by inverse CDF at [b, j]. A function of the branch
    alone, so the draws do not depend on the microbatch grouping, the rank holding the branch or the
    layout."""
    out = torch.empty(len(seq_ids), width)
    for b, (s, a) in enumerate(zip(seq_ids.tolist(), positions.tolist())):
        out[b] = torch.rand(width, generator=torch.Generator().manual_seed(branch_seed(seed, step, s, a)))
    return out


def sample_block_anchors(drafter: Drafter, batch: DraftBatch, seeds: list[int], per_seq: int) -> torch.Tensor:
    """Up to ``per_seq`` anchors per sequence among the drafter's candidates, sequence s drawn with a
    generator seeded ``seeds[s]`` (sorted packed positions; the drafter's ``sample_anchors``)."""
    return drafter.sample_anchors(batch, per_seq, [torch.Generator().manual_seed(int(s)) for s in seeds])


class OnlineDraftTrainer:
    """A drafter, its optimizer and schedule, trained one GRPO step at a time (see the module doc).

    ``cp_group``: the CP group the drafter's branch attention runs over (None at CP = 1).
    ``reduce_group``: the ranks whose gradients are summed (the last stage's DP x CP ranks; None = one rank).
    ``total_steps``: optimizer steps of the run (the schedule's horizon). ``k``: drafts counted by
    the offline acceptance (the served number of speculative tokens).
    """

    def __init__(self, drafter: Drafter, draft_cfg, total_steps: int, seed: int = 0, *, cp_size: int = 1,
                 cp_group=None, reduce_group=None, k: Optional[int] = None, eos_token_id: Optional[int] = None,
                 compare_frozen: bool = False):
        self.drafter = drafter
        # the drafter as built (draft.init), never trained: its acceptance on the same chains
        self.frozen: Optional[Drafter] = _frozen_copy(drafter) if compare_frozen else None
        self.cfg = draft_cfg
        self.loss_name = draft_cfg.loss or draft_cfg.settings.default_loss
        self.branches = getattr(draft_cfg, "branches", "teacher_forced")
        self.eos_token_id = eos_token_id
        self.record = record_of(drafter)  # what the family needs: its anchors, branches, vocabulary rows
        if self.branches == "on_policy" and self.record.branches is None:
            raise NotImplementedError(f"on-policy branches are not built for drafter kind {drafter.kind!r} "
                                      "(its record names no branches)")
        self.loss_extra = {n: float(getattr(draft_cfg.settings, n)) for n in ("l1_weight", "confidence_weight")
                           if hasattr(draft_cfg.settings, n)}
        self.total_steps = int(total_steps)
        self.seed = int(seed)
        self.cp_size, self.cp_group, self.reduce_group = int(cp_size), cp_group, reduce_group
        self.k = min(int(k or drafter.default_num_speculative_tokens()), drafter.draft_width)
        self.optimizer = make_optimizer(drafter, draft_cfg.optimizer)
        self.steps_done = 0  # optimizer steps taken (the schedule's position)
        self._step: Optional[int] = None
        self._measuring = False  # a measure-only step (begin_step(measure_only=True))
        self._stats: dict[str, float] = {}
        self._seconds = 0.0
        # reduced draft vocabulary: token counts since the mapping was last built, steps since then
        vocab: Optional[DraftVocab] = getattr(drafter, "vocab", None)
        self.vocab_every = int(getattr(drafter.cfg, "vocab_rebuild_every", 0) or 0)
        if vocab is not None and self.record.vocab_rows is None:
            raise ValueError(f"drafter kind {drafter.kind!r} has a reduced vocabulary but its record names no "
                             "vocab_rows (the parameter whose optimizer state follows a rebuild)")
        self.vocab_counts = torch.zeros(vocab.vocab_size, dtype=torch.float64) if vocab is not None else None
        self.vocab_steps = 0
        # draft.budget (adaptive, max_steps > 1): recent steps' inputs for the extra optimizer steps
        b = getattr(draft_cfg, "budget", None)
        self.window: Optional[ReplayWindow] = None
        if b is not None and b.mode == "adaptive" and b.max_steps > 1:
            self.window = ReplayWindow(b.replay_steps, b.replay_max_mib * 2**20)
        self._replay: Optional[int] = None  # the extra step being taken (None: the step's own)
        self._replay_entry_step = 0  # the GRPO step of the microbatch being replayed
        self._microbatches_seen = 0
        # FLOPs of a drafter step per chain position: 6 x the parameters it multiplies (its own and a
        # borrowed LM head; an embedding lookup is no matmul)
        params = sum(p.numel() for n, p in drafter.named_parameters() if p.requires_grad and "embed" not in n)
        head = getattr(drafter, "target_lm_head", None)
        if head is not None and not head.requires_grad:
            params += head.numel()
        self.flops_per_position = 6.0 * params

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def set_shared(self, embed: Optional[torch.Tensor] = None, lm_head: Optional[torch.Tensor] = None) -> None:
        """The target tensors the drafter borrows (vLLM shares them with the served policy)."""
        for d in (self.drafter, self.frozen):
            if d is None:
                continue
            if embed is not None:
                d.embed_weight.copy_(embed.to(d.embed_weight.dtype))
            if lm_head is not None:
                d.target_lm_head.copy_(lm_head.to(d.target_lm_head.dtype))

    def begin_step(self, step: int, embed: Optional[torch.Tensor] = None,
                   lm_head: Optional[torch.Tensor] = None, measure_only: bool = False) -> None:
        """``measure_only`` (``draft.budget.measure_idle`` on an idle step): the step's microbatches
        only score the drafter (and its frozen copy) on their chains; end_step takes no optimizer step."""
        self._step = int(step)
        self._measuring = bool(measure_only)
        if self._replay is None:
            self._microbatches_seen = 0
        self.set_shared(embed, lm_head)
        self.drafter.train()
        self.optimizer.zero_grad(set_to_none=True)
        self._stats = dict.fromkeys(("loss_sum", "weight", "overlap_sum", "top1_sum", "positions", "accept_sum",
                                     "chains", "microbatches", "branch_tokens", "accept_sum_frozen",
                                     "chains_frozen", "kl_sum", "kl_weight", "chain_positions", *_TURN_KEYS), 0.0)
        self._timers = {"tree_s": 0.0, "eval_s": 0.0, "frozen_s": 0.0, "measure_s": 0.0}  # this rank's seconds
        if self.vocab_counts is not None:
            self._step_counts = torch.zeros_like(self.vocab_counts)
        self._seconds = 0.0

    def _layout_for(self, batch: DraftBatch, seq_ids: torch.Tensor, step: int):
        """The drafter's layout of ``batch`` at GRPO step ``step`` (anchors drawn per row; a replayed
        microbatch gets fresh anchors: ``step`` is then salted by the replay)."""
        sampled = self.record.anchors == "sampled"
        if sampled and self.drafter.cfg.anchor_sampling == "balanced":
            # one draw for the microbatch, stratified by CP rank (identical on every rank of the group)
            g = torch.Generator().manual_seed(anchor_seed(self.seed, step, int(seq_ids[0])))
            return self.drafter.build_layout(batch, generator=g, cp_size=self.cp_size)
        if sampled:
            seeds = [anchor_seed(self.seed, step, s) for s in seq_ids.tolist()]
            anchors = sample_block_anchors(self.drafter, batch, seeds, int(self.drafter.cfg.anchors_per_seq))
            return self.drafter.build_layout(batch, cp_size=self.cp_size, anchors=anchors)
        return self.drafter.build_layout(batch, cp_size=self.cp_size)

    def logit_rows(self, rows: RolloutRows) -> Optional[torch.Tensor]:
        """The forward positions of ``rows`` (indices into the microbatch's logits, row after row) whose
        target logits this step's microbatch reads, sorted; None = all of them. The policy's log-prob
        loop then hands over only those rows (the compact handoff: no [tokens, V] copy of the whole
        microbatch): the chains' target rows at the anchors the step draws (:meth:`_layout_for`,
        seeded by the rows and the step alone, so known before the forward; EAGLE-3, whose chains
        start at every response position: the response rows, no prompt row). Every row is kept where
        more is read: under CP (rows fetched from their owners), with a replay window (a replayed
        microbatch draws fresh anchors) and for on-policy branches (the stem's logits)."""
        if self.cp_size > 1 or self.window is not None or self.branches != "teacher_forced" or self._replay is not None:
            return None
        batch, _ = draft_inputs(rows, None, None)
        need = self.drafter.target_rows_read(batch, self._layout_for(batch, rows.seq_ids, self._anchor_step))
        return None if need is None else real_positions(rows)[need]

    def microbatch(self, rows: RolloutRows, taps: torch.Tensor, logits: torch.Tensor,
                   scorer: Optional[Callable] = None, logit_rows: Optional[torch.Tensor] = None
                   ) -> dict[str, torch.Tensor]:
        """Forward and backward of the drafter on one microbatch (gradients accumulate). Returns the
        loss's metrics as device tensors: nothing is read back to the host before end_step.
        ``logit_rows``: ``logits`` holds only those forward positions (:meth:`logit_rows`).

        ``draft.branches: on_policy``: ``scorer(layout, tokens, positions)`` returns the policy's
        logits (tempered and filtered like ``logits``) at the branch tokens of the tree ``layout``
        (see :meth:`_on_policy`)."""
        if self._step is None:
            raise RuntimeError("call begin_step before microbatch")
        if self._measuring:
            return self._measure(rows, taps, logits, logit_rows)
        t0, f0 = time.perf_counter(), self._timers["frozen_s"]
        if self._replay is None:
            self._microbatches_seen += 1
            if self.window is not None:
                self.window.add(self._step, rows, taps, logits)
        batch, target = draft_inputs(rows, taps, logits, self.cp_size, logit_rows)
        layout = self._layout_for(batch, rows.seq_ids, self._anchor_step)
        if self.branches == "on_policy":
            if scorer is None:
                raise ValueError("draft.branches: on_policy needs the policy's tree scorer for every microbatch")
            m = self._on_policy(rows, batch, target.source, layout, scorer)
            self._seconds += time.perf_counter() - t0 - (self._timers["frozen_s"] - f0)
            return m
        with torch.enable_grad():
            out = self.drafter(batch, layout, group=self.cp_group if self.cp_size > 1 else None)
            if self.cp_size > 1:  # the rows this rank's chains need, fetched from their owners
                V = target.source.shape[-1]
                tl = fetch_rows(target.source, out.target_rows, layout, self.cp_group).view(-1, V)
                p = TargetDist(tl, torch.arange(tl.shape[0], device=tl.device).view(out.target_rows.shape))
            else:  # gathered chunk by chunk inside the loss
                p = TargetDist(target.source, target.at(out.target_rows, out.valid))
            # token ids are host-side (index space), the chains on the drafter's device
            labels = batch.input_ids[(out.target_rows + 1).clamp(min=0, max=batch.num_tokens - 1).cpu()].to(
                out.logits.device)
            vocab = getattr(self.drafter, "vocab", None)
            loss, m = draft_loss(self.loss_name, out, p, labels=labels, vocab=vocab, **self.loss_extra)
            weight = m["weight"]  # the positions the loss counts (a reduced vocabulary drops some); a tensor
            # always: under CP the backward of branch attention is collective over the CP group,
            # so a rank with nothing to supervise still takes part (with zero gradients)
            (loss * weight).backward()
        with torch.no_grad():  # statistics stay on the device until end_step
            n = out.valid.sum()
            self._stats["chain_positions"] += float(out.valid.numel())
            if vocab is not None and self._replay is None:
                # the rollout tokens the drafts predict (every CP rank holds whole rows: each counts them all)
                self._step_counts += token_counts(batch.input_ids, batch.loss_mask, vocab.vocab_size)
            best = p.source.argmax(-1)[p.rows_index]
            lens, first = self._chain_acceptance(out, vocab, best)
            self._accumulate_turns(batch, out, lens, first)
            if self.frozen is not None and self._replay is None:
                self._frozen_acceptance(batch, layout, best)
        self._accumulate(m, weight, n, lens, first)
        self._stats["microbatches"] += 1
        self._seconds += time.perf_counter() - t0 - (self._timers["frozen_s"] - f0)  # co-training's time only
        return m

    @torch.no_grad()
    def _measure(self, rows: RolloutRows, taps: torch.Tensor, logits: torch.Tensor,
                 logit_rows: Optional[torch.Tensor] = None) -> dict:
        """A measure-only microbatch: the drafter's teacher-forced chains at the anchors a training
        step would draw, scored as a training step scores them (and the frozen copy's on the same
        chains); no loss, no backward, nothing kept for replay or counted for the draft vocabulary."""
        t0, f0 = time.perf_counter(), self._timers["frozen_s"]
        batch, target = draft_inputs(rows, taps, logits, self.cp_size, logit_rows)
        layout = self._layout_for(batch, rows.seq_ids, self._anchor_step)
        best, lens, first = self._teacher_forced_acceptance(batch, layout, target)
        if self.frozen is not None:
            self._frozen_acceptance(batch, layout, best)
        self._stats["accept_sum"] += lens.sum()
        self._stats["chains"] += first.sum()
        self._stats["microbatches"] += 1
        self._timers["measure_s"] += time.perf_counter() - t0 - (self._timers["frozen_s"] - f0)
        return {}

    def _teacher_forced_acceptance(self, batch: DraftBatch, layout, target: "TargetLogits"):
        """(best, lengths, first) of the drafter's teacher-forced chains of ``layout`` (no grad): the
        policy's greedy token at each chain position (fetched from its owner under CP) and the chains'
        greedy acceptance (:meth:`_chain_acceptance`), added to the per-turn sums."""
        group = self.cp_group if self.cp_size > 1 else None
        with torch.no_grad():
            out = self.drafter(batch, layout, group=group)
            if self.cp_size > 1:  # the rows the chains need, from their owners
                ids = target.source.argmax(-1).double()[:, None]  # token ids, exact in float64
                best = fetch_rows(ids, out.target_rows, layout, group).view(out.target_rows.shape).long()
            else:
                best = target.source.argmax(-1)[target.at(out.target_rows, out.valid)]
            lens, first = self._chain_acceptance(out, getattr(self.drafter, "vocab", None), best)
            self._accumulate_turns(batch, out, lens, first)
        return best, lens, first

    @property
    def _anchor_step(self) -> int:
        """The step the anchors are seeded with: the GRPO step, salted for a replayed microbatch (its
        own step, the step replaying it and the extra step's index) so that it gets fresh anchors."""
        if self._replay is None:
            return self._step
        return self._replay_entry_step + (self._step * 64 + self._replay + 1) * 1_000_000_007

    def replay(self, updates: int) -> dict[str, float]:
        """``updates`` further optimizer steps after this GRPO step's own (``draft.budget``), each on
        as many microbatches of the replay window as the step had (newest first; fresh anchors), at
        the step's learning rate (the schedule follows GRPO steps). On every rank of the reduce group
        alike (each replays its own window; the gradients are reduced per step). Returns
        ``replay_loss`` (mean over the extra steps) and ``replay_s`` (this rank's seconds)."""
        if self.window is None or updates <= 0:
            return {}
        if self.branches == "on_policy":
            raise ValueError("draft.budget: replay needs draft.branches: teacher_forced")
        t0 = time.perf_counter()
        step, per_step = self._last_step, max(1, self._microbatches_seen)
        losses = []
        for j in range(updates):
            self._replay = j
            self.begin_step(step)
            try:
                for e in self.window.select(j, per_step):
                    self._replay_entry_step = e.step
                    self.microbatch(e.rows, e.taps, e.logits)
                m = self.end_step()
            finally:
                self._replay = None
            losses.append(m["loss"])
        return {"replay_loss": sum(losses) / len(losses), "replay_s": time.perf_counter() - t0}

    def _accumulate(self, m: dict, weight, n, lens: torch.Tensor, first: torch.Tensor) -> None:
        """Add one microbatch's loss (weighted), overlap / top-1 (per supervised position) and accepted
        lengths (per chain with a supervised first draft) to the step's sums (device tensors)."""
        st = self._stats
        st["loss_sum"] += m["loss"] * weight
        st["weight"] += weight
        st["overlap_sum"] += m["overlap"] * n
        st["top1_sum"] += m["top1_match"] * n
        st["positions"] += n
        st["accept_sum"] += lens.sum()
        st["chains"] += first.sum()
        if "kl" in m:
            st["kl_sum"] += m["kl"] * m["kl_weight"]
            st["kl_weight"] += m["kl_weight"]

    def _accumulate_turns(self, batch: DraftBatch, out: DraftOutput, lens: torch.Tensor, first: torch.Tensor) -> None:
        """The accepted lengths of the chains with a supervised first draft, by the policy turn of
        that draft (``TURN_SLOTS``: that turn and later)."""
        if out.num_chains == 0:
            return
        T = batch.num_tokens
        tok = (out.bonus_pos.cpu() + 1).clamp(max=T - 1)
        turn = turn_of(batch)[tok].clamp(max=TURN_SLOTS).to(lens.device)
        st = self._stats
        for t in range(1, TURN_SLOTS + 1):
            sel = first & (turn == t)
            st[f"accept_sum_turn{t}"] += (lens * sel).sum()
            st[f"chains_turn{t}"] += sel.sum()

    def _chain_acceptance(self, out: DraftOutput, vocab: Optional[DraftVocab], best: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy acceptance of ``out``'s chains: 1 + leading drafts equal to ``best`` (the policy's
        greedy token at each chain position) over the first ``k``, drafted ids mapped to target ids
        under a reduced ``vocab``; counted for the chains whose first draft is supervised. Returns
        (lengths, that mask)."""
        drafted = out.logits.argmax(-1)
        if vocab is not None:
            drafted = vocab.to_target(drafted)
        first = out.valid[:, 0]
        return accept_lengths((drafted == best) & out.valid, self.k) * first, first

    @torch.no_grad()
    def _frozen_acceptance(self, batch: DraftBatch, layout, best: torch.Tensor) -> None:
        """``compare_frozen``: the frozen copy's greedy acceptance on the chains the drafter was just
        scored on (``best``: the policy's greedy token at each chain position, as the drafter's own
        acceptance uses), added to the step's sums; its seconds are kept out of ``time_s``."""
        t0 = time.perf_counter()
        out = self.frozen(batch, layout, group=self.cp_group if self.cp_size > 1 else None)
        lens, first = self._chain_acceptance(out, getattr(self.frozen, "vocab", None), best)
        self._stats["accept_sum_frozen"] += lens.sum()
        self._stats["chains_frozen"] += first.sum()
        self._timers["frozen_s"] += time.perf_counter() - t0

    def _on_policy(self, rows: RolloutRows, batch: DraftBatch, local_logits: torch.Tensor, layout,
                   scorer: Callable) -> dict[str, torch.Tensor]:
        """SpecOPD on one microbatch: the drafter samples a branch at every anchor of ``layout`` it
        holds (one call for a block drafter, EAGLE-3's k passes; draws at :func:`branch_uniforms`),
        the policy scores the branch tokens in one tree forward (``scorer``, on
        ``specopd.target_inputs``: block drafters y_1..y_{W-1}, p_1 then the anchor's own row of
        ``local_logits``; EAGLE-3 x_{p+1}, y_1..y_{k-1} at its chain anchor p, every p_j, p_1
        included, a branch row); the loss (``draft.loss``, E2E-TV for SpecOPD) on the branch
        positions with the tokens and p fixed. Under CP a rank holds the branches whose anchors it
        holds (the drafter's layout), and the drafter's and the policy's attention run over the CP
        group. The statistics: loss, overlap and top-1 agreement on the branch positions;
        ``acceptance_offline`` as in teacher forcing (the drafter's teacher-forced chains at the same
        anchors, no grad, drafted ids mapped to target ids under a reduced vocabulary), so that it
        compares across ``draft.branches``; the rollout tokens counted for the draft vocabulary as in
        teacher forcing."""
        from cotrain.draft import specopd
        from cotrain.draft.common import group_rank

        st = self._stats
        st["microbatches"] += 1
        vocab: Optional[DraftVocab] = getattr(self.drafter, "vocab", None)
        if vocab is not None:  # the rollout tokens the drafts predict (every CP rank holds whole rows)
            self._step_counts += token_counts(batch.input_ids, batch.loss_mask, vocab.vocab_size)
        if int(layout.anchors.numel()) == 0:  # nothing to supervise in these rows (on every CP rank)
            return {}
        C = self.cp_size
        group = self.cp_group if C > 1 else None
        rank = group_rank(group) if C > 1 else 0
        anchors = layout.anchors[layout.local_branches(rank)] if C > 1 else layout.anchors
        seq = batch.seq_of[anchors]
        u = branch_uniforms(self.seed, self._step, rows.seq_ids[seq], anchors - batch.cu_seqlens[seq],
                            self.drafter.draft_width)
        with torch.enable_grad():
            br = specopd.sample_branches(self.drafter, batch, layout, None, temperature=1.0, group=group,
                                         eos_token_id=self.eos_token_id, uniforms=u)
            if not torch.equal(br.anchors, anchors):
                raise RuntimeError("the drafter's branches are not the layout's anchors of this rank, in order")
            W, V = br.width, local_logits.shape[-1]
            tl = specopd.target_layout(layout, W, bonus=br.bonus is not None)
            branch_logits = local_logits.new_zeros(0, V)
            if tl is not None:
                t1 = time.perf_counter()
                toks, pos = specopd.target_inputs(br, batch.cu_seqlens)
                with torch.no_grad():
                    branch_logits = scorer(tl, toks.reshape(-1), pos.reshape(-1)).float()
                self._timers["tree_s"] += time.perf_counter() - t1
                st["branch_tokens"] += float(branch_logits.shape[0])
            stem_index = layout.zigzag_index(rank) if C > 1 else torch.arange(local_logits.shape[0])
            scores = specopd.TreeScores(stem_logits=local_logits, stem_index=stem_index,
                                        branch_logits=branch_logits, layout=tl)
            if br.tokens.shape[0]:  # both logits already at the sampling temperature; EAGLE-3: branch rows only
                p = specopd.branch_target_probs(scores, br, temperature=1.0)
            else:  # a CP rank holding no branch (it still ran the collective forwards and runs the backward)
                p = local_logits.new_zeros(0, W, V)
            loss, m = specopd.specopd_loss(br, p, self.loss_name, getattr(self.drafter.cfg, "loss_gamma", None),
                                           **self.loss_extra)
            weight = m["weight"]
            (loss * weight).backward()
        t1 = time.perf_counter()
        n = br.valid.sum()
        # teacher-forced chains at the same anchors: the acceptance comparable across draft.branches
        best, lens, first = self._teacher_forced_acceptance(batch, layout, TargetLogits(local_logits))
        self._timers["eval_s"] += time.perf_counter() - t1
        if self.frozen is not None:
            self._frozen_acceptance(batch, layout, best)
        self._accumulate(m, weight, n, lens, first)
        return m

    def end_step(self) -> dict[str, float]:
        """Sum gradients and statistics over the reduce group, normalise, clip, step. Returns the
        step's metrics (identical on every rank of the group)."""
        if self._step is None:
            raise RuntimeError("end_step without begin_step")
        t0 = time.perf_counter()
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        keys = sorted(self._stats)
        stats = torch.tensor([float(self._stats[k]) for k in keys], dtype=torch.float64)  # the step's one read-back
        if self._measuring:  # no gradients, no token counts: only the statistics cross
            device = params[0].device if params else torch.device("cpu")
            grads, counts = torch.zeros(0, device=device), torch.zeros(0, dtype=torch.float64)
        else:
            grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                               for p in params])
            counts = self._step_counts if self.vocab_counts is not None else torch.zeros(0, dtype=torch.float64)
        if self.reduce_group is not None and dist.get_world_size(self.reduce_group) > 1:
            # one all-reduce on the drafter's device (the backend's: NCCL carries CUDA tensors only)
            flat = torch.cat([grads.double(), stats.to(grads.device), counts.to(grads.device)])
            dist.all_reduce(flat, group=self.reduce_group)
            n_g, n_s = grads.numel(), stats.numel()
            grads, stats, counts = flat[:n_g].float(), flat[n_g: n_g + n_s].cpu(), flat[n_g + n_s:].cpu()
        s = dict(zip(keys, stats.tolist()))
        metrics = {"loss": s["loss_sum"] / s["weight"] if s["weight"] else float("nan"),
                   "overlap": s["overlap_sum"] / s["positions"] if s["positions"] else float("nan"),
                   "top1_match": s["top1_sum"] / s["positions"] if s["positions"] else float("nan"),
                   "acceptance_offline": s["accept_sum"] / s["chains"] if s["chains"] else float("nan"),
                   "kl": s["kl_sum"] / s["kl_weight"] if s["kl_weight"] else float("nan"),
                   "positions": s["positions"], "chains": s["chains"],
                   "flops": self.flops_per_position * s["chain_positions"]}
        if s["chains_turn2"]:  # multi-turn rows: the acceptance per turn of the chains' first draft
            for t in range(1, TURN_SLOTS + 1):
                if s[f"chains_turn{t}"]:
                    metrics[f"acceptance_offline_turn{t}"] = s[f"accept_sum_turn{t}"] / s[f"chains_turn{t}"]
        if self.frozen is not None:
            metrics["acceptance_offline_frozen"] = (s["accept_sum_frozen"] / s["chains_frozen"] if s["chains_frozen"]
                                                    else float("nan"))
            metrics["frozen_s"] = self._timers["frozen_s"]  # not in time_s: a measurement, not co-training
        if self._measuring:  # the acceptance only; no optimizer step, the schedule does not move
            self._step = None
            keep = ("acceptance_offline", "chains", "acceptance_offline_frozen", "frozen_s")
            return {**{k: v for k, v in metrics.items() if k in keep or k.startswith("acceptance_offline_turn")},
                    "measure_s": self._timers["measure_s"] + time.perf_counter() - t0, "time_s": 0.0}
        if self.branches == "on_policy":  # branch tokens the policy scored (the group's); seconds: this rank's
            metrics.update(branch_tokens=s["branch_tokens"], tree_s=self._timers["tree_s"], eval_s=self._timers["eval_s"])
        replaying = self._replay is not None
        # a replayed step trains at its GRPO step's rate: the schedule follows GRPO steps
        lr = lr_at(self.steps_done - int(replaying), self.total_steps, self.cfg.optimizer)
        vocab = getattr(self.drafter, "vocab", None)
        placeholder = vocab is not None and vocab.source == "placeholder"
        if vocab is not None:
            metrics["vocab_coverage"] = vocab.coverage(counts)
        if placeholder:  # from scratch: no mapping yet; this step's tokens build it, the update waits
            s["weight"] = 0.0
        if s["weight"] > 0:
            off = 0
            for p in params:
                g = grads[off: off + p.numel()].view_as(p).to(p.dtype) / s["weight"]
                p.grad = g
                off += p.numel()
            metrics["grad_norm"] = clip_(params, self.cfg.optimizer.clip_grad)
            set_lr(self.optimizer, lr)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:  # nothing supervised anywhere this step: no update, the schedule does not move
            metrics["grad_norm"] = 0.0
            metrics["skipped"] = 1.0
        metrics["lr"] = lr
        if not replaying:
            self.steps_done += int(s["weight"] > 0)
            if vocab is not None:
                metrics.update(self._vocab_step(counts, placeholder))
            self._last_step = self._step
        self._seconds += time.perf_counter() - t0
        metrics["time_s"] = self._seconds
        self._step = None
        return metrics

    # ------------------------------------------------------------------ reduced draft vocabulary
    def _vocab_step(self, counts: torch.Tensor, placeholder: bool) -> dict[str, float]:
        """Count the step's tokens (summed over the group) and build / rebuild the mapping when due
        (the loss restricts p to the draft tokens; drafted ids are mapped to target ids before they
        are compared). A new mapping is a new head: the next push carries it whole, ``d2t`` included."""
        self.vocab_counts += counts
        self.vocab_steps += 1
        vocab = self.drafter.vocab
        rebuilt = 0.0
        if placeholder or (self.vocab_every and self.vocab_steps >= self.vocab_every):
            new = DraftVocab.from_counts(self.vocab_counts, vocab.size, version=vocab.version + 1)
            src = self.drafter.set_vocab(new)
            remap_optimizer_rows(self.optimizer, self.drafter.get_parameter(self.record.vocab_rows), src)
            self.vocab_counts.zero_()
            self.vocab_steps = 0
            rebuilt = 1.0
        return {"vocab_version": float(self.drafter.vocab.version), "vocab_rebuilt": rebuilt}

    # ------------------------------------------------------------------ weights and checkpoints
    def push_state(self) -> dict[str, torch.Tensor]:
        """What a run-time update sends to the engines: the drafter's own tensors in vLLM names
        (floating tensors as float32; EAGLE-3's d2t stays int64, as vLLM loads it)."""
        sd = self.drafter.vllm_state_dict()
        return {n: (sd[n].detach().float() if sd[n].is_floating_point() else sd[n].detach()).contiguous()
                for n in self.drafter.push_names()}

    def state_dict(self) -> dict:
        out = {"drafter": {n: p.detach().clone() for n, p in self.drafter.named_parameters()},
               "optimizer": self.optimizer.state_dict(), "steps_done": self.steps_done}
        if self.window is not None:
            out["window"] = self.window.state_dict()
        vocab = getattr(self.drafter, "vocab", None)
        if vocab is not None:
            out["vocab"] = {"target_ids": vocab.target_ids.clone(), "source": vocab.source, "version": vocab.version,
                            "counts": self.vocab_counts.clone(), "steps": self.vocab_steps}
        return out

    def load_state_dict(self, state: dict) -> None:
        own = dict(self.drafter.named_parameters())
        if set(own) != set(state["drafter"]):
            raise RuntimeError(f"drafter checkpoint does not match the drafter: missing "
                               f"{sorted(set(own) - set(state['drafter']))}, unexpected "
                               f"{sorted(set(state['drafter']) - set(own))}")
        vs = state.get("vocab")
        vocab = getattr(self.drafter, "vocab", None)
        if (vs is None) != (vocab is None):
            raise RuntimeError("drafter checkpoint does not match the drafter: "
                               + ("it has a reduced draft vocabulary, the drafter does not" if vs is not None
                                  else "the drafter has a reduced draft vocabulary, the checkpoint does not"))
        if vs is not None:
            self.drafter.set_vocab(DraftVocab(vs["target_ids"], vocab.vocab_size, source=vs["source"],
                                              version=int(vs["version"])), remap=False)
            self.vocab_counts = vs["counts"].clone().double()
            self.vocab_steps = int(vs["steps"])
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(state["drafter"][n])
        self.optimizer.load_state_dict(state["optimizer"])
        apply_config(self.optimizer.param_groups, self.cfg.optimizer, weight_decay=self.cfg.optimizer.weight_decay)
        self.steps_done = int(state["steps_done"])
        if self.window is not None:
            device = next(self.drafter.parameters()).device
            self.window.load_state_dict(state.get("window", {"entries": []}), device=device)
