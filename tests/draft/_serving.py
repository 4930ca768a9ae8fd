"""Shared pieces of the serving tests: cached distilled drafters, held-out data, vLLM measurements, chi-square."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@dataclass
class Served:
    kind: str
    k: int
    drafter_dir: Path
    drafter: object
    prompts: list
    records: list
    batch: object
    offline: object
    llm: object = None
    extra: dict = field(default_factory=dict)


@contextmanager
def one_thread():
    """The tiny shapes (HF target, drafter, in-process vLLM engine) run fastest on one thread; two
    threads on a busy 2-core machine can be several times slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def distilled(kind: str, overrides=()):
    """(run directory, DistillConfig) of the cached distillation of configs/distill_<kind>.yaml
    (``kind``: the config's name after ``distill_``, e.g. ``eagle3`` or ``words_eagle3``)."""
    from cotrain.draft.cache import ensure_distilled
    from cotrain.draft.distill import load_distill_config

    cfg = load_distill_config(CONFIGS / f"distill_{kind}.yaml", list(overrides))
    return ensure_distilled(cfg), cfg


def held_out(cfg, hf_target, tap_layers):
    """The distillation's held-out prompts, the target's responses (+ tails) and their batch."""
    from cotrain.draft.distill import generate_records, load_prompts, records_to_batch

    model, tok = hf_target
    d = cfg.data
    prompts = load_prompts(d, d.num_prompts + d.eval_prompts, d.seed)[d.num_prompts:]
    records = generate_records(model, tok, prompts, d.max_new_tokens, d.tail_tokens, 0.0, d.seed)
    return prompts, records, records_to_batch(records, model, tap_layers)


def prepare(kind, k, hf_target, target, overrides=(), config=None) -> Served:
    """``config``: the distillation config's name (configs/distill_<config>.yaml), default ``kind``."""
    from cotrain.draft.acceptance import estimate_acceptance
    from cotrain.draft.export import load_drafter

    run, cfg = distilled(config or kind, overrides)
    drafter = load_drafter(run / "drafter", target).eval()
    prompts, records, batch = held_out(cfg, hf_target, drafter.tap_layers)
    offline = estimate_acceptance(drafter, batch, k=k, eos_token_id=target.eos_token_id)
    return Served(kind, k, run / "drafter", drafter, prompts, records, batch, offline)


def start_engine(model_path, served: Served, draft_sample_method: str = "greedy", **kw):
    from cotrain.rl.vllm.engine import make_cotrain_llm

    spec = served.drafter.speculative_config(str(served.drafter_dir), served.k)
    if draft_sample_method != "greedy":
        spec["draft_sample_method"] = draft_sample_method
    served.llm = make_cotrain_llm(str(model_path), seed=0, speculative_config=spec, **kw)
    return served.llm


def stop_engine(served: Served) -> None:
    served.llm = None
    gc.collect()


def greedy_run(llm, prompts, max_tokens=16):
    """(token ids per prompt, vLLM acceptance length, accepted, rounds) of a greedy batch."""
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    acc = rounds = 0
    for o in outs:
        m = o.outputs[0].spec_decode_metrics
        h = (m.to_dict() if hasattr(m, "to_dict") else dict(m))["acceptance_histogram"] if m is not None else []
        acc += sum(j * c for j, c in enumerate(h))
        rounds += sum(h)
    return [list(o.outputs[0].token_ids) for o in outs], 1.0 + acc / max(rounds, 1), acc, rounds


