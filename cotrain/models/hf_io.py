"""Reading and writing Hugging Face checkpoints (config.json + model.safetensors) on local disk."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cotrain.models.hf_arch import ArchSpec


def read_hf_config(path: str | Path) -> dict:
    path = Path(path)
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.exists():
        raise FileNotFoundError(f"no Hugging Face config.json at {cfg_file}")
    return json.loads(cfg_file.read_text())


def load_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (one or several ``*.safetensors`` files)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_hf_checkpoint(path: str | Path) -> tuple[ArchSpec, dict, dict[str, torch.Tensor]]:
    hf_config = read_hf_config(path)
    return ArchSpec.from_hf(hf_config), hf_config, load_hf_state_dict(path)


def save_safetensors_atomic(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write ``state`` to ``path`` through a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous() for k, v in state.items()}, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
