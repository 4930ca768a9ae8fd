"""One run per run folder.

A run folder (``run.output_dir``, with ``checkpoint.dir`` wherever it points) holds exactly one
run, named by the id in ``<output_dir>/run.json``; every checkpoint's driver state carries the
same id. What a fresh run (``checkpoint.resume: false``) finds there decides what happens:

    nothing of a run              -> the run starts and writes run.json with a new id
    another run's files           -> refused (validation and the driver), unless run.overwrite:
                                     then that run's files are deleted first
    resume, checkpoint matches    -> the run continues (run.json kept; written if missing)
    resume, no checkpoint, files  -> refused like a fresh run (resuming would start over and
                                     truncate the old run's metrics), unless run.overwrite
    resume, checkpoint of another run (its id differs from run.json's) -> refused

"A run's files" are those the loop writes: ``metrics.jsonl``, ``run.json``, ``curves.png``,
``drafter_init/``, the TensorBoard folder if not empty, and ``step_*`` / ``latest`` in the
checkpoint folder. Anything else in the folder is the user's and is never touched.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

RUN_FILE = "run.json"
_OUTPUT_FILES = ("metrics.jsonl", RUN_FILE, "curves.png", "drafter_init")


class RunFolderError(RuntimeError):
    """A run would mix with another run's files (the message names the folder and the options)."""


def run_files(output_dir: str | Path, checkpoint_dir: str | Path | None = None,
              tensorboard_dir: str | Path | None = None) -> list[Path]:
    """The files of a run found in these folders (what a new run would mix with), sorted."""
    out = Path(output_dir)
    found = [out / n for n in _OUTPUT_FILES if (out / n).exists()]
    if tensorboard_dir is not None and Path(tensorboard_dir).is_dir() and any(Path(tensorboard_dir).iterdir()):
        found.append(Path(tensorboard_dir))
    if checkpoint_dir is not None and Path(checkpoint_dir).is_dir():
        ck = Path(checkpoint_dir)
        found += sorted(ck.glob("step_*")) + ([ck / "latest"] if (ck / "latest").exists() else [])
    return sorted(set(found))


def _folders(cfg) -> tuple[Path, Path, Path]:
    return Path(cfg.run.output_dir), Path(cfg.checkpoint.dir), Path(cfg.logging.tensorboard_dir)


def _has_checkpoint(checkpoint_dir: Path) -> bool:
    return any(checkpoint_dir.glob("step_*/COMPLETE"))


def _continues(cfg, resume) -> bool:
    """Whether the run continues a checkpoint (``resume``, None = ``checkpoint.resume``): a path, or
    ``true`` with a complete checkpoint in checkpoint.dir."""
    resume = cfg.checkpoint.resume if resume is None else resume
    return isinstance(resume, str) or (resume is True and _has_checkpoint(Path(cfg.checkpoint.dir)))


def conflict(cfg, resume: bool | str | None = None) -> str | None:
    """Why starting ``cfg``'s run would mix with another run in its folder (None: it would not).
    ``resume``: as ``checkpoint.resume`` (None: that key's value). ``run.overwrite`` resolves every
    such conflict (the old files are deleted by :func:`claim`)."""
    if cfg.run.overwrite:
        return None
    if _continues(cfg, resume):
        return None  # continuing a run: whose run the checkpoint is, is checked on load (check_resume)
    out, ck, tb = _folders(cfg)
    files = run_files(out, ck, tb)
    if not files:
        return None
    shown = ", ".join(str(p) for p in files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
    why = ("checkpoint.resume=true finds no checkpoint to continue" if (cfg.checkpoint.resume if resume is None
                                                                         else resume) is True
           else "a fresh run would mix its metrics and checkpoints with it")
    where = f"{out}" if ck.parent == out else f"{out} (checkpoints in {ck})"
    return (f"{where} already holds a run ({shown}); {why}. Allowed: resume it (launch/grpo.py --resume, "
            f"checkpoint.resume=true), overwrite it (--overwrite, run.overwrite=true: deletes those files), "
            f"or choose another run.output_dir")


def read_run_id(output_dir: str | Path) -> str | None:
    """The id in ``<output_dir>/run.json`` (None: no such file, or not readable as one)."""
    path = Path(output_dir) / RUN_FILE
    try:
        return str(json.loads(path.read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_resume(cfg, checkpoint_run_id: str | None, checkpoint: str | Path) -> None:
    """A checkpoint continues the folder's run only if it is that run's (older checkpoints carry no
    id and are accepted)."""
    mine = read_run_id(cfg.run.output_dir)
    if checkpoint_run_id is not None and mine is not None and checkpoint_run_id != mine:
        raise RunFolderError(f"checkpoint {checkpoint} belongs to run {checkpoint_run_id}, but "
                             f"{Path(cfg.run.output_dir) / RUN_FILE} names run {mine}: resuming would mix two "
                             "runs in one folder (allowed: a checkpoint of this run, or another run.output_dir)")


def claim(cfg, run_id: str | None = None, resume: bool | str | None = None) -> str:
    """Make the folder ``cfg``'s run's: refuse a conflict, or (``run.overwrite``, fresh start) delete
    the old run's files; then write ``run.json`` (``run_id``: the resumed checkpoint's, else the
    folder's, else new). Returns the run id."""
    why = conflict(cfg, resume)
    if why is not None:
        raise RunFolderError(f"run.output_dir: {why}")
    out, ck, tb = _folders(cfg)
    fresh = not _continues(cfg, resume)
    if fresh and cfg.run.overwrite:
        for p in run_files(out, ck, tb):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    rid = run_id or (None if fresh else read_run_id(out)) or uuid.uuid4().hex[:16]
    if not fresh and read_run_id(out) == rid:
        return rid  # continuing: run.json stays as the run's start wrote it
    out.mkdir(parents=True, exist_ok=True)
    record = {"run_id": rid, "name": cfg.run.name, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = out / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(out / RUN_FILE)
    return rid
