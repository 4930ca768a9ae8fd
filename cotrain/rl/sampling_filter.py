"""The engines' top-k / top-p filter, on the trainer's (vocab-parallel) logits.

vLLM samples from ``softmax(filter(logits / T))`` and reports that distribution's log-probs
(``logprobs_mode="processed_logprobs"``). The trainer recomputes the same distribution: the
tempered logits outside the kept set are set to -inf before the log-softmax. The kept set is
vLLM's (``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p_pytorch`` /
``apply_top_k_only``):

* top-k: every token whose tempered logit is >= the k-th largest (ties at the k-th value kept);
* top-p (after top-k): the vocabulary sorted by increasing probability of the (top-k) renormalised
  distribution, a token is dropped while the cumulative probability up to and including it is
  <= 1 - p; the most likely token is always kept.

Under tensor parallelism each rank holds a slice of the vocabulary. top-k alone needs only each
rank's k largest values (all-gathered: ``tp * k`` numbers per position); top-p needs the whole
sorted distribution, so the full-vocabulary logits are all-gathered (no gradient) for the mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def filter_active(temperature: float, top_k: int, top_p: float) -> bool:
    """Whether the engines filter at all (greedy sampling, T = 0, ignores top-k / top-p)."""
    return temperature > 0 and (top_k not in (-1, 0) or top_p < 1.0)


def _gather_vocab(x: torch.Tensor, group) -> torch.Tensor:
    """[N, V/tp] on every rank of ``group`` -> [N, V] (rank order)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _kth_largest(x: torch.Tensor, k: int, group) -> torch.Tensor:
    """The k-th largest value of each row of the full vocabulary [N, 1] from the local slices."""
    local = x.topk(min(k, x.shape[-1]), dim=-1).values
    if group is not None and dist.get_world_size(group) > 1:
        local = _gather_vocab(local, group)  # [N, tp * min(k, V/tp)]: the k largest are among them
    return local.topk(k, dim=-1).values[:, -1:]


def _keep_full(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's sort-based filter on full-vocabulary rows [N, V] -> kept [N, V] (bool)."""
    V = x.shape[-1]
    srt, idx = x.sort(dim=-1, descending=False)
    if 0 < top_k < V:
        kth = srt[:, V - top_k:V - top_k + 1]
        srt.masked_fill_(srt < kth, float("-inf"))
    if top_p < 1.0:
        cum = srt.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - torch.tensor(top_p, dtype=torch.float32)
        drop[:, -1] = False  # at least one
        srt.masked_fill_(drop, float("-inf"))
    keep_sorted = srt > float("-inf")
    return torch.zeros_like(keep_sorted).scatter_(-1, idx, keep_sorted)


@torch.no_grad()
def keep_mask(logits: torch.Tensor, top_k: int, top_p: float, group=None, vocab_start: int = 0) -> torch.Tensor:
    """Which tokens the sampler keeps: bool, the shape of ``logits`` [..., V_local].

    ``logits``: tempered, float32; under TP the slice [vocab_start, vocab_start + V_local) of the
    vocabulary held by this rank of ``group`` (the slices in rank order make up the vocabulary).
    ``top_k``: -1 (or 0) = off; ``top_p``: 1 = off.
    """
    shape = logits.shape
    x = logits.reshape(-1, shape[-1]).float()
    tp = dist.get_world_size(group) if group is not None else 1
    V = shape[-1] * tp
    k = top_k if 0 < top_k < V else 0
    if not k and top_p >= 1.0:
        return torch.ones(shape, dtype=torch.bool, device=logits.device)
    if top_p >= 1.0:  # top-k alone: a threshold, no sort, no full gather
        return (x >= _kth_largest(x, k, group if tp > 1 else None)).reshape(shape)
    full = _gather_vocab(x, group) if tp > 1 else x
    keep = _keep_full(full, k, top_p)
    return keep[:, vocab_start:vocab_start + shape[-1]].reshape(shape)


def sampling_logits(logits: torch.Tensor, sampling, group=None, vocab_start: int = 0
                    ) -> tuple[torch.Tensor, "torch.Tensor | None"]:
    """The distribution the engines sample from, on the trainer's logits: ``(logits.float() / T,
    keep)``, ``keep`` the kept set (:func:`keep_mask` of the tempered logits, bool, their shape) or
    None when ``sampling`` (rollout.sampling: temperature, top_k, top_p) does not filter. Its
    log-softmax with -inf outside ``keep`` is vLLM's ``processed_logprobs``. ``group`` /
    ``vocab_start``: the vocab-parallel slice, as for :func:`keep_mask`."""
    tempered = logits.float() / (sampling.temperature or 1.0)
    if not filter_active(sampling.temperature, sampling.top_k, sampling.top_p):
        return tempered, None
    return tempered, keep_mask(tempered.detach(), sampling.top_k, sampling.top_p, group=group, vocab_start=vocab_start)
