"""draft.budget's decision (cotrain.draft.budget), on hand-made acceptance sequences: idle while the
drafter keeps up, one step while it improves or a probe is due, more the further it falls behind its
running best, never beyond the FLOP credit, and the same decisions after a state_dict round trip."""

from __future__ import annotations

import pytest

from cotrain.config.schema import DraftBudgetConfig
from cotrain.draft.budget import DraftBudget, update_flops


def _run(budget, signals, update=100.0, draft=10.0):
    out = []
    for step, a in enumerate(signals, start=1):
        n, why = budget.decide(step, a, update)
        budget.spent(step, n, a, {"draft/flops": draft} if n else None)
        out.append(n)
    return out


def cfg(**kw):
    return DraftBudgetConfig(mode="adaptive", **{"smoothing": 1.0, **kw})  # (raw signals unless asked)


def test_fixed_mode_takes_one_step_always():
    assert _run(DraftBudget(DraftBudgetConfig()), [None, 2.0, 1.0, 3.0]) == [1, 1, 1, 1]


def test_idle_when_it_keeps_up_busy_when_it_falls_behind():
    b = DraftBudget(cfg(tolerance=0.05, probe_every=100, max_steps=4, max_update_share=1.0))
    # no signal yet: train; improving (2.0 -> 2.5): train; plateau at 2.5: idle
    assert _run(b, [None, 2.0, 2.5, 2.5, 2.51, 2.49]) == [1, 1, 1, 0, 0, 0]
    # behind its best 2.51 by (2.51 - 2.3) / 1.51 = 14% = 2.8 tolerances: 1 + 2 steps
    n, why = b.decide(7, 2.3, 100.0)
    assert n == 3 and why["draft/budget_behind"] == pytest.approx(0.21 / 1.51)


def test_a_probe_every_few_idle_steps():
    b = DraftBudget(cfg(tolerance=0.05, probe_every=3, max_update_share=1.0))
    assert _run(b, [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]) == [1, 0, 0, 1, 0, 0, 1]  # first: no trained signal yet


def test_the_credit_caps_the_drafters_share():
    # a drafter step costs 30% of an update, the share is 15%: at most one step every other GRPO step
    b = DraftBudget(cfg(tolerance=0.01, max_update_share=0.15, max_steps=4))
    steps = _run(b, [None] + [1.5 - 0.05 * k for k in range(11)], update=100.0, draft=30.0)
    assert sum(steps[1:]) * 30.0 <= 0.15 * 100.0 * len(steps) + 30.0
    assert max(steps[1:]) <= 1 and sum(steps) >= 5


def test_the_best_is_forgotten_after_memory_steps():
    b = DraftBudget(cfg(tolerance=0.05, probe_every=100, memory_steps=3, max_update_share=1.0))
    out = _run(b, [3.0, 2.0, 2.0, 2.0, 2.0, 2.0])
    assert out[1] > 1 and out[-1] == 0  # behind 3.0 at first; 3 steps later 2.0 is the best there is


def test_state_dict_round_trip_decides_alike():
    seq = [None, 2.0, 2.4, 2.4, 2.1, 2.2, 2.4, 2.4, 2.4]
    a = DraftBudget(cfg(tolerance=0.03, probe_every=4, max_update_share=0.5))
    first = _run(a, seq[:5], draft=40.0)
    b = DraftBudget(cfg(tolerance=0.03, probe_every=4, max_update_share=0.5))
    b.load_state_dict(a.state_dict())
    rest = [budget.decide(s, x, 100.0)[0] for budget in (a, b) for s, x in [(6, seq[5])]]
    assert rest[0] == rest[1] and first


def test_update_flops():
    assert update_flops(10, 7, epochs=1, reference=True) == 2 * 10 * 7 * 5
    assert update_flops(10, 7, epochs=2, reference=False) == 2 * 10 * 7 * 7


def test_smoothing_rides_out_one_noisy_step():
    """One step's acceptance 10% of the gain below the others: unsmoothed it is 'behind', smoothed by
    half it is within a 6% tolerance."""
    seq = [2.5, 2.5, 2.5, 2.35, 2.5]
    raw = DraftBudget(cfg(tolerance=0.06, probe_every=100, max_update_share=1.0))
    smooth = DraftBudget(cfg(tolerance=0.06, probe_every=100, max_update_share=1.0, smoothing=0.5))
    assert _run(raw, seq) == [1, 0, 0, 2, 1]  # (and then "improving" on the rebound)
    assert _run(smooth, seq) == [1, 0, 0, 0, 0]
