"""Benchmark: EAGLE-3 drafter training step with and without a reduced draft vocabulary (d2t).

Two setups, each with two arms that differ only in ``draft.eagle3.draft_vocab_size``:

- ``words``: the built-in words target (8,192-token vocabulary, cotrain/models/words.py) and the
  data of configs/distill_words_eagle3.yaml (the target's greedy responses to the copy task's
  prompts, taps and target logits from a Hugging Face forward); ``full`` = a head over all 8,192
  tokens, ``reduced`` = 512 draft tokens (the config's), the mapping built from the data's
  response-token counts as the distillation builds it.
- ``qwen3_vocab``: Qwen3's vocabulary size (151,936) on the same small shapes (hidden 128, 2 layers,
  random weights: only the sizes matter here), random Zipf-distributed token sequences;
  ``reduced`` = 32,000 draft tokens (the size of public EAGLE-3 heads, SpecForge's default).

What is measured, per arm: the wall time of one drafter training step as the distillation takes
it (``cotrain.draft.distill.train_step``: TTT forward, target distributions at the chain rows, the
loss, backward, AdamW), on one thread; and the peak of the tensor memory the step allocates above
the level before it (the PyTorch profiler's allocation and free events over one step on a fixed
batch; the parameters, gradients and Adam moments that persist between steps are reported beside
it as ``state_mib``). The arms are interleaved round by round (each round: ``--steps`` timed steps of
one arm, then of the other, the order alternating between rounds), after ``--warmup`` untimed
steps each, so that load from other processes hits both alike. Reported: per arm the median over
rounds of the round's median step time, with [min, max] over rounds; the per-round paired ratio
reduced / full, median [min, max]; the memory numbers and their ratio.

    python bench/draft_vocab.py              # both setups, CPU: about 5 minutes on 2 busy cores
    python bench/draft_vocab.py --quick      # smoke test (fewer rounds and steps)
    python bench/draft_vocab.py --report bench/results/draft_vocab.json   # the docs' table + PNGs

Outputs: the JSON (``--out``, default bench/results/draft_vocab.json), a PNG beside it and, for
full runs, docs/img/draft_vocab.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

CONFIG = ROOT / "configs" / "distill_words_eagle3.yaml"
QWEN3_VOCAB, QWEN3_DRAFT = 151_936, 32_000
DOCS_PNG = ROOT / "docs" / "img" / "draft_vocab.png"


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


# ------------------------------------------------------------------------------------- setups
def words_setup(num_prompts: int) -> dict:
    """The words target and num_prompts sequences of its distillation data."""
    from transformers import AutoTokenizer

    from cotrain.config.distill import load_distill_config
    from cotrain.draft.distill import generate_records, load_prompts, records_to_batch
    from cotrain.draft.taps import TargetSpec, load_hf_target
    from cotrain.models.build_tiny import resolve_model_path

    cfg = load_distill_config(CONFIG)
    path = resolve_model_path(cfg.target)
    model, tok = load_hf_target(path), AutoTokenizer.from_pretrained(str(path))
    target = TargetSpec.from_checkpoint(path)
    d = cfg.data
    prompts = load_prompts(d, num_prompts, d.seed + 99)
    recs = generate_records(model, tok, prompts, d.max_new_tokens, d.tail_tokens)
    tap_layers = [0, 1]  # the config's default for a 2-layer target
    return {"target": target, "data": records_to_batch(recs, model, tap_layers), "settings": cfg.draft.settings,
            "draft_vocab_size": cfg.draft.eagle3.draft_vocab_size, "batch_size": cfg.train.batch_size,
            "loss": cfg.draft.loss}


def qwen3_vocab_setup(num_seqs: int, seq_len: int = 24, batch_size: int = 8, vocab: int = QWEN3_VOCAB,
                      draft: int = QWEN3_DRAFT) -> dict:
    """A random 2-layer target with Qwen3's vocabulary size (``vocab``) and Zipf-distributed token
    sequences; the reduced arm has ``draft`` draft tokens."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from cotrain.config.schema import Eagle3Config
    from cotrain.draft.common import DraftBatch
    from cotrain.draft.taps import TargetSpec, compute_taps
    from cotrain.models.words import WORDS_QWEN3_CONFIG

    hf = {k: v for k, v in WORDS_QWEN3_CONFIG.items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf.update(vocab_size=vocab, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**hf)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        target = TargetSpec.from_checkpoint(tmp, mask_token_id=3)
    g = torch.Generator().manual_seed(0)
    w = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    ids = torch.multinomial(w, num_seqs * seq_len, replacement=True, generator=g)
    ids = ids[torch.randperm(ids.numel(), generator=g)]  # (i.i.d. draws: the order is immaterial)
    ids = (ids * 7919) % vocab  # (7919 is prime: a permutation of the ids unless vocab is a multiple)
    cu = torch.arange(0, num_seqs * seq_len + 1, seq_len)
    taps, logits = compute_taps(model, ids, cu, [0, 1])
    mask = (torch.arange(seq_len) >= seq_len // 3).repeat(num_seqs)  # the last two thirds are "responses"
    data = DraftBatch(ids, cu, taps, mask, logits, torch.full((num_seqs,), seq_len // 3))
    settings = Eagle3Config(tap_layers=[0, 1], ttt_steps=4, num_layers=1)
    return {"target": target, "data": data, "settings": settings, "draft_vocab_size": draft,
            "batch_size": batch_size, "loss": "soft_ce"}


# ------------------------------------------------------------------------------------- arms
class Arm:
    """One drafter (full or reduced head), its optimizer, and a fixed stream of batches."""

    def __init__(self, setup: dict, reduced: bool) -> None:
        from cotrain.draft.distill import build_draft_vocab
        from cotrain.draft.registry import build_drafter

        settings = setup["settings"].model_copy(update={"draft_vocab_size": setup["draft_vocab_size"] if reduced
                                                        else None})
        self.drafter = build_drafter("eagle3", settings, setup["target"], seed=0)
        self.data = setup["data"]
        self.vocab_info = build_draft_vocab(self.drafter, self.data) if reduced else None
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=1e-3)
        self.bs, self.loss = setup["batch_size"], setup["loss"]
        self.gen = torch.Generator().manual_seed(0)
        self.round_ms: list[float] = []
        self.peak_mib: list[float] = []
        self.losses: list[float] = []

    def batch(self, seed: int):
        from cotrain.draft.common import select_sequences

        g = torch.Generator().manual_seed(seed)
        return select_sequences(self.data, torch.randint(0, self.data.num_seqs, (self.bs,), generator=g))

    def step(self, batch) -> float:
        from cotrain.draft.distill import train_step

        t0 = time.perf_counter()
        m = train_step(self.drafter, batch, self.loss, self.opt, 1.0, self.gen)
        dt = time.perf_counter() - t0
        self.losses.append(m["loss"])
        return dt

    def peak_step_mib(self, batch) -> float:
        """Peak tensor memory one step allocates above the level before it (bench.measure)."""
        from bench.measure import peak_allocated_mib

        return peak_allocated_mib(lambda: self.step(batch))

    def state_mib(self) -> float:
        """Parameters + gradients + Adam's two moments (what persists between steps)."""
        n = sum(p.numel() for p in self.drafter.parameters() if p.requires_grad)
        return 4 * n * 4 / 2**20

    def summary(self) -> dict:
        d = self.drafter
        return {"step_ms": spread(self.round_ms), "per_round_step_ms": self.round_ms,
                "peak_step_mib": spread(self.peak_mib), "per_round_peak_step_mib": self.peak_mib,
                "state_mib": self.state_mib(),
                "head_rows": d.lm_head.weight.shape[0],
                "trainable_params": sum(p.numel() for p in d.parameters() if p.requires_grad),
                "vocab": self.vocab_info, "final_loss": self.losses[-1]}


def run_setup(name: str, setup: dict, rounds: int, steps: int, warmup: int) -> dict:
    arms = {"full": Arm(setup, reduced=False), "reduced": Arm(setup, reduced=True)}
    seed = 0
    for arm in arms.values():  # untimed: Adam's state exists, caches warm
        for i in range(warmup):
            arm.step(arm.batch(10_000 + i))
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for a in order:
            arm = arms[a]
            times = [arm.step(arm.batch(seed + i)) for i in range(steps)]  # the same batches for both arms
            arm.round_ms.append(1000 * statistics.median(times))
            arm.peak_mib.append(arm.peak_step_mib(arm.batch(99_999)))
        seed += steps
        print(f"  {name} round {r + 1}/{rounds}: " + ", ".join(f"{a} {arms[a].round_ms[-1]:.0f} ms "
                                                               f"{arms[a].peak_mib[-1]:.0f} MiB" for a in arms),
              flush=True)
    full, red = arms["full"], arms["reduced"]
    per_round = [b / a for a, b in zip(full.round_ms, red.round_ms)]
    data = setup["data"]
    return {"target_vocab_size": setup["target"].arch.vocab_size, "draft_vocab_size": setup["draft_vocab_size"],
            "hidden_size": setup["target"].arch.hidden_size, "batch_sequences": setup["batch_size"],
            "tokens_per_step": round(data.num_tokens / data.num_seqs * setup["batch_size"]),
            "arms": {a: arm.summary() for a, arm in arms.items()},
            "time_ratio": {**spread(per_round), "per_round": per_round},
            "peak_step_mib_ratio": statistics.median(red.peak_mib) / statistics.median(full.peak_mib),
            "state_mib_ratio": red.state_mib() / full.state_mib()}


# ------------------------------------------------------------------------------------- report
def markdown(data: dict) -> str:
    lines = ["| setup | V | draft vocab | arm | step ms, median [min, max] | peak step MiB | state MiB |",
             "|---|---|---|---|---|---|---|"]
    for name, s in data["setups"].items():
        for a in ("full", "reduced"):
            x = s["arms"][a]
            t = x["step_ms"]
            lines.append(f"| {name} | {s['target_vocab_size']:,} | {x['head_rows']:,} | {a} | "
                         f"{t['median']:.0f} [{t['min']:.0f}, {t['max']:.0f}] | "
                         f"{x['peak_step_mib']['median']:.0f} | {x['state_mib']:.1f} |")
    lines += ["", "| setup | step time reduced / full (per round), median [min, max] | peak step memory | state |",
              "|---|---|---|---|"]
    for name, s in data["setups"].items():
        r = s["time_ratio"]
        lines.append(f"| {name} | {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}] | "
                     f"{s['peak_step_mib_ratio']:.2f} | {s['state_mib_ratio']:.2f} |")
    return "\n".join(lines)


def plot(data: dict, path: Path):
    """Draw the two panels (step time, peak step memory; log scale) to ``path``; returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(data["setups"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, label in ((axes[0], "step_ms", "training step (ms)"), (axes[1], "peak_step_mib", "peak step memory (MiB)")):
        for j, a in enumerate(("full", "reduced")):
            med = [data["setups"][n]["arms"][a][key]["median"] for n in names]
            lo = [m - data["setups"][n]["arms"][a][key]["min"] for m, n in zip(med, names)]
            hi = [data["setups"][n]["arms"][a][key]["max"] - m for m, n in zip(med, names)]
            xs = [i + (j - 0.5) * 0.38 for i in range(len(names))]
            ax.bar(xs, med, width=0.36, yerr=[lo, hi], capsize=3, label=a)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([f"{n}\nV={data['setups'][n]['target_vocab_size']:,}, "
                            f"N={data['setups'][n]['draft_vocab_size']:,}" for n in names])
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("EAGLE-3 drafter training step: full vs reduced draft vocabulary (CPU, 1 thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="smoke-test sizes")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; quick 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per arm per round (default 2; quick 1)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per arm first")
    ap.add_argument("--setups", nargs="+", default=["words", "qwen3_vocab"], choices=["words", "qwen3_vocab"])
    ap.add_argument("--out", type=Path, default=None, help="JSON (default bench/results/draft_vocab[_quick].json)")
    ap.add_argument("--report", type=Path, default=None, help="print the docs' tables from this JSON, redraw its PNG")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.report:
        data = json.loads(a.report.read_text())
        plot(data, a.report.with_suffix(".png"))
        if not data["command"].endswith("--quick"):
            plot(data, DOCS_PNG)
        print(markdown(data))
        return 0
    torch.set_num_threads(1)
    rounds = a.rounds or (2 if a.quick else 5)
    steps = a.steps or (1 if a.quick else 2)
    out = a.out or ROOT / "bench" / "results" / ("draft_vocab_quick.json" if a.quick else "draft_vocab.json")
    t0 = time.time()
    setups = {}
    for name in a.setups:
        print(f"{name}: preparing", flush=True)
        setup = words_setup(64 if a.quick else 256) if name == "words" else qwen3_vocab_setup(16 if a.quick else 64)
        setups[name] = run_setup(name, setup, rounds, steps, a.warmup)
        del setup
    data = {"command": " ".join(["python bench/draft_vocab.py", *(argv if argv is not None else sys.argv[1:])]),
            "rounds": rounds, "steps_per_round": steps, "warmup": a.warmup, "threads": 1,
            "torch": torch.__version__, "seconds": round(time.time() - t0, 1), "setups": setups}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    plot(data, out.with_suffix(".png"))
    if not a.quick:
        plot(data, DOCS_PNG)  # the figure docs/drafters.md shows
    print(markdown(data))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
