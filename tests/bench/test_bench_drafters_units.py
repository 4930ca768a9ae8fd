"""bench/drafters.py's method without vLLM: every round runs every workload on every engine, the
engine order rotates, and the ratios are paired within a round (seconds apart), not across arms."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_drafters", ROOT / "bench" / "drafters.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


class FakeLLM:
    """An engine stand-in: run_workload is replaced below, so only its name matters."""

    def __init__(self, name):
        self.name = name


def test_rounds_interleave_rotate_and_pair(monkeypatch):
    log = []
    engines = {n: FakeLLM(n) for n in ("none", "a", "b")}
    # the machine gets 2x slower from the third timed round on (load drift); engine "a" is always
    # 2x faster than "none" within a round

    def run(llm, calls_, params):
        rnd = len([x for x in log if x == llm.name])  # 0 = warm-up, then timed rounds 1..4
        load = 2.0 if rnd >= 3 else 1.0
        log.append(llm.name)
        secs = load * (0.5 if llm.name == "a" else 1.0)
        return {"tokens": 100, "seconds": secs, "tokens_per_s": 100 / secs, "accepted": 0, "verify_rounds": 0,
                "token_ids": [[1]]}

    monkeypatch.setattr(bench, "run_workload", run)
    runs, loads = bench.interleaved_rounds(engines, {"w": ([["p"]], None)}, rounds=4, warmup=1, progress=False)
    # the warm-up round plus 4 timed rounds, all engines in each, order rotated every round
    rounds = [log[i:i + 3] for i in range(0, len(log), 3)]
    assert rounds == [["b", "none", "a"], ["none", "a", "b"], ["a", "b", "none"], ["b", "none", "a"],
                      ["none", "a", "b"]]
    assert len(loads) == 4 and all(len(v) == 4 for v in runs["w"].values())
    arms, ratios, _ = bench.summarize_throughput(runs)
    # paired within rounds: "a" is 2x in every round although the machine slowed down midway
    assert ratios["w"]["a"]["per_round"] == [2.0] * 4 and ratios["w"]["b"]["median"] == 1.0
    assert arms["w"]["none"]["tokens_per_s"]["min"] == 50.0 and arms["w"]["none"]["tokens_per_s"]["max"] == 100.0


def test_presets_and_report_args(tmp_path):
    a = bench.parse_args(["--quick"])
    assert a.preset == "quick" and a.rounds >= 2 and a.png is None and a.out.name == "drafters-quick.json"
    a = bench.parse_args(["--gpu", "--rounds", "3"])
    assert a.preset == "gpu" and a.rounds == 3 and a.samples == 8
    a = bench.parse_args([])
    assert a.png == ROOT / "docs" / "img" / "drafters.png" and a.rounds == 9
