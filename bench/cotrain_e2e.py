"""The headline, measured: GRPO with no speculation, a frozen drafter, and a co-trained drafter, side by side.

Arms (every arm a complete GRPO run of the same config, seeds and prompts; all alive in one process):

    plain            no speculative decoding                                      (the paper's baseline)
    plain_seed1      the same with run.seed = 1                                   (run-to-run noise band)
    frozen_<kind>    the offline-distilled drafter served frozen (draft.cotrain = false)
    cotrained_<kind> the same drafter as the starting point, co-trained online (draft.cotrain = true)
                     on teacher-forced chains of the rollout tokens (draft.branches = teacher_forced)
    cotrained_<kind>_on_policy
                     the same, co-trained on SpecOPD branches it samples itself (draft.branches =
                     on_policy; ``--branches teacher_forced,on_policy``)
    suffix           model-free peer: vLLM's suffix decoding, its global tree fed by the run's own
                     earlier responses (the engine lives for the whole run; needs arctic-inference)
    ngram            model-free peer: prompt lookup (n-gram matches in the request's own tokens)
    <arm>_async<k>   plain and every co-trained arm again with grpo.max_staleness = k (``--staleness
                     0,1``): asynchronous GRPO, the next steps' rollouts drawn while this one updates
                     (``--async-correction``: its grpo.importance_correction)

for each drafter family asked for (``--kinds dflash,eagle3``) and each peer (``--peers``; ``auto`` =
suffix where arctic-inference is installed, else ngram; every model-free arm drafts at most ``--k``
tokens a round, like the drafters). Arms are **interleaved step by step**:
step t of every arm runs before step t+1 of any, in an order rotated every step, so that the machine's
load drifts onto every arm alike. Each arm's step is timed as a whole (rollout, log-prob
recomputation with the drafter's step, the GRPO update, the weight pushes: the real step, drafter
work and optimizer included) and per phase from the run's own metrics.

Reported, per family, in the JSON (``--out``) and printed:

    rollout_speedup         plain rollout time / co-trained rollout time (sums over the steps)
    e2e_speedup             plain step time / co-trained step time (sums)
    frozen_rollout_speedup  plain rollout time / frozen rollout time
    acceptance_first/last   vLLM acceptance length of the first / last few steps, frozen and co-trained
    update_overhead         co-trained: drafter time / (update time - drafter time) (sums)
    tap_wait_fraction       co-trained: TapChannel wait / update time (sums)
and per step every arm's phases, reward, KL to the initial policy and train-inference KL, and when
the step ran (``time/start`` / ``time/end``, seconds since the first step began); per-step
ratios come with their median and [min, max]. After every round the steps so far are written to
``<out>.partial.json`` (readable by ``--report``), so a run that dies keeps its finished steps.
``summary["arms"]`` has the same keys for every
speculative arm (drafters and peers: speed-ups, acceptance first / last, overhead, and vLLM's
per-request acceptance for short and long responses, split at ``--long-tokens``);
``summary["head_to_head"]`` compares each co-trained drafter with each peer on the same steps,
early half vs late half. PNGs beside the JSON: acceptance per step (frozen vs
co-trained), reward and KL per step (every arm, the two plain seeds as the noise band), and the median
seconds per phase of every arm.

    python bench/cotrain_e2e.py                          # configs/bench_small.yaml, DFlash + EAGLE-3
    python bench/cotrain_e2e.py --steps 10 --kinds dflash
    python bench/cotrain_e2e.py --schedule runs/schedule.yaml   # speculation by batch size (calibrate)
    python bench/cotrain_e2e.py --peers none              # drafters only
    python bench/cotrain_e2e.py --kinds dflash --branches teacher_forced,on_policy --plain-seeds 1
                                                         # co-training objectives side by side
    python bench/cotrain_e2e.py --compare-frozen ...      # + each co-trained arm's frozen copy scored on
                                                         # the arm's own chains (draft.compare_frozen)
    python bench/cotrain_e2e.py --staleness 0,1 --kinds dflash --peers none   # synchronous vs asynchronous
    python bench/cotrain_e2e.py --quick                  # smoke test: the tiny model, 2 steps, DFlash, n-gram
    python bench/cotrain_e2e.py --workload calc --tool-latency 0,1 --steps 24
                                                         # multi-turn: configs/calc.yaml (the calculator tool),
                                                         # plain / frozen / co-trained DFlash once per tool latency

Multi-turn (``--workload calc``; ``bench/multiturn_summary.py``): arms ``<arm>_lat<L>s`` per tool latency L
(``env.tool_latency_s``), all interleaved; per latency the env share of the step, rollout / generation / env /
step ratios to plain (sums and per step, median [min, max]), Amdahl's step ratio from the generation ratio,
the step ratio the paper's rollout speed-ups would give on plain's time split, and vLLM's acceptance per
policy turn; ``bench/results/multiturn_e2e.json`` and its PNG.

Asynchronous arms (``summary["async"]``, and ``<out>_async.png``): per pair (sync arm, its async twin)
the step time over the steady steps (after the warm-up, before the last: there both arms draw one
step's rollouts and take one update per step; the async arm's first step draws two, its last none),
per-step ratios sync / async as median [min, max], the whole run's totals, and the overlap achieved,
paired step by step: hidden h = (sync step - async step) / min(sync rollout, sync update) - 0 when
nothing was gained, 1 when the shorter phase vanished from the step (the planner's ``--hidden``,
``python -m cotrain.plan --phases``) - the slow-down of each phase when it runs beside the other
(async / sync rollout and update seconds: on shared cores both slow down), the engines' and the
trainers' idle fractions (1 - rollout / step, 1 - (update + push) / step), reward and KL against the
plain arms' seed band, and the acceptance of the co-trained drafter with and without staleness.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("time/rollout", "time/update", "time/draft", "time/weight_push")
DISTILL = {"bench_small": {"dflash": "configs/distill_small_dflash.yaml", "eagle3": "configs/distill_small_eagle3.yaml"},
           "grpo": {"dflash": "configs/distill_dflash.yaml", "eagle3": "configs/distill_eagle3.yaml"}}
DISTILL["demo"] = DISTILL["grpo"]  # the demo's drafters are the tiny model's
DISTILL["calc"] = {"dflash": "configs/distill_calc_dflash.yaml"}  # builtin:calc's (the multi-turn workload)
EAGLE3 = ["draft.eagle3.tap_layers=null", "draft.eagle3.ttt_steps=4"]  # as distilled (default taps)


PEERS = ("suffix", "ngram")


def resolve_peers(spec: str) -> list[str]:
    """``--peers``: 'auto' = suffix where arctic-inference loads, else ngram; 'none'; or a list."""
    if spec == "auto":
        import importlib.util

        return ["suffix"] if importlib.util.find_spec("arctic_inference") is not None else ["ngram"]
    peers = [p for p in spec.split(",") if p and p != "none"]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise SystemExit(f"--peers: {bad[0]!r} is not a peer (allowed: auto, none, {', '.join(PEERS)})")
    return peers


BRANCHES = ("teacher_forced", "on_policy")


def resolve_branches(spec: str) -> list[str]:
    """``--branches``: the co-training objectives to run as arms (one co-trained arm per family each)."""
    branches = [b for b in spec.split(",") if b]
    bad = [b for b in branches if b not in BRANCHES]
    if bad or not branches:
        raise SystemExit(f"--branches: {(bad or [spec])[0]!r} is not a branch source (allowed: {', '.join(BRANCHES)})")
    return branches


def cotrained_arm(kind: str, branches: str) -> str:
    """The arm name of ``kind`` co-trained on ``branches`` (teacher-forced keeps the plain name)."""
    return f"cotrained_{kind}" if branches == "teacher_forced" else f"cotrained_{kind}_{branches}"


def arm_overrides(base: str, kind: str | None, mode: str, k: int, schedule: str | None,
                  branches: str = "teacher_forced", compare_frozen: bool = False) -> list[str]:
    """Overrides turning the base config into one arm (``mode`` 'plain', 'frozen', 'cotrained' or a peer;
    ``branches``: the co-trained arm's draft.branches)."""
    if mode in PEERS:  # model-free: no drafter anywhere
        return ["draft.kind=null", f"rollout.speculative.method={mode}",
                f"rollout.speculative.num_speculative_tokens={k}", "rollout.speculative.batch_size_schedule=null"]
    if kind is None:
        return ["draft.kind=null", "rollout.speculative.method=null", "rollout.speculative.batch_size_schedule=null"]
    distill = DISTILL[base][kind]
    ov = [f"draft.kind={kind}", f"rollout.speculative.method={kind}", f"rollout.speculative.num_speculative_tokens={k}"]
    if kind == "eagle3":
        ov += EAGLE3
    if mode == "frozen":
        from cotrain.draft.cache import ensure_distilled

        ov += ["draft.cotrain=false", "draft.init=null",
               f"rollout.speculative.draft_model={ensure_distilled(ROOT / distill) / 'drafter'}"]
    else:
        ov += ["draft.cotrain=true", f"draft.init=distill:{distill}", f"draft.branches={branches}"]
        if compare_frozen:  # the frozen copy on this arm's own chains: the same policy trajectory
            ov.append("draft.compare_frozen=true")
    if schedule:
        import yaml

        sched = yaml.safe_load(Path(schedule).read_text())["rollout"]["speculative"]["batch_size_schedule"]
        ov.append("rollout.speculative.batch_size_schedule=" + json.dumps(sched).replace(" ", ""))
    return ov


def acceptance_by_length(samples, long_tokens: int) -> dict[str, float]:
    """vLLM's per-request acceptance, pooled over the responses shorter than ``long_tokens`` and the
    others: 1 + accepted drafts / verification rounds (token-weighted, as vLLM's own counter), and
    how many responses each side has."""
    out = {}
    for side, keep in (("short", lambda n: n < long_tokens), ("long", lambda n: n >= long_tokens)):
        these = [s for s in samples if keep(len(s.token_ids))]
        spec = [s.spec_decode for s in these if s.spec_decode]
        rounds = sum(d.get("num_spec_steps", 0.0) for d in spec)
        accepted = sum(d.get("num_accepted_draft_tokens", 0.0) for d in spec)
        out[f"spec/acceptance_{side}"] = 1.0 + accepted / rounds if rounds else float("nan")
        out[f"spec/responses_{side}"] = float(len(these))
    return out


def summarize(arms: dict[str, list[dict]], kinds: list[str], tail: int, peers: list[str] = (), warmup: int = 1) -> dict:
    """Times (sums, per-step ratios, head to head) over the steps after the first ``warmup`` ones of
    every arm (one-time costs: the engines' and trainers' first calls); acceptance over all steps."""
    timed = {n: ms[warmup:] if len(ms) > warmup else ms for n, ms in arms.items()}

    def tot(arm: str, key: str) -> float:
        return sum(m.get(key, 0.0) for m in timed[arm])

    def ratios(a: str, b: str, key: str) -> dict:
        r = [x[key] / y[key] for x, y in zip(timed[a], timed[b]) if y.get(key)]
        return {"median": statistics.median(r), "min": min(r), "max": max(r)} if r else {}

    def acc(arm: str, part: slice) -> float:
        v = [m["spec/acceptance_length"] for m in arms[arm][part] if "spec/acceptance_length" in m]
        return statistics.mean(v) if v else float("nan")

    def pooled(arm: str, side: str) -> float:  # per-request acceptance over the whole run
        ms = arms[arm]
        n = sum(m.get(f"spec/responses_{side}", 0.0) for m in ms)
        v = [(m[f"spec/acceptance_{side}"], m[f"spec/responses_{side}"]) for m in ms
             if m.get(f"spec/responses_{side}") and m.get(f"spec/acceptance_{side}") == m.get(f"spec/acceptance_{side}")]
        return sum(a * w for a, w in v) / sum(w for _, w in v) if v and n else float("nan")

    per_arm = {}  # the same keys for every speculative arm: computed once, here
    # every synchronous speculative arm (an async arm's engine seconds overlap its update, and its last step
    # draws nothing: it is summarised against its synchronous twin instead, summarize_async)
    for arm in [a for a in arms if not a.startswith("plain") and "_async" not in a]:
        draft = tot(arm, "time/draft")
        per_arm[arm] = {
            "rollout_speedup": tot("plain", "time/rollout") / tot(arm, "time/rollout"),
            "e2e_speedup": tot("plain", "time/step") / tot(arm, "time/step"),
            "acceptance_first": acc(arm, slice(0, tail)), "acceptance_last": acc(arm, slice(-tail, None)),
            "acceptance_short": pooled(arm, "short"), "acceptance_long": pooled(arm, "long"),
            "update_overhead": draft / (tot(arm, "time/update") - draft) if draft else 0.0,
            "tap_wait_fraction": tot(arm, "tap/wait_s") / tot(arm, "time/update"),
            "per_step_rollout_speedup": ratios("plain", arm, "time/rollout"),
            "per_step_e2e_speedup": ratios("plain", arm, "time/step"),
        }

    out = {}
    for kind in kinds:  # co-trained vs frozen per family, read from the per-arm summary
        c, f = per_arm[f"cotrained_{kind}"], per_arm[f"frozen_{kind}"]
        out[kind] = {
            "rollout_speedup": c["rollout_speedup"],
            "e2e_speedup": c["e2e_speedup"],
            "frozen_rollout_speedup": f["rollout_speedup"],
            "frozen_e2e_speedup": f["e2e_speedup"],
            "acceptance_first": {"frozen": f["acceptance_first"], "cotrained": c["acceptance_first"]},
            "acceptance_last": {"frozen": f["acceptance_last"], "cotrained": c["acceptance_last"]},
            "update_overhead": c["update_overhead"],
            "tap_wait_fraction": c["tap_wait_fraction"],
            "per_step_rollout_speedup": c["per_step_rollout_speedup"],
            "per_step_e2e_speedup": c["per_step_e2e_speedup"],
            "per_step_frozen_rollout_speedup": f["per_step_rollout_speedup"],
            # the goal: co-trained keeps >= 95% of its first acceptance, frozen loses >= 15%
            "acceptance_retained": {"frozen": f["acceptance_last"] / f["acceptance_first"],
                                    "cotrained": c["acceptance_last"] / c["acceptance_first"]},
        }
        op = f"cotrained_{kind}_on_policy"
        if op in per_arm:  # the two co-training objectives on the same steps
            o = per_arm[op]
            acc_ratio = [x["spec/acceptance_length"] / y["spec/acceptance_length"] for x, y in
                         zip(arms[op], arms[f"cotrained_{kind}"]) if "spec/acceptance_length" in x and y.get("spec/acceptance_length")]
            out[kind]["on_policy"] = {
                "acceptance_first": o["acceptance_first"], "acceptance_last": o["acceptance_last"],
                "acceptance_retained": o["acceptance_last"] / o["acceptance_first"],
                "rollout_speedup": o["rollout_speedup"], "e2e_speedup": o["e2e_speedup"],
                "update_overhead": o["update_overhead"],
                "draft_time_ratio": tot(op, "time/draft") / tot(f"cotrained_{kind}", "time/draft"),
                "per_step_acceptance_ratio": ({"median": statistics.median(acc_ratio), "min": min(acc_ratio),
                                               "max": max(acc_ratio)} if acc_ratio else {}),
                "note": "acceptance ratio = on-policy / teacher-forced co-trained arm's vLLM acceptance on the same step; "
                        "draft_time_ratio = their summed drafter-step times",
            }
    same = {}  # draft.compare_frozen: each co-trained arm against its frozen copy on the arm's own chains
    for arm, ms in arms.items():
        if not any("draft/acceptance_offline_frozen" in m for m in ms):
            continue
        co = [m["draft/acceptance_offline"] for m in ms]
        fr = [m["draft/acceptance_offline_frozen"] for m in ms]
        gap = [a - b for a, b in zip(co, fr)]
        mean = lambda v: statistics.mean(v) if v else float("nan")  # noqa: E731
        same[arm] = {"cotrained_first": mean(co[:tail]), "cotrained_last": mean(co[-tail:]),
                     "frozen_first": mean(fr[:tail]), "frozen_last": mean(fr[-tail:]),
                     "cotrained_retained": mean(co[-tail:]) / mean(co[:tail]),
                     "frozen_retained": mean(fr[-tail:]) / mean(fr[:tail]),
                     "gap_last": mean(gap[-tail:]),
                     # the run in thirds (early / middle / late): mean co-trained - frozen gap, steps ahead
                     "gap_mean_by_third": [mean(g) for g in (gap[: len(gap) // 3], gap[len(gap) // 3: 2 * len(gap) // 3],
                                                             gap[2 * len(gap) // 3:])],
                     "gap_max": max(gap), "steps_ahead": sum(g > 0 for g in gap),
                     "frozen_eval_s_median": statistics.median(m.get("draft/frozen_s", 0.0) for m in ms),
                     "note": "offline greedy acceptance (1 + leading drafts equal to the policy's greedy token, k "
                             "drafts) on the arm's own rollout chains: co-trained drafter vs the frozen copy of its start"}
    if same:
        out["same_trajectory"] = same
    out["noise"] = {key: statistics.mean(m["reward/mean"] for m in arms[n])
                    for key, n in (("reward_mean_seed0", "plain"), ("reward_mean_seed1", "plain_seed1")) if n in arms}
    out["arms"] = per_arm
    half = len(arms["plain"]) // 2
    out["head_to_head"] = {}
    for kind in kinds:
        for peer in peers:
            c = f"cotrained_{kind}"
            r = [p["time/rollout"] / x["time/rollout"] for x, p in zip(timed[c], timed[peer])]
            early, late = r[: len(r) // 2] or r, r[len(r) // 2:] or r
            out["head_to_head"][f"{c}_vs_{peer}"] = {
                "rollout_ratio_early": statistics.median(early), "rollout_ratio_late": statistics.median(late),
                "rollout_ratio_range": [min(r), max(r)],
                "acceptance_early": {c: acc(c, slice(0, half)), peer: acc(peer, slice(0, half))},
                "acceptance_late": {c: acc(c, slice(half, None)), peer: acc(peer, slice(half, None))},
                "acceptance_short": {c: pooled(c, "short"), peer: pooled(peer, "short")},
                "acceptance_long": {c: pooled(c, "long"), peer: pooled(peer, "long")},
                "note": "rollout_ratio = peer rollout time / co-trained rollout time on the same step (> 1: co-trained faster)",
            }
    return out


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms, kinds = result["arms"], result["kinds"]
    steps = range(1, result["steps"] + 1)
    same = [n for n, ms in arms.items() if any("draft/acceptance_offline_frozen" in m for m in ms)]
    fig, ax = plt.subplots(1, 5 if same else 4, figsize=(25 if same else 20, 4.2))
    for i, kind in enumerate(kinds):
        for name, ls in ((f"frozen_{kind}", "--"), (f"cotrained_{kind}", "-"), (f"cotrained_{kind}_on_policy", "-.")):
            if name in arms:
                v = [m.get("spec/acceptance_length", float("nan")) for m in arms[name]]
                ax[0].plot(steps, v, ls, color=f"C{i}", label=name)
    for i, peer in enumerate(result.get("peers", [])):
        v = [m.get("spec/acceptance_length", float("nan")) for m in arms[peer]]
        ax[0].plot(steps, v, ":", color=f"C{len(kinds) + i}", label=f"{peer} (model-free)")
    ax[0].set_title("vLLM acceptance length")
    for key, a, title in (("reward/mean", ax[1], "reward"), ("kl/ref", ax[2], "KL to the initial policy")):
        if "plain_seed1" in arms:  # the run-to-run noise band (--plain-seeds 2)
            lo = [min(x.get(key, 0), y.get(key, 0)) for x, y in zip(arms["plain"], arms["plain_seed1"])]
            hi = [max(x.get(key, 0), y.get(key, 0)) for x, y in zip(arms["plain"], arms["plain_seed1"])]
            a.fill_between(steps, lo, hi, color="0.85", label="plain, seeds 0 and 1")
        for j, name in enumerate(n for n in arms if n != "plain_seed1"):
            a.plot(steps, [m.get(key, float("nan")) for m in arms[name]], lw=1, label=name, color=f"C{j}")
        a.set_title(title)
    names = list(arms)
    bottom = [0.0] * len(names)
    for j, phase in enumerate(("time/rollout", "time/update", "time/weight_push")):
        vals = [statistics.median(m.get(phase, 0.0) for m in arms[n]) for n in names]
        ax[3].bar(names, vals, bottom=bottom, label=phase, color=f"C{j}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    draft = [statistics.median(m.get("time/draft", 0.0) for m in arms[n]) for n in names]
    rollout = [statistics.median(m["time/rollout"] for m in arms[n]) for n in names]
    ax[3].bar(names, draft, bottom=rollout, color="none", edgecolor="k", hatch="//", label="of which the drafter")
    ax[3].set_title("median seconds per step")
    ax[3].tick_params(axis="x", rotation=30)
    for j, name in enumerate(same):  # draft.compare_frozen: the same chains, the same policy trajectory
        ax[4].plot(steps, [m.get("draft/acceptance_offline", float("nan")) for m in arms[name]], "-",
                   color=f"C{j}", label=f"{name}: co-trained")
        ax[4].plot(steps, [m.get("draft/acceptance_offline_frozen", float("nan")) for m in arms[name]], ":",
                   color=f"C{j}", label=f"{name}: frozen copy")
    if same:
        ax[4].set_title("offline acceptance on the arm's own chains")
    for a in ax:
        a.legend(fontsize=7)
        if a is not ax[3]:
            a.set_xlabel("step")
    fig.suptitle(f"cotrain end to end: {result['config']} ({result['steps']} steps, arms interleaved)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _record_samples(rollout) -> list:
    """Keep the samples of every rollout (for per-request acceptance by length); the step's result is
    returned unchanged."""
    box = [[]]
    generate = rollout.generate

    def recording(*a, **kw):
        result = generate(*a, **kw)
        box[0] = [s for group in result.samples for s in group]
        return result

    rollout.generate = recording
    return box


def machine_info() -> dict:
    import os
    import platform

    import torch

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "load_avg_at_end": os.getloadavg()}


def run(args) -> dict:
    import ray

    from cotrain.config import load_config
    from cotrain.rl.driver import GrpoRun

    base = Path(args.config).stem
    kinds = [k for k in args.kinds.split(",") if k]
    common = [f"grpo.num_steps={args.steps}", "data.eval.every=0", "logging.progress_bar=false",
              "logging.tensorboard=false", "checkpoint.every=100000", "cluster.cpus_per_node=64",
              "run.overwrite=true", *args.overrides]  # each run of the benchmark measures afresh
    branches = resolve_branches(args.branches)
    specs = {"plain": (None, "plain", 0, None)}
    if args.plain_seeds == 2:
        specs["plain_seed1"] = (None, "plain", 1, None)
    for kind in kinds:
        specs[f"frozen_{kind}"] = (kind, "frozen", 0, None)
        for b in branches:
            specs[cotrained_arm(kind, b)] = (kind, "cotrained", 0, b)
    peers = resolve_peers(args.peers)
    for peer in peers:
        specs[peer] = (None, peer, 0, None)
    staleness = resolve_staleness(args.staleness)
    for k in staleness:  # the async twin of plain and of every co-trained arm
        for name in [n for n, sp in specs.items() if n == "plain" or sp[1] == "cotrained"]:
            specs[async_arm(name, k)] = specs[name]
    latencies = getattr(args, "latencies", None)
    if latencies is not None:  # the multi-turn workload: one set of arms per tool latency
        specs = {latency_arm(n, lat): sp for lat in latencies for n, sp in specs.items()}
    out_root = Path(args.out).with_suffix("")
    runs: dict[str, GrpoRun] = {}
    last: dict[str, list] = {}  # the samples of each arm's latest rollout
    metrics: dict[str, list[dict]] = {n: [] for n in specs}
    try:
        for name, (kind, mode, seed, b) in specs.items():
            ov = common + arm_overrides(base, kind, mode, args.k, args.schedule if kind else None, b or "teacher_forced",
                                        args.compare_frozen)
            ov += [f"run.seed={seed}", f"run.output_dir={out_root / name}", f"run.name={name}"]
            if latencies is not None:
                ov.append(f"env.tool_latency_s={split_latency(name)[1]}")
            if "_async" in name:
                ov += [f"grpo.max_staleness={name.rsplit('_async', 1)[1]}",
                       f"grpo.importance_correction={args.async_correction}"]
            cfg = load_config(args.config, ov)
            print(f"[setup] {name}", flush=True)
            runs[name] = GrpoRun(cfg)
            runs[name].setup(resume=False)
            last[name] = _record_samples(runs[name].rollout)
        names = list(specs)
        origin = time.perf_counter()
        for step in range(1, args.steps + 1):
            order = names[step % len(names):] + names[: step % len(names)]
            for name in order:
                t0 = time.perf_counter()
                m = runs[name].step(step)
                t1 = time.perf_counter()
                # when the step ran (seconds since the first step began): the interleaving, checkable
                m["time/step"], m["time/start"], m["time/end"] = t1 - t0, t0 - origin, t1 - origin
                m.update(acceptance_by_length(last[name][0], args.long_tokens))
                runs[name].logger.log(step, m)
                metrics[name].append(m)
            c = {n: metrics[n][-1] for n in names}
            print(f"[step {step}] " + "  ".join(
                f"{n}: {c[n]['time/step']:.1f}s" + (f" acc {c[n]['spec/acceptance_length']:.2f}"
                                                    if "spec/acceptance_length" in c[n] else "") for n in names),
                  flush=True)
            # every finished round is kept: a run that dies later still leaves its complete steps
            partial = Path(args.out).with_suffix(".partial.json")
            partial.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps(_result(args, kinds, peers, metrics, step), indent=1))
    finally:
        for r in runs.values():
            r.shutdown()
        ray.shutdown()
    return _result(args, kinds, peers, metrics, args.steps)


def resolve_staleness(spec: str) -> list[int]:
    """``--staleness``: the grpo.max_staleness values to run; 0 (the synchronous arms) is always run."""
    try:
        values = sorted({int(v) for v in spec.split(",") if v != ""})
    except ValueError:
        raise SystemExit(f"--staleness: {spec!r} is not a list of integers >= 0 (e.g. 0,1)") from None
    if not values or values[0] < 0:
        raise SystemExit(f"--staleness: {spec!r} (allowed: integers >= 0, e.g. 0,1)")
    return [v for v in values if v > 0]


def async_arm(name: str, k: int) -> str:
    return f"{name}_async{k}"


def summarize_async(arms: dict[str, list[dict]], warmup: int = 1) -> dict:
    """Each asynchronous arm against its synchronous twin (the module doc's "Asynchronous arms")."""
    out = {}
    band = [statistics.mean(m["reward/mean"] for m in arms[n]) for n in ("plain", "plain_seed1") if n in arms]
    for name in [n for n in arms if "_async" in n]:
        sync, ms = arms[name.rsplit("_async", 1)[0]], arms[name]
        steady = slice(warmup, len(ms) - 1) if len(ms) > warmup + 1 else slice(0, len(ms))

        def med(v):
            return {"median": statistics.median(v), "min": min(v), "max": max(v)} if v else {}

        def phases(m):
            r, u, w = m.get("time/rollout", 0.0), m.get("time/update", 0.0), m.get("time/weight_push", 0.0)
            return r, u, w, m["time/step"]

        hidden, engine_idle, trainer_idle, slow_r, slow_u = [], [], [], [], []
        for m, ms_ in zip(ms[steady], sync[steady]):
            r, u, w, t = phases(m)
            r0, u0, _, t0 = phases(ms_)
            if min(r0, u0) > 0:
                hidden.append((t0 - t) / min(r0, u0))
                slow_r.append(r / r0)
                slow_u.append(u / u0)
            engine_idle.append(1 - r / t)
            trainer_idle.append(1 - (u + w) / t)
        acc = [m["spec/acceptance_length"] for m in ms if "spec/acceptance_length" in m]
        acc_sync = [m["spec/acceptance_length"] for m in sync if "spec/acceptance_length" in m]
        out[name] = {
            "staleness": int(name.rsplit("_async", 1)[1]),
            "steady_steps": [steady.start + 1, steady.stop],
            "step_s": med([m["time/step"] for m in ms[steady]]),
            "sync_step_s": med([m["time/step"] for m in sync[steady]]),
            "per_step_speedup": med([a["time/step"] / b["time/step"] for a, b in zip(sync[steady], ms[steady])]),
            "run_speedup": sum(m["time/step"] for m in sync) / sum(m["time/step"] for m in ms),
            "hidden_fraction": med(hidden), "rollout_slowdown": med(slow_r), "update_slowdown": med(slow_u),
            "engine_idle": med(engine_idle), "trainer_idle": med(trainer_idle),
            "sync_engine_idle": med([1 - m["time/rollout"] / m["time/step"] for m in sync[steady]]),
            "sync_trainer_idle": med([1 - (m["time/update"] + m.get("time/weight_push", 0.0)) / m["time/step"]
                                      for m in sync[steady]]),
            "policy_lag": med([m.get("async/policy_lag", 0.0) for m in ms]),
            "reward_mean": statistics.mean(m["reward/mean"] for m in ms),
            "reward_band": [min(band), max(band)] if band else [],
            "kl_ref_last": ms[-1].get("kl/ref", float("nan")), "sync_kl_ref_last": sync[-1].get("kl/ref", float("nan")),
            "kl_train_infer": med([m["kl/train_infer"] for m in ms]),
            "acceptance": statistics.mean(acc) if acc else float("nan"),
            "sync_acceptance": statistics.mean(acc_sync) if acc_sync else float("nan"),
            "per_step_acceptance_ratio": med([a["spec/acceptance_length"] / b["spec/acceptance_length"]
                                              for a, b in zip(ms, sync) if "spec/acceptance_length" in a
                                              and b.get("spec/acceptance_length")]),
        }
    return out


def plot_async(result: dict, png: Path) -> None:
    """Step time and idle fractions of every sync / async pair, and the co-trained acceptance per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms, s = result["arms"], result["summary"].get("async", {})
    if not s:
        return
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.2))
    steps = range(1, result["steps"] + 1)
    for j, name in enumerate(s):
        twin = name.rsplit("_async", 1)[0]
        ax[0].plot(steps, [m["time/step"] for m in arms[twin]], "-", color=f"C{j}", label=f"{twin} (sync)")
        ax[0].plot(steps, [m["time/step"] for m in arms[name]], "--", color=f"C{j}", label=name)
        if any("spec/acceptance_length" in m for m in arms[name]):
            ax[2].plot(steps, [m.get("spec/acceptance_length", float("nan")) for m in arms[twin]], "-", color=f"C{j}",
                       label=f"{twin} (sync)")
            ax[2].plot(steps, [m.get("spec/acceptance_length", float("nan")) for m in arms[name]], "--",
                       color=f"C{j}", label=name)
    ax[0].set_title("seconds per step")
    labels, vals = [], []
    for name, a in s.items():
        labels += [f"{name.rsplit('_async', 1)[0]}\nsync", f"{name}"]
        vals += [(a["sync_engine_idle"]["median"], a["sync_trainer_idle"]["median"]),
                 (a["engine_idle"]["median"], a["trainer_idle"]["median"])]
    x = range(len(labels))
    ax[1].bar([i - 0.2 for i in x], [v[0] for v in vals], 0.4, label="engines idle")
    ax[1].bar([i + 0.2 for i in x], [v[1] for v in vals], 0.4, label="trainers idle")
    ax[1].set_xticks(list(x), labels, fontsize=7)
    ax[1].set_title("idle fraction of the step (median, steady steps)")
    ax[2].set_title("vLLM acceptance length")
    for a in ax:
        a.legend(fontsize=7)
    ax[0].set_xlabel("step")
    ax[2].set_xlabel("step")
    fig.suptitle(f"synchronous vs asynchronous GRPO: {result['config']} ({result['steps']} steps, arms interleaved)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


KEEP = ("time/step", "time/start", "time/end", *PHASES, "time/draft_push", "tap/wait_s", "rollout/tokens_per_s", "reward/mean", "kl/ref",
        "time/rollout_wait", "async/policy_lag", "train/is_ratio_mean", "train/is_truncated_frac",
        "kl/train_infer", "spec/acceptance_length", "draft/acceptance_offline", "draft/loss", "response/length",
        "spec/acceptance_short", "spec/acceptance_long", "spec/responses_short", "spec/responses_long",
        "draft/acceptance_offline_frozen", "draft/frozen_s",
        # multi-turn (--workload calc): the environment's seconds, per-turn acceptance, final-answer accuracy
        "time/env", "env/steps", "env/tool_calls", "env/errors", "env/turns_mean", "reward/accuracy",
        "response/env_tokens", *(f"spec/acceptance_length_turn{t}" for t in range(1, 5)),
        *(f"draft/acceptance_offline_turn{t}" for t in range(1, 5)))


def _result(args, kinds: list[str], peers: list[str], metrics: dict[str, list[dict]], steps: int) -> dict:
    arms = {n: [{k: v for k, v in m.items() if k in KEEP} for m in ms[:steps]] for n, ms in metrics.items()}
    result = {"config": args.config, "steps": steps, "kinds": kinds, "peers": peers, "k": args.k,
              "branches": args.branches.split(","), "plain_seeds": args.plain_seeds,
              "compare_frozen": getattr(args, "compare_frozen", False),
              "schedule": args.schedule, "long_tokens": args.long_tokens, "overrides": args.overrides, "arms": arms,
              "machine": machine_info()}
    result["warmup"] = args.warmup
    result["staleness"], result["async_correction"] = args.staleness, args.async_correction
    result["workload"] = getattr(args, "workload", "single_turn")
    result["tool_latencies"] = getattr(args, "latencies", None)
    result["summary"] = summarize_result(result)
    return result


def summarize_result(result: dict) -> dict:
    """The summary of a run's arms (written into the JSON, recomputed by ``--report``)."""
    arms, kinds, steps, w = result["arms"], result["kinds"], result["steps"], result.get("warmup", 1)
    tail = max(1, min(3, steps // 3))
    if result.get("tool_latencies") is not None:
        from bench.multiturn_summary import summarize_multiturn

        return summarize_multiturn(arms, kinds, result["tool_latencies"], tail=tail, warmup=w)
    summary = summarize(arms, kinds, tail=tail, peers=result.get("peers", []), warmup=w)
    if any("_async" in n for n in arms):
        summary["async"] = summarize_async(arms, warmup=w)
    return summary


def latency_arm(name: str, latency: float) -> str:
    """The arm ``name`` of the multi-turn workload at tool latency ``latency`` seconds."""
    return f"{name}_lat{latency:g}s"


def split_latency(arm: str) -> tuple[str, float]:
    name, lat = arm.rsplit("_lat", 1)
    return name, float(lat[:-1])


def report(result: dict) -> str:
    lines = [f"{result['config']}: {result['steps']} GRPO steps per arm, interleaved; draft tokens k = {result['k']}"
             + (f", schedule {result['schedule']}" if result.get("schedule") else "")]
    for kind in result["kinds"]:
        s = result["summary"][kind]
        ps = s["per_step_rollout_speedup"]
        lines += [f"{kind}: rollout speed-up {s['rollout_speedup']:.2f}x (per step median {ps['median']:.2f} "
                  f"[{ps['min']:.2f}, {ps['max']:.2f}]), end to end {s['e2e_speedup']:.2f}x; frozen rollout "
                  f"{s['frozen_rollout_speedup']:.2f}x",
                  f"  acceptance first -> last: frozen {s['acceptance_first']['frozen']:.2f} -> "
                  f"{s['acceptance_last']['frozen']:.2f}, co-trained {s['acceptance_first']['cotrained']:.2f} -> "
                  f"{s['acceptance_last']['cotrained']:.2f}",
                  f"  update-time overhead {100 * s['update_overhead']:.1f}%, tap wait "
                  f"{100 * s['tap_wait_fraction']:.2f}% of the update"]
        if "on_policy" in s:
            o = s["on_policy"]
            lines.append(f"  on-policy co-training: acceptance {o['acceptance_first']:.2f} -> {o['acceptance_last']:.2f}, "
                         f"per step vs teacher-forced {_rng(o['per_step_acceptance_ratio'])}, drafter time "
                         f"{o['draft_time_ratio']:.2f}x teacher-forced's, update-time overhead {100 * o['update_overhead']:.1f}%")
    for name, t in result["summary"].get("same_trajectory", {}).items():
        lines.append(f"{name} on its own chains: co-trained {t['cotrained_first']:.2f} -> {t['cotrained_last']:.2f}, "
                     f"frozen copy {t['frozen_first']:.2f} -> {t['frozen_last']:.2f} (offline greedy acceptance)")
    arms = result["summary"].get("arms", {})
    if arms:
        lines.append(f"{'arm':<26} {'rollout':>8} {'e2e':>6} {'acc first':>9} {'acc last':>8} {'acc short':>9} "
                     f"{'acc long':>8} {'overhead':>8}")
        for name, a in arms.items():
            lines.append(f"{name:<26} {a['rollout_speedup']:>7.2f}x {a['e2e_speedup']:>5.2f}x {a['acceptance_first']:>9.2f} "
                         f"{a['acceptance_last']:>8.2f} {a['acceptance_short']:>9.2f} {a['acceptance_long']:>8.2f} "
                         f"{100 * a['update_overhead']:>7.1f}%")
    for name, h in result["summary"].get("head_to_head", {}).items():
        lines.append(f"{name}: peer/co-trained rollout time early {h['rollout_ratio_early']:.2f}, late "
                     f"{h['rollout_ratio_late']:.2f} (range {h['rollout_ratio_range'][0]:.2f}-{h['rollout_ratio_range'][1]:.2f})")
    for name, a in result["summary"].get("async", {}).items():
        lines.append(f"{name}: step {a['step_s']['median']:.2f}s vs sync {a['sync_step_s']['median']:.2f}s, per step "
                     f"{_rng(a['per_step_speedup'])}x, run {a['run_speedup']:.2f}x; hidden {_rng(a['hidden_fraction'])} "
                     f"(rollout x{a['rollout_slowdown']['median']:.2f}, update x{a['update_slowdown']['median']:.2f} "
                     f"beside each other); idle engines {a['engine_idle']['median']:.2f} "
                     f"(sync {a['sync_engine_idle']['median']:.2f}), trainers {a['trainer_idle']['median']:.2f} "
                     f"(sync {a['sync_trainer_idle']['median']:.2f}); acceptance {a['acceptance']:.2f} vs sync "
                     f"{a['sync_acceptance']:.2f}; reward {a['reward_mean']:.3f} (plain band {a['reward_band']})")
    return "\n".join(lines)


PAPER = {  # the paper's published ranges (Tab. 1, Tab. 2, section 3.5), for the tables
    "acceptance": "2.28-4.78", "rollout_speedup": "1.19-2.23x", "e2e_speedup": "1.16-1.88x",
    "update_overhead": {"dflash": "< 15%", "dspark": "14.6%", "eagle3": "34%"}, "tap_wait_fraction": "1.5-2.2%"}


def _rng(d: dict) -> str:
    return f"{d['median']:.2f} [{d['min']:.2f}, {d['max']:.2f}]" if d else "-"


def _head(caption: str, *columns: str) -> list[str]:
    """A markdown table's caption (a blank line before and after), header row and separator."""
    return ["", caption, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def markdown(result: dict) -> str:
    """docs/benchmarks.md's tables, rendered from one run's JSON (``--report JSON --markdown``)."""
    S, arms = result["summary"], result["arms"]
    w = result.get("warmup", 0)
    out = _head(f"Table 1 analogue (per drafter family; speed-ups = plain time / arm time, sums over steps {w + 1}-"
                f"{result['steps']} (steps 1-{w} left out: docs/benchmarks.md says why); per-step ratios as median "
                "[min, max]; acceptance over the first / last steps):",
                "family", "acceptance frozen (first -> last)", "acceptance co-trained (first -> last)",
                "rollout speed-up co-trained", "per step", "end-to-end speed-up co-trained", "per step",
                "frozen rollout / end-to-end")[1:]  # the page's first line: no blank line before it
    for kind in result["kinds"]:
        s = S[kind]
        out.append(f"| {kind} | {s['acceptance_first']['frozen']:.2f} -> {s['acceptance_last']['frozen']:.2f} | "
                   f"{s['acceptance_first']['cotrained']:.2f} -> {s['acceptance_last']['cotrained']:.2f} | "
                   f"{s['rollout_speedup']:.2f}x | {_rng(s['per_step_rollout_speedup'])} | {s['e2e_speedup']:.2f}x | "
                   f"{_rng(s['per_step_e2e_speedup'])} | {s['frozen_rollout_speedup']:.2f}x / {s['frozen_e2e_speedup']:.2f}x |")
    out.append(f"| paper (Tab. 1) | - | {PAPER['acceptance']} | {PAPER['rollout_speedup']} | | {PAPER['e2e_speedup']} | | |")
    out += _head("Table 2 analogue (co-trained arms):", "family", "update-time overhead (drafter / rest of the update)",
                 "paper", "tap wait / update time", "paper")
    for kind in result["kinds"]:
        s = S[kind]
        out.append(f"| {kind} | {100 * s['update_overhead']:.1f}% | {PAPER['update_overhead'].get(kind, '-')} | "
                   f"{100 * s['tap_wait_fraction']:.2f}% | {PAPER['tap_wait_fraction']} |")
    out += _head("Acceptance kept (last / first; the goal: co-trained >= 95%, frozen falls by >= 15%):",
                 "family", "frozen", "co-trained", "co-trained on-policy")
    for kind in result["kinds"]:
        r = S[kind].get("acceptance_retained")
        if r:
            op = S[kind].get("on_policy", {}).get("acceptance_retained")
            out.append(f"| {kind} | {100 * r['frozen']:.1f}% | {100 * r['cotrained']:.1f}% | "
                       f"{'-' if op is None else f'{100 * op:.1f}%'} |")
    ops = [(kind, S[kind]["on_policy"]) for kind in result["kinds"] if "on_policy" in S[kind]]
    if ops:
        out += _head("Co-training objectives on the same steps (on-policy SpecOPD branches vs teacher-forced chains; "
                     "acceptance ratio = on-policy / teacher-forced vLLM acceptance per step):",
                     "family", "acceptance teacher-forced (first -> last)", "acceptance on-policy (first -> last)",
                     "acceptance ratio per step", "drafter time on-policy / teacher-forced", "update overhead on-policy")
        for kind, o in ops:
            s_ = S[kind]
            out.append(f"| {kind} | {s_['acceptance_first']['cotrained']:.2f} -> {s_['acceptance_last']['cotrained']:.2f} | "
                       f"{o['acceptance_first']:.2f} -> {o['acceptance_last']:.2f} | {_rng(o['per_step_acceptance_ratio'])} | "
                       f"{o['draft_time_ratio']:.2f}x | {100 * o['update_overhead']:.1f}% |")
    same = S.get("same_trajectory", {})
    if same:
        out += _head("Same policy trajectory (`draft.compare_frozen`: each co-trained arm's drafter and a frozen copy of "
                     "its start, offline greedy acceptance on the arm's own rollout chains at every step; first / last "
                     "steps as above):",
                     "arm", "co-trained (first -> last)", "kept", "frozen copy (first -> last)", "kept",
                     "co-trained - frozen at the end", "mean gap, thirds of the run", "largest gap",
                     "steps co-trained ahead")
        for name, t in same.items():
            thirds = " / ".join(f"{g:+.2f}" for g in t["gap_mean_by_third"])
            out.append(f"| {name} | {t['cotrained_first']:.2f} -> {t['cotrained_last']:.2f} | "
                       f"{100 * t['cotrained_retained']:.1f}% | {t['frozen_first']:.2f} -> {t['frozen_last']:.2f} | "
                       f"{100 * t['frozen_retained']:.1f}% | {t['gap_last']:+.2f} | {thirds} | {t['gap_max']:+.2f} | "
                       f"{t['steps_ahead']} of {len(arms[name])} |")
    out += _head("Every arm (the same keys for drafters and model-free peers; acceptance = vLLM's tokens per "
                 f"verification round; short / long = responses under / at least {result.get('long_tokens', 48)} tokens, "
                 "pooled per request over the run):",
                 "arm", "rollout speed-up", "per step", "end-to-end speed-up", "per step", "acceptance first -> last",
                 "short", "long", "update overhead")
    for name, a in S.get("arms", {}).items():
        out.append(f"| {name} | {a['rollout_speedup']:.2f}x | {_rng(a['per_step_rollout_speedup'])} | {a['e2e_speedup']:.2f}x | "
                   f"{_rng(a.get('per_step_e2e_speedup', {}))} | {a['acceptance_first']:.2f} -> "
                   f"{a['acceptance_last']:.2f} | {a['acceptance_short']:.2f} | {a['acceptance_long']:.2f} | "
                   f"{100 * a['update_overhead']:.1f}% |")
    out += _head(f"Median seconds per step and phase over steps {w + 1}-{result['steps']} (the update includes the "
                 "drafter's step; the push both pushes); reward: mean over all steps; KL to the initial policy at the last "
                 "step:", "arm", "step", "rollout", "update", "of which drafter", "weight push", "rollout tokens/s",
                 "reward", "kl/ref (last)")
    for name, ms in arms.items():
        timed = ms[w:] if len(ms) > w else ms
        med = {k: statistics.median(m.get(k, 0.0) for m in timed) for k in
               ("time/step", "time/rollout", "time/update", "time/draft", "time/weight_push", "rollout/tokens_per_s")}
        out.append(f"| {name} | {med['time/step']:.2f} | {med['time/rollout']:.2f} | {med['time/update']:.2f} | "
                   f"{med['time/draft']:.2f} | {med['time/weight_push']:.2f} | {med['rollout/tokens_per_s']:.0f} | "
                   f"{statistics.mean(m['reward/mean'] for m in ms):.3f} | {ms[-1].get('kl/ref', float('nan')):.4f} |")
    asy = S.get("async", {})
    if asy:
        out += _head(f"Synchronous vs asynchronous GRPO (grpo.max_staleness; correction "
                     f"{result.get('async_correction', 'none')}): step time over the steady steps (median [min, max]), "
                     "per-step speed-up sync / async, the whole run's, the hidden fraction h of the shorter phase "
                     "(paired per step: (sync step - async step) / min(sync rollout, sync update); 0 = no gain, 1 = the "
                     "shorter phase gone), each phase's slow-down beside the other, idle fractions of engines and "
                     "trainers, acceptance and reward (plain arms' seed band):",
                     "arm", "step s (sync)", "speed-up per step", "run", "hidden h", "rollout / update slow-down",
                     "engines idle (sync)",
                     "trainers idle (sync)", "acceptance (sync)", "reward (band)", "kl/ref last (sync)")
        for name, a in asy.items():
            band = "-" if not a["reward_band"] else f"{a['reward_band'][0]:.3f}-{a['reward_band'][1]:.3f}"
            acc = "-" if a["acceptance"] != a["acceptance"] else f"{a['acceptance']:.2f} ({a['sync_acceptance']:.2f})"
            out.append(f"| {name} | {_rng(a['step_s'])} ({a['sync_step_s']['median']:.2f}) | {_rng(a['per_step_speedup'])} | "
                       f"{a['run_speedup']:.2f}x | {_rng(a['hidden_fraction'])} | x{a['rollout_slowdown']['median']:.2f} / "
                       f"x{a['update_slowdown']['median']:.2f} | "
                       f"{a['engine_idle']['median']:.2f} ({a['sync_engine_idle']['median']:.2f}) | "
                       f"{a['trainer_idle']['median']:.2f} ({a['sync_trainer_idle']['median']:.2f}) | {acc} | "
                       f"{a['reward_mean']:.3f} ({band}) | {a['kl_ref_last']:.4f} ({a['sync_kl_ref_last']:.4f}) |")
    h2h = S.get("head_to_head", {})
    if h2h:
        out += _head("Co-trained drafter vs model-free peer on the same steps (peer rollout time / co-trained rollout "
                     "time: > 1 = the drafter is faster):", "pair", "early half", "late half", "range",
                     "acceptance early", "acceptance late", "short", "long")
        for name, h in h2h.items():
            def two(d):
                a, b = list(d.values())
                return f"{a:.2f} / {b:.2f}"
            out.append(f"| {name} | {h['rollout_ratio_early']:.2f} | {h['rollout_ratio_late']:.2f} | "
                       f"{h['rollout_ratio_range'][0]:.2f}-{h['rollout_ratio_range'][1]:.2f} | {two(h['acceptance_early'])} | "
                       f"{two(h['acceptance_late'])} | {two(h['acceptance_short'])} | {two(h['acceptance_long'])} |")
    return "\n".join(out)


def _async_png(out: Path) -> Path:
    return out.with_name(out.stem + "_async.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=("single_turn", "calc"), default="single_turn",
                    help="calc: the multi-turn calculator task (configs/calc.yaml, builtin:calc, DFlash, k = 3, "
                    "no peers, one plain seed, bench/results/multiturn_e2e.json), one set of arms per --tool-latency")
    ap.add_argument("--tool-latency", metavar="S[,S...]", help="--workload calc: env.tool_latency_s values (seconds "
                    "of artificial latency per tool call), e.g. 0,0.2; default 0")
    ap.add_argument("--config", default=None, help="default configs/bench_small.yaml (calc: configs/calc.yaml)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kinds", default=None, help="default dflash,eagle3 (calc: dflash)")
    ap.add_argument("--k", type=int, default=None, help="draft tokens per round (rollout.speculative."
                    "num_speculative_tokens); default 4 (calc: 3)")
    ap.add_argument("--peers", default="auto", help="model-free arms: auto (suffix if arctic-inference is "
                    "installed, else ngram), none, or a list of suffix,ngram")
    ap.add_argument("--long-tokens", type=int, default=48, help="responses this long or longer count as long "
                    "(acceptance by response length)")
    ap.add_argument("--schedule", help="a YAML written by python -m cotrain.rl.calibrate --write")
    ap.add_argument("--branches", default="teacher_forced", help="co-trained arms per family, one per "
                    "draft.branches value: teacher_forced, on_policy, or both")
    ap.add_argument("--compare-frozen", action="store_true", help="co-trained arms also score a frozen copy of "
                    "their initial drafter on their own chains every step (draft.compare_frozen: the same policy "
                    "trajectory; its forward is in the step's time)")
    ap.add_argument("--plain-seeds", type=int, choices=(1, 2), default=None, help="plain arms: 2 = seeds 0 and 1 "
                    "(the noise band of reward and KL), 1 = seed 0 only (one arm less in memory); default 2 (calc: 1)")
    ap.add_argument("--staleness", default="0", help="grpo.max_staleness values: 0 = the synchronous arms only; "
                    "e.g. 0,1 adds an asynchronous twin of plain and of every co-trained arm")
    ap.add_argument("--async-correction", default="tis", choices=("none", "tis", "mis"),
                    help="grpo.importance_correction of the asynchronous arms")
    ap.add_argument("--out", default=None, help="default bench/results/cotrain_e2e.json (calc: "
                    "bench/results/multiturn_e2e.json)")
    ap.add_argument("--quick", action="store_true", help="smoke test: configs/grpo.yaml (tiny), 2 steps, DFlash, small batch")
    ap.add_argument("--report", metavar="JSON", help="print the summary of an earlier run and redraw its PNG")
    ap.add_argument("--markdown", action="store_true", help="with --report: print docs/benchmarks.md's tables")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of every arm left out of the times "
                    "(one-time costs); with --report the summary is recomputed with it and written back")
    ap.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = ap.parse_args(argv)
    if args.report:
        result = json.loads(Path(args.report).read_text())
        result["warmup"] = args.warmup
        result["summary"] = summarize_result(result)
        Path(args.report).write_text(json.dumps(result, indent=1))
        write_outputs(result, Path(args.report))
        print(render(result, args.markdown))
        return 0
    calc = args.workload == "calc"
    if args.tool_latency is not None and not calc:
        raise SystemExit("--tool-latency: sets env.tool_latency_s, which acts only with --workload calc")
    args.latencies = parse_latencies(args.tool_latency or "0") if calc else None
    if calc:  # the multi-turn workload's defaults (each still set by its option)
        args.config = args.config or "configs/calc.yaml"
        args.kinds, args.k = args.kinds or "dflash", args.k or 3
        args.peers = "none" if args.peers == "auto" else args.peers
        args.plain_seeds = args.plain_seeds or 1
        args.out = args.out or "bench/results/multiturn_e2e.json"
    args.config, args.kinds = args.config or "configs/bench_small.yaml", args.kinds or "dflash,eagle3"
    args.k, args.plain_seeds = args.k or 4, args.plain_seeds or 2
    args.out = args.out or "bench/results/cotrain_e2e.json"
    if args.quick and calc:  # the calc policy, 2 steps, a small batch
        args.steps = 2
        args.overrides = ["grpo.prompts_per_step=4", "grpo.group_size=4", *args.overrides]
    elif args.quick:
        args.config, args.steps, args.kinds, args.k = "configs/grpo.yaml", 2, "dflash", 3
        args.peers = "ngram" if args.peers == "auto" else args.peers
        args.overrides = ["grpo.prompts_per_step=4", "grpo.group_size=4", "policy.micro_batch_size=16",
                          "draft.dflash.block_size=7", *args.overrides]
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    write_outputs(result, out)
    print(render(result, False))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def parse_latencies(spec: str) -> list[float]:
    """``--tool-latency``: env.tool_latency_s values in seconds (a comma list, each >= 0)."""
    try:
        values = [float(v) for v in spec.split(",") if v != ""]
    except ValueError:
        raise SystemExit(f"--tool-latency: {spec!r} is not a list of seconds (e.g. 0,0.2)") from None
    if not values or min(values) < 0 or len(set(values)) != len(values):
        raise SystemExit(f"--tool-latency: {spec!r} (allowed: distinct seconds >= 0, e.g. 0,0.2)")
    return values


def write_outputs(result: dict, out: Path) -> None:
    """The PNGs beside the JSON ``out``."""
    if result.get("tool_latencies") is not None:
        from bench.multiturn_summary import plot_multiturn

        plot_multiturn(result, out.with_suffix(".png"))
        return
    plot(result, out.with_suffix(".png"))
    plot_async(result, _async_png(out))


def render(result: dict, as_markdown: bool) -> str:
    if result.get("tool_latencies") is not None:
        from bench.multiturn_summary import markdown_multiturn, report_multiturn

        return markdown_multiturn(result) if as_markdown else report_multiturn(result)
    return markdown(result) if as_markdown else report(result)


if __name__ == "__main__":
    sys.exit(main())
