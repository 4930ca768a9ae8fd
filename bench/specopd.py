"""Benchmark: SpecOPD offline on the tiny built-in target - acceptance of three training
objectives in vLLM, and supervised tokens per second against a sequential on-policy baseline.

Part 1, acceptance. Per seed, one DFlash drafter (block ``--k`` + 1, so that it drafts the paper's
k = 7 tokens) is built from the seed and warm-started by ``--warm-steps`` teacher-forced soft-CE
steps (the common init); three copies of it then train ``--steps`` more steps, one per objective:

    offpolicy_ce       draft.branches=teacher_forced, draft.loss=soft_ce (the distill config's CE)
    offpolicy_e2e_tv   draft.branches=teacher_forced, draft.loss=e2e_tv
    onpolicy_e2e_tv    draft.branches=on_policy (SpecOPD), draft.loss=e2e_tv

with the same optimizer schedule, the same sequences at every step (their own generator, seeded
by the seed) and the same anchors (every step's anchors and branch draws come from a generator
seeded by (seed, step), and both paths draw the anchors first). The steps are the distill
command's own ``cotrain.draft.distill.train_step``. Every trained drafter is pushed into ONE
in-process vLLM engine (``cotrain.rl.vllm``: engine, runtime draft push) that serves the held-out
prompts greedily (temperature 0, stop at EOS, max 16 tokens: exactly the offline estimate's walk)
and at temperature 1 (``--t1-samples`` seeded samples per prompt). vLLM's per-request
``per_step_accepted`` lists (``per_request_spec_decode_metrics="detailed"``) are kept raw in the
JSON; acceptance length = 1 + accepted / rounds (the bonus token included, as the paper counts)
and prefix survival s_j = fraction of rounds whose first j drafts were all accepted (j = 1..k),
both from vLLM's counts. The offline estimate (cotrain.draft.acceptance, greedy) is stored beside.

Part 2, supervised tokens per second. One drafter (seed 0's warm start), two copies, one per arm,
each with its own AdamW; per repeat the same ``--tput-seqs`` training sequences for both:

    specopd     ``train_step(..., branches="on_policy")``: seeded anchors (``anchors_per_seq`` per
                sequence) on the reference stems, one drafter call samples every branch, one
                tree-masked target forward scores them, E2E-TV, backward, AdamW. The stems' taps
                come precomputed (the offline reference preparation, excluded as in the paper).
    draft_opd   the sequential baseline (:func:`draft_opd_rollout`): the target prefills the same
                sequences' prompts (KV cache), then ``anchors_per_seq`` rounds as in serving -
                the drafter proposes W tokens for every sequence (one batched call, no autograd),
                the target verifies [bonus, drafts] in one batched forward on its KV cache
                (rejection sampling at temperature 1), accepted tokens and the new bonus are
                committed, rejected slots are masked out of the cache - then ONE batched drafter
                call with autograd re-scores every round's drafts on the final sequences (identical
                logits: DFlash's context is the committed prefix, which later rounds only extend),
                E2E-TV against the verification forwards' distributions, backward, AdamW.

    draft_opd_long  the same baseline with longer rollouts: N x anchors_per_seq / ``--tput-long-rounds``
                sequences (the first of the same ones), ``--tput-long-rounds`` rounds each.

All arms supervise exactly N x anchors_per_seq x W drafted positions per update (the same loss, the
same temperature 1; no EOS rule in this part, so that a drafted EOS does not drop positions from
either count - the distillation data supervises the target's tail after EOS too). The arms run back to back within each repeat (order rotated every repeat),
after ``--tput-warmup`` untimed repeats; the JSON keeps every repeat's time and supervised-position
count and the baseline's per-round phase times.

    python bench/specopd.py            # full CPU run (about 15-20 minutes on the shared 2-core machine)
    python bench/specopd.py --quick    # the test's size (tests/draft/test_specopd_bench.py)
    python bench/specopd.py --report bench/results/specopd.json   # markdown tables + PNG from a JSON
    python bench/specopd.py --grid --target tiny   # family x objective grid, offline (bench/specopd_grid.py)
    python bench/specopd.py --report bench/results/specopd-tiny.json   # its tables + docs/img/specopd-tiny.png

Outputs: ``--out`` (default bench/results/specopd.json; -quick for --quick) and the figure
(``--png``, default docs/img/specopd.png for full runs, beside the JSON for --quick).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.paths import recorded, recorded_args  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ARMS = {  # name -> (draft.branches, draft.loss)
    "offpolicy_ce": ("teacher_forced", "soft_ce"),
    "offpolicy_e2e_tv": ("teacher_forced", "e2e_tv"),
    "onpolicy_e2e_tv": ("on_policy", "e2e_tv"),
    "onpolicy_e2e_tv_greedy": ("on_policy_greedy", "e2e_tv"),  # ablation: branches drafted greedily, as vLLM drafts
}
ON_POLICY = ("onpolicy_e2e_tv", "onpolicy_e2e_tv_greedy")
ARM_NAMES = {"offpolicy_ce": "off-policy CE", "offpolicy_e2e_tv": "off-policy E2E-TV",
             "onpolicy_e2e_tv": "on-policy E2E-TV (SpecOPD)",
             "onpolicy_e2e_tv_greedy": "on-policy E2E-TV, greedy branches (ablation)"}
PAPER = {"k": 7, "gain_vs_offpolicy_ce_pct": 6.96, "gain_vs_offpolicy_e2e_tv_pct": 15.71,
         "supervised_tokens_per_s_x": 16.09, "update_throughput_x": 4.95, "tokens_per_update_x": 3.25}
KINDS = ("dflash", "dspark")
PRESETS = {
    "default": dict(seeds=[0, 1, 2, 3, 4], warm_steps=300, steps=300, batch_size=32, train_prompts=1000,
                    eval_prompts=200, t1_samples=4, tput_seqs=32, tput_repeats=25, tput_warmup=2, tput_long_rounds=16),
    "quick": dict(seeds=[0, 1], warm_steps=4, steps=4, batch_size=8, train_prompts=48, eval_prompts=24,
                  t1_samples=2, tput_seqs=6, tput_repeats=2, tput_warmup=1, tput_long_rounds=8),
}


# ------------------------------------------------------------------------------ block / k checks
def resolve_block(kind: str, k: int, block_size: Optional[int] = None, tail_tokens: Optional[int] = None
                  ) -> tuple[int, int]:
    """(block_size, k) for ``kind`` drafting ``k`` tokens; ValueError with the fix otherwise.

    DFlash drafts block_size - 1 tokens (the bonus token fills the block's first slot), DSpark
    block_size. ``block_size`` None = the smallest block that drafts k. ``tail_tokens``: the
    distillation data's greedy continuation after EOS, which must cover k (vLLM counts drafts
    accepted past EOS; with a shorter tail the offline estimate cannot see them)."""
    if kind not in KINDS:
        raise ValueError(f"--kind {kind!r}: SpecOPD's on-policy branches are built for block drafters "
                         f"({', '.join(KINDS)})")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"--k {k!r}: the number of draft tokens must be an integer >= 1 (the paper uses {PAPER['k']})")
    per_block = (lambda b: b - 1) if kind == "dflash" else (lambda b: b)
    if block_size is None:
        block_size = k + 1 if kind == "dflash" else k
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"--block-size {block_size!r}: a {kind} block has at least 2 positions")
    if per_block(block_size) < k:
        rule = "block_size - 1" if kind == "dflash" else "block_size"
        raise ValueError(f"--k {k} with --block-size {block_size}: a {kind} block of {block_size} drafts at most "
                         f"{per_block(block_size)} tokens ({rule}); use --block-size "
                         f"{k + 1 if kind == 'dflash' else k} or --k <= {per_block(block_size)}")
    if tail_tokens is not None and tail_tokens < k:
        raise ValueError(f"--k {k}: the data keeps only {tail_tokens} tokens of the target's continuation after EOS "
                         f"(data.tail_tokens), fewer than the drafts a round can have accepted past it; "
                         f"set data.tail_tokens >= {k}")
    return block_size, k


# ------------------------------------------------------------------------------ statistics
def spread(xs: list[float]) -> dict:
    xs = [float(x) for x in xs]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def acceptance_from_rounds(per_request: list[list[int]], k: int) -> dict:
    """Acceptance length and prefix survival from vLLM's per-round accepted counts."""
    rounds = [m for req in per_request for m in req]
    n = len(rounds)
    if n == 0:
        return {"acceptance_len": float("nan"), "survival": [float("nan")] * k, "rounds": 0, "accepted": 0}
    return {"acceptance_len": 1.0 + sum(rounds) / n,
            "survival": [sum(m >= j for m in rounds) / n for j in range(1, k + 1)],
            "rounds": n, "accepted": sum(rounds)}


