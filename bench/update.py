"""The GRPO update, padded vs packed, measured on real rollouts (and where a training worker's memory goes).

The update is what the driver's ``time/update`` times (cotrain/rl/driver.py): the log-prob recomputation
(with the co-trained drafter's step riding on it, as in the driver) and the reference forward
(``TrainerGroup.logprobs``), the train-inference KL, and the GRPO step (forward, backward, clipping and
the optimizer: ``TrainerGroup.train_step``). Two arms, the same batch, the same seeds:

    padded   policy.packing=false: every sequence right-padded to the step's longest, micro_batch_size rows
    packed   policy.packing=true: sequences end to end (THD), micro batches by token budget

Workloads (``--workloads``): a real rollout of each config - the step-1 prompts of the config's prompt
stream, sampled by one vLLM engine through cotrain's own rollout machinery (``RolloutGroup.from_config``,
plain sampling: no speculation) with the driver's step-1 seed, scored and given group advantages as the
driver does - cached as JSON under runs/bench_update/ (``--rollout-cache`` reuses it), so every round and
every arm sees the identical batch:

    bench_small   configs/bench_small.yaml: builtin:small (10.4 M), gcd, 8 prompts x 8 samples
    demo          configs/demo.yaml: builtin:tiny (0.8 M), arithmetic, 16 prompts x 16 samples

Each arm is one TrainerGroup (one training worker) alive for the whole workload; after one untimed
warm-up update per arm, ``--rounds`` rounds each run one update per arm, the order rotated every round.
Per update:

- seconds: the update (and its two halves), timed in this process around the calls, as the driver does;
- tokens/s over the real tokens (prompt + response - 1 positions per sequence: padding does not count);
- peak memory: the training worker's RSS high-water mark over the update, exact - the kernel's VmHWM
  of the worker process, reset (``/proc/<pid>/clear_refs`` = 5) right before the update and read right
  after, both by calls into the worker itself (no sampling to miss a short peak, no fresh process whose
  start-up peak would count); also the RSS at the start, so the update's own growth is separable;
- achieved FLOP/s over the real tokens: 2 x P x tokens per forward (P = the policy's matmul parameters,
  LM head included, embedding lookup not) plus causal attention's 2 x layers x n^2 x (heads x head_dim)
  per sequence of n positions, times (1 policy forward + 1 reference forward + 3 per epoch for forward +
  backward); the drafter's own work is not counted (its seconds are reported);
- the physical limit beside it: fp32 ``torch.mm`` of the model's widest matmul ([4096, hidden] x
  [hidden, intermediate]) in the training worker itself, on its threads, after every update (the best of
  10 repeats each time); the limit is the median of all of them, one number per workload, and an arm's
  fraction is its FLOP/s over it.

Medians with [min, max] over the rounds; the ratios (padded / packed seconds, packed / padded peak
memory) are paired round by round, then their median and range. Goals reported against: update >= 3x
faster, peak memory <= 0.5x, >= 60% of the matmul rate. Numerics: both arms' loss and grad_norm in the
warm-up and every round, and the largest difference of their log-probs (packed must equal padded: 1e-4
relative, or 1e-7 absolute for a loss that is a zero-sum of advantages; log-probs within 1e-4).
``--packed-override`` changes the packed arm alone (e.g. its token budget).

Memory breakdown (``--memory``; on by default, for the first workload; off with --quick): fresh workers, one at a time - the import
baseline (a chain of imports in a subprocess, and a bare training actor), the worker without the
reference model and drafter, with the reference, with the drafter (the full config), then two updates
of the full worker phase by phase (peaks of the log-prob and train halves, the Adam state appearing at
the first step), the activations one padded micro batch saves for backward (counted by
``torch.autograd.graph.saved_tensors_hooks``), what ``malloc_trim`` hands back (the allocator's cache),
and the live tensors by owner. The timed run also records what each arm's first micro batch keeps for
backward, in its own layout.

    python bench/update.py                                   # both workloads, 5 rounds, memory breakdown
    python bench/update.py --rollout-cache                   # reuse runs/bench_update/*_rollout.json
    python bench/update.py --workloads bench_small --rounds 3
    python bench/update.py --workloads bench_small --memory off --rollout-cache \
        --packed-override policy.max_tokens_per_microbatch=2048  # the packed arm at a smaller token budget
    python bench/update.py --memory only --workloads bench_small # the memory breakdown alone
    python bench/update.py --report bench/results/update.json    # summaries again from the raw rounds
    python bench/update.py --quick                           # tiny model, 2 rounds, 8 synthetic sequences
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKLOADS = {"bench_small": "configs/bench_small.yaml", "demo": "configs/demo.yaml"}
ARMS = {"padded": ["policy.packing=false", "policy.max_tokens_per_microbatch=null"], "packed": ["policy.packing=true"]}
GOALS = {"speedup": 3.0, "memory_ratio": 0.5, "matmul_fraction": 0.6}
GIB = 2.0 ** 30
CACHE_DIR = ROOT / "runs" / "bench_update"
# (run.output_dir: the bench writes no run, and the workload's own runs/<name> may hold the user's)
COMMON = ["logging.progress_bar=false", "logging.tensorboard=false", "data.eval.every=0",
          "run.output_dir=runs/bench_update/run"]
# (the quick run keeps the arithmetic task's shuffled prompts, not the demo's curriculum file: its log-prob
# bound is checked on the arms' own weights after 2-3 updates, where float noise amplified by Adam depends
# on the rows; the curriculum's first prompts give 3.2e-4 where these give 3.3e-5)
QUICK_OVERRIDES = ["draft.init=null", "draft.compare_frozen=false", "grpo.prompts_per_step=2", "grpo.group_size=4",
                   "policy.micro_batch_size=4", "policy.max_seq_len=64", "data.task=arithmetic", "data.shuffle=true",
                   "data.eval.path=null"]


# ------------------------------------------------------------------------------------------- statistics
def spread(xs) -> dict:
    xs = [float(x) for x in xs]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {}


NUMERICS_REL, NUMERICS_ABS, LOGPROB_ABS = 1e-4, 1e-7, 1e-4  # packed == padded (see agree)


# ------------------------------------------------------------------------------------- inside the worker
# Called with ``actor.__ray_call__.remote(fn, ...)``: ``fn(actor, ...)`` runs in the training worker's
# process (``actor`` is the TrainingWorker, ``actor.worker`` its MegatronPolicyWorker).
STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def w_status(actor=None) -> dict:
    """This process's memory from /proc/self/status, in bytes (and its pid)."""
    out = {"pid": os.getpid()}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in STATUS_KEYS:
                out[key] = int(val.split()[0]) * 1024
    return out


