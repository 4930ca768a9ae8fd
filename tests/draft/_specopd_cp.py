"""Shared setup of the SpecOPD tests, and the rank function of its CP = 2 test."""

import torch

from cotrain.draft.common import DraftBatch
from cotrain.draft.registry import build_drafter
from cotrain.draft.taps import TargetSpec, compute_taps, load_hf_target
from cotrain.parallel import zigzag_shard

SETTINGS = {"dflash": {"block_size": 4, "anchors_per_seq": 3}, "dspark": {"block_size": 3, "anchors_per_seq": 3}}
LENS = (13, 6, 21)
PROMPT = 2


def make_drafter(kind, target, seed=3):
    d = build_drafter(kind, SETTINGS[kind], target, seed=seed).eval()
    if kind == "dspark":  # a Markov head that matters: drafts depend on the previous draft
        with torch.no_grad():
            d.markov_head.markov_w2.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    return d


def ks_statistic(u: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance of the sample ``u`` from Uniform(0, 1)."""
    u = torch.sort(u).values
    n = u.numel()
    i = torch.arange(1, n + 1, dtype=u.dtype)
    return float(torch.maximum(i / n - u, u - (i - 1) / n).max())


def randomised_pit(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, seed: int = 8) -> torch.Tensor:
    """Randomised probability integral transform of each draw ``tokens`` under softmax(logits / T):
    F(y-) + u p(y), u ~ U(0, 1) (seeded); Uniform(0, 1) exactly when the draws follow that distribution."""
    probs = torch.softmax(logits.detach().double() / temperature, -1)
    y = tokens[..., None]
    p_y = probs.gather(-1, y).squeeze(-1)
    below = torch.cumsum(probs, -1).gather(-1, y).squeeze(-1) - p_y
    u = torch.rand(y.shape[:-1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (below + u * p_y).reshape(-1)


def make_batch(model, drafter, lens=LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 100, (sum(lens),), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lens), 0)])
    taps, logits = compute_taps(model, ids, cu, drafter.tap_layers)
    pos = torch.cat([torch.arange(n) for n in lens])
    return DraftBatch(ids, cu, taps, pos >= PROMPT, logits, torch.full((len(lens),), PROMPT))


def rank_fn(rank, world, target_path):
    """Each family at CP = 2: seeded (balanced) anchors, this rank's branches sampled with a
    rank-specific generator, one tree forward of the target over this rank's stem shard + branches."""
    from cotrain.draft import specopd

    torch.manual_seed(0)
    target = TargetSpec.from_checkpoint(target_path)
    model = load_hf_target(target_path)
    out = {}
    for kind in SETTINGS:
        d = make_drafter(kind, target)
        full = make_batch(model, d)
        layout = d.build_layout(full, torch.Generator().manual_seed(11), cp_size=world)
        batch = DraftBatch(full.input_ids, full.cu_seqlens, zigzag_shard(full.taps, layout, rank), full.loss_mask,
                           None, full.response_start)
        br = specopd.sample_branches(d, batch, layout, torch.Generator().manual_seed(100 + rank))
        with torch.no_grad():
            sc = specopd.tree_target_logits(model, full.input_ids, full.cu_seqlens, br)
        out[kind] = {"anchors": br.anchors, "tokens": br.tokens, "draft_logits": br.logits.detach(),
                     "stem_index": sc.stem_index, "stem_logits": sc.stem_logits, "branch_logits": sc.branch_logits,
                     "layout_anchors": layout.anchors}
    return out


def eagle3_rank_fn(rank, world, target_path, k):
    """EAGLE-3 at CP = 2: this rank's chain anchors (the layout's owner rule), draws at per-anchor
    uniforms (rank-independent), the k passes over the CP group, the tree forward of its branches,
    the loss weighted by its positions and its gradients (summed over ranks by the test)."""
    from cotrain.draft import specopd

    torch.manual_seed(0)
    target = TargetSpec.from_checkpoint(target_path)
    model = load_hf_target(target_path)
    d = build_drafter("eagle3", {"ttt_steps": k}, target, seed=3).train()
    full = make_batch(model, d)
    layout = d.build_layout(full, cp_size=world)
    batch = DraftBatch(full.input_ids, full.cu_seqlens, zigzag_shard(full.taps, layout, rank), full.loss_mask,
                       None, full.response_start)
    anchors = layout.anchors[layout.local_branches(rank)]
    u = torch.rand(full.num_tokens, k, generator=torch.Generator().manual_seed(5))[anchors]
    br = specopd.sample_branches(d, batch, layout, temperature=1.0, uniforms=u)
    with torch.no_grad():
        sc = specopd.tree_target_logits(model, full.input_ids, full.cu_seqlens, br)
    p = specopd.branch_target_probs(sc, br)
    loss, m = specopd.specopd_loss(br, p)
    (loss * m["weight"]).backward()
    return {"anchors": br.anchors, "tokens": br.tokens, "draft_logits": br.logits.detach(), "p": p,
            "stem_index": sc.stem_index, "stem_logits": sc.stem_logits, "weight": m["weight"],
            "loss_sum": (loss * m["weight"]).detach(),
            "grads": {n: q.grad.clone() for n, q in d.named_parameters() if q.grad is not None}}
