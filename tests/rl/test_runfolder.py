"""Nothing lost, nothing run from a file: one run per run folder (cotrain.runfolder), checkpoints that
hold only data (cotrain.checkpoint.load_plain), a resume that refuses another run's checkpoint or
a step count below it, and non-finite values refused in the config and caught in the loop.

The driver runs on the in-process fakes of tests/rl/test_driver_contract.py (no Ray, Megatron or
vLLM): each test takes a few seconds."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import yaml

from test_driver_contract import STEPS, FakeTrainer, FakeWorkers, _cfg, _metrics, _run

from cotrain.config import ConfigError
from cotrain.checkpoint import CheckpointError, CheckpointManager, atomic_torch_save
from cotrain.rl.driver import NonFiniteError
from cotrain.runfolder import RunFolderError, read_run_id

ROOT = Path(__file__).resolve().parents[2]


def _finished_run(out: Path) -> FakeWorkers:
    workers = FakeWorkers()
    _run(_cfg(out), workers)
    return workers


def test_a_fresh_run_into_a_used_folder_is_refused_at_validation(tmp_path):
    out = tmp_path / "run"
    _finished_run(out)
    with pytest.raises(ConfigError) as e:
        _cfg(out)
    msg = str(e.value)
    assert "run.output_dir" in msg and str(out) in msg and "metrics.jsonl" in msg
    assert "--resume" in msg and "--overwrite" in msg and "another run.output_dir" in msg
    # also when resuming finds no checkpoint to continue (it would start over and truncate the metrics)
    for p in (out / "checkpoints").glob("step_*"):
        (p / "COMPLETE").unlink()
    with pytest.raises(ConfigError, match="finds no checkpoint to continue"):
        _cfg(out, "checkpoint.resume=true")


def test_the_driver_refuses_the_folder_before_any_worker_starts(tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(out)  # validated while the folder was empty
    _finished_run(out)  # ... then another run wrote it
    workers = FakeWorkers()
    with pytest.raises(RunFolderError, match="already holds a run"):
        _run(cfg, workers)
    assert workers.log == []  # nothing started
    assert len(_metrics(out)) == STEPS  # and nothing of the first run was touched


def test_overwrite_replaces_the_old_run_and_keeps_the_users_files(tmp_path):
    out = tmp_path / "run"
    _finished_run(out)
    first_id = read_run_id(out)
    (out / "notes.txt").write_text("mine")
    cfg = _cfg(out, "run.overwrite=true", "grpo.num_steps=2")
    _run(cfg, FakeWorkers())
    assert sorted(_metrics(out)) == [1, 2]  # only the new run's steps
    assert [p.name for p in sorted((out / "checkpoints").glob("step_*"))] == ["step_000002"]
    assert read_run_id(out) not in (None, first_id)
    assert (out / "notes.txt").read_text() == "mine"
    d = out / "checkpoints" / "step_000002"
    assert torch.load(d / "driver.pt", weights_only=True)["run_id"] == read_run_id(out)
    assert yaml.safe_load((d / "config.yaml").read_text()) == cfg.to_dict()  # the resolved config beside it


def test_launcher_overwrite_flag(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_grpo", ROOT / "launch" / "grpo.py")
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    out = tmp_path / "run"
    _finished_run(out)
    same = ["grpo.num_steps=4", "grpo.prompts_per_step=4", "grpo.group_size=4", "policy.micro_batch_size=4",
            "data.eval.every=0", "draft.kind=dflash", "draft.cotrain=true", "rollout.speculative.method=dflash",
            "draft.push_every=2", "checkpoint.every=2", "checkpoint.keep_last=null"]  # as _cfg's run
    args = ["--config", str(ROOT / "configs/grpo.yaml"), f"run.output_dir={out}", *same, "--validate-only"]
    assert launcher.main(args) == 2
    assert launcher.main(args + ["--overwrite"]) == 0
    assert launcher.main(args + ["--resume"]) == 0


def test_resume_continues_the_folders_run_and_refuses_another_runs_checkpoint(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _finished_run(a)
    _finished_run(b)
    resumed = FakeWorkers()
    _run(_cfg(a, "checkpoint.resume=true", f"grpo.num_steps={STEPS + 2}"), resumed, resume=True)
    assert sorted(_metrics(a)) == list(range(1, STEPS + 3))
    other = b / "checkpoints" / f"step_{STEPS:06d}"
    with pytest.raises(RunFolderError, match="belongs to run"):
        _run(_cfg(a, f"checkpoint.resume={other}"), FakeWorkers(), resume=str(other))


def test_num_steps_below_the_checkpoint_is_refused(tmp_path):
    out = tmp_path / "run"
    _finished_run(out)
    workers = FakeWorkers()
    with pytest.raises(RunFolderError, match=f"grpo.num_steps=2 is below the step of checkpoint .* \\({STEPS}\\)"):
        _run(_cfg(out, "checkpoint.resume=true", "grpo.num_steps=2"), workers, resume=True)
    assert workers.log == []


def test_prune_after_resuming_from_an_older_checkpoint_keeps_the_new_one(tmp_path):
    first = CheckpointManager(tmp_path, keep_last=None)
    for step in (2, 4, 6):
        first.begin(step)
        first.commit(step, {"step": step, "data": {}})
    # resumed from step 2 with keep_last=2: the continuation writes step 3; the abandoned 4 and 6
    # are not counted (sorted with them, step 3 was the oldest but one and deleted right away)
    m = CheckpointManager(tmp_path, keep_last=2)
    m.begin(3)
    m.commit(3, {"step": 3, "data": {}})
    assert m.latest().name == "step_000003"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000003", "step_000004",
                                                               "step_000006"]


class _Payload:
    """What a crafted checkpoint holds: an object whose unpickling runs code."""

    def __reduce__(self):
        return (os.system, ("touch " + str(Path(os.environ["COTRAIN_TEST_MARK"])),))


def test_a_checkpoint_holding_a_pickled_object_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _finished_run(out)
    d = out / "checkpoints" / f"step_{STEPS:06d}"
    mark = tmp_path / "ran"
    monkeypatch.setenv("COTRAIN_TEST_MARK", str(mark))
    atomic_torch_save({"step": STEPS, "data": {}, "x": _Payload()}, d / "driver.pt")
    from cotrain.checkpoint import write_manifest

    write_manifest(d)  # the manifest recomputed: integrity holds, origin does not
    with pytest.raises(CheckpointError, match=f"{d / 'driver.pt'}: refused: it holds a pickled Python object"):
        CheckpointManager.load_driver_state(d)
    with pytest.raises(ConfigError, match="driver.pt: refused"):
        _cfg(out, f"checkpoint.resume={d}")  # --validate-only runs this check
    with pytest.raises(ConfigError, match="driver.pt: refused"):
        _cfg(out, "checkpoint.resume=true")
    cfg = _cfg(tmp_path / "other")
    cfg.checkpoint.resume = str(d)  # the file changed after validation: the driver refuses it too
    workers = FakeWorkers()
    with pytest.raises(CheckpointError, match="refused"):
        _run(cfg, workers, resume=str(d))
    assert workers.log == [] and not mark.exists()  # nothing ran


@pytest.mark.parametrize("override", ["policy.optimizer.lr=.inf", "grpo.kl_coef=.inf", "policy.optimizer.eps=.nan",
                                      "rollout.sampling.temperature=.inf", "reward.correct=.nan",
                                      "policy.optimizer.weight_decay=.inf"])
def test_non_finite_config_values_are_refused_at_their_key(tmp_path, override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, override)
    assert key in str(e.value) and "finite" in str(e.value)


class _DivergingTrainer(FakeTrainer):
    def train_step(self, batch):
        m = super().train_step(batch)
        if self.updates == 3:
            m["grad_norm"] = math.inf
        if self.updates >= 3:
            m["loss"] = math.nan
        return m


def test_a_non_finite_update_stops_the_run_before_it_is_saved(tmp_path):
    out = tmp_path / "run"
    workers = FakeWorkers()
    workers.trainer = lambda model_path, draft_init: setattr(workers, "trainer_", _DivergingTrainer(workers.log)) \
        or workers.trainer_
    with pytest.raises(NonFiniteError, match="step 3: train/loss=nan, train/grad_norm=inf"):
        _run(_cfg(out, "checkpoint.every=1"), workers)
    assert sorted(_metrics(out)) == [1, 2]
    assert [p.name for p in sorted((out / "checkpoints").glob("step_*"))] == ["step_000001", "step_000002"]
    assert not any(e[:2] == ("push", "policy") and e[3] == 3 for e in workers.log)  # the NaN policy never served
    assert json.loads((out / "run.json").read_text())["run_id"] == read_run_id(out)


def test_resume_applies_changed_settings_and_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    _finished_run(out)
    cfg = _cfg(out, "checkpoint.resume=true", f"grpo.num_steps={STEPS + 2}", "policy.optimizer.lr=5e-7",
               "grpo.kl_coef=0.5")
    _run(cfg, FakeWorkers(), resume=True)
    said = capsys.readouterr().out
    assert f"applied from step {STEPS + 1} on: grpo.kl_coef: " in said and "policy.optimizer.lr: " in said
    assert "-> 5e-07" in said and "grpo.num_steps" in said
    saved = yaml.safe_load((out / "checkpoints" / f"step_{STEPS + 2:06d}" / "config.yaml").read_text())
    assert saved["policy"]["optimizer"]["lr"] == 5e-7


@pytest.mark.parametrize("override, key", [("draft.dflash.num_layers=2", "draft.dflash.num_layers"),
                                           ("policy.parallel.data=2", "policy.parallel.data"),
                                           ("run.seed=7", "run.seed"),
                                           ("data.arithmetic.digits=3", "data.arithmetic.digits")])
def test_resume_refuses_what_the_checkpoint_cannot_follow(tmp_path, override, key):
    out = tmp_path / "run"
    _finished_run(out)
    with pytest.raises(ConfigError) as e:
        _cfg(out, "checkpoint.resume=true", override)
    assert e.value.issues[0][0] == key and "which a resume cannot follow" in str(e.value)
    # the driver checks again (the config is validated before the checkpoint it resumes exists)
    cfg = _cfg(tmp_path / "fresh", override)
    cfg.checkpoint.dir = str(out / "checkpoints")
    workers = FakeWorkers()
    with pytest.raises(ConfigError, match=key):
        _run(cfg, workers, resume=True)
    assert workers.log == []
    # a drafter kind not in use is not compared
    _cfg(out, "checkpoint.resume=true", "draft.eagle3.num_layers=3")


# ----------------------------------------------------------------- bad inputs named before any worker starts
def test_a_truncated_drafter_or_policy_weight_file_is_named_at_validation(tmp_path, tiny_model_path):
    import shutil

    from cotrain.models.hf_io import safetensors_problems

    policy = tmp_path / "policy"
    shutil.copytree(tiny_model_path, policy)
    weights = next(policy.glob("*.safetensors"))
    assert safetensors_problems(weights) is None
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    assert "truncated" in safetensors_problems(weights)
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path / "run", f"policy.model_path={policy}")
    assert e.value.issues[0][0] == "policy.model_path" and str(weights) in str(e.value)
    weights.write_bytes(data[:5])
    assert "too short" in safetensors_problems(weights)
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert "not a safetensors file" in safetensors_problems(weights)


def test_a_folder_that_cannot_be_written_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError) as e:
        _cfg(blocker / "run")
    assert e.value.issues[0][0] == "run.output_dir" and "is a file, not a folder" in str(e.value)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_prompts_duplicates_unknown_characters_and_bad_bytes(tmp_path):
    base = ["data.task=jsonl", "data.eval.every=0"]
    dup = _jsonl(tmp_path / "dup.jsonl", [{"prompt": f"{i % 2}+1=", "answer": i % 2 + 1} for i in range(40)])
    with pytest.raises(ConfigError, match="only 2 distinct ones, fewer than grpo.prompts_per_step=4"):
        _cfg(tmp_path / "r1", *base, f"data.jsonl.path={dup}")
    rows = [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(40)]
    rows[7] = {"prompt": "3×4=", "answer": 12}
    uni = _jsonl(tmp_path / "uni.jsonl", rows)
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path / "r2", *base, f"data.jsonl.path={uni}")
    assert f"{uni}:8: the prompt '3×4=' has characters the policy's tokenizer does not know ('×'" in str(e.value)
    raw = _jsonl(tmp_path / "bytes.jsonl", [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(40)])
    lines = raw.read_bytes().split(b"\n")
    lines[12] = b'{"prompt": "1+\xff=", "answer": 2}'
    raw.write_bytes(b"\n".join(lines))
    with pytest.raises(ConfigError, match=f"{raw}:13: not UTF-8 text \\(invalid start byte at byte 14 of the line"):
        _cfg(tmp_path / "r3", *base, f"data.jsonl.path={raw}")
