"""The multi-turn benchmark's summary (bench/multiturn_summary.py, ``bench/cotrain_e2e.py --workload calc``)
on a hand-made run: env share, ratios to plain and Amdahl's step ratio against numbers worked out by
hand, per-turn acceptance, and the ``--report --markdown`` path on the JSON. No run: a second."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import cotrain_e2e  # noqa: E402
from bench.multiturn_summary import summarize_multiturn  # noqa: E402


def _step(step, rollout, env, update, acc=None, reward=0.5):
    m = {"time/step": rollout + update + 0.5, "time/rollout": rollout, "time/env": env, "time/update": update,
         "time/weight_push": 0.5, "reward/mean": reward, "reward/accuracy": reward, "kl/ref": 0.01 * step,
         "env/turns_mean": 2.0}
    if acc is not None:
        m.update({"spec/acceptance_length": sum(acc) / 2, "spec/acceptance_length_turn1": acc[0],
                  "spec/acceptance_length_turn2": acc[1]})
    return m


def _arms():
    """Three steps per arm; step 1 (the warm-up) is slow and must not count. At latency 0.2 s:
    plain step = 6 + 3.5 + 0.5 = 10 s (rollout 6 = generation 4 + env 2), co-trained 4 + 3.5 + 0.5 = 8 s
    (generation 2 + env 2), frozen 5 + 3.5 + 0.5 = 9 s (generation 3 + env 2)."""
    arms = {}
    for lat, env in ((0.0, 0.0), (0.2, 2.0)):
        for name, gen in (("plain", 4.0), ("frozen_dflash", 3.0), ("cotrained_dflash", 2.0)):
            acc = None if name == "plain" else ((1.8, 1.2) if name == "frozen_dflash" else (1.9, 1.6))
            ms = [_step(1, 50.0, env, 20.0, acc, 0.4)] + [_step(s, gen + env, env, 3.5, acc, 0.4 + 0.1 * s)
                                                          for s in (2, 3)]
            if name == "cotrained_dflash":  # the co-trained drafter's turn-2 acceptance rises
                ms[-1]["spec/acceptance_length_turn2"] = 2.2
            arms[cotrain_e2e.latency_arm(name, lat)] = ms
    return arms


def test_ratios_env_share_and_amdahl_by_hand():
    s = summarize_multiturn(_arms(), ["dflash"], [0.0, 0.2], tail=1, warmup=1)
    at = s["by_latency"]["0.2"]
    assert at["plain"]["env_share"] == pytest.approx(2 / 10)
    c = at["cotrained_dflash"]
    assert c["env_share"] == pytest.approx(2 / 8)
    assert c["rollout_ratio"] == pytest.approx(6 / 4) and c["generation_ratio"] == pytest.approx(4 / 2)
    assert c["env_ratio"] == pytest.approx(1.0) and c["step_ratio"] == pytest.approx(10 / 8)
    # only the generation changed (the update is the same here): Amdahl gives the measured step ratio
    assert c["amdahl_step_ratio"] == pytest.approx(10 / (10 - 4 + 4 / 2)) == pytest.approx(c["step_ratio"])
    assert c["per_step_step_ratio"] == {"median": pytest.approx(1.25), "min": pytest.approx(1.25),
                                        "max": pytest.approx(1.25)}
    assert at["frozen_dflash"]["step_ratio"] == pytest.approx(10 / 9)
    # plain's generation (4 of 10 s) 2.23x faster: 10 / (6 + 4 / 2.23)
    assert s["what_if"]["0.2"]["step_ratio_if_generation"]["2.23"] == pytest.approx(10 / (6 + 4 / 2.23))
    assert s["what_if"]["0.2"]["generation_share"] == pytest.approx(0.4)
    # no tool latency: no env share, the whole rollout is generation
    z = s["by_latency"]["0"]["cotrained_dflash"]
    assert z["env_share"] == 0 and z["rollout_ratio"] == pytest.approx(2.0) and z["step_ratio"] == pytest.approx(8 / 6)
    # per turn: first / last step means over all steps (tail 1)
    assert c["acceptance_first"] == {"turn1": 1.9, "turn2": 1.6} and c["acceptance_last"]["turn2"] == 2.2
    assert c["reward_first"] == pytest.approx(0.4) and c["reward_last"] == pytest.approx(0.7)
    assert [(r["tool_latency_s"], r["arm"]) for r in s["amdahl"]] == [
        (0.0, "frozen_dflash"), (0.0, "cotrained_dflash"), (0.2, "frozen_dflash"), (0.2, "cotrained_dflash")]


def test_report_markdown_from_the_json(tmp_path, capsys):
    result = {"config": "configs/calc.yaml", "steps": 3, "kinds": ["dflash"], "peers": [], "k": 3, "warmup": 1,
              "workload": "calc", "tool_latencies": [0.0, 0.2], "arms": _arms(), "summary": {}}
    path = tmp_path / "multiturn_e2e.json"
    path.write_text(json.dumps(result))
    assert cotrain_e2e.main(["--report", str(path), "--markdown"]) == 0
    md = capsys.readouterr().out
    assert "| 0.2 s | cotrained_dflash | 8.00 | 4.00 | 2.00 | 3.50 | 25.0% | 1.50x |" in md
    assert "| 0.2 s | cotrained_dflash | 1.90 / 1.60 | 1.90 / 2.20 |" in md
    assert json.loads(path.read_text())["summary"]["by_latency"]["0.2"]["plain"]["env_share"] == pytest.approx(0.2)
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_tool_latency_needs_the_calc_workload():
    with pytest.raises(SystemExit, match="--workload calc"):
        cotrain_e2e.main(["--tool-latency", "0.2"])
    with pytest.raises(SystemExit, match="distinct seconds"):
        cotrain_e2e.parse_latencies("0.2,-1")
