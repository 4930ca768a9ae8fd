"""What changed since a checkpoint, and whether a resume may apply it.

Every checkpoint holds the resolved config it was written under (``config.yaml``, beside
``driver.pt``). Resuming compares it with the config of the new run, key by key (dotted paths):

    ignored   where the run writes and how it logs (run.output_dir, run.name, run.overwrite,
              checkpoint.dir / resume, logging.*): not part of what the run computes
    refused   what the checkpoint's state cannot follow (the model, its dtype, layer spec and
              parallel layout; the drafter's kind and architecture) or what would make the resumed
              run something other than a continuation (the data and its order: the prompt stream's
              position is an index into them; the environment, env.kind, and the calculator's
              rewards, env.calculator.*), each with its reason, before any worker starts
    applied   everything else (learning rates, loss settings, sampling, step counts, ...): the new
              value holds from the first resumed step on, and the driver says so
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CONFIG_FILE = "config.yaml"

_IGNORED = ("run.output_dir", "run.name", "run.overwrite", "checkpoint.dir", "checkpoint.resume", "logging.",
            "cluster.cpus_per_node")

#: prefix -> why a change cannot be resumed
_REFUSED = {
    "policy.model_path": "the checkpoint holds this model's weights",
    "policy.dtype": "the checkpoint's weights and optimizer state are in the dtype they were saved in",
    "policy.layer_spec": "the layer spec names the checkpoint's parameters",
    "policy.parallel.": "every trainer rank's file holds its shard of the layout it was saved with",
    "draft.kind": "the checkpoint holds this drafter's weights",
    "draft.cotrain": "the checkpoint's trainer state holds a co-trained drafter or none",
    "run.seed": "the prompt stream's order and the sampling seeds derive from it",
    "grpo.max_staleness": "the checkpoint holds the samples in flight of its staleness schedule (the next steps' "
                          "rollouts, sampled by policies it no longer holds)",
    "data.": "the prompt stream's position is an index into the data in its order",  # (data.eval.* applies)
    # multi-turn: the environment poses the task and grades it; its rewards are recorded with the samples
    # (samples in flight included), never recomputed. Its timing (env.timeout_s, env.tool_latency_s) applies.
    "env.kind": "the environment defines the task the run's policy is trained on and the rewards recorded with "
                "its samples (samples in flight included)",
    "env.calculator.": "the calculator's rewards are recorded with the samples (samples in flight included), "
                       "never recomputed",
}

#: drafter settings that shape its weights (the rest are training settings and apply)
_DRAFT_ARCH = ("tap_layers", "num_layers", "block_size", "markov_rank", "markov_head", "confidence_head",
               "draft_vocab_size")


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _reason(key: str, kind: str | None) -> str | None:
    if key.startswith("data.eval."):
        return None  # held-out prompts: not the training stream
    for prefix, why in _REFUSED.items():
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return why
    if kind is not None and key.startswith(f"draft.{kind}.") and key.rsplit(".", 1)[1] in _DRAFT_ARCH:
        return "it shapes the drafter's weights, which the checkpoint holds"
    return None


def changes(saved: dict, now: dict) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any, str]]]:
    """``(applied, refused)`` between the checkpoint's resolved config ``saved`` and ``now`` (both as
    ``to_dict()``): ``(key, old, new)`` and ``(key, old, new, why)``, sorted by key. Only the active
    drafter kind's settings are compared."""
    kind = now.get("draft", {}).get("kind")
    a, b = flatten(saved), flatten(now)
    applied, refused = [], []
    for key in sorted(set(a) | set(b)):
        if key.startswith(_IGNORED) or a.get(key) == b.get(key):
            continue
        if key.startswith("draft.") and key.split(".")[1] in ("eagle3", "dflash", "dspark") and key.split(".")[1] != kind:
            continue
        why = _reason(key, kind)
        if why is None:
            applied.append((key, a.get(key), b.get(key)))
        else:
            refused.append((key, a.get(key), b.get(key), why))
    return applied, refused


def saved_config(step_dir: str | Path) -> dict | None:
    """The resolved config a checkpoint was written under (None: written before configs were saved)."""
    path = Path(step_dir) / CONFIG_FILE
    if not path.exists():
        return None
    return yaml.safe_load(path.read_text())


def diff_against(step_dir: str | Path, now: dict) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, str]]]:
    """``(applied, refusals)`` of a resume of ``step_dir`` with the config ``now`` (``to_dict()``):
    the changes it applies, and one ``(key, message)`` config issue per change it cannot follow
    (both empty for a checkpoint written before configs were saved)."""
    saved = saved_config(step_dir)
    if saved is None:
        return [], []
    applied, refused = changes(saved, now)
    return applied, [(key, f"{new!r} differs from {old!r} in checkpoint {step_dir}, which a resume cannot follow: "
                      f"{why} (allowed: {old!r}, or a fresh run in another run.output_dir)")
                     for key, old, new, why in refused]


def describe(applied: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in applied)
