"""bench/draft_vocab.py at toy sizes: the two arms differ only in the head, the reduced one is
smaller in parameters, optimizer state and step memory, and the report is complete."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_draft_vocab", ROOT / "bench" / "draft_vocab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_arms_at_toy_sizes(bench, one_thread, tmp_path):
    V, N, H = 4096, 256, 128
    setup = bench.qwen3_vocab_setup(num_seqs=8, seq_len=16, batch_size=4, vocab=V, draft=N)
    r = bench.run_setup("toy", setup, rounds=1, steps=1, warmup=1)
    full, red = r["arms"]["full"], r["arms"]["reduced"]
    assert full["head_rows"] == V and red["head_rows"] == N
    assert red["vocab"]["size"] == N and 0 < red["vocab"]["coverage_train"] <= 1
    # the arms differ by the head's rows only: (V - N) x H parameters
    assert full["trainable_params"] - red["trainable_params"] == (V - N) * H
    assert r["state_mib_ratio"] == pytest.approx(red["trainable_params"] / full["trainable_params"])
    # the drafter's V-wide logits, softmax and their gradients dominate the full arm's step memory
    assert r["peak_step_mib_ratio"] < 0.8, r["peak_step_mib_ratio"]
    assert len(full["per_round_step_ms"]) == len(r["time_ratio"]["per_round"]) == 1
    data = {"setups": {"toy": r}}
    table = bench.markdown(data)
    assert "| toy | 4,096 | 256 | reduced |" in table
    bench.plot(data, tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 1000
