"""bench/ceiling.py: the ceiling on one trajectory.

The summary (thirds, recovery, shares, goals) is recomputed here independently from drawn points
(well under a second). The ``--quick`` run (configs/demo.yaml's tiny policy, 3 steps of 16
samples, a point every step, 3-step distillations; one subprocess for the module, ~1.5 min on two
shared cores, most of it Ray's and vLLM's start) is checked against what the loop itself measured:
the scorer (transformers' forward of the exported policy, the drafters loaded from their exports)
reproduces the loop's ``draft/acceptance_offline`` and ``_frozen`` (Megatron's forward, the
trainer's drafters) at every point, the co-trained drafter equals its frozen copy before its first
update, and the JSON names no absolute path.
"""

import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("ceiling")


def fake_result(n_steps=12, every=2, seed=0) -> dict:
    rng = random.Random(seed)
    arms = {}
    for arm in ("fixed", "adaptive"):
        steps = [{"step": s, "time/update": rng.uniform(1, 2), "draft/updates": float(rng.randint(0, 3)),
                  "kl/ref": 0.01 * s} for s in range(1, n_steps + 1)]
        for m in steps:
            if m["draft/updates"]:  # a step where the drafter took no step logs no drafter time
                m["time/draft"] = rng.uniform(0.05, 0.3)
        points = []
        for s in range(1, n_steps + 1, every):
            ceilings = {k: {"seeds": [rng.uniform(1.5, 2.5), rng.uniform(1.5, 2.5)]} for k in ("recipe", "run")}
            for c in ceilings.values():
                c["acceptance"] = statistics.mean(c["seeds"])
            points.append({"step": s, "ceiling": ceilings["run"]["acceptance"], "ceilings": ceilings,
                           "cotrained": rng.uniform(1.5, 2.5), "frozen": rng.uniform(1.2, 2.0),
                           "loop": {"cotrained": None, "frozen": None}})
        for p in points[1:]:
            p["loop"] = {"cotrained": p["cotrained"] + rng.uniform(-0.01, 0.01), "frozen": p["frozen"]}
        arms[arm] = {"num_steps": n_steps, "points": points, "steps": steps}
    return {"config": "x.yaml", "every": every, "k": 3, "arms": arms, "ceilings": ["run", "recipe"], "ceiling_seeds": 2}


def test_thirds_recovery_and_goals_recomputed(bench):
    result = fake_result()
    S = bench.summarize(result)
    for arm, res in result["arms"].items():
        s = S[arm]
        # 12 steps: thirds of 4 steps each (cotrain.rl.thirds.parts; the first may start at step 0)
        assert [t["steps"] for t in s["thirds"]][1:] == [[5, 8], [9, 12]] and s["thirds"][0]["steps"][1] == 4
        for t in s["thirds"]:
            lo, hi = t["steps"]
            pts = [p for p in res["points"] if lo <= p["step"] <= hi and p["step"] != 1]
            assert t["points"] == [p["step"] for p in pts]
            A = {d: statistics.mean(p[d] for p in pts) for d in ("cotrained", "frozen")}
            for kind in ("run", "recipe"):
                C = statistics.mean(statistics.mean(p["ceilings"][kind]["seeds"]) for p in pts)
                v = t["by_ceiling"][kind]
                assert v["acceptance"] == pytest.approx(C)
                assert v["recovery"] == pytest.approx((A["cotrained"] - A["frozen"]) / (C - A["frozen"]))
                assert v["cotrained_share"] == pytest.approx(A["cotrained"] / C)
                assert v["frozen_share"] == pytest.approx(A["frozen"] / C)
                per = [p["cotrained"] / statistics.mean(p["ceilings"][kind]["seeds"]) for p in pts]
                assert v["per_point"]["cotrained_share"] == pytest.approx(
                    {"median": statistics.median(per), "min": min(per), "max": max(per)})
                spread = [max(p["ceilings"][kind]["seeds"]) - min(p["ceilings"][kind]["seeds"]) for p in pts]
                assert v["seed_range"] == pytest.approx(statistics.mean(spread))
            # the primary ceiling (the first kind) at the top level
            assert t["recovery"] == t["by_ceiling"]["run"]["recovery"]
            assert t["acceptance"]["ceiling"] == t["by_ceiling"]["run"]["acceptance"]
            st = [m for m in res["steps"] if lo <= m["step"] <= hi]
            assert t["drafter_share_of_update"] == pytest.approx(sum(m.get("time/draft", 0.0) for m in st)
                                                                 / sum(m["time/update"] for m in st))
            assert t["drafter_steps"] == sum(m["draft/updates"] for m in st)
        for kind in ("run", "recipe"):
            g, v = s["goals_by_ceiling"][kind], [t["by_ceiling"][kind] for t in s["thirds"]]
            assert g["cotrained_ge_95pct_of_ceiling_every_third"] == all(x["cotrained_share"] >= 0.95 for x in v)
            assert g["frozen_le_90pct_of_ceiling_last_third"] == (v[-1]["frozen_share"] <= 0.90)
        assert s["goals"] == s["goals_by_ceiling"]["run"]
        diffs = [abs(p[d] - p["loop"][d]) for p in res["points"][1:] for d in ("cotrained", "frozen")]
        assert s["loop_check"] == {"max_abs_diff": pytest.approx(max(diffs)), "compared": len(diffs)}
        assert s["whole"]["points"] == [p["step"] for p in res["points"] if p["step"] > 1]
    # a goal is met exactly when its numbers say so: force both
    for p in result["arms"]["fixed"]["points"]:
        p["cotrained"], p["frozen"] = 0.97 * p["ceilings"]["run"]["acceptance"], 0.85 * p["ceilings"]["run"]["acceptance"]
    g = bench.summarize(result)["fixed"]["goals"]
    assert g == {"cotrained_ge_95pct_of_ceiling_every_third": True, "frozen_le_90pct_of_ceiling_last_third": True}


