"""Prompt sources: the built-in tasks (arithmetic here, gcd in :mod:`cotrain.tasks.gcd`) and a JSONL
loader for bring-your-own data.

A sample is a ``Problem(prompt, answer)``: the policy sees ``prompt`` and is rewarded when its
response (up to end-of-sequence) equals ``answer``. The arithmetic task is verifiable by
construction, small enough for a tiny model, and hard enough (carries) that a warm-started model
is only partly right, which leaves GRPO room to improve it.

:func:`load_task` turns the ``data`` config section into (training, evaluation) problems; config
validation (``--validate-only``) and the run call the same function, so a bad file is reported
the same way by both (``file:line: what is wrong``). The evaluation problems never share a
prompt with the training problems (see :func:`load_task`).
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import Callable, Iterator, Sequence

from cotrain.seeding import mix
from cotrain.tasks.gcd import gcd_dataset, gcd_problem
from cotrain.tasks.problem import Problem  # noqa: F401  (re-exported: the problem type of every task)

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


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
    """Read ``{"prompt": ..., "answer": ...}`` lines (blank lines skipped).

    Errors (``ValueError``) name the file and line: not JSON, not a JSON object (e.g. a bare
    ``5``), a missing key, a prompt that is not a non-empty string, an answer that is not a string
    or a number."""
    path = Path(path)
    problems = []
    try:
        f = path.open("rb")
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start} of the line: "
                                 f"{raw[max(0, e.start - 10):e.start + 10]!r})") from None
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object with keys {prompt_key!r} and "
                                 f"{answer_key!r}, got {type(row).__name__} {line.strip()[:40]}")
            for key in (prompt_key, answer_key):
                if key not in row:
                    raise ValueError(f"{where}: missing key {key!r} (found: {sorted(row)})")
            prompt, answer = row[prompt_key], row[answer_key]
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{where}: {prompt_key!r} must be a non-empty string, got {prompt!r}"[:200])
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise ValueError(f"{where}: {answer_key!r} must be a string or a number, got {answer!r}"[:200])
            problems.append(Problem(prompt=prompt, answer=str(answer), source=where))
    if not problems:
        raise ValueError(f"{path}: no problems found")
    return problems


# ------------------------------------------------------------------------ train / eval split
#: seed of the held-out selection from a JSONL training file (fixed: the same split for every run.seed)
HOLDOUT_SEED = 0


def heldout_problems(train: Sequence[Problem], n: int, seed: int, draw: Callable[[random.Random], Problem],
                     max_draws: int | None = None) -> list[Problem]:
    """Up to ``n`` distinct problems ``draw(rng)`` (one task's distribution, ``rng`` seeded with
    ``seed``) whose prompts are not among ``train``'s. Fewer when the task has too few problems
    outside the training set (``max_draws``, default ``100 * n + 10000`` draws, bounds the search)."""
    seen = {p.prompt for p in train}
    rng = random.Random(seed)
    out: list[Problem] = []
    for _ in range(max_draws if max_draws is not None else 100 * n + 10_000):
        if len(out) == n:
            break
        p = draw(rng)
        if p.prompt not in seen:
            seen.add(p.prompt)
            out.append(p)
    return out


def heldout_arithmetic(train: Sequence[Problem], n: int, seed: int, max_digits: int = 3,
                       ops: Sequence[str] = ("+",), max_draws: int | None = None) -> list[Problem]:
    """Up to ``n`` distinct arithmetic problems outside ``train`` (:func:`heldout_problems`)."""
    return heldout_problems(train, n, seed, lambda rng: arithmetic_problem(rng, max_digits, ops), max_draws)


def split_heldout(problems: Sequence[Problem], n: int, seed: int = HOLDOUT_SEED) -> tuple[list[Problem], list[Problem]]:
    """(train, held out): ``n`` distinct prompts chosen with ``seed`` are held out, and every
    problem with one of those prompts leaves the training list (duplicates included)."""
    distinct = list(dict.fromkeys(p.prompt for p in problems))
    held = set(random.Random(seed).sample(distinct, min(n, len(distinct))))
    first = {}
    for p in problems:
        if p.prompt in held:
            first.setdefault(p.prompt, p)
    evals = [first[q] for q in distinct if q in held]
    return [p for p in problems if p.prompt not in held], evals


def load_task(data, min_train: int = 1) -> tuple[list[Problem], list[Problem]]:
    """(training problems, evaluation problems) of a ``data`` config section (a DataConfig).

    - arithmetic, gcd (:mod:`cotrain.tasks.gcd`): ``data.<task>.num_prompts`` generated problems;
      evaluation draws ``data.eval.num_prompts`` *distinct* problems of the same distribution
      (seed ``data.<task>.seed + 7919``) whose prompts are not training prompts.
    - jsonl with ``data.eval.path``: that file's problems, minus any whose prompt is also a
      training prompt (with a warning), the first ``data.eval.num_prompts`` of them.
    - jsonl without ``data.eval.path``, evaluation on (``data.eval.every > 0``): up to
      ``data.eval.num_prompts`` distinct prompts of the training file, chosen with a fixed seed,
      are held out of training - as many as leave ``min_train`` distinct training prompts (one
      step's worth, ``grpo.prompts_per_step``), with a warning when that is fewer than asked.
      With evaluation off nothing is held out (and the evaluation list is empty).

    Raises ``ValueError`` naming the file and line for a bad JSONL file.
    """
    e = data.eval
    if data.task == "arithmetic":
        a = data.arithmetic
        train = arithmetic_dataset(a.num_prompts, seed=a.seed, max_digits=a.digits, ops=a.ops)
        evals = heldout_arithmetic(train, e.num_prompts, seed=a.seed + 7919, max_digits=a.digits, ops=a.ops)
        return train, evals
    if data.task == "gcd":
        g = data.gcd
        params = dict(max_value=g.max_value, mean_steps=g.mean_steps, max_steps=g.max_steps)
        train = gcd_dataset(g.num_prompts, seed=g.seed, **params)
        evals = heldout_problems(train, e.num_prompts, seed=g.seed + 7919, draw=lambda rng: gcd_problem(rng, **params))
        return train, evals
    j = data.jsonl
    train = load_jsonl(j.path, j.prompt_key, j.answer_key)
    if e.path is not None:
        seen = {p.prompt for p in train}
        loaded = load_jsonl(e.path, j.prompt_key, j.answer_key)
        evals = [p for p in loaded if p.prompt not in seen]
        if len(evals) < len(loaded):
            warnings.warn(f"data.eval.path: {len(loaded) - len(evals)} of the {len(loaded)} evaluation problems in "
                          f"{e.path} have prompts that are also in the training file {j.path}; they are left out "
                          "of the evaluation", stacklevel=2)
        return train, evals[: e.num_prompts]
    if not e.every:
        return train, []
    distinct = len({p.prompt for p in train})
    n = max(0, min(e.num_prompts, distinct - min_train))
    if n < e.num_prompts:
        warnings.warn(f"data.eval: holding out {n} of the {distinct} distinct prompts of {j.path} for evaluation "
                      f"(data.eval.num_prompts={e.num_prompts}), to leave {distinct - n} for training; give "
                      "data.eval.path for a separate evaluation file", stacklevel=2)
    return split_heldout(train, n)


def prompt_length_errors(problems: Sequence[Problem], count_tokens: Callable[[list[str]], list[int]],
                         max_prompt_tokens: int, what: str = "prompt", limit: int = 3) -> list[str]:
    """Messages for prompts longer than ``max_prompt_tokens`` tokens (at most ``limit``, plus a
    count of the rest). ``count_tokens`` maps prompts to their token counts; it is only called for
    prompts whose UTF-8 length could exceed the limit (no tokenizer in common use makes more than
    one token per byte, plus a few special tokens)."""
    suspects = [p for p in problems if len(p.prompt.encode("utf-8")) + 8 > max_prompt_tokens]
    if not suspects:
        return []
    counts = count_tokens([p.prompt for p in suspects])
    long = [(p, n) for p, n in zip(suspects, counts) if n > max_prompt_tokens]
    out = []
    for p, n in long[:limit]:
        where = f"{p.source}: " if p.source else ""
        out.append(f"{where}{what} of {n} tokens {p.prompt[:40]!r}{'...' if len(p.prompt) > 40 else ''} exceeds "
                   f"the {max_prompt_tokens} tokens left for it")
    if len(long) > limit:
        out.append(f"... and {len(long) - limit} more {what}s that long")
    return out


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
            random.Random(mix(self.seed, epoch)).shuffle(order)
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
