"""bench/specopd.py (SpecOPD's offline measurements): the sequential Draft-OPD baseline against a
hand-rolled loop, the k / block-size checks, and a --quick run whose every reported number is
recomputed here from the JSON's raw per-round data."""

import importlib.util
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_specopd", REPO / "bench" / "specopd.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_specopd"] = bench
_spec.loader.exec_module(bench)


# ------------------------------------------------------------------------------ k / block size
def test_block_and_k_choices_are_validated():
    assert bench.resolve_block("dflash", 7) == (8, 7)  # the bonus token takes a block slot
    assert bench.resolve_block("dspark", 7) == (7, 7)  # DSpark drafts every block position
    assert bench.resolve_block("dflash", 5, 8, tail_tokens=8) == (8, 5)
    with pytest.raises(ValueError, match=r"block of 7 drafts at most 6 tokens \(block_size - 1\).*--block-size 8"):
        bench.resolve_block("dflash", 7, 7)
    with pytest.raises(ValueError, match=r"block of 6 drafts at most 6 tokens \(block_size\).*--block-size 7"):
        bench.resolve_block("dspark", 7, 6)
    with pytest.raises(ValueError, match="integer >= 1"):
        bench.resolve_block("dflash", 0)
    with pytest.raises(ValueError, match="at least 2 positions"):
        bench.resolve_block("dflash", 1, 1)
    with pytest.raises(ValueError, match="block drafters"):
        bench.resolve_block("eagle3", 7)
    with pytest.raises(ValueError, match=r"only 6 tokens of the target's continuation.*tail_tokens >= 7"):
        bench.resolve_block("dflash", 7, tail_tokens=6)


def test_cli_refuses_a_block_that_cannot_draft_k(capsys):
    assert bench.main(["--quick", "--k", "7", "--block-size", "7"]) == 2  # before any model is loaded
    assert "drafts at most 6" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench.main(["--quick", "--kind", "dspark"]) == 2
        assert "GPU only" in capsys.readouterr().err
    assert bench.main(["--quick", "--tput-long-rounds", "5"]) == 2  # 6 x 4 positions are not 5 rounds each
    assert "must divide" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--seeds", "1", "1"])


# ------------------------------------------------------------------------------ Draft-OPD baseline
@pytest.fixture(scope="module")
def trained(hf_target, target):
    """A DFlash drafter (block 4: 3 drafts) after 40 soft-CE steps: it accepts some drafts and not others."""
    from cotrain.draft.common import select_sequences
    from cotrain.draft.distill import generate_records, load_distill_config, load_prompts, records_to_batch, train_step
    from cotrain.draft.optim import make_optimizer
    from cotrain.draft.registry import build_drafter

    model, tok = hf_target
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = load_distill_config(REPO / "configs" / "distill_dflash.yaml", ["draft.dflash.block_size=4"])
    prompts = load_prompts(cfg.data, 120, 3)
    records = generate_records(model, tok, prompts, 16, 8)
    batch = records_to_batch(records, model, [0, 3])
    d = build_drafter("dflash", cfg.draft.settings, target, seed=5)
    opt = make_optimizer(d, cfg.draft.optimizer)
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        train_step(d, select_sequences(batch, torch.randint(0, 120, (32,), generator=g)), "soft_ce", opt, 1.0, g)
    d.eval()
    # prompts of several lengths: the batched rollout's left padding and masked cache columns matter
    by_len = {}
    for r in records:
        by_len.setdefault(len(r.prompt), r.prompt)
    yield d, [by_len[n] for n in sorted(by_len)][:4]
    torch.set_num_threads(old)


def _drafter_logits(drafter, model, seq, a):
    """The drafter's ordinary training forward on seq[:a+1] (taps from a plain target forward),
    block at anchor a: (W, V)."""
    from cotrain.draft.common import DraftBatch
    from cotrain.draft.taps import compute_taps

    ids = torch.tensor(seq[:a + 1])
    cu = torch.tensor([0, a + 1])
    taps, _ = compute_taps(model, ids, cu, drafter.tap_layers)
    batch = DraftBatch(ids, cu, taps)
    with torch.no_grad():
        return drafter(batch, drafter.build_layout(batch, anchors=torch.tensor([a]))).logits[0]


def _target_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0]


