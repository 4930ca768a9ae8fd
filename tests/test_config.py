"""Tests of cotrain.config: loading, inheritance, overrides, strictness, every validation error,
the drafter-kind registry and the launch/grpo.py CLI. Pure Python, a few seconds."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from cotrain.config import (
    ConfigError,
    CotrainConfig,
    DraftKind,
    DraftKindConfig,
    config_from_dict,
    draft_kinds,
    get_draft_kind,
    load_config,
    register_draft_kind,
    speculative_methods,
)
from cotrain.config import schema as schema_mod
from cotrain.config.loader import load_merged

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
DEMO = ROOT / "tests" / "configs" / "small.yaml"  # the validator tests' own fixed base
LAUNCH = ROOT / "launch" / "grpo.py"


def write(dirpath: Path, name: str, text: str) -> Path:
    p = dirpath / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def error_of(overrides, path=DEMO) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value


def assert_issue(err: ConfigError, path: str, *fragments: str) -> str:
    """The error has an issue at ``path`` whose message holds every fragment; returns it."""
    msgs = [m for p, m in err.issues if p == path]
    assert msgs, f"no issue at {path!r}; got {err.issues}"
    line = f"{path}: {msgs[0]}"
    assert line in str(err)
    for frag in fragments:
        assert frag in msgs[0], f"{frag!r} not in {msgs[0]!r}"
    return msgs[0]


# ----------------------------------------------------------------------------- shipped configs
@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml") if not p.name.startswith("distill_")))
def test_shipped_configs_validate(name):  # distill_*.yaml are cotrain.draft.distill configs (tests/draft)
    cfg = load_config(CONFIGS / name)
    assert cfg.cluster.device in ("cpu", "cuda")
    layers = {"builtin:tiny": 4, "builtin:small": 6, "builtin:calc": 4}[cfg.policy.model_path]
    assert cfg.model_arch is not None and cfg.model_arch.num_hidden_layers == layers


def test_demo_configs_content():
    plain = load_config(CONFIGS / "grpo.yaml")
    assert (plain.cluster.device, plain.world_size, plain.rollout.num_engines) == ("cpu", 1, 1)
    assert plain.policy.model_path == "builtin:tiny"
    assert 15 <= plain.grpo.num_steps <= 100
    assert (plain.grpo.prompts_per_step, plain.grpo.group_size, plain.rollout_batch_size) == (16, 16, 256)
    assert plain.draft.kind is None and plain.rollout.speculative.method is None
    demo = load_config(CONFIGS / "demo.yaml")  # the same run with a co-trained DFlash drafter serving the rollouts
    assert demo.grpo == plain.grpo and demo.policy == plain.policy
    assert (demo.draft.kind, demo.draft.cotrain, demo.rollout.speculative.method) == ("dflash", True, "dflash")
    assert demo.draft.init == "distill:configs/distill_dflash.yaml"
    pp2 = load_config(CONFIGS / "demo_pp2.yaml")
    assert pp2.policy.parallel.pipeline == 2 and pp2.world_size == 2 and pp2.draft.kind == "dflash"
    for name, kind in (("demo.yaml", "dflash"), ("demo_eagle3.yaml", "eagle3")):
        cfg = load_config(CONFIGS / name)
        assert cfg.draft.kind == kind and cfg.draft.cotrain
        assert cfg.rollout.speculative.method == kind
        assert cfg.draft.settings is cfg.draft.kind_settings(kind)
        assert all(0 <= t < 4 for t in cfg.draft.settings.tap_layers)
    dspark = load_config(CONFIGS / "demo_dspark.yaml")
    assert dspark.draft.kind == "dspark" and dspark.rollout.speculative.method is None


def test_base_yaml_is_generated_and_spells_out_every_default():
    out = subprocess.run([sys.executable, "-m", "cotrain.config.docgen", "--yaml"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert (CONFIGS / "base.yaml").read_text() == out, \
        "configs/base.yaml is stale: python -m cotrain.config.docgen --yaml > configs/base.yaml"
    raw, _ = load_merged(CONFIGS / "base.yaml")
    defaults = CotrainConfig().model_dump(mode="json")
    for kind in ("eagle3", "dflash", "dspark"):
        assert kind in raw["draft"]
    defaults["draft"] = {k: v for k, v in defaults["draft"].items() if k in raw["draft"]}
    assert raw == defaults


def test_docs_reference_is_current():
    out = subprocess.run([sys.executable, "-m", "cotrain.config.docgen", "--markdown"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    doc = (ROOT / "docs" / "config.md").read_text()
    assert out in doc, "docs/config.md reference is stale: python -m cotrain.config.docgen --markdown"


# ----------------------------------------------------------------------------------- loading
def test_defaults_inheritance_multi_level_and_relative(tmp_path):
    write(tmp_path, "root.yaml", "grpo: {num_steps: 3, group_size: 4}\npolicy: {optimizer: {lr: 0.5, betas: [0.1, 0.2]}}\n")
    write(tmp_path, "mid/a.yaml", "defaults: [../root.yaml]\ngrpo: {num_steps: 4}\n")
    write(tmp_path, "mid/b.yaml", "defaults: ../root.yaml\ngrpo: {num_steps: 5, prompts_per_step: 16}\n"
                                  "policy: {optimizer: {betas: [0.3, 0.4]}}\n")
    leaf = write(tmp_path, "leaf.yaml", "defaults: [mid/a.yaml, mid/b.yaml]\nrun: {name: leaf}\n"
                                        "grpo: {group_size: 8}\n")
    raw, files = load_merged(leaf)
    assert [Path(f).name for f in files] == ["root.yaml", "a.yaml", "root.yaml", "b.yaml", "leaf.yaml"]
    cfg = load_config(leaf)
    assert cfg.grpo.num_steps == 5            # b after a: later default wins
    assert cfg.grpo.prompts_per_step == 16
    assert cfg.grpo.group_size == 8           # the file itself wins over its defaults
    assert cfg.policy.optimizer.lr == 0.5     # deep merge keeps siblings
    assert cfg.policy.optimizer.betas == [0.3, 0.4]  # lists are replaced
    assert cfg.run.name == "leaf" and cfg.run.output_dir == "runs/leaf"
    assert cfg.sources[-1].endswith("leaf.yaml")


def test_defaults_cycle_detected(tmp_path):
    write(tmp_path, "a.yaml", "defaults: [b.yaml]\n")
    write(tmp_path, "b.yaml", "defaults: [sub/c.yaml]\n")
    write(tmp_path, "sub/c.yaml", "defaults: [../a.yaml]\n")
    err = error_of([], tmp_path / "a.yaml")
    msg = assert_issue(err, "defaults", "cycle")
    assert "a.yaml" in msg and "b.yaml" in msg and "c.yaml" in msg
    write(tmp_path, "self.yaml", "defaults: [self.yaml]\n")
    assert_issue(error_of([], tmp_path / "self.yaml"), "defaults", "cycle")


def test_defaults_errors(tmp_path):
    assert_issue(error_of([], write(tmp_path, "m.yaml", "defaults: [nope.yaml]\n")), "defaults", "nope.yaml",
                 "does not exist")
    assert_issue(error_of([], write(tmp_path, "n.yaml", "defaults: {a: 1}\n")), "defaults", "list of file paths")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_empty_file_is_all_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "empty.yaml", ""))
    assert cfg.grpo.num_steps == CotrainConfig().grpo.num_steps


def test_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="duplicate key 'grpo'"):
        load_config(write(tmp_path, "dup.yaml", "grpo: {num_steps: 1}\ngrpo: {num_steps: 2}\n"))
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(write(tmp_path, "bad.yaml", "grpo: [1,\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "list.yaml", "- 1\n- 2\n"))


def test_yaml_12_floats(tmp_path):
    cfg = load_config(write(tmp_path, "f.yaml", "policy: {optimizer: {lr: 1e-5, eps: 3E-7}}\n"))
    assert cfg.policy.optimizer.lr == 1e-5 and cfg.policy.optimizer.eps == 3e-7


# ---------------------------------------------------------------------------------- overrides
def test_override_types():
    cfg = load_config(DEMO, [
        "policy.parallel.pipeline=2",
        "rollout.sampling.temperature=0.7",
        "policy.optimizer.lr=1e-5",
        "draft.kind=eagle3",
        "draft.eagle3.tap_layers=[1, 2]",
        "run.name=my-run",
        "logging.wandb.enabled=true",
        "checkpoint.resume=true",
        "policy.parallel={tensor: 2}",     # flow mappings merge
        "data.arithmetic.ops=['*']",
        "cluster.cpus_per_node=8",
    ])
    assert cfg.policy.parallel.pipeline == 2 and cfg.policy.parallel.tensor == 2
    assert cfg.rollout.sampling.temperature == 0.7
    assert cfg.policy.optimizer.lr == 1e-5
    assert cfg.draft.kind == "eagle3" and cfg.draft.eagle3.tap_layers == [1, 2]
    assert cfg.run.name == "my-run" and cfg.logging.wandb.enabled is True
    assert cfg.checkpoint.resume is True
    assert cfg.data.arithmetic.ops == ["*"]
    back = load_config(CONFIGS / "demo_eagle3.yaml", ["draft.kind=null", "rollout.speculative.method="])
    assert back.draft.kind is None and back.rollout.speculative.method is None


def test_override_unknown_key_lists_close_matches():
    err = error_of(["policy.paralel.pipeline=2"])
    assert_issue(err, "policy.paralel", "unknown key 'paralel'", "did you mean: parallel", "valid keys:",
                 "micro_batch_size")
    assert_issue(error_of(["polcy.dtype=float32"]), "polcy", "did you mean: policy")
    assert_issue(error_of(["draft.eagle4.ttt_steps=2"]), "draft.eagle4", "did you mean: eagle3", "dflash")
    assert_issue(error_of(["policy.dtype.bits=16"]), "policy.dtype.bits", "is a value, not a section")
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(DEMO, ["policy.parallel.pipeline"])
    with pytest.raises(ConfigError, match="only be set in files"):
        load_config(DEMO, ["defaults=[x.yaml]"])


def test_override_wrong_type():
    assert_issue(error_of(["policy.parallel.pipeline=two"]), "policy.parallel.pipeline", "expected an integer")
    assert_issue(error_of(["policy.parallel.pipeline=true"]), "policy.parallel.pipeline", "expected an integer")
    assert_issue(error_of(["policy.parallel.pipeline=2.5"]), "policy.parallel.pipeline", "expected an integer")
    assert_issue(error_of(["logging.tensorboard=1"]), "logging.tensorboard", "expected a boolean")
    assert_issue(error_of(["checkpoint.resume=5"]), "checkpoint.resume", "a boolean", "a string")


# --------------------------------------------------------------------------------- strictness
def test_unknown_keys_in_yaml_name_their_path(tmp_path):
    p = write(tmp_path, "x.yaml", "defaults: [%s]\npolicy:\n  parallel: {pipelin: 2}\nfoo: 1\n"
              "draft: {eagle3: {ttt: 2}}\n" % DEMO)
    err = error_of([], p)
    assert_issue(err, "policy.parallel.pipelin", "unknown key", "did you mean: pipeline")
    assert_issue(err, "foo", "unknown key", "valid keys:", "grpo")
    assert_issue(err, "draft.eagle3.ttt", "unknown key", "did you mean: ttt_steps")
    assert len(err.issues) == 3


def test_section_given_a_scalar():
    assert_issue(error_of(["policy.parallel=2"]), "policy.parallel", "expected a mapping")


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)
    err = error_of(["grpo.group_size=1", "policy.parallel.pipeline=3"])
    assert set(err.paths) == {"grpo.group_size", "policy.parallel.pipeline"}
    assert str(err).startswith("2 config errors")


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


# ------------------------------------------------------------------------------- resolution
def test_resolved_values_and_round_trip(tmp_path):
    cfg = load_config(CONFIGS / "demo_eagle3.yaml")
    assert cfg.run.output_dir == "runs/demo_eagle3"
    assert cfg.checkpoint.dir == "runs/demo_eagle3/checkpoints"
    assert cfg.logging.tensorboard_dir == "runs/demo_eagle3/tensorboard"
    assert cfg.rollout.weight_transport == "shm" and cfg.rollout.enforce_eager is True
    assert cfg.rollout.kv_cache_memory_bytes == 256 * 2**20 and cfg.rollout.gpus_per_engine == 0
    assert cfg.grpo.global_batch_size == 256 and cfg.micro_batches_per_update == 4
    assert cfg.draft.eagle3.tap_layers == [0, 2, 3] and cfg.draft.loss == "soft_ce"
    again = load_config(write(tmp_path, "resolved.yaml", cfg.to_yaml()))
    assert again.to_dict() == cfg.to_dict()
    clone = pickle.loads(pickle.dumps(cfg))           # configs travel to Ray actors
    assert clone.to_dict() == cfg.to_dict() and clone.draft.settings.ttt_steps == 4
    assert clone.model_arch == cfg.model_arch


def test_defaults_resolve_for_cuda():
    cfg = load_config(DEMO, ["cluster.device=auto", "cluster.gpus_per_node=4", "rollout.colocate=true"])
    assert cfg.cluster.device == "cuda" and cfg.rollout.weight_transport == "cuda_ipc"
    assert cfg.rollout.gpu_memory_utilization == 0.4 and cfg.rollout.enforce_eager is False


def test_default_tap_layers_for_deep_targets():
    assert get_draft_kind("eagle3").config().default_tap_layers(32) == [1, 15, 28]
    assert get_draft_kind("dflash").config(num_layers=5).default_tap_layers(36) == [1, 9, 17, 25, 33]
    assert get_draft_kind("dflash").config().default_tap_layers(36) == [18]


def test_config_from_dict_and_construct_in_code():
    cfg = config_from_dict({"grpo": {"num_steps": 3}, "cluster": {"cpus_per_node": 4}})
    assert cfg.grpo.num_steps == 3 and cfg.world_size == 1
    with pytest.raises(ConfigError, match="grpo.group_size"):
        config_from_dict({"grpo": {"group_size": 1}})


# --------------------------------------------------------------------------- drafter registry
@pytest.fixture
def registry():
    saved = dict(schema_mod._DRAFT_KINDS)
    yield
    schema_mod._DRAFT_KINDS.clear()
    schema_mod._DRAFT_KINDS.update(saved)


class MedusaConfig(DraftKindConfig):
    """A test kind."""

    num_heads: int = 2
    """Heads."""


MEDUSA = DraftKind("medusa", MedusaConfig, "medusa_pkg:MedusaDrafter", vllm_method="medusa", losses=("hard_ce",),
                   default_loss="hard_ce")


def test_register_new_draft_kind(registry):
    assert "medusa" not in draft_kinds()
    register_draft_kind(MEDUSA)
    assert get_draft_kind("medusa") is MEDUSA and "medusa" in speculative_methods()
    cfg = load_config(DEMO, ["draft.kind=medusa", "draft.medusa.num_heads=4", "rollout.speculative.method=medusa",
                             "rollout.speculative.num_speculative_tokens=2"])
    assert cfg.draft.settings.num_heads == 4 and cfg.draft.medusa.num_heads == 4
    assert cfg.draft.settings.tap_layers == [0, 2, 3]
    assert "medusa" in cfg.to_dict()["draft"]
    err = error_of(["draft.kind=hydra"])
    assert_issue(err, "draft.kind", "allowed: null, eagle3, dflash, dspark, medusa")
    assert_issue(error_of(["draft.medusa.num_heads=x"]), "draft.medusa.num_heads", "expected an integer")
    # the record's losses decide what draft.loss may be, and its default
    cfg = load_config(DEMO, ["draft.kind=medusa", "draft.loss=null", "rollout.speculative.method=medusa",
                             "rollout.speculative.num_speculative_tokens=2"])
    assert cfg.draft.loss == "hard_ce" and cfg.draft.settings.default_loss == "hard_ce"
    assert_issue(error_of(["draft.kind=medusa", "draft.loss=soft_ce", "rollout.speculative.method=medusa"]),
                 "draft.loss", "soft_ce is not available for draft.kind=medusa (allowed: hard_ce)")
    assert_issue(error_of(["draft.loss=l2"]), "draft.loss",
                 "allowed: null, soft_ce, forward_kl, hard_ce, e2e_tv, accept_weighted_tv, dspark_l1")
    # its record names no on-policy branches: draft.branches=on_policy is refused, naming the kinds that have them
    assert_issue(error_of(["draft.kind=medusa", "draft.loss=hard_ce", "draft.branches=on_policy",
                           "rollout.speculative.method=medusa", "rollout.speculative.num_speculative_tokens=2"]),
                 "draft.branches", "on_policy is built for kinds eagle3, dflash, dspark (cotrain.draft.specopd), not medusa")
    with pytest.raises(ValueError, match="anchors 'some' is not"):
        register_draft_kind(DraftKind("hydra", MedusaConfig, "x:Y", vllm_method=None, anchors="some"))
    with pytest.raises(ValueError, match="branches 'tree' is not"):
        register_draft_kind(DraftKind("hydra", MedusaConfig, "x:Y", vllm_method=None, branches="tree"))
    with pytest.raises(ValueError, match="already registered"):
        register_draft_kind(DraftKind("eagle3", MedusaConfig, "x:Y", vllm_method="eagle3"))
    with pytest.raises(ValueError, match="clashes"):
        register_draft_kind(DraftKind("loss", MedusaConfig, "x:Y", vllm_method=None))
    with pytest.raises(ValueError, match="default_loss 'soft_ce' is not one of its losses"):
        register_draft_kind(DraftKind("hydra", MedusaConfig, "x:Y", vllm_method=None, losses=("hard_ce",)))
    with pytest.raises(KeyError, match="registered: eagle3"):
        get_draft_kind("hydra")


def test_replace_builtin_kind(registry):
    import dataclasses

    class Eagle3Plus(get_draft_kind("eagle3").config):
        extra: int = 1

    register_draft_kind(dataclasses.replace(get_draft_kind("eagle3"), config=Eagle3Plus), replace=True)
    cfg = load_config(CONFIGS / "demo_eagle3.yaml", ["draft.eagle3.extra=5"])
    assert isinstance(cfg.draft.settings, Eagle3Plus) and cfg.draft.settings.extra == 5


# ------------------------------------------------------------------------------ property test
def test_parallel_degrees_property():
    pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    known = {"policy.parallel.pipeline", "policy.parallel.tensor", "policy.parallel.context", "policy.parallel",
             "grpo.prompts_per_step", "grpo.global_batch_size", "rollout.num_engines", "policy.micro_batch_size"}

    @settings(max_examples=40, deadline=None)
    @given(tp=st.integers(1, 5), pp=st.integers(1, 5), cp=st.integers(1, 4), dp=st.integers(1, 4),
           mbs=st.integers(1, 8), cpus=st.integers(1, 64))
    def check(tp, pp, cp, dp, mbs, cpus):
        ov = [f"policy.parallel.tensor={tp}", f"policy.parallel.pipeline={pp}", f"policy.parallel.context={cp}",
              f"policy.parallel.data={dp}", f"policy.micro_batch_size={mbs}", f"cluster.cpus_per_node={cpus}"]
        try:
            cfg = load_config(DEMO, ov)
        except ConfigError as e:
            assert set(e.paths) <= known, e.issues
            assert all("allowed" in m for _, m in e.issues), e.issues
            return
        assert 4 % pp == 0 and 2 % tp == 0 and (cp == 1 or 128 % (2 * cp) == 0)
        assert cfg.world_size + 1 <= cpus
        assert cfg.rollout_batch_size % (dp * (1 if cfg.policy.packing else mbs)) == 0

    check()


# ------------------------------------------------------------------------------------- CLI
def _cli(*args, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(LAUNCH), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


def test_cli_validate_only_ok_from_any_directory(tmp_path):
    res = _cli("--config", str(DEMO), "grpo.num_steps=5", "--validate-only", "policy.parallel.pipeline=2",
               cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "config OK" in res.stdout and "world size 2" in res.stdout and "5 steps" in res.stdout


def test_cli_validate_only_error_exit_2():
    res = _cli("--config", "configs/demo.yaml", "--validate-only", "policy.parallel.pipeline=3")
    assert res.returncode == 2
    assert "policy.parallel.pipeline: 3 does not divide num_hidden_layers=4 (allowed: 1, 2, 4)" in res.stderr
    res = _cli("--config", "configs/nope.yaml", "--validate-only")
    assert res.returncode == 2 and "does not exist" in res.stderr


def _launcher():
    spec = importlib.util.spec_from_file_location("cotrain_launch_grpo", LAUNCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_calls_driver_with_resume(monkeypatch, capsys):
    mod = _launcher()
    calls = []

    monkeypatch.setattr("cotrain.rl.driver.main", lambda cfg, resume=False: calls.append((cfg, resume)))
    assert mod.main(["--config", str(DEMO), "grpo.num_steps=2", "--resume", "--print-config"]) == 0
    cfg, resume = calls[0]
    assert cfg.grpo.num_steps == 2 and resume is True and cfg.checkpoint.resume is True
    assert yaml.safe_load(capsys.readouterr().out)["grpo"]["num_steps"] == 2


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


def test_one_record_per_drafter_kind_drives_config_registry_and_models():
    """The record names the drafter class and the vLLM method; the class the registry imports is that
    one and speaks that method; a class the record does not name is refused."""
    from cotrain.draft.registry import Drafter, get_drafter_class, register_drafter

    for kind in draft_kinds():
        record = get_draft_kind(kind)
        cls = get_drafter_class(kind)
        assert f"{cls.__module__}:{cls.__qualname__}" == record.model and cls.vllm_method == record.vllm_method
        assert record.vllm_method in speculative_methods() and record.default_loss in record.losses
    with pytest.raises(ValueError, match="registered as cotrain.draft.dflash:DFlashDrafter, not cotrain.draft.eagle3:Eagle3Drafter"):
        register_drafter("dflash", get_drafter_class("eagle3"))
    with pytest.raises(TypeError, match="not a Drafter subclass"):
        register_drafter("dflash", object)
    assert issubclass(get_drafter_class("dspark"), Drafter)
    from cotrain.draft import losses  # every loss a record allows is implemented

    assert set(schema_mod.draft_losses()) == set(losses.LOSSES)


def test_the_config_layer_imports_no_torch():
    code = "import sys, cotrain.config, cotrain.config.validate; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
