"""Offline acceptance estimator: how many tokens a drafter would get accepted, under teacher forcing.

Given a target (its logits on the sequences) and a drafter, for every possible bonus position b
in the responses the drafter's chain proposes drafts d_0..d_{k-1} (greedy: the argmax of each
position); under greedy verification draft j is accepted iff d_0..d_j all equal the target's
greedy tokens. With target-greedy data, teacher forcing is exact: whenever draft j matters, the
tokens the drafter conditions on are the ones it would have drafted itself.

Three numbers come out (acceptance length counts the bonus token, as vLLM does: 1 + accepted):

- ``mean_len``: the mean over all response positions b of the acceptance length at b;
- ``per_position``: P(drafts 0..j all accepted) for each j (the prefix survival rate);
- ``walk_len``: what vLLM measures when it serves the sequence greedily: rounds start at the
  first response token (the prefill produced it), each round accepts L-1 drafts and moves the bonus
  position by L, the request ends when an end-of-sequence token is emitted; the estimate is
  1 + total accepted / rounds over all sequences (vLLM's ``mean_acceptance_length``). Drafts past
  the end-of-sequence token count when they match the target's greedy continuation (vLLM's
  sampler accepts them before the output is cut at EOS), so sequences should carry at least k
  tokens of the target's greedy continuation after EOS.

At temperature 1, on the target's *sampled* responses, the same walk is what vLLM measures, in
expectation (:func:`expected_walk`): the output of speculative sampling is a target sample, and
given that output a round's accepted count is fixed by its drafts - an output token equal to the
draft was accepted (a rejected draft's replacement is drawn from the residual (p - q)+, which is
zero at the draft). Greedy drafts are accepted along the response while they equal it: the
walk above, on sampled stems. Drafts sampled from q (vLLM's ``draft_sample_method:
probabilistic``) equal the response token x with probability min(p, q)(x) / p(x) given that
token, so round b accepts at least j drafts with probability prod_{i<=j} min(1, q_i(x_{b+i}) /
p_i(x_{b+i})), the drafter teacher-forced on the response; the walk then moves on at random. A
mean over positions instead of rounds (every position a round start) is not what vLLM measures:
round starts fall where the previous round's drafts failed, and the two differ by drafter.

A drafter with a reduced draft vocabulary (EAGLE-3 ``draft_vocab_size``, ``drafter.vocab``) drafts
target token ``vocab.to_target(argmax)``, as vLLM does with ``d2t``: where the target's greedy
token lies outside the draft vocabulary the draft is rejected, whatever the drafter's logits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from cotrain.draft.common import DraftBatch, DraftOutput, select_sequences


@dataclass
class AcceptanceReport:
    k: int
    mean_len: float
    per_position: list[float]
    walk_len: Optional[float] = None
    rounds: int = 0
    accepted: int = 0
    num_chains: int = 0
    histogram: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def greedy_matches(out: DraftOutput, target_logits: torch.Tensor, vocab=None) -> torch.Tensor:
    """(N, W) bool: draft j equals the target's greedy token at its row (False where invalid).
    ``vocab``: the drafter's reduced draft vocabulary (draft ids are mapped to target ids, so a
    target token outside it never matches)."""
    tgt = target_logits.argmax(-1)[out.target_rows.clamp(min=0)]
    drafted = out.logits.argmax(-1)
    if vocab is not None:
        drafted = vocab.to_target(drafted)
    return (drafted == tgt) & out.valid


def accept_lengths(matches: torch.Tensor, k: int) -> torch.Tensor:
    """(N,) 1 + number of leading accepted drafts among the first k."""
    m = matches[:, :k].to(torch.int64)
    return 1 + torch.cumprod(m, dim=1).sum(dim=1)


def _chain_outputs(drafter, batch: DraftBatch, seqs_per_chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bonus positions (global), matches, valid for every response bonus position, chunked over sequences."""
    from cotrain.draft.dflash import BlockDrafter

    bonus, matches, valid = [], [], []
    for s0 in range(0, batch.num_seqs, seqs_per_chunk):
        seqs = torch.arange(s0, min(s0 + seqs_per_chunk, batch.num_seqs))
        sub = select_sequences(batch, seqs)
        if isinstance(drafter, BlockDrafter):
            layout = drafter.build_layout(sub, all_anchors=True)
        else:
            layout = drafter.build_layout(sub)
        out = drafter(sub, layout)
        m = greedy_matches(out, sub.target_logits, getattr(drafter, "vocab", None))
        bonus.append(out.bonus_pos + int(batch.cu_seqlens[s0]))
        matches.append(m)
        valid.append(out.valid)
    return torch.cat(bonus), torch.cat(matches), torch.cat(valid)