def w_reset_peak(actor=None) -> dict:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS; returns the status after."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return w_status()


def w_malloc_trim(actor=None) -> dict:
    """glibc's malloc_trim(0): free heap pages go back to the kernel; the status before and after."""
    import ctypes
    import gc

    gc.collect()
    before = w_status()
    t = time.perf_counter()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return {"before": before, "after": w_status(), "seconds": time.perf_counter() - t}


def w_matmul(actor, m: int, k: int, n: int, repeats: int) -> dict:
    """fp32 ``torch.mm`` [m, k] x [k, n] on this worker's threads: seconds of each repeat (after a warm-up)."""
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    out = torch.empty(m, n)
    for _ in range(2):
        torch.mm(a, b, out=out)
    secs = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        secs.append(time.perf_counter() - t)
    return {"seconds": secs, "flops": 2.0 * m * k * n, "threads": torch.get_num_threads()}


def w_model_info(actor) -> dict:
    """The policy's shape as the worker built it: matmul parameters (2-D weights but the input embedding)."""
    import torch

    w = actor.worker
    arch = w.arch
    total = matmul = 0
    for name, p in w.model.module.named_parameters():
        total += p.numel()
        if p.dim() == 2 and "embedding" not in name:
            matmul += p.numel()
    if getattr(arch, "tie_word_embeddings", False):
        matmul += arch.vocab_size * arch.hidden_size  # the LM head is the embedding
    return {"params": total, "matmul_params": matmul, "layers": arch.num_layers, "hidden": arch.hidden_size,
            "heads": arch.num_heads, "head_dim": arch.head_dim, "ffn": arch.intermediate_size,
            "vocab": arch.vocab_size, "threads": torch.get_num_threads(),
            "reference_model": w.ref_model is not None, "drafter": w.draft is not None}


def _tensor_bytes(tensors, seen: set) -> int:
    n = 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        n += s.nbytes()
    return n


def _tensors_in(obj, depth: int = 2):
    """Tensors held by ``obj``'s attributes (lists, tuples and dicts followed ``depth`` levels)."""
    import torch

    out = []

    def walk(x, d):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif d > 0 and isinstance(x, (list, tuple)):
            for v in x:
                walk(v, d - 1)
        elif d > 0 and isinstance(x, dict):
            for v in x.values():
                walk(v, d - 1)
        elif d > 0 and hasattr(x, "__dict__") and not isinstance(x, type):
            for v in vars(x).values():
                walk(v, d - 1)

    walk(obj, depth)
    return out


def w_tensors(actor) -> dict:
    """Live tensor bytes by owner (each storage counted once, in this order), and all live tensors."""
    import gc

    import torch

    w = actor.worker
    seen: set = set()
    out = {}
    out["policy_params"] = _tensor_bytes(list(w.model.module.parameters()), seen)
    bufs = list(getattr(w.model, "buffers", []) or []) + list(getattr(w.model, "expert_parallel_buffers", []) or [])
    out["policy_grad_buffer"] = _tensor_bytes([getattr(b, "grad_data", None) for b in bufs]
                                              + [getattr(b, "param_data", None) for b in bufs], seen)
    out["policy_grads_other"] = _tensor_bytes([getattr(p, "main_grad", None) for p in w.model.module.parameters()]
                                              + [p.grad for p in w.model.module.parameters()], seen)
    opt_state = []
    for sub in getattr(w.optimizer, "chained_optimizers", [w.optimizer]):
        inner = getattr(sub, "optimizer", sub)
        for st in inner.state.values():
            opt_state += [v for v in st.values() if isinstance(v, torch.Tensor)]
        for group in inner.param_groups:
            opt_state += list(group["params"])  # fp32 main copies (bf16); the model's own are counted already
    out["policy_optimizer"] = _tensor_bytes(opt_state, seen)
    out["reference_model"] = _tensor_bytes(list(w.ref_model.parameters()) if w.ref_model is not None else [], seen)
    draft = getattr(w, "draft", None)
    trainer = getattr(draft, "trainer", None)
    if trainer is not None:
        d = trainer.drafter
        out["drafter_params"] = _tensor_bytes(list(d.parameters()) + list(d.buffers()), seen)
        out["drafter_grads"] = _tensor_bytes([p.grad for p in d.parameters()], seen)
        st = []
        for s in trainer.optimizer.state.values():
            st += [v for v in s.values() if isinstance(v, torch.Tensor)]
        out["drafter_optimizer"] = _tensor_bytes(st, seen)
        out["drafter_other"] = _tensor_bytes(_tensors_in(trainer, depth=3), seen)
    if draft is not None:
        ch = draft.channel
        out["tapchannel"] = _tensor_bytes([t for tr in ch.transports.values() for t in _tensors_in(tr, depth=3)]
                                          + _tensors_in(ch, depth=2), seen)
        out["tapchannel_routes"] = dict(ch.routes)
    gc.collect()
    every = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    rest = sorted(((t.untyped_storage().nbytes(), list(t.shape)) for t in every
                   if t.untyped_storage().data_ptr() not in seen and t.untyped_storage().nbytes() > 0), reverse=True)
    out["other_tensors"] = _tensor_bytes(every, seen)
    out["other_largest"] = [{"shape": shape, "bytes": n} for n, shape in rest[:6]]
    out["all_live_tensors"] = sum(v for v in out.values() if isinstance(v, int))
    return out


def w_activations(actor, batch) -> dict:
    """Bytes the policy forward of this worker's first micro batch (its own layout: padded rows or a packed
    row) saves for backward, parameters excluded, each storage once (``saved_tensors_hooks``); its shape."""
    import torch

    w = actor.worker
    if hasattr(w, "_micro_batches"):
        micro = w._micro_batches(batch)
    else:  # the trainer before the packed layout: padded rows only
        micro = w._micro(w._my_shard(batch))
    mb = micro[0]
    params = {p.untyped_storage().data_ptr() for p in w.model.module.parameters()}
    seen: dict = {}

    shapes: dict = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            if s.data_ptr() not in seen:
                key = f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"
                n, b = shapes.get(key, (0, 0))
                shapes[key] = (n + 1, b + s.nbytes())
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    w.model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = w._token_logprobs(w.model, mb)
    rows, positions = mb.inputs.shape
    del lp
    real = getattr(mb, "num_real", None)
    if real is None:
        real = int((mb.lengths - 1).clamp(min=0).sum())
    return {"saved_bytes": sum(seen.values()), "saved_tensors": len(seen), "rows": int(rows),
            "positions": int(positions), "real_positions": int(real),
            "micro_batches": len(micro), "layout": type(mb).__name__,
            "by_shape": [{"shape": k, "count": n, "bytes": b}
                         for k, (n, b) in sorted(shapes.items(), key=lambda kv: -kv[1][1])[:12]],
            "logits_fp32_bytes": int(rows) * int(positions) * w.arch.vocab_size * 4}


