"""Tap specs, pipeline layouts, the layer-id convention, and a TapChannel whose taps are all local."""

import pytest
import torch

from cotrain.tapchannel import (
    PipelineLayout,
    TapChannel,
    TapError,
    TapSpec,
    TapSpecMismatchError,
    eagle3_default_layers,
    from_vllm_hidden_state_id,
    tap_bytes,
    tap_specs,
    to_vllm_hidden_state_id,
)


def test_layout_even_and_uneven():
    lay = PipelineLayout.even([4, 5, 6, 7], num_layers=8)
    assert [lay.stage_of_layer(i) for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert lay.reader_rank == 7 and lay.reader_stage == 3 and lay.first_layer(2) == 4
    un = PipelineLayout((0, 1, 2), (1, 4, 2))
    assert [un.stage_of_layer(i) for i in range(7)] == [0, 1, 1, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="outside"):
        un.stage_of_layer(7)
    with pytest.raises(ValueError, match="evenly"):
        PipelineLayout.even([0, 1, 2], 8)
    with pytest.raises(ValueError, match="repeat"):
        PipelineLayout((0, 0), (1, 1))
    assert PipelineLayout((0, 1), (2, 2), reader_stage=0).reader_rank == 0


def test_specs_resolve_stage_and_rank():
    lay = PipelineLayout.even([10, 11], num_layers=4)
    specs = tap_specs([3, 0, 2, 0], lay, width=16, dtype=torch.bfloat16)
    assert [(s.layer, s.stage, s.rank, s.dtype) for s in specs] == [
        (0, 0, 10, torch.bfloat16), (2, 1, 11, torch.bfloat16), (3, 1, 11, torch.bfloat16)]
    with pytest.raises(ValueError, match="stage 1"):
        TapSpec(0, 16, stage=1).resolve(lay)
    with pytest.raises(ValueError):
        TapSpec(-1, 16)
    with pytest.raises(ValueError):
        TapSpec(0, 16, torch.complex64)


def test_vllm_ids():
    # ours: output of layer i; vLLM: residual stream entering layer L
    assert to_vllm_hidden_state_id(0) == 1 and from_vllm_hidden_state_id(8) == 7
    with pytest.raises(ValueError, match="embeddings"):
        from_vllm_hidden_state_id(0)
    assert eagle3_default_layers(8) == [1, 3, 4]  # vLLM (2, 4, 5)


def test_tap_bytes_formula():
    lay = PipelineLayout.even([0, 1], num_layers=4)
    specs = [TapSpec(0, 64).resolve(lay), TapSpec(3, 32, torch.bfloat16).resolve(lay)]
    assert tap_bytes(10, specs) == 10 * 64 * 4 + 10 * 32 * 2


def test_local_channel_reads_in_place_and_checks_usage():
    lay = PipelineLayout.even([0], num_layers=4)
    ch = TapChannel(tap_specs([1, 3], lay, 8), lay, "shm", max_tokens=5)  # no torch.distributed needed
    assert ch.transport is None and ch.is_reader and ch.my_layers == [1, 3]
    with pytest.raises(TapError, match="begin_step"):
        ch.write(1, 0, torch.zeros(2, 8))
    ch.begin_step(2)
    a, b = torch.randn(5, 8), torch.randn(3, 8)
    ch.write(1, 0, a)
    with pytest.raises(TapError, match="not written yet"):
        ch.read(0)
    ch.write(3, 0, b)
    with pytest.raises(TapSpecMismatchError):
        ch.write(1, 1, torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(TapError, match="in order"):
        ch.write(3, 0, b)
    taps = ch.read(0)
    assert taps[1] is not a and taps[1].data_ptr() == a.data_ptr() and torch.equal(taps[3], b)  # detached view
    assert ch.metrics.bytes_per_microbatch[0] == 5 * 8 * 4 + 3 * 8 * 4
    with pytest.raises(TapError, match="never read"):
        ch.end_step()


def test_slots_must_cover_the_pipeline_depth():
    lay = PipelineLayout.even([0, 1, 2, 3], num_layers=4)
    with pytest.raises(ValueError, match="slots=3 < 4"):
        TapChannel(tap_specs([0], lay, 8), lay, "shm", max_tokens=4, slots=3)
    with pytest.raises(ValueError, match="torch.distributed"):  # slots=2 is enough for a tap from stage 2
        TapChannel(tap_specs([2], lay, 8), lay, "shm", max_tokens=4, slots=2)