def first_two_tokens_distribution(model, prompt_ids, eos_id, chunk: int = 512, min_cell: float = 1e-9):
    """Exact target distribution of the first two generated tokens at temperature 1:
    {(t1, t2): p} and {(eos,): p} when the first token ends the sequence. Cells of probability at
    most ``min_cell`` are left out (their mass stays out of the normalisation: chi_square pools it
    with the other small cells). The second token's distributions are computed only after first
    tokens above ``min_cell``, ``chunk`` continuations at a time (a large vocabulary's V x V
    logits would not fit)."""
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        p1 = model(input_ids=ids).logits[0, -1].float().softmax(-1).double()
        firsts = torch.nonzero(p1 > min_cell).flatten()  # (a pair's probability is at most its first token's)
        rows = []
        for c in range(0, firsts.numel(), chunk):
            a = firsts[c: c + chunk]
            seqs = torch.cat([ids.repeat(a.numel(), 1), a[:, None]], dim=1)
            rows.append(model(input_ids=seqs, logits_to_keep=1).logits[:, -1].float().softmax(-1).double())
    joint = p1[firsts, None] * torch.cat(rows)  # (first tokens kept, V)
    joint[firsts == eos_id] = 0.0
    total = float(p1.sum())  # = 1 up to rounding: every pair's mass plus the EOS cell
    out = {(int(firsts[i]), int(b)): float(joint[i, b]) / total
           for i, b in zip(*torch.nonzero(joint > min_cell, as_tuple=True))}
    out[(eos_id,)] = float(p1[eos_id]) / total
    return out


def entropy(dist) -> float:
    import math

    return -sum(p * math.log(p) for p in dist.values() if p > 0)


def chi_square(counts: dict, probs: dict, min_expected: float = 5.0):
    """Pearson's test of ``counts`` against ``probs``; cells expected below ``min_expected`` are pooled.
    Returns (statistic, degrees of freedom, p-value)."""
    n = sum(counts.values())
    cells = set(probs) | set(counts)
    big = [c for c in cells if probs.get(c, 0.0) * n >= min_expected]
    obs = [counts.get(c, 0) for c in big]
    exp = [probs[c] * n for c in big]
    rest_obs = n - sum(obs)
    rest_exp = n - sum(exp)
    if rest_exp > 0:
        obs.append(rest_obs)
        exp.append(rest_exp)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    # survival function of chi2(df): the regularised upper incomplete gamma Q(df/2, stat/2)
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p


def pick_uncertain_prompt(model, tok, candidates, eos_id, pooled_n: int = 0, min_cell: float = 1e-9):
    """The candidate whose first two target tokens have the most entropy (the strongest test).

    ``pooled_n`` > 0 (large vocabularies): the candidate whose *first* token has the most entropy
    as a chi-square test of ``pooled_n`` samples sees it - tokens expected fewer than 5 times pooled
    into one cell - and only its two-token distribution is computed. (With thousands of tokens the
    plain entropy favours a prompt whose mass is spread thinly over the whole vocabulary: every cell
    pooled, nothing left to test.)"""
    if pooled_n:
        def pooled_entropy(prompt):
            with torch.no_grad():
                q = model(input_ids=torch.tensor([tok.encode(prompt)])).logits[0, -1].float().softmax(-1).double()
            big = q[q * pooled_n >= 5.0]
            cells = torch.cat([big, (1.0 - big.sum()).clamp_min(0.0).reshape(1)])
            return float(-(cells * cells.clamp_min(1e-300).log()).sum())
        best = max(candidates, key=pooled_entropy)
        return best, first_two_tokens_distribution(model, tok.encode(best), eos_id, min_cell=min_cell)
    dists = {p: first_two_tokens_distribution(model, tok.encode(p), eos_id, min_cell=min_cell) for p in candidates}
    best = max(candidates, key=lambda p: entropy(dists[p]))
    return best, dists[best]


