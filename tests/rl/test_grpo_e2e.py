"""End to end: `ray job submit launch/grpo.py` on a loopback cluster, then an exact resume.

Run A goes through the real job path (`ray start` + `ray job submit`), 3 steps with a checkpoint
after step 2. Run B starts standalone from A's step-2 checkpoint and runs step 3: its metrics must
equal A's step 3 (on CPU everything is deterministic: seeded sampling, fp32, same weights).
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["grpo.num_steps=3", "grpo.prompts_per_step=4", "grpo.group_size=4", "policy.micro_batch_size=8",
          "checkpoint.every=2",
          "checkpoint.keep_last=null", "data.eval.every=0", "rollout.sampling.max_tokens=8",
          "logging.progress_bar=false", "policy.reference_model=true"]
# Ray >= 2.5x turns token authentication on for `ray start` when ~/.ray/auth_token exists (any earlier
# ray.init writes one), and `ray job submit` then needs the token too; a loopback test cluster opts out.
# The job's `python` is looked up on PATH by the cluster: put this interpreter's environment first
# (CI runs pytest as .venv/bin/python without activating the venv).
BIN = str(Path(sys.executable).parent)
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled",
       "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}
RAY = str(Path(BIN) / "ray")


def metrics(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, tiny_model_path):
    out = tmp_path_factory.mktemp("run_a")
    start = subprocess.run([RAY, "start", "--head", "--num-cpus", "4", "--node-ip-address", "127.0.0.1",
                            "--dashboard-host", "127.0.0.1", "--include-dashboard", "true", "--disable-usage-stats"],
                           env=ENV, capture_output=True, text=True, timeout=180)
    assert start.returncode == 0, start.stdout + start.stderr
    try:
        job = subprocess.run(
            [RAY, "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", str(ROOT),
             "--runtime-env-json", json.dumps({"excludes": [".venv", ".git", "runs"]}), "--",
             "python", "launch/grpo.py", "--config", "configs/demo.yaml", f"run.output_dir={out}", *COMMON],
            env=ENV, capture_output=True, text=True, timeout=900)
        log = job.stdout + job.stderr
        assert job.returncode == 0 and "succeeded" in log.lower(), log[-4000:]
    finally:
        subprocess.run([RAY, "stop", "--force"], env=ENV, capture_output=True, timeout=120)
    return out


def test_job_writes_metrics_curves_and_checkpoints(run_a):
    m = metrics(run_a)
    assert sorted(m) == [1, 2, 3]
    for step in m.values():
        for key in ("reward/mean", "reward/accuracy", "kl/train_infer", "kl/ref", "response/length",
                    "time/rollout", "time/update", "time/weight_push", "train/grad_norm"):
            assert key in step, key
    assert (run_a / "curves.png").stat().st_size > 0
    assert any((run_a / "tensorboard").iterdir())
    assert (run_a / "checkpoints" / "step_000002" / "COMPLETE").exists()
    assert (run_a / "checkpoints" / "latest").read_text() == "step_000003"


def test_train_inference_kl_is_zero_in_fp32(run_a):
    """vLLM's sampling log-probs and the trainer's recomputation agree on the same weights, every step
    (so weight pushes deliver exactly the trained policy)."""
    for step in metrics(run_a).values():
        assert step["kl/train_infer"] < 1e-6
        assert step["kl/train_infer_max_abs_diff"] < 1e-3


def test_resume_reproduces_the_uninterrupted_run(run_a, tmp_path):
    out_b = tmp_path / "run_b"
    ckpt = out_b / "checkpoints"
    shutil.copytree(run_a / "checkpoints" / "step_000002", ckpt / "step_000002")
    (ckpt / "latest").write_text("step_000002")
    proc = subprocess.run([sys.executable, str(ROOT / "launch/grpo.py"), "--config", str(ROOT / "configs/demo.yaml"),
                           f"run.output_dir={out_b}", *COMMON, "--resume"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "resumed from" in proc.stdout
    a, b = metrics(run_a)[3], metrics(out_b)[3]
    for key in ("reward/mean", "response/length", "train/loss", "train/grad_norm", "kl/ref", "kl/train_infer"):
        assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key


def test_speculative_rollouts_report_acceptance_length(tmp_path, tiny_model_path):
    """With speculative decoding on (the initial policy as a frozen `draft_model`), the loop logs
    the engines' acceptance statistics every step and stays on-policy (train-inference KL ~ 0)."""
    out = tmp_path / "spec"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch/grpo.py"), "--config", str(ROOT / "configs/demo.yaml"), f"run.output_dir={out}",
         "grpo.num_steps=2", "grpo.prompts_per_step=4", "grpo.group_size=4", "policy.micro_batch_size=8",
         "data.eval.every=0", "logging.progress_bar=false", "rollout.speculative.method=draft_model",
         f"rollout.speculative.draft_model={tiny_model_path}", "rollout.speculative.num_speculative_tokens=3"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    m = metrics(out)
    for step in (1, 2):
        assert 1.0 <= m[step]["spec/acceptance_length"] <= 4.0
        assert m[step]["kl/train_infer"] < 1e-6
    assert m[1]["spec/acceptance_length"] > 1.5  # the drafter *is* the policy at step 1


def test_frozen_distilled_eagle3_drafter_in_the_loop(tmp_path, tiny_model_path):
    """An offline-distilled EAGLE-3 drafter (cached by tests/draft) served frozen in the rollouts:
    real acceptance (> 1.5 tokens per step at temperature 1) and still on-policy."""
    from cotrain.draft.cache import ensure_distilled

    drafter = ensure_distilled(ROOT / "configs" / "distill_eagle3.yaml") / "drafter"
    out = tmp_path / "eagle3"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch/grpo.py"), "--config", str(ROOT / "configs/demo_eagle3.yaml"),
         f"run.output_dir={out}", "draft.cotrain=false", f"rollout.speculative.draft_model={drafter}",
         "grpo.num_steps=2", "grpo.prompts_per_step=4", "grpo.group_size=4", "policy.micro_batch_size=8",
         "data.eval.every=0", "logging.progress_bar=false"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for step in metrics(out).values():
        assert step["spec/acceptance_length"] > 1.5
        assert step["kl/train_infer"] < 1e-6
