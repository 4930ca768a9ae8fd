"""The compact logits handoff in the Megatron trainer (tests/rl/_handoff_run.py, world size 1): the
drafter's log-prob forward hands it only the rows its chains read (DFlash: its anchors' chains;
EAGLE-3: the response rows), and its step is bit for bit the one on the whole logits - packed rows
whole or in log-prob chunks, padded rows in chunks, a training and a measure-only step."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=["dflash", "eagle3"])
def handoff(request, tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("handoff") / "handoff.pt"
    proc = subprocess.run([sys.executable, str(ROOT / "tests/rl/_handoff_run.py"), "--model-dir", tiny_model_path,
                           "--out", str(out), "--kind", request.param], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("case", ["packed/train", "packed_chunks/train", "padded_chunks/train", "packed/measure",
                                  "packed_chunks/measure", "padded_chunks/measure"])
def test_the_compact_handoff_is_the_whole_logits_step(handoff, case):
    compact, whole = handoff[case]["compact"], handoff[case]["whole"]
    strip = lambda m: {k: v for k, v in m.items() if not k.endswith("_s")}  # noqa: E731  (seconds differ)
    assert strip(compact["metrics"]) == strip(whole["metrics"])
    assert compact["metrics"]["draft/chains"] > 0
    assert torch.equal(compact["logprobs"], whole["logprobs"])  # the policy's side is untouched
    for name, w in whole["weights"].items():
        assert torch.equal(compact["weights"][name], w), name
    moved = any(not torch.equal(handoff[case]["before"][n], w) for n, w in whole["weights"].items())
    assert moved == case.endswith("train")  # a training step moves the drafter, a measure-only one does not
    # fewer rows cross than the micro batches' real positions; the whole handoff carries every position
    assert all(flag and rows < real for rows, real, flag in compact["handed"])
    assert all(not flag and rows >= real for rows, real, flag in whole["handed"])
