"""Benchmark (GPU): the co-trained drafter's share of a GRPO update, Qwen3-0.6B shape (the paper's Table 2 quantity).

    python bench/gpu_cotrain_step.py --device cuda --out DIR        # Qwen3-0.6B shape, bf16, 16 x 1024 tokens (~2 min, H200)
    python bench/gpu_cotrain_step.py --device cpu --tiny --out DIR  # the CPU smoke test's shape (seconds)

One update of the policy is what the driver asks of the trainer every GRPO step: the log-prob
recomputation of the policy that generated the rollouts (``MegatronPolicyWorker.logprobs``) and the
GRPO step on them (``train_step``: forward, backward, clipping, Megatron's optimizer step). With
co-training the drafter rides on the recomputation (``logprobs(batch, draft_step=s)``: taps, its
forward, loss, backward and optimizer step). Both arms run through cotrain's real trainer, in this
process at world size 1, on one random-weight checkpoint and one random rollout batch of
``--seqs`` x ``--seq-len`` tokens (prompt ``--prompt-len``, the rest response), in the same worker:

    off  logprobs(batch)                 + train_step(batch)
    on   logprobs(batch, draft_step=s)   + train_step(batch)

alternating round by round (the order flips every round), after ``--warmup`` rounds of each. Reported
per drafter kind (``--drafters``; each in its own process: Megatron's parallel state is per process):
medians with ranges of every arm's seconds, and two overheads:

    paired    median(on) / median(off) - 1          (the whole update with vs without the drafter)
    drafter   median(draft/time_s) / (median(on) - median(draft/time_s))   (bench/cotrain_e2e.py's)

Every arm is timed between ``torch.cuda.synchronize`` calls, so ``paired`` is the GPU's time. The
drafter's own ``draft/time_s`` is host time inside the step (no synchronisation per microbatch:
kernels it launched may finish later, and its one read-back waits for the policy's queued work), so on
CUDA ``drafter`` is indicative only; ``paired`` is the number to quote.

The paper reports < 15% for block drafters (DFlash) and 34% for EAGLE-3 on GPUs. Output
``DIR/cotrain_step.json`` (each kind's rounds, medians, overheads, drafter metrics, the peak CUDA memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from gpu_verify_cost import QWEN3_0_6B, build_model, loaded_packages  # noqa: E402  (bench/ on sys.path)

#: the CPU smoke test's shape (4 layers: room for the drafters' default tap layers)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=True)
MASK_TOKEN = "<|mask|>"
PAPER = {"dflash": "< 15% (block drafters)", "eagle3": "34%"}


def write_checkpoint(shape: dict, path: Path, device: torch.device, dtype: torch.dtype) -> Path:
    """A random-weight Hugging Face Qwen3 checkpoint (config.json, model.safetensors) with the minimal
    tokenizer files a drafter reads: its mask token (the last id)."""
    model = build_model(shape, device, dtype)
    model.config.eos_token_id = 1
    model.config.pad_token_id = 0
    model.save_pretrained(path)  # safetensors (the default in transformers 4.35+ and 5)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    mask_id = shape["vocab_size"] - 1
    (path / "tokenizer_config.json").write_text(json.dumps({"mask_token": MASK_TOKEN}))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {}},
                                                     "added_tokens": [{"id": mask_id, "content": MASK_TOKEN}]}))
    return path


def random_batch(num_seqs: int, seq_len: int, prompt_len: int, vocab: int, seed: int = 0):
    """A rollout batch of random tokens (the mask token excluded): every row ``seq_len`` long, responses
    after ``prompt_len`` prompt tokens, advantages standard normal."""
    from cotrain.rl.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, vocab - 1, (num_seqs, seq_len + 1), generator=g)
    mask = torch.zeros(num_seqs, seq_len)
    mask[:, prompt_len - 1:] = 1.0
    return TrainBatch(inputs=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous(), mask=mask,
                      advantages=torch.randn(num_seqs, generator=g), rollout_logprobs=torch.zeros(num_seqs, seq_len),
                      lengths=torch.full((num_seqs,), seq_len, dtype=torch.int64))


def overrides(args, kind: str, ckpt: Path) -> list[str]:
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    gpus = ["cluster.gpus_per_node=1", "rollout.colocate=true"] if args.device == "cuda" else []
    return [f"policy.model_path={ckpt}", f"cluster.device={args.device}", *gpus, f"policy.dtype={dtype}",
            f"policy.micro_batch_size={args.micro_batch}", f"policy.max_seq_len={args.seq_len}",
            "policy.reference_model=false", f"grpo.prompts_per_step={args.seqs // 4}", "grpo.group_size=4",
            "grpo.global_batch_size=null", "grpo.epochs=1", "grpo.num_steps=1000",
            f"rollout.sampling.max_tokens={args.seq_len - args.prompt_len}", "rollout.speculative.method=null",
            f"draft.kind={kind}", "draft.cotrain=true", "draft.init=null", *args.set]


def run_kind(args, kind: str, ckpt: Path) -> dict:
    """In this process: one trainer with ``kind``'s co-trained drafter, arms alternating round by round."""
    from cotrain.config import load_config
    from cotrain.distributed import find_free_port
    from cotrain.rl.trainer import MegatronPolicyWorker

    device = torch.device(args.device)
    cfg = load_config(str(ROOT / "configs" / "grpo.yaml"), overrides(args, kind, ckpt))
    t0 = time.perf_counter()
    worker = MegatronPolicyWorker(cfg, str(ckpt), 0, 1, "127.0.0.1", find_free_port())
    build_s = time.perf_counter() - t0
    batch = random_batch(args.seqs, args.seq_len, args.prompt_len, cfg._arch.vocab_size, seed=args.seed)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def update(draft_step):
        sync()
        t = time.perf_counter()
        lp = worker.logprobs(batch, draft_step=draft_step)
        sync()
        t_lp = time.perf_counter() - t
        batch.old_logprobs = lp["logprobs"].to("cpu", torch.float32)
        worker.train_step(batch)
        sync()
        total = time.perf_counter() - t
        rec = {"update_s": total, "logprobs_s": t_lp, "train_s": total - t_lp}
        if draft_step is not None:
            m = lp["draft_metrics"]
            rec["draft_s"] = float(m["draft/time_s"])
            rec["draft_metrics"] = {k: float(v) for k, v in m.items() if isinstance(v, (int, float))}
        return rec

    rounds = {"off": [], "on": []}
    step = 0
    for r in range(args.warmup + args.rounds):
        for arm in (("off", "on") if r % 2 == 0 else ("on", "off")):
            step += arm == "on"
            rec = update(step if arm == "on" else None)
            if r >= args.warmup:
                rounds[arm].append(rec)
        print(f"{kind} round {r + 1}/{args.warmup + args.rounds}"
              f"{' (warm-up)' if r < args.warmup else ''}: "
              + ", ".join(f"{a} {rounds[a][-1]['update_s']:.3f} s" for a in ("off", "on") if rounds[a] and r >= args.warmup),
              flush=True)
    worker.shutdown()
    med = lambda arm, key: statistics.median(x[key] for x in rounds[arm])  # noqa: E731
    rng = lambda arm, key: [min(x[key] for x in rounds[arm]), max(x[key] for x in rounds[arm])]  # noqa: E731
    summary = {arm: {key: {"median": med(arm, key), "range": rng(arm, key)}
                     for key in ("update_s", "logprobs_s", "train_s") + (("draft_s",) if arm == "on" else ())}
               for arm in rounds}
    on, off, draft = med("on", "update_s"), med("off", "update_s"), med("on", "draft_s")
    return {"kind": kind, "draft_settings": cfg.draft.settings.model_dump(mode="json"), "build_s": build_s, "tokens": args.seqs * args.seq_len,
            "response_tokens": int(batch.mask.sum().item()), "summary": summary,
            "overhead_paired": on / off - 1.0, "overhead_drafter": draft / (on - draft),
            "overhead_note": "paired: synchronised wall time of the whole update with / without the drafter; "
                             "drafter: draft/time_s, host time without CUDA syncs (indicative on CUDA)",
            "paper": PAPER.get(kind), "rounds": rounds,
            "peak_cuda_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "python_packages": loaded_packages()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", required=True, help="output folder (cotrain_step.json)")
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke test's shape instead of Qwen3-0.6B")
    ap.add_argument("--drafters", default="dflash,eagle3")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra config override (repeatable), e.g. draft.dflash.block_size=8")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: KIND,CHECKPOINT,RESULT_JSON
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_cotrain_step: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if args.worker:
        kind, ckpt, dest = args.worker.split(",")
        Path(dest).write_text(json.dumps(run_kind(args, kind, Path(ckpt))))
        return 0
    if args.seqs % 4:
        ap.error(f"--seqs {args.seqs}: a multiple of 4 (groups of 4 samples per prompt)")
    if args.tiny:
        args.seqs, args.seq_len, args.prompt_len, args.micro_batch = (min(args.seqs, 4), min(args.seq_len, 64),
                                                                      min(args.prompt_len, 16), min(args.micro_batch, 2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if args.tiny else QWEN3_0_6B
    t_start = time.perf_counter()
    result = {"model": "tiny Qwen3 shape" if args.tiny else "Qwen3-0.6B shape (random weights)", "shape": shape,
              "dtype": str(dtype).replace("torch.", ""), "device": args.device,
              "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None, "torch": torch.__version__,
              "seqs": args.seqs, "seq_len": args.seq_len, "prompt_len": args.prompt_len,
              "micro_batch": args.micro_batch, "rounds": args.rounds, "warmup": args.warmup, "extra_overrides": args.set,
              "arms": "off = logprobs + train_step; on = logprobs(draft_step) + train_step; alternating, order "
                      "flipped every round; one process per drafter kind", "kinds": {}, "failures": {}}
    with tempfile.TemporaryDirectory(prefix="cotrain_step_") as tmp:
        ckpt = write_checkpoint(shape, Path(tmp) / "policy", device, dtype)
        from cotrain.config import load_config

        kinds = [k for k in args.drafters.split(",") if k]
        for kind in kinds:  # a config the trainer refuses fails here, before any worker starts
            load_config(str(ROOT / "configs" / "grpo.yaml"), overrides(args, kind, ckpt))
        for kind in kinds:
            dest = Path(tmp) / f"{kind}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", f"{kind},{ckpt},{dest}",
                   "--device", args.device, "--out", str(out), "--seqs", str(args.seqs), "--seq-len", str(args.seq_len),
                   "--prompt-len", str(args.prompt_len), "--micro-batch", str(args.micro_batch),
                   "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--seed", str(args.seed)]
            for s in args.set:
                cmd += ["--set", s]
            proc = subprocess.run(cmd, env={**os.environ, "LOCAL_RANK": "0"})
            if proc.returncode == 0 and dest.exists():
                result["kinds"][kind] = json.loads(dest.read_text())
            else:
                result["failures"][kind] = f"worker exited {proc.returncode}"
    result["seconds"] = time.perf_counter() - t_start
    (out / "cotrain_step.json").write_text(json.dumps(result, indent=1))
    print(f"{result['model']}, {result['dtype']}, {args.seqs} x {args.seq_len} tokens, medians of {args.rounds} rounds:")
    for kind, r in result["kinds"].items():
        s = r["summary"]
        print(f"  {kind:7s} update off {s['off']['update_s']['median']:.3f} s, on {s['on']['update_s']['median']:.3f} s "
              f"(drafter {s['on']['draft_s']['median']:.3f} s): overhead paired {100 * r['overhead_paired']:.1f}%, "
              f"drafter {100 * r['overhead_drafter']:.1f}% (paper: {r['paper']})")
    for kind, why in result["failures"].items():
        print(f"  {kind}: FAILED ({why})")
    print(f"wrote {out / 'cotrain_step.json'} in {result['seconds']:.0f} s")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
