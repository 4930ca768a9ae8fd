"""dense_branch_attention: the single-process, explicit-mask definition of branch attention.

All queries (T main, then NBt branch tokens) and all keys (same order) go into one score matrix;
the mask spelled out below (the rule stated in cotrain.parallel.layout) decides what is visible:

    out_i = sum_j softmax_j(scale * q_i . k_j | mask_ij) v_j,   lse_i = log sum_{j: mask_ij} exp(scale * q_i . k_j)

It is the test oracle of cp_branch_attention / local_branch_attention and of the drafters' training
path, which never calls it (memory grows as (T + NBt)^2; reference/draft_path.py keeps the old
bucketed use of it for the tests and the benchmark). It computes in fp32 (fp64 if given fp64) and autograd
differentiates it, so it shares no code with the ring implementation.
"""

from __future__ import annotations

from typing import Optional

import torch

from cotrain.parallel.layout import BranchLayout


def branch_attention_mask(layout: BranchLayout) -> torch.Tensor:
    """(T + NBt, T + NBt) bool: row = query, column = key, main rows/columns first."""
    T, NBt = layout.total_len, layout.total_branch_tokens
    cu = layout.cu_seqlens
    # Per main token: its sequence and in-sequence position.
    main_seq = torch.repeat_interleave(torch.arange(layout.num_seqs), cu[1:] - cu[:-1])
    main_pos = torch.arange(T) - cu[main_seq]
    # Per branch token: its branch, index inside the branch, sequence and last visible position.
    tok_branch = torch.repeat_interleave(torch.arange(layout.num_branches), layout.branch_lens)
    tok_j = torch.arange(NBt) - layout.branch_offsets[tok_branch]
    br_seq = torch.searchsorted(cu, layout.anchors, right=True) - 1
    anchor_in_seq = layout.anchors - cu[br_seq]
    last_visible = anchor_in_seq if layout.context == "inclusive" else anchor_in_seq - 1
    tok_seq, tok_last = br_seq[tok_branch], last_visible[tok_branch]

    def trunk_visible(q_seq, q_last):  # which main keys a query (sequence, last visible position) sees
        ok = (q_seq[:, None] == main_seq[None, :]) & (main_pos[None, :] <= q_last[:, None])
        if layout.window is not None:
            ok &= main_pos[None, :] > q_last[:, None] - layout.window
        return ok

    mask = torch.zeros(T + NBt, T + NBt, dtype=torch.bool)
    mask[:T, :T] = trunk_visible(main_seq, main_pos)  # main -> main
    mask[T:, :T] = trunk_visible(tok_seq, tok_last)  # branch -> main context
    same_branch = tok_branch[:, None] == tok_branch[None, :]  # branch -> own branch
    if layout.intra == "causal":
        same_branch &= tok_j[None, :] <= tok_j[:, None]
    mask[T:, T:] = same_branch
    return mask  # main -> branch stays False


def dense_branch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bq: Optional[torch.Tensor],
    bk: Optional[torch.Tensor],
    bv: Optional[torch.Tensor],
    layout: BranchLayout,
    softmax_scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Branch attention on full packed tensors.

    q (T, H, D), k and v (T, Hk, D) with H % Hk == 0 (grouped-query attention: query head h uses
    K/V head h // (H / Hk)); bq (NBt, H, D), bk and bv (NBt, Hk, D), or None when NBt = 0.
    Returns out (T, H, D) and bout (NBt, H, D) in q's dtype, lse (T, H) and blse (NBt, H) in the
    compute dtype (fp32, or fp64 for fp64 inputs).
    """
    T, H, D = q.shape
    Hk = k.shape[1]
    if layout.cp_size != 1:
        layout = layout.with_cp(1)
    if T != layout.total_len:
        raise ValueError(f"q has {T} rows, layout.total_len is {layout.total_len}")
    if bq is None:
        bq, bk, bv = q.new_zeros(0, H, D), k.new_zeros(0, Hk, D), v.new_zeros(0, Hk, D)
    if bq.shape[0] != layout.total_branch_tokens:
        raise ValueError(f"bq has {bq.shape[0]} rows, layout.total_branch_tokens is {layout.total_branch_tokens}")
    if H % Hk:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hk})")
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    ctype = torch.promote_types(q.dtype, torch.float32)

    Q = torch.cat([q, bq]).to(ctype)
    K = torch.cat([k, bk]).to(ctype).repeat_interleave(H // Hk, dim=1)
    V = torch.cat([v, bv]).to(ctype).repeat_interleave(H // Hk, dim=1)
    mask = branch_attention_mask(layout).to(q.device)
    scores = torch.einsum("qhd,khd->hqk", Q, K) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (H, N)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, V).to(q.dtype)
    lse = lse.transpose(0, 1)
    return out[:T], lse[:T], out[T:], lse[T:]
