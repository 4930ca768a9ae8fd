"""Distilled drafters cached like the tiny model: built once, reused by tests and benchmarks.

``ensure_distilled(cfg)`` runs :func:`cotrain.draft.distill.distill` into
``$COTRAIN_CACHE/drafters/<kind>-<key>/`` unless that directory already holds a finished run;
the key hashes the distillation config (output_dir, progress_bar and the draft keys only
co-training reads excluded: :data:`CO_TRAINING_ONLY`), the target (a
built-in model's name and build key, or the checkpoint's path) and the source of the drafter code, so editing a
drafter or its recipe rebuilds it. A lock file makes concurrent callers build once; the directory
appears atomically when complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from cotrain.config.distill import DistillConfig, load_distill_config
from cotrain.draft.distill import distill

_CODE_FILES = ("common.py", "registry.py", "eagle3.py", "dflash.py", "dspark.py", "losses.py", "taps.py",
               "distill.py", "export.py", "optim.py", "vocab.py")


#: the draft section's keys that act only in co-training (a GRPO run), never in distillation
CO_TRAINING_ONLY = ("cotrain", "init", "compare_frozen", "push_every", "budget", "tap_transport", "tap_timeout_s")


def _code_hash() -> str:
    h = hashlib.sha256()
    root = Path(__file__).parent
    for name in _CODE_FILES:
        h.update((root / name).read_bytes())
    return h.hexdigest()[:12]


def cache_key(cfg: DistillConfig) -> str:
    from cotrain.models.build_tiny import builtin_cache_id

    data = cfg.model_dump(mode="json")
    data.pop("output_dir", None)
    data.pop("progress_bar", None)
    if data.get("data", {}).get("ops") is None:  # the tiny task's operators: the key it had before ops existed
        data.get("data", {}).pop("ops", None)
    for key in CO_TRAINING_ONLY:  # draft keys distillation never reads: changing them keeps the cache
        data.get("draft", {}).pop(key, None)
    target = builtin_cache_id(cfg.target) or str(Path(cfg.target).resolve())
    blob = json.dumps([data, target, _code_hash()], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def distilled_dir(cfg: DistillConfig, root: Optional[Path] = None) -> Path:
    """Where the distillation of ``cfg`` is cached (``ensure_distilled`` fills it)."""
    from cotrain.models.build_tiny import cache_root

    return (Path(root) if root is not None else cache_root() / "drafters") / f"{cfg.draft.kind}-{cache_key(cfg)}"


def ensure_distilled(cfg: DistillConfig | str | Path, overrides: list[str] = (), progress: bool = False,
                     root: Optional[Path] = None) -> Path:
    """Directory of a finished distillation (``drafter/``, ``metrics.json``, ``curves.png``)."""
    if not isinstance(cfg, DistillConfig):
        cfg = load_distill_config(cfg, list(overrides))
    elif overrides:
        raise ValueError("overrides apply to a config file, not to a DistillConfig object")
    out = distilled_dir(cfg, root)
    root = out.parent
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_distilled(out):
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=out.name + ".tmp"))
            try:
                distill(cfg.model_copy(update={"output_dir": str(tmp), "progress_bar": progress}))
                os.replace(tmp, out)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return out


def is_distilled(path: str | Path) -> bool:
    """A finished distillation: its ``metrics.json`` is in the directory, which is published whole."""
    return (Path(path) / "metrics.json").exists()


def distilled_summary(path: str | Path) -> dict:
    return json.loads((Path(path) / "metrics.json").read_text())["summary"]
