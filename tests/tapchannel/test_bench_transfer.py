"""bench/tapchannel.py's raw transfer mode (the GPU check runs it with --device cuda: cuda_ipc on one
GPU), run here on CPU through shm: every microbatch of the first round is checked on the reader
against what the writer sent (a mismatch fails the rank, and the script), and the JSON's
summaries follow the sizes asked for."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_transfer_mode_on_cpu(tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "tapchannel.py"), "--transfer", "--ipc-taps", "2", "--ipc-tokens", "64",
           "--ipc-width", "16", "--ipc-dtype", "float32", "--ipc-iters", "3", "--ipc-rounds", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    res = json.loads((tmp_path / "tapchannel_transfer_cpu.json").read_text())
    assert res["transport"] == "shm" and res["payload_bytes_per_microbatch"] == 2 * 64 * 16 * 4
    assert res["iters_per_round"] == 3
    for key in ("GB_per_s_zero_copy_read", "GB_per_s_with_copy_out", "latency_s_one_microbatch", "writer_s_per_microbatch"):
        assert 0 < res[key]["min"] <= res[key]["median"] <= res[key]["max"], key
    assert res["reader_wait_s_per_round_zero_copy"]["min"] >= 0
