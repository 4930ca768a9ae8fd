"""``python -m cotrain.draft.distill``: shipped configs, a small end-to-end run, config errors."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from cotrain.draft.distill import load_distill_config, main
from cotrain.draft.optim import lr_at

REPO = Path(__file__).resolve().parents[2]
DISTILL_CONFIGS = sorted((REPO / "configs").glob("distill_*.yaml"))


def _random_target(tmp_path, name="small"):
    """A TargetSpec of a built-in model's architecture and tokenizer (random weights: building the
    real one takes minutes)."""
    from cotrain.draft.taps import TargetSpec
    from cotrain.models.build_tiny import make_model
    from cotrain.models.builtin import get_builtin
    from cotrain.models.builtin import tokenizer_for

    tok = tokenizer_for(get_builtin(name).tokenizer)
    make_model(tok, 0, name).save_pretrained(str(tmp_path / name))
    tok.save_pretrained(str(tmp_path / name))
    return TargetSpec.from_checkpoint(tmp_path / name)


def test_shipped_distill_configs(target, tmp_path):
    from cotrain.draft.registry import build_drafter

    assert {p.stem for p in DISTILL_CONFIGS} >= {"distill_eagle3", "distill_dflash", "distill_dspark",
                                                 "distill_small_dflash", "distill_small_eagle3",
                                                 "distill_words_eagle3"}
    others = {}  # builtin name -> a random-weight target of its architecture
    for path in DISTILL_CONFIGS:
        cfg = load_distill_config(path)
        name = cfg.target.removeprefix("builtin:")
        prefix = "distill_" if name == "tiny" else f"distill_{name}_"
        assert path.stem == f"{prefix}{cfg.draft.kind}"
        if name != "tiny" and name not in others:
            others[name] = _random_target(tmp_path, name)
        d = build_drafter(cfg.draft.kind, cfg.draft.settings, others.get(name, target))
        assert 3 <= (cfg.train.num_speculative_tokens or d.default_num_speculative_tokens()) <= 7
        assert cfg.data.tail_tokens >= d.draft_width  # the acceptance walk can see drafts past EOS


def test_config_errors(capsys):
    assert main(["--config", str(REPO / "configs/distill_eagle3.yaml"), "draft.loss=dspark_l1"]) == 2
    assert "not allowed for kind 'eagle3'" in capsys.readouterr().err
    assert main(["--config", str(REPO / "configs/distill_dflash.yaml"), "train.stepz=3"]) == 2
    assert "stepz" in capsys.readouterr().err
    assert main(["--config", str(REPO / "configs/distill_dflash.yaml"), "draft.dflash.block_size=1"]) == 2
    assert "block_size" in capsys.readouterr().err
    assert main(["--validate-only", "--config", str(REPO / "configs/distill_dspark.yaml"), "train.steps=7"]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["steps"] == 7


def test_lr_schedule():
    from cotrain.config.schema import OptimizerConfig

    opt = OptimizerConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr=0.1)
    assert [lr_at(s, 14, opt) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # cosine over the 10 steps after warm-up: step s runs at t = (s + 1 - 4) / 10, the last at min_lr
    assert lr_at(4, 14, opt) == pytest.approx(0.1 + 0.45 * (1 + math.cos(0.1 * math.pi)))
    assert lr_at(8, 14, opt) == pytest.approx(0.55) and lr_at(13, 14, opt) == pytest.approx(0.1)


@pytest.mark.slow
def test_small_distillation_end_to_end(tmp_path, tiny_model_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "cotrain.draft.distill", "--config", str(REPO / "configs/distill_dspark.yaml"),
           "train.steps=24", "train.eval_every=12", "train.batch_size=16", "data.num_prompts=64",
           "data.eval_prompts=16", f"output_dir={out}", "progress_bar=false"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["kind"] == "dspark" and summary["steps"] == 24 and summary["drafter_dir"] == str(out / "drafter")
    metrics = json.loads((out / "metrics.json").read_text())
    h = metrics["history"]
    assert h["step"] == list(range(1, 25)) and h["eval_step"] == [0, 12, 24]
    assert sum(h["loss"][-4:]) < sum(h["loss"][:4])  # it learns
    assert h["eval_walk_len"][-1] > h["eval_walk_len"][0]
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and (out / "drafter" / "model.safetensors").exists()
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
