"""Prompt sources: the built-in arithmetic task and a JSONL loader for bring-your-own data.

A sample is a ``Problem(prompt, answer)``: the policy sees ``prompt`` and is rewarded when its
response (up to end-of-sequence) equals ``answer``. The arithmetic task is verifiable by
construction, small enough for a tiny model, and hard enough (carries) that a warm-started model
is only partly right, which leaves GRPO room to improve it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def arithmetic_problem(rng: random.Random, max_digits: int = 3, ops: Sequence[str] = ("+",)) -> Problem:
    """One problem ``"<a><op><b>="`` with answer ``str(a op b)``; operand widths 1..max_digits."""
    for op in ops:
        if op not in OPS:
            raise ValueError(f"data.arithmetic.ops: unknown operator {op!r} (allowed: {sorted(OPS)})")
    a = rng.randrange(10 ** rng.randint(1, max_digits))
    b = rng.randrange(10 ** rng.randint(1, max_digits))
    op = rng.choice(list(ops))
    return Problem(prompt=f"{a}{op}{b}=", answer=str(OPS[op](a, b)))


def arithmetic_dataset(n: int, seed: int, max_digits: int = 3, ops: Sequence[str] = ("+",)) -> list[Problem]:
    rng = random.Random(seed)
    return [arithmetic_problem(rng, max_digits, ops) for _ in range(n)]


def load_jsonl(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Problem]:
    """Read ``{"prompt": ..., "answer": ...}`` lines; errors name the file, line and missing key."""
    path = Path(path)
    problems = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            for key in (prompt_key, answer_key):
                if key not in row:
                    raise ValueError(f"{path}:{lineno}: missing key {key!r} (found: {sorted(row)})")
            problems.append(Problem(prompt=str(row[prompt_key]), answer=str(row[answer_key])))
    if not problems:
        raise ValueError(f"{path}: no problems found")
    return problems


class PromptStream:
    """An endless, seeded, resumable stream of problems (reshuffled every epoch unless ``shuffle=False``).

    ``state()``/``load_state()`` capture the position so a resumed run sees exactly the prompts an
    uninterrupted one would have seen.
    """

    def __init__(self, problems: Sequence[Problem], seed: int, shuffle: bool = True):
        if not problems:
            raise ValueError("PromptStream needs at least one problem")
        self.problems = list(problems)
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.pos = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Problem]:
        out = []
        while len(out) < n:
            if self.pos == len(self._order):
                self.epoch += 1
                self.pos = 0
                self._order = self._permutation(self.epoch)
            out.append(self.problems[self._order[self.pos]])
            self.pos += 1
        return out

    def __iter__(self) -> Iterator[Problem]:
        while True:
            yield self.take(1)[0]

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._permutation(self.epoch)
