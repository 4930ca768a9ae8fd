"""``python -m cotrain.export``: real trainer checkpoints (builtin:tiny, one GRPO step each) exported
as a Hugging Face policy and a vLLM drafter, checked against the trainer itself.

Three trainers: PP=1 with a co-trained DFlash drafter (from builtin:tiny); PP=2 with a co-trained
EAGLE-3 drafter over a reduced draft vocabulary, and TP=2 without a drafter, both started from the
PP=1 run's export. Checked:

- transformers' log-probs from each exported policy equal the trainer's own (Megatron's forward
  after the step) to 1e-5, and the exported tensors equal the trainer's gathered weights
  (``full_policy_state``, assembled over the process groups) bit for bit;
- the PP=2 and TP=2 trainers' checkpoints written before their step (the same weights as the PP=1
  export they loaded) export to the PP=1 export bit for bit;
- the drafter export loads (``load_drafter``) with the trained drafter's tensors bit for bit, d2t
  and the built vocabulary included;
- checkpoints without recorded layouts (older ones) merge the same from config.yaml;
- damaged or missing files and missing checkpoints are named; nothing half-written is left.

Loading the export in vLLM is not tested here: an engine takes ~40 s to start on 2 cores
(tests/rl/test_vllm_parity.py checks vLLM against transformers on the same format).
"""

import json
import shutil
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from _trainer_utils import fake_rollout_batch, perturbed_old_logprobs

from cotrain.config import load_config
from cotrain.export import ExportError, export_checkpoint, export_run, find_step_dir, legacy_layout, main
from cotrain.checkpoint import CheckpointError, CheckpointManager, atomic_torch_save, load_plain, write_manifest

BASE = ["policy.micro_batch_size=4", "grpo.prompts_per_step=4", "policy.reference_model=false",
        "rollout.speculative.method=null", "policy.optimizer.lr=1e-3"]
RUNS = {  # name -> (overrides, starts from the PP=1 export, co-trained drafter)
    "pp1": (["draft.kind=dflash", "draft.dflash.block_size=4", "draft.dflash.anchors_per_seq=2", "draft.cotrain=true"],
            False),
    "pp2": (["policy.parallel.pipeline=2", "draft.kind=eagle3", "draft.eagle3.draft_vocab_size=16",
             "draft.cotrain=true"], True),
    "tp2": (["policy.parallel.tensor=2"], True),
}


def _save(group, cfg, ckpt_dir: Path, step: int) -> Path:
    """What the driver does: begin, every rank writes its file, commit (driver state, config.yaml)."""
    mgr = CheckpointManager(ckpt_dir)
    d = mgr.begin(step)
    group.save_checkpoint(str(d))
    return mgr.commit(step, {"step": step, "data": {"epoch": 0, "pos": 0}}, config_yaml=cfg.to_yaml())


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory):
    from cotrain.rl.workers import TrainerGroup

    root = tmp_path_factory.mktemp("export")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    out = {}
    try:
        for name, (overrides, from_pp1) in RUNS.items():
            model = out["pp1"]["export"] / "policy" if from_pp1 else Path(tiny_model_path)
            cfg = load_config("configs/grpo.yaml", BASE + overrides + [f"policy.model_path={model}"])
            group = TrainerGroup(cfg, str(model))
            ckpt = root / name / "checkpoints"
            try:
                before = _save(group, cfg, ckpt, 0)
                batch = fake_rollout_batch()
                drafting = cfg.draft.kind is not None and cfg.draft.cotrain
                res = group.logprobs(batch, draft_step=1 if drafting else None)
                batch.old_logprobs = perturbed_old_logprobs(res.logprobs, batch.mask)
                group.train_step(batch)
                after = _save(group, cfg, ckpt, 1)
                r = dict(cfg=cfg, ckpt=ckpt, before=before, after=after, batch=batch, model=model,
                         lp=group.logprobs(batch).logprobs, weights=group.named_weights("policy"),
                         draft=group.named_weights("draft") if drafting else None)
            finally:
                group.shutdown()
            r["summary"] = export_run(root / name, root / name / "export")  # the run folder: latest = step 1
            r["export"] = root / name / "export"
            if from_pp1:
                r["export_before"] = root / name / "export_step0"
                export_run(ckpt, r["export_before"], step=0)
            out[name] = r
    finally:
        ray.shutdown()
    return out


