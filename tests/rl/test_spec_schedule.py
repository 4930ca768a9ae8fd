"""Speculation by batch size: vLLM honours rollout.speculative.batch_size_schedule on CPU, and the
calibration command measures the engines and writes a schedule the config accepts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cotrain.rl.calibrate import Point, add_histograms, best_k, schedule_from_points, survival_from_histogram

ROOT = Path(__file__).resolve().parents[2]


def test_choices_and_schedule_by_hand():
    assert survival_from_histogram([2, 1, 1]) == [0.5, 0.25]  # P(>= 1 accepted), P(>= 2 accepted)
    assert add_histograms([1, 2], [3, 4, 5]) == [4, 6, 5]
    per_k = {1: {"tokens_per_s": 90.0}, 2: {"tokens_per_s": 130.0}, 3: {"tokens_per_s": 120.0}}
    assert best_k(100.0, per_k) == (2, 1.3)
    assert best_k(200.0, per_k) == (0, 1.0)
    pts = [Point(1, 0.01, 100, {}, best_k=3), Point(4, 0.01, 100, {}, best_k=3), Point(16, 0.01, 100, {}, best_k=1),
           Point(64, 0.01, 100, {}, best_k=0)]
    # boundaries at the geometric means (4*16 -> 8, 16*64 -> 32); equal neighbours merge
    assert schedule_from_points(pts, 1024) == [[1, 8, 3], [9, 32, 1], [33, 1024, 0]]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_vllm_honours_the_schedule_on_cpu(ray_local, tiny_model_path):
    """One request speculates (k = 3), eight do not (k = 0), with the same engine."""
    import ray

    from cotrain.config import load_config
    from cotrain.draft.cache import ensure_distilled
    from cotrain.rl.interfaces import SamplingSpec
    from cotrain.rl.rollout import RolloutWorker, engine_spec_from_config

    drafter = ensure_distilled(ROOT / "configs" / "distill_dflash.yaml") / "drafter"
    cfg = load_config(ROOT / "configs" / "grpo.yaml", [
        "draft.kind=dflash", "draft.cotrain=false", f"rollout.speculative.draft_model={drafter}",
        "rollout.speculative.method=dflash", "rollout.speculative.num_speculative_tokens=3",
        "draft.dflash.block_size=7", "rollout.speculative.batch_size_schedule=[[1,1,3],[2,1024,0]]"])
    spec = engine_spec_from_config(cfg)
    assert spec.speculative["num_speculative_tokens_per_batch_size"] == [(1, 1, 3), (2, 1024, 0)]
    worker = ray.remote(RolloutWorker).options(num_cpus=1).remote(spec)
    try:
        sampling = SamplingSpec(temperature=1.0, max_tokens=12, seed=0, ignore_eos=True)
        one = ray.get(worker.generate.remote(["12+34="], sampling, 1)).samples[0][0]
        eight = [row[0] for row in ray.get(worker.generate.remote([f"{i}+{i}=" for i in range(8)], sampling, 1)).samples]
        assert one.spec_decode["num_draft_tokens"] > 0 and len(one.token_ids) == 12
        assert sum(s.spec_decode["num_draft_tokens"] for s in eight) == 0  # speculation off at batch 8
        assert all(len(s.token_ids) == 12 for s in eight)
    finally:
        ray.get(worker.shutdown.remote())
        ray.kill(worker)


def test_calibration_writes_a_schedule_the_config_accepts(tmp_path, tiny_model_path):
    out = tmp_path / "schedule.yaml"
    proc = subprocess.run([sys.executable, "-m", "cotrain.rl.calibrate", "--config", "configs/demo.yaml",
                           "--batch-sizes", "1,8", "--ks", "2,3", "--max-tokens", "8", "--rounds", "1", "--no-progress",
                           "--write", str(out), "cluster.cpus_per_node=2"],  # 3 engines on a 2-CPU config: Ray grows
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert [p["batch"] for p in result["points"]] == [1, 8]
    for p in result["points"]:
        m = p["per_k"]["3"]
        assert m["round_s"] > 0 and p["plain_step_s"] > 0
        # the summary from the raw rounds, and vLLM's two counters agreeing: with one round, 1 + accepted
        # drafts / verification rounds equals 1 + the sum of the prefix survivals its acceptance
        # histogram gives (P(>= j accepted), j = 1..3, non-increasing)
        spec = [x for x in p["rounds"] if x["k"] == 3]
        assert len(spec) == 1 and m["acceptance_length"] == pytest.approx(spec[0]["acceptance_length"])
        s = m["survival"]
        assert len(s) == 3 and all(a >= b for a, b in zip(s, s[1:]))
        assert m["acceptance_length"] == pytest.approx(1 + sum(s), rel=1e-9)
        # the choice is the measured fastest arm
        speed = {0: p["plain_tokens_per_s"], **{int(k): v["tokens_per_s"] for k, v in p["per_k"].items()}}
        assert set(speed) == {0, 2, 3} and p["best_k"] == max(speed, key=speed.get)
    # the demo's distilled DFlash drafter at temperature 1, measured (seeded; twice, identical): batch 8
    # 2.1 (survival 0.5, 0.4, 0.2), batch 1 1.4 (only five verification rounds: no bound); a drafter
    # that is not the policy's gets ~1.1
    assert result["points"][1]["per_k"]["3"]["acceptance_length"] > 1.6
    from cotrain.config import load_config

    sched = json.dumps(result["schedule"]).replace(" ", "")
    cfg = load_config(ROOT / "configs" / "demo.yaml", [f"rollout.speculative.batch_size_schedule={sched}",
                                                       f"run.output_dir={tmp_path}"])  # (runs/demo may hold the user's)
    assert cfg.rollout.speculative.batch_size_schedule[0][0] == 1
    assert "batch_size_schedule" in proc.stdout
