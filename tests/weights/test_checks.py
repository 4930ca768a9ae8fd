"""What a weight handle must be: the manifest check and the one check of a push on its way in."""

from __future__ import annotations

import pytest
import torch

from _named_tensors import sample_weights as _weights

from cotrain.weights import WeightPushError, check_manifest, check_push, manifest_of


EXPECTED = {"a.weight": ([3, 4], "float32"), "b.bias": ([5], "int64"), "c.weight": ([2, 2], "bfloat16"),
            "tied.weight": ([3, 4], "float32")}


def test_check_manifest_accepts_a_full_push_and_float_casts():
    check_manifest(manifest_of(_weights()), EXPECTED)
    m = manifest_of(_weights())
    m[0][2] = "bfloat16"  # fp32 parameter, bf16 push: the engine casts on load
    check_manifest(m, EXPECTED)


@pytest.mark.parametrize("mutate, pattern", [
    (lambda m: m.append(["z.weight", [1], "float32"]), r"1 unknown name\(s\): 'z.weight' .*named like"),
    (lambda m: m.pop(1), r"1 missing name\(s\): 'b.bias' \(a policy push must carry all 4 tensors\)"),
    (lambda m: m[0].__setitem__(1, [4, 3]), r"1 shape mismatch\(es\): 'a.weight' expected \[3, 4\] got \[4, 3\]"),
    (lambda m: m[1].__setitem__(2, "float32"), r"1 dtype mismatch\(es\): 'b.bias' expected int64 got float32"),
    (lambda m: m.append(list(m[0])), r"1 duplicated name\(s\): 'a.weight'"),
])
def test_check_manifest_names_the_offenders(mutate, pattern):
    m = manifest_of(_weights())
    mutate(m)
    with pytest.raises(WeightPushError, match=pattern):
        check_manifest(m, EXPECTED)


def test_check_manifest_forbidden_names():
    m = manifest_of(_weights()) + [["lm_head.weight", [3, 4], "float32"]]
    with pytest.raises(WeightPushError, match=r"not allowed in a draft push: 'lm_head.weight' \(shared\)"):
        check_manifest(m, EXPECTED, kind="draft", forbidden={"lm_head.weight": "shared"})


def test_check_push_checks_the_handle_its_payload_and_its_manifest():
    w = _weights()
    h = {"transport": "shm", "version": 1, "manifest": manifest_of(w), "path": "/nowhere"}
    check_push(h, EXPECTED)  # nothing is read: the check needs only the handle
    with pytest.raises(WeightPushError, match="not a weight handle: list"):
        check_push([h], EXPECTED)
    with pytest.raises(WeightPushError, match=r"'floppy' is unknown \(allowed: shm, object_store, cuda_ipc, nccl\)"):
        check_push(dict(h, transport="floppy"), EXPECTED)
    with pytest.raises(WeightPushError, match="shm handle lacks 'version'"):
        check_push({k: v for k, v in h.items() if k != "version"}, EXPECTED)
    # GPU transports: vLLM's payload must be the manifest
    info = {"names": list(w), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in w.values()],
            "shapes": [list(t.shape) for t in w.values()]}
    g = {"transport": "nccl", "version": 2, "manifest": manifest_of(w), "update_info": info}
    check_push(g, EXPECTED)
    with pytest.raises(WeightPushError, match="differs from its vLLM update_info"):
        check_push(dict(g, update_info=dict(info, shapes=[[4, 3], [5], [2, 2], [3, 4]])), EXPECTED)
    with pytest.raises(WeightPushError, match="lacks vLLM's update_info"):
        check_push({k: v for k, v in g.items() if k != "update_info"}, EXPECTED)
    # a draft push must not carry what the drafter borrows, and must carry everything else
    d = dict(h, manifest=manifest_of(w) + [["lm_head.weight", [3, 4], "float32"]])
    with pytest.raises(WeightPushError, match=r"draft weight push rejected: 1 name\(s\) not allowed .*'lm_head.weight'"):
        check_push(d, EXPECTED, {"lm_head"}, kind="draft")
    with pytest.raises(WeightPushError, match=r"missing name\(s\): 'b.bias'"):
        check_push(dict(h, manifest=[r for r in manifest_of(w) if r[0] != "b.bias"]), EXPECTED)

