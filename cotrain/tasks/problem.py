"""One verifiable problem: the policy sees ``prompt`` and is rewarded when its answer equals ``answer``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    source: str = field(default="", compare=False, repr=False)  # "file:line" for JSONL problems
