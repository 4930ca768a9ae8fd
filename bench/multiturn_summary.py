"""The multi-turn workload's summary (``python bench/cotrain_e2e.py --workload calc``): the Amdahl reading.

The arms (plain, frozen_<kind>, cotrained_<kind>) run once per tool latency L (``env.tool_latency_s``),
named ``<arm>_lat<L>s``, all interleaved step by step on the same seeds. Per latency and arm, over the
steps after the warm-up (``time/*`` of the run's metrics):

    T  step        time/step: rollout + update (the drafter's step included) + weight push
    R  rollout     time/rollout = G + E
    E  env         time/env: the environment's steps (tool execution and latency)
    G  generation  R - E: the engines' turns

    env share              sum E / sum T
    ratios vs plain        plain / arm, of R, G, E and T: over the sums, and per step as median [min, max]
    Amdahl                 the step ratio if only the generation changed, by s = sum G_p / sum G_a:
                           sum T_p / (sum T_p - sum G_p + sum G_p / s)
    what if (plain)        the same with the paper's multi-turn rollout speed-ups s = 1.75 and 2.23 applied
                           to plain's generation: the step ratio this workload's time split allows

and the acceptance per policy turn t (vLLM's ``spec/acceptance_length_turn<t>``; the co-trained
drafter's offline ``draft/acceptance_offline_turn<t>``), each the mean over the first / last ``tail``
steps of all steps, with the reward (mean of the first / last steps), ``reward/accuracy`` (right final
answers) and ``kl/ref`` at the last step.
"""

from __future__ import annotations

import statistics
from pathlib import Path

TURNS = (1, 2, 3, 4)
PAPER_ROLLOUT = (1.75, 2.23)  # the paper's multi-turn (agentic) rollout speed-ups


def _gen(m: dict) -> float:
    return m.get("time/rollout", 0.0) - m.get("time/env", 0.0)


def _values(ms: list[dict], key: str) -> list[float]:
    return [_gen(m) if key == "generation" else m.get(key, 0.0) for m in ms]


def _range(v: list[float]) -> dict:
    return {"median": statistics.median(v), "min": min(v), "max": max(v)} if v else {}


def _mean(v: list[float]) -> float:
    return statistics.mean(v) if v else float("nan")


def by_latency(arms: dict[str, list[dict]], latency: float) -> dict[str, list[dict]]:
    """The arms of one tool latency, named without their ``_lat<L>s`` suffix."""
    tag = f"_lat{latency:g}s"
    return {n[: -len(tag)]: ms for n, ms in arms.items() if n.endswith(tag)}


def summarize_latency(arms: dict[str, list[dict]], tail: int, warmup: int) -> dict:
    """One latency's arms (named without the suffix; ``plain`` among them): the module docstring's keys."""
    timed = {n: ms[warmup:] if len(ms) > warmup else ms for n, ms in arms.items()}
    keys = {"step": "time/step", "rollout": "time/rollout", "env": "time/env", "generation": "generation",
            "update": "time/update"}
    out = {}
    for name, ms in timed.items():
        tot = {k: sum(_values(ms, key)) for k, key in keys.items()}
        a = {f"{k}_s": _range(_values(ms, key)) for k, key in keys.items()}
        a["env_share"] = tot["env"] / tot["step"] if tot["step"] else float("nan")
        a["per_step_env_share"] = _range([m.get("time/env", 0.0) / m["time/step"] for m in ms if m.get("time/step")])
        if name == "plain":
            a["step_ratio_if_generation"] = {f"{x:g}": tot["step"] / (tot["step"] - tot["generation"] + tot["generation"] / x)
                                             for x in PAPER_ROLLOUT}
            a["generation_share"] = tot["generation"] / tot["step"] if tot["step"] else float("nan")
        else:
            p = timed["plain"]
            ptot = {k: sum(_values(p, key)) for k, key in keys.items()}
            for k, key in keys.items():
                a[f"{k}_ratio"] = ptot[k] / tot[k] if tot[k] else float("nan")
                a[f"per_step_{k}_ratio"] = _range([x / y for x, y in zip(_values(p, key), _values(ms, key)) if y])
            s = a["generation_ratio"]
            a["amdahl_step_ratio"] = ptot["step"] / (ptot["step"] - ptot["generation"] + ptot["generation"] / s)
        full = arms[name]
        for t in TURNS:
            for prefix, label in (("spec/acceptance_length_turn", "acceptance"),
                                  ("draft/acceptance_offline_turn", "offline_acceptance")):
                v = [m[f"{prefix}{t}"] for m in full if f"{prefix}{t}" in m]
                if v:
                    a.setdefault(f"{label}_first", {})[f"turn{t}"] = _mean(v[:tail])
                    a.setdefault(f"{label}_last", {})[f"turn{t}"] = _mean(v[-tail:])
        acc = [m["spec/acceptance_length"] for m in full if "spec/acceptance_length" in m]
        if acc:
            a["acceptance_all_first"], a["acceptance_all_last"] = _mean(acc[:tail]), _mean(acc[-tail:])
        rewards = [m["reward/mean"] for m in full]
        a["reward_first"], a["reward_last"] = _mean(rewards[:tail]), _mean(rewards[-tail:])
        a["accuracy_mean"] = _mean([m["reward/accuracy"] for m in full if "reward/accuracy" in m])
        a["kl_ref_last"] = full[-1].get("kl/ref", float("nan"))
        a["turns_mean"] = _mean([m["env/turns_mean"] for m in full if "env/turns_mean" in m])
        out[name] = a
    return out


