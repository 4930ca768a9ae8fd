"""SpecOPD: parallel on-policy drafter distillation from random anchors.

The reference (or rollout) tokens are the *stem*. B anchors are drawn on it from a seeded
generator (the drafter's own anchor rule, ``build_layout``: a block drafter's sampled
anchors; EAGLE-3's every chain anchor). From every anchor a the
current drafter samples a *branch* of W tokens y_1..y_W at positions a+1..a+W - all anchors in one
drafter call, branches independent of each other, causal inside. The target then scores the stem
and all branches in ONE forward with the ancestor-only tree mask: branch token (b, j) sees the stem
up to and including its anchor and its own branch tokens 1..j; stem tokens never see branch tokens
(so the stem's outputs are those of the plain forward). Rotary positions are semantic (a + j), not
the packed order. The target distribution of draft j (1-based) is

    p_1 = softmax(target logits at stem row a)                 (= plain forward on stem[:a+1])
    p_j = softmax(target logits at branch token y_{j-1})       (= plain forward on stem[:a+1] + y_1..y_{j-1})

so the target needs only y_1..y_{W-1} of each branch (EAGLE-3: also its bonus token, below).
The loss is E2E-TV (``losses.e2e_tv`` through
``losses.draft_loss``; or ``accept_weighted_tv``, which weights draft j by the acceptance of the
drawn y_{<j}, see :mod:`cotrain.draft.losses`) on the branch positions with y and p held fixed:

    L = - sum_{b,j valid} w_j prod_{i<=j} sum_v min(p_{b,i}(v), q_{b,i}(v)) / sum_{b,j valid} w_j

where q_{b,i} is the drafter's distribution at branch position i *given its own samples* y_{<i}
(DSpark's Markov head reads y_{i-1}; DFlash's block positions do not depend on the samples at
all). Gradients flow through q and the prefix products; p and y are constants. Branches are
re-sampled at every update (call :func:`sample_branches` again).

Families:
- DFlash: the block (bonus x_a + B-1 masks) gives B-1 distributions in one backbone call; each
  draft is sampled from its own position's distribution (as vLLM's dflash proposer does), W = B-1.
- DSpark: one backbone call for every block, then the Markov head left to right
  (logits_i = lm_head(h_i) + W2 W1[y_{i-1}], y_0 = x_a), W = B. Only the (V x r) head is sequential.
- EAGLE-3: its k train-time-test passes, each batched over all anchors (the chain anchors p:
  bonus x_{p+1}, draft j at position p+1+j). Pass 0 (the trunk) reads x_{p+1} and the taps of p
  and gives draft 1; pass t >= 1 reads y_t, drawn from pass t-1's logits, instead of the reference
  token x_{p+1+t} (``Eagle3Drafter.forward``'s ``next_tokens`` hook), and pass t-1's state; W = k.
  k drafter passes rather than one call (they were sequential in teacher forcing already). Under a
  reduced draft vocabulary the draws are draft ids, mapped to target ids (``Branches.tokens``, the
  next pass's embedding, the target's scoring); the loss gets the vocabulary (``Branches.vocab``)
  and restricts p as for teacher-forced chains. The target scores the branch [x_{p+1}, y_1..y_{k-1}]
  at the anchor p (positions p+1..p+k), so p_1 comes from the bonus token's branch row (= the stem
  row p+1 of the plain forward) and p_j from y_{j-1}: k tokens per branch (one more than a block
  drafter's), all on the rank that owns p and drafted the branch, also when x_{p+1} lies on the
  other CP shard.

Target scoring (:func:`tree_target_logits`) runs a Hugging Face causal LM (Qwen3 / Llama-style: any
model whose attention goes through transformers' ``AttentionInterface``) over [stem rows; branch
tokens] with its attention replaced by ``cotrain.parallel``'s branch attention on the layout
``context="inclusive", intra="causal"`` (EAGLE-3's TTT rule). At CP > 1 each rank feeds its zigzag
shard of the stem and the branches whose anchors it holds (the same rank that drafted them), and
the attention is ``cp_branch_attention`` over the CP group.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from cotrain.config.schema import on_policy_kinds
from cotrain.draft.common import DraftBatch, DraftOutput, exp_decay_weights, group_rank
from cotrain.draft.losses import draft_loss
from cotrain.draft.registry import record_of
from cotrain.draft.vocab import DraftVocab
from cotrain.parallel import BranchLayout, cp_branch_attention, local_branch_attention

ATTN_NAME = "cotrain_tree"


# ------------------------------------------------------------------------------- branch sampling
@dataclass
class Branches:
    """Branches sampled by a drafter (this rank's, under CP).

    anchors   (NB,) packed stem positions a. Block drafters: the bonus token's position (draft j
              predicts position a + j). EAGLE-3: the position *before* the bonus token (its chain
              anchor p: bonus x_{p+1}, draft j predicts position p + 1 + j).
    tokens    (NB, W) sampled tokens y_1..y_W, as *target* ids (a reduced draft vocabulary's draws
              are mapped through it).
    logits    (NB, W, Vd) the drafter's logits at each branch position given its own samples y_{<j}
              (with the autograd graph of the call that produced them; divide by nothing: these are
              the raw logits, the sampling temperature only scaled them for the draw). Vd: the draft
              vocabulary's size under a reduced one (``vocab``), else the target's.
    valid     (NB, W) bool: false after a sampled EOS (nothing after it can be accepted).
    layout    the drafter's layout (anchors, CP size).
    bonus     EAGLE-3: (NB,) the bonus tokens x_{a+1}. The target then scores the branch
              [x_{a+1}, y_1..y_{W-1}] at the anchor a, so that p_1 comes from the bonus token's own
              branch row and the whole branch stays on the anchor's rank. None for block drafters
              (the anchor is the bonus position: p_1 is the stem row a).
    vocab     the drafter's reduced draft vocabulary (EAGLE-3 ``draft_vocab_size``), else None.
    """

    anchors: torch.Tensor
    tokens: torch.Tensor
    logits: torch.Tensor
    valid: torch.Tensor
    layout: BranchLayout
    confidence: Optional[torch.Tensor] = None
    bonus: Optional[torch.Tensor] = None
    vocab: Optional[DraftVocab] = None

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def bonus_pos(self) -> torch.Tensor:
        """(NB,) packed position of each branch's bonus token."""
        return self.anchors if self.bonus is None else self.anchors + 1


