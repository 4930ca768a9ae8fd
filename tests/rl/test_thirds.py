"""cotrain.rl.thirds: the run's metrics per third, checked against sums written out by hand on a
10-step run (parts of 4, 3 and 3 steps) with step 0's evaluation row, NaNs, a metric logged on
some steps only and an idle drafter step without time/draft."""

import json
import math

import pytest

from cotrain.rl.thirds import GAP, SHARE, main, markdown, parts, table


def _rows():
    rows = [{"step": 0, "eval/accuracy": 0.1}]
    for s in range(1, 11):
        r = {"step": s, "reward/mean": s / 10, "time/update": float(s), "draft/acceptance_offline": 2.0 + s / 10,
             "draft/acceptance_offline_frozen": 2.0 - s / 10, "kl/ref": float("nan") if s == 2 else s / 100}
        if s != 9:  # step 9: the drafter idled (no drafter seconds logged)
            r["time/draft"] = 0.5
        if s % 5 == 0:
            r["eval/accuracy"] = s / 20
        rows.append(r)
    return rows


def test_parts_are_consecutive_as_equal_as_possible_longer_first():
    assert parts(list(range(1, 11))) == [(1, 4), (5, 7), (8, 10)]
    assert parts(list(range(1, 61))) == [(1, 20), (21, 40), (41, 60)]
    assert parts([3, 4, 7, 8, 9]) == [(3, 4), (7, 8), (9, 9)]  # steps as logged (a resumed run's gaps kept)
    assert parts(list(range(1, 8)), n=2) == [(1, 4), (5, 7)]
    with pytest.raises(ValueError, match="2 training step"):
        parts([1, 2])


def test_table_against_hand_sums():
    ranges, t = table(_rows())
    assert ranges == [(1, 4), (5, 7), (8, 10)]
    assert t["reward/mean"] == pytest.approx([(1 + 2 + 3 + 4) / 40, (5 + 6 + 7) / 30, (8 + 9 + 10) / 30])
    assert t["kl/ref"] == pytest.approx([(1 + 3 + 4) / 300, (5 + 6 + 7) / 300, (8 + 9 + 10) / 300])  # step 2's NaN out
    # step 0's evaluation goes with the first part; steps 5 and 10 to theirs; the third part has 10 only
    assert t["eval/accuracy"] == pytest.approx([0.1, 0.25, 0.5])
    assert t[GAP] == pytest.approx([2 * (1 + 2 + 3 + 4) / 40, 2 * (5 + 6 + 7) / 30, 2 * (8 + 9 + 10) / 30])
    # seconds-weighted, the idle step 9 counting 0 drafter seconds but all of its update
    assert t[SHARE] == pytest.approx([2.0 / 10, 1.5 / 18, 1.0 / 27])
    assert list(t) == ["reward/mean", "eval/accuracy", "kl/ref", "draft/acceptance_offline",
                       "draft/acceptance_offline_frozen", GAP, "time/update", "time/draft", SHARE]
    assert "draft/kl" not in t and "spec/acceptance_length" not in t  # never logged: no row


def test_markdown_and_cli(tmp_path, capsys):
    rows = _rows()
    rows[5]["reward/mean"] = rows[6]["reward/mean"] = rows[7]["reward/mean"] = float("nan")
    ranges, t = table(rows)
    md = markdown(ranges, t)
    lines = md.splitlines()
    assert lines[0] == "| metric | steps 1-4 | steps 5-7 | steps 8-10 |" and lines[1] == "|---|---|---|---|"
    assert "| reward/mean | 0.250 | - | 0.900 |" in lines  # a part whose values are all NaN shows "-"
    assert len(lines) == 2 + len(t)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main([str(tmp_path)])
    assert capsys.readouterr().out.strip() == md
    main([str(tmp_path), "--parts", "2"])
    assert capsys.readouterr().out.splitlines()[0] == "| metric | steps 1-5 | steps 6-10 |"
    assert math.isnan(t["reward/mean"][1])
