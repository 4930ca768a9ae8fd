"""Offline drafter distillation: ``python -m cotrain.draft.distill --config configs/distill_eagle3.yaml``.

Trains any registered drafter (``draft.kind``: eagle3, dflash, dspark) from a target checkpoint:

1. prompts (the built-in arithmetic task or a JSONL file) -> the target generates the responses
   (greedy or sampled, Hugging Face ``generate``), each followed by ``tail_tokens`` of the target's
   greedy continuation after end-of-sequence (vLLM counts drafts accepted past EOS, so the
   acceptance estimate needs them; they are supervised like the response);
2. the target's taps (the drafter's tap layers) and logits on those sequences
   (:mod:`cotrain.draft.taps`);
3. ``train.steps`` optimizer steps of the drafter loss (``draft.loss``, default per kind) against
   the detached target distributions, AdamW with ``draft.optimizer`` (warm-up, cosine, clipping);
4. every ``train.eval_every`` steps: the offline acceptance estimate (:mod:`cotrain.draft.acceptance`)
   on held-out prompts;
5. writes ``<output_dir>/drafter`` (vLLM-loadable, :mod:`cotrain.draft.export`),
   ``<output_dir>/metrics.json`` (curves and final numbers) and ``<output_dir>/curves.png``.

Overrides: ``key.path=value`` after the options (``train.steps=50``, ``draft.eagle3.ttt_steps=3``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from pydantic import ValidationError

from cotrain.config.distill import DistillConfig, DistillDataConfig, load_distill_config
from cotrain.draft.acceptance import estimate_acceptance
from cotrain.draft.common import DraftBatch, select_sequences
from cotrain.draft.losses import draft_loss, target_dist
from cotrain.draft.optim import clip_, lr_at, make_optimizer, set_lr
from cotrain.draft.registry import Drafter, build_drafter


# -------------------------------------------------------------------------------------------- data
@dataclass
class Record:
    prompt: list[int]
    response: list[int]  # up to and including EOS (or max_new_tokens long)
    tail: list[int]  # target greedy continuation after EOS


def load_prompts(cfg: DistillDataConfig, n: int, seed: int) -> list[str]:
    if cfg.task == "arithmetic":
        from cotrain.models.tiny import TINY_TASK
        from cotrain.tasks.data import arithmetic_dataset

        digits = cfg.max_digits or TINY_TASK["max_digits"]
        return [p.prompt for p in arithmetic_dataset(n, seed=seed, max_digits=digits, ops=tuple(cfg.ops or TINY_TASK["ops"]))]
    if cfg.task == "gcd":
        from cotrain.tasks.gcd import gcd_dataset

        return [p.prompt for p in gcd_dataset(n, seed=seed, **cfg.gcd.model_dump())]
    if cfg.task == "words":
        from cotrain.models.words import WORDS_TASK, words_dataset

        return [p.prompt for p in words_dataset(n, seed=seed, **WORDS_TASK)]
    if not cfg.jsonl_path:
        raise ValueError("data.jsonl_path is required for task jsonl")
    rows = [json.loads(line) for line in Path(cfg.jsonl_path).read_text().splitlines() if line.strip()]
    prompts = [str(r[cfg.prompt_key]) for r in rows]
    random.Random(seed).shuffle(prompts)
    if len(prompts) < n:
        raise ValueError(f"{cfg.jsonl_path}: {len(prompts)} prompts, {n} needed")
    return prompts[:n]


@torch.no_grad()
def generate_records(model, tokenizer, prompts: list[str], max_new_tokens: int, tail_tokens: int,
                     temperature: float = 0.0, seed: int = 0, batch_size: int = 256) -> list[Record]:
    """The target's responses to ``prompts`` plus ``tail_tokens`` of greedy continuation after EOS."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    tokenizer.padding_side = "left"
    gen = torch.Generator().manual_seed(seed)
    records = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        enc = tokenizer(chunk, return_tensors="pt", padding=True)
        width = enc["input_ids"].shape[1]
        if temperature == 0:
            out = model.generate(**enc, max_new_tokens=max_new_tokens + tail_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=pad)[:, width:]
            resp = [r.tolist() for r in out]
        else:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                                 top_k=0, top_p=1.0, eos_token_id=eos, pad_token_id=pad)[:, width:]
            resp = [r.tolist() for r in out]
        for j, prompt in enumerate(chunk):
            ids = resp[j]
            e = ids.index(eos) + 1 if eos in ids[:max_new_tokens] else max_new_tokens
            response = ids[:e]
            records.append(Record(tokenizer.encode(prompt), response, ids[e : e + tail_tokens]))
    if temperature > 0 and tail_tokens > 0:
        greedy_tails(model, records, tail_tokens, eos, pad, batch_size)
    return records