def _draw(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator],
          uniforms: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One token per row of ``logits`` (..., V): argmax at temperature 0, else softmax(l / T).
    ``uniforms`` (...,) in [0, 1): draw by inverse CDF at these instead of from ``generator``."""
    if temperature == 0:
        return logits.argmax(-1)
    if uniforms is not None:
        cdf = torch.cumsum(F.softmax(logits.detach().float() / temperature, dim=-1), dim=-1)
        u = uniforms.to(device=cdf.device, dtype=cdf.dtype)[..., None] * cdf[..., -1:]
        return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    probs = F.softmax(logits.detach().float() / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def branch_family(drafter) -> str:
    """How ``drafter``'s branches are drawn, as its kind's record says: ``"block"`` or ``"eagle3"``."""
    family = record_of(drafter).branches
    if family is None:
        raise NotImplementedError(f"on-policy branches are built for kinds {', '.join(on_policy_kinds())}; "
                                  f"got {drafter.kind!r} ({type(drafter).__name__})")
    return family


def _valid(y: torch.Tensor, eos_token_id: Optional[int]) -> torch.Tensor:
    """(NB, W): false after a sampled EOS (an EOS at i makes positions > i invalid)."""
    valid = torch.ones_like(y, dtype=torch.bool)
    if eos_token_id is not None and y.shape[1] > 1:
        ended = torch.cumsum((y == eos_token_id).to(torch.int64), 1)
        valid[:, 1:] = ended[:, :-1] == 0
    return valid


def sample_branches(drafter, batch: DraftBatch, layout: BranchLayout, generator: Optional[torch.Generator] = None,
                    temperature: float = 1.0, group=None, tokens: Optional[torch.Tensor] = None,
                    eos_token_id: Optional[int] = None, uniforms: Optional[torch.Tensor] = None) -> Branches:
    """Sample a branch at every anchor of ``layout`` (this rank's anchors under CP): one drafter call
    for a block drafter, k passes batched over all anchors for EAGLE-3.

    ``tokens`` (NB, W) target ids: score given branches instead of sampling (the logits are then the
    drafter's distributions conditioned on those tokens). ``generator`` drives the draws (temperature > 0);
    ``uniforms`` (NB, W) in [0, 1) instead: draft j of branch b is drawn by inverse CDF at
    uniforms[b, j] (draws that do not depend on which rank holds the branch).
    The returned logits keep the graph: the loss differentiates through them."""
    if branch_family(drafter) == "eagle3":
        return _sample_eagle3(drafter, batch, layout, generator, temperature, group, tokens, eos_token_id, uniforms)
    hidden, anchors, ids = drafter.backbone(batch, layout, group)
    base = drafter.base_logits(hidden)
    conf = None
    if not drafter.predicts_next:  # DFlash: block position j >= 1 is draft j; no dependence on samples
        logits = base[:, 1:]
        y = _draw(logits, temperature, generator, uniforms) if tokens is None else tokens
    else:  # DSpark: Markov head left to right on the drafter's own previous token
        NB, B = base.shape[:2]
        prev = ids[:, 0]
        cols, ys = [], []
        for i in range(B):
            li = base[:, i] + drafter.markov_head.bias(prev, hidden[:, i])
            yi = (_draw(li, temperature, generator, None if uniforms is None else uniforms[:, i])
                  if tokens is None else tokens[:, i])
            cols.append(li)
            ys.append(yi)
            prev = yi
        logits = torch.stack(cols, 1) if cols else base
        y = torch.stack(ys, 1) if ys else torch.zeros(NB, 0, dtype=torch.int64)
        if drafter.confidence_head is not None:
            conf = drafter.confidence_head(hidden)
    y = y.to(torch.int64)
    if tokens is not None and tuple(tokens.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}, expected {tuple(logits.shape[:2])} (branches x width)")
    return Branches(anchors=anchors, tokens=y, logits=logits, valid=_valid(y, eos_token_id), layout=layout,
                    confidence=conf)


def _sample_eagle3(drafter, batch: DraftBatch, layout: BranchLayout, generator, temperature: float, group,
                   tokens: Optional[torch.Tensor], eos_token_id: Optional[int],
                   uniforms: Optional[torch.Tensor]) -> Branches:
    """EAGLE-3's branches: its k train-time-test passes, pass t >= 1 reading y_t, the token drawn from
    pass t-1's logits (``Eagle3Drafter.forward``'s ``next_tokens`` hook), each pass batched over all
    anchors; y_k is drawn from the last pass. Draws are over draft ids, mapped to target ids."""
    vocab = drafter.vocab
    k = drafter.num_passes
    ys: list[torch.Tensor] = []

    def pick(j: int, logits: torch.Tensor) -> torch.Tensor:  # y_{j+1} (target ids) from draft j+1's logits
        if tokens is not None:
            if tokens.shape[1] != k or tokens.shape[0] != logits.shape[0]:
                raise ValueError(f"tokens has shape {tuple(tokens.shape)}, expected ({logits.shape[0]}, {k}) "
                                 "(branches x width)")
            y = tokens[:, j].to(torch.int64)
        else:
            y = _draw(logits, temperature, generator, None if uniforms is None else uniforms[:, j]).to(torch.int64)
            y = vocab.to_target(y) if vocab is not None else y
        ys.append(y)
        return y

    out = drafter(batch, layout, group=group, next_tokens=lambda t, logits: pick(t - 1, logits))
    pick(k - 1, out.logits[:, k - 1])
    y = torch.stack(ys, 1)
    bonus_pos = out.bonus_pos.cpu()  # index space on the host, as the layout (DraftOutput's is the device's)
    return Branches(anchors=bonus_pos - 1, tokens=y, logits=out.logits, valid=_valid(y, eos_token_id), layout=layout,
                    bonus=batch.input_ids[bonus_pos], vocab=vocab)


# ------------------------------------------------------------------------------- target scoring
def target_layout(draft_layout: BranchLayout, width: int, bonus: bool = False) -> Optional[BranchLayout]:
    """The target's tree layout for branches of ``width`` drafts at the drafter layout's anchors:
    W - 1 scored tokens per branch (y_1..y_{W-1}; with ``bonus``, EAGLE-3's, W: x_{a+1}, y_1..y_{W-1}),
    context up to and including the anchor, causal inside. None when no token is scored (W == 1 of
    a block drafter: p_1 comes from the stem alone). Same anchors, so the same owner rank."""
    n = width - 1 + int(bonus)
    if n < 1:
        return None
    a = draft_layout.anchors
    return BranchLayout(draft_layout.cu_seqlens, a, torch.full_like(a, n), context="inclusive",
                        intra="causal", cp_size=draft_layout.cp_size)


def target_inputs(branches: Branches, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target tree's branch tokens and their semantic (in-sequence) positions, both (NB, n),
    branch after branch: block drafters y_1..y_{W-1} at a+1..a+W-1; EAGLE-3 x_{a+1}, y_1..y_{W-1}
    at a+1..a+W (``branches.bonus``)."""
    W = branches.width
    toks = branches.tokens[:, : W - 1]
    if branches.bonus is not None:
        toks = torch.cat([branches.bonus[:, None].to(toks), toks], 1)
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64)
    a = branches.anchors
    start = cu[torch.searchsorted(cu, a, right=True) - 1]
    pos = (a - start)[:, None] + 1 + torch.arange(toks.shape[1])[None, :]
    return toks, pos


@dataclass
class _TreeCall:
    layout: BranchLayout
    group: object
    n_main: int


def _tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers AttentionInterface function: branch attention on [stem rows; branch rows]."""
    call: _TreeCall = kwargs.get("cotrain_tree")
    if call is None:
        raise RuntimeError("the cotrain_tree attention runs only inside tree_target_logits")
    if query.shape[0] != 1:
        raise ValueError(f"tree attention takes one packed row (batch 1), got batch {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (N, heads, D)
    L = call.n_main
    args = (q[:L], k[:L], v[:L], q[L:], k[L:], v[L:], call.layout)
    if call.layout.cp_size == 1 and call.group is None:
        out, _, bout, _ = local_branch_attention(*args, softmax_scale=scaling)
    else:
        out, _, bout, _ = cp_branch_attention(*args, call.group, softmax_scale=scaling)
    return torch.cat([out, bout], 0).unsqueeze(0), None


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, _tree_attention)
        _registered = True


@contextlib.contextmanager
def _attention(model, name: str):
    cfg = model.config
    old = cfg._attn_implementation_internal
    cfg._attn_implementation_internal = name
    try:
        yield
    finally:
        cfg._attn_implementation_internal = old


@dataclass
class TreeScores:
    """Target logits of one tree forward (this rank's rows under CP).

    stem_logits    (L, V): the stem rows this rank holds (all T at CP = 1; the zigzag shard with
                   padding rows at CP > 1, see ``stem_index``).
    stem_index     (L,) packed stem position of each row, -1 for padding.
    branch_logits  (Lb, V): the scored branch tokens, branch after branch (this rank's branches).
    layout         the target layout (None when no branch token was scored).
    """

    stem_logits: torch.Tensor
    stem_index: torch.Tensor
    branch_logits: torch.Tensor
    layout: Optional[BranchLayout]


def tree_target_logits(model, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, branches: Branches,
                       group=None) -> TreeScores:
    """One forward of the HF target ``model`` over the stem and the branch tokens y_1..y_{W-1}
    (EAGLE-3: x_{a+1}, y_1..y_{W-1}; :func:`target_inputs`).

    ``input_ids`` (T,) and ``cu_seqlens``: the global stem (every rank has it); ``branches``: this
    rank's branches (from :func:`sample_branches` on the same stem). Stem rows never see branch
    rows; branch token (b, j) sees the stem up to its anchor and the branch's tokens 1..j; RoPE
    positions are the semantic ones (in-sequence position of the anchor + j)."""
    _register()
    dl = branches.layout
    C = dl.cp_size
    rank = group_rank(group) if C > 1 else 0
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64)
    T = int(cu[-1])
    seq_of = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])
    pos = torch.arange(T) - cu[seq_of]
    W = branches.width
    tl = target_layout(dl, W, bonus=branches.bonus is not None)
    layout = tl if tl is not None else BranchLayout(cu, torch.zeros(0, dtype=torch.int64),
                                                    torch.zeros(0, dtype=torch.int64), context="inclusive",
                                                    intra="causal", cp_size=C)
    if C > 1:
        idx = layout.zigzag_index(rank)
    else:
        idx = torch.arange(T)
    r = idx.clamp(min=0)
    pad = int(getattr(model.config, "pad_token_id", None) or 0)
    stem_ids = torch.where(idx >= 0, input_ids[r], torch.full_like(r, pad))
    stem_pos = torch.where(idx >= 0, pos[r], torch.zeros_like(r))
    if tl is not None:
        bt, bpos = target_inputs(branches, cu)
        if bt.shape[0] != layout.local_branches(rank).numel():
            raise ValueError(f"rank {rank} holds {bt.shape[0]} branches, the layout gives it "
                             f"{layout.local_branches(rank).numel()}")
        b_ids, b_pos = bt.reshape(-1), bpos.reshape(-1)
    else:
        b_ids = b_pos = torch.zeros(0, dtype=torch.int64)
    ids = torch.cat([stem_ids, b_ids]).unsqueeze(0)
    position_ids = torch.cat([stem_pos, b_pos]).unsqueeze(0)
    call = _TreeCall(layout=layout, group=group if C > 1 else None, n_main=stem_ids.numel())
    device = next(model.parameters()).device
    with _attention(model, ATTN_NAME):
        out = model(input_ids=ids.to(device), position_ids=position_ids.to(device),
                    attention_mask={"full_attention": None, "sliding_attention": None}, use_cache=False,
                    cotrain_tree=call)
    logits = out.logits[0]
    L = stem_ids.numel()
    return TreeScores(stem_logits=logits[:L], stem_index=idx, branch_logits=logits[L:], layout=tl)


def branch_target_probs(scores: TreeScores, branches: Branches, temperature: float = 1.0) -> torch.Tensor:
    """(NB, W, V) detached target distributions of the drafts: block drafters p_1 from the stem row
    of the anchor, p_j (j >= 2) from branch token y_{j-1}; EAGLE-3 (``branches.bonus``) p_1 from the
    branch's bonus token x_{a+1}, p_j from y_{j-1}: every p_j from the branch rows."""
    NB, W = branches.tokens.shape
    if branches.bonus is not None:
        rows = scores.branch_logits.detach().float().view(NB, W, -1)
        return F.softmax(rows / temperature, dim=-1)
    row_of = {int(p): i for i, p in enumerate(scores.stem_index.tolist()) if p >= 0}
    rows = torch.tensor([row_of[int(a)] for a in branches.anchors.tolist()], dtype=torch.int64)
    first = scores.stem_logits[rows].detach().float()[:, None]
    rest = scores.branch_logits.detach().float().view(NB, W - 1, -1) if W > 1 else first[:, :0]
    return F.softmax(torch.cat([first, rest], 1) / temperature, dim=-1)


# ------------------------------------------------------------------------------- loss
def branch_chains(branches: Branches, loss_gamma: Optional[float] = None) -> DraftOutput:
    """The branches as draft chains for :func:`cotrain.draft.losses.draft_loss`. ``target_rows``
    is -1 (the supervising distributions are the tree forward's, not stem rows)."""
    NB, W = branches.tokens.shape
    return DraftOutput(logits=branches.logits, bonus_pos=branches.bonus_pos,
                       target_rows=torch.full((NB, W), -1, dtype=torch.int64), valid=branches.valid,
                       confidence=branches.confidence, loss_weight=exp_decay_weights(W, loss_gamma),
                       extras={"tokens": branches.tokens, "on_policy": True})


def specopd_loss(branches: Branches, p: torch.Tensor, loss: str = "e2e_tv",
                 loss_gamma: Optional[float] = None, temperature: float = 1.0, **extra) -> tuple[torch.Tensor, dict]:
    """The drafter loss (default E2E-TV) on the on-policy branches against the fixed target
    distributions ``p`` (NB, W, V) from :func:`branch_target_probs`. ``temperature``: the one the
    branches were drawn at (accept_weighted_tv's prefix acceptance reads it). ``extra``: draft_loss's
    keyword arguments (dspark_l1's weights). Under a reduced draft vocabulary (``branches.vocab``)
    the loss sees the draft-id logits, the target-id labels and p over the target's vocabulary, and
    restricts p as for teacher-forced chains (:mod:`cotrain.draft.losses`)."""
    return draft_loss(loss, branch_chains(branches, loss_gamma), p, labels=branches.tokens, vocab=branches.vocab,
                      branch_temperature=temperature, **extra)


def specopd_step(drafter, target_model, batch: DraftBatch, generator: Optional[torch.Generator] = None,
                 temperature: float = 1.0, loss: str = "e2e_tv", group=None, cp_size: int = 1,
                 layout: Optional[BranchLayout] = None, eos_token_id: Optional[int] = None,
                 extra: Optional[dict] = None) -> tuple[torch.Tensor, dict, Branches]:
    """One SpecOPD loss evaluation: seeded anchors, on-policy branches, one tree forward of the
    target, E2E-TV. Returns (loss, metrics, branches); the caller runs backward and the optimizer.
    Under CP (``cp_size`` > 1, ``group``) ``batch.taps`` is this rank's zigzag shard and the loss
    is this rank's mean: callers weight it by ``metrics["weight"]`` across ranks."""
    if layout is None:
        layout = drafter.build_layout(batch, generator, cp_size=cp_size)
    br = sample_branches(drafter, batch, layout, generator, temperature, group, eos_token_id=eos_token_id)
    with torch.no_grad():
        scores = tree_target_logits(target_model, batch.input_ids, batch.cu_seqlens, br, group)
    p = branch_target_probs(scores, br)
    value, metrics = specopd_loss(br, p, loss, getattr(drafter.cfg, "loss_gamma", None), temperature,
                                  **(extra or {}))
    metrics["branches"] = int(br.tokens.shape[0])
    metrics["branch_tokens_scored"] = int(scores.branch_logits.shape[0])
    return value, metrics, br
