"""TapChannel on a real megatron-core pipeline (gloo, CPU): what the last stage receives at PP=2 and PP=4
is bit-identical to the same layers' outputs in an independent PP=1 run (own forward hooks, no TapChannel)."""

import pytest
import torch

from cotrain.distributed import spawn_local

import _tap_workers as w

MICRO = w.make_micro(seed=0)
MICRO_B2 = w.make_micro(seed=1, batch=2)
H = w.ARCH["hidden_size"]


@pytest.fixture(scope="module")
def reference():
    (ref,) = spawn_local(w.reference_pp1, 1, MICRO, MICRO_B2, timeout_s=300)
    return ref


@pytest.fixture(scope="module", params=[2, 4], ids=lambda pp: f"pp{pp}")
def run(request, reference):
    pp = request.param
    return pp, spawn_local(w.pipeline_taps, pp, pp, reference["state"], MICRO, timeout_s=300)


def _ref_tokens(reference, orig, layer):
    n = w.NUM_TOKENS[orig]
    return reference["hidden"][orig][layer].transpose(0, 1).reshape(-1, H)[:n]  # [s, 1, h] -> first n tokens


def test_reference_has_distinct_layers(reference):
    # guards the comparison below against a degenerate model (identical layers would hide a mix-up)
    hs = reference["hidden"][0]
    for a in w.TAP_LAYERS:
        for b in w.TAP_LAYERS:
            if a < b:
                assert not torch.allclose(hs[a], hs[b])


@pytest.mark.parametrize("transport", ["shm", "gloo", "auto"])
def test_taps_bit_identical_to_pp1(run, reference, transport):
    pp, ranks = run
    last = ranks[-1]
    assert all(r["received"] is None for r in ranks[:-1])
    got = last["received"][transport]
    expected_order = [i for order in w.ORDERS for i in order]
    assert [orig for orig, _ in got] == expected_order  # one read per microbatch, in schedule order
    for orig, taps in got:
        assert sorted(taps) == w.TAP_LAYERS
        for layer, x in taps.items():
            ref = _ref_tokens(reference, orig, layer)
            assert x.shape == (w.NUM_TOKENS[orig], H) and x.dtype == torch.float32
            assert torch.equal(x, ref), f"PP={pp} {transport}: layer {layer}, microbatch {orig}"


def test_taps_come_from_every_stage(run):
    pp, ranks = run
    stage_layers = {r["stage"]: r["layers"] for r in ranks}
    assert len(stage_layers) == pp
    for r in ranks[:-1]:  # each source wrote exactly its own layers' taps
        mine = sorted(set(w.TAP_LAYERS) & set(r["layers"]))
        assert mine, f"stage {r['stage']} has no tap: the test would not cover it"
        for t in ("shm", "gloo", "auto"):
            assert sorted(r["metrics"][t]["writes_per_source"]) == mine
    remote = ranks[-1]["remote_layers"]
    assert remote == [i for i in w.TAP_LAYERS if i not in ranks[-1]["layers"]]


def test_auto_picks_a_transport_per_source_by_node(run):
    """Stages [0, pp/2) on node "A", the rest with the reader on "B": gloo across, shm within B, local on the
    reader; one channel runs both transports (PP=4) and every rank agrees on the routes."""
    pp, ranks = run
    stage_of = {layer: r["stage"] for r in ranks for layer in r["layers"]}
    want = {layer: "local" if stage_of[layer] == pp - 1 else "gloo" if stage_of[layer] < pp // 2 else "shm"
            for layer in w.TAP_LAYERS}
    for r in ranks:
        assert r["routes"]["auto"] == want
        assert r["routes"]["shm"] == {k: "local" if v == "local" else "shm" for k, v in want.items()}
        assert r["auto_transports"] == sorted(set(want.values()) - {"local"})
    assert ("shm" in want.values()) == (pp == 4)


def test_local_taps_are_read_in_place(run):
    pp, ranks = run
    zc = ranks[-1]["zero_copy"]
    local = [i for i in w.TAP_LAYERS if i in ranks[-1]["layers"]]
    assert sorted({i for i, _ in zc}) == local
    assert len(zc) == len(local) * sum(len(o) for o in w.ORDERS)
    assert all(same for _, same in zc)


def test_losses_unchanged_by_the_taps(run, reference):
    pp, ranks = run
    first_step = ranks[-1]["losses"][0]
    assert [i for i, _ in first_step] == w.ORDERS[0]
    torch.testing.assert_close(torch.tensor([l for _, l in first_step]), torch.tensor(reference["losses"]),
                               rtol=1e-6, atol=1e-7)


def test_metrics_bytes_and_times(run):
    pp, ranks = run
    last = ranks[-1]
    n_layers = len(w.TAP_LAYERS)
    remote = last["remote_layers"]
    seq_tokens = [w.NUM_TOKENS[i] for order in w.ORDERS for i in order]
    for t in ("shm", "gloo", "auto"):
        m = last["metrics"][t]
        # bytes per microbatch = tokens x sum of tap widths x element size (each feature once)
        assert m["bytes_per_microbatch"] == [n * n_layers * H * 4 for n in seq_tokens]
        steps = last["step_stats"][t]
        assert len(steps) == len(w.ORDERS) and len(m["reader_wait_s_per_step"]) == len(w.ORDERS)
        for st, order in zip(steps, w.ORDERS):
            assert st["microbatches_read"] == len(order)
            assert st["moved_bytes"] == sum(w.NUM_TOKENS[i] for i in order) * len(remote) * H * 4
            assert 0 <= st["reader_wait_s"] < 30
        for r in ranks[:-1]:
            for layer, nbytes in r["written_bytes"][t].items():  # every feature crossed exactly once
                assert nbytes == sum(seq_tokens) * H * 4
            assert all(0 < s < 5 for s in r["metrics"][t]["write_s_per_source"].values())


def test_pp1_local_channel_batch_major_tokens(reference):
    # PP=1: every tap is local; batch of 2 padded rows -> batch-major tokens, first n kept
    for m, (taps, hidden) in enumerate(reference["b2"]):
        n = MICRO_B2[m][3]
        assert sorted(taps) == w.TAP_LAYERS
        for layer, x in taps.items():
            assert torch.equal(x, hidden[layer].transpose(0, 1).reshape(-1, H)[:n])
