"""Build (once) the tiny built-in policy: tokenizer, Qwen3 checkpoint, supervised warm start.

``python -m cotrain.models.build_tiny`` prints where the checkpoint is and its accuracy on held-out
problems. Nothing is downloaded: the tokenizer comes from :mod:`cotrain.models.tokenizer`, the
architecture from :mod:`cotrain.models.tiny`, the data from the built-in arithmetic task.

The result is cached under ``$COTRAIN_CACHE`` (default ``~/.cache/cotrain``) in a directory named by
a hash of everything that determines it; a lock file makes concurrent callers (parallel tests,
several Ray actors) build it once, and the directory appears atomically when complete.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from cotrain.models.tiny import BUILTIN_MODEL_PATH, TINY_QWEN3_CONFIG, TINY_SFT, TINY_TASK, VOCAB_SIZE
from cotrain.models.tokenizer import EOS, PAD, build_tokenizer, build_vocab
from cotrain.tasks.data import Problem, arithmetic_dataset

BUILD_VERSION = 1


def cache_root() -> Path:
    return Path(os.environ.get("COTRAIN_CACHE", Path.home() / ".cache" / "cotrain"))


def build_key() -> str:
    blob = json.dumps(
        [BUILD_VERSION, TINY_QWEN3_CONFIG, TINY_TASK, TINY_SFT, VOCAB_SIZE, sorted(build_vocab().items())],
        sort_keys=True, default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def hf_config_dict(tokenizer) -> dict:
    cfg = dict(TINY_QWEN3_CONFIG)
    cfg.update(vocab_size=VOCAB_SIZE, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=None)
    return cfg


def make_model(tokenizer, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = {k: v for k, v in hf_config_dict(tokenizer).items() if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**cfg, architectures=["Qwen3ForCausalLM"]))


def encode_sft_batch(tokenizer, problems: list[Problem]) -> dict[str, torch.Tensor]:
    """prompt + answer + <eos>, right-padded; the loss covers the answer and <eos> only."""
    rows, labels = [], []
    for p in problems:
        prompt = tokenizer.encode(p.prompt)
        target = tokenizer.encode(p.answer) + [tokenizer.eos_token_id]
        rows.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


@torch.no_grad()
def complete(model, tokenizer, prompts: list[str], max_new_tokens: int = 8, temperature: float = 0.0,
             seed: int = 0, batch_size: int = 256) -> list[str]:
    """Completions with Hugging Face ``generate`` (left padding), decoded up to <eos>.

    ``temperature`` 0 is greedy; otherwise plain sampling (no top-k/top-p) seeded by ``seed``.
    """
    tokenizer.padding_side = "left"
    sample = temperature > 0
    kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    gen_state = torch.random.fork_rng()
    out = []
    with gen_state:
        torch.manual_seed(seed)
        for i in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id, **kw)
            out += tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int = 8) -> list[str]:
    return complete(model, tokenizer, prompts, max_new_tokens)


def accuracy(model, tokenizer, problems: list[Problem], temperature: float = 0.0) -> float:
    """Fraction of exactly right answers, greedy (temperature 0) or sampled."""
    from cotrain.tasks.rewards import exact_match_reward

    answers = complete(model, tokenizer, [p.prompt for p in problems], temperature=temperature)
    return sum(exact_match_reward(a, p.answer) for a, p in zip(answers, problems)) / len(problems)


def eval_problems() -> list[Problem]:
    return arithmetic_dataset(TINY_SFT["eval_size"], seed=TINY_SFT["seed"] + 1, **TINY_TASK)


def noisy(problem: Problem, rng, label_noise: float) -> Problem:
    """The problem with each answer digit replaced by a random digit with probability ``label_noise``."""
    if not label_noise:
        return problem
    digits = [str(rng.randrange(10)) if c.isdigit() and rng.random() < label_noise else c for c in problem.answer]
    return Problem(problem.prompt, "".join(digits))


def train_sft(model, tokenizer, steps: int, batch_size: int, lr: float, warmup: int, weight_decay: float, seed: int,
              label_noise: float = 0.0, task: dict | None = None, progress: bool = True) -> list[float]:
    from tqdm import tqdm

    import random

    rng = random.Random(seed)
    from cotrain.tasks.data import arithmetic_problem

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    losses = []
    bar = tqdm(range(steps), desc="warm-start SFT", disable=not progress, leave=False)
    for _ in bar:
        problems = [noisy(arithmetic_problem(rng, **(task or TINY_TASK)), rng, label_noise) for _ in range(batch_size)]
        batch = encode_sft_batch(tokenizer, problems)
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


def build(out_dir: Path, progress: bool = True) -> dict:
    """Build the checkpoint into ``out_dir`` (which must not exist) and return its build report."""
    t0 = time.time()
    tokenizer = build_tokenizer()
    model = make_model(tokenizer, TINY_SFT["seed"])
    sft = {k: TINY_SFT[k] for k in ("steps", "batch_size", "lr", "warmup", "weight_decay", "seed", "label_noise")}
    losses = train_sft(model, tokenizer, progress=progress, **sft)
    sampled = accuracy(model, tokenizer, eval_problems(), temperature=1.0)
    greedy = accuracy(model, tokenizer, eval_problems())
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        report = {"accuracy": sampled, "greedy_accuracy": greedy, "final_loss": losses[-1], "build_seconds": round(time.time() - t0, 1),
                  "key": build_key(), "task": TINY_TASK, "sft": TINY_SFT}
        (tmp / "cotrain_build.json").write_text(json.dumps(report, indent=2))
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def ensure_tiny_model(progress: bool = True, force: bool = False) -> Path:
    """Path of the cached tiny checkpoint, building it first if needed (safe to call concurrently)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"tiny-qwen3-{build_key()}"
    with open(root / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other builders wait here, then find the finished directory
        if force and out.exists():
            shutil.rmtree(out)
        if not (out / "cotrain_build.json").exists():
            build(out, progress=progress)
    return out


def resolve_model_path(model_path: str) -> Path:
    """Map ``builtin:tiny`` to the cached checkpoint (building it if needed); other paths as given."""
    if model_path == BUILTIN_MODEL_PATH:
        return ensure_tiny_model()
    return Path(model_path)


def build_report(path: Path) -> dict:
    return json.loads((Path(path) / "cotrain_build.json").read_text())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    path = ensure_tiny_model(force=args.force)
    rep = build_report(path)
    print(f"tiny policy: {path}")
    print(f"held-out accuracy on {TINY_SFT['eval_size']} problems: {rep['accuracy']:.1%} sampled at temperature 1 "
          f"(the GRPO reward), {rep['greedy_accuracy']:.1%} greedy  (built in {rep['build_seconds']} s)")


if __name__ == "__main__":
    main()
