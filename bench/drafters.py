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

import torch  # noqa: E402

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
    a = ap.parse_args(argv)
    a.preset = "quick" if a.quick else "gpu" if a.gpu else "default"
    for k, v in PRESETS[a.preset].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.out is None:
        a.out = ROOT / "bench" / "results" / f"drafters{'' if a.preset == 'default' else '-' + a.preset}.json"
    if a.png is None and a.preset == "default" and a.report is None:
        a.png = ROOT / "docs" / "img" / "drafters.png"
    return a


def build_engines(tiny: str, specs: dict, a) -> dict:
    from cotrain.rl.vllm_engine import make_cotrain_llm

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
                          "vllm_serves": served, "drafter": str(run / "drafter"), "distill_steps": cfg.train.steps}
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

    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    config.update(command="python bench/drafters.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  device=torch.cuda.get_device_name(0) if cuda else "cpu", threads=1, torch=torch.__version__,
                  vllm=vllm.__version__, cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d"),
                  loadavg_start=load_start, loadavg_end=os.getloadavg(), loadavg_per_round=round_loadavg, target=tiny,
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
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(ws))]
        r = [data["ratios"][w][k] for w in ws]
        a.bar(xs, [v["median"] for v in r], width, color=f"C{j}", alpha=0.75, label=f"{NAMES[k]} (median, range)",
              yerr=[[v["median"] - v["min"] for v in r], [v["max"] - v["median"] for v in r]], capsize=2)
        for xi, v in zip(xs, r):
            a.plot([xi] * len(v["per_round"]), v["per_round"], ".", color="k", ms=2.5)
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