def sample_first_two(llm, prompt, n, seed0=1000, top_k: int = 0, top_p: float = 1.0):
    """Counts of the first two tokens over n temperature-1 samples with fixed per-request seeds,
    the number of verification rounds whose first draft was accepted, and the number of rounds."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k, max_tokens=2, seed=seed0 + i)
              for i in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    counts: dict = {}
    first_accepted = rounds = 0
    for o in outs:
        t = tuple(o.outputs[0].token_ids)
        counts[t] = counts.get(t, 0) + 1
        m = o.outputs[0].spec_decode_metrics
        if m is not None:
            h = (m.to_dict() if hasattr(m, "to_dict") else dict(m))["acceptance_histogram"]
            rounds += sum(h)
            first_accepted += sum(h[1:])
    return counts, first_accepted, rounds


# ------------------------------------------------------------------------ the three serving checks
def check_acceptance_matches_offline(served: Served) -> None:
    """(1) greedy serving of the distilled drafter: lossless, acceptance >= 2, within 10% of offline."""
    tokens, vllm_len, accepted, rounds = greedy_run(served.llm, served.prompts)
    assert tokens == [r.response for r in served.records]  # exactly the target's own greedy responses
    assert vllm_len >= 2.0, vllm_len
    off = served.offline
    assert abs(vllm_len - off.walk_len) <= 0.10 * off.walk_len, (vllm_len, off.walk_len)
    served.extra["trained"] = (vllm_len, tokens)
    served.extra["numbers"] = {"vllm_len": vllm_len, "offline_walk_len": off.walk_len, "rounds": rounds,
                               "offline_rounds": off.rounds, "accepted": accepted, "offline_accepted": off.accepted}


def check_runtime_push(served: Served, target) -> None:
    """(2) pushing drafter weights into the running engine moves acceptance to what the offline
    estimate of the pushed weights says, and never changes the greedy output."""
    from cotrain.draft.acceptance import estimate_acceptance
    from cotrain.draft.registry import build_drafter
    from cotrain.rl.vllm.client import push_weights

    if "trained" not in served.extra:
        served.extra["trained"] = greedy_run(served.llm, served.prompts)[1::-1]
    trained_len, trained_tokens = served.extra["trained"]
    fresh = build_drafter(served.kind, served.drafter.cfg, target, seed=123).eval()  # untrained
    fresh_off = estimate_acceptance(fresh, served.batch, k=served.k, eos_token_id=target.eos_token_id).walk_len

    push_weights(served.llm, "draft", fresh.vllm_state_dict(), version=1)
    tokens, fresh_len, _, _ = greedy_run(served.llm, served.prompts)
    assert tokens == trained_tokens
    assert abs(fresh_len - fresh_off) <= 0.10 * fresh_off, (fresh_len, fresh_off)
    assert fresh_len < trained_len - 0.5, (fresh_len, trained_len)

    push_weights(served.llm, "draft", served.drafter.vllm_state_dict(), version=2)
    tokens, back_len, _, _ = greedy_run(served.llm, served.prompts)
    assert tokens == trained_tokens
    assert back_len == trained_len, (back_len, trained_len)


class _Scaled:
    """A HF model with its logits divided by a temperature, then (``top_k`` > 0, ``top_p`` < 1)
    vLLM's top-k / top-p filter applied: the distribution vLLM's sampler draws from."""

    def __init__(self, model, t, top_k: int = 0, top_p: float = 1.0):
        self.model, self.t, self.top_k, self.top_p = model, t, top_k, top_p

    def __call__(self, **kw):
        from cotrain.rl.sampling_filter import keep_mask

        out = self.model(**kw)
        out.logits = out.logits / self.t
        if self.top_k or self.top_p < 1.0:
            out.logits = out.logits.masked_fill(~keep_mask(out.logits.float(), self.top_k, self.top_p), float("-inf"))
        return out


def check_temperature_one(served: Served, hf_target, target, n: int = 2000, pooled: bool = False,
                          min_cell: float = 1e-9, top_k: int = 0, top_p: float = 1.0, tries: int = 1,
                          exact_acceptance: str | None = None) -> None:
    """(3) at temperature 1 the first two sampled tokens follow the target's exact distribution
    (= target-only sampling; with ``top_k`` / ``top_p``, the target's filtered distribution): chi-square
    with fixed per-request seeds. Needs cotrain's CPU repair of vLLM's rejection sampler
    (cotrain.rl.vllm.sampler_fix). ``exact_acceptance`` ("greedy" / "sampled", no filter): also the
    rate at which the first round accepts its first draft, against :func:`first_draft_acceptance`."""
    from cotrain.rl.vllm.sampler_fix import cpu_rejection_sampler_fixed

    model, tok = hf_target
    if not torch.cuda.is_available():
        assert cpu_rejection_sampler_fixed()  # in-process engine: the repair is in this process
    if top_k or top_p < 1.0:
        model = _Scaled(model, 1.0, top_k, top_p)
    candidates = list(served.prompts[:40])
    for attempt in range(tries):
        prompt, exact = pick_uncertain_prompt(model, tok, candidates, target.eos_token_id, n if pooled else 0,
                                              min_cell)
        counts, first_accepted, rounds = sample_first_two(served.llm, prompt, n=n, top_k=top_k, top_p=top_p)
        # both verification outcomes occur (the first draft is accepted in some rounds, rejected in
        # others); a filter can leave the most uncertain prompt with a drafter that is never right
        # there (then the next most uncertain prompt is tried)
        if rounds > 0.75 * n and min(first_accepted, rounds - first_accepted) >= 20:
            break
        candidates.remove(prompt)
    assert rounds > 0.75 * n and min(first_accepted, rounds - first_accepted) >= 20, (first_accepted, rounds)
    stat, df, p = chi_square(counts, exact)
    print(f"temperature 1, first two tokens: chi-square {stat:.1f}, {df} degrees of freedom, p = {p:.2f} "
          f"({n} samples); first draft accepted in {first_accepted}/{rounds} rounds")
    assert p > 1e-3, (stat, df, p, prompt)
    # power: the same counts against the target at temperature 1.3 are rejected
    hot = first_two_tokens_distribution(_Scaled(hf_target[0], 1.3, top_k, top_p), tok.encode(prompt),
                                        target.eos_token_id, min_cell=min_cell)
    assert chi_square(counts, hot)[2] < 1e-6
    served.extra["chi2"] = {"stat": stat, "df": df, "p": p, "prompt": prompt, "first_accept_rate": first_accepted / rounds,
                            "rounds": rounds}
    if exact_acceptance is not None:  # the first draft accepted as often as the exact probability says
        exact = first_draft_acceptance(served, hf_target, target, prompt)[exact_acceptance]
        _close(first_accepted / rounds, exact, rounds, f"first-draft acceptance ({exact_acceptance} drafts)")
        served.extra["chi2"]["exact_first_accept_rate"] = exact


def check_probabilistic_drafts(served: Served, model_path, hf_target, target, n: int = 2000,
                               engine_kw: dict | None = None, **kw) -> None:
    """(4) ``draft_sample_method: probabilistic`` (``rollout.speculative.draft_sample_method``):
    drafts sampled from the drafter, verified with the ratio min(1, p / q). A second engine serving
    the same drafter that way stays lossless at temperature 1 (check (3), with its power check) -
    which any proposal would, even one verified as if q were one-hot - and accepts the first draft as
    often as sampled drafts should (:func:`first_draft_acceptance`), where the greedy-draft engine
    (``served.llm``), on the same prompt and seeds, accepts it as often as greedy drafts should.
    ``engine_kw``: the second engine's arguments (as ``served.llm``'s); ``kw``:
    :func:`check_temperature_one`'s (``pooled``, ``min_cell`` for a large vocabulary)."""
    prob = Served(served.kind, served.k, served.drafter_dir, served.drafter, served.prompts, served.records,
                  served.batch, served.offline)
    start_engine(model_path, prob, draft_sample_method="probabilistic", **(engine_kw or {}))
    try:
        assert prob.llm.llm_engine.vllm_config.speculative_config.draft_sample_method == "probabilistic"
        check_temperature_one(prob, hf_target, target, n=n, exact_acceptance="sampled", **kw)
        chi2 = prob.extra["chi2"]
        _, greedy_first, greedy_rounds = sample_first_two(served.llm, chi2["prompt"], n=n)
        exact = first_draft_acceptance(served, hf_target, target, chi2["prompt"])
        _close(greedy_first / greedy_rounds, exact["greedy"], greedy_rounds, "first-draft acceptance (greedy drafts)")
        served.extra["probabilistic"] = {**chi2, "greedy_first_accept_rate": greedy_first / greedy_rounds,
                                         "exact_greedy_first_accept_rate": exact["greedy"]}
    finally:
        stop_engine(prob)


