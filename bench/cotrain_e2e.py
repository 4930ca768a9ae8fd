"""The headline, measured: GRPO with no speculation, a frozen drafter, and a co-trained drafter, side by side.

Arms (every arm a complete GRPO run of the same config, seeds and prompts; all alive in one process):

    plain            no speculative decoding                                      (the paper's baseline)
    plain_seed1      the same with run.seed = 1                                   (run-to-run noise band)
    frozen_<kind>    the offline-distilled drafter served frozen (draft.cotrain = false)
    cotrained_<kind> the same drafter as the starting point, co-trained online (draft.cotrain = true)

for each drafter family asked for (``--kinds dflash,eagle3``). Arms are **interleaved step by step**:
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
and per step every arm's phases, reward, KL to the initial policy and train-inference KL; per-step
ratios come with their median and [min, max]. PNGs beside the JSON: acceptance per step (frozen vs
co-trained), reward and KL per step (every arm, the two plain seeds as the noise band), and the median
seconds per phase of every arm.

    python bench/cotrain_e2e.py                          # configs/bench_small.yaml, DFlash + EAGLE-3
    python bench/cotrain_e2e.py --steps 10 --kinds dflash
    python bench/cotrain_e2e.py --schedule runs/schedule.yaml   # speculation by batch size (calibrate)
    python bench/cotrain_e2e.py --quick                  # smoke test: the tiny model, 2 steps, DFlash
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
EAGLE3 = ["draft.eagle3.tap_layers=null", "draft.eagle3.ttt_steps=4"]  # as distilled (default taps)


def arm_overrides(base: str, kind: str | None, mode: str, k: int, schedule: str | None) -> list[str]:
    """Overrides turning the base config into one arm."""
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
        ov += ["draft.cotrain=true", f"draft.init=distill:{distill}"]
    if schedule:
        import yaml

        sched = yaml.safe_load(Path(schedule).read_text())["rollout"]["speculative"]["batch_size_schedule"]
        ov.append("rollout.speculative.batch_size_schedule=" + json.dumps(sched).replace(" ", ""))
    return ov


def summarize(arms: dict[str, list[dict]], kinds: list[str], tail: int) -> dict:
    def tot(arm: str, key: str) -> float:
        return sum(m.get(key, 0.0) for m in arms[arm])

    def ratios(a: str, b: str, key: str) -> dict:
        r = [x[key] / y[key] for x, y in zip(arms[a], arms[b]) if y.get(key)]
        return {"median": statistics.median(r), "min": min(r), "max": max(r)} if r else {}

    def acc(arm: str, part: slice) -> float:
        v = [m["spec/acceptance_length"] for m in arms[arm][part] if "spec/acceptance_length" in m]
        return statistics.mean(v) if v else float("nan")

    out = {}
    for kind in kinds:
        f, c = f"frozen_{kind}", f"cotrained_{kind}"
        draft = tot(c, "time/draft")
        out[kind] = {
            "rollout_speedup": tot("plain", "time/rollout") / tot(c, "time/rollout"),
            "e2e_speedup": tot("plain", "time/step") / tot(c, "time/step"),
            "frozen_rollout_speedup": tot("plain", "time/rollout") / tot(f, "time/rollout"),
            "frozen_e2e_speedup": tot("plain", "time/step") / tot(f, "time/step"),
            "acceptance_first": {"frozen": acc(f, slice(0, tail)), "cotrained": acc(c, slice(0, tail))},
            "acceptance_last": {"frozen": acc(f, slice(-tail, None)), "cotrained": acc(c, slice(-tail, None))},
            "update_overhead": draft / (tot(c, "time/update") - draft),
            "tap_wait_fraction": tot(c, "tap/wait_s") / tot(c, "time/update"),
            "per_step_rollout_speedup": ratios("plain", c, "time/rollout"),
            "per_step_e2e_speedup": ratios("plain", c, "time/step"),
            "per_step_frozen_rollout_speedup": ratios("plain", f, "time/rollout"),
        }
    out["noise"] = {"reward_mean_seed0": statistics.mean(m["reward/mean"] for m in arms["plain"]),
                    "reward_mean_seed1": statistics.mean(m["reward/mean"] for m in arms["plain_seed1"])}
    return out


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms, kinds = result["arms"], result["kinds"]
    steps = range(1, result["steps"] + 1)
    fig, ax = plt.subplots(1, 4, figsize=(20, 4.2))
    for i, kind in enumerate(kinds):
        for mode, ls in (("frozen", "--"), ("cotrained", "-")):
            v = [m.get("spec/acceptance_length", float("nan")) for m in arms[f"{mode}_{kind}"]]
            ax[0].plot(steps, v, ls, color=f"C{i}", label=f"{kind} {mode}")
    ax[0].set_title("vLLM acceptance length")
    for key, a, title in (("reward/mean", ax[1], "reward"), ("kl/ref", ax[2], "KL to the initial policy")):
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
    for a in ax:
        a.legend(fontsize=7)
        if a is not ax[3]:
            a.set_xlabel("step")
    fig.suptitle(f"cotrain end to end: {result['config']} ({result['steps']} steps, arms interleaved)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def run(args) -> dict:
    import ray

    from cotrain.config import load_config
    from cotrain.rl.driver import GrpoRun

    base = Path(args.config).stem
    kinds = [k for k in args.kinds.split(",") if k]
    common = [f"grpo.num_steps={args.steps}", "data.eval.every=0", "logging.progress_bar=false",
              "logging.tensorboard=false", "checkpoint.every=100000", "cluster.cpus_per_node=64", *args.overrides]
    specs = {"plain": (None, "plain", 0), "plain_seed1": (None, "plain", 1)}
    for kind in kinds:
        specs[f"frozen_{kind}"] = (kind, "frozen", 0)
        specs[f"cotrained_{kind}"] = (kind, "cotrained", 0)
    out_root = Path(args.out).with_suffix("")
    runs: dict[str, GrpoRun] = {}
    metrics: dict[str, list[dict]] = {n: [] for n in specs}
    try:
        for name, (kind, mode, seed) in specs.items():
            ov = common + arm_overrides(base, kind, mode, args.k, args.schedule if kind else None)
            ov += [f"run.seed={seed}", f"run.output_dir={out_root / name}", f"run.name={name}"]
            cfg = load_config(args.config, ov)
            print(f"[setup] {name}", flush=True)
            runs[name] = GrpoRun(cfg)
            runs[name].setup(resume=False)
        names = list(specs)
        for step in range(1, args.steps + 1):
            order = names[step % len(names):] + names[: step % len(names)]
            for name in order:
                t0 = time.perf_counter()
                m = runs[name].step(step)
                m["time/step"] = time.perf_counter() - t0
                runs[name].logger.log(step, m)
                metrics[name].append(m)
            c = {n: metrics[n][-1] for n in names}
            print(f"[step {step}] " + "  ".join(
                f"{n}: {c[n]['time/step']:.1f}s" + (f" acc {c[n]['spec/acceptance_length']:.2f}"
                                                    if "spec/acceptance_length" in c[n] else "") for n in names),
                  flush=True)
    finally:
        for r in runs.values():
            r.shutdown()
        ray.shutdown()
    keep = ("time/step", *PHASES, "time/draft_push", "tap/wait_s", "rollout/tokens_per_s", "reward/mean", "kl/ref",
            "kl/train_infer", "spec/acceptance_length", "draft/acceptance_offline", "draft/loss", "response/length")
    arms = {n: [{k: v for k, v in m.items() if k in keep} for m in ms] for n, ms in metrics.items()}
    result = {"config": args.config, "steps": args.steps, "kinds": kinds, "k": args.k, "schedule": args.schedule,
              "overrides": args.overrides, "arms": arms}
    result["summary"] = summarize(arms, kinds, tail=max(1, min(3, args.steps // 3)))
    return result


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
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/bench_small.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kinds", default="dflash,eagle3")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per round (rollout.speculative.num_speculative_tokens)")
    ap.add_argument("--schedule", help="a YAML written by python -m cotrain.rl.calibrate --write")
    ap.add_argument("--out", default="bench/results/cotrain_e2e.json")
    ap.add_argument("--quick", action="store_true", help="smoke test: configs/grpo.yaml (tiny), 2 steps, DFlash, small batch")
    ap.add_argument("--report", metavar="JSON", help="print the summary of an earlier run and redraw its PNG")
    ap.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = ap.parse_args(argv)
    if args.report:
        result = json.loads(Path(args.report).read_text())
        plot(result, Path(args.report).with_suffix(".png"))
        print(report(result))
        return 0
    if args.quick:
        args.config, args.steps, args.kinds, args.k = "configs/grpo.yaml", 2, "dflash", 3
        args.overrides = ["grpo.prompts_per_step=4", "grpo.group_size=4", "policy.micro_batch_size=16",
                          "draft.dflash.block_size=7", *args.overrides]
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(report(result))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
