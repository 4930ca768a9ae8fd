"""Verifiable rewards: a response is scored against the problem's exact answer.

The answer is the response text up to the first newline, stripped of surrounding spaces - or, when
the response contains the final-answer marker ``=>`` (tasks with a worked solution, such as the
built-in ``gcd`` task: ``"6-4=2,4-2=2,2-2=0=>2"``), the text after the last marker, up to the next
newline, stripped. Each response gets one of three outcomes:

- ``correct``: the answer equals the reference answer (exact string match);
- ``format_error``: there is no answer to compare - the answer is empty, or the reference answer
  is a number and the answer is not one (``"12a"``, ``"-"``, ``"twelve"``);
- ``incorrect``: any other answer (a well-formed but wrong one, e.g. ``"5430"`` for ``"543"``).

A number is an optional sign, digits with an optional decimal part, and an optional exponent
(``"42"``, ``"-3"``, ``"0.5"``, ``".5"``, ``"1e3"``); thousands separators and spaces inside are
not. Exact match still decides correctness: ``"0543"`` and ``"543.0"`` are numbers, hence
incorrect (not format errors) against ``"543"``.
"""

from __future__ import annotations

import re

CORRECT, INCORRECT, FORMAT_ERROR = "correct", "incorrect", "format_error"

_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")

#: the final-answer marker of worked solutions
MARKER = "=>"


def extract_answer(response: str) -> str:
    """The text after the last ``=>`` when the response has one, else the whole response; up to its
    first newline, stripped of surrounding spaces."""
    if MARKER in response:
        response = response.rsplit(MARKER, 1)[1]
    return response.split("\n", 1)[0].strip()


def is_number(text: str) -> bool:
    return _NUMBER.fullmatch(text) is not None


def grade(response: str, answer: str) -> str:
    """``CORRECT``, ``INCORRECT`` or ``FORMAT_ERROR`` (see the module docstring)."""
    got, want = extract_answer(response), answer.strip()
    if got == want:
        return CORRECT
    if not got or (is_number(want) and not is_number(got)):
        return FORMAT_ERROR
    return INCORRECT


def exact_match_reward(response: str, answer: str, correct: float = 1.0, incorrect: float = 0.0,
                       format_error: float | None = None) -> float:
    """``correct`` / ``incorrect`` / ``format_error`` by :func:`grade` (format_error None = incorrect)."""
    outcome = grade(response, answer)
    if outcome == CORRECT:
        return correct
    if outcome == FORMAT_ERROR and format_error is not None:
        return format_error
    return incorrect
