"""Calibrate speculation by batch size: where does a verification round pay for itself?

    python -m cotrain.rl.calibrate --config configs/bench_small.yaml [--batch-sizes 1,2,4,8,16,32,64]
        [--ks 1,2,4] [--max-tokens 48] [--rounds 3] [--write runs/schedule.yaml] [key=value ...]

Engines serve the config's policy on the task's prompts at its sampling temperature: one plain, and
one speculating with k draft tokens for every k of ``--ks`` (default 1..K, K =
``rollout.speculative.num_speculative_tokens``), all with the config's drafter (``draft.init`` when
co-training, else ``rollout.speculative.draft_model``). For every batch size b, ``b`` requests
generate exactly ``m = --max-tokens`` tokens each (end-of-sequence ignored, so the batch stays b),
the engines interleaved round by round in a rotating order. Measured, medians over rounds:

    c_0(b)  seconds per plain decode step            = plain time / m
    c_k(b)  seconds per verification round with k    = speculative time / engine steps
            (engine steps = the most rounds any request of the batch took)
    E_k(b)  tokens per round (vLLM's acceptance length: 1 + accepted drafts per round)

so that k draft tokens decode E_k / c_k tokens per second per sequence against 1 / c_0 plainly (the
per-position survival P(first j drafts accepted), from vLLM's acceptance histograms, is reported
too). Every measured b takes the k (0 = plain) with the most measured tokens/s; between two measured
batch sizes the boundary is their geometric mean and the last range runs to ``--max-batch``. The
result is vLLM's ``num_speculative_tokens_per_batch_size``, written as the YAML key
``rollout.speculative.batch_size_schedule`` (and printed as an override).

Nothing is modelled: every number in the decision is measured on the running engines. The
acceptance is the drafter's *current* one: re-run after the drafter has co-trained for a while and
pass the new schedule to ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional


@dataclass
class Point:
    batch: int
    plain_step_s: float
    plain_tokens_per_s: float
    per_k: dict  # k -> {"round_s", "acceptance_length", "tokens_per_s", "survival"}
    best_k: int = 0
    speedup: float = 1.0  # best measured tokens/s over plain
    rounds: list[dict] = field(default_factory=list)


def survival_from_histogram(hist: list[int]) -> list[float]:
    """s_j = P(at least j drafts accepted in a round), j = 1..len(hist)-1."""
    total = sum(hist)
    if not total:
        return [0.0] * max(0, len(hist) - 1)
    return [sum(hist[j:]) / total for j in range(1, len(hist))]


def add_histograms(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def best_k(plain_tokens_per_s: float, per_k: dict) -> tuple[int, float]:
    """(k, measured tokens/s over plain) of the fastest arm (k = 0: plain)."""
    best, rate = 0, plain_tokens_per_s
    for k, m in sorted(per_k.items()):
        if m["tokens_per_s"] > rate:
            best, rate = k, m["tokens_per_s"]
    return best, rate / plain_tokens_per_s


def schedule_from_points(points: list[Point], max_batch: int) -> list[list[int]]:
    """[[first, last, k], ...] from per-batch-size choices (boundaries at geometric means)."""
    pts = sorted(points, key=lambda p: p.batch)
    out: list[list[int]] = []
    first = 1
    for i, p in enumerate(pts):
        last = max_batch if i == len(pts) - 1 else max(p.batch, int((p.batch * pts[i + 1].batch) ** 0.5))
        if out and out[-1][2] == p.best_k:
            out[-1][1] = last
        else:
            out.append([first, last, p.best_k])
        first = last + 1
    return out


def _engine(cfg, model_path: str, drafter: Optional[str], k: int):
    """An engine actor: plain (k = 0) or speculating with k draft tokens."""
    import ray

    from cotrain.rl.rollout import EngineSpec, RolloutWorker, engine_spec_from_config

    spec = engine_spec_from_config(cfg, model_path=model_path, draft_model=drafter)
    speculative = None
    if k > 0:  # k drafts at every batch size (a configured schedule is what this measures for)
        speculative = {n: v for n, v in spec.speculative.items() if n != "num_speculative_tokens_per_batch_size"}
        speculative["num_speculative_tokens"] = int(k)
    spec = EngineSpec(**{**asdict(spec), "speculative": speculative})
    actor = ray.remote(RolloutWorker).options(num_cpus=cfg.rollout.cpus_per_engine).remote(spec)
    ray.get(actor.ready.remote())
    return actor


def _with_cpus_for(cfg, engines: int):
    """``cfg`` with a local Ray cluster large enough for ``engines`` engines at once: they are all alive
    for the whole calibration but generate one at a time (interleaved rounds), so their logical CPUs
    may exceed the machine's. A configured cluster (``cluster.ray_address``) is left as it is."""
    need = engines * cfg.rollout.cpus_per_engine
    if cfg.cluster.ray_address not in (None, "local") or (cfg.cluster.cpus_per_node or 0) >= need:
        return cfg
    return cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"cpus_per_node": need})})