@torch.no_grad()
def greedy_tails(model, records: list[Record], tail_tokens: int, eos: int, pad: int, batch_size: int = 256) -> None:
    """Set each record's ``tail`` to ``tail_tokens`` of the target's greedy continuation after its
    response's EOS (none where the response has no EOS), batched and left-padded: the tokens a
    drafter's drafts past the EOS are compared with (sampled responses, or vLLM's)."""
    for r in records:
        r.tail = []
    ended = [r for r in records if r.response and r.response[-1] == eos]
    for i in range(0, len(ended), batch_size):
        chunk = ended[i : i + batch_size]
        seqs = [r.prompt + r.response for r in chunk]
        width = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.int64)
        mask = torch.zeros(len(seqs), width, dtype=torch.int64)
        for j, x in enumerate(seqs):
            ids[j, width - len(x):] = torch.tensor(x)
            mask[j, width - len(x):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tail_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=pad)
        for j, r in enumerate(chunk):
            r.tail = out[j, width:].tolist()


def records_to_batch(records: list[Record], model, tap_layers: list[int]) -> DraftBatch:
    """Packed sequences (prompt + response + tail) with taps and target logits."""
    from cotrain.draft.taps import compute_taps

    ids, lens, mask, starts = [], [], [], []
    for r in records:
        seq = r.prompt + r.response + r.tail
        ids += seq
        lens.append(len(seq))
        mask += [False] * len(r.prompt) + [True] * (len(r.response) + len(r.tail))
        starts.append(len(r.prompt))
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lens), 0)])
    ids_t = torch.tensor(ids, dtype=torch.int64)
    taps, logits = compute_taps(model, ids_t, cu, tap_layers)
    return DraftBatch(ids_t, cu, taps, torch.tensor(mask), logits, torch.tensor(starts))


# ------------------------------------------------------------------------------------------ train
def train_step(drafter: Drafter, batch: DraftBatch, loss_name: str, optimizer: torch.optim.Optimizer,
               clip: float, generator: torch.Generator, extra: Optional[dict] = None,
               branches: str = "teacher_forced", target_model=None, eos_token_id: Optional[int] = None) -> dict:
    """One optimizer step on ``batch``; returns metrics (loss, overlap, top1_match, grad_norm) as floats,
    read back once after the update (the distillation logs every step).
    ``branches="on_policy"``: SpecOPD (cotrain.draft.specopd) - branches the drafter samples at the
    seeded anchors, scored by ``target_model`` (the HF target) in one tree-masked forward."""
    if branches == "on_policy":
        from cotrain.draft.specopd import specopd_step

        loss, metrics, _ = specopd_step(drafter, target_model, batch, generator, loss=loss_name,
                                        eos_token_id=eos_token_id, extra=extra)
    else:
        layout = drafter.build_layout(batch, generator)
        out = drafter(batch, layout)
        p = target_dist(batch.target_logits, out)  # gathered chunk by chunk inside the loss
        labels = batch.input_ids[(out.target_rows + 1).clamp(min=0, max=batch.num_tokens - 1)]
        loss, metrics = draft_loss(loss_name, out, p, labels=labels, vocab=getattr(drafter, "vocab", None),
                                   **(extra or {}))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [q for q in drafter.parameters() if q.grad is not None]
    gn = clip_(params, clip)
    optimizer.step()
    metrics["grad_norm"] = gn
    return {k: float(v) for k, v in metrics.items()}


def loss_extra(cfg: DistillConfig) -> dict:
    s = cfg.draft.settings
    out = {}
    for name in ("l1_weight", "confidence_weight"):
        if hasattr(s, name):
            out[name] = float(getattr(s, name))
    return out


