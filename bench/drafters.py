"""Benchmark: the three drafter families on the tiny built-in target (vLLM rollout throughput, acceptance, training).

Per family (EAGLE-3, DFlash, DSpark), distilled offline with configs/distill_<kind>.yaml (cached
under $COTRAIN_CACHE/drafters, the same drafters the tests use):

- acceptance length: the offline estimate (greedy serving walk on the held-out prompts) and what
  vLLM measures serving those prompts greedily (DSpark: vLLM serves it only on GPU; on CPU the
  number is the offline one);
- training-step time: median and range of the wall time of one optimizer step (forward, loss,
  backward, AdamW) on batches of the distillation data, one thread, the three families' steps
  interleaved (one step of each per round, order rotated);
- vLLM rollout throughput with speculative decoding vs the same engine settings without it.

Throughput method. Every engine (``none`` and one per served family) is built first and all stay
alive in this process; then ``--rounds`` timed rounds (after ``--warmup`` untimed ones). In each
round every workload runs once on every engine, back to back, the engine order rotated from round
to round, so that load from other processes hits every arm alike and no arm runs all its rounds
before the next. tokens/s = generated tokens / wall time of the workload's ``generate`` calls.
Reported per workload: each arm's median and [min, max] tokens/s over the rounds, and the
*per-round paired ratio* spec / none (same round, seconds apart), median and [min, max].

Workloads (prompts = the held-out prompts of the distillation recipe):
    task      all prompts x ``--samples`` samples, temperature 1, stop at EOS (max 16 tokens; the
              tiny task's answers are 1-4 tokens): the rollout batch.
    task_c8   the same sampling, one sample per prompt, 8 prompts per ``generate`` call
              (``--c8-requests`` prompts in all): concurrency 8.
    task_c1   the same, one prompt per call (``--c1-requests`` prompts): concurrency 1.
    long, long_c8, long_c1
              greedy, ``--long-tokens`` tokens ignoring EOS (the target's continuation after its
              answer: long outputs are where speculation can pay), at the batch / 8 / 1.

Outputs: the JSON (``--out``) and a PNG beside it; full CPU runs also redraw docs/img/drafters.png
(``--png``). ``--report JSON`` prints the markdown tables of docs/drafters.md from a JSON and
redraws its PNGs: the docs' numbers come from there.

    python bench/drafters.py            # CPU defaults: 10-15 minutes on 2 busy cores (drafters cached)
    python bench/drafters.py --quick    # smoke test: fewer prompts, rounds and requests
    python bench/drafters.py --gpu      # GPU sizes (all engines on one GPU; DSpark served too)
    python bench/drafters.py --report bench/results/drafters.json   # docs tables + PNG from the JSON

Training path before / after, no vLLM: ``--train-paths`` times the drafter training step
(forward, loss, backward, AdamW; one thread) of each family through the old path
(``reference.draft_path``: all-zero main queries and the dense oracle on buckets at CP = 1,
losses on full (N, W, V) fp32 tensors) and the current one (kernel tiles, branch queries only,
chunked on-device losses), on a random 2-layer target with a 32,768-token vocabulary; the two paths
alternate step by step (order swapped every round), each round also measures each path's peak step
memory (profiler allocation events above the level before the step). Reported: per-round paired
ratios after / before (median [min, max]) and the attention pairs the forward computes.

    python bench/drafters.py --train-paths                  # about 3 minutes on 2 busy cores
    python bench/drafters.py --train-paths --report bench/results/drafters_paths.json   # table + PNGs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.paths import recorded, recorded_args  # noqa: E402

import torch  # noqa: E402

PATHS_PNG = ROOT / "docs" / "img" / "drafters_paths.png"

FAMILIES = {"eagle3": 4, "dflash": 6, "dspark": 7}  # kind -> draft tokens per step served
WORKLOADS = ("task", "task_c8", "task_c1", "long", "long_c8", "long_c1")
PRESETS = {  # sizes; explicit flags override them
    "default": dict(prompts=0, samples=4, rounds=9, warmup=1, c1_requests=12, c8_requests=48, long_tokens=48,
                    train_steps=20),
    "quick": dict(prompts=32, samples=2, rounds=2, warmup=1, c1_requests=3, c8_requests=16, long_tokens=24,
                  train_steps=5),
    "gpu": dict(prompts=0, samples=8, rounds=7, warmup=1, c1_requests=32, c8_requests=128, long_tokens=48,
                train_steps=20),
}


# ----------------------------------------------------------------------------- measurements
def _spec_stats(outs) -> tuple[float, int, int]:
    """(acceptance length, accepted draft tokens, verify rounds) over every request's histogram."""
    acc = rounds = 0
    for o in outs:
        for c in o.outputs:
            m = getattr(c, "spec_decode_metrics", None)
            if m is None:
                continue
            h = (m.to_dict() if hasattr(m, "to_dict") else dict(m))["acceptance_histogram"]
            acc += sum(j * n for j, n in enumerate(h))
            rounds += sum(h)
    return (1.0 + acc / rounds if rounds else float("nan")), acc, rounds


