"""A run's metrics per third of the run: ``python -m cotrain.rl.thirds runs/demo``.

The training steps (the rows of metrics.jsonl with ``time/update``; step 0's evaluation-only row is
not one) are split into three consecutive parts of sizes as equal as possible, the first
``n mod 3`` parts one step longer (numpy.array_split's rule). A part covers its steps, from its
first to its last (``steps 1-20``), and each metric is the mean over the rows in that range that
logged it, NaN values left out ("-" where none did); the first part also takes the rows before the
first training step, so held-out ``eval/accuracy`` logged at steps 0, 10, ..., 60 of a 60-step run
is averaged over steps {0, 10, 20}, {30, 40} and {50, 60}. Two rows are derived, per part:

- ``co-trained - frozen``: the mean over steps logging both of ``draft/acceptance_offline`` -
  ``draft/acceptance_offline_frozen`` (``draft.compare_frozen``: the two drafters on the same chains);
- ``drafter share of the update``: sum of ``time/draft`` / sum of ``time/update`` over the part's
  training steps (the drafter's seconds are inside the update's), i.e. weighted by seconds, not a
  mean of per-step ratios; a step without ``time/draft`` (a drafter budget that stayed idle) counts 0.

Printed as a Markdown table, the numbers the README and docs/cotrain.md quote for the demo.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from cotrain.rl.metrics import read_metrics

#: the metrics of the table, in its order (those no row logged are left out)
KEYS = ["reward/mean", "eval/accuracy", "kl/ref", "response/length", "spec/acceptance_length",
        "draft/acceptance_offline", "draft/acceptance_offline_frozen", "draft/kl", "draft/loss",
        "time/update", "time/draft", "draft/updates", "train/skipped"]
GAP, SHARE = "co-trained - frozen", "drafter share of the update"


def parts(steps: list[int], n: int = 3) -> list[tuple[int, int]]:
    """``n`` consecutive (first, last) step ranges over the sorted training ``steps``, sizes as equal
    as possible, the longer ones first."""
    if len(steps) < n:
        raise ValueError(f"metrics.jsonl has {len(steps)} training step(s); a table of {n} parts needs at least {n}")
    size, extra = divmod(len(steps), n)
    out, i = [], 0
    for j in range(n):
        first = steps[i]
        i += size + (j < extra)
        out.append((first, steps[i - 1]))
    return out


def _mean(values: list[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else float("nan")


def table(rows: list[dict], n: int = 3) -> tuple[list[tuple[int, int]], dict[str, list[float]]]:
    """The step ranges and ``{metric: [mean per part]}`` (see the module docstring), metrics in
    :data:`KEYS` order with the derived rows after the acceptance and time rows they come from."""
    steps = sorted(r["step"] for r in rows if "time/update" in r)
    ranges = parts(steps, n)
    groups = [[r for r in rows if (lo <= r["step"] or j == 0) and r["step"] <= hi] for j, (lo, hi) in enumerate(ranges)]
    out: dict[str, list[float]] = {}
    for k in KEYS:
        if any(k in r for r in rows):
            out[k] = [_mean([float(r[k]) for r in g if k in r]) for g in groups]
        if k == "draft/acceptance_offline_frozen" and k in out:
            out[GAP] = [_mean([r["draft/acceptance_offline"] - r[k] for r in g if k in r and "draft/acceptance_offline" in r])
                        for g in groups]
        if k == "time/draft" and k in out:
            train = [[r for r in g if "time/update" in r] for g in groups]
            out[SHARE] = [sum(r.get(k, 0.0) for r in t) / sum(r["time/update"] for r in t) for t in train]
    return ranges, out


def markdown(ranges: list[tuple[int, int]], values: dict[str, list[float]]) -> str:
    """The table as Markdown, three decimals."""
    head = "| metric | " + " | ".join(f"steps {lo}-{hi}" for lo, hi in ranges) + " |"
    lines = [head, "|---" * (len(ranges) + 1) + "|"]
    for k, vs in values.items():
        lines.append(f"| {k} | " + " | ".join("-" if math.isnan(v) else f"{v:.3f}" for v in vs) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="A cotrain run's metrics averaged per third of the run (Markdown)")
    ap.add_argument("run_dir")
    ap.add_argument("--parts", type=int, default=3, help="how many consecutive parts (default 3)")
    args = ap.parse_args(argv)
    print(markdown(*table(read_metrics(Path(args.run_dir)), args.parts)))


if __name__ == "__main__":
    main()
