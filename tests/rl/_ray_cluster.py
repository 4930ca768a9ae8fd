"""A loopback Ray cluster for end-to-end tests, isolated from any other Ray on the machine.

    from _ray_cluster import ray_cluster, submit_job    # the fixture and the helper

    def test_something(ray_cluster):                     # ray_cluster: the dashboard address
        status, logs = submit_job(ray_cluster, ["python", "launch/grpo.py", ...], timeout=900)
        assert status == "SUCCEEDED", logs[-4000:]

The cluster is ``ray start --head --block`` with its own temporary directory and its own free
ports (GCS, dashboard, dashboard agent, runtime-env agent, metrics, node and object managers, Ray
client; workers on random ports), so it cannot collide with another Ray on the machine (8265,
52365, ... may be taken). Its ports lie outside the kernel's ephemeral range, where no ``bind(0)``
or outgoing connection lands, and a start that still loses one is retried on fresh ports. The fixture waits until the dashboard's job agent accepts a job (a
job submitted too early fails with "No available agent to submit job"). Teardown stops exactly
this cluster: SIGTERM to its ``ray start --block`` process (which shuts its node down), then
SIGKILL to any process of it still alive - its descendants, recorded before the stop, and any
process naming its temporary directory. It never runs ``ray stop``, which stops every Ray of the
machine's user.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = str(Path(sys.executable).parent)
RAY = str(Path(BIN) / "ray")
# Ray >= 2.5x turns token authentication on for `ray start` when ~/.ray/auth_token exists (any earlier
# ray.init writes one), and job submission then needs the token too; a loopback test cluster opts out.
# The job's `python` is looked up on PATH by the cluster: put this interpreter's environment first
# (CI runs pytest as .venv/bin/python without activating the venv). No drain wait on SIGTERM.
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled",
       "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}
ENV.pop("RAY_ADDRESS", None)
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
PORT_FLAGS = ("--port", "--dashboard-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
              "--runtime-env-agent-port", "--metrics-export-port", "--node-manager-port", "--object-manager-port",
              "--ray-client-server-port")


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports bound to 0 and outgoing connections (Linux's default otherwise)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on every address right now, drawn outside the kernel's ephemeral
    range: a port handed out by ``bind(0)`` can be handed again to any process (a Ray worker's, a
    connection's) between our release and Ray's bind; one below the range is only ever taken by a
    process that names it."""
    lo, hi = _ephemeral_range()
    pool = [p for p in range(10000, 65536) if not lo <= p <= hi]
    random.SystemRandom().shuffle(pool)  # not the module's generator, which a test may have seeded
    socks = []
    try:
        for port in pool:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            if len(socks) == n:
                return [s.getsockname()[1] for s in socks]
        raise RuntimeError(f"fewer than {n} free ports outside the ephemeral range {lo}-{hi}")
    finally:
        for s in socks:
            s.close()


def _http(method: str, url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with closing(urllib.request.urlopen(req, timeout=timeout)) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout) as e:
        return 0, f"{type(e).__name__}: {e}"


