"""bench/update.py --quick: the JSON's structure, its summaries recomputed from the raw rounds, and packed == padded.

The quick run (configs/demo.yaml's tiny policy with a co-trained DFlash drafter from scratch, 8 sequences
of 2-36 positions, 2 rounds) is one subprocess for the module. No speed is asserted (a shared 2-core
machine); what is asserted is what the benchmark derives from what it measured - every median / range
and every paired ratio recomputed from the raw per-round records, the arms interleaved in the recorded
rotated order, the FLOP count from the recorded sequence lengths - and the property the packed layout
must keep: both arms' loss and grad_norm agree to 1e-4 relative in every round (and the warm-up
update), and their log-probs to 1e-4 absolute.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_update")
    out, png = tmp / "update.json", tmp / "update.png"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "update.py"), "--quick", "--no-progress",
                           "--out", str(out), "--png", str(png), "--cache-dir", str(tmp / "cache")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert png.stat().st_size > 10_000
    return json.loads(out.read_text())


def _spread(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def test_structure(result):
    assert result["quick"] and result["rounds"] == 2 and set(result["arms"]) == {"padded", "packed"}
    (w,) = result["workloads"].values()
    assert w["config"] == "configs/demo.yaml" and w["rollout"]["source"] == "synthetic"
    assert w["rollout"]["sequences"] == 8 and w["cotrain_drafter"] == "dflash"
    for arm in ("padded", "packed"):
        recs = w["raw"][arm]
        assert [r["round"] for r in recs] == [0, 1]
        assert [r["step"] for r in recs] == [2, 3] and w["warmup"][arm]["step"] == 1
        for r in recs:
            assert r["update_s"] >= r["logprobs_s"] + r["train_s"] > 0
            assert r["peak_rss"] >= max(r["rss_start"], r["rss_end"]) > 0  # a high-water mark over the update
            assert r["matmul_flops_per_s"] > 0 and r["matmul_threads"] == w["threads"]
    assert "memory_breakdown" not in result  # off in --quick unless asked
    assert set(w["goals"]) == {"speedup", "memory_ratio", "matmul_fraction"}


def test_arms_interleaved_in_rotated_order(result):
    (w,) = result["workloads"].values()
    assert w["order"] == [["padded", "packed"], ["packed", "padded"]]


def test_summaries_and_ratios_recomputed_from_raw_rounds(result):
    (w,) = result["workloads"].values()
    raw, S = w["raw"], w["summary"]
    real = w["rollout"]["real_positions"]
    for arm, recs in raw.items():
        for key in ("update_s", "logprobs_s", "train_s", "peak_rss", "matmul_flops_per_s"):
            assert S[arm][key] == pytest.approx(_spread([r[key] for r in recs])), (arm, key)
        assert S[arm]["tokens_per_s"] == pytest.approx(_spread([real / r["update_s"] for r in recs]))
        flops = [w["flops"]["per_update"] / r["update_s"] for r in recs]
        assert S[arm]["flops_per_s"] == pytest.approx(_spread(flops))
        limit = statistics.median(r["matmul_flops_per_s"] for rs in raw.values() for r in rs)
        assert w["matmul_limit"]["median"] == pytest.approx(limit)
        assert S[arm]["matmul_fraction"] == pytest.approx(_spread([f / limit for f in flops]))
        assert S[arm]["peak_growth"] == pytest.approx(_spread([r["peak_rss"] - r["rss_start"] for r in recs]))
    pad, pk = raw["padded"], raw["packed"]
    speed = [a["update_s"] / b["update_s"] for a, b in zip(pad, pk)]
    mem = [b["peak_rss"] / a["peak_rss"] for a, b in zip(pad, pk)]
    assert w["ratios"]["speedup"]["per_round"] == pytest.approx(speed)
    assert {k: w["ratios"]["speedup"][k] for k in ("median", "min", "max")} == pytest.approx(_spread(speed))
    assert {k: w["ratios"]["memory_ratio"][k] for k in ("median", "min", "max")} == pytest.approx(_spread(mem))
    assert w["goals"]["speedup"]["value"] == pytest.approx(statistics.median(speed))
    assert w["goals"]["speedup"]["met"] == (statistics.median(speed) >= 3.0)


def test_flops_from_first_principles(result):
    """2 x matmul params x positions + causal attention per forward; policy + reference + 3 per epoch."""
    (w,) = result["workloads"].values()
    info, f = w["model_info"], w["flops"]
    # the tiny Qwen3: 4 layers x (q 128x128, k/v 128x64, o 128x128, MLP 3 x 128x384) + LM head 128 x vocab
    per_layer = 128 * 128 * 2 + 2 * 128 * 64 + 3 * 128 * 384
    assert info["matmul_params"] == 4 * per_layer + info["vocab"] * 128
    assert f["forward_equivalents"] == 1 + 1 + 3  # reference on, one epoch
    real = w["rollout"]["real_positions"]
    lo = 2 * info["matmul_params"] * real  # the attention term only adds
    assert lo < f["per_forward"] < lo * 1.2 and f["per_update"] == pytest.approx(5 * f["per_forward"])


def test_packed_equals_padded(result):
    """The real property: the packed layout changes the work, not the numbers."""
    (w,) = result["workloads"].values()
    pairs = [(w["warmup"]["padded"], w["warmup"]["packed"])] + list(zip(w["raw"]["padded"], w["raw"]["packed"]))
    for a, b in pairs:
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert max(d["logprobs_max_abs"] for d in w["logprob_diffs"]) < 1e-4
    n = w["numerics"]
    assert n["agree"] and n["loss"] == [[a["loss"], b["loss"]] for a, b in pairs]
    assert n["max"]["grad_norm_rel_diff"] == pytest.approx(
        max(abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] for a, b in pairs))