def _check_cpus(cfg, engines: int) -> None:
    """Refuse (instead of waiting forever for an actor that cannot be placed) when the Ray cluster has
    fewer CPUs than the engines reserve."""
    import ray

    need = engines * cfg.rollout.cpus_per_engine
    have = ray.cluster_resources().get("CPU", 0)
    if have < need:
        raise ValueError(f"calibration starts {engines} engines (plain + one per k of --ks) of "
                         f"rollout.cpus_per_engine={cfg.rollout.cpus_per_engine} CPUs: {need} CPUs, the Ray cluster "
                         f"has {have:g} (measure fewer k with --ks, or lower rollout.cpus_per_engine)")


def calibrate(cfg, batch_sizes: list[int], ks: list[int], max_tokens: int, rounds: int, max_batch: int,
              progress: bool = True) -> dict:
    import ray
    from tqdm import tqdm

    from cotrain.models.build_tiny import resolve_model_path
    from cotrain.rl.driver import load_problems, resolve_draft_init
    from cotrain.rl.interfaces import SamplingSpec
    from cotrain.rl.ray_workers import init_ray

    spec_cfg = cfg.rollout.speculative
    if spec_cfg.method is None:
        raise ValueError("rollout.speculative.method is null: there is nothing to calibrate (allowed: a drafter "
                         "method such as dflash or eagle3, ngram, draft_model)")
    K = int(spec_cfg.num_speculative_tokens)
    ks = sorted(set(ks or range(1, K + 1)))
    if ks[0] < 1 or ks[-1] > K:
        raise ValueError(f"--ks {ks}: each k in 1..{K} (rollout.speculative.num_speculative_tokens)")
    model_path = str(resolve_model_path(cfg.policy.model_path))
    drafter = spec_cfg.draft_model
    if cfg.draft.kind is not None and cfg.draft.cotrain:
        drafter = resolve_draft_init(cfg)
        if drafter is None:
            raise ValueError("draft.init is null: a from-scratch drafter has no acceptance to calibrate on; "
                             "set draft.init (a drafter directory or distill:<yaml>)")
    init_ray(_with_cpus_for(cfg, len(ks) + 1))
    _check_cpus(cfg, len(ks) + 1)
    engines = {k: _engine(cfg, model_path, drafter, k) for k in [0, *ks]}
    train, _ = load_problems(cfg)
    s = cfg.rollout.sampling
    points = []
    try:
        bar = tqdm(total=len(batch_sizes) * rounds, desc="calibrate", disable=not progress, dynamic_ncols=True)
        for b in batch_sizes:
            prompts = [train[i % len(train)].prompt for i in range(b)]
            meas: dict[int, list[dict]] = {k: [] for k in engines}
            hist: dict[int, list[int]] = {k: [] for k in ks}
            arms = list(engines)
            for r in range(rounds):
                for k in arms[r % len(arms):] + arms[: r % len(arms)]:  # rotated order every round
                    sampling = SamplingSpec(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                            max_tokens=max_tokens, seed=1000 * r + b, ignore_eos=True)
                    t0 = time.perf_counter()
                    res = ray.get(engines[k].generate.remote(prompts, sampling, 1))
                    seconds = time.perf_counter() - t0
                    samples = [row[0] for row in res.samples]
                    m = {"k": k, "seconds": seconds, "tokens_per_s": b * max_tokens / seconds}
                    if k == 0:
                        m["step_s"] = seconds / max_tokens
                    else:
                        d = [x.spec_decode for x in samples]
                        total_rounds = sum(x["num_spec_steps"] for x in d)
                        m["round_s"] = seconds / max(1.0, max(x["num_spec_steps"] for x in d))
                        m["acceptance_length"] = 1 + sum(x["num_accepted_draft_tokens"] for x in d) / max(1.0, total_rounds)
                        for x in d:
                            hist[k] = add_histograms(hist[k], x.get("acceptance_histogram") or [])
                    meas[k].append(m)
                bar.update(1)
            med = lambda k, key: statistics.median(x[key] for x in meas[k])  # noqa: E731
            per_k = {k: {"round_s": med(k, "round_s"), "acceptance_length": med(k, "acceptance_length"),
                         "tokens_per_s": med(k, "tokens_per_s"), "survival": survival_from_histogram(hist[k])}
                     for k in ks}
            plain = med(0, "tokens_per_s")
            k_best, speedup = best_k(plain, per_k)
            points.append(Point(batch=b, plain_step_s=med(0, "step_s"), plain_tokens_per_s=plain, per_k=per_k,
                                best_k=k_best, speedup=speedup, rounds=[x for k in meas for x in meas[k]]))
        bar.close()
    finally:
        from cotrain.placement import stop_actors

        stop_actors(list(engines.values()))
    schedule = schedule_from_points(points, max_batch)
    return {"config": cfg.run.name, "method": spec_cfg.method, "num_speculative_tokens": K, "ks": ks,
            "max_tokens": max_tokens, "temperature": s.temperature, "rounds": rounds,
            "points": [asdict(p) for p in points], "schedule": schedule}


