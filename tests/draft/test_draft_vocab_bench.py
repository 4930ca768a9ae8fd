"""bench/draft_vocab.py at toy sizes: the two arms differ only in the head, the reduced one is
smaller in parameters, optimizer state and step memory in every round; every summary number is
recomputed from the per-round raw values, and the figure's bars are the medians."""

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("draft_vocab")


def _spread(xs):
    xs = sorted(xs)
    n = len(xs)
    return {"median": xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2, "min": xs[0], "max": xs[-1]}


def test_bench_arms_at_toy_sizes(bench, one_thread, tmp_path):
    V, N, H = 4096, 256, 128
    setup = bench.qwen3_vocab_setup(num_seqs=8, seq_len=16, batch_size=4, vocab=V, draft=N)
    r = bench.run_setup("toy", setup, rounds=2, steps=1, warmup=1)
    full, red = r["arms"]["full"], r["arms"]["reduced"]
    assert full["head_rows"] == V and red["head_rows"] == N
    assert red["vocab"]["size"] == N and 0 < red["vocab"]["coverage_train"] <= 1
    # the arms differ by the head's rows only: (V - N) x H parameters
    assert full["trainable_params"] - red["trainable_params"] == (V - N) * H
    # persistent state: parameters, gradients and Adam's two moments, fp32
    for arm in (full, red):
        assert arm["state_mib"] == pytest.approx(4 * 4 * arm["trainable_params"] / 2**20)
    assert r["state_mib_ratio"] == pytest.approx(red["trainable_params"] / full["trainable_params"])
    # every summary number from the per-round raw values: spreads, the per-round paired time ratio,
    # the memory ratio of the medians
    for arm in (full, red):
        assert len(arm["per_round_step_ms"]) == len(arm["per_round_peak_step_mib"]) == 2
        assert arm["step_ms"] == pytest.approx(_spread(arm["per_round_step_ms"]))
        assert arm["peak_step_mib"] == pytest.approx(_spread(arm["per_round_peak_step_mib"]))
    per_round = [b / a for a, b in zip(full["per_round_step_ms"], red["per_round_step_ms"])]
    assert r["time_ratio"]["per_round"] == pytest.approx(per_round)
    assert {k: r["time_ratio"][k] for k in ("median", "min", "max")} == pytest.approx(_spread(per_round))
    peak_ratio = _spread(red["per_round_peak_step_mib"])["median"] / _spread(full["per_round_peak_step_mib"])["median"]
    assert r["peak_step_mib_ratio"] == pytest.approx(peak_ratio)
    # the drafter's V-wide logits, softmax and their gradients dominate the full arm's step memory:
    # the reduced step's peak is below 0.8 of the full one's in every round (measured 0.4-0.5)
    assert all(x < 0.8 * y for x, y in zip(red["per_round_peak_step_mib"], full["per_round_peak_step_mib"]))
    # the full arm's peak holds at least one fp32 copy of its V-wide logits (tokens x V x 4 bytes)
    assert full["peak_step_mib"]["min"] > r["tokens_per_step"] * V * 4 / 2**20
    data = {"setups": {"toy": r}}
    table = bench.markdown(data)
    assert "| toy | 4,096 | 256 | reduced |" in table
    fig = bench.plot(data, tmp_path / "x.png")
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the bars are the medians, full then reduced, on log axes
    for ax, key in zip(fig.axes, ("step_ms", "peak_step_mib")):
        assert ax.get_yscale() == "log"
        heights = [p.get_height() for p in ax.patches]
        assert heights == pytest.approx([full[key]["median"], red[key]["median"]])
