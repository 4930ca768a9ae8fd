"""SpecOPD: parallel on-policy drafter distillation from random anchors (issue 13).

The reference (or rollout) tokens are the *stem*. B anchors are drawn on it from a seeded
generator (the drafter's own anchor rule: ``BlockDrafter.build_layout``). From every anchor a the
current drafter samples a *branch* of W tokens y_1..y_W at positions a+1..a+W - all anchors in one
drafter call, branches independent of each other, causal inside. The target then scores the stem
and all branches in ONE forward with the ancestor-only tree mask: branch token (b, j) sees the stem
up to and including its anchor and its own branch tokens 1..j; stem tokens never see branch tokens
(so the stem's outputs are those of the plain forward). Rotary positions are semantic (a + j), not
the packed order. The target distribution of draft j (1-based) is

    p_1 = softmax(target logits at stem row a)                 (= plain forward on stem[:a+1])
    p_j = softmax(target logits at branch token y_{j-1})       (= plain forward on stem[:a+1] + y_1..y_{j-1})

so the target needs only y_1..y_{W-1} of each branch. The loss is E2E-TV (``losses.e2e_tv`` through
``losses.draft_loss``) on the branch positions with y and p held fixed:

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
- EAGLE-3: possible but not built here. Its train-time-test passes are already sequential (pass t
  reads the token of step t and pass t-1's state); on-policy, pass t would read the token sampled
  from pass t-1's logits instead of the reference token: still batched over all anchors per pass,
  but k drafter passes rather than one call, and it needs a hook into ``Eagle3Drafter``'s pass loop
  (the token fed to passes >= 1 is read from ``batch.input_ids`` today).

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

from cotrain.draft.common import DraftBatch, DraftOutput, exp_decay_weights, group_rank
from cotrain.draft.losses import draft_loss
from cotrain.parallel import BranchLayout, cp_branch_attention, local_branch_attention

ATTN_NAME = "cotrain_tree"


# ------------------------------------------------------------------------------- branch sampling
@dataclass
class Branches:
    """Branches sampled by a block drafter (this rank's, under CP).

    anchors   (NB,) packed stem positions a (the bonus token; draft j predicts position a + j).
    tokens    (NB, W) sampled tokens y_1..y_W.
    logits    (NB, W, V) the drafter's logits at each branch position given its own samples y_{<j}
              (with the autograd graph of the call that produced them; divide by nothing: these are
              the raw logits, the sampling temperature only scaled them for the draw).
    valid     (NB, W) bool: false after a sampled EOS (nothing after it can be accepted).
    layout    the drafter's layout (anchors, CP size).
    """

    anchors: torch.Tensor
    tokens: torch.Tensor
    logits: torch.Tensor
    valid: torch.Tensor
    layout: BranchLayout
    confidence: Optional[torch.Tensor] = None

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])


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


def _check_block_drafter(drafter) -> None:
    from cotrain.draft.dflash import BlockDrafter

    if not isinstance(drafter, BlockDrafter):
        raise NotImplementedError(
            f"on-policy branches are built for block drafters (dflash, dspark); got {type(drafter).__name__} "
            "(EAGLE-3 would need its train-time-test passes to read sampled tokens: see cotrain.draft.specopd)")


def sample_branches(drafter, batch: DraftBatch, layout: BranchLayout, generator: Optional[torch.Generator] = None,
                    temperature: float = 1.0, group=None, tokens: Optional[torch.Tensor] = None,
                    eos_token_id: Optional[int] = None, uniforms: Optional[torch.Tensor] = None) -> Branches:
    """Sample a branch at every anchor of ``layout`` (this rank's anchors under CP) in one drafter call.

    ``tokens`` (NB, W): score given branches instead of sampling (the logits are then the drafter's
    distributions conditioned on those tokens). ``generator`` drives the draws (temperature > 0);
    ``uniforms`` (NB, W) in [0, 1) instead: draft j of branch b is drawn by inverse CDF at
    uniforms[b, j] (draws that do not depend on which rank holds the branch).
    The returned logits keep the graph: the loss differentiates through them."""
    _check_block_drafter(drafter)
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
    valid = torch.ones_like(y, dtype=torch.bool)
    if eos_token_id is not None and y.shape[1] > 1:
        ended = torch.cumsum((y == eos_token_id).to(torch.int64), 1)  # EOS at i: positions > i are invalid
        valid[:, 1:] = ended[:, :-1] == 0
    return Branches(anchors=anchors, tokens=y, logits=logits, valid=valid, layout=layout, confidence=conf)


# ------------------------------------------------------------------------------- target scoring
def target_layout(draft_layout: BranchLayout, width: int) -> Optional[BranchLayout]:
    """The target's tree layout for branches of ``width`` drafts at the drafter layout's anchors:
    W - 1 scored tokens per branch (y_1..y_{W-1}), context up to and including the anchor, causal
    inside. None when W == 1 (p_1 comes from the stem alone). Same anchors, so the same owner rank."""
    if width < 2:
        return None
    a = draft_layout.anchors
    return BranchLayout(draft_layout.cu_seqlens, a, torch.full_like(a, width - 1), context="inclusive",
                        intra="causal", cp_size=draft_layout.cp_size)


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
    """One forward of the HF target ``model`` over the stem and the branch tokens y_1..y_{W-1}.

    ``input_ids`` (T,) and ``cu_seqlens``: the global stem (every rank has it); ``branches``: this
    rank's branches (from :func:`sample_branches` on the same stem). Stem rows never see branch
    rows; branch token (b, j) sees the stem up to its anchor and y_{b,1..j}; RoPE positions are
    the semantic ones (in-sequence position of the anchor + j)."""
    _register()
    dl = branches.layout
    C = dl.cp_size
    rank = group_rank(group) if C > 1 else 0
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64)
    T = int(cu[-1])
    seq_of = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])
    pos = torch.arange(T) - cu[seq_of]
    W = branches.width
    tl = target_layout(dl, W)
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
        bt = branches.tokens[:, : W - 1]
        bpos = pos[branches.anchors][:, None] + 1 + torch.arange(W - 1)[None, :]
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
    """(NB, W, V) detached target distributions of the drafts: p_1 from the stem row of the anchor,
    p_j (j >= 2) from branch token y_{j-1}."""
    NB, W = branches.tokens.shape
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
    return DraftOutput(logits=branches.logits, bonus_pos=branches.anchors,
                       target_rows=torch.full((NB, W), -1, dtype=torch.int64), valid=branches.valid,
                       confidence=branches.confidence, loss_weight=exp_decay_weights(W, loss_gamma),
                       extras={"tokens": branches.tokens, "on_policy": True})


def specopd_loss(branches: Branches, p: torch.Tensor, loss: str = "e2e_tv",
                 loss_gamma: Optional[float] = None, **extra) -> tuple[torch.Tensor, dict]:
    """The drafter loss (default E2E-TV) on the on-policy branches against the fixed target
    distributions ``p`` (NB, W, V) from :func:`branch_target_probs`. ``extra``: draft_loss's
    keyword arguments (dspark_l1's weights)."""
    return draft_loss(loss, branch_chains(branches, loss_gamma), p, labels=branches.tokens, **extra)


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
    value, metrics = specopd_loss(br, p, loss, drafter.cfg.loss_gamma, **(extra or {}))
    metrics["branches"] = int(br.tokens.shape[0])
    metrics["branch_tokens_scored"] = int(scores.branch_logits.shape[0])
    return value, metrics, br