def summarize_multiturn(arms: dict[str, list[dict]], kinds: list[str], latencies: list[float], tail: int,
                        warmup: int) -> dict:
    """``{"by_latency": {"<L>": {arm: ...}}, "amdahl": [...]}``: per latency every arm's keys, and one
    row per (latency, speculative arm) with the env share of plain, the rollout and step ratios and
    Amdahl's step ratio."""
    by = {f"{lat:g}": summarize_latency(by_latency(arms, lat), tail, warmup) for lat in latencies}
    rows = []
    for lat, s in by.items():
        for name, a in s.items():
            if name == "plain":
                continue
            rows.append({"tool_latency_s": float(lat), "arm": name, "plain_env_share": s["plain"]["env_share"],
                         "arm_env_share": a["env_share"], "rollout_ratio": a["rollout_ratio"],
                         "generation_ratio": a["generation_ratio"], "env_ratio": a["env_ratio"],
                         "step_ratio": a["step_ratio"], "per_step_rollout_ratio": a["per_step_rollout_ratio"],
                         "per_step_step_ratio": a["per_step_step_ratio"], "amdahl_step_ratio": a["amdahl_step_ratio"]})
    what_if = {lat: {"generation_share": s["plain"]["generation_share"], "env_share": s["plain"]["env_share"],
                     "step_ratio_if_generation": s["plain"]["step_ratio_if_generation"]} for lat, s in by.items()}
    return {"by_latency": by, "amdahl": rows, "what_if": what_if, "kinds": kinds,
            "note": "ratios = plain / arm (> 1: the arm is faster); generation = time/rollout - time/env; amdahl = "
                    "the step ratio if only the generation changed (bench/multiturn_summary.py)"}


def _r(d: dict) -> str:
    return f"{d['median']:.2f} [{d['min']:.2f}, {d['max']:.2f}]" if d else "-"


def _turns(d: dict | None) -> str:
    return " / ".join(f"{v:.2f}" for _, v in sorted(d.items())) if d else "-"


def markdown_multiturn(result: dict) -> str:
    """docs/benchmarks.md's multi-turn tables from one run's JSON (``--report JSON --markdown``)."""
    S, w = result["summary"], result.get("warmup", 1)
    out = [f"Time split per tool latency (steps {w + 1}-{result['steps']}; seconds per step as median; ratios = "
           "plain / arm, over the sums and per step as median [min, max]; generation = rollout - env; Amdahl = the "
           "step ratio if only the generation had changed):", "",
           "| tool latency | arm | step s | rollout s | env s | update s | env share of the step | rollout ratio | "
           "per step | generation ratio | step ratio | per step | Amdahl |", "|" + "---|" * 13]
    for lat, s in S["by_latency"].items():
        for name, a in s.items():
            ratios = ("| - | - | - | - | - | - |" if name == "plain" else
                      f"| {a['rollout_ratio']:.2f}x | {_r(a['per_step_rollout_ratio'])} | {a['generation_ratio']:.2f}x | "
                      f"{a['step_ratio']:.2f}x | {_r(a['per_step_step_ratio'])} | {a['amdahl_step_ratio']:.2f}x |")
            out.append(f"| {lat} s | {name} | {a['step_s']['median']:.2f} | {a['rollout_s']['median']:.2f} | "
                       f"{a['env_s']['median']:.2f} | {a['update_s']['median']:.2f} | {100 * a['env_share']:.1f}% " + ratios)
    out += ["", "What this time split allows: the plain arm's step with its generation sped up by the paper's multi-turn "
            "rollout speed-ups (1.75x and 2.23x), everything else as measured (Amdahl):", "",
            "| tool latency | generation share of the plain step | env share | step ratio at 1.75x | at 2.23x |",
            "|---|---|---|---|---|"]
    for lat, w_ in S.get("what_if", {}).items():
        r = w_["step_ratio_if_generation"]
        out.append(f"| {lat} s | {100 * w_['generation_share']:.1f}% | {100 * w_['env_share']:.1f}% | {r['1.75']:.2f}x | "
                   f"{r['2.23']:.2f}x |")
    out += ["", "Acceptance per policy turn (vLLM's tokens per verification round, turn 1 / turn 2 / ...; mean of the "
            "first -> last steps; offline: the co-trained drafter's own estimate on the batch's chains), reward (first "
            "-> last steps), right final answers (mean over steps) and KL to the initial policy at the last step:", "",
            "| tool latency | arm | acceptance per turn, first | last | offline per turn, first | last | reward | "
            "accuracy | kl/ref (last) |", "|" + "---|" * 9]
    for lat, s in S["by_latency"].items():
        for name, a in s.items():
            out.append(f"| {lat} s | {name} | {_turns(a.get('acceptance_first'))} | {_turns(a.get('acceptance_last'))} | "
                       f"{_turns(a.get('offline_acceptance_first'))} | {_turns(a.get('offline_acceptance_last'))} | "
                       f"{a['reward_first']:.3f} -> {a['reward_last']:.3f} | {a['accuracy_mean']:.3f} | "
                       f"{a['kl_ref_last']:.4f} |")
    return "\n".join(out)