@dataclass
class LoopbackCluster:
    address: str  # the dashboard, http://127.0.0.1:PORT: what `ray job submit --address` takes
    gcs_address: str
    temp_dir: Path
    proc: subprocess.Popen
    log: Path
    seen: dict = field(default_factory=dict)  # pid -> psutil.Process of every descendant observed

    def record(self) -> None:
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def processes(self) -> list[psutil.Process]:
        """This cluster's processes still running: recorded descendants, and any naming its temp dir."""
        self.record()
        alive = {pid: p for pid, p in self.seen.items() if p.is_running()}
        tag = str(self.temp_dir)
        for p in psutil.process_iter(["cmdline"]):
            try:
                if tag in " ".join(p.info["cmdline"] or []):
                    alive.setdefault(p.pid, p)
            except psutil.Error:
                pass
        alive.pop(os.getpid(), None)
        return [p for p in alive.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    def stop(self, timeout: float = 60) -> list[str]:
        """Stop this cluster only; returns the processes that needed SIGKILL (for diagnostics)."""
        self.record()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `ray start --block`: shuts its own node down
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        _, alive = psutil.wait_procs(self.processes(), timeout=10)
        killed = []
        for p in alive:
            try:
                killed.append(f"{p.pid} {p.name()}")
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return killed


PORT_CLASH = ("address already in use", "Failed to find a valid port", "already occupied")


def start_cluster(num_cpus: int = 4, timeout: float = 240, attempts: int = 3) -> LoopbackCluster:
    """``ray start --head --block`` on loopback with its own temp dir and free ports; returns once
    the dashboard's job agent runs jobs. A start that fails because another process bound one of its
    ports in between is retried on fresh ports, up to ``attempts`` times."""
    attempt = 1
    while True:
        # short: Ray's unix sockets live under it (a socket path has at most 107 bytes)
        temp_dir = Path(tempfile.mkdtemp(prefix="cotrain-ray-", dir="/tmp"))
        ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
        log = temp_dir / "ray_start.log"
        cmd = [RAY, "start", "--head", "--block", "--num-cpus", str(num_cpus), "--node-ip-address", "127.0.0.1",
               "--dashboard-host", "127.0.0.1", "--include-dashboard", "true", "--disable-usage-stats",
               "--temp-dir", str(temp_dir), "--min-worker-port", "0", "--max-worker-port", "0"]
        for flag, port in ports.items():
            cmd += [flag, str(port)]
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, env=ENV, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        cluster = LoopbackCluster(address=f"http://127.0.0.1:{ports['--dashboard-port']}",
                                  gcs_address=f"127.0.0.1:{ports['--port']}", temp_dir=temp_dir, proc=proc, log=log)
        try:
            wait_for_job_agent(cluster, timeout)
            return cluster
        except BaseException as e:
            cluster.stop()
            if attempt >= attempts or not (isinstance(e, RuntimeError) and any(m in str(e) for m in PORT_CLASH)):
                raise
        print(f"ray start lost a port to another process (attempt {attempt}/{attempts}); retrying on fresh ports",
              file=sys.stderr)
        attempt += 1


def wait_for_job_agent(cluster: LoopbackCluster, timeout: float) -> None:
    """Until a trivial job submitted to the dashboard succeeds (the dashboard answers before its job
    agent has registered; a submission in between fails with "No available agent")."""
    deadline = time.monotonic() + timeout
    last = ""
    sid = None
    while time.monotonic() < deadline:
        if cluster.proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {cluster.proc.returncode}:\n{cluster.log.read_text()[-4000:]}")
        cluster.record()
        if sid is None:
            code, text = _http("POST", f"{cluster.address}/api/jobs/", {"entrypoint": "echo job agent ready"})
            if code == 200:
                sid = json.loads(text)["submission_id"]
            else:
                last = f"submit: HTTP {code} {text[:300]}"
                time.sleep(2)
                continue
        code, text = _http("GET", f"{cluster.address}/api/jobs/{sid}")
        status = json.loads(text).get("status") if code == 200 else None
        if status == "SUCCEEDED":
            return
        if status in ("FAILED", "STOPPED"):
            raise RuntimeError(f"the readiness job ended {status}: {text[:2000]}")
        last = f"readiness job: {status or f'HTTP {code} {text[:300]}'}"
        time.sleep(1)
    raise TimeoutError(f"the job agent of {cluster.address} was not ready within {timeout:.0f} s ({last});\n"
                       f"{cluster.log.read_text()[-4000:]}")


def submit_job(address: str, args: list[str], timeout: float, working_dir: str | Path = ROOT,
               excludes: tuple[str, ...] = (".venv", ".git", "runs")) -> tuple[str, str]:
    """Run ``args`` as a Ray job (``ray job submit``, ``working_dir`` uploaded minus ``excludes``)
    and wait for it; returns (status, logs). status is the job's final status (SUCCEEDED, FAILED,
    STOPPED), or ``TIMEOUT`` when it did not end within ``timeout`` seconds (it is then stopped)."""
    deadline = time.monotonic() + timeout
    sid = f"cotrain-test-{uuid.uuid4().hex[:12]}"
    cmd = [RAY, "job", "submit", "--address", address, "--submission-id", sid, "--no-wait",
           "--working-dir", str(working_dir), "--runtime-env-json", json.dumps({"excludes": list(excludes)}), "--", *args]
    while True:
        proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=max(30, deadline - time.monotonic()))
        out = proc.stdout + proc.stderr
        if proc.returncode == 0:
            break
        if "No available agent" not in out or time.monotonic() > deadline:
            return "SUBMIT_FAILED", out
        time.sleep(2)
    status = None
    while time.monotonic() < deadline:
        code, text = _http("GET", f"{address}/api/jobs/{sid}")
        status = json.loads(text).get("status") if code == 200 else None
        if status in TERMINAL:
            break
        time.sleep(2)
    else:
        _http("POST", f"{address}/api/jobs/{sid}/stop")
        status = "TIMEOUT"
    code, text = _http("GET", f"{address}/api/jobs/{sid}/logs")
    logs = json.loads(text).get("logs", "") if code == 200 else f"(no logs: HTTP {code} {text[:300]})"
    return status, logs


@pytest.fixture(scope="module")
def ray_cluster():
    """A loopback Ray cluster of this test module (see the module docstring); yields its address."""
    cluster = start_cluster()
    try:
        yield cluster.address
    finally:
        cluster.stop()
