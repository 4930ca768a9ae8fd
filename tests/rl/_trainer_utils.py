"""Shared helpers for the trainer tests: a deterministic GRPO batch from the arithmetic task."""

import torch

from cotrain.models.tokenizer import build_tokenizer
from cotrain.rl.batch import build_batch
from cotrain.tasks.data import arithmetic_dataset
from cotrain.rl.grpo import group_advantages
from cotrain.rl.interfaces import Sample


def fake_rollout_batch(num_prompts: int = 4, group: int = 4, seed: int = 0, multiple_of: int = 4):
    """Responses are the true answer or a corrupted one; rewards follow; sampler log-probs are fake."""
    tok = build_tokenizer()
    g = torch.Generator().manual_seed(seed)
    samples, rewards = [], []
    for i, p in enumerate(arithmetic_dataset(num_prompts, seed=seed)):
        row = []
        for j in range(group):
            correct = bool(torch.rand((), generator=g) < 0.5)
            text = p.answer if correct else str(int(p.answer) + 1 + j)
            ids = tok.encode(text) + [tok.eos_token_id]
            samples.append(Sample(prompt_index=i, prompt_token_ids=tok.encode(p.prompt), token_ids=ids,
                                  logprobs=[-0.5] * len(ids), text=text, finish_reason="stop", weight_version=0))
            row.append(1.0 if correct else 0.0)
        rewards.append(row)
    adv = group_advantages(torch.tensor(rewards)).flatten().tolist()
    return build_batch(samples, adv, pad_id=tok.pad_token_id, multiple_of=multiple_of)


def perturbed_old_logprobs(logprobs: torch.Tensor, mask: torch.Tensor, scale: float = 0.3, seed: int = 0) -> torch.Tensor:
    """An "old" policy's log-probs: ``logprobs`` plus seeded Gaussian noise on the response targets, so
    that the ratios leave 1 and clipping (and the KL) are exercised."""
    return logprobs + scale * torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(seed)) * mask
