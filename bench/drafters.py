"""Benchmark: the three drafter families on the tiny built-in target (CPU).

Per family (EAGLE-3, DFlash, DSpark), distilled offline with configs/distill_<kind>.yaml (cached
under $COTRAIN_CACHE/drafters, the same drafters the tests use):

- acceptance length: the offline estimate (greedy serving walk on the held-out prompts) and what
  vLLM measures serving those prompts greedily (DSpark: vLLM serves it only on GPU; on CPU the
  number is the offline one);
- training-step time: median wall time of one optimizer step (forward, loss, backward, AdamW) on
  batches of the distillation data, one thread;
- vLLM rollout throughput with speculative decoding vs the same engine settings without it, on two
  workloads, from one run (all engines in this process, one after the other):
    * ``task``:  the held-out prompts, temperature 1 (rollout-like), n samples each, stop at EOS
      (responses of 1-4 tokens: the tiny task's answers);
    * ``long``:  the same prompts, greedy, 48 tokens each ignoring EOS (the target's continuation
      after its answer; long outputs are where speculation can pay).
  tokens/s = generated tokens / wall time (median of ``--repeats`` runs); the ratio spec/none.

Writes bench/results/drafters.json and docs/img/drafters.png.

    python bench/drafters.py            # about 3-5 minutes on 2 cores (drafters cached: less)
    python bench/drafters.py --quick    # fewer prompts and repeats
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

FAMILIES = {"eagle3": 4, "dflash": 6, "dspark": 7}  # kind -> draft tokens per step served


def _spec_len(outs) -> tuple[float, int, int]:
    acc = rounds = 0
    for o in outs:
        for c in o.outputs:
            m = c.spec_decode_metrics
            if m is None:
                continue
            h = (m.to_dict() if hasattr(m, "to_dict") else dict(m))["acceptance_histogram"]
            acc += sum(j * n for j, n in enumerate(h))
            rounds += sum(h)
    return (1.0 + acc / rounds if rounds else float("nan")), acc, rounds


def _throughput(llm, prompts, params, repeats: int) -> dict:
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    times, tokens, outs = [], 0, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    t = statistics.median(times)
    acc_len, acc, rounds = _spec_len(outs)
    return {"tokens": tokens, "seconds": t, "tokens_per_s": tokens / t, "acceptance_len": acc_len,
            "texts": [[list(c.token_ids) for c in o.outputs] for o in outs]}


def _train_step_time(kind: str, cfg, steps: int) -> dict:
    from transformers import AutoTokenizer

    from cotrain.draft.common import select_sequences
    from cotrain.draft.distill import generate_records, load_prompts, loss_extra, records_to_batch, train_step
    from cotrain.draft.registry import build_drafter
    from cotrain.draft.taps import TargetSpec, load_hf_target
    from cotrain.models.build_tiny import resolve_model_path

    path = resolve_model_path(cfg.target)
    model, tok = load_hf_target(path), AutoTokenizer.from_pretrained(str(path))
    target = TargetSpec.from_checkpoint(path)
    d = build_drafter(kind, cfg.draft.settings, target, seed=0)
    prompts = load_prompts(cfg.data, 256, cfg.data.seed + 99)
    recs = generate_records(model, tok, prompts, cfg.data.max_new_tokens, cfg.data.tail_tokens)
    data = records_to_batch(recs, model, d.tap_layers)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    loss = cfg.draft.loss or cfg.draft.settings.default_loss
    times = []
    bs = cfg.train.batch_size
    for i in range(steps + 3):
        b = select_sequences(data, torch.randint(0, data.num_seqs, (bs,), generator=gen))
        t0 = time.perf_counter()
        train_step(d, b, loss, opt, 1.0, gen, loss_extra(cfg))
        if i >= 3:
            times.append(time.perf_counter() - t0)
    toks = data.num_tokens / data.num_seqs * bs
    med = statistics.median(times)
    return {"step_ms": 1000 * med, "batch_sequences": bs, "tokens_per_step": round(toks),
            "trained_tokens_per_s": toks / med, "loss": loss}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--samples", type=int, default=None, help="samples per prompt in the task workload")
    ap.add_argument("--out", default=str(ROOT / "bench/results/drafters.json"))
    ap.add_argument("--png", default=str(ROOT / "docs/img/drafters.png"))
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    n_samples = args.samples or (2 if args.quick else 4)
    torch.set_num_threads(1)

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from cotrain.draft.acceptance import estimate_acceptance
    from cotrain.draft.cache import ensure_distilled
    from cotrain.draft.distill import generate_records, load_distill_config, load_prompts, records_to_batch
    from cotrain.draft.export import load_drafter
    from cotrain.draft.taps import TargetSpec, load_hf_target
    from cotrain.models.build_tiny import ensure_tiny_model
    from cotrain.rl.vllm_engine import make_cotrain_llm

    t_start = time.time()
    tiny = ensure_tiny_model()
    target = TargetSpec.from_checkpoint(tiny)
    model, tok = load_hf_target(tiny), AutoTokenizer.from_pretrained(str(tiny))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results: dict = {"target": str(tiny), "device": device, "threads": 1, "families": {}}

    prompts = None
    engines_needed = {}
    for kind, k in FAMILIES.items():
        cfg = load_distill_config(ROOT / f"configs/distill_{kind}.yaml")
        print(f"[{kind}] distilling (cached after the first run) ...", flush=True)
        run = ensure_distilled(cfg)
        drafter = load_drafter(run / "drafter", target).eval()
        d = cfg.data
        held = load_prompts(d, d.num_prompts + d.eval_prompts, d.seed)[d.num_prompts:]
        if args.quick:
            held = held[:64]
        prompts = prompts or held
        recs = generate_records(model, tok, held, d.max_new_tokens, d.tail_tokens)
        batch = records_to_batch(recs, model, drafter.tap_layers)
        off = estimate_acceptance(drafter, batch, k=k, eos_token_id=target.eos_token_id)
        print(f"[{kind}] offline acceptance {off.walk_len:.3f} (k={k}); timing training steps ...", flush=True)
        train = _train_step_time(kind, cfg, steps=5 if args.quick else 20)
        results["families"][kind] = {"k": k, "offline_acceptance_len": off.walk_len,
                                     "offline_per_position": off.per_position, "train": train,
                                     "vllm_serves_on_cpu": kind != "dspark", "drafter": str(run / "drafter"),
                                     "distill_steps": cfg.train.steps}
        if kind != "dspark" or torch.cuda.is_available():
            engines_needed[kind] = drafter.speculative_config(str(run / "drafter"), k)
        del drafter, batch
        gc.collect()

    task = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=16, n=n_samples, seed=0)
    long = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    runs: dict = {}
    for name, spec in [("none", None), *engines_needed.items()]:
        print(f"[vllm] engine {name} ...", flush=True)
        llm = make_cotrain_llm(str(tiny), seed=0, speculative_config=spec)
        entry = {"task": _throughput(llm, prompts, task, repeats), "long": _throughput(llm, prompts, long, repeats)}
        g = llm.generate(prompts, greedy, use_tqdm=False)
        entry["greedy_acceptance_len"] = _spec_len(g)[0]
        entry["greedy_tokens"] = [list(o.outputs[0].token_ids) for o in g]
        runs[name] = entry
        del llm
        gc.collect()

    base = runs["none"]
    results["baseline"] = {w: {"tokens_per_s": base[w]["tokens_per_s"], "tokens": base[w]["tokens"]}
                           for w in ("task", "long")}
    for kind, entry in runs.items():
        if kind == "none":
            continue
        fam = results["families"][kind]
        fam["vllm_acceptance_len"] = entry["greedy_acceptance_len"]
        fam["vllm_vs_offline"] = entry["greedy_acceptance_len"] / fam["offline_acceptance_len"]
        fam["greedy_output_identical"] = entry["greedy_tokens"] == base["greedy_tokens"]
        for w in ("task", "long"):
            fam[w] = {"tokens_per_s": entry[w]["tokens_per_s"], "acceptance_len": entry[w]["acceptance_len"],
                      "speedup_vs_none": entry[w]["tokens_per_s"] / base[w]["tokens_per_s"]}
        fam["long_greedy_identical"] = entry["long"]["texts"] == base["long"]["texts"]
    results["workloads"] = {"task": f"{len(prompts)} prompts x {n_samples} samples, temperature 1, max 16 tokens",
                            "long": f"{len(prompts)} prompts, greedy, 48 tokens ignoring EOS"}
    results["seconds"] = round(time.time() - t_start, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    plot(results, args.png)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk not in ("offline_per_position", "drafter")}
                      for k, v in results["families"].items()}, indent=1))
    print(f"wrote {args.out} and {args.png} in {results['seconds']} s")
    return 0


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = list(results["families"])
    x = range(len(fams))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    a = axes[0]
    off = [results["families"][f]["offline_acceptance_len"] for f in fams]
    vl = [results["families"][f].get("vllm_acceptance_len", float("nan")) for f in fams]
    a.bar([i - 0.2 for i in x], off, 0.4, label="offline estimate")
    a.bar([i + 0.2 for i in x], vl, 0.4, label=f"vLLM ({results['device']})")
    for i, f in enumerate(fams):
        if "vllm_acceptance_len" not in results["families"][f]:
            a.text(i + 0.2, 0.1, "GPU only", rotation=90, ha="center", va="bottom", fontsize=8)
    a.set_xticks(list(x), [f"{f}\nk={results['families'][f]['k']}" for f in fams])
    a.set_ylabel("greedy acceptance length")
    a.set_title("acceptance (held-out prompts)")
    a.legend(fontsize=8)
    a = axes[1]
    a.bar(list(x), [results["families"][f]["train"]["step_ms"] for f in fams], color="C2")
    a.set_xticks(list(x), fams)
    a.set_ylabel("ms / step")
    a.set_title(f"training step (batch {results['families'][fams[0]]['train']['batch_sequences']}, 1 thread)")
    a = axes[2]
    served = [f for f in fams if "task" in results["families"][f]]
    xs = range(len(served))
    for j, w in enumerate(("task", "long")):
        a.bar([i - 0.2 + 0.4 * j for i in xs], [results["families"][f][w]["speedup_vs_none"] for f in served], 0.4,
              label=w)
    a.axhline(1.0, color="k", lw=0.8)
    a.set_xticks(list(xs), served)
    a.set_ylabel("tokens/s with spec / without")
    a.set_title(f"vLLM rollout throughput ratio ({results['device']})")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
