"""Rollout pieces that need no engine: transports, push validation, the sampler repair, splitting.

Fast (no vLLM engine, no Ray). The GPU transports (vLLM's engines) are in test_weight_transfer.py
(their cotrain side, with stand-in engines) and test_weight_push_gpu.py (``gpu`` marker).
"""

from __future__ import annotations

import os

import pytest
import torch

from cotrain.weights import WeightPushError, check_manifest, make_transport, manifest_of, receiver_for, resolve_transport_name
from cotrain.weights.transports.shm import ShmTransport


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = {"a.weight": torch.randn(3, 4, generator=g), "b.bias": torch.arange(5),
         "c.weight": torch.randn(2, 2, generator=g).to(torch.bfloat16)}
    w["tied.weight"] = w["a.weight"]  # shares storage: safetensors would refuse it as is
    return w


EXPECTED = {"a.weight": ([3, 4], "float32"), "b.bias": ([5], "int64"), "c.weight": ([2, 2], "bfloat16"),
            "tied.weight": ([3, 4], "float32")}


# ------------------------------------------------------------------------------------ shm
def test_shm_round_trip_and_release(tmp_path):
    t = ShmTransport(str(tmp_path))
    w = _weights()
    h = t.send(w, 7)
    assert h["transport"] == "shm" and h["version"] == 7 and os.path.exists(h["path"])
    assert [row[0] for row in h["manifest"]] == list(w)  # the sender's order
    got = receiver_for(h).receive(h)  # a fresh receiver, as in the engine process
    assert list(got) == list(w)
    for n in w:
        assert got[n].dtype == w[n].dtype and torch.equal(got[n], w[n])
    t.release(h)
    assert not os.path.exists(h["path"])
    t.release(h)  # idempotent
    with pytest.raises(WeightPushError, match="does not exist"):
        receiver_for(h).receive(h)


def test_shm_defaults_to_dev_shm():
    assert ShmTransport().directory in ("/dev/shm", __import__("tempfile").gettempdir())


def test_transport_factory():
    assert resolve_transport_name("auto") == ("cuda_ipc" if torch.cuda.is_available() else "shm")
    assert resolve_transport_name("auto", colocated=False) == ("nccl" if torch.cuda.is_available() else "shm")
    assert isinstance(make_transport("shm"), ShmTransport)
    with pytest.raises(ValueError, match="allowed: auto, shm, object_store, cuda_ipc, nccl"):
        make_transport("carrier-pigeon")
    with pytest.raises(ValueError, match="master_addr, master_port, world_size"):
        make_transport("nccl")
    with pytest.raises(WeightPushError, match="allowed: shm, object_store, cuda_ipc, nccl"):
        receiver_for({"transport": "floppy", "version": 1, "manifest": []})
    for name, backend in (("nccl", "'nccl'"), ("cuda_ipc", "'ipc'")):  # vLLM's engines receive those
        with pytest.raises(WeightPushError, match=f"received by vLLM's {backend} weight-transfer engine"):
            receiver_for({"transport": name, "version": 1, "manifest": []})


# ------------------------------------------------------------------------------- manifests
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


def test_shared_with_target_is_by_identity():
    from cotrain.rl.vllm.manifest import shared_with_target
    from cotrain.weights import shared_name_reasons

    target = torch.nn.Module()
    target.lm_head = torch.nn.Linear(4, 4)
    target.model = torch.nn.Module()
    target.model.embed_tokens = torch.nn.Embedding(8, 4)
    draft = torch.nn.Module()
    draft.lm_head = target.lm_head  # borrowed (EAGLE-3 / DFlash without their own head)
    draft.model = torch.nn.Module()
    draft.model.embed_tokens = torch.nn.Embedding(8, 4)  # its own (a separate draft model)
    assert shared_with_target(draft, target) == {"lm_head"}
    names = ["lm_head.weight", "model.embed_tokens.weight", "fc.weight", "model.lm_head_bias"]
    assert list(shared_name_reasons(names, {"lm_head"})) == ["lm_head.weight"]
    assert list(shared_name_reasons(names, {"lm_head", "embed_tokens"})) == names[:2]