def _hand_rolled_greedy(drafter, model, prompt, rounds):
    """One sequence, no KV cache, no batching: plain forwards of the whole sequence every round."""
    W = drafter.draft_width
    seq = list(prompt) + [int(_target_logits(model, prompt)[-1].argmax())]
    out = []
    for _ in range(rounds):
        a = len(seq) - 1
        q = _drafter_logits(drafter, model, seq, a)
        y = q.argmax(-1).tolist()
        full = _target_logits(model, seq + y)  # row a + j predicts the token at a + j + 1
        greedy = full[a:a + W + 1].argmax(-1).tolist()
        m = 0
        while m < W and y[m] == greedy[m]:
            m += 1
        out.append({"anchor": a, "tokens": y, "accepted": m, "bonus": greedy[m],
                    "p": F.softmax(full[a:a + W], -1), "q": q})
        seq += y[:m] + [greedy[m]]
    return seq, out


def _hand_e2e_tv(q_logits, p, valid, gamma):
    """-sum_j w_j prod_{i<=j} sum_v min(p, q) / sum_j w_j over valid positions (invalid ones count 1 in the product)."""
    a = torch.minimum(F.softmax(q_logits.double(), -1), p.double()).sum(-1)
    a = torch.where(valid, a, torch.ones_like(a))
    w = torch.tensor([math.exp(-j / gamma) for j in range(p.shape[1])], dtype=torch.float64)[None] * valid
    return float(-(torch.cumprod(a, 1) * w).sum() / w.sum())


