"""Benchmark (GPU): what a speculative verification round costs against a plain decode step, by batch size.

    python bench/gpu_verify_cost.py --device cuda --out DIR      # the Qwen3-0.6B shape, bf16 (about a minute on an H200)
    python bench/gpu_verify_cost.py --device cpu --tiny --out DIR  # the CPU smoke test's shape (seconds)

A Qwen3-0.6B-shaped ``transformers`` ``Qwen3ForCausalLM`` (random weights: costs do not depend on
them; bf16 on CUDA, fp32 on CPU) holds, for every batch size b of ``--batch-sizes`` (1..256), a KV
cache of ``--context`` positions per sequence (one prefill). Then, interleaved round by round in a
rotating order, with the cache cropped back to ``--context`` after every forward:

    c_0(b)  one decode step: a forward of 1 position per sequence against the cache
    c_k(b)  one verification round with k drafts: a forward of k + 1 positions per sequence (the
            bonus token and k drafts, logits at every one of them) against the same cache

medians over ``--rounds`` (after ``--warmup``), with ranges. ``c_k / c_0`` is the acceptance length
(tokens per round) at which a round pays for itself; what speculation gains is E_k / (c_k / c_0).

The result has the shape ``python -m cotrain.rl.calibrate`` writes (points with ``plain_step_s``,
``per_k[k].round_s``, ``tokens_per_s``, ``best_k``, ``schedule``: its report prints it), with two
differences it names: the acceptance lengths are *assumed*, E_k = (1 - a^(k+1)) / (1 - a) for a per-draft
acceptance rate a = ``--acceptance-rate`` (this script has no drafter), and the costs are those of
eager PyTorch through transformers, not vLLM's engine (no CUDA graphs, no paged attention, no
drafter forward). So it is a *proxy* for vLLM's decode cost on this GPU: where vLLM runs, the
schedule comes from calibrate's engine measurement, never from this file.

Output: ``DIR/verify_cost.json`` and ``DIR/verify_cost.png`` (c_k / c_0 by batch size per k; the
assumed speed-up of the best k).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Qwen3-0.6B's architecture (its Hugging Face config.json; random weights here)
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
#: the CPU smoke test's shape
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=True)


def loaded_packages() -> list[str]:
    """Top-level non-standard-library modules loaded in this process (recorded in the JSON: no ray, no vllm)."""
    return sorted({n.split(".")[0] for n, m in list(sys.modules.items()) if m is not None} - set(sys.stdlib_module_names))


def build_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-weight Qwen3ForCausalLM of ``shape`` on ``device`` (initialised there), eval mode."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(**shape, architectures=["Qwen3ForCausalLM"], use_cache=True)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def assumed_acceptance(k: int, rate: float) -> tuple[float, list[float]]:
    """(E_k, survival): tokens per round and P(first j drafts accepted), j = 1..k, for i.i.d.
    per-draft acceptance ``rate``."""
    survival = [rate ** j for j in range(1, k + 1)]
    return 1.0 + sum(survival), survival


def crop_to(cache, length: int) -> None:
    """Drop the positions past ``length`` from a DynamicCache. ``crop(-n)`` removes n positions in
    transformers 4.x and 5.x alike (a positive argument is an absolute length in 4.x, deprecated in 5.x)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
    if cache.get_seq_length() != length:
        raise RuntimeError(f"the KV cache holds {cache.get_seq_length()} positions, {length} expected")


