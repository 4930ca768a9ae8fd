"""Resume after faults: damaged checkpoint files and a metrics.jsonl cut mid-line (no Ray, no model)."""

import json
import warnings
from pathlib import Path

import pytest
import torch

from cotrain.checkpoint import (CheckpointError, CheckpointManager, CheckpointWarning, atomic_torch_save,
                                   verify_checkpoint)

RANKS = 2


def _save(mgr: CheckpointManager, step: int) -> Path:
    """What GrpoRun.save_checkpoint does: begin, every rank writes its file, the driver commits."""
    d = mgr.begin(step)
    for r in range(RANKS):
        atomic_torch_save({"w": torch.full((256,), float(step + r)), "step": step}, d / f"trainer_rank{r:04d}.pt")
    mgr.commit(step, {"step": step, "data": {"epoch": 0, "pos": step}})
    return d


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.fixture
def two_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=None)
    return mgr, _save(mgr, 2), _save(mgr, 4)


def test_intact_checkpoints_resolve_to_the_newest(two_checkpoints):
    mgr, _, newest = two_checkpoints
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mgr.resolve(True) == newest
    assert mgr.load_driver_state(newest) == {"step": 4, "data": {"epoch": 0, "pos": 4}}


def test_truncated_rank_file_falls_back_to_the_previous_checkpoint_with_a_warning(two_checkpoints):
    mgr, older, newest = two_checkpoints
    bad = newest / "trainer_rank0001.pt"
    _truncate(bad)
    with pytest.raises(RuntimeError, match="PytorchStreamReader"):  # what a worker would have hit
        torch.load(bad, weights_only=False)
    with pytest.warns(CheckpointWarning, match=rf"{bad}.*truncated.*falling back to the previous complete"):
        assert mgr.resolve(True) == older
    # asked for by name: an error naming the file, no silent fallback
    with pytest.raises(CheckpointError, match=rf"{bad}: \d+ bytes, the manifest says \d+"):
        mgr.resolve(str(newest))


def test_same_size_corruption_is_caught_by_the_hash(two_checkpoints):
    mgr, older, newest = two_checkpoints
    bad = newest / "trainer_rank0000.pt"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.warns(CheckpointWarning, match=rf"{bad}: sha256 differs"):
        assert mgr.resolve(True) == older


def test_checkpoint_without_manifest_is_checked_structurally(two_checkpoints):
    """Checkpoints written before manifests: a truncated .pt still fails to open as a zip archive."""
    mgr, older, newest = two_checkpoints
    (newest / "MANIFEST.json").unlink()
    (older / "MANIFEST.json").unlink()
    assert mgr.resolve(True) == newest
    _truncate(newest / "driver.pt")
    with pytest.warns(CheckpointWarning, match=rf"{newest / 'driver.pt'}: damaged or truncated"):
        assert mgr.resolve(True) == older


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(two_checkpoints):
    mgr, older, newest = two_checkpoints
    _truncate(older / "trainer_rank0000.pt")
    _truncate(newest / "trainer_rank0000.pt")
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="no usable checkpoint.*step_000002"):
        mgr.resolve(True)
    assert CheckpointManager(mgr.dir / "nothing_here").resolve(True) is None  # no checkpoint: fresh start


def test_damaged_driver_state_names_the_file(two_checkpoints):
    _, _, newest = two_checkpoints
    _truncate(newest / "driver.pt")
    with pytest.raises(CheckpointError, match=rf"{newest / 'driver.pt'}: cannot be loaded") as e:
        CheckpointManager.load_driver_state(newest)
    assert e.value.__cause__ is None  # not chained to torch's reader error


def test_load_with_fallback_goes_back_when_loading_fails(two_checkpoints):
    mgr, older, newest = two_checkpoints

    def load(d):
        if d == newest:
            raise RuntimeError("rank 1: size mismatch for decoder.layers.0.weight")
        return mgr.load_driver_state(d)

    with pytest.warns(CheckpointWarning, match=r"step_000004 could not be loaded \(RuntimeError: rank 1"):
        d, state = mgr.load_with_fallback(True, load)
    assert d == older and state["step"] == 2


