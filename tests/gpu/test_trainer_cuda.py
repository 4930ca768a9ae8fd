"""The Megatron trainer and its co-trained drafter on CUDA against the same steps on CPU (in process,
world size 1, PP = 1; skipped without CUDA). No Ray, no vLLM: tests/gpu/_trainer_run.py runs one
process per device (the CPU one with CUDA_VISIBLE_DEVICES="", where cotrain's compatibility layer
runs Megatron on the CPU) on the same random-weight tiny checkpoint and rollout batch.

* fp32 on CUDA equals fp32 on CPU closely (TF32 off: torch's default for matmuls; cuDNN is not
  used): log-probs before and after one GRPO step within 1e-4, loss and gradient norm within 1e-4
  relative. Anything the device placement got wrong (a tensor left behind, a mask on the wrong
  rows) moves these by far more.
* bf16 on CUDA against fp32 on CPU within bf16's tolerance: bf16 keeps 8 significant bits (a
  relative rounding of 2^-8 = 0.4% on every weight and activation); over the tiny model's layers that
  is about 1% of logits of magnitude ~5, so a few hundredths on a log-prob: masked log-probs within
  0.02 on average and 0.25 at most (the bounds tests/rl/test_trainer_gpu.py uses for TE against local
  attention in bf16), the step's loss within 5% and its gradient norm within 10%.
* one co-training step (taps, the drafter, its loss and its optimizer) of DFlash and of EAGLE-3, each
  teacher-forced and on its own branches (SpecOPD, the policy's tree forward scoring them), on CUDA
  in fp32 equals CPU's (the branches are drawn at the same uniforms, so they are the same tokens): draft loss and gradient norm within 1e-4 relative, the drafter's weights
  after its step within 1e-5 (eps = 1, no clipping: the update is ~lr * g, linear in the gradient).
* (the CUDA process runs with torch's deterministic algorithms and cuBLAS's deterministic workspace,
  so that a repeated step in it is bit-identical)
* the checkpoint round trip restores the CUDA generator and Megatron's CUDA RNG tracker: the same
  draws after load as after save; a resumed step equals the original bit for bit; offload + onload
  leaves the next step bit-identical.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "_trainer_run.py"
DRAFTERS = ["dflash", "eagle3", "dflash_op", "eagle3_op"]  # _op: on their own branches (SpecOPD)
CPU_CASES = ",".join(["plain:float32"] + [f"{k}:float32" for k in DRAFTERS])
# the checks (offload, rng, resume) run on the first case: bf16, whose optimizer also holds fp32 main parameters
CUDA_CASES = ",".join(["plain:bfloat16", "plain:float32"] + [f"{k}:float32" for k in DRAFTERS])


def _run(device: str, cases: str, checks: str, d: Path) -> dict:
    env = dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # torch sees no GPU: Megatron runs through the compatibility layer
    else:  # deterministic cuBLAS (and torch's deterministic kernels): bit-identical repeats in one process
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    out = d / f"{device}.pt"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", device, "--cases", cases, "--checks", checks,
                           "--model-dir", str(d / "model"), "--work", str(d / f"work_{device}"), "--out", str(out),
                           "--deterministic"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainer_cuda")
    cpu = _run("cpu", CPU_CASES, "", d)  # writes the checkpoint both use
    cuda = _run("cuda", CUDA_CASES, "offload,rng,resume", d)
    return cpu, cuda


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_everything_is_on_the_gpu(runs):
    _, cuda = runs
    for case in CUDA_CASES.split(","):
        assert cuda[case]["device"] == "cuda:0" and cuda[case]["param_devices"] == ["cuda:0"], case
    for case in (f"{k}:float32" for k in DRAFTERS):
        assert cuda[case]["drafter_devices"] == ["cuda:0"]
        assert cuda[case]["step"]["logprobs"].device.type == "cpu"  # results leave on the CPU


def test_fp32_step_matches_cpu(runs):
    cpu, cuda = runs
    a, b = cuda["plain:float32"]["step"], cpu["plain:float32"]["step"]
    m = b["mask"].bool()
    for key in ("logprobs", "logprobs_after"):
        torch.testing.assert_close(a[key][m], b[key][m], atol=1e-4, rtol=1e-4, msg=key)
    assert _rel(a["metrics"]["loss"], b["metrics"]["loss"]) < 1e-4
    assert _rel(a["metrics"]["grad_norm"], b["metrics"]["grad_norm"]) < 1e-4


def test_bf16_step_matches_cpu_fp32_within_bf16_tolerance(runs):
    cpu, cuda = runs
    a, b = cuda["plain:bfloat16"]["step"], cpu["plain:float32"]["step"]
    m = b["mask"].bool()
    for key in ("logprobs", "logprobs_after"):
        diff = (a[key] - b[key]).abs()[m]
        assert diff.mean() < 0.02 and diff.max() < 0.25, (key, float(diff.mean()), float(diff.max()))
    assert _rel(a["metrics"]["loss"], b["metrics"]["loss"]) < 0.05
    assert _rel(a["metrics"]["grad_norm"], b["metrics"]["grad_norm"]) < 0.1


@pytest.mark.parametrize("kind", DRAFTERS)
def test_cotraining_step_matches_cpu(runs, kind):
    cpu, cuda = runs
    a, b = cuda[f"{kind}:float32"]["step"], cpu[f"{kind}:float32"]["step"]
    ma, mb = a["draft_metrics"], b["draft_metrics"]
    assert ma["draft/positions"] == mb["draft/positions"] > 0 and ma["draft/chains"] == mb["draft/chains"]
    for k in ("draft/loss", "draft/grad_norm", "draft/overlap"):
        assert _rel(ma[k], mb[k]) < 1e-4, (k, ma[k], mb[k])
    assert set(a["drafter"]) == set(b["drafter"])
    for name, w in b["drafter"].items():
        torch.testing.assert_close(a["drafter"][name], w, atol=1e-5, rtol=1e-4, msg=name)
    # the policy's step is the plain one (co-training never reaches it)
    torch.testing.assert_close(a["logprobs_after"], cuda["plain:float32"]["step"]["logprobs_after"], atol=1e-6, rtol=0)


def test_cuda_rng_and_resume_through_a_checkpoint(runs):
    _, cuda = runs
    first, again = cuda["plain:bfloat16"]["rng"]
    assert len(first) == 4  # torch CPU, Python, this GPU's generator, Megatron's model-parallel CUDA stream
    for x, y in zip(first, again):
        assert (torch.equal(x, y) if torch.is_tensor(x) else x == y)
    a, b = cuda["plain:bfloat16"]["resume"]
    assert torch.equal(a["logprobs_after"], b["logprobs_after"]) and a["metrics"] == b["metrics"]


def test_offload_onload_leaves_the_next_step_bit_identical(runs):
    _, cuda = runs
    a, b = cuda["plain:bfloat16"]["offload"], cuda["plain:bfloat16"]["offload_ref"]
    assert torch.equal(a["logprobs_after"], b["logprobs_after"]) and a["metrics"] == b["metrics"]
