"""bench/cotrain_e2e.py's summary of the co-training objectives' arms, recomputed here from raw steps.

The end-to-end smoke test (tests/bench/test_bench_smoke.py) runs the script itself; these check, in well
under a second, what it derives from per-step metrics when a run has the on-policy co-trained arm
(``--branches teacher_forced,on_policy``) and one plain seed (``--plain-seeds 1``): the numbers are
drawn at random and every summary value is recomputed from them independently.
"""

import random
import statistics

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("cotrain_e2e")


ARMS = ("plain", "frozen_dflash", "cotrained_dflash", "cotrained_dflash_on_policy")


def fake_arms(steps: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    arms = {}
    for name in ARMS:
        ms = []
        for _ in range(steps):
            m = {"time/rollout": rng.uniform(0.5, 2), "time/update": rng.uniform(8, 14), "time/weight_push": 0.1,
                 "reward/mean": rng.random(), "kl/ref": rng.random() / 10, "rollout/tokens_per_s": 1000.0,
                 "tap/wait_s": 0.0}
            m["time/step"] = m["time/rollout"] + m["time/update"] + 0.1
            if name != "plain":
                m["spec/acceptance_length"] = rng.uniform(2, 4)
                m["time/draft"] = rng.uniform(0.2, 1.0) if name.startswith("cotrained") else 0.0
            if name.startswith("cotrained"):  # --compare-frozen
                m["draft/acceptance_offline"] = rng.uniform(2, 4)
                m["draft/acceptance_offline_frozen"] = rng.uniform(2, 4)
                m["draft/frozen_s"] = rng.uniform(0.01, 0.1)
            ms.append(m)
        arms[name] = ms
    return arms


def test_on_policy_arm_is_summarised_against_the_teacher_forced_arm_on_the_same_steps(bench):
    steps, warmup, tail = 9, 2, 3
    arms = fake_arms(steps)
    S = bench.summarize(arms, ["dflash"], tail=tail, warmup=warmup)
    op, tf = arms["cotrained_dflash_on_policy"], arms["cotrained_dflash"]

    def acc(ms):
        return statistics.mean(m["spec/acceptance_length"] for m in ms)

    o = S["dflash"]["on_policy"]
    assert o["acceptance_first"] == pytest.approx(acc(op[:tail]))
    assert o["acceptance_last"] == pytest.approx(acc(op[-tail:]))
    assert o["acceptance_retained"] == pytest.approx(acc(op[-tail:]) / acc(op[:tail]))
    r = [x["spec/acceptance_length"] / y["spec/acceptance_length"] for x, y in zip(op, tf)]
    assert o["per_step_acceptance_ratio"] == pytest.approx({"median": statistics.median(r), "min": min(r), "max": max(r)})
    draft = lambda ms: sum(m["time/draft"] for m in ms[warmup:])  # noqa: E731
    assert o["draft_time_ratio"] == pytest.approx(draft(op) / draft(tf))
    upd = sum(m["time/update"] for m in op[warmup:])
    assert o["update_overhead"] == pytest.approx(draft(op) / (upd - draft(op)))
    roll = lambda ms: sum(m["time/rollout"] for m in ms[warmup:])  # noqa: E731
    assert o["rollout_speedup"] == pytest.approx(roll(arms["plain"]) / roll(op))
    # the goal's ratios for frozen and teacher-forced co-trained
    ret = S["dflash"]["acceptance_retained"]
    assert ret["frozen"] == pytest.approx(acc(arms["frozen_dflash"][-tail:]) / acc(arms["frozen_dflash"][:tail]))
    assert ret["cotrained"] == pytest.approx(acc(tf[-tail:]) / acc(tf[:tail]))
    # one plain seed: no noise band, the seed-0 mean only
    assert S["noise"] == {"reward_mean_seed0": pytest.approx(statistics.mean(m["reward/mean"] for m in arms["plain"]))}
    assert set(S["arms"]) == set(ARMS[1:])
    # --compare-frozen: each co-trained arm against its frozen copy on its own chains
    assert set(S["same_trajectory"]) == {"cotrained_dflash", "cotrained_dflash_on_policy"}
    for name in S["same_trajectory"]:
        t, ms = S["same_trajectory"][name], arms[name]
        co = [m["draft/acceptance_offline"] for m in ms]
        fr = [m["draft/acceptance_offline_frozen"] for m in ms]
        assert t["cotrained_first"] == pytest.approx(statistics.mean(co[:tail]))
        assert t["frozen_last"] == pytest.approx(statistics.mean(fr[-tail:]))
        assert t["frozen_retained"] == pytest.approx(statistics.mean(fr[-tail:]) / statistics.mean(fr[:tail]))
        assert t["cotrained_retained"] == pytest.approx(statistics.mean(co[-tail:]) / statistics.mean(co[:tail]))
        assert t["gap_last"] == pytest.approx(statistics.mean(co[-tail:]) - statistics.mean(fr[-tail:]))
        gap = [a - b for a, b in zip(co, fr)]  # 9 steps: thirds of 3
        assert t["gap_mean_by_third"] == pytest.approx([statistics.mean(gap[i:i + 3]) for i in (0, 3, 6)])
        assert t["gap_max"] == pytest.approx(max(gap)) and t["steps_ahead"] == sum(g > 0 for g in gap)


def test_markdown_and_plot_render_the_on_policy_arm(bench, tmp_path):
    steps = 6
    arms = fake_arms(steps, seed=1)
    result = {"config": "configs/bench_small.yaml", "steps": steps, "kinds": ["dflash"], "peers": [], "k": 4,
              "warmup": 1, "arms": arms, "summary": bench.summarize(arms, ["dflash"], tail=2, warmup=1)}
    md = bench.markdown(result)
    o = result["summary"]["dflash"]["on_policy"]
    r = o["per_step_acceptance_ratio"]
    ratio = f"{r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]"
    row = [line for line in md.splitlines() if line.startswith("| dflash |") and ratio in line]
    assert len(row) == 1 and f"| {o['draft_time_ratio']:.2f}x |" in row[0]
    assert len(row) == 1 and f"{o['acceptance_first']:.2f} -> {o['acceptance_last']:.2f}" in row[0]
    assert f"{100 * o['acceptance_retained']:.1f}%" in md
    t = result["summary"]["same_trajectory"]["cotrained_dflash"]
    assert f"| cotrained_dflash | {t['cotrained_first']:.2f} -> {t['cotrained_last']:.2f} |" in md
    assert "cotrained_dflash_on_policy" in bench.report(result)
    png = tmp_path / "e2e.png"
    bench.plot(result, png)  # no plain_seed1 arm: no noise band, and no KeyError
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("spec,fragment", [
    ("teacher_forced,sideways", "'sideways'"),
    ("", "allowed: teacher_forced, on_policy"),
])
def test_branches_option_refuses_what_is_not_a_branch_source(bench, spec, fragment):
    with pytest.raises(SystemExit, match=fragment):
        bench.resolve_branches(spec)
    assert bench.resolve_branches("on_policy,teacher_forced") == ["on_policy", "teacher_forced"]


def test_arm_overrides_set_the_branch_source_of_the_cotrained_arm_only(bench, monkeypatch, tmp_path):
    import cotrain.draft.cache

    # the frozen arm serves the cached distillation: its path only (no distillation run here)
    monkeypatch.setattr(cotrain.draft.cache, "ensure_distilled", lambda path: tmp_path)
    ov = bench.arm_overrides("bench_small", "dflash", "cotrained", 4, None, "on_policy")
    assert "draft.branches=on_policy" in ov and "draft.cotrain=true" in ov
    assert "draft.compare_frozen=true" not in ov
    assert "draft.compare_frozen=true" in bench.arm_overrides("bench_small", "dflash", "cotrained", 4, None,
                                                              "teacher_forced", compare_frozen=True)
    assert "draft.compare_frozen=true" not in bench.arm_overrides("bench_small", "dflash", "frozen", 4, None,
                                                                  "teacher_forced", compare_frozen=True)
    assert bench.cotrained_arm("dflash", "on_policy") == "cotrained_dflash_on_policy"
    assert bench.cotrained_arm("dflash", "teacher_forced") == "cotrained_dflash"
    assert not any(o.startswith("draft.branches") for o in bench.arm_overrides("bench_small", None, "plain", 4, None))


# ------------------------------------------------------------------ asynchronous arms (--staleness)
def fake_async_arms(steps: int, seed: int = 2) -> dict:
    """plain, plain_seed1, cotrained_dflash and their async twins: the sync arms' steps are the sum
    of their phases; the async arms' hide part of the shorter phase behind the longer."""
    rng = random.Random(seed)
    arms = {}
    for name in ("plain", "plain_seed1", "cotrained_dflash", "plain_async1", "cotrained_dflash_async1"):
        ms = []
        for _ in range(steps):
            r, u, w = rng.uniform(2, 4), rng.uniform(3, 6), 0.1
            m = {"time/rollout": r, "time/update": u, "time/weight_push": w, "reward/mean": rng.random(),
                 "kl/ref": rng.random() / 10, "kl/train_infer": rng.random() / 100, "tap/wait_s": 0.0}
            m["time/step"] = r + u + w if "_async" not in name else max(r, u) + w + rng.uniform(0, min(r, u))
            if "_async" in name:
                m["async/policy_lag"] = 1.0
            if name.startswith("cotrained"):
                m["spec/acceptance_length"], m["time/draft"] = rng.uniform(2, 3), 0.3
            ms.append(m)
        arms[name] = ms
    arms["plain_async1"][0]["async/policy_lag"] = 0.0
    return arms


def test_async_arms_are_summarised_against_their_synchronous_twins(bench, tmp_path):
    steps, warmup = 7, 1
    arms = fake_async_arms(steps)
    S = bench.summarize_async(arms, warmup=warmup)
    assert set(S) == {"plain_async1", "cotrained_dflash_async1"}

    def med(v):
        return {"median": statistics.median(v), "min": min(v), "max": max(v)}

    for name, twin in (("plain_async1", "plain"), ("cotrained_dflash_async1", "cotrained_dflash")):
        a, ms, sync = S[name], arms[name][warmup:steps - 1], arms[twin][warmup:steps - 1]  # the steady steps 2..6
        assert a["steady_steps"] == [2, 6] and a["staleness"] == 1
        assert a["per_step_speedup"] == pytest.approx(med([y["time/step"] / x["time/step"] for x, y in zip(ms, sync)]))
        assert a["run_speedup"] == pytest.approx(sum(m["time/step"] for m in arms[twin]) /
                                                 sum(m["time/step"] for m in arms[name]))
        hidden = [(y["time/step"] - x["time/step"]) / min(y["time/rollout"], y["time/update"]) for x, y in zip(ms, sync)]
        assert a["hidden_fraction"] == pytest.approx(med(hidden))
        assert a["rollout_slowdown"] == pytest.approx(med([x["time/rollout"] / y["time/rollout"] for x, y in zip(ms, sync)]))
        assert a["update_slowdown"] == pytest.approx(med([x["time/update"] / y["time/update"] for x, y in zip(ms, sync)]))
        assert a["engine_idle"] == pytest.approx(med([1 - m["time/rollout"] / m["time/step"] for m in ms]))
        assert a["trainer_idle"] == pytest.approx(med([1 - (m["time/update"] + 0.1) / m["time/step"] for m in ms]))
        seeds = [statistics.mean(m["reward/mean"] for m in arms[n]) for n in ("plain", "plain_seed1")]
        assert a["reward_band"] == pytest.approx([min(seeds), max(seeds)])
    c = S["cotrained_dflash_async1"]
    acc = lambda n: statistics.mean(m["spec/acceptance_length"] for m in arms[n])  # noqa: E731
    assert (c["acceptance"], c["sync_acceptance"]) == pytest.approx((acc("cotrained_dflash_async1"), acc("cotrained_dflash")))
    assert S["plain_async1"]["acceptance"] != S["plain_async1"]["acceptance"]  # (nan: no speculation)
    assert S["plain_async1"]["policy_lag"]["min"] == 0.0 and S["plain_async1"]["policy_lag"]["max"] == 1.0
    result = {"config": "configs/demo.yaml", "steps": steps, "kinds": [], "peers": [], "k": 3, "warmup": warmup,
              "arms": arms, "async_correction": "tis",
              "summary": {"arms": {}, "async": S}}
    md = bench.markdown(result)
    assert f"| cotrained_dflash_async1 | {c['step_s']['median']:.2f} [" in md and "correction tis" in md
    assert "plain_async1: step" in bench.report(result)
    png = tmp_path / "e2e_async.png"
    bench.plot_async(result, png)
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("spec,fragment", [("0,x", "not a list of integers"), ("-1", "allowed: integers >= 0")])
def test_staleness_option_refuses_what_is_not_a_staleness(bench, spec, fragment):
    with pytest.raises(SystemExit, match=fragment):
        bench.resolve_staleness(spec)
    assert bench.resolve_staleness("0") == [] and bench.resolve_staleness("1,0,2") == [1, 2]
