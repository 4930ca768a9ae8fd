"""Atomic, verifiable, resumable checkpoints.

Layout under ``checkpoint.dir``::

    step_000010/trainer_rank0000.pt ...   one file per trainer rank, written by the rank itself
                                          (its model and optimizer state, RNG, steps done)
    step_000010/driver.pt                 the driver's state: {"step": 10, "data": the prompt
                                          stream's position {"epoch", "pos"}}
    step_000010/MANIFEST.json             size and sha256 of every other file of the step
    step_000010/COMPLETE                  written last: a step directory without it is ignored
    latest                                name of the newest complete step directory

Every file is written to a temporary name and renamed, so a crash never leaves a half-written
file under a final name, and ``latest`` only ever points at a complete checkpoint. A file can
still be damaged afterwards (a truncated copy, a full disk on a network file system): resuming
checks each candidate against its manifest before any worker loads it (:meth:`CheckpointManager.
resolve`), names the damaged file, and falls back to the previous complete checkpoint with a
warning. Checkpoints written before manifests existed are checked structurally (every ``.pt``
must open as torch's zip archive), which catches truncation.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

MANIFEST = "MANIFEST.json"
COMPLETE = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint (or one of its files, named in the message) cannot be used."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an older one."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """The sha256 of a file's bytes, read in chunks (hex)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _payload_files(d: Path) -> list[Path]:
    """The files a step directory's manifest covers: all but the markers and temporary files."""
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name not in (MANIFEST, COMPLETE)
                  and not (p.name.startswith(".") and p.name.endswith(".tmp")))