def test_points_and_refusals(bench):
    assert bench.point_steps(60, 5) == [1, 6, 11, 16, 21, 26, 31, 36, 41, 46, 51, 56]
    assert bench.point_steps(3, 1) == [1, 2, 3]
    with pytest.raises(ValueError, match="--every 0"):
        bench.point_steps(10, 0)
    by_step = {1: ["a", "b"], 2: ["c", "a"], 3: ["d"], 5: ["e"]}
    # steps 1-3 but none of step 2's prompts (its chains are scored), each prompt once, in order
    assert bench.run_prompts(by_step, 2, 1) == ["b", "d"]
    assert bench.run_prompts(by_step, 4, 1) == ["d", "e"]
    assert bench.run_prompts(by_step, 5, 0) == []

    class Cfg:
        class draft:
            init = "runs/some_drafter"
    with pytest.raises(ValueError, match="draft.init: 'runs/some_drafter'.*distill:<yaml>"):
        bench.distill_recipe(Cfg)


def _same(a, b) -> bool:
    """Equal as JSON (NaN, where a third has no point, equal to NaN)."""
    return json.dumps(a, sort_keys=True) == json.dumps(json.loads(json.dumps(b)), sort_keys=True)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_ceiling")
    out = tmp / "ceiling.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "ceiling.py"), "--quick", "--no-progress",
                           "--workdir", str(tmp / "work"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return out, json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_quick_run_scores_what_the_loop_measured(quick, bench):
    out, result, stdout = quick
    (arm,) = result["arms"]
    res = result["arms"][arm]
    assert res["points_at"] == [1, 2, 3] and [p["step"] for p in res["points"]] == [1, 2, 3]
    assert [m["step"] for m in res["steps"]] == [1, 2, 3]
    k = result["k"]
    for p in res["points"]:
        for d in ("ceiling", "cotrained", "frozen"):
            assert 1.0 <= p[d] <= k + 1
        # the scorer (transformers, exports) == the loop (Megatron, the trainer's drafters), on the
        # same chains: one chain's greedy token flipping by rounding would move it by ~1/64
        for d in ("cotrained", "frozen"):
            assert p[d] == pytest.approx(p["loop"][d], abs=0.02), (p["step"], d, p[d], p["loop"][d])
        assert p["loop"]["cotrained"] == pytest.approx(next(m for m in res["steps"] if m["step"] == p["step"])
                                                       ["draft/acceptance_offline"])
    first = res["points"][0]
    assert first["cotrained"] == first["frozen"]  # before the first update: one drafter
    assert "max_abs_weight_diff_vs_draft_init" in first["recipe_check"]
    assert all(p["export_s"] > 0 for p in res["points"][1:])
    assert _same(result["summary"], bench.summarize(result))
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert not out.with_suffix(".partial.json").exists()
    assert "| step | ceiling (recipe) | co-trained | frozen |" in stdout

    def strings(x):
        if isinstance(x, dict):
            for v in x.values():
                yield from strings(v)
        elif isinstance(x, list):
            for v in x:
                yield from strings(v)
        elif isinstance(x, str):
            yield x
    assert not [s for s in strings(result) if s.startswith("/")]


@pytest.mark.slow
def test_report_mode_reprints_and_redraws(quick, bench, tmp_path, capsys):
    out, result, _ = quick
    copy = tmp_path / "again.json"
    copy.write_text(json.dumps(result))
    assert bench.main(["--report", str(copy)]) == 0
    printed = capsys.readouterr().out
    assert "recovery (co - frozen) / (ceiling - frozen)" in printed and "Goals against the recipe ceiling:" in printed
    assert _same(json.loads(copy.read_text())["summary"], result["summary"])
    assert copy.with_suffix(".png").stat().st_size > 10_000
