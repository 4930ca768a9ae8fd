"""What the GRPO driver needs from its workers, independent of how they are built or placed.

The driver talks to two kinds of workers through these interfaces only:

* a :class:`GenerationBackend` samples responses (vLLM is one implementation, running in Ray
  actors) and accepts pushed weights;
* a :class:`TrainingBackend` recomputes log-probabilities, takes GRPO steps and exports its weights
  (Megatron-core is one implementation, a group of Ray actors forming one torch.distributed world).

Weights travel between them as ``{name: tensor}`` in Hugging Face names (policy) or the drafter's
vLLM names (draft); a :class:`WeightTransport` decides how the bytes move (shared memory on CPU,
CUDA IPC when colocated on a GPU, NCCL broadcast otherwise).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

WeightKind = Literal["policy", "draft"]


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False  # generate max_tokens whatever is sampled (measurements at a fixed batch)


@dataclass
class Sample:
    """One sampled response to one prompt."""

    prompt_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # the sampler's log-probability of each response token
    text: str
    finish_reason: str  # "stop" (end of sequence) or "length"
    weight_version: int
    spec_decode: dict | None = None  # acceptance statistics when speculative decoding is on (scalars, and
    # "acceptance_histogram": rounds by number of accepted drafts)


@dataclass
class GenerationResult:
    samples: list[list[Sample]]  # [prompt][sample]
    metrics: dict[str, float] = field(default_factory=dict)


class GenerationBackend(ABC):
    @abstractmethod
    def generate(self, prompts: list[str], sampling: SamplingSpec, n: int) -> GenerationResult:
        """``n`` samples for each prompt."""

    @abstractmethod
    def push_weights(self, kind: WeightKind, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights into the running engine(s); raise and keep serving the old ones on mismatch."""

    @abstractmethod
    def weight_version(self) -> int:
        """The version label of the weights currently served."""

    def shutdown(self) -> None:  # noqa: B027 - optional
        pass


@dataclass
class PolicyLogprobs:
    """What the log-prob recomputation returns: [N, S] per-token log-probs of the current policy
    (and of the reference policy when there is one) and, when the drafter trained on this forward,
    its metrics (``draft/*``, ``tap/*``)."""

    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    draft_metrics: dict[str, float] | None = None


class TrainingBackend(ABC):
    @abstractmethod
    def logprobs(self, batch: Any, draft_step: int | None = None) -> PolicyLogprobs:
        """Log-probabilities of the response tokens under the current policy. With ``draft_step``
        (co-training), the co-trained drafter takes its step ``draft_step`` on this very forward:
        its taps and the policy's detached logits."""

    @abstractmethod
    def train_step(self, batch: Any) -> dict[str, float]:
        """One optimizer step of the GRPO loss on ``batch``; returns metrics."""

    @abstractmethod
    def named_weights(self, kind: WeightKind) -> dict[str, torch.Tensor]:
        """Full (gathered) weights in the names the rollout engines load."""

    @abstractmethod
    def export(self, kind: WeightKind, version: int, transport: str) -> dict:
        """Publish the ``kind`` weights through a weight transport; returns the receivers' handle
        (free it with :meth:`release_export` once every engine has loaded it)."""

    @abstractmethod
    def release_export(self, handle: dict) -> None:
        """Free what :meth:`export` published."""

    def shutdown(self) -> None:  # noqa: B027 - optional
        pass


class WeightTransport(ABC):
    """How a set of named tensors travels from a trainer to an engine process."""

    name: str

    @abstractmethod
    def send(self, named_tensors: dict[str, torch.Tensor], version: int) -> dict:
        """Publish the tensors; returns a small picklable handle for the receiver."""

    @abstractmethod
    def receive(self, handle: dict) -> dict[str, torch.Tensor]:
        """Materialise the tensors on the receiving side."""

    def release(self, handle: dict) -> None:  # noqa: B027 - optional
        """Free what :meth:`send` allocated, once every receiver is done."""