def w_import(actor=None) -> dict:
    """Import what a training worker's setup imports (Megatron, cotrain's trainer); the status after."""
    import cotrain.rl.draft_stage  # noqa: F401
    import cotrain.rl.trainer  # noqa: F401

    return w_status()


def call(actor, fn, *args):
    import ray

    return ray.get(actor.__ray_call__.remote(fn, *args))


# ------------------------------------------------------------------------------------------------ inputs
def workload_config(name: str, quick: bool, extra: list[str]):
    from cotrain.config import load_config

    path = WORKLOADS[name]
    ov = COMMON + (QUICK_OVERRIDES if quick else []) + list(extra)
    return path, ov, load_config(ROOT / path, ov)


def step1_problems(cfg, tokenizer):
    from cotrain.rl.driver import load_problems
    from cotrain.tasks.data import PromptStream

    train, _ = load_problems(cfg, tokenizer=tokenizer)
    return PromptStream(train, seed=cfg.run.seed, shuffle=cfg.data.shuffle).take(cfg.grpo.prompts_per_step)


def real_rollout(cfg, model_path: str) -> dict:
    """The driver's step 1 (prompts, seed, rewards, advantages) sampled by one vLLM engine, plain sampling."""
    from transformers import AutoTokenizer

    from cotrain.rl.driver import score
    from cotrain.rl.grpo import group_advantages
    from cotrain.rl.interfaces import SamplingSpec
    from cotrain.rl.rollout import RolloutGroup
    from cotrain.seeding import mix

    tok = AutoTokenizer.from_pretrained(model_path)
    problems = step1_problems(cfg, tok)
    plain = cfg.model_copy(deep=True)
    plain.rollout.speculative.method = None  # plain sampling: the batch, not the rollout's speed, is wanted
    engines = RolloutGroup.from_config(plain, model_path=model_path)
    try:
        s = cfg.rollout.sampling
        # the driver's step-1 sampling (GrpoRun.sampling): its per-step seed
        sampling = SamplingSpec(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                                seed=mix(cfg.run.seed, 1))
        gen = engines.generate([p.prompt for p in problems], sampling, n=cfg.grpo.group_size)
    finally:
        engines.shutdown()
    rewards = score(cfg, gen.samples, problems)
    adv = group_advantages(rewards, cfg.grpo.baseline, cfg.grpo.normalize_std)
    return {"source": "vllm", "pad_id": tok.pad_token_id, "rollout_s": gen.metrics["time_s"],
            "prompts": [p.prompt for p in problems], "answers": [p.answer for p in problems],
            "samples": [[{"prompt_token_ids": x.prompt_token_ids, "token_ids": x.token_ids, "logprobs": x.logprobs,
                          "text": x.text, "finish_reason": x.finish_reason} for x in row] for row in gen.samples],
            "rewards": rewards.tolist(), "advantages": adv.flatten().tolist()}


def synthetic_rollout(cfg, model_path: str, seed: int = 0) -> dict:
    """--quick: no engine (its start-up alone is longer than the test may take): the step-1 prompts with
    responses of varied length (1-20 tokens of the tokenizer's digits, then end of sequence), rewards at
    random, sampler log-probs -0.5 - numerics, not speed, are what the quick run checks."""
    import torch
    from transformers import AutoTokenizer

    from cotrain.rl.grpo import group_advantages

    tok = AutoTokenizer.from_pretrained(model_path)
    problems = step1_problems(cfg, tok)
    g = torch.Generator().manual_seed(seed)
    digits = [tok.convert_tokens_to_ids(c) for c in "0123456789"]
    samples, rewards = [], []
    for p in problems:
        row, r = [], []
        for _ in range(cfg.grpo.group_size):
            n = int(torch.randint(1, 21, (), generator=g))
            ids = [digits[int(i)] for i in torch.randint(0, 10, (n,), generator=g)] + [tok.eos_token_id]
            row.append({"prompt_token_ids": tok.encode(p.prompt), "token_ids": ids, "logprobs": [-0.5] * len(ids),
                        "text": tok.decode(ids[:-1]), "finish_reason": "stop"})
            r.append(float(torch.rand((), generator=g) < 0.5))
        samples.append(row)
        rewards.append(r)
    adv = group_advantages(torch.tensor(rewards), cfg.grpo.baseline, cfg.grpo.normalize_std)
    return {"source": "synthetic", "pad_id": tok.pad_token_id, "rollout_s": 0.0,
            "prompts": [p.prompt for p in problems], "answers": [p.answer for p in problems], "samples": samples,
            "rewards": rewards, "advantages": adv.flatten().tolist()}


def get_rollout(name: str, config: str, overrides: list[str], cfg, model_path: str, quick: bool,
                reuse: bool, cache_dir: Path) -> tuple[dict, Path]:
    path = cache_dir / f"{name}{'_quick' if quick else ''}_rollout.json"
    key = {"config": config, "overrides": overrides}
    if reuse and path.exists():
        data = json.loads(path.read_text())
        if data.get("key") != key:
            raise SystemExit(f"--rollout-cache: {path} was written for {data.get('key')}, not {key}: "
                             "run without --rollout-cache to sample afresh")
        return data, path
    data = synthetic_rollout(cfg, model_path) if quick else real_rollout(cfg, model_path)
    data["key"] = key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return data, path


def make_batch(cfg, rollout: dict):
    from cotrain.rl.batch import build_batch
    from cotrain.rl.interfaces import Sample

    flat = [Sample(prompt_index=i, prompt_token_ids=s["prompt_token_ids"], token_ids=s["token_ids"],
                   logprobs=s["logprobs"], text=s["text"], finish_reason=s["finish_reason"], weight_version=0)
            for i, row in enumerate(rollout["samples"]) for s in row]
    cp = cfg.policy.parallel.context  # as the driver: zigzag CP splits every sequence into 2*CP chunks
    return build_batch(flat, rollout["advantages"], rollout["pad_id"], multiple_of=2 * cp if cp > 1 else 1), flat


