"""The local Ray cluster cotrain starts (cotrain.rl.ray_workers.init_ray): token authentication on,
with Ray's token file readable by its owner only (Ray 2.60 writes it 0644). In a subprocess: the
cluster dies with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, stat, sys
from pathlib import Path
token = Path(sys.argv[1])
token.parent.mkdir(parents=True, exist_ok=True)
token.write_text("x" * 64)
token.chmod(0o644)  # as Ray 2.60 writes it
os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
import ray
from cotrain.config import load_config
from cotrain.rl.ray_workers import init_ray
init_ray(load_config("configs/grpo.yaml", ["cluster.cpus_per_node=2", f"run.output_dir={sys.argv[2]}"]))
from ray._private.authentication.authentication_token_setup import AUTH_MODE_ENV_VAR
print(json.dumps({"auth": os.environ.get(AUTH_MODE_ENV_VAR), "mode": stat.S_IMODE(token.stat().st_mode)}))
ray.shutdown()
"""


def test_local_cluster_has_token_auth_and_a_private_token(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ray" / "auth_token"), str(tmp_path / "run")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["auth"] == "token" and got["mode"] == 0o600
