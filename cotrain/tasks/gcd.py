"""The built-in ``gcd`` task: a worked solution whose length has a long tail.

A problem is ``"gcd(84,36)="``; the response works it out by Euclid's subtractive algorithm, one
step per comma-separated item - subtract the smaller number from the larger, keep the subtrahend
and the difference - and gives the final answer after the marker ``=>``::

    gcd(84,36)=  ->  84-36=48,48-36=12,36-12=24,24-12=12,12-12=0=>12

Every step depends only on the step before it (two numbers to compare, copy and subtract), so the
solution is learnable by a small model, while its length is a property of the problem: ``a==b``
takes one step, ``gcd(97,5)`` twenty-four. The reward checks the final answer only
(:func:`cotrain.tasks.rewards.extract_answer` reads what follows the last ``=>``).

Sampling: the number of steps ``s`` is drawn from a geometric distribution with mean
``mean_steps``, truncated to ``1..max_steps`` (redrawn above it), then the operands uniformly among
the pairs ``max_value >= a >= b >= 1`` whose solution has exactly ``s`` steps; the prompt writes the
larger operand first, so the first step copies it (the solution is the same either way). Many short problems,
few long ones: a long tail of response lengths (docs/models.md shows the distribution).

``gcd_solution(a, b, rng, slip)`` also writes solutions with arithmetic slips (each digit of a
step's difference replaced by a random digit with probability ``slip``, the steps after it
continuing from the wrong number, as a person's worked solution would): the built-in small model
is warm-started on such noisy solutions (cotrain.models.small).
"""

from __future__ import annotations

import functools
import math
import random
import re
from typing import Optional

from cotrain.tasks.problem import Problem
from cotrain.tasks.rewards import MARKER

_PROMPT = re.compile(r"gcd\((\d+),(\d+)\)=")


def gcd_prompt(a: int, b: int) -> str:
    return f"gcd({a},{b})="


def parse_prompt(prompt: str) -> tuple[int, int]:
    m = _PROMPT.fullmatch(prompt)
    if not m:
        raise ValueError(f"not a gcd prompt: {prompt!r} (expected 'gcd(<a>,<b>)=')")
    return int(m.group(1)), int(m.group(2))


def num_steps(a: int, b: int) -> int:
    """Steps of the subtractive algorithm on (a, b): the sum of the partial quotients of a/b."""
    x, y, s = max(a, b), min(a, b), 0
    while y:
        q, r = divmod(x, y)
        s += q
        x, y = y, r
    return s


def gcd_solution(a: int, b: int, rng: Optional[random.Random] = None, slip: float = 0.0,
                 max_steps: Optional[int] = None) -> str:
    """The worked solution (the response without end-of-sequence), e.g. ``"6-4=2,4-2=2,2-2=0=>2"``.

    With ``slip > 0`` (and ``rng``) each digit of each difference is replaced by a random digit
    with that probability and the solution carries on from the wrong number; it stops after
    ``max_steps`` steps if given (a slipped solution can run longer than the clean one), the final
    answer then being the last subtrahend."""
    if a < 1 or b < 1:
        raise ValueError(f"gcd operands must be positive integers, got {a}, {b}")
    x, y = max(a, b), min(a, b)
    steps = []
    while True:
        c = x - y
        if slip and rng is not None:
            c = int("".join(str(rng.randrange(10)) if rng.random() < slip else ch for ch in str(c)))
        steps.append(f"{x}-{y}={c}")
        if c == 0 or (max_steps is not None and len(steps) >= max_steps):
            break
        x, y = max(y, c), min(y, c)
    return ",".join(steps) + MARKER + str(y)


@functools.lru_cache(maxsize=8)
def pairs_by_steps(max_value: int, max_steps: int) -> dict[int, tuple[tuple[int, int], ...]]:
    """The pairs max_value >= a >= b >= 1, by the number of steps of their solution (<= max_steps)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for a in range(1, max_value + 1):
        for b in range(1, a + 1):
            s = num_steps(a, b)
            if s <= max_steps:
                out.setdefault(s, []).append((a, b))
    return {s: tuple(v) for s, v in sorted(out.items())}


def check_params(max_value: int, mean_steps: float, max_steps: int) -> None:
    if max_value < 1:
        raise ValueError(f"data.gcd.max_value: {max_value} (allowed: >= 1)")
    if mean_steps < 1:
        raise ValueError(f"data.gcd.mean_steps: {mean_steps} (allowed: >= 1)")
    if max_steps < 1:
        raise ValueError(f"data.gcd.max_steps: {max_steps} (allowed: >= 1)")


def draw_steps(rng: random.Random, mean_steps: float, max_steps: int, available) -> int:
    """A step count from the geometric distribution with mean ``mean_steps`` on 1, 2, ...,
    redrawn until it is <= max_steps and in ``available``."""
    p = 1.0 / mean_steps
    while True:
        u = rng.random()
        s = 1 if p >= 1.0 else 1 + int(math.log1p(-u) / math.log1p(-p))  # inverse CDF of the geometric
        if s <= max_steps and s in available:
            return s


def gcd_problem(rng: random.Random, max_value: int = 99, mean_steps: float = 5.0, max_steps: int = 15) -> Problem:
    """One problem ``"gcd(a,b)="`` with answer ``str(gcd(a, b))`` (see the module docstring)."""
    check_params(max_value, mean_steps, max_steps)
    table = pairs_by_steps(max_value, max_steps)
    s = draw_steps(rng, mean_steps, max_steps, table)
    a, b = rng.choice(table[s])
    return Problem(prompt=gcd_prompt(a, b), answer=str(math.gcd(a, b)))


def gcd_dataset(n: int, seed: int, max_value: int = 99, mean_steps: float = 5.0, max_steps: int = 15) -> list[Problem]:
    rng = random.Random(seed)
    return [gcd_problem(rng, max_value, mean_steps, max_steps) for _ in range(n)]


def solution_of(problem: Problem, rng: Optional[random.Random] = None, slip: float = 0.0,
                max_steps: Optional[int] = None) -> str:
    """The worked solution of a gcd problem (from its prompt)."""
    return gcd_solution(*parse_prompt(problem.prompt), rng=rng, slip=slip, max_steps=max_steps)