def state_hash(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------ Draft-OPD baseline
class _TapHooks:
    """Forward hooks capturing the tap layers' outputs (the cotrain convention: output of decoder
    layer i; cotrain.draft.taps.compute_taps does the same on whole sequences)."""

    def __init__(self, model, layers):
        self.layers = sorted(int(i) for i in layers)
        self.model = model
        self.captured: dict[int, torch.Tensor] = {}

    def __enter__(self):
        self.hooks = [self.model.model.layers[i].register_forward_hook(
            lambda mod, args, out, i=i: self.captured.__setitem__(i, out[0] if isinstance(out, tuple) else out))
            for i in self.layers]
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()

    def taps(self) -> torch.Tensor:
        return torch.cat([self.captured[i].float() for i in self.layers], dim=-1)


def _draw(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    probs = F.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).view(probs.shape[:-1])


@dataclass
class Rollout:
    """What a Draft-OPD rollout collected.

    sequences  committed tokens per sequence (prompt + every accepted draft and bonus token).
    rounds     per round and sequence: {"seq", "anchor" (in-sequence position of the bonus token
               the round drafted after), "tokens" (the W drafts), "accepted", "bonus" (the token
               the target committed after the accepted drafts)}.
    anchors    (NR,) in-sequence anchor positions, round-major (round r, sequence i -> r * N + i).
    tokens     (NR, W) the drafts; p (NR, W, V) the target's distributions at the drafted
               positions (temperature 1) from the verification forwards; valid (NR, W) (false
               after a drafted EOS, the SpecOPD rule); logits (NR, W, V) the drafter's logits
               during the rollout (no graph).
    taps       packed taps of the final sequences (the cache's committed columns; a zero row for
               each sequence's last token, the bonus never fed to the target).
    times      per round {"draft_s", "verify_s"} and "prefill_s".
    """

    sequences: list
    rounds: list
    anchors: torch.Tensor
    tokens: torch.Tensor
    p: torch.Tensor
    valid: torch.Tensor
    logits: torch.Tensor
    taps: torch.Tensor
    times: dict = field(default_factory=dict)


def _context_batch(sequences: list[list[int]], taps_rows: list[torch.Tensor], tap_dim: int):
    """A DraftBatch of the committed sequences: taps for every processed token, a zero row for the
    last (the bonus token, never part of a block's context: DFlash's context is exclusive)."""
    from cotrain.draft.common import DraftBatch

    ids, taps, lens = [], [], []
    for seq, rows in zip(sequences, taps_rows):
        if rows.shape[0] != len(seq) - 1:
            raise RuntimeError(f"{rows.shape[0]} tap rows for a sequence of {len(seq)} tokens (expected one fewer)")
        ids += seq
        taps += [rows, torch.zeros(1, tap_dim)]
        lens.append(len(seq))
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lens), 0)])
    return DraftBatch(torch.tensor(ids, dtype=torch.int64), cu, torch.cat(taps)), cu


