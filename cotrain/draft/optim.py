"""The drafter's optimizer and learning-rate schedule (offline distillation and online co-training).

AdamW over the drafter's trainable parameters with ``draft.optimizer`` (betas, eps, weight decay);
the learning rate at optimizer step t (0-based) of T:

    warm-up (t < W):   lr * (t + 1) / W
    constant:          lr
    cosine:            min_lr + (lr - min_lr) * (1 + cos(pi * min(1, (t + 1 - W) / max(1, T - W)))) / 2

(the policy's schedule, Megatron's OptimizerParamScheduler as the trainer steps it: step t runs at
the rate of its 1-based number, so the last of T steps runs at min_lr).

Gradient clipping (``clip_grad`` > 0) is by the global L2 norm of the drafter's gradients only: the
drafter never shares an optimizer, a schedule or a clipping norm with the policy.
"""

from __future__ import annotations

import math

import torch


def lr_at(step: int, total: int, opt) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of ``total`` under ``opt`` (an OptimizerConfig)."""
    if opt.warmup_steps and step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.schedule == "cosine":
        span = max(1, total - opt.warmup_steps)
        t = min(1.0, (step + 1 - opt.warmup_steps) / span)
        return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1 + math.cos(math.pi * t))
    return opt.lr


def make_optimizer(module: torch.nn.Module, opt) -> torch.optim.AdamW:
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)


def apply_config(param_groups: list[dict], opt, **extra) -> None:
    """Put ``opt``'s betas and eps (and ``extra`` keys) into every param group, after an optimizer's
    ``load_state_dict``: a checkpoint's param groups carry the hyperparameters they were saved with,
    and a resume with a changed config must run on the config's (the learning rate is set each step
    from the schedule)."""
    for g in param_groups:
        g.update(betas=tuple(opt.betas), eps=opt.eps, **extra)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def clip_(params: list[torch.Tensor], max_norm: float) -> float:
    """Clip the gradients of ``params`` to global norm ``max_norm`` (0 = no clipping); returns the norm before."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
    return float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in grads)))


def remap_optimizer_rows(optimizer: torch.optim.Optimizer, param: torch.Tensor, src: torch.Tensor) -> None:
    """After a draft-vocabulary rebuild (EAGLE-3's ``set_vocab``): move the optimizer's per-row state
    of ``param`` (Adam's moments of the LM head) with its rows, new row i from old row ``src[i]``;
    rows of new tokens (``src[i] = -1``) start from zero."""
    st = optimizer.state.get(param)
    if not st:
        return
    kept = src >= 0
    for key, t in st.items():
        if torch.is_tensor(t) and t.shape == param.shape:
            new = torch.zeros_like(t)
            new[kept.to(t.device)] = t[src[kept].to(t.device)]
            t.copy_(new)
