"""The training batch: sampled responses laid out for teacher-forced recomputation.

Each sequence is ``prompt + response`` (right-padded). Position t of the model input predicts
``targets[t] = tokens[t + 1]``; ``mask[t]`` is 1 where that target is a response token, so every
per-token quantity (log-probs, advantages, losses) lives on the ``[N, S]`` target grid.

A multi-turn sample's response interleaves the policy's turns with the environment's replies
(:mod:`cotrain.rl.multiturn`); its ``Sample.loss_mask`` (1 = policy token) is the mask on its
response targets, so ``mask[t] = loss_mask[t + 1 - len(prompt)]``: only policy tokens are trained,
carry rollout log-probs and enter the train-inference KL; replies are context. A sample without a
loss mask (single-turn) has mask 1 on its whole response, exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from cotrain.parallel.zigzag import zigzag_split
from cotrain.rl.interfaces import Sample


@dataclass
class TrainBatch:
    inputs: torch.Tensor  # [N, S] token ids fed to the model
    targets: torch.Tensor  # [N, S] next tokens
    mask: torch.Tensor  # [N, S] float, 1 on response targets
    advantages: torch.Tensor  # [N] one advantage per sequence
    rollout_logprobs: torch.Tensor  # [N, S] the sampler's log-probs on response targets (0 elsewhere)
    old_logprobs: torch.Tensor | None = None  # [N, S] trainer's log-probs before the update
    ref_logprobs: torch.Tensor | None = None  # [N, S] reference policy's log-probs
    lengths: torch.Tensor | None = None  # [N] real tokens per row (prompt + response), at most S
    is_weights: torch.Tensor | None = None  # [N, S] the off-policy correction's per-token weights
    # (grpo.importance_correction; cotrain.rl.grpo.importance_weights), None = no correction

    def __post_init__(self) -> None:
        if self.lengths is None:  # from the mask: the last response target t predicts token t + 1
            last = torch.where(self.mask.bool(), torch.arange(self.seq_len, device=self.mask.device), -1).max(dim=1).values
            self.lengths = torch.clamp(last + 2, max=self.seq_len)

    def __len__(self) -> int:
        return self.inputs.shape[0]

    @property
    def seq_len(self) -> int:
        return self.inputs.shape[1]

    def to(self, device: torch.device | str) -> "TrainBatch":
        """Every field on ``device`` (dtypes kept, None stays None): the trainer's one move of a
        batch onto its device."""
        return TrainBatch(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
                             for f in fields(self)})

    def select(self, idx: slice | torch.Tensor) -> "TrainBatch":
        return TrainBatch(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[idx])
                             for f in fields(self)})

    def zigzag(self, rank: int, cp: int) -> "TrainBatch":
        """Context-parallel shard: chunks ``rank`` and ``2cp-1-rank`` of 2cp along the sequence
        (:func:`cotrain.parallel.zigzag.zigzag_split`)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = zigzag_split(v, cp, rank, dim=1) if v is not None and v.dim() == 2 else v
        return TrainBatch(**out)

    def split(self, parts: int) -> list["TrainBatch"]:
        if len(self) % parts:
            raise ValueError(f"batch of {len(self)} sequences does not split into {parts} equal parts")
        n = len(self) // parts
        return [self.select(slice(i * n, (i + 1) * n)) for i in range(parts)]


def build_batch(samples: list[Sample], advantages: list[float], pad_id: int, multiple_of: int = 1) -> TrainBatch:
    """Lay out samples (flat list) with their advantages; S is rounded up to ``multiple_of``."""
    seqs = [s.prompt_token_ids + s.token_ids for s in samples]
    longest = max(len(s) for s in seqs) - 1
    S = -(-longest // multiple_of) * multiple_of
    N = len(samples)
    tokens = torch.full((N, S + 1), pad_id, dtype=torch.long)
    mask = torch.zeros(N, S)
    rollout_lp = torch.zeros(N, S)
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        tokens[i, : len(seq)] = torch.tensor(seq)
        start, end = len(s.prompt_token_ids) - 1, len(seq) - 1  # targets that are response tokens
        if s.loss_mask is None:
            mask[i, start:end] = 1
        else:
            if len(s.loss_mask) != len(s.token_ids):
                raise ValueError(f"sample {i}: loss_mask has {len(s.loss_mask)} entries for {len(s.token_ids)} "
                                 "response tokens")
            mask[i, start:end] = torch.tensor(s.loss_mask, dtype=torch.float32)
        if s.logprobs:
            rollout_lp[i, start:end] = torch.tensor(s.logprobs, dtype=torch.float32)
    lengths = torch.tensor([min(len(seq), S) for seq in seqs], dtype=torch.int64)
    return TrainBatch(inputs=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous(), mask=mask,
                      advantages=torch.tensor(advantages, dtype=torch.float32), rollout_logprobs=rollout_lp,
                      lengths=lengths)
