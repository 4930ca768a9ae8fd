"""The curves: which panels a run gets, that every line is the run's logged metric (and its trend
the trailing mean) under a legend naming what it is, the co-trained drafter beside its frozen copy,
the train-inference KL on its own log axis, and that the PNG is that figure."""

import json
import struct

import pytest

from cotrain.rl.plot import DPI, label, make_figure, plot_run, run_figure, select_panels


def _grpo_rows(n=12):
    return [{"step": s, "reward/mean": 0.4 + s / 100, "eval/accuracy": 0.5, "kl/ref": 0.01 * s,
             "kl/train_infer": 0.0 if s == 1 else 1e-9 * s, "time/rollout": 0.2, "time/update": 0.6,
             "time/weight_push": 0.05} for s in range(1, n + 1)]


def _cotrain_rows(n=12, frozen=False):
    return [{**r, "spec/acceptance_length": 2.0 + r["step"] / 100, "draft/acceptance_offline": 2.1,
             "draft/loss": 3.0 - r["step"] / 10, "draft/kl": 0.5 - r["step"] / 100, "time/draft": 0.1,
             **({"draft/acceptance_offline_frozen": 2.1 - r["step"] / 50} if frozen else {})} for r in _grpo_rows(n)]


def _axes(fig):
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def _labels(ax):
    """The metric keys of an axis's per-step lines (each legend label ends with its key)."""
    return {line.get_label().rsplit(": ", 1)[-1] for line in ax.get_lines()
            if not line.get_label().endswith("(10-step mean)")}


def test_plain_grpo_run_has_no_drafter_panels_and_a_log_axis_for_train_inference_kl():
    rows = _grpo_rows()
    assert [t for t, _, _ in select_panels(rows)] == ["reward", "KL to reference", "train-inference KL",
                                                      "seconds per step"]
    axes = _axes(make_figure(rows))
    assert set(axes) == {"reward", "KL to reference", "train-inference KL", "seconds per step"}
    ti, ref = axes["train-inference KL"], axes["KL to reference"]
    assert ti.get_yscale() == "log" and ref.get_yscale() == "linear"
    assert _labels(ti) == {"kl/train_infer"} and _labels(ref) == {"kl/ref"}
    xs = ti.get_lines()[0].get_xdata()
    assert list(xs) == list(range(2, 13))  # step 1's exact 0 cannot sit on a log axis: left out (and noted)
    assert any("not shown" in t.get_text() for t in ti.texts)
    assert _labels(axes["seconds per step"]) == {"time/rollout", "time/update", "time/weight_push"}


def test_cotraining_run_gets_acceptance_drafter_loss_and_draft_time_panels():
    axes = _axes(make_figure(_cotrain_rows()))
    assert _labels(axes["acceptance length"]) == {"spec/acceptance_length", "draft/acceptance_offline"}
    assert _labels(axes["drafter loss"]) == {"draft/loss", "draft/kl"}
    assert _labels(axes["seconds per step"]) == {"time/rollout", "time/update", "time/draft", "time/weight_push"}
    # offline-only acceptance (a drafter trained but not served, e.g. dspark on CPU): the panel stays
    rows = [{k: v for k, v in r.items() if k != "spec/acceptance_length"} for r in _cotrain_rows()]
    assert _labels(_axes(make_figure(rows))["acceptance length"]) == {"draft/acceptance_offline"}


def _trailing_mean(ys, w=10):
    return [sum(ys[max(0, i - w + 1):i + 1]) / len(ys[max(0, i - w + 1):i + 1]) for i in range(len(ys))]


def _lines(ax):
    """{label: (xs, ys)} of an axis's lines."""
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}


def _uneven_rows():
    """Metrics that differ per step, logged on some steps only (eval every 3rd step, the drafter's
    loss from step 4: a drafter that skipped its first steps), 14 steps (> 10: trends drawn)."""
    rows = []
    for s in range(1, 15):
        r = {"step": s, "reward/mean": 0.3 + 0.05 * ((s * 7) % 5), "kl/ref": 0.002 * s * s,
             "kl/train_infer": 1e-9 * (1 + (s % 4)), "time/rollout": 1.0 + 0.1 * (s % 3), "time/update": 2.0 + s / 50,
             "spec/acceptance_length": 1.5 + 0.1 * (s % 6)}
        if s % 3 == 0:
            r["eval/accuracy"] = 0.2 + s / 100
        if s >= 4:
            r["draft/loss"] = 5.0 / s
        rows.append(r)
    return rows