def write_manifest(d: Path) -> dict:
    """Record the size and sha256 of every payload file of step directory ``d`` (atomically)."""
    d = Path(d)
    files = {p.relative_to(d).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in _payload_files(d)}
    manifest = {"version": 1, "files": files}
    atomic_write_bytes(d / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest


def verify_checkpoint(d: Path, hashes: bool = True) -> list[str]:
    """Problems of step directory ``d``, each naming the file (empty = usable).

    With a manifest: every listed file exists with its size (and, with ``hashes``, its sha256).
    Without one (older checkpoints): every ``.pt`` file opens as a zip archive (torch's format)."""
    d = Path(d)
    if not (d / COMPLETE).exists():
        return [f"{d}: no {COMPLETE} marker (the checkpoint was never finished)"]
    mpath = d / MANIFEST
    if not mpath.exists():
        problems = []
        for p in sorted(d.rglob("*.pt")):
            try:
                with zipfile.ZipFile(p):
                    pass
            except (zipfile.BadZipFile, OSError) as e:
                problems.append(f"{p}: damaged or truncated ({e})")
        if not (d / "driver.pt").exists():
            problems.append(f"{d / 'driver.pt'}: missing")
        return problems
    try:
        files = json.loads(mpath.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{mpath}: unreadable manifest ({e})"]
    problems = []
    for name, meta in sorted(files.items()):
        p = d / name
        if not p.is_file():
            problems.append(f"{p}: missing")
            continue
        size = p.stat().st_size
        if size != meta["size"]:
            problems.append(f"{p}: {size} bytes, the manifest says {meta['size']} (truncated or overwritten)")
        elif hashes and sha256_file(p) != meta["sha256"]:
            problems.append(f"{p}: sha256 differs from the manifest (corrupted)")
    return problems


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


def load_plain(path: Path, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)``: tensors, numbers, strings and plain containers only.

    A checkpoint is data, never code: a file whose pickle names any other object (which a
    ``weights_only=False`` load would construct, running whatever its ``__reduce__`` says) is
    refused with :class:`CheckpointError` naming the file, as is a damaged one. The manifest's
    sha256 proves a file unchanged since it was written, not who wrote it."""
    import pickle

    path = Path(path)
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"{path}: refused: it holds a pickled Python object, not only tensors and plain "
                              f"containers, and loading it could run code ({first})") from None
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/EOFError/... for a damaged file
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"{path}: cannot be loaded, the file is damaged or truncated "
                              f"({type(e).__name__}: {first})") from None


def unsafe_files(d: Path) -> list[str]:
    """Problems of step directory ``d``'s ``.pt`` files under :func:`load_plain` (memory-mapped:
    the tensors are not read), each naming the file."""
    problems = []
    for p in sorted(Path(d).glob("*.pt")):
        try:
            load_plain(p, mmap=True, map_location="cpu")
        except CheckpointError as e:
            problems.append(str(e))
    return problems


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

    def commit(self, step: int, driver_state: dict, config_yaml: str | None = None) -> Path:
        """After every rank has written its files: the driver's state (and the run's resolved config
        as ``config.yaml``), the manifest, ``COMPLETE``, ``latest``; then prune."""
        d = self.step_dir(step)
        atomic_torch_save(driver_state, d / "driver.pt")
        if config_yaml is not None:
            atomic_write_bytes(d / "config.yaml", config_yaml.encode())
        write_manifest(d)
        atomic_write_bytes(d / COMPLETE, b"")
        atomic_write_bytes(self.dir / "latest", d.name.encode())
        self._prune(step)
        return d

    def latest(self) -> Path | None:
        marker = self.dir / "latest"
        if marker.exists():
            d = self.dir / marker.read_text().strip()
            if (d / "COMPLETE").exists():
                return d
        complete = sorted(p.parent for p in self.dir.glob("step_*/COMPLETE"))
        return complete[-1] if complete else None

    def complete(self) -> list[Path]:
        """Complete step directories, newest first; the one ``latest`` names leads (newer ones after
        it are ignored, as before)."""
        done = sorted((p.parent for p in self.dir.glob(f"step_*/{COMPLETE}")), reverse=True)
        head = self.latest()
        if head is not None and head in done:
            done = [head] + [p for p in done if p.name < head.name]
        return done

    def _first_usable(self, candidates: list[Path], hashes: bool, failures: list[str]) -> int | None:
        """Index of the first candidate that verifies; each damaged one before it is warned about."""
        for i, d in enumerate(candidates):
            problems = verify_checkpoint(d, hashes)
            if not problems:
                return i
            failures.append(f"{d.name}: {'; '.join(problems)}")
            more = "; falling back to the previous complete checkpoint" if i + 1 < len(candidates) else ""
            warnings.warn(CheckpointWarning(f"checkpoint {d} is damaged, not resuming from it: "
                                            f"{'; '.join(problems)}{more}"), stacklevel=3)
        return None

    def resolve(self, resume: bool | str, hashes: bool = True) -> Path | None:
        """The checkpoint to resume from, verified (:func:`verify_checkpoint`) before any worker loads it.

        ``True`` -> the newest complete checkpoint that verifies: a damaged one is named in a
        :class:`CheckpointWarning` and the previous complete one is tried; None when there is no
        complete checkpoint at all; :class:`CheckpointError` when every one is damaged. A path ->
        that checkpoint, or :class:`CheckpointError` naming the damaged file (no fallback: it was
        asked for by name)."""
        if resume is True:
            candidates, failures = self.complete(), []
            if not candidates:
                return None
            i = self._first_usable(candidates, hashes, failures)
            if i is None:
                raise CheckpointError(f"checkpoint.resume: no usable checkpoint in {self.dir}: " + " | ".join(failures))
            return candidates[i]
        d = Path(resume)
        if not (d / COMPLETE).exists():
            raise FileNotFoundError(f"checkpoint.resume: {d} is not a complete checkpoint (no COMPLETE marker)")
        problems = verify_checkpoint(d, hashes)
        if problems:
            raise CheckpointError(f"checkpoint.resume: {d} is damaged: {'; '.join(problems)}")
        return d

    def load_with_fallback(self, resume: bool | str, load: Callable[[Path], Any],
                           hashes: bool = True) -> tuple[Path, Any] | None:
        """:meth:`resolve`, then ``load(step_dir)``. For ``resume=True``, when ``load`` raises, warn
        naming the checkpoint and the error and go on with the previous verified one. Returns
        ``(step_dir, load's result)``, or None when there is no complete checkpoint."""
        if resume is not True:
            d = self.resolve(resume, hashes)
            return (d, load(d)) if d is not None else None
        candidates, failures = self.complete(), []
        if not candidates:
            return None
        while candidates:
            i = self._first_usable(candidates, hashes, failures)
            if i is None:
                break
            d = candidates[i]
            try:
                return d, load(d)
            except Exception as e:  # noqa: BLE001 - any failure to load falls back, named
                msg = str(e).splitlines()[0] if str(e) else ""
                failures.append(f"{d.name}: {type(e).__name__}: {msg}")
                candidates = candidates[i + 1:]
                more = "; falling back to the previous complete checkpoint" if candidates else ""
                warnings.warn(CheckpointWarning(f"checkpoint {d} could not be loaded ({type(e).__name__}: {msg}){more}"),
                              stacklevel=2)
        raise CheckpointError(f"checkpoint.resume: no usable checkpoint in {self.dir}: " + " | ".join(failures))

    @staticmethod
    def load_driver_state(d: Path) -> dict:
        """driver.pt of step directory ``d``; :class:`CheckpointError` naming the file if unreadable
        or if it holds anything but tensors and plain containers (:func:`load_plain`)."""
        return load_plain(Path(d) / "driver.pt")

    def _prune(self, step: int) -> None:
        """Keep the ``keep_last`` newest complete checkpoints up to ``step`` (the one just written
        among them). Newer ones - left by a run that was resumed from an older checkpoint - are not
        this continuation's and are left alone rather than counted (counting them would delete the
        checkpoint just written)."""
        if not self.keep_last:
            return
        complete = sorted(p.parent for p in self.dir.glob(f"step_*/{COMPLETE}") if p.parent.name <= f"step_{step:06d}")
        for old in complete[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
