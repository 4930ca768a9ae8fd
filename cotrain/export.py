"""Export a trainer checkpoint: the policy as a Hugging Face checkpoint, the co-trained drafter in vLLM's format.

    python -m cotrain.export <run dir | checkpoint dir | step dir> <out dir> [--step N] [--model-path DIR]

Input. A run's ``run.output_dir`` (its checkpoints under ``checkpoints/``), a ``checkpoint.dir``
(``step_XXXXXX/`` folders and ``latest``) or one step folder. From a run or checkpoint folder the
step ``latest`` names is exported, ``--step N`` picks ``step_N``. The step is verified against its
``MANIFEST.json`` first (every file's size and sha256: a damaged or missing file is named) and every
file is read as data only (:func:`cotrain.checkpoint.load_plain`; no Megatron, no process group).
The run's resolved ``config.yaml`` beside the files gives the base model (``policy.model_path``,
``--model-path`` overrides it) and the drafter's settings.

Output (written to a temporary folder beside ``<out dir>``, renamed into place when complete; a
previous export there is replaced, any other existing folder is refused)::

    <out>/policy/config.json        the base model's config.json, its dtype the trained tensors'
    <out>/policy/model.safetensors  the merged policy, Hugging Face names
    <out>/policy/<tokenizer files>  copied from the base model folder (everything but its weights,
                                    config.json, cotrain_build.json and README.md)
    <out>/drafter/                  the co-trained drafter, when the checkpoint holds one: vLLM's format
                                    (cotrain.draft.export.export_drafter, what the engines are pushed;
                                    cotrain.draft.export.load_drafter reads it back)
    <out>/cotrain_export.json       the source step, its layout, the base model, what was written

Merging the shards. Each ``trainer_rankNNNN.pt`` holds its rank's ``layout`` (tp_rank / tp, pp_rank
/ pp, cp_rank / cp, dp_rank / dp, layer_offset) and ``model``: the local Megatron module's tensors
(local-spec names, the stage's layers numbered from 0, this TP rank's slice). Data- and
context-parallel ranks hold replicas, so the ranks with dp_rank = cp_rank = 0 are taken, one per
(pp_rank, tp_rank), and every one of them must be there. Per stage the TP slices are concatenated
in tp_rank order (:func:`cotrain.models.convert.tp_gather`: column-parallel QKV / embedding / LM
head on dim 0, FC1's gate and up halves each on dim 0, row-parallel projections on dim 1, norms
replicated), the stage's layer i becomes global layer layer_offset + i
(:func:`~cotrain.models.convert.from_local`), the stages' tensors are united (every global layer
0..L-1 exactly once), a tied LM head's last-stage copy is dropped, and the full Megatron state is
converted to Hugging Face names (:func:`~cotrain.models.convert.megatron_to_hf`: exact, no
arithmetic). The result must have exactly the base model's tensor names and shapes. Checkpoints
written before ranks recorded their layout are placed by Megatron's rank order (tp fastest, then
cp, dp, pp) from ``policy.parallel`` in config.yaml, layer offsets from the stages' layer counts.

The drafter (``draft`` in the last stage's tp_rank = 0 file): rebuilt from ``draft.kind`` and its
settings in config.yaml (:func:`cotrain.draft.registry.build_drafter`) against the exported policy
(its shared embedding / LM head, never written), its reduced draft vocabulary set first, then its
parameters loaded, and written with :func:`~cotrain.draft.export.export_drafter`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from cotrain.checkpoint import COMPLETE, CheckpointError, CheckpointManager, load_plain, verify_checkpoint

EXPORT_FILE = "cotrain_export.json"
CONFIG_FILE = "config.yaml"
_RANK_RE = re.compile(r"^trainer_rank(\d{4,})\.pt$")
_STEP_RE = re.compile(r"^step_(\d+)$")
LAYOUT_KEYS = ("rank", "world_size", "tp_rank", "tp", "pp_rank", "pp", "cp_rank", "cp", "dp_rank", "dp",
               "layer_offset")
#: base-model files never copied into the export (its weights, its config - rewritten -, its card)
_NOT_COPIED = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.bin\.index\.json|\.pt|\.pth|\.ckpt"
                         r"|\.gguf|\.h5|\.msgpack)$|^(config\.json|cotrain_build\.json|README\.md)$|^\.")


class ExportError(ValueError):
    """The export cannot start: no checkpoint where it was pointed, a step that does not exist, an
    output folder it must not replace (the message names the path and what exists)."""


# --------------------------------------------------------------------------------------- finding the step
def _complete_steps(ckpt_dir: Path) -> list[Path]:
    return sorted(p.parent for p in ckpt_dir.glob(f"step_*/{COMPLETE}") if _STEP_RE.match(p.parent.name))


def _describe_steps(ckpt_dir: Path) -> str:
    done = [p.name for p in _complete_steps(ckpt_dir)]
    partial = sorted(p.name for p in ckpt_dir.glob("step_*") if p.is_dir() and p.name not in done)
    out = f"complete steps: {', '.join(done) if done else 'none'}"
    return out + (f"; unfinished (no {COMPLETE}): {', '.join(partial)}" if partial else "")


def _is_step_dir(d: Path) -> bool:
    return (d / COMPLETE).exists() or (d / "driver.pt").exists() or any(d.glob("trainer_rank*.pt"))


def find_step_dir(path: str | Path, step: Optional[int] = None) -> Path:
    """The step folder ``path`` designates (see the module doc); :class:`ExportError` naming what
    was looked for and which steps exist."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path}: no such directory (allowed: a run's output_dir, a checkpoint.dir or a step_* "
                          "folder of one)")
    if _is_step_dir(path):
        if step is not None and path.name != f"step_{step:06d}":
            raise ExportError(f"--step {step}: {path} is the checkpoint {path.name}; pass its parent folder to pick "
                              "another step")
        if not (path / COMPLETE).exists():
            raise ExportError(f"{path}: not a complete checkpoint (no {COMPLETE} marker: it was never finished); "
                              f"{_describe_steps(path.parent)}")
        return path
    candidates = [path, path / "checkpoints"]
    ckpt = next((c for c in candidates if (c / "latest").exists() or any(c.glob("step_*"))), None)
    if ckpt is None:
        raise ExportError(f"{path}: no checkpoint there (looked for step_* folders in {path} and {path / 'checkpoints'}; "
                          "a run whose checkpoint.dir points elsewhere: pass that folder)")
    if step is not None:
        d = ckpt / f"step_{step:06d}"
        if not (d / COMPLETE).exists():
            raise ExportError(f"--step {step}: {d} is not a complete checkpoint; {_describe_steps(ckpt)}")
        return d
    d = CheckpointManager(ckpt).latest()
    if d is None:
        raise ExportError(f"{ckpt}: no complete checkpoint; {_describe_steps(ckpt)}")
    return d


