"""Derived seeds: one rule, so that every stream a run draws from is a fixed function of run.seed.

    mix(seed, i) = seed * 1_000_003 + i                       (1_000_003: a prime above 10^6)

A stream indexed by several counters nests the rule: the anchors of row r at step t are
``mix(mix(seed, t), r, 1_000_033) mod (2^63 - 1)`` (:func:`cotrain.draft.online.anchor_seed`).
Users: the prompt stream's per-epoch order (``mix(run.seed, epoch)``), the rollouts' per-step
sampling seed (``mix(run.seed, step) + round * 2^32``, one per dynamic-sampling round), the
update's mini-batch order (``mix(run.seed, updates done)``). Changing the rule changes every run's
numbers; it is kept exactly as the runs and their checkpoints were made.
"""

PRIME = 1_000_003


def mix(seed: int, index: int, prime: int = PRIME) -> int:
    """``seed * prime + index`` (module doc)."""
    return int(seed) * prime + int(index)