def _chunks(prompts: list[str], size: int | None) -> list[list[str]]:
    if not size:
        return [prompts]
    return [prompts[i:i + size] for i in range(0, len(prompts), size)]


def make_workloads(prompts: list[str], a) -> dict[str, tuple[list[list[str]], object]]:
    """name -> (generate calls, one prompt list each; SamplingParams)."""
    from vllm import SamplingParams

    task = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=16, n=a.samples, seed=0)
    task1 = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=16, n=1, seed=0)
    long = SamplingParams(temperature=0.0, max_tokens=a.long_tokens, ignore_eos=True)
    c8, c1 = prompts[:a.c8_requests], prompts[:a.c1_requests]
    return {"task": (_chunks(prompts, None), task), "task_c8": (_chunks(c8, 8), task1),
            "task_c1": (_chunks(c1, 1), task1), "long": (_chunks(prompts, None), long),
            "long_c8": (_chunks(c8, 8), long), "long_c1": (_chunks(c1, 1), long)}


def run_workload(llm, calls, params) -> dict:
    outs, t0 = [], time.perf_counter()
    for chunk in calls:
        outs += llm.generate(chunk, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    acc_len, acc, rounds = _spec_stats(outs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "accepted": acc,
            "verify_rounds": rounds, "token_ids": [[list(c.token_ids) for c in o.outputs] for o in outs]}


def interleaved_rounds(engines: dict, workloads: dict, rounds: int, warmup: int,
                       progress: bool = True) -> tuple[dict, list[float]]:
    """Every workload on every engine once per round, engine order rotated each round.

    Returns ``{workload: {engine: [per-round result, ...]}}`` (timed rounds only) and the 1-minute
    load average after each timed round."""
    names = list(engines)
    out: dict = {w: {e: [] for e in names} for w in workloads}
    loads: list[float] = []
    for r in range(-warmup, rounds):
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        t0 = time.perf_counter()
        for w, (calls, params) in workloads.items():
            for e in order:
                res = run_workload(engines[e], calls, params)
                if r >= 0:
                    out[w][e].append(res)
        if r >= 0:
            loads.append(os.getloadavg()[0])
        if progress:
            label = f"round {r + 1}/{rounds}" if r >= 0 else f"warm-up {r + warmup + 1}/{warmup}"
            print(f"[vllm] {label} ({' '.join(order)}) {time.perf_counter() - t0:.1f} s", flush=True)
    return out, loads


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize_throughput(runs: dict) -> tuple[dict, dict, dict]:
    """(per-arm tokens/s, per-round paired ratios spec/none, greedy identity per family)."""
    arms, ratios, identical = {}, {}, {}
    for w, per_engine in runs.items():
        base = per_engine["none"]
        arms[w] = {}
        for e, res in per_engine.items():
            acc = sum(x["accepted"] for x in res)
            vr = sum(x["verify_rounds"] for x in res)
            arms[w][e] = {"tokens_per_s": spread([x["tokens_per_s"] for x in res]),
                          "per_round_tokens_per_s": [x["tokens_per_s"] for x in res],
                          "tokens": res[0]["tokens"], "acceptance_len": 1.0 + acc / vr if vr else None}
            if e == "none":
                continue
            per_round = [s["tokens_per_s"] / b["tokens_per_s"] for s, b in zip(res, base)]
            ratios.setdefault(w, {})[e] = {**spread(per_round), "per_round": per_round}
            if w.startswith("long"):  # greedy: speculation must not change a token
                same = all(s["token_ids"] == b["token_ids"] for s, b in zip(res, base))
                identical[e] = identical.get(e, True) and same
    return arms, ratios, identical


# ------------------------------------------------------------------------------ training
class TrainBench:
    """One family's drafter, optimizer and distillation data, for timing single training steps."""

    def __init__(self, kind: str, cfg) -> None:
        from transformers import AutoTokenizer

        from cotrain.draft.distill import generate_records, load_prompts, loss_extra, records_to_batch
        from cotrain.draft.registry import build_drafter
        from cotrain.draft.taps import TargetSpec, load_hf_target
        from cotrain.models.build_tiny import resolve_model_path

        path = resolve_model_path(cfg.target)
        model, tok = load_hf_target(path), AutoTokenizer.from_pretrained(str(path))
        target = TargetSpec.from_checkpoint(path)
        self.drafter = build_drafter(kind, cfg.draft.settings, target, seed=0)
        prompts = load_prompts(cfg.data, 256, cfg.data.seed + 99)
        recs = generate_records(model, tok, prompts, cfg.data.max_new_tokens, cfg.data.tail_tokens)
        self.data = records_to_batch(recs, model, self.drafter.tap_layers)
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(0)
        self.loss = cfg.draft.loss or cfg.draft.settings.default_loss
        self.extra = loss_extra(cfg)
        self.bs = cfg.train.batch_size
        self.times: list[float] = []

    def step(self, timed: bool) -> None:
        from cotrain.draft.common import select_sequences
        from cotrain.draft.distill import train_step

        b = select_sequences(self.data, torch.randint(0, self.data.num_seqs, (self.bs,), generator=self.gen))
        t0 = time.perf_counter()
        train_step(self.drafter, b, self.loss, self.opt, 1.0, self.gen, self.extra)
        if timed:
            self.times.append(time.perf_counter() - t0)

    def summary(self) -> dict:
        toks = self.data.num_tokens / self.data.num_seqs * self.bs
        med = statistics.median(self.times)
        return {"step_ms": 1000 * med, "step_ms_range": [1000 * min(self.times), 1000 * max(self.times)],
                "steps": len(self.times), "batch_sequences": self.bs, "tokens_per_step": round(toks),
                "trained_tokens_per_s": toks / med, "loss": self.loss}


def train_step_times(cfgs: dict, steps: int, warmup: int = 3) -> dict:
    """Median training-step time per family, the families interleaved step by step (order rotated)."""
    benches = {kind: TrainBench(kind, cfg) for kind, cfg in cfgs.items()}
    names = list(benches)
    for i in range(warmup + steps):
        shift = i % len(names)
        for kind in names[shift:] + names[:shift]:
            benches[kind].step(timed=i >= warmup)
    return {kind: b.summary() for kind, b in benches.items()}


# ----------------------------------------------------------------------------------- main
# ------------------------------------------------------------------ training path: before / after
# `--train-paths`: the drafter's training step through the old path (reference.draft_path: all-zero
# main queries and the dense oracle on buckets at CP = 1, losses in plain autograd on full (N, W, V)
# fp32 tensors with host reads in every call) and through the current one (kernel tiles, branch
# queries only, losses in chunks on the device), on a random target with a 32,768-token vocabulary.
PATHS = ("before", "after")
PATH_PRESETS = {"default": dict(rounds=5, seqs=8, seq_len=128, prompt=32),
                "quick": dict(rounds=2, seqs=2, seq_len=48, prompt=16)}
PATH_VOCAB, PATH_HIDDEN = 32_768, 256
PATH_SETTINGS = {"eagle3": {"tap_layers": [0, 1], "ttt_steps": 3},
                 "dflash": {"tap_layers": [0, 1], "block_size": 8, "anchors_per_seq": 8},
                 "dspark": {"tap_layers": [0, 1], "block_size": 8, "anchors_per_seq": 8}}


def path_workload(seqs: int, seq_len: int, prompt: int) -> dict:
    """A random 2-layer Qwen3 target (hidden 256, 4 heads of 64, 2 K/V heads, V = 32,768), its taps and
    logits on ``seqs`` random sequences of ``seq_len`` tokens, the first ``prompt`` of each a prompt."""
    import tempfile

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from cotrain.draft.common import DraftBatch
    from cotrain.draft.taps import TargetSpec, compute_taps

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=PATH_VOCAB, hidden_size=PATH_HIDDEN, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, pad_token_id=0, eos_token_id=1,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        target = TargetSpec.from_checkpoint(tmp, mask_token_id=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, PATH_VOCAB, (seqs * seq_len,), generator=g)
    cu = torch.arange(0, seqs * seq_len + 1, seq_len)
    taps, logits = compute_taps(model, ids, cu, [0, 1])
    mask = (torch.arange(seq_len) >= prompt).repeat(seqs)
    return {"target": target, "batch": DraftBatch(ids, cu, taps, mask, logits, torch.full((seqs,), prompt))}


def attention_pairs(drafter, batch, layout, old: bool) -> int:
    """Query-key pairs the forward's attention calls compute: the dense buckets' (tokens)^2 per call
    (old), or the kernel tiles' (ring plan + block-diagonal branches) with or without main queries."""
    from reference import draft_path
    from cotrain.draft.common import BranchAttention
    from cotrain.parallel import default_kernel, ring_plan

    total = []
    call = BranchAttention.__call__

    def count(self, q, *args, **kw):
        lay = self.layout
        if old:
            total.append(sum((m1 - m0 + b1 - b0) ** 2 for _, m0, m1, b0, b1 in draft_path._buckets(lay, 128)))
        else:
            plan = ring_plan(lay, 0, "cpu", tile_cost_pairs=default_kernel("cpu").tile_cost_pairs,
                             main_queries=q is not None)
            total.append(sum(m.pairs_computed() for m in plan.ring_masks)
                         + (plan.intra_blocks.pairs_computed() if plan.intra_blocks is not None else 0))
        return call(self, q, *args, **kw)

    BranchAttention.__call__ = count
    try:
        with torch.no_grad():
            drafter(batch, layout)
    finally:
        BranchAttention.__call__ = call
    return sum(total)


class PathArm:
    """One family's drafter and optimizer, stepped through the old or the current training path."""

    def __init__(self, kind: str, work: dict, path: str) -> None:
        from cotrain.draft.registry import build_drafter

        self.drafter = build_drafter(kind, PATH_SETTINGS[kind], work["target"], seed=0)
        self.loss = self.drafter.cfg.default_loss
        self.batch, self.old = work["batch"], path == "before"
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=1e-4)
        self.layout = self.drafter.build_layout(self.batch, torch.Generator().manual_seed(1))
        self.times, self.peaks, self.losses = [], [], []

    def step(self) -> float:
        import contextlib

        from reference import draft_path
        from cotrain.draft.losses import draft_loss, target_dist, target_probs

        b, d = self.batch, self.drafter
        extra = {"l1_weight": 1.0, "confidence_weight": 1.0} if self.loss == "dspark_l1" else {}
        t0 = time.perf_counter()
        with draft_path.dense_attention() if self.old else contextlib.nullcontext():
            out = d(b, self.layout)
        labels = b.input_ids[(out.target_rows + 1).clamp(min=0, max=b.num_tokens - 1)]
        if self.old:
            loss, m = draft_path.draft_loss(self.loss, out, target_probs(b.target_logits, out), labels, **extra)
        else:
            loss, m = draft_loss(self.loss, out, target_dist(b.target_logits, out), labels, **extra)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        dt = time.perf_counter() - t0
        self.losses.append(float(m["loss"]))
        return dt

    def peak_step_mib(self) -> float:
        """Peak tensor memory one step allocates above the level before it (bench.measure)."""
        from bench.measure import peak_allocated_mib

        return peak_allocated_mib(self.step)


