"""Verifiable rewards: a response is scored against the problem's exact answer."""

from __future__ import annotations


def extract_answer(response: str) -> str:
    """The answer is the response text up to the first newline, stripped of surrounding spaces."""
    return response.split("\n", 1)[0].strip()


def exact_match_reward(response: str, answer: str, correct: float = 1.0, incorrect: float = 0.0) -> float:
    return correct if extract_answer(response) == answer.strip() else incorrect
