"""How many optimizer steps the co-trained drafter takes in a GRPO step (``draft.budget.mode: adaptive``).

Co-training pays only when the rollout distribution moves: on a stationary run a drafter step per
GRPO step buys nothing. The budget spends drafter steps where the measured acceptance says they
pay, from data alone (never the clock), so a run and its resume decide alike.

Signal. a_k, the acceptance length of the drafter on step k's rollouts: vLLM's measured one
(``spec/acceptance_length``, free, known before the update) when the engines serve the co-trained
drafter, else the drafter's own offline acceptance on the chains of the last step it trained on
(``draft/acceptance_offline``, scored before that step's update). The gain is a - 1 (tokens per
verification beyond the one a target step always gives). One step's acceptance is noisy (a few
hundred verification rounds: on the demo +-0.13 around 2.35, 10% of the gain), so the decision
compares means and a noise level measured from the signal itself:

    window   the signals of the last ``memory_steps`` steps;  recent = the last ``recent_steps`` of them
    level    R = mean(recent);  reference B = mean(the window before them)
    noise    sigma = median |a_j - a_{j-1}| / (0.6745 sqrt 2) over the window (successive
             differences, robustly: neither a steady trend nor a jump enters it);
             e = Z sigma sqrt(1/|recent| + 1/|before|), Z = 2.5
    behind   d = (B - R) / (B - 1)                 counts when B - R > tol (B - 1) + e, by
             x = (B - R - e) / (B - 1) - tol        its excess over that threshold (as a gain share)
    rising   r = (R - R_t) / (R_t - 1), R_t = R when it last trained;  counts when R - R_t > tol (R_t - 1) + e
    wanted   = min(max_steps, 1 + floor(x / tol))  when behind (falling behind: more the further)
             = 1  when rising, when too little is measured to judge (fewer than 2 recent_steps signals),
                  or (offline signal only) probe_every steps after it last trained
             = 0  otherwise (it keeps up: idle)

Cost. A credit in FLOPs caps the drafter's share of the update over the run: every step adds
``max_update_share`` x F_update (2 x policy parameters x the batch's tokens per forward of the
update: the log-prob recomputation, the reference's, and 3 per epoch for forward + backward);
each drafter step costs F_draft (6 x the drafter's parameters, borrowed LM head included, x its
chain positions, as the last step it took measured them); the credit is capped at max_steps x
F_draft. The step takes n = min(wanted, floor(credit / F_draft)) (before any measurement of
F_draft: the wanted steps, at most one). The extra n - 1 steps train on the replay window
(:class:`cotrain.draft.online.ReplayWindow`).

What the peers do, as their papers describe them (their code was not in reach to read): verl-SpeCo
adapts its drafter budget to the acceptance trend and picks hard samples by per-request acceptance;
TLT trains the drafter on idle rollout capacity. Here the trend and the lag behind the recent past
both count, each only beyond the noise measured from the signal itself; the cost is bounded by a
share of the update (not by idle time, which a colocated run does not have); the extra steps reuse
recent steps' inputs; there is no sample selection yet.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class BudgetState:
    """What the decision remembers (the driver's checkpoint carries it)."""

    history: list = field(default_factory=list)  # [(step, signal)] of the last memory_steps measurements
    trained_level: float | None = None            # the recent level R when the drafter last trained
    last_trained: int = 0                          # the GRPO step it last trained on (0 = never)
    credit: float = 0.0                            # FLOPs the drafter may still spend
    draft_flops: float | None = None               # FLOPs of one drafter step, as last measured
    offline: float | None = None                   # its offline acceptance on the last step it trained
    level: float | None = None                     # R at the last decision


#: noise multiplier of the thresholds (under a 1% chance per step that noise alone counts as behind)
Z = 2.5


def noise(signals: list[float]) -> float:
    """sigma of one step's signal from its successive differences, robustly: for Gaussian noise the
    median |a_j - a_{j-1}| is 0.6745 sqrt(2) sigma, and a jump (the policy moving) is one
    difference, which the median ignores (0 with fewer than 3 signals)."""
    if len(signals) < 3:
        return 0.0
    d = sorted(abs(b - a) for a, b in zip(signals, signals[1:]))
    mid = len(d) // 2
    med = d[mid] if len(d) % 2 else (d[mid - 1] + d[mid]) / 2
    return med / (0.6745 * math.sqrt(2.0))


class DraftBudget:
    """The decision of :mod:`cotrain.draft.budget` for ``draft.budget`` (a DraftBudgetConfig)."""

    def __init__(self, cfg, served: bool = True):
        """``served``: the signal is the engines' acceptance of this drafter (measured every step
        whatever the drafter does: no probes); False = its own offline acceptance, measured only
        when it trains (an idle drafter probes every probe_every steps)."""
        self.cfg = cfg
        self.served = served
        self.state = BudgetState()

    def decide(self, step: int, signal: float | None, update_flops: float) -> tuple[int, dict[str, float]]:
        """The drafter steps of GRPO step ``step`` (its acceptance ``signal``: None = none measured
        yet) and the reasons, as metrics (``draft/budget_*``)."""
        c, st = self.cfg, self.state
        if c.mode == "fixed":
            return 1, {}
        if signal is not None and math.isfinite(signal):
            st.history = [(s, a) for s, a in st.history if s > step - c.memory_steps] + [(step, float(signal))]
        signals = [a for _, a in st.history]
        recent, before = signals[-c.recent_steps:], signals[:-c.recent_steps]
        behind = rising = 0.0
        why: dict[str, float] = {}
        if recent:
            st.level = R = sum(recent) / len(recent)
            why["draft/budget_level"] = R
        if len(before) < c.recent_steps:  # (and so fewer than 2 x recent_steps signals)
            wanted = 1  # too little measured to judge: train (the credit still caps it)
        else:
            B = sum(before) / len(before)
            e = Z * noise(signals) * math.sqrt(1 / len(recent) + 1 / len(before))
            why.update({"draft/budget_reference": B, "draft/budget_noise": e})
            falling = B > 1.0 and B - R > c.tolerance * (B - 1.0) + e
            behind = (B - R) / (B - 1.0) if B > 1.0 else 0.0
            T = st.trained_level
            improving = T is not None and T > 1.0 and R - T > c.tolerance * (T - 1.0) + e
            if T is not None and T > 1.0:
                rising = (R - T) / (T - 1.0)
            if falling:
                # one step per tolerance of the gain lost beyond the threshold
                wanted = min(c.max_steps, 1 + int((B - R - e) / (B - 1.0) / c.tolerance - 1.0))
            elif improving or (not self.served and step - st.last_trained >= c.probe_every):
                wanted = 1
            else:
                wanted = 0
        st.credit += c.max_update_share * max(float(update_flops), 0.0)
        if st.draft_flops:
            st.credit = min(st.credit, c.max_steps * st.draft_flops)
            n = min(wanted, int(st.credit // st.draft_flops))
        else:
            n = min(wanted, 1)
        return n, {"draft/budget_wanted": float(wanted), "draft/budget_behind": behind,
                   "draft/budget_rising": rising, **why}

    def spent(self, step: int, updates: int, signal: float | None, draft_metrics: dict | None) -> None:
        """Record what step ``step`` took: ``updates`` drafter steps (``draft_metrics``: the step's
        ``draft/*`` metrics, whose ``draft/flops`` is one step's cost and ``draft/acceptance_offline``
        the next offline signal), ``signal`` the acceptance the decision saw."""
        st = self.state
        dm = draft_metrics or {}
        if dm.get("draft/flops"):
            st.draft_flops = float(dm["draft/flops"])
        if math.isfinite(dm.get("draft/acceptance_offline", float("nan"))):
            st.offline = float(dm["draft/acceptance_offline"])
        if updates > 0:
            st.credit = max(0.0, st.credit - updates * (st.draft_flops or 0.0))
            st.last_trained = step
            if st.level is not None:
                st.trained_level = st.level

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = BudgetState(**{**state, "history": [tuple(h) for h in state.get("history", [])]})


def update_flops(policy_params: int, tokens: int, epochs: int, reference: bool) -> float:
    """Estimated FLOPs of one GRPO update: 2 N per token per forward; the log-prob recomputation,
    the reference's forward, and forward + backward (3 forwards' worth) per epoch."""
    return 2.0 * policy_params * tokens * (1 + int(reference) + 3 * epochs)
