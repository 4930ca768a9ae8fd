"""The demo's prompt curriculum (configs/data/*.jsonl, scripts/demo_prompts.py): the committed files
are what the script writes, every problem's answer is its arithmetic (recomputed here), steps 1-20
of configs/demo.yaml see only the distilled distribution (2-digit '+') and steps 21-60 '+' and '-',
the evaluation prompts are held out, and the run reads the file once, in order."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBLEM = re.compile(r"(\d+)([+-])(\d+)=")


def _read(name):
    return [json.loads(line) for line in (ROOT / "configs/data" / name).read_text().splitlines()]


def _parsed(rows):
    out = []
    for r in rows:
        a, op, b = PROBLEM.fullmatch(r["prompt"]).groups()
        assert r["answer"] == str(int(a) + int(b) if op == "+" else int(a) - int(b)), r
        out.append((int(a), op, int(b)))
    return out


def test_committed_files_are_what_the_script_writes():
    proc = subprocess.run([sys.executable, "scripts/demo_prompts.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_two_phases_and_held_out_evaluation():
    train, evals = _parsed(_read("demo_prompts.jsonl")), _parsed(_read("demo_eval.jsonl"))
    assert len(train) == 960 and len(evals) == 256
    first, second = train[:320], train[320:]
    assert {op for _, op, _ in first} == {"+"} and all(a < 100 and b < 100 for a, _, b in train + evals)
    minus = sum(op == "-" for _, op, _ in second) / len(second)
    assert 0.4 < minus < 0.6, minus
    assert 0.4 < sum(op == "-" for _, op, _ in evals) / len(evals) < 0.6
    prompts = {r["prompt"] for r in _read("demo_prompts.jsonl")}
    held = [r["prompt"] for r in _read("demo_eval.jsonl")]
    assert len(set(held)) == len(held) and not prompts & set(held)


def test_demo_reads_the_curriculum_once_in_order(tmp_path):
    from cotrain.config import load_config
    from cotrain.tasks.data import PromptStream, load_task

    cfg = load_config(ROOT / "configs/demo.yaml", [f"run.output_dir={tmp_path}"])  # (runs/demo may hold the user's)
    assert (cfg.data.task, cfg.data.shuffle, cfg.grpo.resample_rounds) == ("jsonl", False, 0)
    train, evals = load_task(cfg.data, min_train=cfg.grpo.prompts_per_step)
    assert [p.prompt for p in evals] == [r["prompt"] for r in _read("demo_eval.jsonl")]
    stream = PromptStream(train, seed=cfg.run.seed, shuffle=cfg.data.shuffle)  # as the driver builds it
    steps = [stream.take(cfg.grpo.prompts_per_step) for _ in range(cfg.grpo.num_steps)]
    assert [p.prompt for s in steps for p in s] == [r["prompt"] for r in _read("demo_prompts.jsonl")]  # once, in order
    assert all("-" not in p.prompt for s in steps[:20] for p in s)
    assert all(any("-" in p.prompt for p in s) for s in steps[20:])  # every later step has subtraction
