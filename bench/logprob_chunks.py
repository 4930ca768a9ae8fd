"""Chunked log-probs at a real vocabulary: the update's tensor memory with and without chunks.

The trainer's log-probs (cotrain/rl/trainer.py, ``_token_logprobs``) run the output layer over chunks
of a micro batch's positions under activation checkpointing (``policy.logprob_chunk_tokens``; default:
chunks whose fp32 logits take at most 256 MiB), so the [tokens, vocab] logits of the whole micro
batch are never alive at once. At a 128-token vocabulary that changes nothing; at Qwen's 151,936
it is most of the update's memory. This measures it on a model whose vocabulary is 151,936 (a
random-init Qwen3 of 2 layers, hidden 256, tied embeddings, so that the logits dominate as they do at
real scale: written once to ``--model-dir``), one packed micro batch of ``--tokens`` positions:

    arms      chunked (policy.logprob_chunk_tokens = null: auto), whole (= 0), handoff: chunked
              with the co-trained drafter's handoff of the whole logits (the last stage's on_logits
              callback receives the filtered, tempered logits [b, S, V/tp] of each micro batch and
              keeps them to the end of the call, as cotrain/rl/draft_stage.py does without the
              compact handoff: under CP, a replay window, on-policy branches), and compact:
              chunked with the compact handoff (only the rows a DFlash drafter's step reads cross,
              [n, V/tp]: the logit_rows of a real DFlash drafter's OnlineDraftTrainer, fixed budget,
              step 1, for this micro batch's RolloutRows as MegatronPolicyWorker._draft_rows builds
              them; --block-size 16, the DFlash default, and --anchors-per-seq 4, draft.dflash's
              default; tap_layers null: [0, 1] of the 2 layers). Both handoff arms hand over in the
              log-prob recomputation (where the drafter co-trains) and in the training step (where
              the backward's recomputation of a chunk must not copy again); the drafter itself is
              left out
    measured  peak tensor memory above the level before the call (the PyTorch profiler's allocation
              events: independent of the allocator's caching) and seconds, for the log-prob
              recomputation (no grad) and the training step (forward + backward + optimizer)

All arms run in one trainer (world size 1, in this process): the key is read at every call, so
rounds alternate the arms on the same batch (the order rotated each round; the weights move at lr
1e-6 only), after one unrecorded warm-up step (Adam's state is created on the first); medians
with [min, max] over ``--rounds``. Checked (the last round's log-prob calls): the chunked log-probs
equal the whole arm's (``logprobs_max_abs_diff``), the handoff and compact arms' the chunked arm's
(``handoff_logprobs_max_abs_diff``, ``compact_logprobs_max_abs_diff``), and the compact buffer equals
the handoff arm's whole logits at its rows (``compact_rows_max_abs_diff``). JSON to ``--out``, a PNG
beside it.

    python bench/logprob_chunks.py                                    # 151,936 vocabulary, 2048 tokens, 3 rounds
    python bench/logprob_chunks.py --quick                            # 8,192 vocabulary, 512 tokens, chunks of 64,
                                                                      # DFlash blocks of 8, 2 anchors a sequence
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

from bench.measure import peak_allocated_mib  # noqa: E402


def write_model(path: Path, vocab: int, hidden: int = 256, layers: int = 2) -> Path:
    """A random-init Qwen3 checkpoint of ``vocab`` tokens at ``path`` (kept if it is already there)."""
    if (path / "config.json").exists():
        return path
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return path


def make_batch(tokens: int, vocab: int, seqs: int = 8, seed: int = 0):
    """``seqs`` sequences of about tokens / seqs positions (prompt 16, the rest response), random ids."""
    from cotrain.rl.batch import build_batch
    from cotrain.rl.interfaces import Sample

    g = torch.Generator().manual_seed(seed)
    n = tokens // seqs
    samples = [Sample(prompt_index=i, prompt_token_ids=torch.randint(2, vocab, (16,), generator=g).tolist(),
                      token_ids=torch.randint(2, vocab, (n - 15,), generator=g).tolist(), logprobs=[-1.0] * (n - 15),
                      text="", finish_reason="stop", weight_version=0) for i in range(seqs)]
    return build_batch(samples, [1.0 if i % 2 else -1.0 for i in range(seqs)], pad_id=0)


def compact_rows(worker, batch, model_dir: Path, block_size: int, anchors_per_seq: int,
                 sweep: tuple[int, ...] = (2, 4, 8, 16)):
    """(micro, rows, logit_rows, drafter settings): the bench's one micro batch, its RolloutRows as the
    trainer builds them (``MegatronPolicyWorker._draft_rows``: packed, widths = the sequences' lengths
    at CP = 1) and the forward positions a DFlash drafter's step 1 reads there
    (``OnlineDraftTrainer.logit_rows``: its chains' target rows at the anchors the step draws; fixed
    budget, the default, so the compact handoff is on). The settings also hold the rows at the
    anchors_per_seq of ``sweep`` (same block size; counted, not measured)."""
    from cotrain.config.schema import DraftConfig
    from cotrain.draft.online import OnlineDraftTrainer
    from cotrain.draft.registry import TargetSpec, build_drafter

    micro = worker._micro_batches(batch)
    assert len(micro) == 1, f"the bench's batch should be one micro batch, got {len(micro)}"
    rows = worker._draft_rows(batch, micro)[0]
    # the checkpoint has no tokenizer: the mask token (read only by the drafter's forward) is named here
    target = TargetSpec.from_checkpoint(str(model_dir), mask_token_id=1)

    def step_rows(anchors: int):
        cfg = DraftConfig.model_validate({"kind": "dflash", "dflash": {"block_size": block_size,
                                                                        "anchors_per_seq": anchors}})
        assert cfg.budget.mode == "fixed"
        drafter = build_drafter("dflash", cfg.settings, target, seed=0)
        trainer = OnlineDraftTrainer(drafter, cfg, total_steps=10, seed=0)
        trainer.begin_step(1)
        need = trainer.logit_rows(rows)
        assert need is not None, "the compact handoff is off (OnlineDraftTrainer.logit_rows is None)"
        return need, drafter, cfg

    logit_rows, drafter, cfg = step_rows(anchors_per_seq)
    settings = {"kind": "dflash", "block_size": block_size, "anchors_per_seq": anchors_per_seq,
                "draft_width": drafter.draft_width, "tap_layers": list(drafter.tap_layers), "budget": cfg.budget.mode,
                "step": 1, "rows_at_anchors_per_seq": {a: int(step_rows(a)[0].numel()) for a in sweep}}
    return micro[0], rows, logit_rows, settings


def run(args) -> dict:
    from cotrain.config import load_config
    from cotrain.distributed import find_free_port
    from cotrain.rl.trainer import MegatronPolicyWorker

    model = write_model(Path(args.model_dir), args.vocab)
    base = [f"policy.model_path={model}", f"policy.max_seq_len={args.tokens}", "policy.micro_batch_size=1",
            f"policy.max_tokens_per_microbatch={args.tokens}", "rollout.sampling.max_tokens=8",
            "policy.reference_model=false", "grpo.kl_coef=0", "grpo.prompts_per_step=1", "grpo.group_size=8",
            "draft.kind=null", "rollout.speculative.method=null", "policy.optimizer.lr=1e-6"]
    chunk = [] if args.chunk is None else [f"policy.logprob_chunk_tokens={args.chunk}"]
    cfgs = {"chunked": load_config(ROOT / "configs/grpo.yaml", base + chunk),
            "whole": load_config(ROOT / "configs/grpo.yaml", base + ["policy.logprob_chunk_tokens=0"])}
    cfgs["handoff"] = cfgs["compact"] = cfgs["chunked"]
    worker = MegatronPolicyWorker(cfgs["chunked"], str(model), 0, 1, "127.0.0.1", find_free_port())
    held: list = []  # the handoff arms' logits, kept until the call ends (as the drafter keeps them)
    token_logprobs = worker._token_logprobs
    batch = make_batch(args.tokens, args.vocab)
    micro, rows, logit_rows, draft = compact_rows(worker, batch, model, args.block_size, args.anchors_per_seq)
    chunk_pos = worker._chunk_positions(1, args.vocab)  # the chunked arms' positions per chunk (packed: one row)
    per_chunk = torch.bincount(logit_rows.cpu() // chunk_pos, minlength=-(-micro.width // chunk_pos)).tolist()

    def with_handoff(model, mb, on_logits=None, logit_rows=None):
        return token_logprobs(model, mb, held.append)

    def with_compact(model, mb, on_logits=None, logit_rows_=None):
        assert torch.equal(mb.rows, micro.rows) and mb.width == micro.width  # the micro batch of ``rows``
        return token_logprobs(model, mb, held.append, logit_rows.to(mb.inputs.device))
    wrap = {"handoff": with_handoff, "compact": with_compact}
    arms = list(cfgs)
    lps = {}
    out = {a: {"logprobs_mib": [], "train_mib": [], "logprobs_s": [], "train_s": []} for a in arms}
    kept = {}
    try:
        from tqdm import tqdm

        # one unrecorded call of each first: the optimizer's state is created on the first step
        batch.old_logprobs = worker.logprobs(batch)["logprobs"]
        worker.train_step(batch)

        for r in tqdm(range(args.rounds), desc="rounds"):
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            for arm in order:  # every arm's log-probs on the same weights, then every arm's step
                worker.cfg = cfgs[arm]
                worker._token_logprobs = wrap.get(arm, token_logprobs)
                t0 = time.perf_counter()
                res = {}
                out[arm]["logprobs_mib"].append(peak_allocated_mib(lambda: res.update(lp=worker.logprobs(batch))))
                out[arm]["logprobs_s"].append(time.perf_counter() - t0)
                worker._token_logprobs = token_logprobs
                lps[arm] = res["lp"]["logprobs"]
                if arm in wrap:  # what crossed: the whole micro batch's [1, T, V], or the compact [n, V]
                    (buf,) = held
                    kept[arm] = buf.reshape(-1, buf.shape[-1])[logit_rows.to(buf.device)] if arm == "handoff" else buf.clone()
                    kept[arm + "_shape"] = list(buf.shape)
                held.clear()
            batch.old_logprobs = lps["whole"]
            for arm in order:
                worker.cfg = cfgs[arm]
                worker._token_logprobs = wrap.get(arm, token_logprobs)
                t0 = time.perf_counter()
                out[arm]["train_mib"].append(peak_allocated_mib(lambda: worker.train_step(batch)))
                out[arm]["train_s"].append(time.perf_counter() - t0)
                worker._token_logprobs = token_logprobs
                held.clear()
    finally:
        worker.shutdown()
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    summary = {}
    for arm in arms:
        summary[arm] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in out[arm].items()}
    summary["train_memory_ratio"] = statistics.median(
        c / w for c, w in zip(out["chunked"]["train_mib"], out["whole"]["train_mib"]))
    for arm in wrap:  # the handoff's price above the chunked arm, in the training step and the log-prob call
        summary[f"{arm}_extra_mib"] = statistics.median(
            h - c for h, c in zip(out[arm]["train_mib"], out["chunked"]["train_mib"]))
        summary[f"{arm}_logprobs_extra_mib"] = statistics.median(
            h - c for h, c in zip(out[arm]["logprobs_mib"], out["chunked"]["logprobs_mib"]))
        summary[f"{arm}_logprobs_max_abs_diff"] = (lps[arm] - lps["chunked"]).abs().max().item()
    summary["logprobs_max_abs_diff"] = (lps["chunked"] - lps["whole"]).abs().max().item()  # the last round's
    summary["compact_rows_max_abs_diff"] = (kept["compact"] - kept["handoff"]).abs().max().item()
    positions = int(rows.row_widths().sum())
    n = int(logit_rows.numel())
    return {"vocab": args.vocab, "tokens": args.tokens, "rounds": args.rounds, "chunk": args.chunk,
            "one_logits_copy_mib": logits_mib,
            "compact": {"drafter": draft, "sequences": len(rows), "positions": positions,
                        "real_positions": int(rows.lengths.sum()), "rows": n, "row_share": n / positions,
                        "rows_copy_mib": n * args.vocab * 4 / 2**20, "chunk_positions": chunk_pos,
                        "rows_per_chunk": per_chunk,
                        "handed_shape": {"handoff": kept["handoff_shape"], "compact": kept["compact_shape"]}},
            "note": "peak tensor memory above the level before the call (MiB), PyTorch profiler allocation events",
            "per_round": out, "summary": summary}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    keys = [("logprobs_mib", "log-probs (no grad)"), ("train_mib", "train step")]
    arms = [a for a in ("whole", "chunked", "handoff", "compact") if a in res["summary"]]
    w = 0.8 / len(arms)
    c = res.get("compact")
    labels = {"handoff": "handoff (whole logits)",
              "compact": f"compact ({c['rows']} of {c['positions']} rows)" if c else "compact"}
    for i, arm in enumerate(arms):
        s = res["summary"][arm]
        med = [s[k]["median"] for k, _ in keys]
        err = [[m - s[k]["min"] for (k, _), m in zip(keys, med)], [s[k]["max"] - m for (k, _), m in zip(keys, med)]]
        ax.bar([j + w * i for j in range(len(keys))], med, w, yerr=err, label=labels.get(arm, arm))
    ax.axhline(res["one_logits_copy_mib"], color="gray", ls="--", lw=1, label="one [tokens, V] fp32 copy")
    ax.set_xticks([j + w * (len(arms) - 1) / 2 for j in range(len(keys))], [lbl for _, lbl in keys])
    top = max(res["summary"][a][k]["max"] for a in arms for k, _ in keys)
    ax.set_ylim(0, 1.4 * top)  # room for the legend above the bars
    ax.set_ylabel("peak tensor memory (MiB)")
    ax.set_title(f"log-probs at V = {res['vocab']:,}, {res['tokens']} tokens")
    ax.legend(fontsize=8, ncol=2, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None, help="the chunked arm's policy.logprob_chunk_tokens "
                    "(default: null, the trainer's auto rule)")
    ap.add_argument("--block-size", type=int, default=16, help="the compact arm's DFlash block_size (default 16: "
                    "draft.dflash's default, the block DFlash trains and serves)")
    ap.add_argument("--anchors-per-seq", type=int, default=4, help="the compact arm's DFlash anchors_per_seq "
                    "(default 4: draft.dflash's default)")
    ap.add_argument("--model-dir", default=None, help="where the random-init checkpoint is written (default: "
                    "runs/bench_logprob_chunks/model-<vocab>)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/logprob_chunks.json"))
    ap.add_argument("--quick", action="store_true", help="8,192 vocabulary, 512 tokens, chunks of 64, 1 round, "
                    "DFlash blocks of 8 and 2 anchors a sequence (of 64 positions)")
    args = ap.parse_args(argv)
    if args.quick:
        args.vocab, args.tokens, args.rounds, args.chunk = 8192, 512, 1, 64
        args.block_size, args.anchors_per_seq = 8, 2
    args.model_dir = args.model_dir or str(ROOT / f"runs/bench_logprob_chunks/model-{args.vocab}")
    res = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    plot(res, out.with_suffix(".png"))
    s = res["summary"]
    print(f"V={args.vocab} tokens={args.tokens}: train step peak {s['whole']['train_mib']['median']:.0f} MiB whole, "
          f"{s['chunked']['train_mib']['median']:.0f} MiB chunked (x{s['train_memory_ratio']:.2f}), +"
          f"{s['handoff_extra_mib']:.0f} MiB with the drafter's handoff of the whole logits, +"
          f"{s['compact_extra_mib']:.0f} MiB with the compact handoff ({res['compact']['rows']} of "
          f"{res['compact']['positions']} rows); one logits copy {res['one_logits_copy_mib']:.0f} MiB -> {out}")
    return res


if __name__ == "__main__":
    main()
