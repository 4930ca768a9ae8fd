"""The ``cuda_ipc`` handle set on CPU: which trainer ranks export, which GPU UUIDs the set covers,
and the error for an engine GPU no trainer rank sits on (pure functions, then the collective on a
gloo group with torch's CUDA export replaced by a stand-in that names the exporting rank). The real
CUDA export and vLLM's receiving engine run in tests/rl/test_weight_push_gpu.py (``gpu``)."""

from __future__ import annotations

import pytest
import torch

import _ipc_workers as w
from cotrain.distributed import spawn_local
from cotrain.weights import WeightPushError, manifest_of
from cotrain.weights.transports.cuda_ipc import (
    CudaIpcTransport,
    check_coverage,
    ipc_exporters,
    merge_handle_sets,
    restore_update_info,
)


def test_exporters_one_rank_per_engine_gpu_rank_zero_first():
    ranks = ["A", "B", "B", "C"]  # rank 2 shares rank 1's GPU (e.g. two TP ranks cannot, but be general)
    assert ipc_exporters(ranks, ["B", "A"]) == {"B": 1, "A": 0}
    assert ipc_exporters(ranks, ["C", "C", "B"]) == {"C": 3, "B": 1}  # duplicates (engine TP on one GPU) once
    assert ipc_exporters(["B", "A", "A"], ["A"]) == {"A": 1}  # the lowest rank on the GPU when it is not rank 0's
    assert ipc_exporters(["B", "A"], None) == {"B": 0}  # no engine GPUs reported: rank 0's GPU, as before
    with pytest.raises(WeightPushError, match=r"engine GPU\(s\) Z, Y host\(s\) no trainer rank .* on A, B, C"):
        ipc_exporters(ranks, ["A", "Z", "Y"])


def test_merge_and_coverage():
    parts = [[{"A": 1}, {"A": 2}], None, [{"C": 3}, {"C": 4}]]
    merged = merge_handle_sets(parts, 2)
    assert merged == [{"A": 1, "C": 3}, {"A": 2, "C": 4}]
    check_coverage(merged, ["A", "C"])
    with pytest.raises(WeightPushError, match="lacks GPU\\(s\\) B"):
        check_coverage(merged, ["A", "B"])
    with pytest.raises(WeightPushError, match="rank 2 exported 1 handles for 2 tensors"):
        merge_handle_sets([[{"A": 1}, {"A": 2}], None, [{"C": 3}]], 2)
    with pytest.raises(WeightPushError, match="GPU A exported twice"):
        merge_handle_sets([[{"A": 1}], [{"A": 2}]], 1)


def test_single_process_sender_holds_its_copy_until_release():
    tx = CudaIpcTransport("cpu", share=lambda t: ("args", t.shape[0]), uuid="A")
    st = w.state()
    h = tx.send(st, 4)
    assert h["transport"] == "cuda_ipc" and h["version"] == 4 and h["gpus"] == ["A"]
    assert h["manifest"] == manifest_of(st)
    # IPC rebuild arguments travel pickled (vLLM's msgpack channel to its engine core refuses them)
    assert "ipc_handles" not in h["update_info"] and isinstance(h["update_info"]["ipc_handles_pickled"], str)
    info = restore_update_info(h["update_info"])
    assert info["ipc_handles"] == [{"A": ("args", 3)}, {"A": ("args", 5)}, {"A": ("args", 2)}]
    assert info["names"] == list(st) and info["dtype_names"] == ["float32", "int64", "bfloat16"]
    assert tx.held() == 1
    tx.release(h)
    tx.release(h)  # idempotent
    assert tx.held() == 0
    with pytest.raises(WeightPushError, match="engine GPU\\(s\\) B host\\(s\\) no trainer rank"):
        CudaIpcTransport("cpu", engine_gpus=["A", "B"], share=repr, uuid="A").send(st, 5)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            CudaIpcTransport()


def test_collective_export_puts_a_copy_on_every_engine_gpu():
    """Three trainer ranks on GPU-0..2, engines on GPU-0 and GPU-2: rank 0 and rank 2 export (rank 2
    from a copy rank 0 sent it, equal to rank 0's tensors), rank 1 holds nothing; the handle on rank
    0 maps every tensor to both GPUs; every copy is dropped on release. An engine on a GPU without
    a trainer rank fails every rank alike, naming it (no rank is left waiting in a collective)."""
    out = spawn_local(w.export, 3, ["GPU-2", "GPU-0"], timeout_s=120)
    st = w.state()
    h = out[0]["handle"]
    assert out[1]["handle"] is None and out[2]["handle"] is None
    assert [o["held"] for o in out] == [1, 0, 1] and [o["held_after"] for o in out] == [0, 0, 0]
    assert h["gpus"] == ["GPU-0", "GPU-2"] and h["manifest"] == manifest_of(st)
    for (name, t), per_gpu in zip(st.items(), h["update_info"]["ipc_handles"]):
        want = t.float().flatten().tolist()
        assert per_gpu == {"GPU-0": ("rank", 0, want), "GPU-2": ("rank", 2, want)}, name
    bad = spawn_local(w.export, 3, ["GPU-1", "GPU-9"], timeout_s=120)
    assert all("GPU-9 host(s) no trainer rank" in b["error"] for b in bad)
    empty = spawn_local(w.export, 3, ["GPU-1"], True, timeout_s=120)  # rank 0 cannot stage: every rank hears it
    assert all("nothing to send" in e["error"] for e in empty)
