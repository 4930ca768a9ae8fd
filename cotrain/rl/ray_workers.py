"""The default workers of a GRPO run: Megatron trainers and vLLM engines as Ray actors.

:class:`RayWorkers` is the driver's default :class:`~cotrain.rl.interfaces.WorkerFactory`: it joins
(or starts) Ray (:func:`init_ray`), reserves one placement group when the run spans several nodes
or colocates engines with the trainers on GPUs (:class:`~cotrain.placement.ClusterPlacement`,
docs/multinode.md: colocated engines share the trainer ranks' GPU bundles), and builds the
:class:`~cotrain.rl.workers.TrainerGroup` and the :class:`~cotrain.rl.rollout.RolloutGroup`.
"""

from __future__ import annotations

import os
from pathlib import Path

from cotrain.rl.interfaces import GenerationBackend, TrainingBackend, WorkerFactory


class RayWorkers(WorkerFactory):
    def __init__(self, cfg):
        self.cfg = cfg
        self.placement = None  # cotrain.placement.ClusterPlacement: several nodes, or colocated

    def start(self) -> None:
        init_ray(self.cfg)
        # every rank and engine on its node (docs/multinode.md); colocated: in the ranks' GPU bundles
        if self.cfg.cluster.num_nodes > 1 or self.cfg.rollout.colocate:
            from cotrain.placement import ClusterPlacement

            self.placement = ClusterPlacement(self.cfg)
            print("placement:\n  " + self.placement.describe().replace("\n", "\n  "))

    def trainer(self, model_path: str, draft_init: str | None) -> TrainingBackend:
        from cotrain.rl.workers import TrainerGroup

        return TrainerGroup(self.cfg, model_path, draft_init=draft_init, placement=self.placement)

    def rollout(self, model_path: str, draft_model: str | None) -> GenerationBackend:
        from cotrain.rl.rollout import RolloutGroup

        return RolloutGroup.from_config(self.cfg, model_path=model_path, draft_model=draft_model,
                                        placement=self.placement)

    def check_alive(self, what: str) -> None:
        if self.placement is not None:
            self.placement.check(what, force=True)

    def close(self) -> None:
        if self.placement is not None:
            self.placement.remove()


def init_ray(cfg) -> None:
    """Join the configured Ray cluster, or start a local one that dies with this process.

    A local cluster's processes are this driver's descendants. Ray's own fate sharing leaves two of
    them behind when the driver is SIGKILLed (the dashboard and runtime-env agents outlive their
    raylet, measured 45 s and more), so a small reaper process (:func:`start_reaper`) kills what is
    left of them once the driver is gone. SIGTERM (``kill``, ``ray job stop``) raises SystemExit(143)
    in the driver (:func:`exit_on_sigterm`): ``finally`` blocks (worker shutdown) and ``ray.shutdown``
    run and the process exits 143, where Ray's own handlers print a C++ stack and end it with SIGABRT."""
    import ray

    if ray.is_initialized():
        return
    address = cfg.cluster.ray_address
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = "auto"  # launched by `ray job submit`: join that cluster
    if address in (None, "local"):
        # the dashboard on loopback; Ray 2.60's gRPC servers bind every interface and ray.init turns a
        # loopback node address into the machine's own: its token authentication guards them, with
        # the token private (docs/multinode.md, "Securing a cluster")
        ray.init(address="local", num_cpus=cfg.cluster.cpus_per_node, num_gpus=cfg.cluster.gpus_per_node or None,
                 include_dashboard=False, dashboard_host="127.0.0.1", log_to_driver=False)
        private_token_file()
        start_reaper()
    else:
        ray.init(address=address, log_to_driver=False)
    exit_on_sigterm()


def private_token_file() -> Path | None:
    """Ray's authentication token (``~/.ray/auth_token``, which Ray 2.60 writes readable by every
    local user) made readable by its owner only. Returns the file, if there is one."""
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if path.is_file() and path.stat().st_mode & 0o077:
        path.chmod(0o600)
    return path if path.is_file() else None


_REAPER_SOURCE = r"""
import os, sys, time
import psutil
driver, grace = psutil.Process(int(sys.argv[1])), float(sys.argv[2])
known = {}
while True:
    try:
        if driver.status() == psutil.STATUS_ZOMBIE:
            break
        for p in driver.children(recursive=True):
            known.setdefault(p.pid, p)
    except psutil.Error:  # gone (is_running/status compare the creation time: no pid reuse)
        break
    time.sleep(1.0)
time.sleep(grace)  # Ray's own fate sharing goes first
left = [p for p in known.values() if p.pid != os.getpid() and p.is_running()]
for p in left:
    try:
        p.terminate()
    except psutil.Error:
        pass
_, left = psutil.wait_procs(left, timeout=5)
for p in left:
    try:
        p.kill()
    except psutil.Error:
        pass
"""
_reaper = None


def start_reaper(grace_s: float = 2.0):
    """Start (once per process) a detached watcher of this process: it records this process's
    descendants every second and, once this process has exited - normally or killed - gives them
    ``grace_s`` to exit and then terminates (after 5 s kills) those still running. Only processes
    it saw as descendants are touched (psutil checks creation times, so no reused pid)."""
    global _reaper
    import subprocess
    import sys

    if _reaper is None or _reaper.poll() is not None:
        _reaper = subprocess.Popen([sys.executable, "-c", _REAPER_SOURCE, str(os.getpid()), str(grace_s)],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
    return _reaper


def exit_on_sigterm() -> None:
    """SIGTERM -> SystemExit(143) in the main thread, installed after ``ray.init`` (whose handlers
    would dump a C++ stack and abort the process); a second SIGTERM kills outright."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