def train_drafter(drafter: Drafter, train: DraftBatch, evals: DraftBatch, cfg: DistillConfig,
                  eos_token_id: Optional[int], target_model=None) -> dict:
    """The training loop; returns the history (train metrics per step, evaluations)."""
    from tqdm import tqdm

    opt_cfg = cfg.draft.optimizer
    loss_name = cfg.draft.loss or cfg.draft.settings.default_loss
    optimizer = make_optimizer(drafter, opt_cfg)
    gen = torch.Generator().manual_seed(cfg.train.seed)
    k = cfg.train.num_speculative_tokens or drafter.default_num_speculative_tokens()
    k = min(k, drafter.draft_width)
    history: dict[str, list] = {"step": [], "loss": [], "overlap": [], "top1_match": [], "lr": [], "step_s": [],
                                "eval_step": [], "eval_mean_len": [], "eval_walk_len": [], "eval_per_position": []}
    extra = loss_extra(cfg)

    def evaluate(step: int) -> None:
        rep = estimate_acceptance(drafter, evals, k=k, eos_token_id=eos_token_id)
        history["eval_step"].append(step)
        history["eval_mean_len"].append(rep.mean_len)
        history["eval_walk_len"].append(rep.walk_len)
        history["eval_per_position"].append(rep.per_position)

    bar = tqdm(range(cfg.train.steps), desc=f"distill {drafter.kind}", disable=not cfg.progress_bar,
               dynamic_ncols=True)
    evaluate(0)
    drafter.train()
    for step in bar:
        lr = lr_at(step, cfg.train.steps, opt_cfg)
        set_lr(optimizer, lr)
        seqs = torch.randint(0, train.num_seqs, (cfg.train.batch_size,), generator=gen)
        batch = select_sequences(train, seqs)
        t0 = time.perf_counter()
        m = train_step(drafter, batch, loss_name, optimizer, opt_cfg.clip_grad, gen, extra,
                       cfg.draft.branches, target_model, eos_token_id)
        history["step"].append(step + 1)
        history["step_s"].append(time.perf_counter() - t0)
        history["lr"].append(lr)
        for key in ("loss", "overlap", "top1_match"):
            history[key].append(m[key])
        if cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0 and step + 1 < cfg.train.steps:
            evaluate(step + 1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc_len=f"{history['eval_walk_len'][-1]:.2f}")
        else:
            bar.set_postfix(loss=f"{m['loss']:.3f}")
    evaluate(cfg.train.steps)
    history["k"] = k
    history["loss_name"] = loss_name
    return history


def build_draft_vocab(drafter: Drafter, train: DraftBatch, evals: Optional[DraftBatch] = None) -> Optional[dict]:
    """A drafter with a reduced draft vocabulary (EAGLE-3 ``draft_vocab_size``) gets the mapping of
    the most frequent supervised tokens of ``train`` (:mod:`cotrain.draft.vocab`), its LM head rows
    taken from the target's. Returns its size and coverage (share of the supervised tokens inside
    it) on ``train`` and ``evals``; None for a drafter without one."""
    from cotrain.draft.vocab import DraftVocab, token_counts

    vocab = getattr(drafter, "vocab", None)
    if vocab is None:
        return None
    counts = token_counts(train.input_ids, train.loss_mask, vocab.vocab_size)
    vocab = DraftVocab.from_counts(counts, vocab.size)
    drafter.set_vocab(vocab)
    info = {"size": vocab.size, "target_vocab_size": vocab.vocab_size, "coverage_train": vocab.coverage(counts),
            "distinct_train_tokens": int((counts > 0).sum())}
    if evals is not None:
        info["coverage_eval"] = vocab.coverage(token_counts(evals.input_ids, evals.loss_mask, vocab.vocab_size))
    return info


