"""Turn a run directory into PNG curves: ``python -m cotrain.rl.plot runs/demo [--out curves.png]``.

Panels (each drawn only when at least one of its metrics is in metrics.jsonl, so a plain GRPO run
has no drafter panels): reward (mean, and held-out accuracy); KL to the reference policy (linear);
train-inference KL on its own log axis (it is ~1e-9, invisible next to kl/ref); acceptance length
(vLLM's measured ``spec/acceptance_length``, the co-trained drafter's offline
``draft/acceptance_offline`` and, with ``draft.compare_frozen``, its frozen copy's
``draft/acceptance_offline_frozen`` on the same chains, dashed); the drafter's loss with its
``draft/kl`` = KL(policy || drafter) on the supervised positions (both in nats); and seconds per
step split into rollout / update / drafter / weight pushes. Each line's legend names what it is
and its metric key (:func:`label`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cotrain.rl.metrics import read_metrics

#: (title, metric keys, y scale)
PANELS = [
    ("reward", ["reward/mean", "eval/accuracy"], "linear"),
    ("KL to reference", ["kl/ref"], "linear"),
    ("train-inference KL", ["kl/train_infer"], "log"),
    ("acceptance length", ["spec/acceptance_length", "draft/acceptance_offline", "draft/acceptance_offline_frozen"],
     "linear"),
    ("drafter loss", ["draft/loss", "draft/kl"], "linear"),
    ("seconds per step", ["time/rollout", "time/update", "time/draft", "time/weight_push", "time/draft_push"], "linear"),
]

#: what a metric's line is, in its legend (before the key)
DESCRIPTIONS = {
    "spec/acceptance_length": "served, in vLLM",
    "draft/acceptance_offline": "co-trained, offline",
    "draft/acceptance_offline_frozen": "frozen copy, offline",
    "draft/loss": "drafter's loss",
    "draft/kl": "KL(policy || drafter)",
}

#: fixed line styles, so that the co-trained and the frozen drafter read alike in every run's PNG
STYLES = {
    "spec/acceptance_length": {"color": "tab:blue"},
    "draft/acceptance_offline": {"color": "tab:green"},
    "draft/acceptance_offline_frozen": {"color": "tab:red", "ls": "--"},
}


def label(key: str) -> str:
    """A line's legend label: ``"<description>: <key>"`` for the keys in :data:`DESCRIPTIONS`, else the key."""
    return f"{DESCRIPTIONS[key]}: {key}" if key in DESCRIPTIONS else key


def select_panels(rows: list[dict]) -> list[tuple[str, list[str], str]]:
    """The panels to draw for these metric rows: each with the keys present, panels with none dropped."""
    out = []
    for title, keys, scale in PANELS:
        present = [k for k in keys if any(k in r for r in rows)]
        if present:
            out.append((title, present, scale))
    return out


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


#: resolution of the PNG that :func:`plot_run` writes
DPI = 110


def run_figure(run_dir: str | Path):
    """The figure of ``<run_dir>/metrics.jsonl`` (what :func:`plot_run` saves)."""
    return make_figure(read_metrics(run_dir), f"cotrain run: {Path(run_dir).name}")


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``<run_dir>/metrics.jsonl`` to ``out`` (default ``<run_dir>/curves.png``)."""
    import matplotlib.pyplot as plt

    fig = run_figure(run_dir)
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def make_figure(rows: list[dict], title: str = ""):
    """The matplotlib figure of these metric rows, one axis per :func:`select_panels` panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = select_panels(rows)
    if not panels:
        raise ValueError("no plottable metrics (none of: " + ", ".join(k for _, ks, _ in PANELS for k in ks) + ")")
    cols = min(4, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (panel, keys, scale) in zip(axes.flat, panels):
        shown = {}  # the legend: one line per metric, its trend where drawn (the thick line)
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if k in r]
            if scale == "log":  # a log axis cannot show 0 (an exact match): leave such points out, say so
                zeros = sum(1 for p in pts if not p[1] > 0)
                pts = [p for p in pts if p[1] > 0]
                if zeros:
                    ax.text(0.02, 0.02, f"{k} = 0 at {zeros} step(s), not shown", transform=ax.transAxes, fontsize=7)
                if not pts:
                    continue
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            style = STYLES.get(k, {})
            line, = ax.plot(xs, ys, marker="o", ms=2, lw=0.8, alpha=0.5 if len(xs) > 10 else 1.0, label=label(k),
                            **style)
            shown[label(k)] = line
            if len(xs) > 10:  # per-step values are noisy (each step draws new prompts): add a trend
                shown[label(k)], = ax.plot(xs, moving_average(ys, 10), color=line.get_color(), lw=2,
                                           ls=style.get("ls", "-"), label=f"{label(k)} (10-step mean)")
        ax.set_title(panel)
        ax.set_xlabel("step")
        if scale == "log" and ax.has_data():
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if shown:
            ax.legend(list(shown.values()), list(shown), fontsize=7, framealpha=0.8)
    fig.suptitle(title)
    fig.text(0.5, 0.005, "thin lines: per step; thick: the trailing 10-step mean (for curves of more than 10 points)",
             ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return fig


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Plot a cotrain run's curves to PNG")
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None, help="PNG path (default: <run_dir>/curves.png)")
    args = ap.parse_args(argv)
    print(plot_run(args.run_dir, args.out))


if __name__ == "__main__":
    main()
