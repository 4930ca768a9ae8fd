"""Multi-node on one machine: Ray's own test harness (`ray.cluster_utils.Cluster`) starts several raylets
on 127.0.0.1, each its own Ray node with its own resources, and the demo runs across two of them.

The run: configs/demo.yaml (GRPO with a co-trained DFlash drafter serving the rollouts) at PP=2 with one
pipeline stage and one engine per node (`cluster.num_nodes=2`), drafter from scratch, 3 small steps with
a checkpoint after step 2. One Ray cluster serves the whole module: the reference (the same run on one
node) runs on its head node alone; then two nodes join, the two-node run takes the head and one of them,
the other is a spare. Checked:

- every rank and engine runs on the node the placement gives it (Ray node ids reported by the actors);
- the tap from stage 0 (the other node) reaches the drafter through gloo, stage 1's own tap stays local;
  on one node the same tap goes through shm (`tap/transport/<layer>`); the engine on the other node gets
  its weights through Ray's object store, the one beside trainer rank 0 from /dev/shm;
- rewards, losses and draft metrics are bit-identical to those of the one-node run (same seeds);
- killing node 1's raylet during step 3 fails the step within seconds with an error naming the step, the
  node and the rank and engine it held; step 3 is neither logged nor checkpointed;
- `--resume` (the same `GrpoRun.setup(resume=True)` that `launch/grpo.py --resume` calls) right after the
  death - the dead node still in the cluster, Ray's GCS still reporting it alive for ~15 s - places the
  run on the head and the spare (every actor new) and runs step 3 exactly as the one-node run did.

2-3 minutes on 2 cores, nearly all of it the three runs' start-up (trainers, engines) and the nodes';
a step takes < 1 s. `pytest -s` prints the phases' times.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from _ray_cluster import ROOT, free_ports

pytestmark = pytest.mark.slow  # end to end (CI runs slow tests too: `make test` runs everything)

RUN = ["grpo.num_steps=3", "grpo.prompts_per_step=4", "grpo.group_size=4", "policy.micro_batch_size=8",
       "policy.parallel.pipeline=2", "rollout.num_engines=2", "policy.reference_model=false",
       "checkpoint.every=2", "checkpoint.keep_last=null", "data.eval.every=0", "rollout.sampling.max_tokens=8",
       "logging.progress_bar=false", "logging.tensorboard=false", "draft.init=null", "draft.compare_frozen=false",
       "draft.optimizer.lr=3e-3"]
ONE_NODE = ["cluster.num_nodes=1", "cluster.cpus_per_node=4"]
TWO_NODES = ["cluster.num_nodes=2", "cluster.cpus_per_node=2"]  # a stage + an engine per node
EQUAL = ("reward/mean", "reward/std", "reward/accuracy", "response/length", "response/truncated", "train/loss",
         "train/grad_norm", "train/clip_frac", "kl/train_infer", "draft/loss", "draft/acceptance_offline",
         "draft/grad_norm", "spec/acceptance_length", "tap/bytes", "tap/moved_bytes")
NODE_ARGS = dict(num_cpus=2, node_ip_address="127.0.0.1", object_store_memory=200 * 2**20)  # the second node


def metrics(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _loopback_env() -> None:
    # every Ray listener on 127.0.0.1 (Ray reads this at import: set the constant too)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def _config(out: Path, *extra: str):
    from cotrain.config import load_config

    return load_config(str(ROOT / "configs/demo.yaml"), [f"run.output_dir={out}", *RUN, *extra])


@pytest.fixture(scope="module")
def cluster():
    """The module's Ray cluster (`ray.cluster_utils.Cluster`): a head node of 4 CPUs, its raylet on
    127.0.0.1 with its own temp dir and free ports where Ray would otherwise take fixed ones; the test
    process is the driver, on the head. The one-node reference runs on the head alone, then
    ``add_nodes(2)`` adds two nodes of 2 CPUs: the two-node run takes one of them, the other is the
    spare its resume moves to once the first is dead. Yields ``{"cluster", "head", "nodes", "add_nodes"}``.""" 
    import ray
    from ray.cluster_utils import Cluster

    _loopback_env()
    # Cluster writes its head's address to Ray's default temp dir and deletes it at shutdown: keep what
    # another Ray of this machine had there
    addr_file = Path("/tmp/ray/ray_current_cluster")
    saved = addr_file.read_text() if addr_file.exists() else None
    temp = tempfile.mkdtemp(prefix="cotrain-mn-", dir="/tmp")  # short: Ray's socket paths live under it
    node_args = dict(NODE_ARGS, temp_dir=temp)
    c = Cluster(initialize_head=True, shutdown_at_exit=True,
                head_node_args=dict(node_args, num_cpus=4, include_dashboard=False,
                                    dashboard_agent_listen_port=free_ports(1)[0]))
    state = {"cluster": c, "head": c.head_node, "nodes": {}}

    def add_nodes(n: int) -> dict:
        """``n`` more nodes of 2 CPUs, started together; returns {node id: node} of all added so far."""
        for _ in range(n):
            node = c.add_node(wait=False, **node_args, dashboard_agent_listen_port=free_ports(1)[0])
            state["nodes"][node.node_id] = node
        c.wait_for_nodes()
        return state["nodes"]

    state["add_nodes"] = add_nodes
    try:
        ray.init(address=c.address, _node_ip_address="127.0.0.1", log_to_driver=False)
        yield state
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        if saved is not None:
            addr_file.parent.mkdir(parents=True, exist_ok=True)
            addr_file.write_text(saved)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, tiny_model_path, cluster):
    """The reference: the same run on one node (the head alone, 4 CPUs, no placement group), 3 steps."""
    from cotrain.rl.driver import GrpoRun

    assert not cluster["nodes"]  # before the other nodes join
    out = tmp_path_factory.mktemp("one_node")
    run = GrpoRun(_config(out, *ONE_NODE))
    t0 = time.monotonic()
    try:
        run.setup(False)
        nodes = {*run.trainer.node_ids, *run.rollout.node_ids}
        t1 = time.monotonic()
        run.train()
    finally:
        run.shutdown()
    print(f"one node: setup {t1 - t0:.1f} s, 3 steps {time.monotonic() - t1:.1f} s (with shutdown)")
    return {"out": out, "nodes": nodes}


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, cluster, one_node):
    """Two more nodes join (the run takes the head and one of them, the other is a spare); steps 1-2 on
    two nodes (checkpoint after step 2); then node 1's raylet killed during step 3, after its rollouts
    and before the update."""
    from cotrain.placement import NodeDiedError
    from cotrain.rl.driver import GrpoRun

    nodes = cluster["add_nodes"](2)
    out = tmp_path_factory.mktemp("two_nodes")
    seen: dict = {"out": out, "head": cluster["head"].node_id}
    cfg = _config(out, *TWO_NODES)
    run = GrpoRun(cfg)
    t0 = time.monotonic()
    try:
        run.setup(False)
        seen["setup_s"] = time.monotonic() - t0
        seen["other"] = run.workers.placement.node_ids[1]
        other = nodes[seen["other"]]
        (seen["spare"],) = set(nodes) - {seen["other"]}
        seen.update(placement=list(run.workers.placement.node_ids), trainers=list(run.trainer.node_ids),
                    engines=list(run.rollout.node_ids))
        cfg.grpo.num_steps = 2  # the loop stops after step 2 (the workers were built for 3 steps)
        run.train()
        seen["status"] = run.rollout.status()
        cfg.grpo.num_steps = 3
        logprobs, killed = run.trainer.logprobs, {}

        def kill_then_logprobs(batch, draft_step=None, draft_updates=1):
            killed["t"] = time.monotonic()
            other.kill_raylet()  # SIGKILL, as a crashed machine; Ray's GCS notices it only ~15 s later
            return logprobs(batch, draft_step=draft_step, draft_updates=draft_updates)

        run.trainer.logprobs = kill_then_logprobs
        with pytest.raises(NodeDiedError) as e:
            run.train()
        seen["error"], seen["error_s"] = e.value, time.monotonic() - killed["t"]
    finally:
        t0 = time.monotonic()
        run.shutdown()
        seen["shutdown_s"] = time.monotonic() - t0
    seen["metrics"] = metrics(out)  # before the resume adds step 3
    seen["latest"] = (out / "checkpoints" / "latest").read_text()
    seen["checkpoints"] = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    print(f"two nodes: setup {seen['setup_s']:.1f} s; failed {seen['error_s']:.2f} s after the kill, shut down in {seen['shutdown_s']:.2f} s: "
          f"{seen['error']}")
    return seen


@pytest.fixture(scope="module")
def resumed(cluster, two_nodes):
    """The run resumed from its checkpoint (`GrpoRun.setup(resume=True)`, what `launch/grpo.py --resume`
    calls) right after node 1 died: the dead node is still in the cluster (and Ray's GCS still reports it
    alive for ~15 s after the kill), the spare node takes its place."""
    import ray

    from cotrain.rl.driver import GrpoRun

    dead = two_nodes["other"]
    ray_says_alive = any(n["NodeID"] == dead and n["Alive"] for n in ray.nodes())
    run = GrpoRun(_config(two_nodes["out"], *TWO_NODES, "checkpoint.resume=true"))
    t0 = time.monotonic()
    try:
        run.setup(True)
        print(f"resume: setup {time.monotonic() - t0:.1f} s (Ray still reported the dead node alive: {ray_says_alive})")
        seen = {"placement": list(run.workers.placement.node_ids), "step": run.state.step,
                "trainers": list(run.trainer.node_ids), "engines": list(run.rollout.node_ids)}
        run.train()
    finally:
        run.shutdown()
    return seen


def test_ranks_and_engines_run_where_the_placement_says(one_node, two_nodes, resumed):
    assert one_node["nodes"] == {two_nodes["head"]}  # the reference ran on one node
    s = two_nodes
    assert s["head"] != s["other"]
    assert s["placement"] == [s["head"], s["other"]]  # node 0 = the driver's node
    assert s["trainers"] == [s["head"], s["other"]]  # stage 0 on node 0, stage 1 (and the drafter) on node 1
    assert s["engines"] == [s["head"], s["other"]]
    # after node 1 died: the spare takes its place, never the dead one
    r = resumed
    assert s["spare"] not in (s["head"], s["other"])
    assert r["placement"] == r["trainers"] == r["engines"] == [s["head"], s["spare"]]


def test_taps_and_weights_take_the_link_of_their_nodes(one_node, two_nodes):
    from cotrain.tapchannel import TRANSPORT_CODES

    one, two = metrics(one_node["out"]), two_nodes["metrics"]
    for step in (1, 2):
        # tiny model, PP=2: layer 0 on stage 0 (the other node), layer 3 on the drafter's stage (local)
        assert two[step]["tap/transport/0"] == TRANSPORT_CODES["gloo"]
        assert one[step]["tap/transport/0"] == TRANSPORT_CODES["shm"]
        assert two[step]["tap/transport/3"] == one[step]["tap/transport/3"] == TRANSPORT_CODES["local"]
        assert two[step]["tap/moved_bytes"] == one[step]["tap/moved_bytes"] > 0
    # trainer rank 0 (the sender) is on node 0: engine 0 reads its /dev/shm file, engine 1 got each push
    # of steps 1-2 (policy + drafter) from the object store (none at start: the engines load the checkpoint)
    relayed = [st["relayed_pushes"] for st in two_nodes["status"]]
    assert relayed == [0, 4], relayed


def test_two_nodes_equal_one_node(one_node, two_nodes):
    one, two = metrics(one_node["out"]), two_nodes["metrics"]
    assert sorted(two) == [1, 2]  # step 3 failed: not logged
    for step in (1, 2):
        for key in EQUAL:  # bit-identical: the same computation, only the links differ
            assert two[step][key] == one[step][key], (step, key, two[step][key], one[step][key])
        assert two[step]["draft/push_ok"] == 1.0


def test_a_dead_node_fails_the_step_naming_it(two_nodes):
    e, s = two_nodes["error"], two_nodes
    msg = str(e)
    assert e.step == 3 and e.node == 1 and e.node_id == s["other"] and e.ranks == [1] and e.engines == [1]
    assert msg.startswith(f"step 3: node 1 ({s['other'][:12]}, 127.0.0.1) died during "), msg
    assert "raylet at 127.0.0.1:" in msg and "does not answer" in msg
    assert "training rank [1] (pipeline stage [1]) and rollout engine [1] were on it" in msg
    assert s["error_s"] < 10, s["error_s"]  # within seconds (Ray's own health check takes ~15 s)
    assert s["shutdown_s"] < 30, s["shutdown_s"]  # nothing waits on the dead node
    assert s["latest"] == "step_000002" and s["checkpoints"] == ["step_000002"]  # step 3 not checkpointed


def test_resume_on_the_spare_node_continues_exactly(one_node, two_nodes, resumed):
    assert resumed["step"] == 2  # from step_000002
    one, two = metrics(one_node["out"]), metrics(two_nodes["out"])
    assert sorted(two) == [1, 2, 3]
    for key in EQUAL:
        assert two[3][key] == one[3][key], (key, two[3][key], one[3][key])
    assert two[3]["tap/transport/0"] == 3.0  # gloo again