@torch.no_grad()
def measure_batch(model, b: int, context: int, ks: list[int], rounds: int, warmup: int, device, seed: int) -> dict:
    """Per arm (0 = decode step, k = verification round with k drafts): seconds of every timed forward."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(seed + b)
    prompt = torch.randint(0, vocab, (b, context), generator=g).to(device)
    cache = DynamicCache()
    model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    del prompt
    arms = [0, *ks]
    inputs = {k: torch.randint(0, vocab, (b, k + 1), generator=g).to(device) for k in arms}
    times: dict[int, list[float]] = {k: [] for k in arms}
    for r in range(warmup + rounds):
        for k in arms[r % len(arms):] + arms[: r % len(arms)]:  # rotated order every round
            sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=inputs[k], past_key_values=cache, use_cache=True)
            sync(device)
            dt = time.perf_counter() - t0
            assert out.logits.shape[1] == k + 1  # logits at every verified position
            del out
            crop_to(cache, context)
            if r >= warmup:
                times[k].append(dt)
    del cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times


def summarise(times_by_batch: dict[int, dict[int, list[float]]], ks: list[int], rate: float, max_batch: int) -> dict:
    """calibrate's points and schedule from the timings (acceptance assumed: ``rate``)."""
    from dataclasses import asdict

    from cotrain.rl.calibrate import Point, best_k, schedule_from_points

    points, ranges = [], []
    for b, times in sorted(times_by_batch.items()):
        c0 = statistics.median(times[0])
        per_k = {}
        for k in ks:
            ck = statistics.median(times[k])
            e, survival = assumed_acceptance(k, rate)
            per_k[k] = {"round_s": ck, "round_s_range": [min(times[k]), max(times[k])], "cost_ratio": ck / c0,
                        "acceptance_length": e, "tokens_per_s": b * e / ck, "survival": survival}
        plain = b / c0
        k_best, speedup = best_k(plain, per_k)
        points.append(Point(batch=b, plain_step_s=c0, plain_tokens_per_s=plain, per_k=per_k, best_k=k_best,
                            speedup=speedup, rounds=[{"k": k, "seconds": s} for k in times for s in times[k]]))
        ranges.append([min(times[0]), max(times[0])])
    return {"points": [{**asdict(p), "plain_step_s_range": r} for p, r in zip(points, ranges)],
            "schedule": schedule_from_points(points, max_batch)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    bs = [p["batch"] for p in pts]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for k in result["ks"]:
        a1.plot(bs, [p["per_k"][str(k)]["cost_ratio"] for p in pts], marker="o", label=f"k={k}")
        a2.plot(bs, [p["per_k"][str(k)]["tokens_per_s"] / p["plain_tokens_per_s"] for p in pts], marker="o",
                label=f"k={k}")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch (sequences)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    a1.set_ylabel("verification round / decode step (c_k / c_0)")
    a1.set_title(f"{result['model']}, {result['dtype']}, context {result['context']}: break-even tokens per round")
    a2.axhline(1.0, color="k", lw=0.8)
    a2.set_ylabel(f"tokens/s vs plain, acceptance rate {result['acceptance_assumed']['per_draft_rate']} (assumed)")
    a2.set_title("proxy for vLLM (eager transformers, no CUDA graphs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", required=True, help="output folder (verify_cost.json, verify_cost.png)")
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke test's shape instead of Qwen3-0.6B")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--ks", default="1,3,7,15", help="draft tokens per round (DFlash blocks of 16 verify up to 15)")
    ap.add_argument("--context", type=int, default=512, help="positions already in each sequence's KV cache")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--acceptance-rate", type=float, default=0.8,
                    help="assumed per-draft acceptance rate for the tokens/s columns and the schedule")
    ap.add_argument("--max-batch", type=int, default=1024)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_verify_cost: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if args.tiny else QWEN3_0_6B
    sizes = sorted({int(x) for x in args.batch_sizes.split(",")})
    ks = sorted({int(x) for x in args.ks.split(",")})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    model = build_model(shape, device, dtype)
    times = {}
    for b in sizes:
        times[b] = measure_batch(model, b, args.context, ks, args.rounds, args.warmup, device, seed=0)
        c0 = statistics.median(times[b][0])
        print(f"batch {b:>4}: decode step {1e3 * c0:8.2f} ms; round/step "
              + "  ".join(f"k={k}: {statistics.median(times[b][k]) / c0:5.2f}" for k in ks), flush=True)
    result = {"config": "qwen3-0.6b-shape" if not args.tiny else "tiny", "method": "proxy: transformers eager forward",
              "proxy_for": "vLLM decode / verification cost (calibrate's engine measurement is the one schedules use)",
              "model": "Qwen3-0.6B shape (random weights)" if not args.tiny else "tiny Qwen3 shape",
              "shape": shape, "dtype": str(dtype).replace("torch.", ""), "device": args.device,
              "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
              "torch": torch.__version__, "context": args.context, "num_speculative_tokens": max(ks), "ks": ks,
              "max_tokens": None, "temperature": None, "rounds": args.rounds, "warmup": args.warmup,
              "acceptance_assumed": {"per_draft_rate": args.acceptance_rate,
                                     "acceptance_length": "E_k = (1 - a^(k+1)) / (1 - a)"}}
    result.update(summarise(times, ks, args.acceptance_rate, args.max_batch))
    result["seconds"] = time.perf_counter() - t_start
    result["python_packages"] = loaded_packages()
    result = json.loads(json.dumps(result))  # int keys -> str, as calibrate's JSON has them
    (out / "verify_cost.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "verify_cost.png")
    from cotrain.rl.calibrate import format_report

    print(format_report(result))
    print(f"(acceptance assumed, rate {args.acceptance_rate}; costs measured) wrote {out / 'verify_cost.json'} "
          f"and {out / 'verify_cost.png'} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
