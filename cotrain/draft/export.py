"""Export drafters in vLLM's format (config.json + model.safetensors) and load them back.

Per family (see each module for the architecture):

| kind   | vLLM method | ``architectures``         | tap ids in config.json                          |
|--------|-------------|---------------------------|-------------------------------------------------|
| eagle3 | eagle3      | LlamaForCausalLMEagle3    | ``eagle_aux_hidden_state_layer_ids`` = taps + 1 |
| dflash | dflash      | DFlashDraftModel (qwen3)  | ``dflash_config.target_layer_ids`` = taps       |
| dspark | dspark      | Qwen3DSparkModel (qwen3)  | ``dflash_config.target_layer_ids`` = taps       |

(taps in cotrain's convention, the output of layer i; see :mod:`cotrain.draft.taps`.)
The drafter's own tensors are written; the target's embeddings (all three) and LM head (DFlash,
DSpark) are shared by vLLM and never written. An EAGLE-3 drafter with a reduced draft vocabulary
also writes ``d2t`` (int64, target id = draft id + d2t[draft id]; ``draft_vocab_size`` in
config.json = its length); vLLM skips ``t2d``, so it is not written (:mod:`cotrain.draft.vocab`). config.json also carries a ``cotrain`` section
(kind, tap layers, block size / TTT steps) and ``cotrain_drafter.json`` the full settings, so
:func:`load_drafter` can rebuild the training module from an export.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from cotrain.draft.registry import Drafter, build_drafter
from cotrain.draft.taps import TargetSpec

META_FILE = "cotrain_drafter.json"


def export_drafter(drafter: Drafter, out_dir: str | Path, metadata: Optional[dict] = None) -> Path:
    """Write ``drafter`` to ``out_dir`` in vLLM's format (atomically: a temporary directory renamed
    into place; an existing directory is replaced). Returns the directory."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    config = drafter.vllm_config()
    # floating tensors as float32; integer ones (EAGLE-3's d2t) keep their dtype (vLLM loads d2t as int64)
    state = {k: (v.detach().to(torch.float32) if v.is_floating_point() else v.detach()).contiguous().cpu()
             for k, v in drafter.vllm_state_dict().items()}
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        meta = {"kind": drafter.kind, "settings": drafter.cfg.model_dump(mode="json"),
                "vllm_method": drafter.vllm_method, "tap_layers": drafter.tap_layers,
                "vllm_tap_ids": drafter.vllm_tap_ids, **(metadata or {})}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
        if out_dir.exists():
            old = out_dir.with_name(out_dir.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_export(path: str | Path) -> tuple[dict, dict, dict[str, torch.Tensor]]:
    """(config.json, cotrain metadata, tensors) of an exported drafter."""
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    meta = json.loads((path / META_FILE).read_text()) if (path / META_FILE).exists() else {}
    return config, meta, load_file(str(path / "model.safetensors"))


def load_drafter(path: str | Path, target: TargetSpec) -> Drafter:
    """Rebuild the training module from an export (settings from its metadata)."""
    config, meta, state = read_export(path)
    kind = meta.get("kind") or config.get("cotrain", {}).get("kind")
    if kind is None:
        raise ValueError(f"{path}: not a cotrain drafter export (no {META_FILE} or config.json 'cotrain' section)")
    drafter = build_drafter(kind, meta.get("settings"), target)
    drafter.load_vllm_state_dict(state)
    return drafter


def speculative_config(path: str | Path, num_speculative_tokens: Optional[int] = None, **extra) -> dict:
    """vLLM ``speculative_config`` for an exported drafter (method from its metadata)."""
    config, meta, _ = read_export(path)
    kind = meta.get("kind") or config.get("cotrain", {}).get("kind")
    method = meta.get("vllm_method") or kind
    if num_speculative_tokens is None:
        cot = config.get("cotrain", {})
        num_speculative_tokens = cot.get("block_size", 4) - (0 if kind == "dspark" else 1) if "block_size" in cot \
            else cot.get("ttt_steps", 3)
    out = {"method": method, "model": str(path), "num_speculative_tokens": int(num_speculative_tokens)}
    out.update(extra)
    return out
