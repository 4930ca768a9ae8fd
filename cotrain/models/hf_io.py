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


def param_count(path: str | Path, skip: tuple[str, ...] = ("embed_tokens",)) -> int:
    """Parameters of a checkpoint directory from its safetensors headers alone (no tensor is read),
    without the tensors whose name contains one of ``skip`` (an embedding lookup is no matmul)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if not any(s in name for s in skip):
                    n = 1
                    for d in st.get_slice(name).get_shape():
                        n *= d
                    total += n
    return total


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


def safetensors_problems(path: str | Path) -> str | None:
    """Why ``path`` is not a complete safetensors file (None: it is), from its header alone: the
    8-byte header length, the JSON header, and every tensor's data inside the file (a truncated
    copy keeps its header but loses the end of its data)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path}: {size} bytes, too short for a safetensors header"
            n = int.from_bytes(head, "little")
            if n > size - 8:
                return f"{path}: its header claims {n} bytes, the file has {size} (truncated or not safetensors)"
            header = json.loads(f.read(n))
    except OSError as e:
        return f"{path}: cannot read ({e.strerror})"
    except (ValueError, UnicodeDecodeError) as e:
        return f"{path}: not a safetensors file (unreadable header: {e})"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and "data_offsets" in t]
    need = 8 + n + max(ends, default=0)
    if size < need:
        return f"{path}: {size} bytes, its header needs {need} (truncated)"
    return None
