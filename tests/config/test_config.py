"""Tests of cotrain.config: shipped configs, loading, inheritance, overrides, strictness, resolution and
the launch/grpo.py CLI. Pure Python, a few seconds."""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cotrain.config import (
    ConfigError,
    CotrainConfig,
    config_from_dict,
    get_draft_kind,
    load_config,
)
from cotrain.config.loader import load_merged
from _config_helpers import ROOT, CONFIGS, DEMO, LAUNCH, write, error_of, assert_issue, shipped


# ----------------------------------------------------------------------------- shipped configs
@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml") if not p.name.startswith("distill_")))
def test_shipped_configs_validate(name):  # distill_*.yaml are cotrain.draft.distill configs (tests/draft)
    cfg = shipped(name)
    assert cfg.cluster.device in ("cpu", "cuda")
    layers = {"builtin:tiny": 4, "builtin:small": 6, "builtin:calc": 4}[cfg.policy.model_path]
    assert cfg.model_arch is not None and cfg.model_arch.num_hidden_layers == layers


def test_demo_configs_content():
    plain = shipped("grpo.yaml")
    assert (plain.cluster.device, plain.world_size, plain.rollout.num_engines) == ("cpu", 1, 1)
    assert plain.policy.model_path == "builtin:tiny"
    assert 15 <= plain.grpo.num_steps <= 100
    assert (plain.grpo.prompts_per_step, plain.grpo.group_size, plain.rollout_batch_size) == (16, 16, 256)
    assert plain.draft.kind is None and plain.rollout.speculative.method is None
    demo = shipped("demo.yaml")  # the same run with a co-trained DFlash drafter serving the rollouts
    assert demo.grpo == plain.grpo and demo.policy == plain.policy
    assert (demo.draft.kind, demo.draft.cotrain, demo.rollout.speculative.method) == ("dflash", True, "dflash")
    assert demo.draft.init == "distill:configs/distill_dflash.yaml"
    pp2 = shipped("demo_pp2.yaml")
    assert pp2.policy.parallel.pipeline == 2 and pp2.world_size == 2 and pp2.draft.kind == "dflash"
    for name, kind in (("demo.yaml", "dflash"), ("demo_eagle3.yaml", "eagle3")):
        cfg = shipped(name)
        assert cfg.draft.kind == kind and cfg.draft.cotrain
        assert cfg.rollout.speculative.method == kind
        assert cfg.draft.settings is cfg.draft.kind_settings(kind)
        assert all(0 <= t < 4 for t in cfg.draft.settings.tap_layers)
    dspark = shipped("demo_dspark.yaml")
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


# ------------------------------------------------------------------------------- resolution
def test_resolved_values_and_round_trip(tmp_path):
    # (a run name no run of the checkout has: runs/demo_eagle3 may hold the user's)
    cfg = load_config(CONFIGS / "demo_eagle3.yaml", ["run.name=resolved-paths"])
    assert cfg.run.output_dir == "runs/resolved-paths"
    assert cfg.checkpoint.dir == "runs/resolved-paths/checkpoints"
    assert cfg.logging.tensorboard_dir == "runs/resolved-paths/tensorboard"
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


def test_the_config_layer_imports_no_torch():
    code = "import sys, cotrain.config, cotrain.config.validate; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
