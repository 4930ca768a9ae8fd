"""The built-in calculator task: arithmetic where the policy may call a calculator before it answers.

A conversation (character tokens; ``<eos>`` ends every policy turn)::

    prompt      37*48=
    policy      <calc>37*48</calc><eos>          a tool call: the turn ends with </calc>
    calculator  [1776]                           the tool's reply, appended as tokens (not trained)
    policy      1776<eos>                        any other turn is the final answer: done

The final answer is graded like the single-turn tasks (:func:`cotrain.tasks.rewards.grade`, exact
match, ``reward.correct`` / ``incorrect`` / ``format_error``); each tool call costs
``env.calculator.call_cost`` (a step reward of -call_cost), so the conversation's reward is

    R = reward(final answer) - call_cost * (number of calls).

A conversation that runs out of turns or tokens has no final answer: its last turn is graded as it
is (a tool call is not a number: ``reward.format_error``). The calculator evaluates integer
expressions of ``+ - *`` and parentheses (:func:`evaluate`); anything else - a malformed
expression, a result over ``MAX_DIGITS`` digits - is answered ``[error]``, which is the policy's
mistake, not the environment's: the conversation goes on. ``tool_latency_s`` is an artificial
latency per call (an ``await``, so the calls of a turn overlap), for the time-split benchmark.
"""

from __future__ import annotations

import ast
import asyncio

from cotrain.envs.base import Environment, EnvStep, RewardValues, Turn
from cotrain.tasks.data import Problem
from cotrain.tasks.rewards import grade

OPEN, CLOSE = "<calc>", "</calc>"
ERROR = "[error]"
MAX_EXPR_CHARS = 64
MAX_DIGITS = 24


class CalcError(ValueError):
    """An expression the calculator does not evaluate."""


def tool_call(text: str) -> str | None:
    """The expression of a turn that is a tool call (its text, stripped, ends with ``</calc>`` after
    a ``<calc>``), else None."""
    t = text.strip()
    if not t.endswith(CLOSE):
        return None
    body = t[: -len(CLOSE)]
    if OPEN not in body:
        return None
    return body.rsplit(OPEN, 1)[1]


_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def evaluate(expr: str) -> int:
    """The value of an integer expression of ``+ - *``, unary minus and parentheses (CalcError otherwise)."""
    if not expr or len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression of {len(expr)} characters (allowed: 1..{MAX_EXPR_CHARS})")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise CalcError(f"not an expression: {expr!r}") from None

    def ev(node) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            v = _BINOPS[type(node.op)](ev(node.left), ev(node.right))
            if len(str(abs(v))) > MAX_DIGITS:
                raise CalcError(f"result over {MAX_DIGITS} digits")
            return v
        raise CalcError(f"unsupported: {ast.dump(node)[:40]}")

    return ev(tree)


def reply(expr: str) -> str:
    """The calculator's reply to ``expr``: ``[value]`` or ``[error]``."""
    try:
        return f"[{evaluate(expr)}]"
    except CalcError:
        return ERROR


class CalculatorEnv(Environment):
    """The calculator task (see the module docstring)."""

    def __init__(self, rewards: RewardValues = RewardValues(), call_cost: float = 0.0, tool_latency_s: float = 0.0):
        self.rewards, self.call_cost, self.tool_latency_s = rewards, float(call_cost), float(tool_latency_s)

    async def step(self, problem: Problem, turns: list[Turn]) -> EnvStep:
        text = turns[-1].text
        expr = tool_call(text)
        if expr is None:
            return EnvStep(reward=self.rewards.of(text, problem.answer), done=True,
                           info={"outcome": grade(text, problem.answer), "tool_call": False})
        if self.tool_latency_s > 0:
            await asyncio.sleep(self.tool_latency_s)
        return EnvStep(observation=reply(expr), reward=-self.call_cost, info={"tool_call": True})

    def final_reward(self, problem: Problem, turns: list[Turn]) -> float:
        return self.rewards.of(turns[-1].text if turns else "", problem.answer)