@torch.no_grad()
def draft_opd_rollout(drafter, model, prompts: list[list[int]], rounds: int, temperature: float = 1.0,
                      generator: Optional[torch.Generator] = None, eos_token_id: Optional[int] = None) -> Rollout:
    """Sequential on-policy rollout (Draft-OPD) as a speculative-decoding server runs it, batched
    over the prompts: target prefill (KV cache), then ``rounds`` rounds of [drafter proposes W
    tokens after the bonus token, the target verifies bonus + drafts in one cached forward, the
    accepted drafts and the next bonus token are committed]. Temperature 0: greedy drafts and
    verification; > 0: drafts sampled from softmax(q / T), standard speculative rejection sampling
    (accept y_j with probability min(1, p_j(y_j) / q_j(y_j)), on rejection the bonus token from
    the residual max(p_j - q_j, 0), after W acceptances from p_{W+1}). The rollout continues past
    EOS (like the distillation data's tails and vLLM's ignore_eos) so that every sequence runs
    every round. KV cache: one column block of W + 1 per round for all sequences; columns of
    rejected drafts are masked out (attention mask), never recomputed. The drafter has no KV
    cache: its context projection (fc and per-layer K/V of the committed tokens' taps, no decoder
    layer) is recomputed in each round's call, as in the drafter's training forward."""
    from transformers import DynamicCache

    from cotrain.draft.specopd import sample_branches

    was_training = drafter.training
    drafter.eval()
    N = len(prompts)
    P = max(len(p) for p in prompts)
    pad = int(getattr(model.config, "pad_token_id", None) or 0)
    ids = torch.full((N, P), pad, dtype=torch.int64)
    mask = torch.zeros(N, P, dtype=torch.int64)
    for i, p in enumerate(prompts):  # left padding: every prompt ends in the last column
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    hooks = _TapHooks(model, drafter.tap_layers)
    cache = DynamicCache()
    times: dict = {"rounds": []}
    t0 = time.perf_counter()
    with hooks:
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                    past_key_values=cache, use_cache=True)
        taps_cols = hooks.taps()  # (N, columns, D), aligned with the KV cache's columns
        bonus = _draw(out.logits[:, -1], temperature, generator)
    times["prefill_s"] = time.perf_counter() - t0
    D = taps_cols.shape[-1]
    seqs = [list(p) + [int(b)] for p, b in zip(prompts, bonus)]
    rec_rounds, anchors, toks, ps, valids, qlogits = [], [], [], [], [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        keep = mask.bool()
        batch, cu = _context_batch(seqs, [taps_cols[i][keep[i]] for i in range(N)], D)
        layout = drafter.build_layout(batch, anchors=cu[1:] - 1)  # the bonus token: the last one
        br = sample_branches(drafter, batch, layout, generator, temperature, eos_token_id=eos_token_id)
        y, W = br.tokens, br.width
        t1 = time.perf_counter()
        a = torch.tensor([len(s) - 1 for s in seqs])  # in-sequence position of the bonus token
        inp = torch.cat([bonus[:, None], y], 1)  # (N, W + 1) at positions a .. a + W
        mask = torch.cat([mask, torch.ones(N, W + 1, dtype=torch.int64)], 1)
        with hooks:
            out = model(input_ids=inp, attention_mask=mask, position_ids=a[:, None] + torch.arange(W + 1)[None],
                        past_key_values=cache, use_cache=True)
            taps_cols = torch.cat([taps_cols, hooks.taps()], 1)
        logits = out.logits.float()  # row j: the target's distribution of the token at a + j + 1
        if temperature == 0:
            ok = y == logits[:, :W].argmax(-1)
        else:
            pt = F.softmax(logits / temperature, -1)
            qt = F.softmax(br.logits.float() / temperature, -1)
            py, qy = pt[:, :W].gather(-1, y[..., None])[..., 0], qt.gather(-1, y[..., None])[..., 0]
            u = torch.rand(N, W, generator=generator)
            ok = u * qy < py  # u < min(1, p / q)
        m = torch.cumprod(ok.to(torch.int64), 1).sum(1)  # accepted drafts per sequence
        new_bonus = torch.empty(N, dtype=torch.int64)
        for i in range(N):
            mi = int(m[i])
            if temperature == 0 or mi == W:
                new_bonus[i] = _draw(logits[i, mi], temperature, generator)
            else:  # the residual distribution at the first rejected position
                res = (pt[i, mi] - qt[i, mi]).clamp(min=0)
                new_bonus[i] = torch.multinomial(res / res.sum(), 1, generator=generator)[0]
            mask[i, mask.shape[1] - W + mi:] = 0  # the rejected drafts' columns leave the cache
            rec_rounds.append({"round": r, "seq": i, "anchor": int(a[i]), "tokens": y[i].tolist(), "accepted": mi,
                               "bonus": int(new_bonus[i])})
            seqs[i] += y[i, :mi].tolist() + [int(new_bonus[i])]
        anchors.append(a)
        toks.append(y)
        ps.append(F.softmax(logits[:, :W], -1))
        valids.append(br.valid)
        qlogits.append(br.logits.float())
        bonus = new_bonus
        times["rounds"].append({"draft_s": t1 - t0, "verify_s": time.perf_counter() - t1})
    drafter.train(was_training)
    keep = mask.bool()
    final, _ = _context_batch(seqs, [taps_cols[i][keep[i]] for i in range(N)], D)
    return Rollout(sequences=seqs, rounds=rec_rounds, anchors=torch.cat(anchors), tokens=torch.cat(toks),
                   p=torch.cat(ps), valid=torch.cat(valids), logits=torch.cat(qlogits), taps=final.taps, times=times)


def draft_opd_loss(drafter, ro: Rollout, prompts_n: int, loss: str = "e2e_tv"):
    """The baseline's loss: ONE drafter call with autograd re-scores every round's drafts at their
    anchors on the final committed sequences (``sample_branches(tokens=...)``), then the loss
    (E2E-TV) against the verification forwards' target distributions. Returns (loss, metrics,
    branches): branches.anchors are packed positions in the final sequences, round-major."""
    from cotrain.draft.common import DraftBatch
    from cotrain.draft.specopd import sample_branches, specopd_loss

    lens = [len(s) for s in ro.sequences]
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lens), 0)])
    batch = DraftBatch(torch.tensor([t for s in ro.sequences for t in s], dtype=torch.int64), cu, ro.taps)
    seq = torch.arange(ro.anchors.numel()) % prompts_n
    anchors = cu[seq] + ro.anchors
    order = torch.argsort(anchors)  # layouts keep anchors sorted; undo afterwards
    layout = drafter.build_layout(batch, anchors=anchors[order])
    br = sample_branches(drafter, batch, layout, tokens=ro.tokens[order])
    inv = torch.argsort(order)
    br.anchors, br.tokens, br.logits = br.anchors[inv], br.tokens[inv], br.logits[inv]
    br.valid = ro.valid
    value, metrics = specopd_loss(br, ro.p, loss, drafter.cfg.loss_gamma)
    return value, metrics, br


