"""What a push into an engine must carry, read from the engine's own checkpoint: names, shapes and
dtypes (:func:`checkpoint_manifest`), minus the target modules a drafter borrows
(:func:`shared_with_target`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from cotrain.weights.checks import SHARED_KEYS, WeightPushError


def checkpoint_manifest(path: str | os.PathLike) -> dict[str, tuple[list[int], str]]:
    """``{name: (shape, dtype)}`` of the safetensors checkpoint in directory ``path`` (headers only)."""
    from safetensors import safe_open

    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
    index = root / "model.safetensors.index.json"
    if root.is_dir() and index.exists():
        files = sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
    if not files or not all(f.exists() for f in files):
        raise WeightPushError(f"cannot validate pushes: no safetensors checkpoint at {str(path)!r} (cotrain "
                              "validates pushed names and shapes against the checkpoint the engine loaded)")
    out: dict[str, tuple[list[int], str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                sl = sf.get_slice(name)
                out[name] = (list(sl.get_shape()), _st_dtype(sl.get_dtype()))
    return out


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _st_dtype(code: str) -> str:
    return _ST_DTYPES.get(code, code.lower())


def shared_with_target(draft: torch.nn.Module, target: torch.nn.Module) -> set[str]:
    """Which of ``lm_head`` / ``embed_tokens`` the drafter borrows from the target (same object)."""
    target_ids = {id(p) for p in target.parameters()}
    shared = set()
    for name, p in draft.named_parameters(remove_duplicate=False):
        if id(p) in target_ids:
            shared.update(k for k in SHARED_KEYS if k in name.split("."))
    return shared