def _hf_logprobs(path: Path, batch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.inputs).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, batch.targets[..., None])[..., 0] * batch.mask


@pytest.mark.parametrize("name", list(RUNS))
def test_exported_policy_gives_the_trainers_logprobs_and_weights(runs, name):
    r = runs[name]
    torch.testing.assert_close(_hf_logprobs(r["export"] / "policy", r["batch"]), r["lp"], atol=1e-5, rtol=1e-5)
    exported = load_file(str(r["export"] / "policy" / "model.safetensors"))
    assert set(exported) == set(r["weights"])
    for k, v in r["weights"].items():
        assert torch.equal(exported[k], v), k


def test_the_step_moved_the_weights(runs, tiny_model_path):
    base = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    exported = load_file(str(runs["pp1"]["export"] / "policy" / "model.safetensors"))
    moved = [k for k in base if not torch.equal(base[k], exported[k])]
    assert len(moved) == len(base), sorted(set(base) - set(moved))


@pytest.mark.parametrize("name", ["pp2", "tp2"])
def test_another_layouts_checkpoint_of_the_same_weights_exports_identically(runs, name):
    ref = load_file(str(runs["pp1"]["export"] / "policy" / "model.safetensors"))
    got = load_file(str(runs[name]["export_before"] / "policy" / "model.safetensors"))
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_policy_folder_is_the_base_models_config_and_tokenizer(runs, tiny_model_path):
    from transformers import AutoTokenizer

    base, pol = Path(tiny_model_path), runs["pp1"]["export"] / "policy"
    want = json.loads((base / "config.json").read_text())
    want["dtype"] = "float32"
    assert json.loads((pol / "config.json").read_text()) == want
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (pol / f).read_bytes() == (base / f).read_bytes(), f
    assert not (pol / "cotrain_build.json").exists()
    assert AutoTokenizer.from_pretrained(str(pol)).encode("12+3=") == AutoTokenizer.from_pretrained(str(base)).encode("12+3=")
    s = json.loads((runs["pp2"]["export"] / "cotrain_export.json").read_text())
    assert (s["step"], s["layout"], s["merged_ranks"], s["layout_recorded"]) == \
        (1, {"tp": 1, "pp": 2, "cp": 1, "dp": 1, "world_size": 2}, [0, 1], True)
    assert s["drafter"]["from"] == "trainer_rank0001.pt"  # the last stage's file
    assert runs["tp2"]["summary"]["drafter"] is None and not (runs["tp2"]["export"] / "drafter").exists()


