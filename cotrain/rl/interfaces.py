"""The contract between the GRPO driver and its workers: what the driver calls, and nothing else.

The driver (:mod:`cotrain.rl.driver`) reaches its workers only through these interfaces:

* a :class:`GenerationBackend` samples responses, loads pushed weights and, sharing the trainers'
  GPUs (``rollout.colocate``), sleeps while they run - and they offload while it runs (vLLM
  engines in Ray actors: :class:`cotrain.rl.rollout.RolloutGroup`);
* a :class:`TrainingBackend` recomputes log-probabilities, takes GRPO steps (with the co-trained
  drafter's step on the same forward), publishes its weights for the engines and checkpoints
  itself (Megatron-core ranks in Ray actors: :class:`cotrain.rl.workers.TrainerGroup`);
* a :class:`WorkerFactory` builds both for a run (:class:`cotrain.rl.ray_workers.RayWorkers`,
  the default).

A weight push is ``handle = trainer.export(kind, version)`` -> ``rollout.push(kind, handle,
version)`` -> ``trainer.release_export(handle)``; the handle is a small picklable dict whose
format is the trainer's and the engines' business (:mod:`cotrain.weights`).
A new engine or trainer implements one of these classes; the driver's tests run it on in-process
fakes (tests/rl/test_driver_contract.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:  # pragma: no cover
    from cotrain.rl.batch import TrainBatch

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
    weight_version: int  # the policy version that sampled it (the engine's label: the last policy push)
    spec_decode: dict | None = None  # acceptance statistics when speculative decoding is on (scalars, and
    # "acceptance_histogram": rounds by number of accepted drafts)
    draft_version: int | None = None  # the drafter version that drafted it (the last drafter push; None:
    # no speculation, or the engines' initial drafter)
    # multi-turn rollouts (cotrain.rl.multiturn; None on single-turn samples, which stay as they were):
    loss_mask: list[int] | None = None  # per response token: 1 = the policy's (trained, sampled log-prob),
    # 0 = the environment's (context only: log-prob 0, never trained); None = every token the policy's
    reward: float | None = None  # the environment's reward of the conversation (None: reward.* on text)
    turns: list[dict] | None = None  # one JSON-plain record per policy turn: its text, token counts, the
    # environment's reply (so a resume never asks a tool again), step reward, versions, acceptance
    env_error: str | None = None  # the named error that ended the conversation (cotrain.rl.multiturn.ENV_ERRORS)


@dataclass
class GenerationResult:
    samples: list[list[Sample]]  # [prompt][sample]
    metrics: dict[str, float] = field(default_factory=dict)


class GenerationBackend(ABC):
    """The rollout engines."""

    @abstractmethod
    def generate(self, prompts: list[str], sampling: SamplingSpec, n: int) -> GenerationResult:
        """``n`` samples for each prompt, in prompt order (``sampling.seed`` makes them reproducible)."""

    @abstractmethod
    def push(self, kind: WeightKind, handle: dict, version: int) -> dict[str, float]:
        """Load the ``kind`` weights a :meth:`TrainingBackend.export` published; a policy push makes
        ``version`` the served weight version. A rejected push raises
        :class:`~cotrain.weights.checks.WeightPushError` and every engine keeps serving what
        it served before. Returns timings."""

    @abstractmethod
    def sleep(self) -> None:
        """Free the devices for the trainers (``rollout.colocate``: called before the update): the
        served weights are kept off the device, the KV cache is dropped."""

    @abstractmethod
    def wake_up(self) -> None:
        """Take the devices back after :meth:`sleep` (before the update's weight push)."""

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
    """The policy's trainer (and the co-trained drafter's)."""

    @abstractmethod
    def logprobs(self, batch: TrainBatch, draft_step: int | None = None, draft_updates: int = 1) -> PolicyLogprobs:
        """Log-probabilities of the response tokens under the current policy. With ``draft_step``
        (co-training), the co-trained drafter takes its step ``draft_step`` on this very forward:
        its taps and the policy's detached logits; then ``draft_updates - 1`` more optimizer steps
        on its replay window (draft.budget). ``draft_updates`` 0: the drafter is only scored on the
        step's chains (draft.budget.measure_idle), its weights and optimizer state untouched."""

    @abstractmethod
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """The GRPO update on ``batch`` (whose ``old_logprobs`` / ``ref_logprobs`` are set): metrics
        ``loss``, ``grad_norm``, ``clip_frac`` (and ``lr``, ``optimizer_steps``, ``kl_ref``)."""

    @abstractmethod
    def export(self, kind: WeightKind, version: int) -> dict:
        """Publish the current ``kind`` weights for the engines; returns the handle
        :meth:`GenerationBackend.push` loads. Free it with :meth:`release_export`."""

    @abstractmethod
    def release_export(self, handle: dict) -> None:
        """Free what :meth:`export` published (after the push, whether it succeeded or not)."""

    @abstractmethod
    def export_draft_dir(self, path: str) -> str:
        """Write the co-trained drafter as a vLLM drafter directory (the engines' initial drafter)."""

    @abstractmethod
    def offload(self) -> None:
        """Free the device memory the engines need while they run (``rollout.colocate``: before the
        engines wake; the weights stay, for the push): optimizer states off the device, caches
        emptied. A no-op on CPU."""

    @abstractmethod
    def onload(self) -> None:
        """Take back what :meth:`offload` freed (after the engines sleep, before the log-probs)."""

    @abstractmethod
    def save_checkpoint(self, directory: str) -> None:
        """Write everything the trainer needs to resume exactly (weights, optimizers, RNG) into ``directory``."""

    @abstractmethod
    def load_checkpoint(self, directory: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""

    def connect(self, rollout: GenerationBackend) -> None:  # noqa: B027 - optional
        """Called once, before the first push: set up what the weight path to ``rollout`` needs
        (the ``nccl`` transport's broadcast group)."""

    def shutdown(self) -> None:  # noqa: B027 - optional
        pass


class WorkerFactory(ABC):
    """Builds a run's workers: the trainer first, then the engines (which may start with the
    trainer's initial drafter)."""

    def start(self) -> None:  # noqa: B027 - optional
        """Called once before the workers are built (e.g. joining a cluster)."""

    @abstractmethod
    def trainer(self, model_path: str, draft_init: str | None) -> TrainingBackend:
        """The trainer of the policy at ``model_path`` (and the co-trained drafter from ``draft_init``)."""

    @abstractmethod
    def rollout(self, model_path: str, draft_model: str | None) -> GenerationBackend:
        """The engines serving ``model_path`` (drafting with ``draft_model`` when given)."""

    def check_alive(self, what: str) -> None:  # noqa: B027 - optional
        """Raise :class:`~cotrain.placement.NodeDiedError` if a machine of the run has died."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release what :meth:`start` reserved (after the workers shut down)."""