def run_train_paths(a) -> dict:
    """Rounds: every family, both paths (order alternating), one timed step and one profiled step each."""
    p = PATH_PRESETS["quick" if a.quick else "default"]
    rounds = a.rounds_given if a.rounds_given is not None else p["rounds"]
    work = path_workload(p["seqs"], p["seq_len"], p["prompt"])
    loads = [os.getloadavg()[0]]
    out = {}
    for kind in a.families:
        arms = {path: PathArm(kind, work, path) for path in PATHS}
        for arm in arms.values():  # untimed: Adam's state exists, caches warm
            arm.step()
        for r in range(rounds):
            for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                arms[path].times.append(1000 * arms[path].step())
                arms[path].peaks.append(arms[path].peak_step_mib())
            loads.append(os.getloadavg()[0])
            print(f"[paths] {kind} round {r + 1}/{rounds}: " + ", ".join(
                f"{x} {arms[x].times[-1]:.0f} ms {arms[x].peaks[-1]:.0f} MiB" for x in PATHS), flush=True)
        bef, aft = arms["before"], arms["after"]
        chains = aft.drafter(work["batch"], aft.layout).valid.shape
        out[kind] = {
            "loss": aft.loss, "chains": list(chains),
            "step_ms": {x: spread(arms[x].times) for x in PATHS},
            "peak_step_mib": {x: spread(arms[x].peaks) for x in PATHS},
            "time_ratio": {**spread([n / o for n, o in zip(aft.times, bef.times)]),
                           "per_round": [n / o for n, o in zip(aft.times, bef.times)]},
            "peak_ratio": {**spread([n / o for n, o in zip(aft.peaks, bef.peaks)]),
                           "per_round": [n / o for n, o in zip(aft.peaks, bef.peaks)]},
            "attention_pairs_forward": {"before": attention_pairs(bef.drafter, work["batch"], bef.layout, True),
                                        "after": attention_pairs(aft.drafter, work["batch"], aft.layout, False)},
            "first_losses": {x: arms[x].losses[0] for x in PATHS},
        }
    flex = None if a.quick else flex_probe()
    return {"command": "python bench/drafters.py --train-paths" + (" --quick" if a.quick else ""), "flex": flex,
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "rounds": rounds, "vocab": PATH_VOCAB, "hidden": PATH_HIDDEN, "settings": PATH_SETTINGS,
            "tokens": work["batch"].num_tokens, "sequences": p["seqs"], "seq_len": p["seq_len"], "prompt": p["prompt"],
            "load_avg_1min": spread(loads), "families": out}