# --------------------------------------------------------------------------------------- reading the step
def read_config(step_dir: Path):
    """The run's resolved config saved beside the step (a CotrainConfig, schema-validated only: the
    data files and resources of the run need not exist here); None when the step has none."""
    import yaml

    from cotrain.config.errors import ConfigError, from_validation_error
    from cotrain.config.schema import CotrainConfig
    from pydantic import ValidationError

    path = Path(step_dir) / CONFIG_FILE
    if not path.exists():
        return None
    try:
        return CotrainConfig.model_validate(yaml.safe_load(path.read_text()))
    except (yaml.YAMLError, ValidationError) as e:
        detail = str(from_validation_error(e, CotrainConfig)) if isinstance(e, ValidationError) else str(e)
        raise CheckpointError(f"{path}: not a config this cotrain can read ({detail})") from None
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None


def legacy_layout(rank: int, world_size: int, parallel) -> dict[str, int]:
    """A rank's coordinates under Megatron's default order ``tp-cp-ep-dp-pp`` (tp fastest), for
    checkpoints written before ranks recorded their layout (no layer_offset: derived by the merge)."""
    tp, cp, pp = int(parallel.tensor), int(parallel.context), int(parallel.pipeline)
    if world_size % (tp * cp * pp):
        raise CheckpointError(f"policy.parallel tensor={tp} x context={cp} x pipeline={pp} does not divide the "
                              f"checkpoint's {world_size} rank files")
    dp = world_size // (tp * cp * pp)
    return {"rank": rank, "world_size": world_size, "tp_rank": rank % tp, "tp": tp,
            "cp_rank": rank // tp % cp, "cp": cp, "dp_rank": rank // (tp * cp) % dp, "dp": dp,
            "pp_rank": rank // (tp * cp * dp), "pp": pp}


def rank_files(step_dir: Path) -> dict[int, Path]:
    files = {int(m.group(1)): p for p in Path(step_dir).iterdir() if (m := _RANK_RE.match(p.name))}
    if not files:
        raise CheckpointError(f"{step_dir}: no trainer_rank*.pt files")
    missing = sorted(set(range(max(files) + 1)) - set(files))
    if missing:
        raise CheckpointError(f"{step_dir}: trainer_rank{missing[0]:04d}.pt missing (rank files "
                              f"{sorted(files)}; ranks 0..{max(files)} expected)")
    return files


def _layer_count(state: dict[str, torch.Tensor]) -> int:
    ids = [int(m.group(1)) for k in state if (m := re.match(r"^decoder\.layers\.(\d+)\.", k))]
    return max(ids) + 1 if ids else 0


def load_shards(step_dir: Path, cfg=None) -> tuple[dict[str, int], dict[tuple[int, int], dict], Optional[dict]]:
    """``(sizes, shards, draft)``: the layout's sizes {tp, pp, cp, dp, world_size, recorded};
    {(pp_rank, tp_rank): {"file", "layout", "model"}} of the dp_rank = cp_rank = 0 ranks; the
    drafter's trainer state (from the last stage's tp_rank 0 file) or None. Tensors memory-mapped."""
    files = rank_files(step_dir)
    world = len(files)
    shards: dict[tuple[int, int], dict] = {}
    draft = None
    recorded = None
    for rank, path in sorted(files.items()):
        state = load_plain(path, mmap=True, map_location="cpu")
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise CheckpointError(f"{path}: no 'model' tensors (not a trainer rank file)")
        layout = state.get("layout")
        if recorded is None:
            recorded = layout is not None
        if (layout is not None) != recorded:
            raise CheckpointError(f"{path}: {'records' if layout is not None else 'does not record'} its layout, "
                                  f"unlike {files[0].name}")
        if layout is None:
            if cfg is None:
                raise CheckpointError(f"{path}: records no layout and the step has no {CONFIG_FILE} to derive it from")
            layout = legacy_layout(rank, world, cfg.policy.parallel)
        else:
            bad = [k for k in LAYOUT_KEYS if not isinstance(layout.get(k), int)]
            if bad:
                raise CheckpointError(f"{path}: layout lacks {bad} (has {sorted(layout)})")
            if layout["rank"] != rank or layout["world_size"] != world:
                raise CheckpointError(f"{path}: its layout says rank {layout['rank']} of {layout['world_size']}, the "
                                      f"step holds {world} rank files")
        if layout["tp"] * layout["pp"] * layout["cp"] * layout["dp"] != world:
            raise CheckpointError(f"{path}: layout tp={layout['tp']} x pp={layout['pp']} x cp={layout['cp']} x "
                                  f"dp={layout['dp']} != {world} rank files")
        if layout["dp_rank"] or layout["cp_rank"]:
            continue  # a replica of the dp_rank = cp_rank = 0 rank's weights
        key = (layout["pp_rank"], layout["tp_rank"])
        if key in shards:
            raise CheckpointError(f"{path}: pp_rank {key[0]} tp_rank {key[1]} is also {shards[key]['file'].name}'s")
        shards[key] = {"file": path, "layout": layout, "model": state["model"]}
        if "draft" in state and key[1] == 0 and layout["pp_rank"] == layout["pp"] - 1:
            draft = state["draft"]
    first = shards[min(shards)]["layout"]
    sizes = {"tp": first["tp"], "pp": first["pp"], "cp": first["cp"], "dp": first["dp"], "world_size": world,
             "recorded": bool(recorded)}
    for s in shards.values():
        if any(s["layout"][k] != sizes[k] for k in ("tp", "pp", "cp", "dp")):
            raise CheckpointError(f"{s['file']}: layout sizes {[s['layout'][k] for k in ('tp', 'pp', 'cp', 'dp')]} "
                                  f"differ from {shards[min(shards)]['file'].name}'s")
    absent = [(p, t) for p in range(sizes["pp"]) for t in range(sizes["tp"]) if (p, t) not in shards]
    if absent:
        raise CheckpointError(f"{step_dir}: no rank file holds pp_rank {absent[0][0]} tp_rank {absent[0][1]} at "
                              "dp_rank 0, cp_rank 0")
    return sizes, shards, draft


# --------------------------------------------------------------------------------------- merging
def merge_policy(sizes: dict[str, int], shards: dict[tuple[int, int], dict], arch) -> dict[str, torch.Tensor]:
    """The full Megatron state (global layer names, TP = 1) from the shards (module doc)."""
    from cotrain.models import convert

    full: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    offset = 0
    for p in range(sizes["pp"]):
        parts = [shards[(p, t)] for t in range(sizes["tp"])]
        names = set(parts[0]["model"])
        for s in parts[1:]:
            if set(s["model"]) != names:
                raise CheckpointError(f"{s['file']}: its tensors {sorted(set(s['model']) ^ names)} differ from "
                                      f"{parts[0]['file'].name}'s (the same stage)")
        stage = {n: convert.tp_gather(n, [s["model"][n] for s in parts]) for n in sorted(names)}
        recorded = parts[0]["layout"].get("layer_offset")
        if recorded is not None and recorded != offset:
            raise CheckpointError(f"{parts[0]['file']}: layer_offset {recorded}, but the earlier stages hold {offset} "
                                  "layers (a stage is missing or stages overlap)")
        for k, v in convert.from_local(stage, offset).items():
            if k in full and k != "output_layer.weight":
                raise CheckpointError(f"{parts[0]['file']}: {k} also in {where[k].name}")
            full[k], where[k] = v, parts[0]["file"]
        offset += _layer_count(stage)
    if offset != arch.num_layers:
        raise CheckpointError(f"the checkpoint's stages hold {offset} decoder layers, the base model has "
                              f"{arch.num_layers} (wrong policy.model_path / --model-path?)")
    if arch.tie_word_embeddings:
        full.pop("output_layer.weight", None)  # the last stage's copy of the tied embedding
    return full


def _base_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{model_dir}: no *.safetensors files (the base model's weights name its tensors)")
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            shapes.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
    return shapes


def to_hf(full: dict[str, torch.Tensor], arch, base_dir: Path) -> dict[str, torch.Tensor]:
    """``full`` in Hugging Face names, checked name by name and shape by shape against the base model."""
    from cotrain.models import convert

    base = _base_shapes(base_dir)
    meta = {k: torch.empty(s, device="meta") for k, s in base.items()}
    expected = set(convert.hf_to_megatron(meta, arch))  # the Megatron names the conversion reads
    missing, extra = sorted(expected - set(full)), sorted(set(full) - expected)
    if missing or extra:
        raise CheckpointError(f"the merged Megatron state does not fit the base model {base_dir}: missing {missing}, "
                              f"unexpected {extra}")
    hf = convert.megatron_to_hf(full, arch)
    if set(hf) != set(base):
        raise CheckpointError(f"converted names differ from {base_dir}'s: {sorted(set(hf) ^ set(base))}")
    wrong = [f"{k}: {tuple(v.shape)} vs {base[k]}" for k, v in sorted(hf.items()) if tuple(v.shape) != base[k]]
    if wrong:
        raise CheckpointError(f"merged shapes differ from the base model {base_dir}'s: {'; '.join(wrong[:5])}")
    return hf


# --------------------------------------------------------------------------------------- the drafter
def load_draft_state(drafter, state: dict, source: Path) -> None:
    """The co-trained drafter's parameters (and reduced vocabulary) from its trainer state
    (:meth:`cotrain.draft.online.OnlineDraftTrainer.state_dict`) into ``drafter``."""
    from cotrain.draft.vocab import DraftVocab

    own = dict(drafter.named_parameters())
    saved = state.get("drafter")
    if not isinstance(saved, dict) or set(saved) != set(own):
        have = set(saved) if isinstance(saved, dict) else set()
        raise CheckpointError(f"{source}: its drafter does not match draft.{drafter.kind} of {CONFIG_FILE}: missing "
                              f"{sorted(set(own) - have)}, unexpected {sorted(have - set(own))}")
    vs, vocab = state.get("vocab"), getattr(drafter, "vocab", None)
    if (vs is None) != (vocab is None):
        raise CheckpointError(f"{source}: the drafter {'has' if vs is not None else 'has no'} reduced draft vocabulary, "
                              f"draft.{drafter.kind} of {CONFIG_FILE} {'does not' if vs is not None else 'does'}")
    if vs is not None:
        drafter.set_vocab(DraftVocab(vs["target_ids"], vocab.vocab_size, source=vs["source"],
                                     version=int(vs["version"])), remap=False)
    with torch.no_grad():
        for n, p in own.items():
            if tuple(saved[n].shape) != tuple(p.shape):
                raise CheckpointError(f"{source}: drafter tensor {n} has shape {tuple(saved[n].shape)}, "
                                      f"draft.{drafter.kind} builds {tuple(p.shape)}")
            p.copy_(saved[n])


def export_draft(cfg, state: dict, source: Path, policy_dir: Path, out_dir: Path, metadata: dict) -> Path:
    from cotrain.draft.export import export_drafter
    from cotrain.draft.registry import build_drafter
    from cotrain.draft.taps import TargetSpec

    if cfg is None or cfg.draft.kind is None:
        raise CheckpointError(f"{source} holds a co-trained drafter but {source.parent / CONFIG_FILE} names no "
                              "draft.kind to rebuild it with")
    target = TargetSpec.from_checkpoint(policy_dir)
    drafter = build_drafter(cfg.draft.kind, cfg.draft.settings, target, seed=cfg.run.seed)
    load_draft_state(drafter, state, source)
    return export_drafter(drafter, out_dir, metadata=metadata)


# --------------------------------------------------------------------------------------- writing
def _dtype_name(hf: dict[str, torch.Tensor]) -> str:
    dtypes = {v.dtype for v in hf.values() if v.is_floating_point()}
    if len(dtypes) != 1:
        raise CheckpointError(f"the policy's tensors have several floating dtypes {sorted(map(str, dtypes))}")
    return str(dtypes.pop()).removeprefix("torch.")


def write_policy(hf: dict[str, torch.Tensor], base_dir: Path, out_dir: Path) -> list[str]:
    """config.json (the base's, its dtype the tensors'), model.safetensors, the tokenizer files."""
    from cotrain.models.hf_io import read_hf_config, save_safetensors_atomic

    out_dir.mkdir(parents=True)
    config = read_hf_config(base_dir)
    dtype = _dtype_name(hf)
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_safetensors_atomic(hf, out_dir / "model.safetensors")
    copied = []
    for f in sorted(base_dir.iterdir()):
        if f.is_file() and not _NOT_COPIED.search(f.name):
            shutil.copy2(f, out_dir / f.name)
            copied.append(f.name)
    return copied


def _check_replaceable(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not (out / EXPORT_FILE).exists():
        raise ExportError(f"{out}: exists and is not a cotrain export (no {EXPORT_FILE}); not replacing it "
                          "(allowed: a new folder, an empty one or a previous export)")


def _usual_modes(root: Path) -> None:
    """Temporary folders and files are created private (0700 / 0600): give the export the modes the
    umask gives new files (it is the user's result, not a secret)."""
    mask = os.umask(0)
    os.umask(mask)
    for p in [root, *root.rglob("*")]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def _replace_dir(tmp: Path, out: Path) -> None:
    """``tmp`` renamed to ``out``; a previous export there moved aside first, then deleted."""
    _check_replaceable(out)
    if out.exists():
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old"))
        os.replace(out, old / out.name)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def export_checkpoint(step_dir: str | Path, out_dir: str | Path, model_path: Optional[str] = None) -> dict[str, Any]:
    """Export one verified step folder into ``out_dir`` (module doc); returns what was written
    (the content of ``cotrain_export.json``)."""
    from cotrain.models.build_tiny import resolve_model_path
    from cotrain.models.hf_arch import ArchSpec
    from cotrain.models.hf_io import read_hf_config

    step_dir, out = Path(step_dir).resolve(), Path(out_dir).resolve()
    problems = verify_checkpoint(step_dir)
    if problems:
        raise CheckpointError(f"{step_dir} is damaged: {'; '.join(problems)}")
    cfg = read_config(step_dir)
    if model_path is None:
        if cfg is None:
            raise ExportError(f"{step_dir}: no {CONFIG_FILE} naming the base model; pass --model-path")
        model_path = cfg.policy.model_path
    base_dir = Path(resolve_model_path(model_path, progress=False))
    if not (base_dir / "config.json").exists():
        raise ExportError(f"policy.model_path: {model_path} -> {base_dir} holds no config.json (the base model moved? "
                          "pass --model-path)")
    arch = ArchSpec.from_hf(read_hf_config(base_dir))
    named = _STEP_RE.match(step_dir.name)
    step = int(load_plain(step_dir / "driver.pt").get("step", named.group(1) if named else -1))

    sizes, shards, draft_state = load_shards(step_dir, cfg)
    hf = to_hf(merge_policy(sizes, shards, arch), arch, base_dir)

    _check_replaceable(out)  # before any work
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp"))
    try:
        copied = write_policy(hf, base_dir, tmp / "policy")
        summary: dict[str, Any] = {
            "step": step, "checkpoint": str(step_dir), "base_model": str(model_path), "base_dir": str(base_dir),
            "layout": {k: sizes[k] for k in ("tp", "pp", "cp", "dp", "world_size")},
            "layout_recorded": sizes["recorded"],
            "merged_ranks": [shards[k]["layout"]["rank"] for k in sorted(shards)],
            "policy": {"dir": str(out / "policy"), "architectures": read_hf_config(tmp / "policy").get("architectures"),
                       "parameters": int(sum(v.numel() for v in hf.values())), "dtype": _dtype_name(hf),
                       "copied": copied},
            "drafter": None,
        }
        if draft_state is not None:
            src = shards[(sizes["pp"] - 1, 0)]["file"]
            export_draft(cfg, draft_state, src, tmp / "policy", tmp / "drafter", {"step": step, "checkpoint": str(step_dir)})
            summary["drafter"] = {"dir": str(out / "drafter"), "kind": cfg.draft.kind, "from": src.name}
        (tmp / EXPORT_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        _usual_modes(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def export_run(path: str | Path, out_dir: str | Path, step: Optional[int] = None,
               model_path: Optional[str] = None) -> dict[str, Any]:
    """:func:`find_step_dir` then :func:`export_checkpoint`."""
    return export_checkpoint(find_step_dir(path, step), out_dir, model_path)


def export_final(checkpoint_dir: str | Path, output_dir: str | Path) -> Optional[dict[str, Any]]:
    """The driver's end-of-run export (``checkpoint.export_final``): the latest complete checkpoint
    of ``checkpoint_dir`` into ``<output_dir>/export``, printed. A checkpoint that cannot be exported
    does not fail the finished run: the reason and the command to retry are printed, None returned."""
    out = Path(output_dir) / "export"
    try:
        summary = export_run(checkpoint_dir, out)
    except (ExportError, CheckpointError) as e:
        print(f"no export of the run (checkpoint.export_final): {e}\n  retry: python -m cotrain.export "
              f"{checkpoint_dir} {out}")
        return None
    print(describe(summary))
    return summary


def describe(summary: dict[str, Any]) -> str:
    lay = summary["layout"]
    merged = ", ".join(map(str, summary["merged_ranks"]))
    how = "recorded by each rank" if summary["layout_recorded"] else "derived from config.yaml policy.parallel"
    pol = summary["policy"]
    lines = [f"exported step {summary['step']} of {summary['checkpoint']}",
             f"  layout TP={lay['tp']} PP={lay['pp']} CP={lay['cp']} DP={lay['dp']} ({lay['world_size']} rank files, "
             f"{how}); merged ranks {merged}",
             f"  policy:  {pol['dir']}  ({', '.join(pol['architectures'] or [])}, {pol['parameters']:,} parameters, "
             f"{pol['dtype']}; base {summary['base_model']}; copied {', '.join(pol['copied']) or 'no tokenizer files'})"]
    d = summary["drafter"]
    lines.append(f"  drafter: {d['dir']}  ({d['kind']}, from {d['from']})" if d else
                 "  drafter: none (the checkpoint holds no co-trained drafter)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cotrain.export", description=__doc__.split("\n")[0])
    ap.add_argument("source", help="a run's output_dir, a checkpoint.dir or one step_* folder")
    ap.add_argument("out", help="output folder: <out>/policy (Hugging Face), <out>/drafter (vLLM drafter)")
    ap.add_argument("--step", type=int, default=None, help="the step to export (default: the latest complete one)")
    ap.add_argument("--model-path", default=None, help="the base model (default: policy.model_path of the "
                    "checkpoint's config.yaml): config and tokenizer files come from it")
    args = ap.parse_args(argv)
    try:
        summary = export_run(args.source, args.out, args.step, args.model_path)
    except (ExportError, CheckpointError) as e:
        ap.exit(2, f"cotrain.export: error: {e}\n")
    print(describe(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
