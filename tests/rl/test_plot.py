"""The curves: which panels a run gets, and the train-inference KL on its own log axis."""

import json

import pytest

from cotrain.rl.plot import make_figure, plot_run, select_panels


def _grpo_rows(n=12):
    return [{"step": s, "reward/mean": 0.4 + s / 100, "eval/accuracy": 0.5, "kl/ref": 0.01 * s,
             "kl/train_infer": 0.0 if s == 1 else 1e-9 * s, "time/rollout": 0.2, "time/update": 0.6,
             "time/weight_push": 0.05} for s in range(1, n + 1)]


def _cotrain_rows(n=12):
    return [{**r, "spec/acceptance_length": 2.0 + r["step"] / 100, "draft/acceptance_offline": 2.1,
             "draft/loss": 3.0 - r["step"] / 10, "time/draft": 0.1} for r in _grpo_rows(n)]


def _axes(fig):
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def _labels(ax):
    return {line.get_label() for line in ax.get_lines() if not line.get_label().endswith("(10-step mean)")}


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
    assert _labels(axes["drafter loss"]) == {"draft/loss"}
    assert _labels(axes["seconds per step"]) == {"time/rollout", "time/update", "time/draft", "time/weight_push"}
    # offline-only acceptance (a drafter trained but not served, e.g. dspark on CPU): the panel stays
    rows = [{k: v for k, v in r.items() if k != "spec/acceptance_length"} for r in _cotrain_rows()]
    assert _labels(_axes(make_figure(rows))["acceptance length"]) == {"draft/acceptance_offline"}


def test_plot_run_writes_a_png_even_after_a_line_cut_mid_write(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _cotrain_rows()) + '{"step": 13, "rew')
    with pytest.warns(UserWarning, match="metrics.jsonl:13"):
        out = plot_run(tmp_path)
    assert out == tmp_path / "curves.png" and out.read_bytes()[:4] == b"\x89PNG"


def test_figure_title_is_the_runs():
    assert make_figure(_grpo_rows(), "cotrain run: demo")._suptitle.get_text() == "cotrain run: demo"
