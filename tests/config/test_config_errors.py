"""Every validation error of cotrain.config, each naming its key and what is allowed; the co-trained
drafter's checks (draft.init against the policy); suffix decoding's. Pure Python, a few seconds."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from cotrain.config import load_config
from _config_helpers import CONFIGS, DEMO, write, error_of, assert_issue


# --------------------------------------------------------------------- every validation error
@pytest.fixture
def hf_model(tmp_path):
    d = tmp_path / "hf6"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(num_hidden_layers=6, num_attention_heads=6,
                                                   num_key_value_heads=3, hidden_size=96,
                                                   max_position_embeddings=512, model_type="llama")))
    return d


@pytest.fixture
def files(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3)))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    return {"jsonl": jsonl, "drafter": drafter, "tmp": tmp_path}


CUDA2 = ["cluster.device=cuda", "cluster.gpus_per_node=2"]
ERROR_CASES = [
    # (id, overrides, path, fragments naming the allowed values)
    ("pp_layers", ["policy.parallel.pipeline=3"], "policy.parallel.pipeline",
     ["3 does not divide num_hidden_layers=4", "allowed: 1, 2, 4"]),
    ("tp_heads", ["policy.parallel.tensor=3"], "policy.parallel.tensor", ["num_attention_heads=4", "allowed: 1, 2"]),
    ("tp_kv_heads", ["policy.parallel.tensor=4", "cluster.cpus_per_node=8"], "policy.parallel.tensor",
     ["num_key_value_heads=2", "allowed: 1, 2"]),
    ("rollout_tp_heads", ["rollout.tensor_parallel=3"], "rollout.tensor_parallel", ["allowed: 1, 2, 4"]),
    ("cp_zigzag", ["policy.parallel.context=3"], "policy.parallel.context",
     ["2*context=6", "allowed: 1, 2, 4, 8"]),
    ("seq_len_model", ["policy.max_seq_len=512"], "policy.max_seq_len", ["max_position_embeddings=256",
                                                                        "allowed: 2..256"]),
    ("max_tokens", ["rollout.sampling.max_tokens=128"], "rollout.sampling.max_tokens", ["allowed: 1..127"]),
    ("world_too_big", ["policy.parallel.data=8"], "policy.parallel", ["TP*PP*CP*DP = 1*1*1*8 = 8",
                                                                     "allowed: world size <= 4"]),
    ("world_plus_rollout", ["policy.parallel.data=4"], "policy.parallel",
     ["rollout.num_engines=1", "allowed: training + rollout <= 4)"]),
    ("colocate_cpu", ["rollout.colocate=true"], "rollout.colocate",
     ["needs cluster.device=cuda", "vLLM's CPU backend has no sleep mode", "allowed on cpu: false"]),
    ("engines_fit", ["rollout.num_engines=5"], "rollout.num_engines", ["allowed: at most 4 engines"]),
    ("engines_fit_gpu", [*CUDA2, "rollout.num_engines=3"], "rollout.num_engines", ["GPUs", "at most 2 engines"]),
    ("world_gpu", [*CUDA2, "policy.parallel.data=2"], "policy.parallel",
     ["GPUs", "allowed: training + rollout <= 2, or rollout.colocate=true"]),
    ("cuda_no_gpus", ["cluster.device=cuda"], "cluster.device", ["gpus_per_node", "allowed: cpu, auto"]),
    ("engine_tp_node", [*CUDA2, "rollout.tensor_parallel=4", "cluster.num_nodes=2"], "rollout.tensor_parallel",
     ["one node", "allowed: 1..2"]),
    ("gpus_per_engine", ["cluster.device=cuda", "cluster.gpus_per_node=4", "rollout.tensor_parallel=2",
                         "rollout.gpus_per_engine=1"], "rollout.gpus_per_engine", ["allowed: >= 2"]),
    ("group_size", ["grpo.group_size=1"], "grpo.group_size", ["allowed: >= 2"]),
    ("min_groups_with_signal", ["grpo.prompts_per_step=8", "grpo.min_groups_with_signal=9"],
     "grpo.min_groups_with_signal", ["no step would ever update", "allowed: 0..8"]),
    ("budget_no_drafter", ["draft.budget.mode=adaptive"], "draft.budget", ["needs a co-trained drafter"]),
    ("budget_fixed", ["draft.kind=dflash", "draft.budget.replay_steps=2"], "draft.budget.replay_steps",
     ["acts only with draft.budget.mode=adaptive"]),
    ("budget_fixed_measure", ["draft.kind=dflash", "draft.budget.measure_idle=true"], "draft.budget.measure_idle",
     ["acts only with draft.budget.mode=adaptive"]),
    ("budget_no_replay", ["draft.kind=dflash", "draft.budget.mode=adaptive", "draft.budget.max_steps=1", "draft.budget.replay_max_mib=64"],
     "draft.budget.replay_max_mib", ["acts only with draft.budget.max_steps > 1"]),
    ("budget_on_policy", ["draft.kind=dflash", "draft.budget.mode=adaptive", "draft.budget.max_steps=2", "draft.branches=on_policy",
                          "draft.loss=e2e_tv"], "draft.budget.max_steps", ["allowed with on_policy: 1"]),
    ("batch_divisible", ["policy.packing=false", "grpo.prompts_per_step=3", "policy.micro_batch_size=8"],
     "grpo.prompts_per_step",
     ["3*4 = 12", "policy.parallel.data*policy.micro_batch_size = 1*8 = 8", "allowed prompts_per_step: 2, 4, 6"]),
    ("global_batch_divides", ["policy.packing=false", "grpo.global_batch_size=12"], "grpo.global_batch_size",
     ["does not divide", "allowed: 4, 8, 16, 32"]),
    ("global_batch_micro", ["policy.packing=false", "grpo.global_batch_size=2"], "grpo.global_batch_size",
     ["not a multiple", "allowed: 4, 8, 16, 32"]),
    ("packed_global_batch_dp", ["policy.parallel.data=2", "grpo.global_batch_size=3"], "grpo.global_batch_size",
     ["does not divide", "allowed: 2, 4, 8, 16, 32"]),
    ("packed_budget", ["policy.max_tokens_per_microbatch=100"], "policy.max_tokens_per_microbatch",
     ["below the longest sequence's 128 tokens", "allowed policy.max_tokens_per_microbatch: >= 128"]),
    ("padded_budget", ["policy.packing=false", "policy.max_tokens_per_microbatch=512"],
     "policy.max_tokens_per_microbatch", ["acts only with policy.packing=true"]),
    ("num_steps", ["grpo.num_steps=0"], "grpo.num_steps", ["allowed: >= 1"]),
    ("checkpoint_every", ["checkpoint.every=0"], "checkpoint.every", ["allowed: >= 1"]),
    ("kl_needs_reference", ["grpo.kl_coef=0.1"], "grpo.kl_coef", ["policy.reference_model=true", "allowed: 0"]),
    ("spec_needs_drafter", ["rollout.speculative.method=eagle3"], "rollout.speculative.method",
     ["draft.kind=eagle3", "rollout.speculative.draft_model", "allowed with draft.kind=null: null, ngram, draft_model"]),
    ("spec_kind_mismatch", ["rollout.speculative.method=dflash", "draft.kind=eagle3"], "rollout.speculative.method",
     ["draft.kind=dflash (got eagle3)", "allowed with draft.kind=eagle3: null, ngram, draft_model, eagle3"]),
    ("spec_unknown", ["rollout.speculative.method=medusa"], "rollout.speculative.method",
     ["allowed: null, ngram, draft_model, eagle3, dflash, dspark"]),
    ("draft_model_required", ["rollout.speculative.method=draft_model"], "rollout.speculative.draft_model",
     ["required by method draft_model"]),
    ("draft_model_missing", ["rollout.speculative.method=draft_model", "rollout.speculative.draft_model=/no/such"],
     "rollout.speculative.draft_model", ["does not exist"]),
    ("dspark_cpu", ["rollout.speculative.method=dspark", "draft.kind=dspark"], "rollout.speculative.method",
     ["not supported by vLLM", "allowed on cpu: null, ngram, draft_model, eagle3, dflash",
      "rollout.speculative.method=null", "draft.cotrain=true"]),
    ("spec_tokens_block", ["draft.kind=dflash", "draft.dflash.block_size=4", "rollout.speculative.method=dflash",
                           "rollout.speculative.num_speculative_tokens=5"],
     "rollout.speculative.num_speculative_tokens", ["predicts per block (3", "allowed: 1..3"]),
    ("ngram_range", ["rollout.speculative.method=ngram", "rollout.speculative.ngram.prompt_lookup_min=5"],
     "rollout.speculative.ngram.prompt_lookup_min", ["allowed: <= prompt_lookup_max"]),
    ("tap_range_eagle3", ["draft.kind=eagle3", "draft.eagle3.tap_layers=[1, 7]"], "draft.eagle3.tap_layers[1]",
     ["7 is not a layer", "allowed: 0..3"]),
    ("tap_range_dflash", ["draft.kind=dflash", "draft.dflash.tap_layers=[4]"], "draft.dflash.tap_layers[0]",
     ["allowed: 0..3"]),
    ("tap_range_dspark", ["draft.kind=dspark", "draft.dspark.tap_layers=[0, 9]"], "draft.dspark.tap_layers[1]",
     ["allowed: 0..3"]),
    ("tap_negative", ["draft.kind=eagle3", "draft.eagle3.tap_layers=[-1]"], "draft.eagle3.tap_layers[0]",
     ["allowed: >= 0"]),
    ("tap_duplicate", ["draft.kind=eagle3", "draft.eagle3.tap_layers=[1, 1]"], "draft.eagle3.tap_layers",
     ["duplicates", "0..3"]),
    ("tap_empty", ["draft.kind=dflash", "draft.dflash.tap_layers=[]"], "draft.dflash.tap_layers",
     ["at least one", "0..3"]),
    ("block_size_dflash", ["draft.kind=dflash", "draft.dflash.block_size=1"], "draft.dflash.block_size",
     ["allowed: >= 2"]),
    ("block_size_dspark", ["draft.dspark.block_size=1"], "draft.dspark.block_size", ["allowed: >= 2"]),
    ("ttt_steps", ["draft.kind=eagle3", "draft.eagle3.ttt_steps=0"], "draft.eagle3.ttt_steps", ["allowed: >= 1"]),
    ("draft_kind", ["draft.kind=medusa"], "draft.kind", ["allowed: null, eagle3, dflash, dspark"]),
    ("draft_loss_kind", ["draft.kind=eagle3", "draft.loss=dspark_l1"], "draft.loss",
     ["allowed: soft_ce, forward_kl, hard_ce, e2e_tv"]),
    ("draft_loss_value", ["draft.loss=mse"], "draft.loss",
     ["is not a drafter loss (allowed: null, soft_ce, forward_kl, hard_ce, e2e_tv, accept_weighted_tv, dspark_l1)"]),
    ("draft_fixed_random", ["draft.kind=eagle3", "draft.cotrain=false"], "draft.cotrain",
     ["stay random", "rollout.speculative.draft_model"]),
    ("markov_head", ["draft.dspark.markov_head=deep"], "draft.dspark.markov_head", ["allowed: vanilla, gated"]),
    ("jsonl_required", ["data.task=jsonl"], "data.jsonl.path", ["required when data.task=jsonl"]),
    ("jsonl_missing", ["data.task=jsonl", "data.jsonl.path=/no/such.jsonl"], "data.jsonl.path", ["does not exist"]),
    ("jsonl_short", ["data.task=jsonl", "data.jsonl.path={jsonl}"], "data.jsonl.path", ["has 3 prompts",
                                                                                      "allowed: a file with >= 8"]),
    ("task_value", ["data.task=csv"], "data.task", ["allowed: arithmetic, gcd, jsonl"]),
    ("arith_prompts", ["data.arithmetic.num_prompts=4"], "data.arithmetic.num_prompts", ["allowed: >= 8"]),
    ("arith_ops", ["data.arithmetic.ops=['/']"], "data.arithmetic.ops[0]", ["allowed: +, -, *"]),
    ("eval_path", ["data.eval.path=/no/such.jsonl"], "data.eval.path", ["does not exist"]),
    ("reward_order", ["reward.correct=0.0"], "reward.correct", ["allowed: > 0"]),
    ("reward_kind", ["reward.kind=f1"], "reward.kind", ["allowed: exact_match"]),
    ("model_missing", ["policy.model_path=/no/such/model"], "policy.model_path",
     ["does not exist", "allowed: builtin:tiny"]),
    ("model_no_config", ["policy.model_path={tmp}"], "policy.model_path", ["no config.json"]),
    ("model_builtin", ["policy.model_path=builtin:huge"], "policy.model_path", ["allowed: builtin:tiny"]),
    ("dtype", ["policy.dtype=fp16"], "policy.dtype", ["allowed: float32, bfloat16"]),
    ("resume_path", ["checkpoint.resume=/no/such/ckpt"], "checkpoint.resume", ["does not exist"]),
    ("transport_cpu", ["rollout.weight_transport=nccl"], "rollout.weight_transport",
     ["needs cluster.device=cuda", "allowed on cpu: shm"]),
    ("transport_ipc", [*CUDA2, "rollout.weight_transport=cuda_ipc", "policy.parallel.data=1"],
     "rollout.weight_transport", ["rollout.colocate=true", "allowed: nccl"]),
    ("transport_shm_nodes", ["cluster.num_nodes=2", "rollout.weight_transport=shm"], "rollout.weight_transport",
     ["one node", "allowed: nccl"]),
    ("kv_exclusive", ["rollout.kv_cache_memory_bytes=1000000", "rollout.gpu_memory_utilization=0.5"],
     "rollout.kv_cache_memory_bytes", ["exclusive", "allowed: set one"]),
    ("mem_range", ["rollout.gpu_memory_utilization=1.5"], "rollout.gpu_memory_utilization", ["allowed: <= 1"]),
    ("device_value", ["cluster.device=gpu"], "cluster.device", ["allowed: auto, cpu, cuda"]),
    ("ray_address", ["cluster.ray_address='foo bar'"], "cluster.ray_address", ["allowed: null, 'local', 'auto'"]),
    ("top_k", ["rollout.sampling.top_k=0"], "rollout.sampling.top_k", ["allowed: -1"]),
    ("top_p", ["rollout.sampling.top_p=0"], "rollout.sampling.top_p", ["allowed: > 0"]),
    ("run_name", ["run.name='a b'"], "run.name", ["[A-Za-z0-9._-]"]),
    ("betas_len", ["policy.optimizer.betas=[0.9]"], "policy.optimizer.betas", ["at least 2"]),
    ("sample_method", ["rollout.speculative.draft_sample_method=beam"], "rollout.speculative.draft_sample_method",
     ["allowed: greedy, probabilistic"]),
    ("baseline", ["grpo.baseline=median"], "grpo.baseline", ["allowed: mean, leave_one_out"]),
    ("loss_agg", ["grpo.loss_agg=sum"], "grpo.loss_agg", ["allowed: token_mean, seq_mean"]),
]


@pytest.mark.parametrize("overrides,path,fragments", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_validation_error(overrides, path, fragments, files):
    overrides = [o.format(**files) for o in overrides]
    assert_issue(error_of(overrides), path, *fragments)


def test_hf_checkpoint_architecture(hf_model):
    cfg = load_config(DEMO, [f"policy.model_path={hf_model}", "policy.max_seq_len=128", "policy.parallel.tensor=3",
                             "policy.micro_batch_size=2", "cluster.cpus_per_node=8"])
    assert cfg.model_arch.num_hidden_layers == 6 and cfg.model_arch.model_type == "llama"
    err = error_of([f"policy.model_path={hf_model}", "policy.parallel.pipeline=4"])
    assert_issue(err, "policy.parallel.pipeline", "num_hidden_layers=6", "allowed: 1, 2, 3, 6")
    bad = hf_model.parent / "broken"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert_issue(error_of([f"policy.model_path={bad}"]), "policy.model_path", "num_hidden_layers")


def test_valid_variants(files):
    """Combinations near the limits that must pass."""
    load_config(DEMO, ["cluster.device=cuda", "cluster.gpus_per_node=4", "policy.parallel.data=4",
                       "rollout.colocate=true"])
    load_config(DEMO, ["rollout.speculative.method=eagle3", f"rollout.speculative.draft_model={files['drafter']}"])
    load_config(DEMO, ["draft.kind=eagle3", "draft.cotrain=false", f"rollout.speculative.draft_model={files['drafter']}"])
    load_config(DEMO, ["data.task=jsonl", f"data.jsonl.path={files['jsonl']}", "grpo.prompts_per_step=2"])
    cfg = load_config(CONFIGS / "demo_dspark.yaml", [*CUDA2, "rollout.speculative.method=dspark"])
    assert cfg.rollout.weight_transport == "nccl" and cfg.rollout.gpus_per_engine == 1.0
    assert cfg.rollout.speculative.num_speculative_tokens == 7      # dspark: a block of 7 drafts 7 tokens
    assert cfg.draft.loss == "dspark_l1"
    cfg = load_config(DEMO, ["policy.parallel.context=2", "policy.parallel.pipeline=2", "cluster.cpus_per_node=5"])
    assert cfg.world_size == 4


# ----------------------------------------------------------------------------- the co-trained drafter
def _fake_drafter(dirpath: Path, kind="dflash", hidden=128, vocab=None, tap_layers=(0, 3), num_layers=1) -> Path:
    from cotrain.models.tiny import TINY_QWEN3_CONFIG
    from cotrain.models.tiny import VOCAB_SIZE

    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "config.json").write_text(json.dumps({
        "target_hidden_size": hidden, "hidden_size": hidden, "vocab_size": vocab or VOCAB_SIZE,
        "num_hidden_layers": num_layers, "cotrain": {"kind": kind, "tap_layers": list(tap_layers)}}))
    (dirpath / "cotrain_drafter.json").write_text(json.dumps({
        "kind": kind, "tap_layers": list(tap_layers),
        "settings": {"tap_layers": list(tap_layers), "num_layers": num_layers}}))
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(4, 4)}, str(dirpath / "model.safetensors"))  # a complete file
    assert TINY_QWEN3_CONFIG["hidden_size"] == 128
    return dirpath


COTRAIN_DFLASH = ["draft.kind=dflash", "draft.cotrain=true", "rollout.speculative.method=dflash"]


def _truncated(drafter: Path) -> Path:
    f = drafter / "model.safetensors"
    f.write_bytes(f.read_bytes()[:80])
    return drafter


def test_draft_init_directory_is_checked_against_the_policy_and_the_kind(tmp_path):
    ok = _fake_drafter(tmp_path / "ok")
    cfg = load_config(DEMO, [*COTRAIN_DFLASH, f"draft.init={ok}"])
    assert cfg.draft.init == str(ok)
    cases = [
        (_fake_drafter(tmp_path / "h", hidden=256), "draft.init", "made for hidden size 256, the policy's is 128"),
        (_fake_drafter(tmp_path / "v", vocab=999), "draft.init", "made for a vocabulary of 999"),
        (_fake_drafter(tmp_path / "k", kind="eagle3"), "draft.init", "is a eagle3 drafter, draft.kind is dflash"),
        (_fake_drafter(tmp_path / "t", tap_layers=(1, 2)), "draft.dflash.tap_layers", "differs from the drafter in"),
        (_fake_drafter(tmp_path / "n", num_layers=2), "draft.dflash.num_layers", "set it to 2"),
        (tmp_path / "nothing", "draft.init", "is not a drafter directory"),
        (_truncated(_fake_drafter(tmp_path / "cut")), "draft.init", "model.safetensors: 80 bytes, its header needs"),
    ]
    for path, key, fragment in cases:
        assert_issue(error_of([*COTRAIN_DFLASH, f"draft.init={path}"]), key, fragment)


def test_draft_init_from_a_distill_config(tmp_path):
    cfg = load_config(DEMO, [*COTRAIN_DFLASH, "draft.init=distill:configs/distill_dflash.yaml"])
    assert cfg.draft.settings.tap_layers == [0, 3]
    assert_issue(error_of([*COTRAIN_DFLASH, "draft.init=distill:configs/distill_eagle3.yaml"]),
                 "draft.init", "is a eagle3 drafter, draft.kind is dflash")
    assert_issue(error_of([*COTRAIN_DFLASH, "draft.init=distill:configs/nope.yaml"]), "draft.init", "does not exist")
    bad = write(tmp_path, "bad.yaml", "draft: {kind: dflash, lr: 3}\n")
    assert_issue(error_of([*COTRAIN_DFLASH, f"draft.init=distill:{bad}"]), "draft.init", "not a valid distill config")


def test_cotraining_refuses_what_it_cannot_act_on():
    assert_issue(error_of([*COTRAIN_DFLASH, "rollout.speculative.draft_model=configs"]),
                 "rollout.speculative.draft_model", "must be null with draft.cotrain=true")
    assert_issue(error_of([*COTRAIN_DFLASH, "draft.tap_transport=nccl"]), "draft.tap_transport", "needs cluster.device=cuda")
    frozen = ["draft.kind=dflash", "draft.cotrain=false", "rollout.speculative.draft_model=configs"]
    for key, value in (("init", "distill:configs/distill_dflash.yaml"), ("push_every", "2"), ("tap_timeout_s", "5.0"),
                       ("compare_frozen", "true")):
        assert_issue(error_of([*frozen, f"draft.{key}={value}"]), f"draft.{key}", "used only when co-training")
    assert load_config(DEMO, [*COTRAIN_DFLASH]).draft.tap_transport == "shm"  # auto on cpu
    # the frozen copy of draft.init beside the co-trained drafter: needs both
    assert_issue(error_of([*COTRAIN_DFLASH, "draft.compare_frozen=true"]), "draft.compare_frozen", "needs draft.init")
    assert_issue(error_of(["draft.compare_frozen=true"]), "draft.compare_frozen", "needs a co-trained drafter")
    assert load_config(DEMO, [*COTRAIN_DFLASH, "draft.compare_frozen=true",
                              "draft.init=distill:configs/distill_dflash.yaml"]).draft.compare_frozen


def test_distill_config_refuses_online_only_keys():
    from cotrain.config.distill import load_distill_config

    with pytest.raises(ValueError, match=r"draft.push_every: used only by a GRPO run's co-training"):
        load_distill_config(CONFIGS / "distill_dflash.yaml", ["draft.push_every=3"])
    with pytest.raises(ValueError, match=r"draft.compare_frozen: used only by a GRPO run's co-training"):
        load_distill_config(CONFIGS / "distill_dflash.yaml", ["draft.compare_frozen=true"])


# ------------------------------------------------------------------ suffix decoding (model-free)
SUFFIX = ["rollout.speculative.method=suffix"]


def test_suffix_refused_when_its_package_is_missing(monkeypatch):
    import cotrain.config.validate as validate

    monkeypatch.setattr(validate, "suffix_decoding_unavailable", lambda: "it is not installed")
    assert_issue(error_of(SUFFIX), "rollout.speculative.method", "suffix needs the arctic-inference package",
                 "it is not installed", "pip install --no-build-isolation arctic-inference==0.3.0",
                 "'suffix' extra", "docs/rollout.md", "ngram")
    monkeypatch.setattr(validate, "suffix_decoding_unavailable", lambda: None)  # as if installed
    cfg = load_config(DEMO, [*SUFFIX, "rollout.speculative.suffix.max_cached_requests=0"])
    s = cfg.rollout.speculative
    assert s.num_speculative_tokens == 3 and s.suffix.max_cached_requests == 0 and s.suffix.max_tree_depth == 24
    load_config(DEMO, ["rollout.speculative.method=ngram"])  # the other model-free method needs nothing


def test_suffix_availability_is_this_environment_s(tmp_path, monkeypatch):
    """The real probe: matches what is installed here, and names a broken build's import error."""
    from cotrain.config.validate import suffix_decoding_unavailable

    if importlib.util.find_spec("arctic_inference") is None:
        assert suffix_decoding_unavailable() == "it is not installed"
        assert_issue(error_of(SUFFIX), "rollout.speculative.method", "it is not installed")
    else:
        assert suffix_decoding_unavailable() is None
        assert load_config(DEMO, SUFFIX).rollout.speculative.method == "suffix"
    # a package whose native extension does not load (e.g. built for another Python or torch)
    fake = tmp_path / "arctic_inference" / "suffix_decoding"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("from ._C import SuffixTree\n")
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "arctic_inference"}
    for k in saved:
        del sys.modules[k]
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        why = suffix_decoding_unavailable()
        assert why is not None and why.startswith("it does not load (ModuleNotFoundError: No module named "
                                                  "'arctic_inference.suffix_decoding._C'"), why
        assert_issue(error_of(SUFFIX), "rollout.speculative.method", "does not load (ModuleNotFoundError")
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] == "arctic_inference"]:
            del sys.modules[k]
        sys.modules.update(saved)


@pytest.mark.parametrize("override,fragment", [
    ("max_tree_depth=0", "allowed: >= 1"),
    ("max_cached_requests=-1", "allowed: >= 0"),
    ("max_spec_factor=-0.5", "allowed: >= 0"),
    ("min_token_prob=1.5", "allowed: <= 1"),
    ("depth=8", "max_tree_depth"),
])
def test_suffix_settings_out_of_range(override, fragment, monkeypatch):
    import cotrain.config.validate as validate

    monkeypatch.setattr(validate, "suffix_decoding_unavailable", lambda: None)
    key = "rollout.speculative.suffix." + override.split("=")[0]
    assert_issue(error_of([*SUFFIX, f"rollout.speculative.suffix.{override}"]), key, fragment)
