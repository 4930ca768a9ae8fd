"""Rollouts drawn ahead: the schedule of asynchronous GRPO (``grpo.max_staleness`` = k).

    step t trains on the rollouts of step t, sampled by the policy pushed at the end of step
    t-1-k (the initial policy while t-1-k < 1);  k = 0: by the policy of step t-1 (synchronous)

While step t updates, one background thread draws the rollouts of steps t+1 .. t+k not drawn yet
(in step order, each its own seeded draw, :meth:`GrpoRun.draw_groups`) on the engines as they are
when the update starts. The driver waits for that thread before it pushes step t's weights, so a
push always lands between two engine calls, never inside a request, and the version every draw
samples with is fixed by the schedule alone - a seeded run is deterministic. The steps drawn but
not trained yet are part of the driver's checkpoint (regenerating them would need the older
policies, which checkpoints do not hold).

Version labels are the engines' (:attr:`Sample.weight_version`: the last policy push). A step is
trained only if every sample carries the label its draw started on, and that label is at most k
versions behind the trainer's (:class:`StaleSampleError` otherwise).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from cotrain.rl.interfaces import GenerationResult, Sample
from cotrain.tasks.data import Problem


@dataclass
class StepGroups:
    """The groups a step drew (:meth:`GrpoRun.draw_groups`). P = grpo.prompts_per_step, G = group_size."""

    first: GenerationResult          # the first round's rollouts [P][G] and metrics (what reward/* report)
    first_problems: list[Problem]    # [P] its prompts
    first_rewards: torch.Tensor      # [P, G] its rewards
    samples: list[list[Sample]]      # [P][G] the groups the update trains on, in draw order
    rewards: torch.Tensor            # [P, G] their rewards
    with_signal: int                 # how many of them carry a learning signal (rewards not all equal)
    resampled_prompts: int           # prompts drawn beyond the first round
    version: int = 0                 # the policy version (label) the engines held for this draw


class StaleSampleError(RuntimeError):
    """A step's samples were not sampled by the policy version the staleness schedule says."""


# ------------------------------------------------------------------------------- (de)serialisation
def _samples_state(rows: list[list[Sample]]) -> list[list[dict]]:
    return [[dataclasses.asdict(s) for s in row] for row in rows]


def _samples(rows: list[list[dict]]) -> list[list[Sample]]:
    return [[Sample(**s) for s in row] for row in rows]


def groups_state(g: StepGroups) -> dict:
    """``g`` as plain containers and tensors (what a weights-only checkpoint load accepts)."""
    return {"first": {"samples": _samples_state(g.first.samples), "metrics": dict(g.first.metrics)},
            "first_problems": [dataclasses.asdict(p) for p in g.first_problems],
            "first_rewards": g.first_rewards, "samples": _samples_state(g.samples), "rewards": g.rewards,
            "with_signal": g.with_signal, "resampled_prompts": g.resampled_prompts, "version": g.version}


def groups_from_state(d: dict) -> StepGroups:
    return StepGroups(first=GenerationResult(_samples(d["first"]["samples"]), dict(d["first"]["metrics"])),
                      first_problems=[Problem(**p) for p in d["first_problems"]], first_rewards=d["first_rewards"],
                      samples=_samples(d["samples"]), rewards=d["rewards"], with_signal=int(d["with_signal"]),
                      resampled_prompts=int(d["resampled_prompts"]), version=int(d["version"]))


# ------------------------------------------------------------------------------------ the schedule
class DrawAhead:
    """The steps drawn ahead of the update and the one background draw in flight (module doc)."""

    def __init__(self, staleness: int):
        self.k = int(staleness)
        self.pending: dict[int, StepGroups] = {}
        self._future: Future | None = None
        self._pool: ThreadPoolExecutor | None = None

    def take(self, step: int) -> StepGroups | None:
        """Step ``step``'s groups if they were drawn ahead (None: draw them now)."""
        return self.pending.pop(step, None)

    def launch(self, step: int, last_step: int, draw: Callable[[int], StepGroups]) -> list[int]:
        """Start drawing, in the background, the steps step+1 .. min(step+k, last_step) not drawn
        yet (``draw(s)`` -> step s's groups); returns them."""
        if self._future is not None:
            raise RuntimeError("a draw is still in flight: wait() for it before launching another")
        steps = [s for s in range(step + 1, min(step + self.k, last_step) + 1) if s not in self.pending]
        if steps:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cotrain-draw-ahead")
            self._future = self._pool.submit(self._draw, steps, draw)
        return steps

    def _draw(self, steps: list[int], draw: Callable[[int], StepGroups]) -> float:
        t0 = time.perf_counter()
        for s in steps:
            self.pending[s] = draw(s)
        return time.perf_counter() - t0

    def wait(self) -> tuple[float, float]:
        """Wait for the draw in flight (re-raising what it raised): (its seconds, seconds waited)."""
        if self._future is None:
            return 0.0, 0.0
        t0 = time.perf_counter()
        future, self._future = self._future, None
        seconds = future.result()
        return seconds, time.perf_counter() - t0

    def check(self, step: int, groups: StepGroups, trainer_version: int) -> int:
        """The policy lag of step ``step``'s samples (trainer_version - their version), after checking
        that every sample carries its draw's version and the lag is at most k."""
        wrong = sorted({s.weight_version for row in groups.samples for s in row} - {groups.version})
        if wrong:
            raise StaleSampleError(f"step {step}: samples of policy version(s) {wrong} in a draw started on version "
                                   f"{groups.version}: a weight push landed during the draw")
        lag = trainer_version - groups.version
        if not 0 <= lag <= self.k:
            raise StaleSampleError(f"step {step}: samples of policy version {groups.version} would be trained by "
                                   f"version {trainer_version}, {lag} versions newer (grpo.max_staleness={self.k})")
        return lag

    def state_dict(self) -> dict:
        if self._future is not None:
            raise RuntimeError("a draw is in flight: a checkpoint waits for it first")
        return {str(s): groups_state(g) for s, g in sorted(self.pending.items())}

    def load_state_dict(self, state: dict) -> None:
        self.pending = {int(s): groups_from_state(g) for s, g in state.items()}

    def close(self) -> None:
        """Stop the background thread (a draw in flight is abandoned: its results are never used)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
