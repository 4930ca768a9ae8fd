"""The GPU measurements' CPU paths (bench/gpu_verify_cost.py, bench/gpu_cotrain_step.py) on tiny shapes.

Each runs as the GPU check runs it, in a subprocess, with the packages the GPU machine lacks made
unimportable (a sitecustomize that puts None in sys.modules for them: ``import ray`` then fails as
it does there, ``find_spec`` says absent). Their numbers are recomputed here from the raw rounds they
write; the KV-cache crop the verification timing relies on is checked against a forward without cache.
"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ABSENT_THERE = ("ray", "vllm", "flash_attn", "transformer_engine", "apex")


@pytest.fixture
def gpu_machine_env(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"for name in {ABSENT_THERE!r}:\n"
        "    sys.modules[name] = None  # import fails, importlib.util.find_spec returns None\n")
    return {**os.environ, "PYTHONPATH": f"{site}:{ROOT}"}


def _bench(args, env, timeout=600):
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_verify_cost_cpu_path_writes_calibrate_shaped_points(tmp_path, gpu_machine_env):
    out = tmp_path / "out"
    _bench(["bench/gpu_verify_cost.py", "--device", "cpu", "--tiny", "--out", str(out), "--batch-sizes", "1,4,16",
            "--ks", "1,3", "--context", "16", "--rounds", "3", "--warmup", "1", "--acceptance-rate", "0.6"],
           gpu_machine_env)
    res = json.loads((out / "verify_cost.json").read_text())
    assert (out / "verify_cost.png").stat().st_size > 0
    assert not set(ABSENT_THERE) & set(res["python_packages"])
    assert [p["batch"] for p in res["points"]] == [1, 4, 16]
    a = 0.6
    for p in res["points"]:
        plain = [x["seconds"] for x in p["rounds"] if x["k"] == 0]
        assert len(plain) == 3 and p["plain_step_s"] == statistics.median(plain)
        rates = {0: p["batch"] / p["plain_step_s"]}
        for k in (1, 3):
            m = p["per_k"][str(k)]
            times = [x["seconds"] for x in p["rounds"] if x["k"] == k]
            assert m["round_s"] == statistics.median(times)
            e = sum(a ** j for j in range(k + 1))  # 1 + a + ... + a^k
            assert m["acceptance_length"] == pytest.approx(e)
            assert m["tokens_per_s"] == pytest.approx(p["batch"] * e / m["round_s"])
            assert m["cost_ratio"] == pytest.approx(m["round_s"] / p["plain_step_s"])
            rates[k] = m["tokens_per_s"]
        assert p["best_k"] == max(rates, key=rates.get)
    # calibrate's own report reads it, and its schedule covers 1..max_batch without gaps
    from cotrain.rl.calibrate import format_report

    assert "schedule:" in format_report(res)
    sched = res["schedule"]
    assert sched[0][0] == 1 and sched[-1][1] == 1024
    assert all(b[0] == a_[1] + 1 for a_, b in zip(sched, sched[1:]))


def test_crop_to_leaves_the_cache_a_forward_without_it_agrees_with():
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_verify_cost import TINY, build_model, crop_to
    from transformers import DynamicCache

    model = build_model(TINY, torch.device("cpu"), torch.float64)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, TINY["vocab_size"], (2, 12), generator=g)
    draft = torch.randint(0, TINY["vocab_size"], (2, 4), generator=g)
    nxt = torch.randint(0, TINY["vocab_size"], (2, 1), generator=g)
    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        model(input_ids=draft, past_key_values=cache, use_cache=True)  # a verification round, then dropped
        crop_to(cache, 12)
        assert cache.get_seq_length() == 12
        cached = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
        full = model(input_ids=torch.cat([prompt, nxt], dim=1)).logits[:, -1]
    torch.testing.assert_close(cached, full, rtol=1e-9, atol=1e-9)


@pytest.mark.slow
def test_cotrain_step_cpu_path_measures_both_drafters_through_the_trainer(tmp_path, gpu_machine_env):
    out = tmp_path / "out"
    _bench(["bench/gpu_cotrain_step.py", "--device", "cpu", "--tiny", "--out", str(out), "--rounds", "2",
            "--warmup", "0"], gpu_machine_env)
    res = json.loads((out / "cotrain_step.json").read_text())
    assert res["failures"] == {} and set(res["kinds"]) == {"dflash", "eagle3"}
    for kind, r in res["kinds"].items():
        assert not set(ABSENT_THERE) & set(r["python_packages"])
        assert r["response_tokens"] == res["seqs"] * (res["seq_len"] - res["prompt_len"] + 1)
        off = statistics.median(x["update_s"] for x in r["rounds"]["off"])
        on = statistics.median(x["update_s"] for x in r["rounds"]["on"])
        draft = statistics.median(x["draft_s"] for x in r["rounds"]["on"])
        assert len(r["rounds"]["off"]) == len(r["rounds"]["on"]) == 2
        assert r["overhead_paired"] == pytest.approx(on / off - 1)
        assert r["overhead_drafter"] == pytest.approx(draft / (on - draft))
        for x in r["rounds"]["on"]:  # the drafter stepped inside the recomputation, once per on-round
            assert 0 < x["draft_s"] < x["logprobs_s"]
            assert x["update_s"] == pytest.approx(x["logprobs_s"] + x["train_s"])
        assert all("draft_s" not in x for x in r["rounds"]["off"])
        assert r["draft_settings"]["tap_layers"]