def draft_opd_step(drafter, model, prompts: list[list[int]], rounds: int, optimizer, clip: float,
                   temperature: float = 1.0, generator=None, eos_token_id=None, loss: str = "e2e_tv") -> dict:
    """One Draft-OPD update: rollout, re-score with autograd, loss, backward, clip, AdamW."""
    from cotrain.draft.optim import clip_

    t0 = time.perf_counter()
    ro = draft_opd_rollout(drafter, model, prompts, rounds, temperature, generator, eos_token_id)
    t1 = time.perf_counter()
    value, metrics, _ = draft_opd_loss(drafter, ro, len(prompts), loss)
    optimizer.zero_grad(set_to_none=True)
    value.backward()
    clip_([q for q in drafter.parameters() if q.grad is not None], clip)
    optimizer.step()
    return {"rollout_s": t1 - t0, "update_s": time.perf_counter() - t1, "prefill_s": ro.times["prefill_s"],
            "draft_s": sum(x["draft_s"] for x in ro.times["rounds"]),
            "verify_s": sum(x["verify_s"] for x in ro.times["rounds"]),
            "supervised": int(ro.valid.sum()), "nominal": int(ro.valid.numel()),
            "accepted": [x["accepted"] for x in ro.rounds], "loss": float(value.detach())}


# ------------------------------------------------------------------------------ part 1: training
def step_generator(seed: int, step: int) -> torch.Generator:
    """Anchors and branch draws of one step: the same anchors for every arm (both training paths
    draw them first from this generator)."""
    return torch.Generator().manual_seed(1_000_003 * (seed + 1) + step)


def train_arm(drafter, train, cfg, branches: str, loss: str, steps: int, seed: int, model, eos_token_id,
              batch_size: int) -> dict:
    """``steps`` optimizer steps of the distill command's ``train_step`` with a fresh AdamW and the
    config's schedule; sequences from a generator seeded by ``seed`` alone (identical across arms)."""
    from cotrain.draft.distill import loss_extra, train_step
    from cotrain.draft.common import select_sequences
    from cotrain.draft.optim import lr_at, make_optimizer, set_lr

    opt_cfg = cfg.draft.optimizer
    start_sha = state_hash(drafter)
    optimizer = make_optimizer(drafter, opt_cfg)
    order = torch.Generator().manual_seed(seed)
    h = hashlib.sha256()
    losses, times = [], []
    drafter.train()
    for step in range(steps):
        set_lr(optimizer, lr_at(step, steps, opt_cfg))
        seqs = torch.randint(0, train.num_seqs, (batch_size,), generator=order)
        h.update(seqs.numpy().tobytes())
        t0 = time.perf_counter()
        batch, g = select_sequences(train, seqs), step_generator(seed, step)
        if branches == "on_policy_greedy":  # SpecOPD's step with temperature-0 branches (not a distill option)
            m = specopd_update(drafter, model, batch, optimizer, opt_cfg.clip_grad, g, eos_token_id, loss,
                               temperature=0.0)
        else:
            m = train_step(drafter, batch, loss, optimizer, opt_cfg.clip_grad, g, loss_extra(cfg), branches, model,
                           eos_token_id)
        times.append(time.perf_counter() - t0)
        losses.append(m["loss"])
    drafter.eval()
    return {"steps": steps, "batches_sha": h.hexdigest()[:16], "start_sha": start_sha, "final_sha": state_hash(drafter), "loss_first": losses[0] if losses else None,
            "loss_last10": statistics.fmean(losses[-10:]) if losses else None,
            "step_s": spread(times) if times else None}