@pytest.mark.parametrize("name", ["pp1", "pp2"])
def test_drafter_export_loads_with_the_trained_drafters_tensors(runs, name):
    from cotrain.draft.export import load_drafter, speculative_config
    from cotrain.draft.taps import TargetSpec

    r = runs[name]
    target = TargetSpec.from_checkpoint(r["export"] / "policy")
    drafter = load_drafter(r["export"] / "drafter", target)
    sd = drafter.vllm_state_dict()
    assert set(r["draft"]) <= set(sd)
    for k, v in r["draft"].items():
        assert torch.equal(sd[k].to(v.dtype), v), k
    assert speculative_config(r["export"] / "drafter")["method"] == drafter.vllm_method
    if name == "pp2":  # the reduced vocabulary built from the step's tokens, not the placeholder
        vocab = load_plain(r["after"] / "trainer_rank0001.pt")["draft"]["vocab"]
        assert vocab["source"] == "counts" and "d2t" in r["draft"]
        assert torch.equal(drafter.vocab.target_ids, vocab["target_ids"])
        assert not torch.equal(vocab["target_ids"], torch.arange(16))
    # the drafter borrows the exported (trained) policy's head, as vLLM serves it
    lm = load_file(str(r["export"] / "policy" / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(drafter.target_lm_head, lm.float())


def _strip_layouts(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in dst.glob("trainer_rank*.pt"):
        state = load_plain(f)
        del state["layout"]
        atomic_torch_save(state, f)
    write_manifest(dst)
    return dst


@pytest.mark.parametrize("name", ["pp2", "tp2"])
def test_checkpoints_without_recorded_layouts_merge_from_the_config(runs, name, tmp_path):
    r = runs[name]
    for f in sorted(r["after"].glob("trainer_rank*.pt")):
        layout = load_plain(f)["layout"]
        derived = legacy_layout(layout["rank"], layout["world_size"], r["cfg"].policy.parallel)
        assert derived == {k: v for k, v in layout.items() if k != "layer_offset"}, f.name
    summary = export_checkpoint(_strip_layouts(r["after"], tmp_path / "step_000001"), tmp_path / "out")
    assert not summary["layout_recorded"]
    ref = load_file(str(r["export"] / "policy" / "model.safetensors"))
    got = load_file(str(tmp_path / "out" / "policy" / "model.safetensors"))
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_or_missing_shard_is_named_and_nothing_is_written(runs, tmp_path, damage):
    step = tmp_path / "ckpt" / "step_000001"
    shutil.copytree(runs["pp2"]["after"], step)
    f = step / "trainer_rank0001.pt"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    else:
        f.unlink()
    with pytest.raises(CheckpointError, match=r"trainer_rank0001\.pt: (\d+ bytes|missing)"):
        export_run(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_missing_checkpoints_and_steps_are_named(runs, tmp_path, capsys):
    with pytest.raises(ExportError, match=f"{tmp_path}: no checkpoint there"):
        find_step_dir(tmp_path)
    with pytest.raises(ExportError, match="no such directory"):
        find_step_dir(tmp_path / "nowhere")
    ckpt = runs["pp2"]["ckpt"]
    with pytest.raises(ExportError, match=r"--step 7: .*step_000007 is not a complete checkpoint; complete steps: "
                                          r"step_000000, step_000001"):
        find_step_dir(ckpt, step=7)
    assert find_step_dir(ckpt.parent) == runs["pp2"]["after"]  # the run folder: its latest step
    assert find_step_dir(ckpt, step=0) == runs["pp2"]["before"]
    unfinished = tmp_path / "ck" / "step_000003"
    shutil.copytree(runs["pp2"]["after"], unfinished)
    (unfinished / "COMPLETE").unlink()
    with pytest.raises(ExportError, match="no COMPLETE marker"):
        find_step_dir(unfinished)
    with pytest.raises(ExportError, match=r"no complete checkpoint; complete steps: none; unfinished .*step_000003"):
        find_step_dir(tmp_path / "ck")
    with pytest.raises(SystemExit) as e:  # the command line: exit status 2 and the message
        main([str(tmp_path / "ck"), str(tmp_path / "out")])
    assert e.value.code == 2 and "step_000003" in capsys.readouterr().err


def test_wrong_base_model_is_refused_and_nothing_is_written(runs, tiny_model_path, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_path, base)
    cfg = json.loads((base / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (base / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="stages hold 4 decoder layers, the base model has 2"):
        export_checkpoint(runs["pp2"]["after"], tmp_path / "out", model_path=str(base))
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_a_previous_export_is_replaced_any_other_folder_is_not(runs, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ExportError, match="is not a cotrain export"):
        export_run(runs["tp2"]["ckpt"], mine)
    assert (mine / "notes.txt").read_text() == "keep"
    out = tmp_path / "out"
    assert main([str(runs["tp2"]["ckpt"]), str(out), "--step", "0"]) == 0
    assert main([str(runs["tp2"]["ckpt"]), str(out)]) == 0  # over the step-0 export
    printed = capsys.readouterr().out
    assert "exported step 1 of" in printed and "layout TP=2 PP=1 CP=1 DP=1 (2 rank files" in printed
    assert "merged ranks 0, 1" in printed and "drafter: none" in printed
    assert json.loads((out / "cotrain_export.json").read_text())["step"] == 1 and _leftovers(tmp_path) == []


def test_the_drivers_final_export_takes_the_latest_step_and_never_fails_the_run(runs, tmp_path, capsys):
    from cotrain.export import export_final

    summary = export_final(runs["pp2"]["ckpt"], tmp_path / "run")
    assert summary["step"] == 1 and (tmp_path / "run" / "export" / "policy" / "model.safetensors").exists()
    assert (tmp_path / "run" / "export" / "drafter" / "model.safetensors").exists()
    assert export_final(tmp_path / "empty", tmp_path / "run2") is None  # no checkpoint: said, not raised
    printed = capsys.readouterr().out
    assert "exported step 1" in printed and "no export of the run" in printed and "retry: python -m cotrain.export" in printed
    assert not (tmp_path / "run2" / "export").exists()
