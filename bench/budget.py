"""What the drafter budget (``draft.budget``) saves and what it keeps: fixed against adaptive, with and without drift.

For each workload (``--workloads``: ``stationary`` = the config with a policy learning rate too small
to move it, ``drift`` = the config as it is, or with ``--drift`` overrides), two GRPO runs of the
same config, seeds and prompts, alive in one process and **interleaved step by step** (step t of
both before step t + 1 of either, the order alternating):

    fixed     draft.budget.mode = fixed     one drafter optimizer step per GRPO step
    adaptive  draft.budget.mode = adaptive  as many as the measured acceptance asks (cotrain.draft.budget)

both with ``draft.compare_frozen`` (their frozen copy scored on their own chains). Reported per arm
(JSON ``--out``, PNG beside, ``--report`` prints the tables):

    draft_share        sum of time/draft / sum of time/update over the steps after --warmup (the
                       drafter's seconds, replayed steps included, over the update they are part of)
    draft_steps        drafter optimizer steps taken (sum of draft/updates)
    thirds             per third of the run: vLLM acceptance, the co-trained drafter's offline
                       acceptance and its frozen copy's (cotrain.rl.thirds), drafter share

The decision reads only measured data, so both arms are deterministic on CPU; the seconds are this
machine's (medians and ranges per step in the JSON).

    python bench/budget.py                                   # configs/demo.yaml, 18 steps, both workloads
    python bench/budget.py --report bench/results/budget.json
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

ARMS = {"fixed": ["draft.budget.mode=fixed"], "adaptive": ["draft.budget.mode=adaptive"]}
KEEP = ("time/step", "time/update", "time/draft", "time/rollout", "spec/acceptance_length", "draft/acceptance_offline",
        "draft/acceptance_offline_frozen", "draft/updates", "draft/kl", "draft/loss", "kl/ref", "reward/mean",
        "draft/budget_behind", "draft/budget_signal", "train/skipped")


def run_workload(args, name: str, extra: list[str]) -> dict[str, list[dict]]:
    import ray

    from cotrain.config import load_config
    from cotrain.rl.driver import GrpoRun

    common = [f"grpo.num_steps={args.steps}", "data.eval.every=0", "logging.progress_bar=false",
              "logging.tensorboard=false", "checkpoint.every=100000", "checkpoint.export_final=false",
              "run.overwrite=true", "draft.compare_frozen=true", *extra, *args.overrides]
    out_root = Path(args.out).with_suffix("") / name
    runs: dict[str, GrpoRun] = {}
    metrics: dict[str, list[dict]] = {a: [] for a in ARMS}
    try:
        for arm, ov in ARMS.items():
            cfg = load_config(args.config, common + ov + [f"run.output_dir={out_root / arm}", f"run.name={arm}"])
            print(f"[{name}] setup {arm}", flush=True)
            runs[arm] = GrpoRun(cfg)
            runs[arm].setup(resume=False)
        from tqdm import tqdm

        for step in tqdm(range(1, args.steps + 1), desc=name, dynamic_ncols=True):
            order = list(ARMS) if step % 2 else list(ARMS)[::-1]
            for arm in order:
                t0 = time.perf_counter()
                m = runs[arm].step(step)
                m["time/step"] = time.perf_counter() - t0
                runs[arm].logger.log(step, m)
                metrics[arm].append({"step": step, **{k: v for k, v in m.items() if k in KEEP}})
    finally:
        for r in runs.values():
            r.shutdown()
        ray.shutdown()
    return metrics


def summarize(rows: list[dict], warmup: int) -> dict:
    from cotrain.rl.thirds import table

    after = [r for r in rows if r["step"] > warmup]
    upd = sum(r["time/update"] for r in after)
    draft = sum(r.get("time/draft", 0.0) for r in after)
    per_step = [r.get("time/draft", 0.0) / r["time/update"] for r in after]
    # an idle step (draft/updates = 0) has no drafter seconds: 0 of its update, not a step left out
    ranges, parts = table([{**r, "time/draft": r.get("time/draft", 0.0)} for r in rows])
    return {"draft_share": draft / upd, "draft_share_per_step": {"median": statistics.median(per_step),
                                                                   "min": min(per_step), "max": max(per_step)},
            "draft_steps": sum(r.get("draft/updates", 1.0) for r in rows),
            "step_s_median": statistics.median(r["time/step"] for r in after),
            "thirds": {"ranges": ranges, **{k: parts[k] for k in parts}}}


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, axes = plt.subplots(2, len(names), figsize=(6 * len(names), 7), squeeze=False)
    for j, w in enumerate(names):
        arms = result["workloads"][w]["arms"]
        ax = axes[0][j]
        for arm, style in (("fixed", "-"), ("adaptive", "--")):
            rows = arms[arm]
            steps = [r["step"] for r in rows]
            ax.plot(steps, [r.get("spec/acceptance_length", float("nan")) for r in rows], style, label=f"{arm}: vLLM")
            ax.plot(steps, [r.get("draft/acceptance_offline", float("nan")) for r in rows], style, marker=".",
                    label=f"{arm}: offline co-trained")
            ax.plot(steps, [r.get("draft/acceptance_offline_frozen", float("nan")) for r in rows], style, marker="x",
                    label=f"{arm}: offline frozen copy")
        ax.set_title(f"{w}: acceptance length")
        ax.set_xlabel("GRPO step")
        ax.legend(fontsize=7)
        ax = axes[1][j]
        for arm in ("fixed", "adaptive"):
            rows = arms[arm]
            ax.bar([r["step"] + (0.2 if arm == "adaptive" else -0.2) for r in rows],
                   [r.get("time/draft", 0.0) for r in rows], width=0.4, label=f"{arm}: drafter s")
        ax.plot([r["step"] for r in arms["fixed"]], [r["time/update"] for r in arms["fixed"]], "k-", lw=0.8,
                label="fixed: update s")
        ax.set_title(f"{w}: drafter seconds per step")
        ax.set_xlabel("GRPO step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def report(result: dict) -> str:
    out = [f"config {result['config']}, {result['steps']} steps, warm-up {result['warmup']}", ""]
    for w, res in result["workloads"].items():
        out += [f"### {w} ({' '.join(res['overrides']) or 'the config as it is'})", "",
                "| arm | drafter share of the update | per step: median [min, max] | drafter steps | step s (median) |",
                "|---|---|---|---|---|"]
        for arm, s in res["summary"].items():
            ps = s["draft_share_per_step"]
            out.append(f"| {arm} | {s['draft_share']:.1%} | {ps['median']:.1%} [{ps['min']:.1%}, {ps['max']:.1%}] | "
                       f"{s['draft_steps']:.0f} | {s['step_s_median']:.2f} |")
        out += ["", "| arm | third | vLLM acceptance | offline co-trained | offline frozen copy | co-trained - frozen |",
                "|---|---|---|---|---|---|"]
        for arm, s in res["summary"].items():
            t = s["thirds"]
            for i, (lo, hi) in enumerate(t["ranges"]):
                def g(k):
                    v = t.get(k, [float("nan")] * 3)[i]
                    return "-" if v != v else f"{v:.3f}"
                out.append(f"| {arm} | steps {lo}-{hi} | {g('spec/acceptance_length')} | "
                           f"{g('draft/acceptance_offline')} | {g('draft/acceptance_offline_frozen')} | "
                           f"{g('co-trained - frozen')} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--steps", type=int, default=18)
    ap.add_argument("--warmup", type=int, default=1, help="steps left out of the time shares (start-up)")
    ap.add_argument("--workloads", default="stationary,drift")
    ap.add_argument("--stationary", default="policy.optimizer.lr=1e-9",
                    help="overrides of the stationary workload (space separated)")
    ap.add_argument("--drift", default="", help="overrides of the drift workload (space separated)")
    ap.add_argument("--out", default="bench/results/budget.json")
    ap.add_argument("--report", metavar="JSON", help="print the tables of a result and exit")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = ap.parse_args(argv)
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return 0
    spec = {"stationary": args.stationary.split(), "drift": args.drift.split()}
    result = {"config": args.config, "steps": args.steps, "warmup": args.warmup, "overrides": args.overrides,
              "workloads": {}}
    for w in args.workloads.split(","):
        if w not in spec:
            raise SystemExit(f"--workloads: {w!r} (allowed: stationary, drift)")
        arms = run_workload(args, w, spec[w])
        result["workloads"][w] = {"overrides": spec[w], "arms": arms,
                                  "summary": {a: summarize(rows, args.warmup) for a, rows in arms.items()}}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    plot(result, Path(args.out).with_suffix(".png"))
    print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
