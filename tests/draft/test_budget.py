"""draft.budget's decision (cotrain.draft.budget), on hand-made acceptance sequences: idle while the
drafter keeps up (noise included), one step while it improves or a probe is due, more the further
it falls behind, never beyond the FLOP credit, and the same decisions after a state_dict round trip."""

from __future__ import annotations

import random

import pytest

from cotrain.config.schema import DraftBudgetConfig
from cotrain.draft.budget import DraftBudget, noise, update_flops


def _run(budget, signals, update=100.0, draft=10.0, start=1):
    out = []
    for step, a in enumerate(signals, start=start):
        n, _ = budget.decide(step, a, update)
        budget.spent(step, n, a, {"draft/flops": draft} if n else None)
        out.append(n)
    return out


def cfg(**kw):
    return DraftBudgetConfig(mode="adaptive", **{"max_update_share": 1.0, "probe_every": 100, **kw})


def _noisy(level, n, sd=0.13, seed=0):
    """One step's acceptance on the demo: ~2.35 +- 0.13 (bench/budget.py's stationary run)."""
    rng = random.Random(seed)
    return [level + rng.gauss(0.0, sd) for _ in range(n)]


def test_fixed_mode_takes_one_step_always():
    assert _run(DraftBudget(DraftBudgetConfig()), [None, 2.0, 1.0, 3.0]) == [1, 1, 1, 1]


def test_noise_alone_keeps_it_idle():
    """30 stationary steps at the demo's measured noise, 8 seeds: after the first five (too little
    measured) the drafter takes under a tenth of the steps a fixed budget would (a rare 2-sigma
    stretch wakes it)."""
    judged = 0
    for seed in range(8):
        steps = _run(DraftBudget(cfg()), _noisy(2.35, 30, seed=seed))
        assert steps[:5] == [1] * 5
        judged += sum(steps[5:])
    assert judged < 0.1 * 8 * 25, judged


def test_a_drop_wakes_it_with_more_steps_the_further_it_falls():
    b = DraftBudget(cfg(max_steps=4))
    before = _noisy(2.35, 10, sd=0.05)
    steps = _run(b, before)
    assert sum(steps[5:]) == 0
    # the policy moves: acceptance 2.35 -> 1.8 (40% of the gain lost)
    after = _run(b, [1.8, 1.8, 1.8], start=11)
    assert after[-1] == 4 and sum(after) >= 6
    n, why = b.decide(14, 1.8, 100.0)
    assert why["draft/budget_behind"] > 0.3


def test_one_step_while_it_improves_and_a_probe_every_few_idle_steps():
    b = DraftBudget(cfg(recent_steps=2, tolerance=0.05))
    assert _run(b, [2.0] * 6) == [1, 1, 1, 0, 0, 0]  # warm-up (recent_steps = 2), then idle
    # it trained last on step 3 at level 2.0; the level rises (+15%, then +30% of the gain): improving
    assert _run(b, [2.3, 2.3], start=7) == [1, 1]
    probe = DraftBudget(cfg(probe_every=5), served=False)  # (a served drafter needs no probes)
    assert _run(probe, [2.0] * 14) == [1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0]


def test_the_credit_caps_the_drafters_share():
    """A drafter step costs 30% of an update, the share is 15%: over any prefix of the run it spends
    at most what it earned (plus the first, unmeasured step), banking idle steps' credit for a burst."""
    b = DraftBudget(cfg(max_update_share=0.15, max_steps=4))
    signals = _noisy(2.4, 10, sd=0.02) + [2.4 - 0.1 * k for k in range(14)]
    steps = _run(b, signals, update=100.0, draft=30.0)
    for k in range(1, len(steps) + 1):
        assert 30.0 * sum(steps[:k]) <= 0.15 * 100.0 * k + 30.0
    assert max(steps) > 1 and sum(steps) >= 8  # idle steps saved for the fall


def test_state_dict_round_trip_decides_alike():
    seq = _noisy(2.3, 12, seed=3) + [1.9, 1.9, 2.1, 2.2]
    a = DraftBudget(cfg(max_update_share=0.5))
    _run(a, seq[:10], draft=40.0)
    b = DraftBudget(cfg(max_update_share=0.5))
    b.load_state_dict(a.state_dict())
    assert _run(a, seq[10:], draft=40.0, start=11) == _run(b, seq[10:], draft=40.0, start=11)


def test_noise_from_successive_differences():
    assert noise([2.0, 2.0]) == 0.0
    assert noise([2.0, 2.1, 2.2, 2.3, 2.4]) == pytest.approx(0.1 / (0.6745 * 2**0.5))  # a trend: its step
    assert noise(_noisy(2.35, 400, seed=1)) == pytest.approx(0.13, rel=0.1)
    jump = _noisy(2.35, 20, seed=2) + _noisy(1.6, 20, seed=3)  # the policy moved once: not noise
    assert noise(jump) == pytest.approx(noise(_noisy(2.35, 40, seed=4)), rel=0.35)


def test_update_flops():
    assert update_flops(10, 7, epochs=1, reference=True) == 2 * 10 * 7 * 5
    assert update_flops(10, 7, epochs=2, reference=False) == 2 * 10 * 7 * 7
