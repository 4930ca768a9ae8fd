"""GRPO's mathematics, as pure functions on tensors (no workers, no models).

For a prompt with G sampled responses and rewards r_1..r_G, the advantage of response i is

    A_i = (r_i - b_i) / (std(r) + eps)   if normalize_std else   r_i - b_i

with baseline b_i = mean(r) ("mean") or the mean of the *other* G-1 rewards ("leave_one_out"), and
std(r) the (unbiased) standard deviation of all G rewards of the group, for either baseline. (NeMo-RL
divides a leave-one-out advantage by the std of the other G-1 rewards instead, skipping the division
when that is 0. We keep one scale per group: r_i - mean_{-i}(r) = G/(G-1) (r_i - mean(r)), so with
the group's std the leave-one-out advantages are exactly G/(G-1) times the mean-baseline ones, still
sum to 0 over the group and keep their order; a per-sample std gives the lone correct answer among
wrong ones (its others all equal: std 0, not divided) +1 against 3 x -0.71 for the wrong ones at
G=4 - the group's advantages no longer sum to 0.)

Every response token t of response i gets A_i. With the ratio rho_t = exp(clamp(logp_t - logp_old_t,
-log_ratio_clamp, log_ratio_clamp)), the token loss is the clipped surrogate plus an optional KL
penalty to a reference policy,

    l_t = -max(c A_i, min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i))  if A_i < 0 (dual clip)
    l_t = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i)              otherwise
          + beta * min(k3_t, kl_clamp),
    k3_t = exp(d_t) - d_t - 1,  d_t = ref_t - logp_t       (non-negative, unbiased for KL)

The dual clip (c = ``clip_ratio_c`` > 1, Ye et al. 2020, verl's ``clip_ratio_c``) bounds the loss of
a negative-advantage token whose ratio has run far above 1; ``log_ratio_clamp`` (verl clamps at 20)
keeps exp() finite; the k3 clamp (verl and NeMo-RL clamp at 10) bounds one token's KL penalty.
k3 is computed as expm1(d) - d in float64, so it is >= 0 to the last bit (exp(d) - d - 1 in float32
rounds to about -1e-8 for |d| ~ 1e-4, which made a train-inference KL of ~0 print negative).

The batch loss aggregates l_t over response tokens either as one mean over all tokens
("token_mean") or as the mean over sequences of each sequence's token mean ("seq_mean").

Off-policy correction (grpo.importance_correction). The responses were sampled by a behaviour
policy mu (the engines: up to grpo.max_staleness versions older than the policy pi_old the update
starts from, and another implementation of it); with w_t = pi_old(y_t) / mu(y_t) (both detached),

    tis:  l_t <- min(w_t, C) * l_t^pg + kl_t                 (truncated IS: every token kept)
    mis:  l_t <- w_t * l_t^pg + kl_t   for w_t <= C; tokens with w_t > C leave the loss - its sum
          and its token (sequence) counts                    (masked IS: an outlier is rejected)

(l^pg the clipped surrogate term, kl_t the penalty, C = grpo.importance_cap). Truncation bounds the
variance at the price of a bias towards mu where w > C; masking removes those tokens altogether
(Yao et al. 2025; Liu et al. 2025's MIS; rejected tokens out of the denominator as verl and slime
count them).
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


def groups_with_signal(rewards: torch.Tensor) -> torch.Tensor:
    """``rewards`` [P, G] -> [P] bool: the group's rewards are not all equal. A group of equal
    rewards has advantage 0 for every sample under either baseline, so it carries no learning
    signal (with grpo.kl_coef > 0 only the KL term pulls on it)."""
    return rewards.amax(dim=1) != rewards.amin(dim=1)


def select_groups(signal: list[bool], keep: int) -> list[int]:
    """DAPO's dynamic sampling over the groups drawn in a step, in draw order (``signal``: which carry
    a learning signal): the indices of the ``keep`` groups the update trains on - the first ``keep``
    with signal, filled up (when fewer were drawn) with the first ones without, in draw order."""
    with_signal = [i for i, s in enumerate(signal) if s][:keep]
    without = [i for i, s in enumerate(signal) if not s][:keep - len(with_signal)]
    return sorted(with_signal + without)


#: defaults of the guards, the same as grpo.log_ratio_clamp / grpo.clip_ratio_c / grpo.kl_clamp
LOG_RATIO_CLAMP = 20.0
CLIP_RATIO_C = 3.0
KL_CLAMP = 10.0


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor, log_ratio_clamp: float | None = None,
          clamp: float | None = None) -> torch.Tensor:
    """Per-token estimator of KL(pi || ref) from samples of pi (Schulman's k3), >= 0 exactly.

    Computed as ``expm1(d) - d`` in float64 (d = ref_logp - logp, clamped to +-``log_ratio_clamp``
    when given) and returned in the inputs' dtype; ``clamp`` caps each token's value (None = no cap).
    """
    out_dtype = torch.promote_types(logp.dtype, ref_logp.dtype)
    d = ref_logp.double() - logp.double()
    if log_ratio_clamp is not None:
        d = d.clamp(-log_ratio_clamp, log_ratio_clamp)
    k3 = (torch.expm1(d) - d).clamp(min=0.0)  # expm1(d) >= d in exact arithmetic: the clamp only guards rounding
    if clamp is not None:
        k3 = k3.clamp(max=clamp)
    return k3.to(out_dtype)


IS_CORRECTIONS = ("none", "tis", "mis")


def importance_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                       cap: float, log_ratio_clamp: float | None = LOG_RATIO_CLAMP
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The off-policy correction of the module doc: per-token weights [N, S] for the policy-gradient
    term, the loss mask [N, S] the update keeps (``mask`` itself for tis; without the rejected
    tokens for mis) and metrics over the response tokens (``mask``): ``train/is_ratio_mean`` (of w),
    ``train/is_ratio_max`` and ``train/is_truncated_frac`` (w > C: truncated by tis, rejected by
    mis). ``old_logp`` / ``behaviour_logp``: the trainer's and the engines' log-probs [N, S]."""
    if mode not in ("tis", "mis"):
        raise ValueError(f"grpo.importance_correction: {mode!r} (allowed here: tis, mis)")
    log_w = old_logp.double() - behaviour_logp.double()
    if log_ratio_clamp is not None:
        log_w = log_w.clamp(-log_ratio_clamp, log_ratio_clamp)
    w = torch.exp(log_w)
    on = mask.bool()
    over = (w > cap) & on
    if mode == "tis":
        weights, keep = w.clamp(max=cap), mask
    else:
        weights, keep = torch.where(over, torch.zeros_like(w), w), mask * (~over).to(mask.dtype)
    n = max(int(on.sum()), 1)
    stats = {"train/is_ratio_mean": float(w[on].sum()) / n,
             "train/is_ratio_max": float(w[on].max()) if on.any() else 1.0,
             "train/is_truncated_frac": float(over.sum()) / n}
    return (weights * mask.double()).to(old_logp.dtype), keep, stats


def grpo_token_losses(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float, clip_high: float, ref_logp: torch.Tensor | None = None,
                      kl_coef: float = 0.0, log_ratio_clamp: float | None = LOG_RATIO_CLAMP,
                      clip_ratio_c: float | None = CLIP_RATIO_C,
                      kl_clamp: float | None = KL_CLAMP,
                      is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss l_t (same shape as ``logp``) and per-token diagnostics.

    ``log_ratio_clamp``, ``clip_ratio_c`` and ``kl_clamp`` are grpo.log_ratio_clamp,
    grpo.clip_ratio_c and grpo.kl_clamp (None = that guard off); ``is_weights`` the off-policy
    correction's weights of the policy-gradient term (:func:`importance_weights`; None = none,
    nothing multiplied). Diagnostics: ``ratio``,
    ``clipped`` (the clipped term was taken), ``dual_clipped`` (the dual clip's floor was taken)
    and, with ``ref_logp``, ``kl_ref`` (the unclamped k3, the KL measurement; the penalty uses the
    clamped one).
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1:
        raise ValueError(f"grpo.clip_ratio_c: {clip_ratio_c} (allowed: > 1, or null = no dual clip)")
    log_ratio = logp - old_logp
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    objective = torch.minimum(unclipped, clipped)
    info = {"ratio": ratio.detach(), "clipped": (clipped < unclipped).float().detach()}
    if clip_ratio_c is not None:
        floor = clip_ratio_c * advantages
        dual = (advantages < 0) & (objective < floor)
        objective = torch.where(dual, floor, objective)
        info["dual_clipped"] = dual.float().detach()
    else:
        info["dual_clipped"] = torch.zeros_like(ratio).detach()
    loss = -objective if is_weights is None else -objective * is_weights
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp, log_ratio_clamp=log_ratio_clamp)
        info["kl_ref"] = kl.detach()
        if kl_coef:
            loss = loss + kl_coef * (kl.clamp(max=kl_clamp) if kl_clamp is not None else kl)
    return loss, info


def aggregate(token_losses: torch.Tensor, mask: torch.Tensor, loss_agg: str, num_tokens: float | None = None,
              num_seqs: float | None = None, seq_tokens: torch.Tensor | None = None,
              seq_index: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce [B, T] token losses over response tokens (``mask``).

    ``num_tokens``/``num_seqs`` are the global counts when a batch is split into micro-batches (so
    that summing the micro-batch results gives the global mean); by default this batch's own counts.
    ``seq_tokens`` [B]: each sequence's response-token count when ``token_losses`` holds only part
    of every row (context parallelism: a rank's zigzag chunks), so that summing the parts over the
    ranks gives each sequence's mean; by default the rows' own counts.
    ``seq_index`` [B, T]: packed rows (cotrain.rl.packing), the sequence (0 .. len(seq_tokens) - 1) each
    position belongs to, -1 for none; seq_mean then sums per sequence, not per row.
    """
    mask = mask.to(token_losses.dtype)
    if loss_agg == "token_mean":
        denom = num_tokens if num_tokens is not None else mask.sum().clamp(min=1)
        return (token_losses * mask).sum() / denom
    if loss_agg == "seq_mean":
        if seq_index is None:
            counts = mask.sum(dim=1) if seq_tokens is None else seq_tokens.to(token_losses.dtype)
            sums = (token_losses * mask).sum(dim=1)
        else:
            counts = seq_tokens.to(token_losses.dtype)
            valid = seq_index >= 0
            sums = token_losses.new_zeros(len(counts)).index_add(0, seq_index[valid], (token_losses * mask)[valid])
        per_seq = sums / counts.clamp(min=1)
        denom = num_seqs if num_seqs is not None else len(counts)
        return per_seq.sum() / denom
    raise ValueError(f"grpo.loss_agg: {loss_agg!r} (allowed: {', '.join(LOSS_AGGS)})")