def plot_curves(history: dict, path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = history["step"]
    loss = history["loss"]
    win = max(1, len(loss) // 30)
    smooth = [sum(loss[max(0, i - win + 1): i + 1]) / len(loss[max(0, i - win + 1): i + 1]) for i in range(len(loss))]
    a1.plot(steps, loss, alpha=0.3, color="C0", label="train loss")
    a1.plot(steps, smooth, color="C0", label=f"moving mean ({win})")
    a1.set_xlabel("step")
    a1.set_ylabel(history.get("loss_name", "loss"))
    a1.legend()
    a1.set_title(title)
    a2.plot(history["eval_step"], history["eval_walk_len"], "o-", label="greedy acceptance length (serving walk)")
    a2.plot(history["eval_step"], history["eval_mean_len"], "s--", label="mean over all anchors")
    a2.set_xlabel("step")
    a2.set_ylabel(f"acceptance length (k={history.get('k')})")
    a2.legend()
    a2.set_title("held-out offline acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------------------- run
def prepare_data(cfg: DistillConfig, model, tokenizer, tap_layers: list[int]) -> tuple[DraftBatch, DraftBatch]:
    d = cfg.data
    prompts = load_prompts(d, d.num_prompts + d.eval_prompts, d.seed)
    records = generate_records(model, tokenizer, prompts, d.max_new_tokens, d.tail_tokens, d.temperature, d.seed)
    return (records_to_batch(records[: d.num_prompts], model, tap_layers),
            records_to_batch(records[d.num_prompts:], model, tap_layers))


def distill(cfg: DistillConfig) -> dict:
    """Run an offline distillation; returns the summary written to metrics.json."""
    old_threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _distill(cfg)
    finally:
        torch.set_num_threads(old_threads)


def _distill(cfg: DistillConfig) -> dict:
    from transformers import AutoTokenizer

    from cotrain.draft.export import export_drafter
    from cotrain.draft.taps import TargetSpec, load_hf_target
    from cotrain.models.build_tiny import resolve_model_path

    t_start = time.time()
    target_path = resolve_model_path(cfg.target)
    model = load_hf_target(target_path)
    tokenizer = AutoTokenizer.from_pretrained(str(target_path))
    target = TargetSpec.from_checkpoint(target_path)
    drafter = build_drafter(cfg.draft.kind, cfg.draft.settings, target, seed=cfg.train.seed)
    t0 = time.time()
    train, evals = prepare_data(cfg, model, tokenizer, drafter.tap_layers)
    t_data = time.time() - t0
    vocab_info = build_draft_vocab(drafter, train, evals)
    history = train_drafter(drafter, train, evals, cfg, target.eos_token_id, model)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "kind": cfg.draft.kind, "target": str(target_path), "loss": history["loss_name"], "k": history["k"],
        "steps": cfg.train.steps, "final_loss": sum(history["loss"][-10:]) / len(history["loss"][-10:]),
        "acceptance_walk_len": history["eval_walk_len"][-1], "acceptance_mean_len": history["eval_mean_len"][-1],
        "acceptance_per_position": history["eval_per_position"][-1],
        "train_step_s": sorted(history["step_s"])[len(history["step_s"]) // 2],
        "data_s": round(t_data, 2), "total_s": round(time.time() - t_start, 2),
        "train_sequences": train.num_seqs, "eval_sequences": evals.num_seqs,
        "trainable_params": sum(q.numel() for q in drafter.parameters() if q.requires_grad),
    }
    if vocab_info:
        summary["draft_vocab"] = vocab_info
    export_drafter(drafter, out / "drafter", metadata={"distill": summary, "config": cfg.model_dump(mode="json")})
    (out / "metrics.json").write_text(json.dumps({"summary": summary, "history": history}, indent=1))
    plot_curves(history, out / "curves.png", f"{cfg.draft.kind} distillation ({history['loss_name']})")
    summary["drafter_dir"] = str(out / "drafter")
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cotrain.draft.distill", description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="YAML file (defaults: allowed)")
    ap.add_argument("--validate-only", action="store_true", help="check the config and exit")
    ap.add_argument("overrides", nargs="*", help="key.path=value")
    args = ap.parse_args(argv)
    try:
        cfg = load_distill_config(args.config, args.overrides)
    except (ValidationError, ValueError) as e:
        print(f"invalid distillation config: {e}", file=sys.stderr)
        return 2
    if args.validate_only:
        print(cfg.model_dump_json(indent=1))
        return 0
    summary = distill(cfg)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
