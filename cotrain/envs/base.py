"""The environment interface: what a multi-turn rollout talks to between the policy's turns.

An environment is a stateless rule over one conversation. From a problem it gives the first
observation (the prompt the policy sees); from the conversation so far (the problem and every
policy turn, each with its text and token ids, and the observations it replied) it gives the next
step::

    first = env.first_observation(problem)                      # str: turn 1's prompt
    step  = await env.step(problem, turns)                      # EnvStep(observation, reward, done, info)
    r     = env.final_reward(problem, turns)                    # a conversation cut short (turns, tokens, error)

A conversation's reward is the sum of its steps' rewards, plus ``final_reward`` when it ended
without the environment saying ``done`` (the turn limit, the token budget, an environment error).
``step`` is a coroutine, so an environment can wait on a tool (a process, a server) while the
other conversations' steps run: the turn loop (:mod:`cotrain.rl.multiturn`) awaits every live
conversation's step of a turn at once, each under ``env.timeout_s``. A tool that blocks in plain
Python code should run through :func:`run_tool` (a worker thread), so that the timeout can end the
conversation; the thread itself is not interrupted.

Being stateless (everything it needs is in ``turns``, which the samples record) is what makes a
resumed run independent of a tool's timing: nothing is re-asked of the tool for a recorded turn.

Single-turn tasks (the built-in arithmetic / gcd tasks, JSONL) are :class:`SingleTurnEnv`: done
after the first turn, with the exact-match reward of :mod:`cotrain.tasks.rewards`.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

from cotrain.tasks.data import Problem
from cotrain.tasks.rewards import CORRECT, exact_match_reward, grade


@dataclass(frozen=True)
class Turn:
    """One policy turn and the environment's reply to it (``observation`` None: no reply yet, or none)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # the engine's: "stop" or "length"
    observation: str | None = None


@dataclass
class EnvStep:
    """The environment's answer to a policy turn.

    observation  text appended to the conversation as tokens before the next policy turn (ignored
                 when ``done``)
    reward       this step's reward (a conversation's reward is the sum over its steps)
    done         the conversation is over
    info         JSON-plain details; ``outcome`` ("correct" / "incorrect" / "format_error") of a final
                 answer is counted in the rollout's metrics, ``tool_call`` (bool) too
    """

    observation: str | None = None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """A task the policy interacts with over turns (see the module docstring)."""

    def first_observation(self, problem: Problem) -> str:
        """The text of turn 1's prompt (default: the problem's prompt)."""
        return problem.prompt

    @abstractmethod
    async def step(self, problem: Problem, turns: list[Turn]) -> EnvStep:
        """The reply to the last of ``turns`` (the earlier ones carry their observations)."""

    @abstractmethod
    def final_reward(self, problem: Problem, turns: list[Turn]) -> float:
        """The reward of a conversation that ended before the environment said done."""


async def run_tool(fn: Callable, *args, **kwargs):
    """Run a blocking tool in a worker thread (so a timeout can end the conversation waiting on it)."""
    return await asyncio.to_thread(fn, *args, **kwargs)


@dataclass(frozen=True)
class RewardValues:
    """reward.correct / incorrect / format_error (the config's ``reward`` section)."""

    correct: float = 1.0
    incorrect: float = 0.0
    format_error: float | None = 0.0

    @classmethod
    def from_config(cls, reward) -> "RewardValues":
        return cls(reward.correct, reward.incorrect, reward.format_error)

    def of(self, text: str, answer: str) -> float:
        return exact_match_reward(text, answer, self.correct, self.incorrect, self.format_error)


class SingleTurnEnv(Environment):
    """A task of prompts and exact answers as a one-turn environment: done after the policy's first
    turn, rewarded by exact match of its final answer (:func:`cotrain.tasks.rewards.exact_match_reward`)."""

    def __init__(self, rewards: RewardValues = RewardValues()):
        self.rewards = rewards

    async def step(self, problem: Problem, turns: list[Turn]) -> EnvStep:
        text = turns[-1].text
        outcome = grade(text, problem.answer)
        return EnvStep(reward=self.rewards.of(text, problem.answer), done=True, info={"outcome": outcome})

    def final_reward(self, problem: Problem, turns: list[Turn]) -> float:
        return self.rewards.of(turns[-1].text if turns else "", problem.answer)


__all__ = ["CORRECT", "EnvStep", "Environment", "RewardValues", "SingleTurnEnv", "Turn", "run_tool"]