def report_multiturn(result: dict) -> str:
    lines = [f"{result['config']} (multi-turn): {result['steps']} GRPO steps per arm, interleaved; k = {result['k']}; "
             f"tool latencies {result['tool_latencies']} s"]
    for row in result["summary"]["amdahl"]:
        lines.append(f"latency {row['tool_latency_s']:g}s {row['arm']}: env share (plain) "
                     f"{100 * row['plain_env_share']:.1f}%, rollout {row['rollout_ratio']:.2f}x "
                     f"(per step {_r(row['per_step_rollout_ratio'])}), generation {row['generation_ratio']:.2f}x, "
                     f"step {row['step_ratio']:.2f}x (per step {_r(row['per_step_step_ratio'])}), Amdahl "
                     f"{row['amdahl_step_ratio']:.2f}x")
    for lat, s in result["summary"]["by_latency"].items():
        for name, a in s.items():
            if "acceptance_first" in a:
                lines.append(f"latency {lat}s {name}: acceptance per turn {_turns(a['acceptance_first'])} -> "
                             f"{_turns(a['acceptance_last'])}")
    return "\n".join(lines)


def plot_multiturn(result: dict, png: Path) -> None:
    """Median seconds per phase of every arm and latency, acceptance per turn per step, reward per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms, w = result["arms"], result.get("warmup", 1)
    steps = range(1, result["steps"] + 1)
    fig, ax = plt.subplots(1, 3, figsize=(18, 4.6))
    names = list(arms)
    bottom = [0.0] * len(names)
    for j, (key, label) in enumerate((("generation", "generation (rollout - env)"), ("time/env", "env (tools)"),
                                      ("time/update", "update (with the drafter)"), ("time/weight_push", "weight push"))):
        vals = [statistics.median(_values(arms[n][w:] or arms[n], key)) for n in names]
        ax[0].bar(names, vals, bottom=bottom, label=label, color=f"C{j}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[0].set_title("median seconds per step")
    ax[0].tick_params(axis="x", rotation=35, labelsize=7)
    lat = f"_lat{result['tool_latencies'][0]:g}s"
    for i, name in enumerate(n for n in names if n.endswith(lat) and not n.startswith("plain")):
        for t, ls in zip(TURNS, ("-", "--", ":", "-.")):
            v = [m.get(f"spec/acceptance_length_turn{t}", float("nan")) for m in arms[name]]
            if any(x == x for x in v):
                ax[1].plot(steps, v, ls, color=f"C{i}", label=f"{name} turn {t}")
    ax[1].set_title("vLLM acceptance length per policy turn")
    for j, name in enumerate(names):
        ax[2].plot(steps, [m["reward/mean"] for m in arms[name]], lw=1, color=f"C{j}", label=name)
    ax[2].set_title("reward")
    for a in ax:
        a.legend(fontsize=7)
    ax[1].set_xlabel("step")
    ax[2].set_xlabel("step")
    fig.suptitle(f"multi-turn cotrain end to end: {result['config']} ({result['steps']} steps, arms interleaved)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
