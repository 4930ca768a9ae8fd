"""GRPO's mathematics, as pure functions on tensors (no workers, no models).

For a prompt with G sampled responses and rewards r_1..r_G, the advantage of response i is

    A_i = (r_i - b_i) / (std(r) + eps)   if normalize_std else   r_i - b_i

with baseline b_i = mean(r) ("mean") or the mean of the *other* G-1 rewards ("leave_one_out").
Every response token t of response i gets A_i. With the ratio rho_t = exp(logp_t - logp_old_t), the
token loss is the clipped surrogate plus an optional KL penalty to a reference policy,

    l_t = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i) + beta * k3_t,
    k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (non-negative, unbiased for KL)

and the batch loss aggregates l_t over response tokens either as one mean over all tokens
("token_mean") or as the mean over sequences of each sequence's token mean ("seq_mean").
"""

from __future__ import annotations

import torch

BASELINES = ("mean", "leave_one_out")
LOSS_AGGS = ("token_mean", "seq_mean")


def group_advantages(rewards: torch.Tensor, baseline: str = "mean", normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """``rewards`` [P, G] (prompts x samples) -> advantages [P, G]."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, group_size>=2], got {tuple(rewards.shape)}")
    rewards = rewards.double()
    G = rewards.shape[1]
    if baseline == "mean":
        base = rewards.mean(dim=1, keepdim=True)
    elif baseline == "leave_one_out":
        base = (rewards.sum(dim=1, keepdim=True) - rewards) / (G - 1)
    else:
        raise ValueError(f"grpo.baseline: {baseline!r} (allowed: {', '.join(BASELINES)})")
    adv = rewards - base
    if normalize_std:
        adv = adv / (rewards.std(dim=1, keepdim=True) + eps)
    return adv.float()


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimator of KL(pi || ref) from samples of pi (Schulman's k3)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def grpo_token_losses(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float, clip_high: float, ref_logp: torch.Tensor | None = None,
                      kl_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss l_t (same shape as ``logp``) and per-token diagnostics."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    info = {"ratio": ratio.detach(), "clipped": (clipped < unclipped).float().detach()}
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        info["kl_ref"] = kl.detach()
        if kl_coef:
            loss = loss + kl_coef * kl
    return loss, info


def aggregate(token_losses: torch.Tensor, mask: torch.Tensor, loss_agg: str, num_tokens: float | None = None,
              num_seqs: float | None = None) -> torch.Tensor:
    """Reduce [B, T] token losses over response tokens (``mask``).

    ``num_tokens``/``num_seqs`` are the global counts when a batch is split into micro-batches (so
    that summing the micro-batch results gives the global mean); by default this batch's own counts.
    """
    mask = mask.to(token_losses.dtype)
    if loss_agg == "token_mean":
        denom = num_tokens if num_tokens is not None else mask.sum().clamp(min=1)
        return (token_losses * mask).sum() / denom
    if loss_agg == "seq_mean":
        per_seq = (token_losses * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        denom = num_seqs if num_seqs is not None else token_losses.shape[0]
        return per_seq.sum() / denom
    raise ValueError(f"grpo.loss_agg: {loss_agg!r} (allowed: {', '.join(LOSS_AGGS)})")