def rollout_stats(flat, batch) -> dict:
    n_pos = [len(s.prompt_token_ids) + len(s.token_ids) - 1 for s in flat]
    resp = [len(s.token_ids) for s in flat]
    return {"sequences": len(flat), "real_positions": sum(n_pos), "padded_positions": batch.inputs.numel(),
            "padded_seq_len": batch.seq_len, "padding_efficiency": sum(n_pos) / batch.inputs.numel(),
            "response_tokens": sum(resp), "response_len": {**spread(resp), "mean": sum(resp) / len(resp)},
            "sequence_positions": n_pos}


def update_flops(info: dict, positions: list[int], cfg) -> dict:
    """Useful FLOPs of one update over the real positions (see the module docstring)."""
    per_fwd = sum(2.0 * info["matmul_params"] * n + 2.0 * info["layers"] * n * n * info["heads"] * info["head_dim"]
                  for n in positions)
    attn = sum(2.0 * info["layers"] * n * n * info["heads"] * info["head_dim"] for n in positions)
    forwards = 1 + (1 if info["reference_model"] else 0) + 3 * cfg.grpo.epochs
    return {"per_forward": per_fwd, "attention_share": attn / per_fwd, "forward_equivalents": forwards,
            "per_update": per_fwd * forwards,
            "note": "policy forward + reference forward + 3 x epochs (forward + backward); drafter not counted"}


# ----------------------------------------------------------------------------------------------- the arms
def start_arm(config: str, overrides: list[str], arm: str, model_path: str, draft_init, arm_overrides=()):
    from cotrain.config import load_config
    from cotrain.rl.workers import TrainerGroup

    cfg = load_config(ROOT / config, overrides + ARMS[arm] + list(arm_overrides))
    return cfg, TrainerGroup(cfg, model_path, draft_init=draft_init)


def one_update(group, batch, step: int, cotrain: bool, matmul_shape) -> tuple[dict, object]:
    """One timed update as the driver runs it, the worker's peak RSS over it, then the matmul rate."""
    from cotrain.rl.driver import train_inference_kl

    actor = group.actors[0]
    b = replace(batch, old_logprobs=None, ref_logprobs=None)
    start = call(actor, w_reset_peak)
    t0 = time.perf_counter()
    lp = group.logprobs(b, draft_step=step if cotrain else None)
    t1 = time.perf_counter()
    b.old_logprobs, b.ref_logprobs = lp.logprobs, lp.ref_logprobs
    kl = train_inference_kl(b)
    t2 = time.perf_counter()
    tm = group.train_step(b)
    t3 = time.perf_counter()
    end = call(actor, w_status)
    mm = call(actor, w_matmul, *matmul_shape, 10)
    rec = {"step": step, "update_s": t3 - t0, "logprobs_s": t1 - t0, "train_s": t3 - t2,
           "draft_s": (lp.draft_metrics or {}).get("draft/time_s", 0.0),
           "rss_start": start["VmRSS"], "peak_rss": end["VmHWM"], "rss_end": end["VmRSS"],
           "rss_anon_end": end.get("RssAnon", 0), "rss_shmem_end": end.get("RssShmem", 0),
           "loss": tm["loss"], "grad_norm": tm["grad_norm"], "clip_frac": tm.get("clip_frac", float("nan")),
           "kl_train_infer": kl["kl/train_infer"],
           "matmul_flops_per_s": mm["flops"] / min(mm["seconds"]), "matmul_threads": mm["threads"]}
    return rec, lp


def lp_diff(a, b, mask) -> float:
    m = mask.bool()
    return float((a[m] - b[m]).abs().max()) if m.any() else 0.0


