"""The GPU check's machinery, on CPU (docs/setup.md, "The GPU check").

- scripts/gpu_wheels.sh --list is scripts/gpu_wheels.txt, pinned to this environment's versions.
- Every file in tests/gpu (and the GPU measurements) imports, transitively, only packages the GPU
  machine has (scripts/gpu_machine.txt and what those require) or the check carries
  (scripts/gpu_wheels.txt); the checker itself flags a test that imports ray.
- Without CUDA tests/gpu collects and skips, nothing fails.
- gpu_check.sh --dry-run prints its stages and the carried size (recomputed here from git and .whl/);
  a run on this GPU-less machine fails at env, goes on, and writes summary.json within 8 files.
"""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
#: what the GPU machine does not have (its description); none of it may load in a GPU test
ABSENT_THERE = ("ray", "vllm", "flash_attn", "transformer_engine", "apex")
STAGES = ["env", "wheels", "imports", "pytest-gpu", "cotrain-step", "verify-cost", "cp-attention", "tapchannel",
          "pytest-heavy"]


def _pins(path: Path) -> list[tuple[str, str]]:
    return re.findall(r"^\s*([A-Za-z0-9_.\-]+)==([^\s#]+)", path.read_text(), re.M)


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _run(cmd, timeout=300, env=None):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_wheel_list_is_what_the_script_downloads_pinned_to_this_environment():
    pins = _pins(ROOT / "scripts" / "gpu_wheels.txt")
    r = _run(["bash", "scripts/gpu_wheels.sh", "--list"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [f"{n}=={v}" for n, v in pins]
    for name, version in pins:  # the GPU runs the code the CPU tests ran
        assert importlib.metadata.version(name) == version, name
    carried = {_canon(n) for n, _ in pins}
    machine = {_canon(re.split(r"[=<>\s#]", line.strip())[0]) for line in
               (ROOT / "scripts" / "gpu_machine.txt").read_text().splitlines() if line.strip() and not line.startswith("#")}
    assert {"megatron-core", "pydantic", "pydantic-core"} <= carried
    assert not carried & machine, "a carried wheel the machine already has"


def _imports(*targets) -> tuple[int, dict]:
    r = _run([sys.executable, "scripts/gpu_imports.py", "--check", *map(str, targets)])
    return r.returncode, json.loads(r.stdout)


def test_gpu_tests_import_only_what_the_gpu_machine_has_or_the_check_carries():
    rc, res = _imports("--gpu-check")  # tests/gpu, the measurements and what they import lazily
    assert res["errors"] == {}
    assert res["outside"] == [], f"imported by tests/gpu, in neither scripts/gpu_wheels.txt nor the machine's list: {res['outside']}"
    assert not set(ABSENT_THERE) & {p.split(".")[0] for p in res["packages"]}
    assert rc == 0
    # and every carried wheel is used: each listed distribution owns a package the GPU tests load
    used = set(res["packages"].values())
    assert {_canon(n) for n, _ in _pins(ROOT / "scripts" / "gpu_wheels.txt")} <= used


def test_the_import_check_flags_a_package_the_machine_lacks(tmp_path):
    bad = tmp_path / "test_uses_ray.py"
    bad.write_text("import ray\n")
    good = tmp_path / "test_uses_carried.py"
    good.write_text("import pydantic\nimport megatron.core\nimport transformers\n")
    rc, res = _imports(bad)
    assert rc == 1 and "ray" in res["outside"]
    rc, res = _imports(good)
    assert rc == 0 and res["outside"] == [] and res["packages"]["pydantic"] == "pydantic"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without CUDA")
def test_gpu_folder_collects_and_skips_without_cuda():
    r = _run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-rs"], timeout=600)
    assert r.returncode in (0, 5), r.stdout[-3000:]  # 5: no test files yet
    assert " failed" not in r.stdout and " error" not in r.stdout, r.stdout[-3000:]
    if r.returncode == 0:
        assert "needs a CUDA device" in r.stdout and " passed" not in r.stdout


def _carried_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    tree = sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())
    whl = sum(p.stat().st_size for p in (ROOT / ".whl").rglob("*") if p.is_file()) if (ROOT / ".whl").exists() else 0
    return tree + whl


def test_dry_run_prints_the_stages_and_the_carried_size():
    r = _run(["bash", "scripts/gpu_check.sh", "--dry-run"])
    assert r.returncode == 0, r.stdout + r.stderr
    listed = re.findall(r"^(\S+)\s+(\d+)\s+(required|heavy)\s", r.stdout, re.M)
    assert [s for s, _, _ in listed] == STAGES
    assert all(int(limit) <= 600 for _, limit, _ in listed)
    travels = float(re.search(r"travels \(repository \+ wheels\): ([\d.]+) MiB", r.stdout).group(1))
    assert travels < 64
    assert abs(travels - _carried_bytes() / 2**20) < 0.05
    assert "budget 405s" in r.stdout  # under 7 minutes


@pytest.mark.slow
def test_check_without_a_gpu_fails_at_env_goes_on_and_writes_its_summary(tmp_path):
    out = tmp_path / "out"
    r = _run(["bash", "scripts/gpu_check.sh"], timeout=300,
             env={"OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_BUDGET_S": "50", "TMPDIR": str(tmp_path)})
    assert r.returncode == 1
    summary = json.loads((out / "summary.json").read_text())
    status = {s["stage"]: s["status"] for s in summary["stages"]}
    assert [s["stage"] for s in summary["stages"]] == STAGES
    assert status["env"].startswith("FAILED") and status["wheels"] == "ok"  # every wheel is installed here already
    assert summary["passed"] is False
    files = list(out.iterdir())
    assert len(files) <= 8 and all(f.stat().st_size <= 16 * 2**20 for f in files)
    assert {"summary.json", "gpu_check.log"} <= {f.name for f in files}


def _fake_wheel(folder: Path, name: str, version: str, tag: str = "py3-none-any") -> Path:
    """A minimal wheel of one module ``name`` (what pip --target needs: the module, METADATA, WHEEL, RECORD)."""
    import zipfile

    path = folder / f"{name}-{version}-{tag}.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}.py": f"VERSION = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
    return path


def _wheels_stage(tmp_path, listing: str) -> tuple[str, str]:
    """Run gpu_check.sh with a budget that ends soon after the wheels stage; (its status, the log)."""
    (tmp_path / "list.txt").write_text(listing)
    out = tmp_path / "out"
    _run(["bash", "scripts/gpu_check.sh"], timeout=120,
         env={"OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_BUDGET_S": "27", "WHEEL_DIR": str(tmp_path / "whl"),
              "TMPDIR": str(tmp_path),
              "GPU_WHEELS_LIST": str(tmp_path / "list.txt")})
    summary = json.loads((out / "summary.json").read_text())
    status = {s["stage"]: s["status"] for s in summary["stages"]}
    return status["wheels"], (out / "gpu_check.log").read_text()


def test_wheels_stage_installs_only_what_is_missing_and_names_what_has_no_wheel(tmp_path):
    (tmp_path / "whl").mkdir()
    _fake_wheel(tmp_path / "whl", "h4probe", "1.0")
    _fake_wheel(tmp_path / "whl", "h4other", "2.0", tag="cp27-cp27m-win32")  # not for this interpreter
    pyd = importlib.metadata.version("pydantic")
    status, log = _wheels_stage(tmp_path, f"pydantic=={pyd}  # installed here\nh4probe==1.0\n")
    assert status == "ok", log
    assert f"pydantic=={pyd}: already installed" in log
    assert "h4probe==1.0: h4probe-1.0-py3-none-any.whl" in log
    assert re.search(r"^h4probe\.py$", log, re.M)  # the --target folder's listing
    status, log = _wheels_stage(tmp_path, "h4probe==1.0\nh4other==2.0\n")
    assert status.startswith("FAILED")
    assert "no wheel for this Python" in log and "h4other==2.0" in log and "gpu_wheels.sh --python" in log
