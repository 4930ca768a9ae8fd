"""Atomic, resumable checkpoints.

Layout under ``checkpoint.dir``::

    step_000010/trainer_rank0000.pt ...   one file per trainer rank (model, optimizer, RNG)
    step_000010/driver.pt                 step, data position, driver RNG, metrics so far
    step_000010/COMPLETE                  written last: a step directory without it is ignored
    latest                                name of the newest complete step directory

Every file is written to a temporary name and renamed, so a crash never leaves a half-written
file under a final name, and ``latest`` only ever points at a complete checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_torch_save(obj: Any, path: Path) -> None:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(Path(path), buf.getvalue())


class CheckpointManager:
    def __init__(self, directory: str | Path, keep_last: int | None = None):
        self.dir = Path(directory)
        self.keep_last = keep_last

    def step_dir(self, step: int) -> Path:
        return self.dir / f"step_{step:06d}"

    def begin(self, step: int) -> Path:
        d = self.step_dir(step)
        if d.exists():  # a stale partial write of the same step: start it over
            shutil.rmtree(d)
        d.mkdir(parents=True)
        return d

    def commit(self, step: int, driver_state: dict) -> Path:
        d = self.step_dir(step)
        atomic_torch_save(driver_state, d / "driver.pt")
        atomic_write_bytes(d / "COMPLETE", b"")
        atomic_write_bytes(self.dir / "latest", d.name.encode())
        self._prune()
        return d

    def latest(self) -> Path | None:
        marker = self.dir / "latest"
        if marker.exists():
            d = self.dir / marker.read_text().strip()
            if (d / "COMPLETE").exists():
                return d
        complete = sorted(p.parent for p in self.dir.glob("step_*/COMPLETE"))
        return complete[-1] if complete else None

    def resolve(self, resume: bool | str) -> Path | None:
        """``True`` -> the latest complete checkpoint (None if there is none); a path -> that one."""
        if resume is True:
            return self.latest()
        d = Path(resume)
        if not (d / "COMPLETE").exists():
            raise FileNotFoundError(f"checkpoint.resume: {d} is not a complete checkpoint (no COMPLETE marker)")
        return d

    @staticmethod
    def load_driver_state(d: Path) -> dict:
        return torch.load(Path(d) / "driver.pt", weights_only=False)

    def _prune(self) -> None:
        if not self.keep_last:
            return
        complete = sorted(p.parent for p in self.dir.glob("step_*/COMPLETE"))
        for old in complete[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