def test_checkpoint_manifest_reads_headers(tmp_path):
    from safetensors.torch import save_file

    from cotrain.rl.vllm.manifest import checkpoint_manifest

    save_file({"x": torch.zeros(2, 3), "y": torch.zeros(4, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    assert checkpoint_manifest(tmp_path) == {"x": ([2, 3], "float32"), "y": ([4], "bfloat16")}
    with pytest.raises(WeightPushError, match="no safetensors checkpoint"):
        checkpoint_manifest(tmp_path / "nothing")


# ------------------------------------------------------------------- sampler repair (pure)
def test_expand_batch_to_tokens_matches_definition():
    from cotrain.rl.vllm.sampler_fix import _expand_batch_to_tokens

    x = torch.tensor([0.5, -1.0, 2.0])
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = _expand_batch_to_tokens(x, cu, 6, replace_from=-1, replace_to=1)
    assert out.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 2.0]
    k = torch.tensor([3, 0], dtype=torch.int64)
    assert _expand_batch_to_tokens(k, torch.tensor([1, 3]), 3).tolist() == [3, 0, 0]
    assert _expand_batch_to_tokens(x[:0], cu[:0], 0).numel() == 0


def test_cpu_repair_replaces_vllm_function():
    pytest.importorskip("vllm")
    from cotrain.rl.vllm import sampler_fix
    from vllm.v1.sample import rejection_sampler as rs

    if torch.cuda.is_available() or os.environ.get("COTRAIN_VLLM_SAMPLER_FIX") == "0":
        pytest.skip("the repair applies on CPU only, unless disabled")
    assert sampler_fix.install_cpu_rejection_sampler_fix()
    assert rs.expand_batch_to_tokens is sampler_fix._expand_batch_to_tokens
    assert sampler_fix.cpu_rejection_sampler_fixed()


# ---------------------------------------------------------------------------- splitting etc.
def test_split_evenly():
    from cotrain.rl.rollout import split_evenly

    assert split_evenly(5, 2) == [(0, 3), (3, 5)]
    assert split_evenly(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert split_evenly(0, 2) == [(0, 0), (0, 0)]


def test_speculative_config_builder():
    from cotrain.rl.vllm.engine import speculative_config

    assert speculative_config(None) is None
    assert speculative_config("ngram", num_speculative_tokens=3, prompt_lookup_max=5) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5}
    assert speculative_config("draft_model", num_speculative_tokens=2, draft_model="/d",
                              draft_sample_method="probabilistic") == {
        "method": "draft_model", "num_speculative_tokens": 2, "model": "/d", "draft_sample_method": "probabilistic"}
    with pytest.raises(ValueError, match="needs draft_model"):
        speculative_config("eagle3", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="num_speculative_tokens >= 1"):
        speculative_config("ngram")


def test_engine_spec_from_config(tmp_path):
    from cotrain.config import load_config
    from cotrain.rl.rollout import engine_spec_from_config, sampling_from_config

    cfg = load_config("configs/grpo.yaml", ["rollout.speculative.method=ngram",
                                            "rollout.speculative.num_speculative_tokens=2",
                                            "rollout.speculative.ngram.prompt_lookup_max=3"])
    spec = engine_spec_from_config(cfg, model_path=str(tmp_path))
    assert spec.model_path == str(tmp_path) and spec.max_model_len == cfg.policy.max_seq_len
    assert spec.speculative == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                "prompt_lookup_max": 3}
    assert spec.kv_cache_memory_bytes == 256 * 2**20 and spec.enforce_eager is True
    s = sampling_from_config(cfg, seed=3)
    assert (s.temperature, s.max_tokens, s.seed) == (1.0, 16, 3)


def test_engine_memory_defaults_are_the_configs(monkeypatch):
    """An engine built outside a run (engine_kwargs) and a run's validated rollout section take the
    same values for the keys left null: on cpu 256 MiB of KV cache and eager, on cuda 0.85 of the
    device (0.4 colocated, the run only)."""
    from cotrain.config import load_config
    from cotrain.rl.vllm.engine import engine_kwargs

    cfg = load_config("configs/grpo.yaml")
    kw = engine_kwargs("m")
    assert (kw["kv_cache_memory_bytes"], kw["enforce_eager"]) == (cfg.rollout.kv_cache_memory_bytes, True) == \
        (256 * 2**20, True)
    assert "gpu_memory_utilization" not in kw and cfg.rollout.gpu_memory_utilization is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    kw = engine_kwargs("m")
    gpu = load_config("configs/grpo.yaml", ["cluster.device=cuda", "cluster.gpus_per_node=2"])
    assert kw["gpu_memory_utilization"] == gpu.rollout.gpu_memory_utilization == 0.85
    assert "kv_cache_memory_bytes" not in kw and kw["enforce_eager"] is False
    assert engine_kwargs("m", kv_cache_memory_bytes=5)["kv_cache_memory_bytes"] == 5  # an explicit size alone


def test_push_through_releases_whatever_the_load_does():
    from cotrain.weights import WeightPushError, WeightTransport, push_through

    class Recording(WeightTransport):
        name = "rec"

        def __init__(self):
            self.log = []

        def send(self, named_tensors, version):
            self.log.append(("send", version))
            return {"version": version}

        def receive(self, handle):
            raise NotImplementedError

        def release(self, handle):
            self.log.append(("release", handle["version"]))

    t = Recording()
    stats = push_through(t, {}, 3, lambda h: {"push_s": 1.0, "seen": h["version"]})
    assert stats["seen"] == 3 and stats["send_s"] >= 0 and t.log == [("send", 3), ("release", 3)]

    def reject(h):
        t.log.append(("load", h["version"]))
        raise WeightPushError("rejected")

    with pytest.raises(WeightPushError, match="rejected"):
        push_through(t, {}, 4, reject)
    assert t.log[2:] == [("send", 4), ("load", 4), ("release", 4)]


def test_draft_pushes_need_a_drafter_network():
    from cotrain.rl.vllm.client import require_drafter

    require_drafter({"method": "draft_model", "model": "/d"})
    with pytest.raises(WeightPushError, match="without speculative decoding"):
        require_drafter(None)
    with pytest.raises(WeightPushError, match="'ngram' has no drafter weights"):
        require_drafter({"method": "ngram"})
