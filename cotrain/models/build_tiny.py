"""Build (once) the built-in policies: tokenizer, Qwen3 checkpoint, supervised warm start.

``python -m cotrain.models.build_tiny [--model tiny|small|words|calc]`` prints where the checkpoint is and its
accuracy on held-out problems. Nothing is downloaded: the tokenizer comes from
:mod:`cotrain.models.tokenizer`, the architecture and recipe from :mod:`cotrain.models.builtin`
(``tiny``: :mod:`cotrain.models.tiny`, ``small``: :mod:`cotrain.models.small`), the data from the
built-in tasks (:mod:`cotrain.tasks`).

The result is cached under ``$COTRAIN_CACHE`` (default ``~/.cache/cotrain``) in a directory named by
a hash of everything that determines it; a lock file makes concurrent callers (parallel tests,
several Ray actors) build it once, and the directory appears atomically when complete.

Determinism: a build runs on the model's fixed ``BUILD_THREADS`` torch threads (restored
afterwards), draws its data from its own seeded generators and initialises from its seed, so the
same build key gives bit-identical weights on any core count (tested with 1 and 2 threads and with
the process pinned to one core). With torch's default - one thread per core - the reduction order
of matrix products and sums followed the machine (the tiny model came out 72.7% or 78.1% greedy
with 1 or 2 threads under one key).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import torch

from cotrain.models.builtin import BuiltinModel, allowed, get_builtin, is_builtin, tokenizer_for
from cotrain.models.tiny import BUILTIN_MODEL_PATH, TINY_TASK  # noqa: F401  (BUILTIN_MODEL_PATH: re-exported)
from cotrain.models.tokenizer import build_vocab
from cotrain.tasks.data import Problem, arithmetic_dataset, arithmetic_problem

BUILD_VERSION = get_builtin("tiny").build_version  # the tiny model's (each built-in model has its own)


#: the build's report (accuracy, seconds, key), in the directory beside the weights; a build publishes the
#: directory whole (a rename), so the report's presence marks a finished build (:func:`is_built`)
BUILD_REPORT = "cotrain_build.json"


def cache_root() -> Path:
    return Path(os.environ.get("COTRAIN_CACHE", Path.home() / ".cache" / "cotrain"))


def _spec(model: str | BuiltinModel) -> BuiltinModel:
    return model if isinstance(model, BuiltinModel) else get_builtin(model)


def build_key(model: str | BuiltinModel = "tiny") -> str:
    """The cache key of a built-in model: a hash of its architecture, tokenizer, task, recipe,
    build threads and version."""
    m = _spec(model)
    parts = [m.build_version, m.name, m.hf_config, m.task, m.task_params, m.sft, m.vocab_size, m.threads,
             m.eval_max_new_tokens, sorted(build_vocab().items())]
    if m.tokenizer != "chars":  # (the character tokenizer's models keep the keys they always had)
        from cotrain.models.words import build_words_vocab

        parts[-1] = [m.tokenizer, sorted(build_words_vocab().items())]
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def builtin_cache_id(model_path: str) -> Optional[str]:
    """``builtin:<name>:<build key>`` for a built-in model path (what identifies its weights, e.g. in
    the drafter cache's key), None for any other path."""
    if not is_builtin(model_path):
        return None
    m = get_builtin(model_path)
    return f"{m.model_path}:{build_key(m)}"


def cache_dir(model: str | BuiltinModel = "tiny") -> Path:
    m = _spec(model)
    return cache_root() / f"{m.name}-qwen3-{build_key(m)}"


@contextmanager
def fixed_threads(n: int):
    """torch's intra-op threads set to ``n`` inside, restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def hf_config_dict(tokenizer, model: str | BuiltinModel = "tiny") -> dict:
    m = _spec(model)
    cfg = dict(m.hf_config)
    cfg.update(vocab_size=m.vocab_size, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=None)
    return cfg


def make_model(tokenizer, seed: int, model: str | BuiltinModel = "tiny"):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = {k: v for k, v in hf_config_dict(tokenizer, model).items()
           if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**cfg, architectures=["Qwen3ForCausalLM"]))


def encode_sft_batch(tokenizer, problems: list[Problem], targets: Optional[list[str]] = None) -> dict[str, torch.Tensor]:
    """prompt + target + <eos>, right-padded; the loss covers the target and <eos> only.
    ``targets``: the response texts (default: each problem's answer)."""
    rows, labels = [], []
    for i, p in enumerate(problems):
        prompt = tokenizer.encode(p.prompt)
        target = tokenizer.encode(p.answer if targets is None else targets[i]) + [tokenizer.eos_token_id]
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


def accuracy(model, tokenizer, problems: list[Problem], temperature: float = 0.0, max_new_tokens: int = 8,
             batch_size: int = 256) -> float:
    """Fraction of exactly right final answers (cotrain.tasks.rewards), greedy (temperature 0) or sampled."""
    from cotrain.tasks.rewards import exact_match_reward

    answers = complete(model, tokenizer, [p.prompt for p in problems], max_new_tokens=max_new_tokens,
                       temperature=temperature, batch_size=batch_size)
    return sum(exact_match_reward(a, p.answer) for a, p in zip(answers, problems)) / len(problems)


def task_problems(model: str | BuiltinModel, n: int, seed: int) -> list[Problem]:
    """``n`` problems of a built-in model's task, drawn with ``seed``."""
    m = _spec(model)
    if m.task == "gcd":
        from cotrain.tasks.gcd import gcd_dataset

        return gcd_dataset(n, seed=seed, **m.task_params)
    if m.task == "words":
        from cotrain.models.words import words_dataset

        return words_dataset(n, seed=seed, **m.task_params)
    return arithmetic_dataset(n, seed=seed, **m.task_params)  # (also the calculator task's problems)


def eval_problems(model: str | BuiltinModel = "tiny") -> list[Problem]:
    m = _spec(model)
    return task_problems(m, m.sft["eval_size"], seed=m.sft["seed"] + 1)


def noisy(problem: Problem, rng, label_noise: float) -> Problem:
    """The problem with each answer digit replaced by a random digit with probability ``label_noise``."""
    if not label_noise:
        return problem
    digits = [str(rng.randrange(10)) if c.isdigit() and rng.random() < label_noise else c for c in problem.answer]
    return Problem(problem.prompt, "".join(digits))


def sft_sampler(model: str | BuiltinModel) -> Callable[[random.Random], tuple[Problem, str]]:
    """(problem, target response) pairs of a built-in model's warm start: the tiny model's noisy
    answers, the small model's worked solutions with slips."""
    m = _spec(model)
    if m.task == "gcd":
        from cotrain.tasks.gcd import gcd_problem, solution_of

        slip, cap = m.sft.get("slip", 0.0), 2 * m.task_params["max_steps"]

        def draw(rng):
            p = gcd_problem(rng, **m.task_params)
            return p, solution_of(p, rng, slip, max_steps=cap)

        return draw
    if m.task == "words":
        from cotrain.models.words import words_problem

        def draw(rng):
            p = words_problem(rng, **m.task_params)
            return p, p.answer

        return draw
    if m.task == "calculator":  # the target is a conversation: (who, text) segments (cotrain.models.calc)
        from cotrain.models.calc import conversation

        def draw(rng):
            p = arithmetic_problem(rng, **m.task_params)
            return p, conversation(p, rng, m.sft)

        return draw
    noise = m.sft.get("label_noise", 0.0)

    def draw(rng):
        p = noisy(arithmetic_problem(rng, **m.task_params), rng, noise)
        return p, p.answer

    return draw


def train_sft(model, tokenizer, steps: int, batch_size: int, lr: float, warmup: int, weight_decay: float, seed: int,
              label_noise: float = 0.0, task: dict | None = None, progress: bool = True,
              sampler: Optional[Callable[[random.Random], tuple[Problem, str]]] = None, bucket: int = 1,
              desc: str = "warm-start SFT", encode: Callable = encode_sft_batch) -> list[float]:
    """AdamW with linear warm-up and cosine decay on fresh problems each step.

    ``sampler(rng)`` gives (problem, target response); default: the arithmetic task ``task``
    (default the tiny model's) with ``label_noise``. ``bucket > 1`` draws that many batches at
    once, sorts them by length and trains on them in a seeded order (less padding). ``encode``
    (tokenizer, problems, targets) -> the HF batch (default :func:`encode_sft_batch`)."""
    from tqdm import tqdm

    rng = random.Random(seed)
    if sampler is None:
        def sampler(r):
            p = noisy(arithmetic_problem(r, **(task or TINY_TASK)), r, label_noise)
            return p, p.answer

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    losses = []
    queue: list[list[tuple[Problem, str]]] = []
    bar = tqdm(range(steps), desc=desc, disable=not progress, leave=False)
    for _ in bar:
        if not queue:
            pool = [sampler(rng) for _ in range(batch_size * bucket)]
            if bucket > 1:
                pool.sort(key=lambda pt: len(pt[0].prompt) + len(pt[1]))
            queue = [pool[i * batch_size:(i + 1) * batch_size] for i in range(bucket)]
            rng.shuffle(queue)
        chunk = queue.pop()
        batch = encode(tokenizer, [p for p, _ in chunk], [t for _, t in chunk])
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


def _reduced(m: BuiltinModel, overrides: Optional[dict]) -> BuiltinModel:
    """``m`` with ``overrides = {"hf_config": {...}, "sft": {...}}`` applied (tests build at a reduced size)."""
    if not overrides:
        return m
    from dataclasses import replace

    return replace(m, hf_config=dict(m.hf_config, **overrides.get("hf_config", {})),
                   sft=dict(m.sft, **overrides.get("sft", {})))


def build(out_dir: Path, progress: bool = True, model: str | BuiltinModel = "tiny",
          _test_overrides: Optional[dict] = None) -> dict:
    """Build the checkpoint into ``out_dir`` (which must not exist) and return its build report.

    Runs on the model's fixed number of torch threads (restored afterwards). ``_test_overrides``
    (tests only; such a build is never cached): ``{"hf_config": {...}, "sft": {...}}`` replacing
    some of the model's numbers, to exercise the build at a reduced size."""
    m = _reduced(_spec(model), _test_overrides)
    with fixed_threads(m.threads):
        return _build(out_dir, m, progress)


def _build(out_dir: Path, m: BuiltinModel, progress: bool) -> dict:
    t0 = time.time()
    tokenizer = tokenizer_for(m.tokenizer)
    model = make_model(tokenizer, m.sft["seed"], m)
    sft = {k: m.sft[k] for k in ("steps", "batch_size", "lr", "warmup", "weight_decay", "seed")}
    extra = {}
    score = accuracy
    if m.task == "calculator":  # conversations with the tool (cotrain.models.calc)
        from cotrain.models.calc import calc_accuracy, encode_conversations

        extra, score = {"encode": encode_conversations}, calc_accuracy
    losses = train_sft(model, tokenizer, progress=progress, sampler=sft_sampler(m), bucket=m.sft.get("bucket", 1),
                       desc=f"builtin:{m.name} warm start", **sft, **extra)
    evals = eval_problems(m)
    n = m.eval_max_new_tokens
    sampled = score(model, tokenizer, evals, temperature=1.0, max_new_tokens=n)
    greedy = score(model, tokenizer, evals, max_new_tokens=n)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        report = {"model": m.model_path, "accuracy": sampled, "greedy_accuracy": greedy, "final_loss": losses[-1],
                  "build_seconds": round(time.time() - t0, 1), "threads": m.threads, "key": build_key(m),
                  "parameters": sum(p.numel() for p in model.parameters()), "task": m.task,
                  "task_params": m.task_params, "sft": m.sft}
        (tmp / BUILD_REPORT).write_text(json.dumps(report, indent=2))
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def ensure_builtin_model(model: str | BuiltinModel = "tiny", progress: bool = True, force: bool = False) -> Path:
    """Path of a built-in model's cached checkpoint, building it first if needed (safe to call concurrently)."""
    m = _spec(model)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    out = cache_dir(m)
    with open(root / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other builders wait here, then find the finished directory
        if force and out.exists():
            shutil.rmtree(out)
        if not is_built(out):
            build(out, progress=progress, model=m)
    return out


def is_built(path: Path) -> bool:
    """A finished build: its report (:data:`BUILD_REPORT`) is in the directory, which a build publishes whole."""
    return (Path(path) / BUILD_REPORT).exists()


def ensure_tiny_model(progress: bool = True, force: bool = False) -> Path:
    """Path of the cached tiny checkpoint, building it first if needed (safe to call concurrently)."""
    return ensure_builtin_model("tiny", progress=progress, force=force)


def ensure_small_model(progress: bool = True, force: bool = False) -> Path:
    """Path of the cached small checkpoint, building it first if needed (a few minutes the first time)."""
    return ensure_builtin_model("small", progress=progress, force=force)


def resolve_model_path(model_path: str, progress: bool = True) -> Path:
    """Map ``builtin:<name>`` to its cached checkpoint (building it if needed); other paths as given.
    An unknown ``builtin:`` name is a ValueError naming the built-in models."""
    if is_builtin(model_path):
        return ensure_builtin_model(get_builtin(model_path), progress=progress)
    return Path(model_path)


def build_report(path: Path) -> dict:
    return json.loads((Path(path) / BUILD_REPORT).read_text())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help=f"which built-in model ({allowed()}; default tiny)")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = ap.parse_args(argv)
    m = get_builtin(args.model)
    path = ensure_builtin_model(m, force=args.force)
    rep = build_report(path)
    print(f"{m.model_path} policy ({rep.get('parameters', 0) / 1e6:.1f} M parameters): {path}")
    print(f"held-out accuracy on {m.sft['eval_size']} {m.task} problems: {rep['accuracy']:.1%} sampled at temperature 1 "
          f"(the GRPO reward), {rep['greedy_accuracy']:.1%} greedy  (built in {rep['build_seconds']} s on "
          f"{rep.get('threads', '?')} thread(s))")


if __name__ == "__main__":
    main()