def test_draft_opd_supervises_exactly_the_positions_it_drafted(trained, hf_target, target, one_thread):
    d, prompts = trained
    model = hf_target[0]
    R, W = 4, d.draft_width
    eos = target.eos_token_id
    ro = bench.draft_opd_rollout(d, model, prompts, R, temperature=0.0, eos_token_id=eos)
    N = len(prompts)
    assert ro.tokens.shape == (N * R, W) and ro.p.shape[:2] == (N * R, W)
    accepted = []
    for i, prompt in enumerate(prompts):
        seq, ref = _hand_rolled_greedy(d, model, prompt, R)
        assert ro.sequences[i] == seq  # greedy: the target's own continuation, identical to the hand-rolled one
        for r, h in enumerate(ref):
            got = ro.rounds[r * N + i]
            assert (got["seq"], got["round"]) == (i, r)
            assert (got["anchor"], got["tokens"], got["accepted"], got["bonus"]) == \
                (h["anchor"], h["tokens"], h["accepted"], h["bonus"])
            n = r * N + i  # round-major rows
            assert int(ro.anchors[n]) == h["anchor"] and ro.tokens[n].tolist() == h["tokens"]
            torch.testing.assert_close(ro.p[n], h["p"], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(ro.logits[n], h["q"], atol=2e-4, rtol=1e-4)
            accepted.append(h["accepted"])
    assert 0 in accepted and any(0 < m < W for m in accepted), accepted  # partial acceptance exercised
    # the loss supervises those rows: re-scored logits = the rollout's, tokens = the drafts, E2E-TV by hand
    loss, _, br = bench.draft_opd_loss(d, ro, N)
    cu = torch.cumsum(torch.tensor([0] + [len(s) for s in ro.sequences]), 0)
    assert torch.equal(br.anchors, cu[torch.arange(N * R) % N] + ro.anchors)
    assert torch.equal(br.tokens, ro.tokens)
    torch.testing.assert_close(br.logits.detach(), ro.logits, atol=2e-4, rtol=1e-4)
    p_ref = torch.stack([_hand_rolled_greedy(d, model, prompts[n % N], R)[1][n // N]["p"] for n in range(N * R)])
    # a drafted EOS ends what can be accepted: the positions after it are not supervised
    valid = torch.tensor([[eos not in ro.tokens[n, :j].tolist() for j in range(W)] for n in range(N * R)])
    assert not bool(valid.all())  # the tiny target's EOS is drafted: the rule is exercised
    assert loss.item() == pytest.approx(_hand_e2e_tv(br.logits.detach(), p_ref, valid, d.cfg.loss_gamma), abs=1e-5)
    d.zero_grad(set_to_none=True)
    loss.backward()
    assert d.fc.weight.grad is not None and float(d.fc.weight.grad.abs().sum()) > 0


def test_draft_opd_temperature_one_rounds_are_consistent(trained, hf_target, target, one_thread):
    """At T = 1 (sampled drafts, rejection sampling) every round still supervises its own drafts
    with the target's distribution after stem[:a+1] + drafts, and commits exactly the accepted
    prefix and the bonus token; a drafted EOS invalidates the later positions."""
    d, prompts = trained
    model = hf_target[0]
    R, W, N = 3, d.draft_width, len(prompts)
    eos = target.eos_token_id
    ro = bench.draft_opd_rollout(d, model, prompts, R, temperature=1.0, generator=torch.Generator().manual_seed(3),
                                 eos_token_id=eos)
    for n, rd in enumerate(ro.rounds):
        seq, a, y, m = ro.sequences[rd["seq"]], rd["anchor"], rd["tokens"], rd["accepted"]
        assert n == rd["round"] * N + rd["seq"]
        assert seq[a + 1:a + 1 + m] == y[:m] and seq[a + 1 + m] == rd["bonus"]
        full = _target_logits(model, seq[:a + 1] + y)
        torch.testing.assert_close(ro.p[n], F.softmax(full[a:a + W], -1), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(ro.logits[n], _drafter_logits(d, model, seq, a), atol=2e-4, rtol=1e-4)
        ended = [eos in y[:j] for j in range(W)]
        assert ro.valid[n].tolist() == [not e for e in ended]
    assert [len(s) for s in ro.sequences] == [len(p) + 1 + sum(r["accepted"] + 1 for r in ro.rounds if r["seq"] == i)
                                              for i, p in enumerate(prompts)]


# ------------------------------------------------------------------------------ --quick run
def _spread(xs):
    return statistics.median(xs), min(xs), max(xs)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("specopd") / "specopd.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "specopd.py"), "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text()), out


@pytest.mark.slow  # a vLLM engine and 40 training steps in a subprocess: 15-70 s
def test_quick_bench_acceptance_recomputed_from_vllm_rounds(quick, hf_target):
    data, out = quick
    c, s = data["config"], data["summary"]
    k, seeds = c["k"], [str(x) for x in c["seeds"]]
    assert (k, c["block_size"], c["kind"]) == (7, 8, "dflash") and len(seeds) >= 2
    arms = list(data["acceptance"]["0"])
    assert arms == ["init", "offpolicy_ce", "offpolicy_e2e_tv", "onpolicy_e2e_tv", "onpolicy_e2e_tv_greedy"]
    n_prompts = c["eval_prompts"]
    for T, per_prompt in (("0", 1), ("1", c["t1_samples"])):
        for arm in arms:
            lens = []
            for sd in seeds:
                reqs = data["acceptance"][T][arm][sd]["per_request_rounds"]
                assert len(reqs) == n_prompts * per_prompt
                rounds = [m for req in reqs for m in req]
                assert rounds and all(0 <= m <= k for m in rounds)
                acc = 1 + sum(rounds) / len(rounds)
                surv = [sum(m >= j for m in rounds) / len(rounds) for j in range(1, k + 1)]
                assert s["acceptance"][T][arm]["per_seed"][sd] == pytest.approx(acc, abs=1e-12)
                assert acc == pytest.approx(1 + sum(surv), abs=1e-12)  # the survival curve adds up to the length
                lens.append(acc)
                if T == "0":
                    # vLLM's greedy acceptance agrees with the offline estimate's serving walk
                    off = data["offline"][sd][arm]
                    assert acc == pytest.approx(off["walk_len"], rel=0.05)
            assert (s["acceptance"][T][arm]["acceptance_len"]["median"], s["acceptance"][T][arm]["acceptance_len"]["min"],
                    s["acceptance"][T][arm]["acceptance_len"]["max"]) == pytest.approx(_spread(lens))
            for j in range(k):
                per_seed = [sum(m >= j + 1 for req in data["acceptance"][T][arm][sd]["per_request_rounds"] for m in req)
                            / sum(len(req) for req in data["acceptance"][T][arm][sd]["per_request_rounds"])
                            for sd in seeds]
                assert s["acceptance"][T][arm]["survival"][j]["median"] == pytest.approx(statistics.median(per_seed))
        for arm in ("onpolicy_e2e_tv", "onpolicy_e2e_tv_greedy"):
            on = s["acceptance"][T][arm]["per_seed"]
            for base in ("offpolicy_ce", "offpolicy_e2e_tv"):
                b = s["acceptance"][T][base]["per_seed"]
                paired = [100 * (on[sd] / b[sd] - 1) for sd in seeds]
                g = s["gains_pct"][T][arm][base]
                assert (g["paired"]["median"], g["paired"]["min"], g["paired"]["max"]) == pytest.approx(_spread(paired))
                assert g["of_medians"] == pytest.approx(
                    100 * (statistics.median(on.values()) / statistics.median(b.values()) - 1))
    # greedy serving is lossless for every drafter: the target's own greedy responses (HF, computed here)
    from cotrain.draft.distill import generate_records, load_distill_config, load_prompts

    model, tok = hf_target
    cfg = load_distill_config(REPO / "configs" / "distill_dflash.yaml")
    d = cfg.data
    prompts = load_prompts(d, c["train_prompts"] + n_prompts, d.seed)[c["train_prompts"]:]
    ref = [r.response for r in generate_records(model, tok, prompts, d.max_new_tokens, 0)]
    for arm in arms:
        for sd in seeds:
            assert data["acceptance"]["0"][arm][sd]["token_ids"] == ref
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.slow  # a vLLM engine and 40 training steps in a subprocess: 15-70 s
def test_quick_bench_same_budget_for_the_three_objectives(quick):
    data, _ = quick
    c = data["config"]
    seeds = [str(x) for x in c["seeds"]]
    arms = list(bench.ARMS)
    for sd in seeds:
        tr = data["training"][sd]
        assert {tr[a]["steps"] for a in arms} == {c["steps"]}
        assert len({tr[a]["batches_sha"] for a in arms}) == 1  # the same sequences at every step
        assert {tr[a]["start_sha"] for a in arms} == {tr["init_sha"]}  # the same init (the warm start)
        assert len({tr[a]["final_sha"] for a in arms}) == len(arms)  # and different results
        assert tr["warm"]["final_sha"] == tr["init_sha"] and tr["warm"]["start_sha"] == tr["random_init_sha"]
    # seeds differ: init and batches
    assert len({data["training"][sd]["init_sha"] for sd in seeds}) == len(seeds)
    assert len({data["training"][sd]["offpolicy_ce"]["batches_sha"] for sd in seeds}) == len(seeds)


@pytest.mark.slow  # a vLLM engine and 40 training steps in a subprocess: 15-70 s
def test_quick_bench_throughput_recomputed_and_interleaved(quick):
    data, _ = quick
    tp, t = data["throughput"], data["summary"]["throughput"]
    c = data["config"]
    n = c["tput_seqs"] * c["anchors_per_seq"] * c["k"]  # the same supervised positions in every arm
    arms = ["specopd", "draft_opd", "draft_opd_long"]
    assert tp["plan"]["draft_opd_long"] == {"sequences": c["tput_seqs"] * c["anchors_per_seq"] // c["tput_long_rounds"],
                                            "rounds_or_anchors": c["tput_long_rounds"]}
    for arm in arms:
        assert len(tp[arm]) == c["tput_repeats"]
        for r in tp[arm]:
            assert r["supervised"] == r["nominal"] == n
    for arm in arms[1:]:  # Draft-OPD's raw rounds: sequences x rounds per update, each accepting 0..W drafts
        plan = tp["plan"][arm]
        for r in tp[arm]:
            assert len(r["accepted"]) == plan["sequences"] * plan["rounds_or_anchors"]
            assert all(0 <= m <= c["k"] for m in r["accepted"])
            assert r["prefill_s"] + r["draft_s"] + r["verify_s"] <= r["seconds"]
        ratio = [(x["supervised"] / x["seconds"]) / (y["supervised"] / y["seconds"]) for x, y in zip(tp["specopd"], tp[arm])]
        got = t[arm]["ratio_specopd_over"]
        assert (got["median"], got["min"], got["max"]) == pytest.approx(_spread(ratio))
    assert t["specopd"]["supervised_tokens_per_s"]["median"] == pytest.approx(
        statistics.median([a["supervised"] / a["seconds"] for a in tp["specopd"]]))
    # interleaved: within each repeat the arms ran back to back, the order rotated every repeat
    events = sorted((r["start"], arm, i) for arm in arms for i, r in enumerate(tp[arm]))
    for rep in range(c["tput_repeats"]):
        group = events[3 * rep:3 * rep + 3]
        assert {e[2] for e in group} == {rep} and [e[1] for e in group] == tp["order"][rep]
        if rep:
            prev = tp["order"][rep - 1]
            assert tp["order"][rep] == prev[1:] + prev[:1]
