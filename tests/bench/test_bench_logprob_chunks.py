"""bench/logprob_chunks.py --quick: the chunked log-probs are the whole micro batch's, and hold less
tensor memory, the co-trained drafter's handoff of the whole logits adds one logits copy, and the
compact handoff (only the rows a DFlash drafter's step reads, OnlineDraftTrainer.logit_rows) only its
rows' share of one (a deterministic count of the PyTorch profiler's allocation events, not a timing)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_chunked_logprobs_are_exact_and_smaller(tmp_path):
    out = tmp_path / "chunks.json"
    res = subprocess.run([sys.executable, str(ROOT / "bench/logprob_chunks.py"), "--quick", "--out", str(out),
                          "--model-dir", str(tmp_path / "model")], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    s = r["summary"]
    assert s["logprobs_max_abs_diff"] <= 1e-6
    # whole: at least one [tokens, V] fp32 copy of the logits alive; chunks of 64 of 512 positions: far less
    assert s["whole"]["logprobs_mib"]["median"] >= r["one_logits_copy_mib"]
    assert s["chunked"]["logprobs_mib"]["median"] < 0.7 * s["whole"]["logprobs_mib"]["median"]
    assert s["chunked"]["train_mib"]["median"] < s["whole"]["train_mib"]["median"]
    # the drafter's handoff costs one logits copy: not one per chunk clone, their concatenation, and
    # the clones the backward's recomputation would make again (three copies)
    assert s["handoff_extra_mib"] <= 1.25 * r["one_logits_copy_mib"]
    # the compact handoff: the rows of a real DFlash drafter's step, fewer than the micro batch's
    # positions; it costs at most their share of one copy, less than the whole logits' handoff; the
    # log-probs unchanged and the rows handed over are the whole logits' at those rows
    c = r["compact"]
    assert 0 < c["rows"] < c["positions"] == r["tokens"]
    assert c["handed_shape"]["compact"] == [c["rows"], r["vocab"]]
    assert s["compact_extra_mib"] <= 1.25 * c["rows"] / r["tokens"] * r["one_logits_copy_mib"]
    assert s["compact_extra_mib"] < s["handoff_extra_mib"]
    assert s["compact_logprobs_max_abs_diff"] == 0 and s["handoff_logprobs_max_abs_diff"] == 0
    assert s["compact_rows_max_abs_diff"] == 0
    assert out.with_suffix(".png").exists()