def flex_probe() -> dict:
    """torch's flex_attention as the CP = 1 training kernel, measured against the ring's tiles on the
    trunk of 8 sequences of 256 tokens (H = 4, Hk = 2, D = 64, fp32, one thread): the document-causal
    rule as a mask_mod; eager and compiled forward, whether a backward runs, the block mask's build."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from cotrain.parallel import cu_seqlens_from_lengths, eagle3_ttt_layout, local_branch_attention

    lens, H, Hk, D = [256] * 8, 4, 2, 64
    T = sum(lens)
    lay = eagle3_ttt_layout(cu_seqlens_from_lengths(lens), 3).subset([])
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, Hk, D, generator=g), torch.randn(T, Hk, D, generator=g)
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))

    def ms(f, n=5):
        f()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            f()
            ts.append(1000 * (time.perf_counter() - t0))
        return statistics.median(ts)

    def tiles(backward):
        x = [t.clone().requires_grad_(backward) for t in (q, k, v)]
        out, _, _, _ = local_branch_attention(*x, None, None, None, lay)
        if backward:
            out.sum().backward()

    t0 = time.perf_counter()
    bm = create_block_mask(lambda b, h, i, j: (seq[i] == seq[j]) & (j <= i), None, None, T, T, device="cpu")
    mask_s = time.perf_counter() - t0
    args = [t.transpose(0, 1)[None] for t in (q, k, v)]
    res = {"tokens": T, "tiles_forward_ms": ms(lambda: tiles(False)), "tiles_forward_backward_ms": ms(lambda: tiles(True)),
           "block_mask_s": mask_s}
    import warnings

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res["flex_eager_forward_ms"] = ms(lambda: flex_attention(*args, block_mask=bm, enable_gqa=True), 3)
    res["flex_eager_warning"] = next((str(x.message).split("\n")[0] for x in w if "materializes" in str(x.message)), "")
    try:
        x = [t.clone().requires_grad_() for t in args]
        flex_attention(*x, block_mask=bm, enable_gqa=True).sum().backward()
        res["flex_backward"] = "runs"
    except NotImplementedError as e:
        res["flex_backward"] = str(e).split(".")[0]
    compiled = torch.compile(flex_attention)
    t0 = time.perf_counter()
    compiled(*args, block_mask=bm, enable_gqa=True)
    res["flex_compile_first_call_s"] = time.perf_counter() - t0
    res["flex_compiled_forward_ms"] = ms(lambda: compiled(*args, block_mask=bm, enable_gqa=True), 3)
    return res


def paths_markdown(data: dict) -> str:
    lines = [f"Measured with `{data['command']}` ({data['date']}, torch {data['torch']}, {data['threads']} thread; "
             f"1-minute load average {data['load_avg_1min']['min']:.1f}-{data['load_avg_1min']['max']:.1f}): "
             f"{data['sequences']} sequences of {data['seq_len']} tokens (prompt {data['prompt']}), vocabulary "
             f"{data['vocab']:,}, hidden {data['hidden']}, {data['rounds']} interleaved rounds after 1 warm-up step.",
             "",
             "| family (loss, chains x drafts) | step ms, before | step ms, after | time after / before | "
             "peak step MiB, before | after | peak after / before | attention pairs (fwd), before | after |",
             "|---|---|---|---|---|---|---|---|---|"]
    for kind, f in data["families"].items():
        t, m, r, q = f["step_ms"], f["peak_step_mib"], f["time_ratio"], f["peak_ratio"]
        pr = f["attention_pairs_forward"]
        lines.append(
            f"| {NAMES[kind]} ({f['loss']}, {f['chains'][0]:,} x {f['chains'][1]}) | "
            f"{t['before']['median']:.0f} [{t['before']['min']:.0f}, {t['before']['max']:.0f}] | "
            f"{t['after']['median']:.0f} [{t['after']['min']:.0f}, {t['after']['max']:.0f}] | "
            f"{r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}] | {m['before']['median']:.0f} | "
            f"{m['after']['median']:.0f} | {q['median']:.2f} [{q['min']:.2f}, {q['max']:.2f}] | "
            f"{pr['before']:,} | {pr['after']:,} |")
    fx = data.get("flex")
    if fx:
        lines += ["", f"CP = 1 kernel candidates on {fx['tokens']:,} trunk tokens (8 sequences of 256, H = 4, Hk = 2, "
                  "D = 64, fp32, one thread; ms are medians):", "",
                  "| kernel | forward ms | forward + backward ms | one-time cost |", "|---|---|---|---|",
                  f"| ring tiles (`local_branch_attention`) | {fx['tiles_forward_ms']:.1f} | "
                  f"{fx['tiles_forward_backward_ms']:.1f} | none |",
                  f"| `flex_attention`, eager | {fx['flex_eager_forward_ms']:.1f} | {fx['flex_backward']} | "
                  f"block mask {fx['block_mask_s']:.2f} s per layout |",
                  f"| `flex_attention`, `torch.compile` | {fx['flex_compiled_forward_ms']:.1f} | {fx['flex_backward']} | "
                  f"compile + first call {fx['flex_compile_first_call_s']:.1f} s, block mask {fx['block_mask_s']:.2f} s "
                  "per layout |"]
    return "\n".join(lines)


def ratio_bars(ax, xs: list[float], ratios: list[dict], width: float, dot_size: float, **bar_kw) -> None:
    """Bars at the medians of ``ratios`` (each a :func:`spread` with its ``per_round`` values) with
    min-max error bars and every round's value as a dot."""
    ax.bar(xs, [v["median"] for v in ratios], width,
           yerr=[[v["median"] - v["min"] for v in ratios], [v["max"] - v["median"] for v in ratios]], **bar_kw)
    for xi, v in zip(xs, ratios):
        ax.plot([xi] * len(v["per_round"]), v["per_round"], ".", color="k", ms=dot_size)