@torch.no_grad()
def estimate_acceptance(drafter, batch: DraftBatch, k: Optional[int] = None, eos_token_id: Optional[int] = None,
                        seqs_per_chunk: int = 32) -> AcceptanceReport:
    """Greedy acceptance of ``drafter`` with ``k`` draft tokens (default: its trained width) on
    ``batch`` (which must carry target_logits). ``eos_token_id`` enables the serving walk."""
    if batch.target_logits is None:
        raise ValueError("estimate_acceptance needs batch.target_logits")
    k = int(k or drafter.draft_width)
    if k > drafter.draft_width:
        raise ValueError(f"k = {k} exceeds the {drafter.draft_width} draft positions the drafter produces")
    was_training = drafter.training
    drafter.eval()
    try:
        bonus, matches, valid = _chain_outputs(drafter, batch, seqs_per_chunk)
    finally:
        drafter.train(was_training)
    # only chains whose bonus lies in the response and whose first draft is supervised
    seq = batch.seq_of[bonus]
    in_resp = batch.positions[bonus] >= batch.response_start[seq]
    keep = in_resp & valid[:, 0]
    m = matches[keep]
    lens = accept_lengths(m, k)
    surv = torch.cumprod(m[:, :k].to(torch.float64), dim=1)
    v = valid[keep][:, :k]
    per_pos = [(float(surv[v[:, j], j].mean()) if bool(v[:, j].any()) else float("nan")) for j in range(k)]
    report = AcceptanceReport(k=k, mean_len=float(lens.double().mean()) if lens.numel() else float("nan"),
                              per_position=per_pos, num_chains=int(keep.sum()))
    if eos_token_id is not None:
        by_pos = dict(zip(bonus[keep].tolist(), lens.tolist()))
        rounds, accepted, hist = _walk(batch, by_pos, eos_token_id, k)
        report.rounds, report.accepted, report.histogram = rounds, accepted, hist
        report.walk_len = 1.0 + accepted / rounds if rounds else float("nan")
    return report


def _walk(batch: DraftBatch, accept_at: dict[int, int], eos: int, k: int) -> tuple[int, int, list[int]]:
    ids = batch.input_ids.tolist()
    cu = batch.cu_seqlens.tolist()
    rounds = accepted = 0
    hist = [0] * (k + 1)
    for s in range(batch.num_seqs):
        b = cu[s] + int(batch.response_start[s])
        end = cu[s + 1]
        while b < end and ids[b] != eos:
            if b not in accept_at:  # no supervised next token: the data ends here
                break
            L = accept_at[b]
            rounds += 1
            accepted += L - 1
            hist[L - 1] += 1
            new = ids[b + 1 : b + 1 + L]
            if eos in new or b + L >= end:
                break
            b += L
    return rounds, accepted, hist


def expected_walk(batch: DraftBatch, survival_at: dict[int, list[float]], eos: int, k: int) -> dict:
    """The serving walk of :func:`_walk` with random acceptance, in expectation (exact, no sampling).

    ``survival_at[b]`` = [S_1 .. S_k]: the probability that the round whose bonus token sits at packed
    position b accepts at least j drafts (non-increasing; 0/1 values give :func:`_walk`'s walk). The
    round accepts exactly j drafts with probability S_j - S_{j+1} (S_0 = 1, S_{k+1} = 0), then the walk
    goes on from b + j + 1 unless the j + 1 new tokens hold an EOS or reach the sequence's end (as in
    :func:`_walk`). Backwards over each sequence's positions, with E(b) the expected (rounds,
    accepted drafts, rounds with >= j accepted) of the walk from b:

        E(b) = (1, 0, S(b)) + sum_j P_j(b) * ((0, j, 0) + E(b + j + 1) if the walk goes on)

    Returns {"acceptance_len": 1 + E[accepted] / E[rounds], "rounds", "accepted" (expectations,
    summed over sequences), "survival": [E[rounds with >= j accepted] / E[rounds], j = 1..k]}."""
    ids = batch.input_ids.tolist()
    cu = batch.cu_seqlens.tolist()
    tot = torch.zeros(2 + k, dtype=torch.float64)
    for s in range(batch.num_seqs):
        start, end = cu[s] + int(batch.response_start[s]), cu[s + 1]
        memo: dict[int, torch.Tensor] = {}
        for b in range(end - 1, start - 1, -1):
            if ids[b] == eos or b not in survival_at:
                continue  # no round starts here (the request ended, or the data does)
            S = torch.tensor([1.0, *survival_at[b], 0.0], dtype=torch.float64)
            e = torch.zeros(2 + k, dtype=torch.float64)
            e[0] = 1.0
            e[2:] = S[1:k + 1]
            for j in range(k + 1):
                pj = float(S[j] - S[j + 1])
                if pj <= 0.0:
                    continue
                e[1] += pj * j
                L = j + 1
                if eos not in ids[b + 1:b + 1 + L] and b + L < end:
                    nxt = memo.get(b + L)
                    if nxt is not None:
                        e += pj * nxt
            memo[b] = e
        if start in memo:
            tot += memo[start]
    rounds, accepted = float(tot[0]), float(tot[1])
    return {"acceptance_len": 1.0 + accepted / rounds if rounds else float("nan"), "rounds": rounds,
            "accepted": accepted, "survival": (tot[2:] / rounds).tolist() if rounds else [float("nan")] * k}