def test_metrics_line_cut_mid_write_does_not_stop_resume(tmp_path):
    from cotrain.config import load_config
    from cotrain.rl.metrics import MetricsLogger, read_metrics

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "grpo.yaml", [f"run.output_dir={tmp_path}", "logging.tensorboard=false"])
    rows = [{"step": s, "reward/mean": s / 10} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "reward/me')
    with pytest.warns(UserWarning, match=r"metrics.jsonl:4: skipping an unreadable metrics line"):
        logger = MetricsLogger(cfg, resume_step=3)
    logger.log(4, {"reward/mean": 0.4})
    logger.close()
    assert read_metrics(tmp_path) == rows + [{"step": 4, "reward/mean": 0.4}]


def test_validation_refuses_a_damaged_checkpoint_named_by_path(two_checkpoints, capsys):
    import importlib.util

    _, older, newest = two_checkpoints
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("launch_grpo_ckpt_test", root / "launch" / "grpo.py")
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    args = ["--config", str(root / "configs/grpo.yaml"), "--validate-only", "--resume"]
    assert launcher.main(args + [str(older)]) == 0
    _truncate(newest / "trainer_rank0000.pt")
    capsys.readouterr()
    assert launcher.main(args + [str(newest)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint.resume: '{newest}' is not a usable checkpoint: {newest / 'trainer_rank0000.pt'}: " in err


# ----- a commit that fails between files ---------------------------------------------------------------------
COMMIT_FILES = ["driver.pt", "MANIFEST.json", "COMPLETE", "latest"]


def _failing_at(monkeypatch, name):
    """atomic_write_bytes that raises when it is about to write ``name`` (a crash between two files)."""
    import cotrain.checkpoint as ck

    real = ck.atomic_write_bytes

    def write(path, data):
        if Path(path).name == name:
            raise OSError(f"disk full writing {name}")
        real(path, data)

    monkeypatch.setattr(ck, "atomic_write_bytes", write)


@pytest.mark.parametrize("fail_at", COMMIT_FILES)
def test_commit_failing_between_files_leaves_a_step_latest_and_resolve_ignore(two_checkpoints, monkeypatch, fail_at):
    mgr, older, newest = two_checkpoints
    d = mgr.begin(6)
    for r in range(RANKS):
        atomic_torch_save({"w": torch.zeros(4), "step": 6}, d / f"trainer_rank{r:04d}.pt")
    _failing_at(monkeypatch, fail_at)
    with pytest.raises(OSError, match="disk full"):
        mgr.commit(6, {"step": 6, "data": {"epoch": 0, "pos": 6}})
    monkeypatch.undo()
    assert mgr.latest() == newest
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even a warning: the step was never finished, not damaged
        assert mgr.resolve(True) == newest
    assert d not in mgr.complete()[:1]
    assert (mgr.dir / "latest").read_text() == newest.name
    # the step is written again from scratch on the next attempt, and then it is the newest
    assert _save(mgr, 6) == d and mgr.latest() == d and mgr.resolve(True) == d


def test_a_rank_failing_before_commit_leaves_no_usable_step(two_checkpoints):
    mgr, _, newest = two_checkpoints
    d = mgr.begin(6)
    atomic_torch_save({"w": torch.zeros(4)}, d / "trainer_rank0000.pt")  # rank 1 died before writing
    atomic_torch_save({"w": torch.zeros(4)}, d / "trainer_rank0003.pt")  # (this attempt ran on 4 ranks)
    assert mgr.latest() == newest and mgr.resolve(True) == newest and d not in mgr.complete()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        mgr.resolve(str(d))
    assert verify_checkpoint(d) == [f"{d}: no COMPLETE marker (the checkpoint was never finished)"]
    # the step written again (now on 2 ranks) starts from an empty directory: nothing of the failed attempt
    _save(mgr, 6)
    files = json.loads((d / "MANIFEST.json").read_text())["files"]
    assert sorted(files) == ["driver.pt", "trainer_rank0000.pt", "trainer_rank0001.pt"]


def test_completion_marker_is_written_last_over_verified_files(tmp_path, monkeypatch):
    """When COMPLETE appears, every file of the step is in place and matches the manifest; `latest`
    moves only after it."""
    import cotrain.checkpoint as ck

    mgr = CheckpointManager(tmp_path / "ckpt")
    real, order = ck.atomic_write_bytes, []

    def write(path, data):
        path = Path(path)
        if path.name == "COMPLETE":
            import hashlib

            files = json.loads((path.parent / "MANIFEST.json").read_text())["files"]
            assert sorted(files) == ["driver.pt", "trainer_rank0000.pt", "trainer_rank0001.pt"]
            for name, meta in files.items():  # each file final and as the manifest describes it
                data_ = (path.parent / name).read_bytes()
                assert (len(data_), hashlib.sha256(data_).hexdigest()) == (meta["size"], meta["sha256"]), name
            assert (mgr.dir / "latest").exists() is False or (mgr.dir / "latest").read_text() != path.parent.name
        order.append(path.name)
        real(path, data)

    monkeypatch.setattr(ck, "atomic_write_bytes", write)
    d = _save(mgr, 2)
    monkeypatch.undo()
    assert order[-4:] == COMMIT_FILES
    assert order.index("COMPLETE") == len(order) - 2 and not verify_checkpoint(d)