def paths_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(data["families"])
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for j, (key, label) in enumerate((("time_ratio", "step time"), ("peak_ratio", "peak step memory"))):
        ratio_bars(ax, [i + (j - 0.5) * 0.38 for i in range(len(kinds))], [data["families"][k][key] for k in kinds],
                   0.36, dot_size=3, label=f"{label} (median, range)", alpha=0.8, capsize=3)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(kinds)), [NAMES[k] for k in kinds])
    ax.set_ylabel("after / before (per round)")
    ax.set_title(f"drafter training step, V={data['vocab']:,}, {data['tokens']:,} tokens (CPU, 1 thread)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train_paths_main(a) -> int:
    if a.report is not None:
        data = json.loads(a.report.read_text())
        print(paths_markdown(data))
        for p in [a.report.with_suffix(".png")] + ([] if data["command"].endswith("--quick") else [PATHS_PNG]):
            paths_plot(data, p)
            print(f"wrote {p}")
        return 0
    torch.set_num_threads(1)
    data = run_train_paths(a)
    out = a.out if a.out_given else ROOT / "bench" / "results" / f"drafters_paths{'-quick' if a.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    print(paths_markdown(data))
    for p in [out.with_suffix(".png")] + ([] if a.quick else [PATHS_PNG]):
        paths_plot(data, p)
    print(f"wrote {out}")
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="smoke-test sizes")
    g.add_argument("--gpu", action="store_true", help="GPU sizes (needs CUDA)")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts used (0 = all)")
    ap.add_argument("--samples", type=int, default=None, help="samples per prompt in the task workload")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (every workload on every engine)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds first")
    ap.add_argument("--c1-requests", type=int, default=None, help="requests of the concurrency-1 workloads")
    ap.add_argument("--c8-requests", type=int, default=None, help="requests of the concurrency-8 workloads")
    ap.add_argument("--long-tokens", type=int, default=None, help="tokens per request of the long workloads")
    ap.add_argument("--train-steps", type=int, default=None, help="timed drafter training steps per family")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--cuda-graphs", action="store_true", help="GPU: let vLLM capture CUDA graphs (slower start)")
    ap.add_argument("--kv-cache-gib", type=float, default=2.0, help="GPU: KV cache per engine")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON, a PNG is written beside it (default bench/results/drafters[-quick|-gpu].json)")
    ap.add_argument("--png", type=Path, default=None,
                    help="another copy of the figure (default docs/img/drafters.png for full CPU runs)")
    ap.add_argument("--report", type=Path, default=None,
                    help="print the docs' markdown tables from this JSON, redraw its PNG(s), exit")
    ap.add_argument("--train-paths", action="store_true",
                    help="only the training step through the old and the current path (no vLLM; JSON "
                         "bench/results/drafters_paths.json); with --report: that JSON's table")
    a = ap.parse_args(argv)
    a.out_given, a.rounds_given = a.out is not None, a.rounds
    a.preset = "quick" if a.quick else "gpu" if a.gpu else "default"
    for k, v in PRESETS[a.preset].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.out is None:
        a.out = ROOT / "bench" / "results" / f"drafters{'' if a.preset == 'default' else '-' + a.preset}.json"
    if a.png is None and a.preset == "default" and a.report is None and not a.train_paths:
        a.png = ROOT / "docs" / "img" / "drafters.png"
    return a


