"""Turn a run directory into PNG curves: ``python -m cotrain.rl.plot runs/demo [--out curves.png]``.

Panels: reward (mean, and accuracy), KL (train-inference, to reference), acceptance length (when
speculative decoding was on), and step time split into rollout / update / weight push.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cotrain.rl.metrics import read_metrics

PANELS = [
    ("reward", ["reward/mean", "eval/accuracy"]),
    ("KL", ["kl/train_infer", "kl/ref"]),
    ("acceptance length", ["spec/acceptance_length", "draft/offline_acceptance_length"]),
    ("seconds per step", ["time/rollout", "time/update", "time/weight_push"]),
]


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    panels = [(title, [k for k in keys if any(k in r for r in rows)]) for title, keys in PANELS]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (title, keys) in zip(axes[0], panels):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if k in r]
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            line, = ax.plot(xs, ys, marker="o", ms=2, lw=0.8, alpha=0.5 if len(xs) > 10 else 1.0, label=k)
            if len(xs) > 10:  # per-step values are noisy (each step draws new prompts): add a trend
                ax.plot(xs, moving_average(ys, 10), color=line.get_color(), lw=2, label=f"{k} (10-step mean)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"cotrain run: {Path(run_dir).name}")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Plot a cotrain run's curves to PNG")
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None, help="PNG path (default: <run_dir>/curves.png)")
    args = ap.parse_args(argv)
    print(plot_run(args.run_dir, args.out))


if __name__ == "__main__":
    main()