def vllm_rounds(llm, prompts: list[str], temperature: float, samples: int, seed: int,
                max_tokens: int = 16) -> tuple[list, list]:
    """(per-request per-round accepted counts, per-request token ids) of one generate call.

    At temperature > 0 prompt i's j-th sample has the seed ``seed + i * samples + j`` (vLLM seeds
    the j-th of n samples with the request's seed + j), as cotrain's rollouts do: independent draws
    across prompts, the same draws for every drafter served. (One seed for every prompt, as before
    2026-12-06, drew every prompt's j-th sample from one random stream: correlated across prompts.)"""
    from vllm import SamplingParams

    if temperature == 0:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    else:
        params = [SamplingParams(temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_tokens, n=samples,
                                 seed=seed + i * samples) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    rounds, tokens = [], []
    for o in outs:
        for c in o.outputs:
            m = c.spec_decode_metrics
            d = m.to_dict() if hasattr(m, "to_dict") else dict(m or {})
            rounds.append(list(d.get("per_step_accepted", [])))
            tokens.append(list(c.token_ids))
            if d.get("per_step_drafted") and set(d["per_step_drafted"]) - {llm_k(llm)}:
                raise RuntimeError(f"vLLM drafted {sorted(set(d['per_step_drafted']))} tokens in some rounds, "
                                   f"expected {llm_k(llm)}")
    return rounds, tokens


def llm_k(llm) -> int:
    return int(llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens)


# ------------------------------------------------------------------------------ part 2: throughput
def specopd_update(drafter, model, batch, optimizer, clip: float, generator, eos_token_id, loss: str = "e2e_tv",
                   temperature: float = 1.0) -> dict:
    """One SpecOPD update, as the distill command's ``train_step(branches="on_policy")`` runs it
    (specopd_step, backward, clip, AdamW), returning the branches' supervised-position counts."""
    from cotrain.draft.optim import clip_
    from cotrain.draft.specopd import specopd_step

    value, metrics, br = specopd_step(drafter, model, batch, generator, temperature=temperature, loss=loss,
                                      eos_token_id=eos_token_id)
    optimizer.zero_grad(set_to_none=True)
    value.backward()
    clip_([q for q in drafter.parameters() if q.grad is not None], clip)
    optimizer.step()
    return {"supervised": int(br.valid.sum()), "nominal": int(br.valid.numel()), "branches": int(br.tokens.shape[0]),
            "loss": float(value.detach())}


TPUT_ARMS = ("specopd", "draft_opd", "draft_opd_long")


def throughput_plan(seqs: int, anchors: int, long_rounds: int) -> dict:
    """Sequences and rounds (anchors) per update of each arm: every arm supervises
    seqs x anchors x W positions. draft_opd: the same sequences, one round per SpecOPD anchor;
    draft_opd_long: fewer sequences, ``long_rounds`` rounds each (longer sequential rollouts)."""
    if long_rounds < 1 or (seqs * anchors) % long_rounds:
        raise ValueError(f"--tput-long-rounds {long_rounds}: must divide --tput-seqs x anchors_per_seq = "
                         f"{seqs} x {anchors} = {seqs * anchors} so that every arm supervises the same positions")
    return {"specopd": (seqs, anchors), "draft_opd": (seqs, anchors),
            "draft_opd_long": (seqs * anchors // long_rounds, long_rounds)}


def throughput(drafter0, model, train, records, cfg, a, eos_token_id) -> dict:
    """SpecOPD's update vs Draft-OPD's, interleaved repeat by repeat (the arms' order rotated each
    repeat). Every arm starts from ``drafter0`` with its own AdamW (at the schedule's final rate)."""
    from cotrain.draft.common import select_sequences
    from cotrain.draft.optim import make_optimizer, set_lr

    opt_cfg = cfg.draft.optimizer
    A = int(drafter0.cfg.anchors_per_seq)
    plan = throughput_plan(a.tput_seqs, A, a.tput_long_rounds)
    arms = {name: copy.deepcopy(drafter0).train() for name in TPUT_ARMS}
    opts = {name: make_optimizer(d, opt_cfg) for name, d in arms.items()}
    for o in opts.values():
        set_lr(o, opt_cfg.min_lr)
    W = drafter0.draft_width
    pick = torch.Generator().manual_seed(12345)
    out = {name: [] for name in TPUT_ARMS}
    out.update(order=[], loadavg=[])
    for rep in range(-a.tput_warmup, a.tput_repeats):
        seqs = torch.randperm(train.num_seqs, generator=pick)[:a.tput_seqs]
        shift = rep % len(TPUT_ARMS)
        order = list(TPUT_ARMS[shift:] + TPUT_ARMS[:shift])
        for name in order:
            d, g = arms[name], torch.Generator().manual_seed(777 + rep)
            n, rounds = plan[name]
            t0 = time.perf_counter()
            if name == "specopd":
                res = specopd_update(d, model, select_sequences(train, seqs), opts[name], opt_cfg.clip_grad, g,
                                     eos_token_id)
            else:
                prompts = [records[int(s)].prompt for s in seqs[:n]]
                res = draft_opd_step(d, model, prompts, rounds, opts[name], opt_cfg.clip_grad, 1.0, g, eos_token_id)
            res["seconds"] = time.perf_counter() - t0
            res["start"] = t0
            if rep >= 0:
                out[name].append(res)
        if rep >= 0:
            out["order"].append(order)
            out["loadavg"].append(os.getloadavg()[0])
    out["plan"] = {name: {"sequences": n, "rounds_or_anchors": r} for name, (n, r) in plan.items()}
    out["width"] = W
    return out


# ------------------------------------------------------------------------------ summary
TEMPS = ("0", "1")


def summarize(data: dict) -> dict:
    """Every reported number, recomputed from the raw per-round data in ``data``."""
    k = data["config"]["k"]
    seeds = [str(s) for s in data["config"]["seeds"]]
    out: dict = {"acceptance": {}, "gains_pct": {}, "throughput": {}}
    for T in TEMPS:
        per_arm = {}
        for arm, by_seed in data["acceptance"][T].items():
            vals = {s: acceptance_from_rounds(by_seed[s]["per_request_rounds"], k) for s in seeds}
            per_arm[arm] = {"acceptance_len": spread([vals[s]["acceptance_len"] for s in seeds]),
                            "survival": [spread([vals[s]["survival"][j] for s in seeds]) for j in range(k)],
                            "per_seed": {s: vals[s]["acceptance_len"] for s in seeds},
                            "rounds": sum(vals[s]["rounds"] for s in seeds)}
        out["acceptance"][T] = per_arm
        gains = {}
        for arm in ON_POLICY:
            if arm not in per_arm:
                continue
            on = per_arm[arm]
            for base in ("offpolicy_ce", "offpolicy_e2e_tv"):
                b = per_arm[base]
                paired = [100.0 * (on["per_seed"][s] / b["per_seed"][s] - 1.0) for s in seeds]
                gains.setdefault(arm, {})[base] = {
                    "of_medians": 100.0 * (on["acceptance_len"]["median"] / b["acceptance_len"]["median"] - 1.0),
                    "paired": spread(paired), "paired_per_seed": paired}
        out["gains_pct"][T] = gains
    tp = data["throughput"]
    per = {}
    for arm in TPUT_ARMS:
        per[arm] = [r["supervised"] / r["seconds"] for r in tp[arm]]
        out["throughput"][arm] = {"supervised_tokens_per_s": spread(per[arm]),
                                  "seconds": spread([r["seconds"] for r in tp[arm]]),
                                  "supervised": spread([r["supervised"] for r in tp[arm]])}
        if arm != "specopd":
            ratio = [x / y for x, y in zip(per["specopd"], per[arm])]
            out["throughput"][arm]["ratio_specopd_over"] = {**spread(ratio), "per_repeat": ratio}
            out["throughput"][arm]["phases_s"] = {ph: spread([r[ph] for r in tp[arm]])
                                                  for ph in ("prefill_s", "draft_s", "verify_s", "update_s")}
    return out


def _r(x: dict, fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(x['median'])} [{fmt.format(x['min'])}, {fmt.format(x['max'])}]"


def markdown(data: dict) -> str:
    c, s = data["config"], data["summary"]
    k = c["k"]
    lines = [f"Measured with `{c['command']}` on {c['device']} ({c['date']}, torch {c['torch']}, vLLM {c['vllm']}, "
             f"{c['cpu_count']} CPUs shared with other jobs, 1 thread; 1-minute load average "
             f"{c['loadavg_start'][0]:.1f} at the start, {c['loadavg_end'][0]:.1f} at the end; {data['seconds']:.0f} s "
             f"in all). {c['kind']} drafter, block {c['block_size']} = k = {k} drafts; seeds {c['seeds']}; "
             f"warm start {c['warm_steps']} soft-CE steps, then {c['steps']} steps per objective, batch "
             f"{c['batch_size']} sequences, {c['train_prompts']} training / {c['eval_prompts']} held-out prompts; "
             f"temperature 1: {c['t1_samples']} samples per prompt. Median [min, max] over seeds.", "",
             "| objective | acceptance length, T = 0 | T = 1 | offline estimate, T = 0 |", "|---|---|---|---|"]
    arms = ["init"] + list(ARMS)
    for arm in arms:
        off = spread([data["offline"][str(sd)][arm]["walk_len"] for sd in c["seeds"]])
        label = "warm start (common init)" if arm == "init" else ARM_NAMES[arm]
        lines.append(f"| {label} | {_r(s['acceptance']['0'][arm]['acceptance_len'])} | "
                     f"{_r(s['acceptance']['1'][arm]['acceptance_len'])} | {_r(off)} |")
    lines += ["", "Gain of on-policy E2E-TV in acceptance length (%): ratio of the medians, and per seed "
              "(same init, same batches) median [min, max].", "",
              "| on-policy arm | over | T = 0, of medians | T = 0, paired | T = 1, of medians | T = 1, paired | paper |",
              "|---|---|---|---|---|---|---|"]
    for arm in s["gains_pct"]["0"]:
        for base, paper in (("offpolicy_ce", PAPER["gain_vs_offpolicy_ce_pct"]),
                            ("offpolicy_e2e_tv", PAPER["gain_vs_offpolicy_e2e_tv_pct"])):
            g0, g1 = s["gains_pct"]["0"][arm][base], s["gains_pct"]["1"][arm][base]
            lines.append(f"| {ARM_NAMES[arm]} | {ARM_NAMES[base]} | {g0['of_medians']:+.1f} | "
                         f"{_r(g0['paired'], '{:+.1f}')} | {g1['of_medians']:+.1f} | {_r(g1['paired'], '{:+.1f}')} | "
                         f"+{paper} |")
    for T in TEMPS:
        lines += ["", f"Prefix survival at T = {T} (vLLM, fraction of verification rounds whose first j drafts were "
                  "all accepted; median over seeds):", "",
                  "| objective | " + " | ".join(f"j={j}" for j in range(1, k + 1)) + " |",
                  "|---|" + "---|" * k]
        for arm in arms:
            sv = s["acceptance"][T][arm]["survival"]
            label = "warm start" if arm == "init" else ARM_NAMES[arm]
            lines.append(f"| {label} | " + " | ".join(f"{x['median']:.3f}" for x in sv) + " |")
    t = s["throughput"]
    tp = data["throughput"]
    W = tp["width"]
    pl = tp["plan"]
    lines += ["", f"Supervised tokens per second: every arm supervises {pl['specopd']['sequences']} x "
              f"{pl['specopd']['rounds_or_anchors']} x {W} drafted positions per update; "
              f"{len(tp['specopd'])} interleaved repeats (order rotated), median [min, max]:", "",
              "| arm | sequences x anchors or rounds | seconds per update | supervised tokens / s | SpecOPD / arm (per repeat) |",
              "|---|---|---|---|---|"]
    names = {"specopd": "SpecOPD (parallel: anchors on the reference)",
             "draft_opd": "Draft-OPD (sequential rounds), same sequences",
             "draft_opd_long": "Draft-OPD, longer rollouts"}
    for arm in TPUT_ARMS:
        r = t[arm].get("ratio_specopd_over")
        lines.append(f"| {names[arm]} | {pl[arm]['sequences']} x {pl[arm]['rounds_or_anchors']} | {_r(t[arm]['seconds'])} | "
                     f"{_r(t[arm]['supervised_tokens_per_s'], '{:.0f}')} | "
                     + (f"**{_r(r, '{:.2f}')}x**" if r else "-") + " |")
    lines += ["", f"Paper: {PAPER['supervised_tokens_per_s_x']}x (= {PAPER['update_throughput_x']}x update throughput x "
              f"{PAPER['tokens_per_update_x']}x supervised tokens per update; 27B target, 8 GPUs).", "",
              "Draft-OPD's update, median seconds: " + "; ".join(
                  f"{names[arm].split(',')[-1].strip()}: prefill {t[arm]['phases_s']['prefill_s']['median']:.3f}, drafting "
                  f"{t[arm]['phases_s']['draft_s']['median']:.3f}, verification {t[arm]['phases_s']['verify_s']['median']:.3f} "
                  f"(all rounds), re-score + loss + backward + AdamW {t[arm]['phases_s']['update_s']['median']:.3f}"
                  for arm in TPUT_ARMS[1:]) + "."]
    return "\n".join(lines)


def plot(data: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, s = data["config"], data["summary"]
    k = c["k"]
    arms = ["init"] + list(ARMS)
    labels = ["warm start", "off-policy\nCE", "off-policy\nE2E-TV", "on-policy\nE2E-TV", "on-policy\nE2E-TV greedy"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    for ti, T in enumerate(TEMPS):
        xs = [i + (ti - 0.5) * 0.38 for i in range(len(arms))]
        vals = [s["acceptance"][T][a]["acceptance_len"] for a in arms]
        ax.bar(xs, [v["median"] for v in vals], 0.36, label=f"T = {T} (median over seeds)", alpha=0.75,
               yerr=[[v["median"] - v["min"] for v in vals], [v["max"] - v["median"] for v in vals]], capsize=3)
        for x, a in zip(xs, arms):
            per = list(s["acceptance"][T][a]["per_seed"].values())
            ax.plot([x] * len(per), per, ".", color="k", ms=4)
    ax.set_xticks(range(len(arms)), labels, fontsize=8)
    lo = min(s["acceptance"][T][a]["acceptance_len"]["min"] for T in TEMPS for a in arms)
    ax.set_ylim(max(1.0, lo - 0.2), None)
    ax.set_ylabel(f"acceptance length in vLLM (k = {k})")
    ax.set_title("same budget per objective (dots: seeds)")
    ax.legend(fontsize=8)
    ax = axes[1]
    for i, a in enumerate(arms):
        for T, style in (("0", "-"), ("1", "--")):
            sv = s["acceptance"][T][a]["survival"]
            ax.plot(range(1, k + 1), [x["median"] for x in sv], style, marker="o", ms=3, color=f"C{i}",
                    label=f"{labels[i]}, T={T}".replace("\n", " "))
    ax.set_xlabel("draft position j")
    ax.set_ylabel("prefix survival (first j drafts accepted)")
    ax.set_title("per-position prefix survival (vLLM, median over seeds)")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[2]
    t = s["throughput"]
    pl = data["throughput"]["plan"]
    for i, arm in enumerate(TPUT_ARMS):
        per = [r["supervised"] / r["seconds"] for r in data["throughput"][arm]]
        ax.plot([i] * len(per), per, ".", color="k", ms=4)
        ax.bar(i, t[arm]["supervised_tokens_per_s"]["median"], 0.6, alpha=0.75, color=f"C{i + 4}")
        r = t[arm].get("ratio_specopd_over")
        if r:
            ax.text(i, t[arm]["supervised_tokens_per_s"]["median"], f"SpecOPD {r['median']:.2f}x\n[{r['min']:.2f}, "
                    f"{r['max']:.2f}]", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(TPUT_ARMS)), [f"SpecOPD\n{pl['specopd']['sequences']} seqs x {pl['specopd']['rounds_or_anchors']} anchors",
                                          f"Draft-OPD\n{pl['draft_opd']['sequences']} seqs x {pl['draft_opd']['rounds_or_anchors']} rounds",
                                          f"Draft-OPD\n{pl['draft_opd_long']['sequences']} seqs x "
                                          f"{pl['draft_opd_long']['rounds_or_anchors']} rounds"], fontsize=8)
    ax.set_ylabel("supervised tokens / s (dots: repeats)")
    ax.set_title(f"same supervised positions / update (paper {PAPER['supervised_tokens_per_s_x']}x)")
    fig.suptitle(f"SpecOPD on the tiny target, {c['kind']} k={k}, CPU ({c['cpu_count']} cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


# ------------------------------------------------------------------------------ main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="the test's sizes (about a minute)")
    ap.add_argument("--kind", default="dflash", help="drafter family: dflash, or dspark (GPU only: vLLM serves it there)")
    ap.add_argument("--k", type=int, default=PAPER["k"], help="draft tokens per round (the paper's 7)")
    ap.add_argument("--block-size", type=int, default=None, help="default: the smallest block drafting k")
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--warm-steps", type=int, default=None, help="soft-CE steps of the common init")
    ap.add_argument("--steps", type=int, default=None, help="steps per objective")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--train-prompts", type=int, default=None)
    ap.add_argument("--eval-prompts", type=int, default=None)
    ap.add_argument("--t1-samples", type=int, default=None, help="temperature-1 samples per held-out prompt")
    ap.add_argument("--tput-seqs", type=int, default=None, help="sequences per throughput update")
    ap.add_argument("--tput-repeats", type=int, default=None)
    ap.add_argument("--tput-warmup", type=int, default=None)
    ap.add_argument("--tput-long-rounds", type=int, default=None,
                    help="rounds per sequence of the long Draft-OPD arm (divides tput-seqs x anchors_per_seq)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--report", type=Path, nargs="+", default=None,
                    help="print the markdown tables from this JSON (or several --grid JSONs, merged), redraw its PNG")
    a = ap.parse_args(argv)
    preset = "quick" if a.quick else "default"
    for key, v in PRESETS[preset].items():
        if getattr(a, key) is None:
            setattr(a, key, v)
    for key in ("warm_steps", "steps", "batch_size", "train_prompts", "eval_prompts", "t1_samples", "tput_seqs",
                "tput_repeats", "tput_warmup", "tput_long_rounds"):
        v = getattr(a, key)
        if v < (0 if key in ("warm_steps", "tput_warmup") else 1):
            ap.error(f"--{key.replace('_', '-')} {v}: must be >= {0 if key in ('warm_steps', 'tput_warmup') else 1}")
    if len(set(a.seeds)) != len(a.seeds):
        ap.error(f"--seeds {a.seeds}: repeated seed")
    if a.out is None:
        a.out = ROOT / "bench" / "results" / f"specopd{'-quick' if a.quick else ''}.json"
    if a.png is None:
        a.png = a.out.with_suffix(".png") if a.quick else ROOT / "docs" / "img" / "specopd.png"
    return a


def _grid():
    """bench/specopd_grid.py (the family x target x objective grid), imported beside this file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_specopd_grid", Path(__file__).with_name("specopd_grid.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_specopd_grid", mod)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--grid" in argv:
        return _grid().main(argv)
    a = parse_args(argv)
    if a.report is not None:
        data = json.loads(a.report[0].read_text())
        if "cells" in data:  # --grid JSONs (several: one grid run side by side over disjoint --families)
            png = a.png if "--png" in argv else ROOT / "docs" / "img" / a.report[0].with_suffix(".png").name
            return _grid().report(a.report, png)
        if len(a.report) > 1:
            print("bench/specopd.py --report: one JSON of this benchmark at a time (several only of --grid runs)",
                  file=sys.stderr)
            return 2
        data["summary"] = summarize(data)
        print(markdown(data))
        plot(data, a.png)
        print(f"wrote {a.png}")
        return 0
    from cotrain.draft.distill import load_distill_config

    cfg = load_distill_config(ROOT / "configs" / f"distill_{a.kind}.yaml") if a.kind in KINDS else None
    try:
        block, k = resolve_block(a.kind, a.k, a.block_size, cfg.data.tail_tokens if cfg else None)
        throughput_plan(a.tput_seqs, int(cfg.draft.settings.anchors_per_seq), a.tput_long_rounds)
        if a.kind == "dspark" and not torch.cuda.is_available():
            raise ValueError("--kind dspark: vLLM serves DSpark on GPU only (its V2 model runner); on CPU use --kind dflash")
    except ValueError as e:
        print(f"bench/specopd.py: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    t_start, load_start = time.time(), os.getloadavg()

    import vllm
    from transformers import AutoTokenizer

    from cotrain.draft.acceptance import estimate_acceptance
    from cotrain.draft.distill import generate_records, load_prompts, records_to_batch
    from cotrain.draft.export import export_drafter
    from cotrain.draft.registry import build_drafter
    from cotrain.draft.taps import TargetSpec, load_hf_target
    from cotrain.models.build_tiny import resolve_model_path

    cfg = load_distill_config(ROOT / "configs" / f"distill_{a.kind}.yaml",
                              [f"draft.{a.kind}.block_size={block}", f"train.batch_size={a.batch_size}"])
    tiny = resolve_model_path(cfg.target)
    target = TargetSpec.from_checkpoint(tiny)
    model, tok = load_hf_target(tiny), AutoTokenizer.from_pretrained(str(tiny))
    d = cfg.data
    prompts = load_prompts(d, a.train_prompts + a.eval_prompts, d.seed)
    records = generate_records(model, tok, prompts, d.max_new_tokens, d.tail_tokens, d.temperature, d.seed)
    probe = build_drafter(a.kind, cfg.draft.settings, target, seed=0)
    train = records_to_batch(records[:a.train_prompts], model, probe.tap_layers)
    evals = records_to_batch(records[a.train_prompts:], model, probe.tap_layers)
    eval_prompts = prompts[a.train_prompts:]
    eos = target.eos_token_id
    print(f"[data] {train.num_seqs} train / {evals.num_seqs} held-out sequences in {time.time() - t_start:.1f} s",
          flush=True)

    training: dict = {}
    offline: dict = {}
    weights: dict = {}
    warm0 = None
    for seed in a.seeds:
        t0 = time.time()
        d0 = build_drafter(a.kind, cfg.draft.settings, target, seed=seed)
        tr = {"random_init_sha": state_hash(d0)}
        tr["warm"] = train_arm(d0, train, cfg, "teacher_forced", "soft_ce", a.warm_steps, 10_000 + seed, model, eos,
                               a.batch_size)
        tr["init_sha"] = state_hash(d0)
        drafters = {"init": d0}
        for arm, (branches, loss) in ARMS.items():
            dd = copy.deepcopy(d0)
            tr[arm] = train_arm(dd, train, cfg, branches, loss, a.steps, seed, model, eos, a.batch_size)
            drafters[arm] = dd
        offline[str(seed)] = {arm: estimate_acceptance(dd, evals, k=k, eos_token_id=eos).to_dict()
                              for arm, dd in drafters.items()}
        weights[str(seed)] = {arm: dd.vllm_state_dict() for arm, dd in drafters.items()}
        training[str(seed)] = tr
        warm0 = warm0 or copy.deepcopy(d0)
        print(f"[train] seed {seed}: " + ", ".join(f"{arm} {offline[str(seed)][arm]['walk_len']:.3f}"
                                                    for arm in drafters) + f" (offline) in {time.time() - t0:.1f} s",
              flush=True)

    # acceptance in vLLM: one engine, every drafter pushed into it in turn
    acceptance: dict = {T: {arm: {} for arm in ["init", *ARMS]} for T in TEMPS}
    lossless = True
    from cotrain.rl.vllm.client import push_weights
    from cotrain.rl.vllm.engine import make_cotrain_llm

    with tempfile.TemporaryDirectory() as tmp:
        export_drafter(warm0, Path(tmp) / "drafter")
        t0 = time.time()
        llm = make_cotrain_llm(str(tiny), seed=0, speculative_config=warm0.speculative_config(str(Path(tmp) / "drafter"), k),
                               spec_metrics="detailed")
        print(f"[vllm] engine ready in {time.time() - t0:.1f} s", flush=True)
        reference = [r.response for r in records[a.train_prompts:]]
        version = 0
        for seed in a.seeds:
            for arm, sd in weights[str(seed)].items():
                version += 1
                push_weights(llm, "draft", sd, version)
                for T in TEMPS:
                    rounds, tokens = vllm_rounds(llm, eval_prompts, float(T), a.t1_samples, 100 + seed)
                    entry = {"per_request_rounds": rounds}
                    if T == "0":
                        entry["token_ids"] = tokens
                        entry["greedy_identical_to_target"] = tokens == reference
                        lossless &= entry["greedy_identical_to_target"]
                    acceptance[T][arm][str(seed)] = entry
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del llm
    print(f"[vllm] acceptance measured ({version} drafters; greedy output identical to the target's: {lossless})",
          flush=True)

    t0 = time.time()
    tput = throughput(warm0, model, train, records, cfg, a, None)  # no EOS rule: every drafted position counts
    print(f"[throughput] {a.tput_repeats} repeats in {time.time() - t0:.1f} s", flush=True)

    config = recorded_args(a)
    config.update(command="python bench/specopd.py" + "".join(" " + x for x in (sys.argv[1:] if argv is None else argv)),
                  k=k, block_size=block, kind=a.kind, device="cpu" if not torch.cuda.is_available() else
                  torch.cuda.get_device_name(0), torch=torch.__version__, vllm=vllm.__version__, cpu_count=os.cpu_count(),
                  date=time.strftime("%Y-%m-%d"), loadavg_start=load_start, loadavg_end=os.getloadavg(), threads=1,
                  target=recorded(tiny), distill_config=f"configs/distill_{a.kind}.yaml",
                  optimizer=cfg.draft.optimizer.model_dump(), loss_gamma=cfg.draft.settings.loss_gamma,
                  anchors_per_seq=int(cfg.draft.settings.anchors_per_seq), t1_seed="100 + seed",
                  draft_sample_method="greedy (vLLM's default; verification at the request's temperature)")
    data = {"config": config, "paper": PAPER, "training": training, "offline": offline, "acceptance": acceptance,
            "throughput": tput, "seconds": round(time.time() - t_start, 1)}
    data["summary"] = summarize(data)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(data, separators=(",", ":")))  # compact: the raw per-round lists are long
    a.png.parent.mkdir(parents=True, exist_ok=True)
    plot(data, a.png)
    print(markdown(data))
    print(f"wrote {a.out} and {a.png} in {data['seconds']} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