def build_engines(tiny: str, specs: dict, a) -> dict:
    from cotrain.rl.vllm.engine import make_cotrain_llm

    kw = {}
    if torch.cuda.is_available():
        # every engine lives on the one GPU at once: each asks for a small share, KV cache fixed
        kw = dict(gpu_memory_utilization=min(0.9, 0.9 / (len(specs) + 1)) if len(specs) else 0.5,
                  kv_cache_memory_bytes=int(a.kv_cache_gib * 2**30), enforce_eager=not a.cuda_graphs)
    engines = {}
    for name, spec in specs.items():
        t0 = time.perf_counter()
        engines[name] = make_cotrain_llm(tiny, seed=0, speculative_config=spec, **kw)
        print(f"[vllm] engine {name} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    return engines


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.train_paths:
        return train_paths_main(a)
    if a.report is not None:
        data = json.loads(a.report.read_text())
        print(markdown(data))
        for p in write_pngs(data, a.report, a.png):
            print(f"wrote {p}")
        return 0
    if a.gpu and not torch.cuda.is_available():
        print("--gpu needs CUDA", file=sys.stderr)
        return 2
    torch.set_num_threads(1)

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from cotrain.draft.acceptance import estimate_acceptance
    from cotrain.draft.cache import ensure_distilled
    from cotrain.draft.distill import generate_records, load_distill_config, load_prompts, records_to_batch
    from cotrain.draft.export import load_drafter
    from cotrain.draft.taps import TargetSpec, load_hf_target
    from cotrain.models.build_tiny import ensure_tiny_model

    t_start = time.time()
    load_start = os.getloadavg()
    tiny = str(ensure_tiny_model())
    target = TargetSpec.from_checkpoint(tiny)
    model, tok = load_hf_target(tiny), AutoTokenizer.from_pretrained(tiny)
    cuda = torch.cuda.is_available()
    families: dict = {}
    prompts = None
    specs: dict = {"none": None}
    cfgs: dict = {}
    for kind in a.families:
        k = FAMILIES[kind]
        cfg = load_distill_config(ROOT / f"configs/distill_{kind}.yaml")
        print(f"[{kind}] distilling (cached after the first run) ...", flush=True)
        run = ensure_distilled(cfg)
        drafter = load_drafter(run / "drafter", target).eval()
        d = cfg.data
        held = load_prompts(d, d.num_prompts + d.eval_prompts, d.seed)[d.num_prompts:]
        if a.prompts:
            held = held[:a.prompts]
        prompts = prompts or held
        recs = generate_records(model, tok, held, d.max_new_tokens, d.tail_tokens)
        batch = records_to_batch(recs, model, drafter.tap_layers)
        off = estimate_acceptance(drafter, batch, k=k, eos_token_id=target.eos_token_id)
        print(f"[{kind}] offline acceptance {off.walk_len:.3f} (k={k})", flush=True)
        cfgs[kind] = cfg
        served = kind != "dspark" or cuda
        families[kind] = {"k": k, "offline_acceptance_len": off.walk_len, "offline_per_position": off.per_position,
                          "vllm_serves": served, "drafter": recorded(run / "drafter"), "distill_steps": cfg.train.steps}
        if served:
            specs[kind] = drafter.speculative_config(str(run / "drafter"), k)
        del drafter, batch
        gc.collect()

    print(f"[train] timing {a.train_steps} training steps per family, interleaved ...", flush=True)
    for kind, train in train_step_times(cfgs, a.train_steps).items():
        families[kind]["train"] = train

    engines = build_engines(tiny, specs, a)
    workloads = make_workloads(prompts, a)
    runs, round_loadavg = interleaved_rounds(engines, workloads, a.rounds, a.warmup)
    arms, ratios, identical = summarize_throughput(runs)

    # acceptance as vLLM serves the offline estimate's walk: greedy, stop at EOS
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    g = {name: llm.generate(prompts, greedy, use_tqdm=False) for name, llm in engines.items()}
    base_tokens = [list(o.outputs[0].token_ids) for o in g["none"]]
    for kind, fam in families.items():
        if kind not in engines:
            continue
        fam["vllm_acceptance_len"] = _spec_stats(g[kind])[0]
        fam["vllm_vs_offline"] = fam["vllm_acceptance_len"] / fam["offline_acceptance_len"]
        fam["greedy_output_identical"] = [list(o.outputs[0].token_ids) for o in g[kind]] == base_tokens
        fam["long_greedy_identical"] = identical.get(kind, True)
        for w in WORKLOADS:  # the headline numbers again, per family
            fam[w] = {"speedup_vs_none": ratios[w][kind]["median"], "ratio_range": [ratios[w][kind]["min"],
                      ratios[w][kind]["max"]], "tokens_per_s": arms[w][kind]["tokens_per_s"]["median"],
                      "acceptance_len": arms[w][kind]["acceptance_len"]}

    desc = {"task": f"{len(prompts)} prompts x {a.samples} samples in one batch, temperature 1, stop at EOS, max 16",
            "task_c8": f"{min(len(prompts), a.c8_requests)} prompts, 8 per call, 1 sample, temperature 1, max 16",
            "task_c1": f"{min(len(prompts), a.c1_requests)} prompts, 1 per call, 1 sample, temperature 1, max 16",
            "long": f"{len(prompts)} prompts in one batch, greedy, {a.long_tokens} tokens ignoring EOS",
            "long_c8": f"{min(len(prompts), a.c8_requests)} prompts, 8 per call, greedy, {a.long_tokens} tokens",
            "long_c1": f"{min(len(prompts), a.c1_requests)} prompts, 1 per call, greedy, {a.long_tokens} tokens"}
    import vllm

    config = recorded_args(a)
    config.update(command="python bench/drafters.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  device=torch.cuda.get_device_name(0) if cuda else "cpu", threads=1, torch=torch.__version__,
                  vllm=vllm.__version__, cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d"),
                  loadavg_start=load_start, loadavg_end=os.getloadavg(), loadavg_per_round=round_loadavg, target=recorded(tiny),
                  engines=list(engines), engine_order="rotated each round; all engines alive throughout")
    data = {"config": config, "workloads": desc, "families": families, "throughput": arms, "ratios": ratios,
            "seconds": round(time.time() - t_start, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(data, indent=1))
    pngs = write_pngs(data, a.out, a.png)
    print(markdown(data))
    print(f"wrote {a.out}, " + ", ".join(map(str, pngs)) + f" in {data['seconds']} s")
    for llm in engines.values():
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
    return 0


# ------------------------------------------------------------------------- report, figure
NAMES = {"eagle3": "EAGLE-3", "dflash": "DFlash", "dspark": "DSpark"}


def _r(x: dict, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(x['median'])} [{fmt.format(x['min'])}, {fmt.format(x['max'])}]"


def markdown(data: dict) -> str:
    c, fams = data["config"], data["families"]
    kinds = list(fams)
    served = [k for k in kinds if fams[k].get("vllm_serves") and "vllm_acceptance_len" in fams[k]]
    loads = c.get("loadavg_per_round") or [c["loadavg_end"][0]]
    lines = [f"Measured with `{c['command'].strip()}` on {c['device']} ({c['date']}, torch {c['torch']}, vLLM "
             f"{c['vllm']}, {c['cpu_count']} CPUs shared with other jobs: 1-minute load average "
             f"{c['loadavg_start'][0]:.1f} at the start, {min(loads):.1f}-{max(loads):.1f} during the rounds); "
             f"{c['rounds']} interleaved rounds after {c['warmup']} warm-up.", ""]
    lines += ["| | " + " | ".join(NAMES[k] for k in kinds) + " |", "|---|" + "---|" * len(kinds)]

    def row(label, f):
        lines.append(f"| {label} | " + " | ".join(f(fams[k]) for k in kinds) + " |")

    row("distillation steps (batch 32)", lambda f: str(f["distill_steps"]))
    row("draft tokens k", lambda f: str(f["k"]))
    row("acceptance length, offline estimate", lambda f: f"{f['offline_acceptance_len']:.2f}")
    dev = "GPU" if c["device"] != "cpu" else "CPU"
    row(f"acceptance length, vLLM ({dev}, greedy)",
        lambda f: f"{f['vllm_acceptance_len']:.2f}" if "vllm_acceptance_len" in f else "GPU only")
    row("greedy output identical to the target's",
        lambda f: ("yes" if f["greedy_output_identical"] and f["long_greedy_identical"] else "**no**")
        if "greedy_output_identical" in f else "-")
    row("training step, ms (1 thread, median [min, max])",
        lambda f: f"{f['train']['step_ms']:.0f} [{f['train']['step_ms_range'][0]:.0f}, "
                  f"{f['train']['step_ms_range'][1]:.0f}]" if "step_ms_range" in f["train"]
        else f"{f['train']['step_ms']:.0f}")
    lines += ["", "Rollout throughput: tokens/s of the plain engine, and per drafter the per-round paired ratio "
              "spec / none (median [min, max] over rounds) with the acceptance length in that workload.", ""]
    lines += ["| workload | none, tokens/s | " + " | ".join(f"{NAMES[k]} spec/none" for k in served) + " |",
              "|---|---|" + "---|" * len(served)]
    for w in data["throughput"]:
        arms = data["throughput"][w]
        cells = [_r(arms["none"]["tokens_per_s"], "{:.0f}")]
        for k in served:
            acc = arms[k]["acceptance_len"]
            cells.append(f"{_r(data['ratios'][w][k])}x (acc. {acc:.2f})" if acc else f"{_r(data['ratios'][w][k])}x")
        lines.append(f"| `{w}` | " + " | ".join(cells) + " |")
    lines += ["", "Workloads: " + "; ".join(f"`{w}` = {d}" for w, d in data["workloads"].items()) + "."]
    return "\n".join(lines)


def write_pngs(data: dict, json_path: Path, extra: Path | None) -> list[Path]:
    paths = [Path(json_path).with_suffix(".png")]
    if extra is not None and Path(extra) != paths[0]:
        paths.append(Path(extra))
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        plot(data, p)
    return paths


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = data["families"]
    kinds = list(fams)
    dev = data["config"]["device"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [1, 0.8, 2]})
    a = axes[0]
    x = range(len(kinds))
    a.bar([i - 0.2 for i in x], [fams[f]["offline_acceptance_len"] for f in kinds], 0.4, label="offline estimate")
    a.bar([i + 0.2 for i in x], [fams[f].get("vllm_acceptance_len", float("nan")) for f in kinds], 0.4,
          label=f"vLLM ({'cpu' if dev == 'cpu' else 'gpu'})")
    for i, f in enumerate(kinds):
        if "vllm_acceptance_len" not in fams[f]:
            a.text(i + 0.2, 0.1, "GPU only", rotation=90, ha="center", va="bottom", fontsize=8)
    a.set_xticks(list(x), [f"{NAMES[f]}\nk={fams[f]['k']}" for f in kinds])
    a.set_ylabel("greedy acceptance length")
    a.set_title("acceptance (held-out prompts)")
    a.legend(fontsize=8)
    a = axes[1]
    med = [fams[f]["train"]["step_ms"] for f in kinds]
    rng = [fams[f]["train"].get("step_ms_range", [m, m]) for f, m in zip(kinds, med)]
    a.bar(list(x), med, color="C2", yerr=[[m - r[0] for m, r in zip(med, rng)], [r[1] - m for m, r in zip(med, rng)]],
          capsize=3)
    a.set_xticks(list(x), [NAMES[f] for f in kinds])
    a.set_ylabel("ms / step")
    a.set_title(f"training step (batch {fams[kinds[0]]['train']['batch_sequences']}, 1 thread)")
    a = axes[2]
    served = [k for k in kinds if k in next(iter(data["ratios"].values()), {})]
    ws = list(data["ratios"])
    width = 0.8 / max(1, len(served))
    for j, k in enumerate(served):
        ratio_bars(a, [i - 0.4 + width * (j + 0.5) for i in range(len(ws))], [data["ratios"][w][k] for w in ws],
                   width, dot_size=2.5, color=f"C{j}", alpha=0.75, label=f"{NAMES[k]} (median, range)", capsize=2)
    a.axhline(1.0, color="k", lw=0.8)
    a.set_xticks(range(len(ws)), ws)
    a.set_ylabel("tokens/s with spec / without (per round)")
    a.set_title(f"vLLM rollout throughput ratio, {data['config']['rounds']} interleaved rounds ({dev})")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