def run_workload(name: str, args, progress: bool) -> dict:
    from tqdm import tqdm

    from cotrain.config.derived import packing_budget
    from cotrain.models.build_tiny import resolve_model_path
    from cotrain.rl.driver import resolve_draft_init

    config, overrides, cfg = workload_config(name, args.quick, args.overrides)
    model_path = str(resolve_model_path(cfg.policy.model_path))
    rollout, cache = get_rollout(name, config, overrides, cfg, model_path, args.quick, args.rollout_cache,
                                 Path(args.cache_dir))
    batch, flat = make_batch(cfg, rollout)
    stats = rollout_stats(flat, batch)
    cotrain = cfg.draft.kind is not None and cfg.draft.cotrain
    draft_init = resolve_draft_init(cfg) if cotrain else None
    groups, cfgs = {}, {}
    raw = {a: [] for a in ARMS}
    warm, order, diffs = {}, [], []
    try:
        t0 = time.perf_counter()
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(ARMS)) as pool:  # both workers set up at once (imports, model build)
            started = {arm: pool.submit(start_arm, config, overrides, arm, model_path, draft_init,
                                        args.packed_override if arm == "packed" else ()) for arm in ARMS}
            errors = []
            for arm, fut in started.items():
                try:
                    cfgs[arm], groups[arm] = fut.result()
                except Exception as e:  # noqa: BLE001 - the other arm is shut down below, then this is raised
                    errors.append(e)
            if errors:
                raise errors[0]
        setup_s = time.perf_counter() - t0
        info = call(groups["padded"].actors[0], w_model_info)
        matmul_shape = (4096, info["hidden"], info["ffn"])
        flops = update_flops(info, stats["sequence_positions"], cfg)
        arms = list(ARMS)
        for arm in arms:  # one untimed update each: first-call costs (and Adam's state appears)
            warm[arm], _ = one_update(groups[arm], batch, 1, cotrain, matmul_shape)
        bar = tqdm(total=args.rounds * len(arms), desc=f"update {name}", disable=not progress, dynamic_ncols=True)
        for r in range(args.rounds):
            this = arms[r % len(arms):] + arms[: r % len(arms)]
            order.append(this)
            lps = {}
            for arm in this:
                rec, lp = one_update(groups[arm], batch, r + 2, cotrain, matmul_shape)
                rec["round"] = r
                rec["tokens_per_s"] = stats["real_positions"] / rec["update_s"]
                rec["flops_per_s"] = flops["per_update"] / rec["update_s"]
                raw[arm].append(rec)
                lps[arm] = lp
                bar.update(1)
                bar.set_postfix({a: f"{raw[a][-1]['update_s']:.1f}s" for a in arms if raw[a]})
            d = {"round": r, "logprobs_max_abs": lp_diff(lps["padded"].logprobs, lps["packed"].logprobs, batch.mask)}
            if lps["padded"].ref_logprobs is not None:
                d["ref_logprobs_max_abs"] = lp_diff(lps["padded"].ref_logprobs, lps["packed"].ref_logprobs, batch.mask)
            diffs.append(d)
        bar.close()
        acts = {}  # after the timed rounds: what one micro batch of each layout keeps for backward
        for arm in arms:
            b = replace(batch, old_logprobs=lps[arm].logprobs, ref_logprobs=lps[arm].ref_logprobs)
            try:
                acts[arm] = call(groups[arm].actors[0], w_activations, b)
            except Exception as e:  # noqa: BLE001 - the trainer's internals moved: say so, keep the run
                acts[arm] = {"error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        for g in groups.values():
            g.shutdown()
    res = {"config": config, "overrides": overrides, "model": cfg.policy.model_path, "model_info": info,
           "rollout": {"cache": os.path.relpath(cache, ROOT), "source": rollout["source"],
                       "rollout_s": rollout["rollout_s"], "reward_mean": statistics.mean(sum(rollout["rewards"], [])),
                       **{k: v for k, v in stats.items() if k != "sequence_positions"}},
           "micro_batch_size": cfg.policy.micro_batch_size, "max_seq_len": cfg.policy.max_seq_len,
           "packed_overrides": list(args.packed_override),
           "packed_token_budget": packing_budget(cfgs["packed"]),
           "cotrain_drafter": cfg.draft.kind if cotrain else None, "threads": info["threads"],
           "setup_s": setup_s, "flops": flops, "matmul_shape": list(matmul_shape), "order": order, "warmup": warm, "raw": raw,
           "logprob_diffs": diffs, "activations_first_micro_batch": acts}
    res.update(summarize(res))
    return res


def agree(a: float, b: float) -> bool:
    """Packed == padded for a scalar: within NUMERICS_REL relative, or NUMERICS_ABS absolute (a loss that is
    a zero-sum of advantages rounds to +-1e-9 either way: its relative difference means nothing)."""
    return abs(a - b) <= NUMERICS_REL * max(abs(a), abs(b)) + NUMERICS_ABS


def summarize(res: dict) -> dict:
    """Every summary value from the raw rounds (tests recompute them the same way). The matmul limit is one
    number per workload: the median of every torch.mm measurement of the run (each the best of its repeats,
    in both workers, after every timed update); an arm's fraction is its FLOP/s over that limit."""
    raw = res["raw"]
    keys = ("update_s", "logprobs_s", "train_s", "draft_s", "tokens_per_s", "flops_per_s", "peak_rss", "rss_start",
            "matmul_flops_per_s")
    limit = statistics.median(r["matmul_flops_per_s"] for recs in raw.values() for r in recs)
    summary = {}
    for arm, recs in raw.items():
        s = {k: spread([r[k] for r in recs]) for k in keys}
        s["peak_growth"] = spread([r["peak_rss"] - r["rss_start"] for r in recs])
        s["matmul_fraction"] = spread([r["flops_per_s"] / limit for r in recs])
        # the same FLOPs over the update's time without the drafter's own step (its work is not counted)
        s["flops_per_s_without_drafter"] = spread([res["flops"]["per_update"] / (r["update_s"] - r["draft_s"])
                                                   for r in recs])
        summary[arm] = s
    pad, pk = raw["padded"], raw["packed"]
    per_round = {
        "speedup": [a["update_s"] / b["update_s"] for a, b in zip(pad, pk)],
        "logprobs_speedup": [a["logprobs_s"] / b["logprobs_s"] for a, b in zip(pad, pk)],
        "train_speedup": [a["train_s"] / b["train_s"] for a, b in zip(pad, pk)],
        "memory_ratio": [b["peak_rss"] / a["peak_rss"] for a, b in zip(pad, pk)],
    }
    ratios = {k: {**spread(v), "per_round": v} for k, v in per_round.items()}
    pairs = [(res["warmup"]["padded"], res["warmup"]["packed"])] + list(zip(pad, pk))  # warm-up first
    numerics = {"loss": [[a["loss"], b["loss"]] for a, b in pairs],
                "grad_norm": [[a["grad_norm"], b["grad_norm"]] for a, b in pairs],
                "loss_abs_diff": [abs(a["loss"] - b["loss"]) for a, b in pairs],
                "grad_norm_rel_diff": [abs(a["grad_norm"] - b["grad_norm"]) / max(abs(a["grad_norm"]), 1e-30)
                                       for a, b in pairs],
                "logprobs_max_abs": [d["logprobs_max_abs"] for d in res["logprob_diffs"]]}
    numerics["max"] = {k: max(numerics[k]) for k in ("loss_abs_diff", "grad_norm_rel_diff", "logprobs_max_abs")}
    numerics["agree"] = (all(agree(a["loss"], b["loss"]) and agree(a["grad_norm"], b["grad_norm"]) for a, b in pairs)
                         and numerics["max"]["logprobs_max_abs"] <= LOGPROB_ABS)
    numerics["tolerance"] = {"rel": NUMERICS_REL, "abs": NUMERICS_ABS, "logprobs_abs": LOGPROB_ABS,
                             "note": "pairs: the warm-up update, then every round"}
    frac = summary["packed"]["matmul_fraction"]["median"]
    goals = {"speedup": {"value": ratios["speedup"]["median"], "goal": f">= {GOALS['speedup']}x",
                         "met": ratios["speedup"]["median"] >= GOALS["speedup"]},
             "memory_ratio": {"value": ratios["memory_ratio"]["median"], "goal": f"<= {GOALS['memory_ratio']}x",
                              "met": ratios["memory_ratio"]["median"] <= GOALS["memory_ratio"]},
             "matmul_fraction": {"value": frac, "goal": f">= {GOALS['matmul_fraction']:.0%} (packed arm)",
                                 "met": frac >= GOALS["matmul_fraction"]}}
    return {"summary": summary, "matmul_limit": {"median": limit, **{k: v for k, v in spread(
        [r["matmul_flops_per_s"] for recs in raw.values() for r in recs]).items() if k != "median"}},
            "ratios": ratios, "numerics": numerics, "goals": goals}


# ------------------------------------------------------------------------------------- memory breakdown
IMPORT_CHAIN = """
import json, os, sys
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024
out = [('python', rss())]
import torch; torch.set_num_threads(1); out.append(('+ torch', rss()))
import ray; out.append(('+ ray', rss()))
import megatron.core; out.append(('+ megatron-core', rss()))
import transformers; out.append(('+ transformers', rss()))
import cotrain.rl.trainer, cotrain.rl.draft_stage, cotrain.rl.workers; out.append(('+ cotrain trainer modules', rss()))
print(json.dumps(out))
"""


def import_chain() -> list:
    """RSS after each import of a training worker's stack, in a fresh interpreter."""
    p = subprocess.run([sys.executable, "-c", IMPORT_CHAIN], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if p.returncode:
        return [("failed", 0, p.stderr[-500:])]
    return json.loads(p.stdout.strip().splitlines()[-1])


def memory_breakdown(name: str, args, progress: bool) -> dict:
    """Fresh workers one at a time (see the module docstring); every number a measurement."""
    import ray
    from tqdm import tqdm

    from cotrain.models.build_tiny import resolve_model_path
    from cotrain.rl.driver import resolve_draft_init
    from cotrain.rl.workers import TrainerGroup, TrainingWorker

    config, overrides, cfg = workload_config(name, args.quick, args.overrides)
    model_path = str(resolve_model_path(cfg.policy.model_path))
    rollout, _ = get_rollout(name, config, overrides, cfg, model_path, args.quick, True, Path(args.cache_dir))
    batch, _ = make_batch(cfg, rollout)
    cotrain = cfg.draft.kind is not None and cfg.draft.cotrain
    draft_init = resolve_draft_init(cfg) if cotrain else None
    out = {"workload": name, "config": config, "padded_micro_batch": None}
    bar = tqdm(total=6, desc=f"memory {name}", disable=not progress, dynamic_ncols=True)
    out["import_chain"] = import_chain()
    bar.update(1)
    actor = TrainingWorker.options(num_cpus=1).remote(cfg.policy.cpus_per_worker)
    try:
        out["bare_actor"] = call(actor, w_status)
        out["actor_after_imports"] = call(actor, w_import)
    finally:
        ray.kill(actor)
    bar.update(1)
    from cotrain.config import load_config

    no_drafter = ["draft.kind=null", "rollout.speculative.method=null"]
    variants = {"policy_only": ["policy.reference_model=false", *no_drafter], "policy_and_reference": no_drafter,
                "full": []}
    out["variants"] = {}
    for vname, vo in variants.items():
        vcfg = load_config(ROOT / config, overrides + ARMS["padded"] + vo)
        g = TrainerGroup(vcfg, model_path, draft_init=draft_init if vname == "full" else None)
        try:
            a = g.actors[0]
            v = {"after_setup": call(a, w_status), "tensors_after_setup": call(a, w_tensors)}
            v["malloc_trim_after_setup"] = call(a, w_malloc_trim)  # what setup left in the allocator's cache
            if vname == "full":
                v["updates"] = []
                for step in (1, 2):
                    ph = {}
                    b = replace(batch, old_logprobs=None, ref_logprobs=None)
                    ph["start"] = call(a, w_reset_peak)
                    lp = g.logprobs(b, draft_step=step if cotrain else None)
                    ph["after_logprobs"] = call(a, w_status)
                    b.old_logprobs, b.ref_logprobs = lp.logprobs, lp.ref_logprobs
                    ph["train_start"] = call(a, w_reset_peak)
                    g.train_step(b)
                    ph["after_train"] = call(a, w_status)
                    ph["tensors_after"] = call(a, w_tensors)
                    ph["malloc_trim"] = call(a, w_malloc_trim)
                    v["updates"].append(ph)
                b = replace(batch, old_logprobs=lp.logprobs, ref_logprobs=lp.ref_logprobs)
                try:
                    out["padded_micro_batch"] = call(a, w_activations, b)
                except Exception as e:  # noqa: BLE001 - the trainer's internals moved: say so
                    out["padded_micro_batch"] = {"error": f"{type(e).__name__}: {e}"[:300]}
            out["variants"][vname] = v
        finally:
            g.shutdown()
        bar.update(1)
    bar.update(1)
    bar.close()
    out["table"] = breakdown_table(out)
    return out


def breakdown_table(m: dict) -> list[dict]:
    """The breakdown as rows (what; the RSS it takes, measured; the live tensors it holds, counted; how),
    in MiB, from the raw measurements. RSS differences between separate workers carry about +-15 MiB of
    process-to-process noise: there the tensor count is the sharper number."""
    mib = lambda b: None if b is None else b / 2 ** 20  # noqa: E731
    rows = []

    def row(what, rss=None, tensors=None, how=""):
        rows.append({"what": what, "rss_mib": mib(rss), "tensor_mib": mib(tensors), "how": how})

    chain = dict((c[0], c[1]) for c in m["import_chain"])
    steps = list(chain)
    parts = ", ".join(f"{b[2:] if b.startswith('+ ') else b} {mib(chain[b] - (chain[a] if a else 0)):.0f}"
                      for a, b in zip([None] + steps[:-1], steps))
    bare, imp = m["bare_actor"]["VmRSS"], m["actor_after_imports"]["VmRSS"]
    row("imports: Python, Ray's worker, torch (a bare training actor)", bare,
        how=f"RSS of the actor; in a fresh interpreter the chain is {parts} MiB")
    row("imports: + megatron-core, transformers, cotrain's trainer", imp - bare, how="RSS after importing them in the actor")
    V = m["variants"]
    trimmed = {k: v["malloc_trim_after_setup"]["after"]["VmRSS"] for k, v in V.items()}
    po, pr, full = V["policy_only"]["tensors_after_setup"], V["policy_and_reference"]["tensors_after_setup"], \
        V["full"]["tensors_after_setup"]
    row("policy weights + Megatron's fp32 gradient buffer", trimmed["policy_only"] - imp,
        po["policy_params"] + po["policy_grad_buffer"],
        how="worker without reference and drafter, after setup and malloc_trim, minus the imports")
    row("reference model", trimmed["policy_and_reference"] - trimmed["policy_only"], pr["reference_model"],
        how="RSS difference of two workers (after setup and malloc_trim)")
    row("co-trained drafter (DFlash) + TapChannel", trimmed["full"] - trimmed["policy_and_reference"],
        full.get("drafter_params", 0) + full.get("tapchannel", 0),
        how=f"RSS difference; TapChannel slots {mib(full.get('tapchannel', 0)):.1f} MiB: every tap's route is "
            f"{sorted(set(full.get('tapchannel_routes', {}).values()))} at PP = 1 (read in place, no slots)")
    row("setup's leftovers in the allocator's cache", V["full"]["malloc_trim_after_setup"]["before"]["VmRSS"] - trimmed["full"],
        how="what malloc_trim(0) hands back right after setup (the HF state dicts the models were loaded from, ...)")
    ups = V["full"]["updates"]
    after = ups[-1]["tensors_after"]
    row("Adam state: policy (fp32 exp_avg + exp_avg_sq) and drafter (AdamW)", None,
        after["policy_optimizer"] + after.get("drafter_optimizer", 0),
        how=f"policy {mib(after['policy_optimizer']):.0f} + drafter {mib(after.get('drafter_optimizer', 0)):.1f}; "
            "allocated at the first optimizer step")
    row("other live tensors between updates (the last batch's log-probs, Megatron's buffers, ...)", None,
        after["other_tensors"], how="largest: " + ", ".join(f"{o['shape']} {mib(o['bytes']):.1f}"
                                                            for o in after.get("other_largest", [])[:4]))
    act = m.get("padded_micro_batch") or {}
    if "saved_bytes" in act:
        top = ", ".join(f"{x['count']} x {x['shape']} {mib(x['bytes']):.0f}" for x in act["by_shape"][:5])
        row(f"activations one padded micro batch keeps for backward ({act['rows']} x {act['positions']} positions, "
            f"{act['real_positions']} real)", None, act["saved_bytes"],
            how=f"saved_tensors_hooks over its policy forward; largest: {top}")
    for i, u in enumerate(ups):
        tag = "first update" if i == 0 else "second update"
        lp_peak = u["after_logprobs"]["VmHWM"] - u["start"]["VmRSS"]
        tr_peak = u["after_train"]["VmHWM"] - u["train_start"]["VmRSS"]
        row(f"{tag}: log-prob half (policy + reference forwards, drafter step), peak over its start", lp_peak,
            how="VmHWM reset before it, read after")
        row(f"{tag}: train half (forward, backward, optimizer), peak over its start", tr_peak,
            how="VmHWM reset before it, read after" + (f"; beyond the saved activations: {mib(tr_peak - act['saved_bytes']):.0f} "
                                                      "(gradients of activations, temporaries)" if "saved_bytes" in act else ""))
        tr = u["malloc_trim"]
        row(f"{tag}: allocator cache after it (freed, kept by glibc)", tr["before"]["VmRSS"] - tr["after"]["VmRSS"],
            how=f"what malloc_trim(0) hands back (in {1e3 * tr.get('seconds', float('nan')):.0f} ms); RSS before "
                f"{mib(tr['before']['VmRSS']):.0f}, after {mib(tr['after']['VmRSS']):.0f}")
    last = ups[-1]
    row("worker peak over the second update (total)", max(last["after_logprobs"]["VmHWM"], last["after_train"]["VmHWM"]),
        how="max of its two halves' VmHWM")
    return rows


# ------------------------------------------------------------------------------------------------ output
def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.38
    colors = {"padded": "C0", "packed": "C1"}
    for j, arm in enumerate(ARMS):
        xs = [i + (j - 0.5) * width for i in range(len(names))]
        for a, key, scale in ((ax[0], "update_s", 1.0), (ax[1], "peak_rss", 1 / GIB), (ax[2], "flops_per_s", 1e-9)):
            s = [result["workloads"][n]["summary"][arm][key] for n in names]
            med = [x["median"] * scale for x in s]
            err = [[(x["median"] - x["min"]) * scale for x in s], [(x["max"] - x["median"]) * scale for x in s]]
            a.bar(xs, med, width, yerr=err, capsize=4, color=colors[arm], label=arm)
        start = [result["workloads"][n]["summary"][arm]["rss_start"]["median"] / GIB for n in names]
        ax[1].hlines(start, [x - width / 2 for x in xs], [x + width / 2 for x in xs], colors="k", linewidth=2,
                     label="RSS at the update's start" if j == 0 else None)
    mm = [result["workloads"][n]["matmul_limit"]["median"] * 1e-9 for n in names]
    for i, v in enumerate(mm):
        ax[2].hlines(v, i - width, i + width, colors="k", linestyles="--",
                     label="fp32 torch.mm in the worker" if i == 0 else None)
    for a, title in zip(ax, ("update seconds (median, [min, max])", "worker peak RSS, GiB",
                             "achieved GFLOP/s over real tokens")):
        a.set_xticks(range(len(names)))
        a.set_xticklabels(names)
        a.set_title(title)
        a.legend(fontsize=8)
    for i, n in enumerate(names):
        w = result["workloads"][n]
        r = w["ratios"]
        for a, key, text, scale in ((ax[0], "update_s", f"padded/packed {r['speedup']['median']:.2f}x", 1.0),
                                    (ax[1], "peak_rss", f"packed/padded {r['memory_ratio']['median']:.2f}x", 1 / GIB)):
            top = max(w["summary"][arm][key]["max"] for arm in ARMS) * scale
            a.annotate(text, (i, top), xytext=(0, 4), textcoords="offset points", ha="center", fontsize=8)
        for a in ax[:2]:
            a.margins(y=0.12)
    extra = sorted({o for n in names for o in result["workloads"][n].get("packed_overrides", [])})
    fig.suptitle(f"GRPO update, padded vs packed ({result['rounds']} rounds, interleaved; "
                 f"{'quick' if result['quick'] else 'full'}{'; packed arm: ' + ', '.join(extra) if extra else ''})")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _r(d: dict, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    return f"{fmt.format(d['median'] * scale)} [{fmt.format(d['min'] * scale)}, {fmt.format(d['max'] * scale)}]"


def report(result: dict) -> str:
    lines = []
    for name, w in result["workloads"].items():
        ro = w["rollout"]
        lines.append(f"{name} ({w['config']}, {ro['source']} rollout: {ro['sequences']} sequences, "
                     f"{ro['real_positions']} real positions, padded to {ro['sequences']} x {ro['padded_seq_len']} = "
                     f"{ro['padded_positions']}: {100 * ro['padding_efficiency']:.0f}% real; "
                     f"{w['threads']} worker thread(s); packed token budget {w.get('packed_token_budget')})")
        for arm, s in w["summary"].items():
            lines.append(f"  {arm:7s} update {_r(s['update_s'])} s (log-probs {_r(s['logprobs_s'])}, train "
                         f"{_r(s['train_s'])}, drafter {s['draft_s']['median']:.2f}), {_r(s['tokens_per_s'], '{:.0f}')} tok/s, "
                         f"peak RSS {_r(s['peak_rss'], '{:.2f}', 1 / GIB)} GiB (+{s['peak_growth']['median'] / GIB:.2f} over "
                         f"the start), {_r(s['flops_per_s'], '{:.1f}', 1e-9)} GFLOP/s = "
                         f"{100 * s['matmul_fraction']['median']:.0f}% of the matmul limit "
                         f"({s['flops_per_s_without_drafter']['median'] * 1e-9:.1f} without the drafter's seconds)")
        r, n = w["ratios"], w["numerics"]["max"]
        lim = w["matmul_limit"]
        lines.append(f"  matmul limit (fp32 torch.mm {w['matmul_shape']} in the workers) "
                     f"{_r(lim, '{:.1f}', 1e-9)} GFLOP/s")
        lines.append(f"  padded/packed seconds {_r(r['speedup'])} (log-probs {_r(r['logprobs_speedup'])}, train "
                     f"{_r(r['train_speedup'])}), packed/padded peak memory {_r(r['memory_ratio'])}; numerics "
                     f"{'agree' if w['numerics']['agree'] else 'DIFFER'}: loss abs {n['loss_abs_diff']:.1e}, grad_norm "
                     f"rel {n['grad_norm_rel_diff']:.1e}, log-probs max abs {n['logprobs_max_abs']:.1e}")
        lines.append("  goals: " + "; ".join(f"{k} {g['value']:.2f} ({g['goal']}: {'met' if g['met'] else 'not met'})"
                                            for k, g in w["goals"].items()))
    mem = result.get("memory_breakdown")
    if mem:
        lines.append(f"memory of a {mem['workload']} training worker:")
        lines.append(f"  {'RSS MiB':>8} {'tensors':>8}  what (how)")
        for row in mem["table"]:
            rss = "" if row["rss_mib"] is None else f"{row['rss_mib']:.0f}"
            ten = "" if row["tensor_mib"] is None else f"{row['tensor_mib']:.1f}"
            lines.append(f"  {rss:>8} {ten:>8}  {row['what']} ({row['how']})")
    return "\n".join(lines)


def machine_info() -> dict:
    import platform

    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    trainer = (ROOT / "cotrain" / "rl" / "trainer.py").read_text()
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__, "commit": commit,
            "trainer_reads_policy_packing": "policy.packing" in trainer or ".packing" in trainer,
            "load_avg_at_end": os.getloadavg()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="bench_small,demo", help=f"comma-separated: {', '.join(WORKLOADS)}")
    ap.add_argument("--rounds", type=int, default=None, help="default 5 (--quick: 2)")
    ap.add_argument("--rollout-cache", action="store_true", help="reuse the cached rollout of each workload "
                    "(runs/bench_update/<workload>_rollout.json) instead of sampling afresh")
    ap.add_argument("--cache-dir", default=str(CACHE_DIR))
    ap.add_argument("--memory", choices=("auto", "on", "off", "only"), default="auto",
                    help="the memory breakdown of the first workload's worker (auto: on unless --quick; only: "
                         "without the timed arms)")
    ap.add_argument("--quick", action="store_true", help="tiny model (configs/demo.yaml, drafter from scratch), "
                    "2 rounds, 8 synthetic sequences: structure and numerics, not speed")
    ap.add_argument("--out", default="bench/results/update.json")
    ap.add_argument("--png", default=None, help="default: beside --out")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--report", metavar="JSON", help="recompute an earlier run's summaries from its raw rounds "
                    "(written back), print its report and redraw its PNG")
    ap.add_argument("--packed-override", action="append", default=[], metavar="key.path=value",
                    help="applied to the packed arm only (e.g. policy.max_tokens_per_microbatch=2048); repeatable")
    ap.add_argument("overrides", nargs="*", metavar="key.path=value", help="applied to every workload and arm")
    args = ap.parse_args(argv)
    if args.report:
        result = json.loads(Path(args.report).read_text())
        for w in result["workloads"].values():  # the summaries again from the raw rounds (written back)
            w.update(summarize(w))
        if result.get("memory_breakdown"):
            result["memory_breakdown"]["table"] = breakdown_table(result["memory_breakdown"])
        Path(args.report).write_text(json.dumps(result, indent=1))
        if result["workloads"]:
            plot(result, Path(args.png or Path(args.report).with_suffix(".png")))
        print(report(result))
        return 0
    if args.quick:
        args.workloads = "demo"
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    names = [n for n in args.workloads.split(",") if n]
    bad = [n for n in names if n not in WORKLOADS]
    if bad or not names:
        raise SystemExit(f"--workloads: {(bad or [args.workloads])[0]!r} (allowed: {', '.join(WORKLOADS)})")
    if __name__ != "__main__":  # functions run inside the workers travel by value
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    from cotrain.rl.ray_workers import init_ray

    progress = not args.no_progress
    _, _, cfg0 = workload_config(names[0], args.quick, args.overrides)
    t_ray = time.perf_counter()
    init_ray(cfg0)
    t_ray = time.perf_counter() - t_ray
    import ray

    result = {"command": "python bench/update.py " + " ".join((argv if argv is not None else sys.argv[1:])),
              "quick": args.quick, "rounds": args.rounds, "arms": ARMS, "goals": GOALS, "workloads": {}}
    t0 = time.perf_counter()
    try:
        for n in names if args.memory != "only" else []:
            result["workloads"][n] = run_workload(n, args, progress)
        if args.memory in ("on", "only") or (args.memory == "auto" and not args.quick):
            result["memory_breakdown"] = memory_breakdown(names[0], args, progress)
    finally:
        ray.shutdown()
    result["wall_s"] = time.perf_counter() - t0
    result["ray_init_s"] = t_ray
    result["machine"] = machine_info()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    png = Path(args.png) if args.png else out.with_suffix(".png")
    if result["workloads"]:
        plot(result, png)
    print(report(result))
    print(f"wrote {out}" + (f" and {png}" if result["workloads"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