_EXACT: dict = {}  # (drafter export, prompt, mass) -> first_draft_acceptance


def first_draft_acceptance(served: Served, hf_target, target, prompt: str, mass: float = 1 - 1e-3,
                           chunk: int = 128) -> dict:
    """The exact probability that the first verification round of a temperature-1 request for
    ``prompt`` accepts its first draft (an independent reference for vLLM's counts):

        greedy drafts:   sum_t P(t) p_t(argmax q_t) / sum_t P(t)
        sampled drafts:  sum_t P(t) sum_v min(p_t(v), q_t(v)) / sum_t P(t)

    over the first tokens t != EOS (an EOS ends the request before any round; the most probable ones
    up to ``mass`` of P, the rest, at most 1 - ``mass``, left out), P the target's first token
    distribution, p_t the target's and q_t the drafter's distributions of the token after
    prompt + t (draft 1 of the round whose bonus token is t). Sampled drafts y ~ q_t are accepted with
    probability min(1, p_t(y) / q_t(y)), whose mean over y is sum_v min(p_t, q_t)."""
    from cotrain.draft.dflash import BlockDrafter
    from cotrain.draft.distill import Record, records_to_batch
    from cotrain.draft.specopd import sample_branches

    key = (str(served.drafter_dir), prompt, mass)
    if key in _EXACT:  # greedy and sampled come together: the two checks of a prompt share one computation
        return _EXACT[key]
    model, tok = hf_target
    ids = tok.encode(prompt)
    eos = target.eos_token_id
    with torch.no_grad():
        p1 = model(input_ids=torch.tensor([ids])).logits[0, -1].float().softmax(-1).double()
        order = torch.argsort(p1, descending=True)
        n = int(torch.searchsorted(torch.cumsum(p1[order], 0), torch.tensor(mass, dtype=p1.dtype))) + 1
        firsts = [t for t in order[:n].tolist() if t != eos]
        drafter = served.drafter.eval()
        greedy, sampled = [], []
        for c in range(0, len(firsts), chunk):
            ts = firsts[c:c + chunk]
            # prompt + t + filler: the filler only makes room for the round's drafts (it changes neither p_t nor q_t)
            batch = records_to_batch([Record(ids, [t] * (served.k + 2), []) for t in ts], model, drafter.tap_layers)
            bonus_at = batch.cu_seqlens[:-1] + len(ids)  # packed position of t in each sequence
            # a block drafter's branch at t only; EAGLE-3 runs its passes at every chain anchor
            layout = (drafter.build_layout(batch, anchors=bonus_at) if isinstance(drafter, BlockDrafter)
                      else drafter.build_layout(batch))
            br = sample_branches(drafter, batch, layout, temperature=0.0)
            row = {b: i for i, b in enumerate(br.bonus_pos.tolist())}
            q = br.logits[torch.tensor([row[b] for b in bonus_at.tolist()]), 0].double().softmax(-1)
            if br.vocab is not None:  # draft vocabulary -> target ids
                q = br.vocab.spread(q)
            p = batch.target_logits[bonus_at].double().softmax(-1)
            greedy.append(p.gather(1, q.argmax(-1, keepdim=True))[:, 0])
            sampled.append(torch.minimum(p, q).sum(-1))
    w = p1[firsts]
    greedy, sampled = torch.cat(greedy), torch.cat(sampled)
    _EXACT[key] = {"greedy": float((w * greedy).sum() / w.sum()), "sampled": float((w * sampled).sum() / w.sum()),
                   "rounds_share": float(w.sum())}
    return _EXACT[key]


def _close(measured: float, exact: float, rounds: int, what: str) -> None:
    """``measured`` (a rate over ``rounds`` independent rounds) within 4.5 standard errors (+0.005)."""
    tol = 4.5 * (exact * (1 - exact) / rounds) ** 0.5 + 0.005
    print(f"{what}: vLLM {measured:.3f} over {rounds} rounds, exact {exact:.3f}")  # the docs' numbers (pytest -s)
    assert abs(measured - exact) <= tol, f"{what}: vLLM {measured:.4f} vs exact {exact:.4f} (tolerance {tol:.4f})"
