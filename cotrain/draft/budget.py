"""How many optimizer steps the co-trained drafter takes in a GRPO step (``draft.budget.mode: adaptive``).

Co-training pays only when the rollout distribution moves: on a stationary run a drafter step per
GRPO step buys nothing. The budget spends drafter steps where the measured acceptance says they
pay, from data alone (never the clock), so a run and its resume decide alike.

Signal. m_k, the acceptance length of the drafter on step k's rollouts: vLLM's measured one
(``spec/acceptance_length``, free, known before the update) when the engines serve the co-trained
drafter, else the drafter's own offline acceptance on the chains of the last step it trained on
(``draft/acceptance_offline``, scored before that step's update), smoothed:
a_k = s m_k + (1 - s) a_{k-1} (s = ``smoothing``; one step's acceptance over a few hundred
verification rounds varies by several percent of its gain). The gain is a - 1 (tokens per
verification beyond the one a target step always gives).

    best_k  = max(a_j : the last ``memory_steps`` steps with a measurement)
    behind  = (best_k - a_k) / (best_k - 1)              the share of the best gain lost
    rising  = (a_k - a_t) / (a_t - 1)                    since a_t, the signal when it last trained
    wanted  = min(max_steps, 1 + floor(behind / tol))    if behind > tol      (falling behind)
            = 1                                          elif rising > tol, no signal yet, or
                                                         probe_every steps since it last trained
            = 0                                          otherwise            (it keeps up: idle)

Cost. A credit in FLOPs caps the drafter's share of the update over the run: every step adds
``max_update_share`` x F_update (2 x policy parameters x the batch's tokens per forward of the
update: the log-prob recomputation, the reference's, and 3 per epoch for forward + backward);
each drafter step costs F_draft (6 x the drafter's parameters, borrowed LM head included, x its
chain positions, as the last step it took measured them); the credit is capped at max_steps x
F_draft. The step takes n = min(wanted, floor(credit / F_draft)) (before any measurement of
F_draft: the wanted steps, at most one). The extra n - 1 steps train on the replay window
(:class:`cotrain.draft.online.ReplayWindow`).

What the peers do: verl-SpeCo adapts its drafter budget to the acceptance trend and picks hard
samples by per-request acceptance; TLT trains the drafter on idle rollout capacity. Here the
trend and the lag behind the running best both count, the cost is bounded by a share of the
update (not by idle time, which a colocated run does not have), and the extra steps reuse recent
steps' inputs (no sample selection yet).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class BudgetState:
    """What the decision remembers (the driver's checkpoint carries it)."""

    history: list = field(default_factory=list)  # [(step, signal)] of the last memory_steps measurements
    trained_signal: float | None = None           # the signal when the drafter last trained
    last_trained: int = 0                          # the GRPO step it last trained on (0 = never)
    credit: float = 0.0                            # FLOPs the drafter may still spend
    draft_flops: float | None = None               # FLOPs of one drafter step, as last measured
    offline: float | None = None                   # its offline acceptance on the last step it trained
    smoothed: float | None = None                  # the smoothed signal a_k


class DraftBudget:
    """The decision of :mod:`cotrain.draft.budget` for ``draft.budget`` (a DraftBudgetConfig)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.state = BudgetState()

    def decide(self, step: int, signal: float | None, update_flops: float) -> tuple[int, dict[str, float]]:
        """The drafter steps of GRPO step ``step`` (its acceptance ``signal``: None = none measured
        yet) and the reasons, as metrics (``draft/budget_*``)."""
        c, st = self.cfg, self.state
        if c.mode == "fixed":
            return 1, {}
        if signal is not None and math.isfinite(signal):
            st.smoothed = (float(signal) if st.smoothed is None
                           else c.smoothing * float(signal) + (1.0 - c.smoothing) * st.smoothed)
            signal = st.smoothed
            st.history = [(s, a) for s, a in st.history if s > step - c.memory_steps] + [(step, signal)]
        else:
            signal = None
        behind = rising = 0.0
        if signal is None:
            wanted = 1
        else:
            best = max(a for _, a in st.history)
            behind = (best - signal) / (best - 1.0) if best > 1.0 else 0.0
            if st.trained_signal is not None and st.trained_signal > 1.0:
                rising = (signal - st.trained_signal) / (st.trained_signal - 1.0)
            if behind > c.tolerance:
                wanted = min(c.max_steps, 1 + int(behind / c.tolerance))
            elif rising > c.tolerance or st.trained_signal is None or step - st.last_trained >= c.probe_every:
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
                   "draft/budget_rising": rising,
                   **({"draft/budget_signal": signal} if signal is not None else {})}

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
            st.trained_signal = st.smoothed if signal is not None and math.isfinite(signal) else st.trained_signal

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = BudgetState(**{**state, "history": [tuple(h) for h in state.get("history", [])]})


def update_flops(policy_params: int, tokens: int, epochs: int, reference: bool) -> float:
    """Estimated FLOPs of one GRPO update: 2 N per token per forward; the log-prob recomputation,
    the reference's forward, and forward + backward (3 forwards' worth) per epoch."""
    return 2.0 * policy_params * tokens * (1 + int(reference) + 3 * epochs)