def format_report(result: dict) -> str:
    ks = result["ks"]
    lines = [f"{result['method']}, T = {result['temperature']}, {result['max_tokens']} tokens per request, medians "
             f"of {result['rounds']} interleaved rounds; per k: round/plain-step cost, tokens per round, tokens/s vs plain",
             "batch  plain ms/step  plain tok/s  " + "  ".join(f"k={k}: cost  tok/rnd  speed" for k in ks) + "  best k"]
    for p in result["points"]:
        cols = []
        for k in ks:
            m = p["per_k"][str(k)] if str(k) in p["per_k"] else p["per_k"][k]
            cols.append(f"{m['round_s'] / p['plain_step_s']:>9.2f} {m['acceptance_length']:>8.2f} "
                        f"{m['tokens_per_s'] / p['plain_tokens_per_s']:>5.2f}x")
        lines.append(f"{p['batch']:>5} {1e3 * p['plain_step_s']:>14.2f} {p['plain_tokens_per_s']:>12.0f}  "
                     + "  ".join(cols) + f"  {p['best_k']:>6}")
    sched = json.dumps(result["schedule"]).replace(" ", "")
    lines.append(f"schedule: rollout.speculative.batch_size_schedule={sched}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cotrain.rl.calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--ks", default="", help="draft-token counts to measure (default: 1..num_speculative_tokens)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=1024, help="end of the last range (vLLM's max_num_seqs)")
    ap.add_argument("--write", help="write the schedule as a YAML config fragment here (and the measurements "
                                    "as JSON beside it)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = ap.parse_args(argv)
    from cotrain.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        sizes = sorted({int(x) for x in args.batch_sizes.split(",")})
        ks = [int(x) for x in args.ks.split(",") if x]
        if not sizes or sizes[0] < 1:
            raise ValueError(f"--batch-sizes {args.batch_sizes!r}: positive integers, comma separated")
    except (ConfigError, ValueError) as e:
        print(f"calibrate: {e}", file=sys.stderr)
        return 2
    try:
        result = calibrate(cfg, sizes, ks, args.max_tokens, args.rounds, args.max_batch, progress=not args.no_progress)
    except ValueError as e:
        print(f"calibrate: {e}", file=sys.stderr)
        return 2
    finally:
        import ray

        ray.shutdown()
    print(format_report(result))
    if args.write:
        import yaml

        out = Path(args.write)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"# written by python -m cotrain.rl.calibrate --config {args.config}\n"
                       + yaml.safe_dump({"rollout": {"speculative": {"batch_size_schedule": result["schedule"]}}},
                                        default_flow_style=None))
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        print(f"wrote {out} (use it as a defaults: entry or copy the key) and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