def test_every_line_is_the_logged_metric_and_its_trend_the_trailing_mean():
    rows = _uneven_rows()
    axes = _axes(make_figure(rows))
    assert set(axes) == {"reward", "KL to reference", "train-inference KL", "acceptance length", "drafter loss",
                         "seconds per step"}
    for title, keys, scale in select_panels(rows):
        ax = axes[title]
        assert ax.get_xlabel() == "step" and ax.get_yscale() == scale
        lines = _lines(ax)
        for k in keys:
            xs = [r["step"] for r in rows if k in r]
            ys = [r[k] for r in rows if k in r]
            assert lines[label(k)] == (xs, ys), k  # the logged values at their own steps, none invented, none lost
            if len(xs) > 10:
                tx, ty = lines[f"{label(k)} (10-step mean)"]
                assert tx == xs and ty == pytest.approx(_trailing_mean(ys)), k
            else:  # eval/accuracy: 4 points, no trend (the drafter's loss, 11 points from step 4, has one)
                assert f"{label(k)} (10-step mean)" not in lines, k
        # the legend names each metric drawn once, in the panel's order (its thick trend line, where drawn)
        legend = ax.get_legend()
        assert [t.get_text() for t in legend.get_texts()] == [label(k) for k in keys]
        trends = [len([r for r in rows if k in r]) > 10 for k in keys]
        assert [h.get_linewidth() for h in legend.legend_handles] == [2 if t else 0.8 for t in trends]
    assert axes["train-inference KL"].get_yscale() == "log" and axes["KL to reference"].get_yscale() == "linear"


def test_compare_frozen_draws_the_frozen_copy_dashed_beside_the_co_trained_drafter_each_named():
    rows = _cotrain_rows(14, frozen=True)
    ax = _axes(make_figure(rows))["acceptance length"]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    co = lines["co-trained, offline: draft/acceptance_offline"]
    fr = lines["frozen copy, offline: draft/acceptance_offline_frozen"]
    served = lines["served, in vLLM: spec/acceptance_length"]
    assert list(fr.get_ydata()) == [r["draft/acceptance_offline_frozen"] for r in rows]
    assert list(co.get_ydata()) == [r["draft/acceptance_offline"] for r in rows]
    assert list(served.get_ydata()) == [r["spec/acceptance_length"] for r in rows]
    trend = lines["frozen copy, offline: draft/acceptance_offline_frozen (10-step mean)"]
    assert fr.get_linestyle() == trend.get_linestyle() == "--" and co.get_linestyle() == "-"
    assert len({co.get_color(), fr.get_color(), served.get_color()}) == 3 and trend.get_color() == fr.get_color()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "served, in vLLM: spec/acceptance_length", "co-trained, offline: draft/acceptance_offline",
        "frozen copy, offline: draft/acceptance_offline_frozen"]
    # the drafter's KL to the policy shares the loss panel (both nats), named
    loss = {ln.get_label(): list(ln.get_ydata()) for ln in _axes(make_figure(rows))["drafter loss"].get_lines()}
    assert loss["KL(policy || drafter): draft/kl"] == [r["draft/kl"] for r in rows]
    assert loss["drafter's loss: draft/loss"] == [r["draft/loss"] for r in rows]


def test_plot_run_draws_metrics_jsonl_even_after_a_line_cut_mid_write(tmp_path):
    rows = _uneven_rows()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 15, "rew')
    with pytest.warns(UserWarning, match="metrics.jsonl:15"):
        fig = run_figure(tmp_path)
    assert fig._suptitle.get_text() == f"cotrain run: {tmp_path.name}"
    reward = _lines(_axes(fig)["reward"])  # the complete rows, the cut one left out
    assert reward["reward/mean"] == ([r["step"] for r in rows], [r["reward/mean"] for r in rows])
    with pytest.warns(UserWarning, match="metrics.jsonl:15"):
        out = plot_run(tmp_path)
    assert out == tmp_path / "curves.png"
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    w, h = struct.unpack(">II", png[16:24])  # the PNG is that figure at plot_run's resolution
    fw, fh = fig.get_size_inches()
    assert (w, h) == (round(fw * DPI), round(fh * DPI))


def test_figure_title_is_the_runs():
    assert make_figure(_grpo_rows(), "cotrain run: demo")._suptitle.get_text() == "cotrain run: demo"
