"""The node layout (cotrain.placement): where ranks and engines go, what validation refuses, and that the
planner numbers nodes the same way. Pure functions, no Ray (the placement on a real two-node Ray cluster is
tests/rl/test_multinode.py)."""

import pytest

from cotrain.config import ConfigError, load_config
from cotrain.placement import layout_issues, node_layout
from cotrain.plan import Hardware, load_arch, make_plan

DEMO = "configs/demo.yaml"
TWO = ["cluster.num_nodes=2", "cluster.cpus_per_node=4", "policy.parallel.pipeline=2", "rollout.num_engines=2"]


def _issue(overrides, key, *fragments):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, overrides)
    msgs = [m for k, m in e.value.issues if k == key]
    assert msgs, e.value.issues
    for f in fragments:
        assert any(f in m for m in msgs), (f, msgs)


def test_pipeline_crosses_nodes_one_engine_per_node():
    cfg = load_config(DEMO, TWO)
    lay = node_layout(cfg)
    assert lay.rank_node == (0, 1) and lay.engine_node == (0, 1) and lay.ranks_per_node == 1
    assert lay.ranks_on(1) == [1] and lay.stage_of(1) == 1 and lay.engines_on(0) == [0]
    assert lay.node_demand(0) == {"CPU": 2.0}
    # several nodes: weights cross through Ray's object store, taps choose per source at start
    assert cfg.rollout.weight_transport == "object_store" and cfg.draft.tap_transport == "auto"


def test_megatron_order_whole_tp_cp_groups_per_node():
    # TP=2, CP=2, DP=1, PP=2 on 2 nodes: ranks 0-3 (stage 0) on node 0, 4-7 (stage 1) on node 1
    cfg = load_config(DEMO, ["cluster.num_nodes=2", "cluster.cpus_per_node=6", "policy.parallel.tensor=2",
                             "policy.parallel.context=2", "policy.parallel.pipeline=2", "rollout.num_engines=2",
                             "policy.micro_batch_size=16"])
    lay = node_layout(cfg)
    assert lay.rank_node == (0, 0, 0, 0, 1, 1, 1, 1) and lay.engine_node == (0, 1)
    # a TP x CP group of 4 never straddles: on 3 nodes still whole groups per node (4, 4, 0 ranks)
    lay3 = node_layout(cfg, num_nodes=3)
    assert lay3.rank_node == (0, 0, 0, 0, 1, 1, 1, 1) and lay3.engine_node == (0, 1)


def test_engine_only_nodes_are_the_last():
    cfg = load_config(DEMO, ["cluster.num_nodes=3", "cluster.engine_nodes=1", "cluster.cpus_per_node=2",
                             "policy.parallel.pipeline=2", "rollout.num_engines=2"])
    lay = node_layout(cfg)
    assert lay.trainer_nodes == 2 and lay.rank_node == (0, 1) and lay.engine_node == (2, 2)
    assert "node 2: engines 0, 1" in lay.describe()


def test_refusals_name_the_group_that_would_straddle():
    # TP x CP = 8, a node holds 4 trainer ranks (4 CPUs / 1 per worker): the CP group would straddle
    _issue(["cluster.num_nodes=4", "cluster.cpus_per_node=4", "policy.parallel.tensor=2", "policy.parallel.context=4",
            "policy.micro_batch_size=8"],
           "policy.parallel", "TP x CP = 2 x 4 = 8 ranks per group, a node holds 4 trainer rank(s)",
           "the CP group of ranks 0, 2, 4, 6 would straddle nodes 0, 1")  # ranks 0-3 fill node 0
    _issue(["cluster.num_nodes=4", "cluster.cpus_per_node=1", "policy.parallel.tensor=2"],
           "policy.parallel", "the TP group of ranks 0, 1 would straddle nodes 0, 1", "allowed: TP x CP <= 1")
    # TP = 2 fits a node of 3 but TP x CP = 4 does not: ranks 0-2 fill node 0, the TP group 2, 3 would cross
    _issue(["cluster.num_nodes=2", "cluster.cpus_per_node=3", "policy.parallel.tensor=2", "policy.parallel.context=2",
            "rollout.num_engines=2"], "policy.parallel", "the TP group of ranks 2, 3 would straddle nodes 0, 1")
    _issue(["cluster.num_nodes=2", "cluster.engine_nodes=2"], "cluster.engine_nodes", "allowed: 0..1")
    _issue(["cluster.num_nodes=2", "cluster.engine_nodes=1", "rollout.colocate=true"], "cluster.engine_nodes",
           "colocated engines run on the trainers' nodes")
    # 2 nodes x 3 CPUs fit 2 x 2 + 2 CPUs in total, but a node holds a stage and 1 CPU: no room for the engine
    _issue(["cluster.num_nodes=2", "cluster.cpus_per_node=3", "policy.parallel.pipeline=2", "policy.cpus_per_worker=2",
            "rollout.cpus_per_engine=2"], "rollout.num_engines", "do not fit", "allowed: at most 0 engines",
           "cluster.engine_nodes > 0")
    # taps by shared memory across nodes are refused only when a tapped stage is on another node
    _issue([*TWO, "draft.tap_transport=shm"], "draft.tap_transport", "pipeline stage(s) [0] send taps from another node",
           "allowed: auto, gloo")
    load_config(DEMO, ["cluster.num_nodes=2", "cluster.engine_nodes=1", "policy.parallel.pipeline=2",
                       "rollout.num_engines=2", "draft.tap_transport=shm"])  # both stages on node 0


def test_one_node_layout_is_everything_on_node_0():
    cfg = load_config(DEMO, ["policy.parallel.pipeline=2", "cluster.cpus_per_node=4"])
    lay = node_layout(cfg)
    assert lay.rank_node == (0, 0) and lay.engine_node == (0,) and cfg.rollout.weight_transport == "shm"
    assert cfg.draft.tap_transport == "shm"  # auto on one node: as before
    assert layout_issues(cfg)[1] == []


@pytest.mark.parametrize("overrides, gpus", [
    (TWO, 1),
    (["policy.parallel.pipeline=4", "cluster.cpus_per_node=8", "rollout.num_engines=2"], 2),
    (["policy.parallel.tensor=2", "policy.parallel.pipeline=2", "policy.parallel.data=2", "policy.micro_batch_size=16",
      "cluster.cpus_per_node=16", "rollout.num_engines=2"], 4),
])
def test_plan_numbers_nodes_as_the_placement(overrides, gpus):
    """The planner on nodes of `gpus` GPUs places ranks exactly as the run would on such nodes."""
    cfg = load_config(DEMO, overrides)
    plan = make_plan(cfg, load_arch(cfg.policy.model_path), Hardware(gpus_per_node=gpus))
    lay, issues = layout_issues(cfg, device="cuda", gpus_per_node=gpus, cpus_per_node=1 << 30,
                                num_nodes=plan.placement["num_nodes"], gpus_per_engine=1)
    assert not issues and plan.placement["rank_node"] == list(lay.rank_node)
    assert plan.placement["engine_node"] == list(lay.engine_node)
    p = cfg.policy.parallel
    span = p.tensor * p.context * p.data
    last = lay.rank_node[(p.pipeline - 1) * span]
    for st in plan.stages:
        assert st.node == lay.rank_node[st.stage * span]
        if st.tap_bytes_per_microbatch:
            assert st.tap_link == ("intra" if st.node == last else "inter")


def test_nodes_whose_raylet_is_gone_are_not_picked():
    """Ray's Alive flag lags a killed raylet by ~15 s: the placement also probes each raylet's port."""
    import socket

    from cotrain.placement import ClusterPlacement, _raylet_down

    cfg = load_config(DEMO, TWO)
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    try:
        up, down = listening.getsockname()[1], closed.getsockname()[1]
        assert _raylet_down("127.0.0.1", up) is None and "does not answer" in _raylet_down("127.0.0.1", down)

        def node(i, port, alive=True):
            return {"NodeID": f"{i:02d}" * 28, "Alive": alive, "NodeManagerAddress": "127.0.0.1",
                    "NodeManagerPort": port, "Resources": {"CPU": 4.0}}

        pl = object.__new__(ClusterPlacement)
        pl.layout = node_layout(cfg)
        picked = pl._pick_nodes([node(1, down), node(2, up), node(3, up, alive=False), node(4, up)])
        assert [n["NodeID"][:2] for n in picked] == ["02", "04"]
        with pytest.raises(RuntimeError, match="no alive Ray node left"):
            pl._pick_nodes([node(1, down), node(2, up)])
    finally:
        listening.close()
        closed.close()


def test_gpu_weight_pushes_across_nodes_use_nccl():
    gpu = ["cluster.num_nodes=2", "cluster.gpus_per_node=8", "cluster.cpus_per_node=96", "cluster.device=cuda",
           "draft.init=null", "draft.compare_frozen=false", "policy.parallel.pipeline=2", "rollout.num_engines=2",
           "rollout.colocate=true"]
    assert load_config(DEMO, gpu).rollout.weight_transport == "nccl"  # colocated, but engine 1 is on node 1
    _issue([*gpu, "rollout.weight_transport=cuda_ipc"], "rollout.weight_transport",
           "engine(s) [1] run on another node than trainer rank 0")
    one = ["cluster.gpus_per_node=8", "cluster.cpus_per_node=96", "cluster.device=cuda", "draft.init=null",
           "draft.compare_frozen=false", "rollout.colocate=true"]
    assert load_config(DEMO, one).rollout.weight_transport == "cuda_ipc"  # one node: as before


def test_validate_only_refuses_a_group_that_would_straddle():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "launch/grpo.py", "--config", DEMO, "cluster.num_nodes=2",
                           "cluster.cpus_per_node=3", "policy.parallel.tensor=2", "policy.parallel.context=2",
                           "rollout.num_engines=2", "--validate-only"], cwd=root, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the TP group of ranks 2, 3 would straddle nodes 0, 1" in proc.stdout + proc.stderr


# ------------------------------------------------------------------------- colocated GPU bundles
CUDA = ["cluster.device=cuda", "draft.init=null", "draft.compare_frozen=false", "rollout.colocate=true"]


def _colocated(nodes: int, gpus: int, *extra: str):
    return load_config(DEMO, [*CUDA, f"cluster.num_nodes={nodes}", f"cluster.gpus_per_node={gpus}",
                              "cluster.cpus_per_node=16", *extra])


def _check_shared_gpus(lay, tp: int) -> None:
    """The invariants of a colocated layout, checked from its actors' requests (not its own tables):
    every engine worker sits on the bundle (GPU) of a trainer rank of the engine's node, all of an
    engine's workers on one node, at most one engine worker per GPU, and the Ray shares on each GPU
    (the rank's + the engine worker's) add up to at most its one GPU; CPUs likewise per bundle."""
    gpu_use = {r: lay.trainer_resources(r)["num_gpus"] for r in range(lay.world_size)}
    cpu_use = {r: lay.trainer_resources(r)["num_cpus"] for r in range(lay.world_size)}
    workers_on = {r: 0 for r in range(lay.world_size)}
    for e, node in enumerate(lay.engine_node):
        env = lay.engine_env(e)
        res = lay.engine_resources(e)
        if env:  # TP > 1: vLLM's executor puts worker i in bundle VLLM_RAY_BUNDLE_INDICES[i]
            bundles = [int(b) for b in env["VLLM_RAY_BUNDLE_INDICES"].split(",")]
            per_worker = float(env["VLLM_RAY_PER_WORKER_GPUS"])
            assert res["num_gpus"] == 0 and len(bundles) == tp
        else:  # TP = 1: the actor is the worker
            bundles, per_worker = [lay.engine_bundles[e][0]], res["num_gpus"]
        assert bundles[0] == lay.engine_bundles[e][0]  # the actor sits in the first
        cpu_use[bundles[0]] += res["num_cpus"]
        for b in bundles:
            assert lay.rank_node[b] == node
            gpu_use[b] += per_worker
            workers_on[b] += 1
    bundles = lay.bundles()
    assert len(bundles) == lay.world_size  # colocated: no bundle of the engines' own
    for r in range(lay.world_size):
        assert bundles[r][0]["GPU"] == 1 and workers_on[r] <= 1 and gpu_use[r] <= 1 + 1e-9
        assert cpu_use[r] <= bundles[r][0]["CPU"] + 1e-9
    assert sum(workers_on.values()) == len(lay.engine_node) * tp


@pytest.mark.parametrize("nodes, gpus, pp, dp, engines, tp", [
    (1, 2, 1, 2, 2, 1), (1, 4, 1, 4, 2, 2), (1, 4, 2, 2, 1, 4), (2, 2, 2, 2, 2, 2), (2, 4, 2, 4, 3, 2),
    (2, 8, 2, 4, 1, 1), (4, 2, 4, 2, 4, 2), (2, 4, 1, 8, 2, 4)])
def test_colocated_engines_share_the_trainer_gpus(nodes, gpus, pp, dp, engines, tp):
    cfg = _colocated(nodes, gpus, f"policy.parallel.pipeline={pp}", f"policy.parallel.data={dp}",
                     f"rollout.num_engines={engines}", f"rollout.tensor_parallel={tp}",
                     f"policy.micro_batch_size={16 // dp}")
    lay = node_layout(cfg)
    assert lay.shared and cfg.rollout.gpus_per_engine == 0.5 * tp  # the default: half of each GPU
    _check_shared_gpus(lay, tp)
    assert lay.node_demand(0)["GPU"] == len(lay.ranks_on(0))  # one GPU per rank: the engines add none


def test_the_colocated_plan_of_the_docs_example():
    """docs/multinode.md's example: 2 nodes of 4 GPUs, PP=2 x DP=4, two engines of TP=2 (one per node)."""
    cfg = _colocated(2, 4, "policy.parallel.pipeline=2", "policy.parallel.data=4", "rollout.num_engines=2",
                     "rollout.tensor_parallel=2", "policy.micro_batch_size=4")
    lay = node_layout(cfg)
    assert lay.rank_node == (0, 0, 0, 0, 1, 1, 1, 1) and lay.engine_node == (0, 1)
    assert lay.engine_bundles == ((0, 1), (4, 5))
    assert lay.engine_env(1) == {"VLLM_RAY_BUNDLE_INDICES": "4,5", "VLLM_RAY_PER_WORKER_GPUS": "0.5"}
    assert lay.trainer_resources(4) == {"num_cpus": 0.5, "num_gpus": 0.5}  # shares its CPU with engine 1's actor
    assert lay.trainer_resources(5) == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert lay.engine_resources(1) == {"num_cpus": 0.5, "num_gpus": 0.0}
    text = lay.describe_gpus()
    assert "bundle 4 (node 1, one GPU): trainer rank 4 (0.5 GPU, 0.5 CPU) + engine 1 actor, worker 0 (0.5 GPU, 0.5 CPU)" \
        in text and "bundle 6 (node 1, one GPU): trainer rank 6 (0.5 GPU, 1 CPU)\n" in text
    assert "memory: engine 0.4 of the device" in text


def test_colocated_tp1_engine_is_its_own_worker():
    lay = node_layout(_colocated(1, 2, "policy.parallel.data=2", "rollout.num_engines=2", "policy.micro_batch_size=8",
                                 "rollout.gpus_per_engine=0.3"))
    assert lay.engine_bundles == ((0,), (1,)) and lay.engine_env(0) == {}
    assert lay.engine_resources(1) == {"num_cpus": pytest.approx(0.3), "num_gpus": pytest.approx(0.3)}
    assert lay.trainer_resources(1)["num_gpus"] == pytest.approx(0.7)


def test_colocation_refusals_name_the_keys_and_numbers():
    base = ["cluster.gpus_per_node=2", "cluster.cpus_per_node=16", "policy.parallel.data=2", "policy.micro_batch_size=8"]
    _issue([*CUDA, *base, "rollout.num_engines=2", "rollout.tensor_parallel=2"], "rollout.num_engines",
           "2 colocated engines x rollout.tensor_parallel=2 GPUs = 4 exceed the 2 GPUs of the trainer ranks",
           "allowed: at most 1 engines")
    for gpe in ("0", "1", "1.5"):  # TP = 1: a share of 0, 1 or more of a GPU leaves the rank nothing, or nothing to it
        _issue([*CUDA, *base, f"rollout.gpus_per_engine={gpe}"], "rollout.gpus_per_engine",
               "a colocated engine worker shares its GPU with a trainer rank", "allowed: 0 < gpus_per_engine < 1")
    # one rank per node (PP = 2 over 2 nodes): an engine of TP = 2 would straddle them
    _issue([*CUDA, "cluster.num_nodes=2", "cluster.gpus_per_node=2", "cluster.cpus_per_node=4",
            "policy.parallel.pipeline=2", "rollout.tensor_parallel=2"], "rollout.num_engines",
           "an engine's GPUs are on one node", "hold [1, 1] trainer GPU(s), room for [0, 0] engine(s)")
    _issue([*CUDA, "cluster.gpus_per_node=2", "cluster.cpus_per_node=4", "policy.parallel.data=2",
            "policy.micro_batch_size=8", "policy.cpus_per_worker=2", "rollout.cpus_per_engine=3"],
           "rollout.cpus_per_engine", "node 0 holds 2 trainer rank(s)", "and 1 colocated engine(s)",
           "5 CPUs exceed cluster.cpus_per_node=4")


def test_the_planner_prints_the_colocated_gpus():
    cfg = load_config("configs/plan/qwen3_8b_2x8.yaml")
    plan = make_plan(cfg, load_arch(cfg.policy.model_path), Hardware(gpus_per_node=8))
    assert plan.placement["engine_gpus_of_ranks"] == [[0, 1, 2, 3], [8, 9, 10, 11]]
    from cotrain.plan import format_plan

    assert "colocated: engine 0 on the GPUs of ranks [0, 1, 2, 3]; engine 1 on the GPUs of ranks [8, 9, 10, 11] " \
           "(Ray: engine worker 0.5 + rank 0.5 of each GPU; memory: engine 0.4 of the device" in format_plan(plan)


# ---------------------------------------------- the colocated placement group on a real Ray cluster
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gpu_cluster():
    """Two Ray nodes of 4 CPUs and 2 *fake* GPUs each (`ray.cluster_utils.Cluster`: Ray accepts a GPU count
    without GPUs and hands out their ids as it would real ones), every listener on 127.0.0.1, its own
    temp dir; this process is the driver."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    import ray
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    addr_file = Path("/tmp/ray/ray_current_cluster")  # Cluster rewrites it: keep another Ray's
    saved = addr_file.read_text() if addr_file.exists() else None
    temp = tempfile.mkdtemp(prefix="cotrain-pg-", dir="/tmp")
    args = dict(num_cpus=4, num_gpus=2, node_ip_address="127.0.0.1", object_store_memory=100 * 2**20, temp_dir=temp)
    c = Cluster(initialize_head=True, shutdown_at_exit=True,
                head_node_args=dict(args, include_dashboard=False, dashboard_agent_listen_port=_free_port()))
    c.add_node(**args, dashboard_agent_listen_port=_free_port())
    c.wait_for_nodes()
    try:
        ray.init(address=c.address, _node_ip_address="127.0.0.1", log_to_driver=False)
        import sys

        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import a test module
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        if saved is not None:
            addr_file.parent.mkdir(parents=True, exist_ok=True)
            addr_file.write_text(saved)


class _Probe:
    """Stands in for a trainer rank or an engine actor: where Ray put it, and (as an engine of TP > 1)
    the TP workers started the way vLLM's Ray executor starts them (``RayDistributedExecutor.
    _init_workers_ray``: worker i in bundle ``VLLM_RAY_BUNDLE_INDICES[i]`` of the actor's own placement
    group, ``num_cpus=0``, ``num_gpus=VLLM_RAY_PER_WORKER_GPUS``)."""

    def __init__(self, env: dict):
        import os

        os.environ.update(env)

    def where(self):
        import os

        import ray

        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()], \
            os.environ.get("CUDA_VISIBLE_DEVICES")

    def start_tp_workers(self):
        import os

        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = get_current_placement_group()
        share = float(os.environ["VLLM_RAY_PER_WORKER_GPUS"])
        probe = ray.remote(_Probe)
        workers = [probe.options(num_cpus=0, num_gpus=share, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_capture_child_tasks=True, placement_group_bundle_index=int(b)))
            .remote({}) for b in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
        return ray.get([w.where.remote() for w in workers], timeout=60)


@pytest.mark.parametrize("engines, tp", [(2, 2), (4, 1)])
def test_the_colocated_placement_group_puts_every_engine_worker_on_its_ranks_gpu(gpu_cluster, engines, tp):
    """PP=2 x DP=2 on the 2 nodes: the group reserves one GPU bundle per rank and nothing else; every
    actor is placed within the timeout (the trainers' 1-GPU requests left no room for colocated engines
    before: an endless wait), and every engine worker gets the GPU of the rank whose bundle it shares."""
    import ray

    from cotrain.placement import ClusterPlacement, wait_placed

    cfg = load_config(DEMO, [*CUDA, "cluster.num_nodes=2", "cluster.gpus_per_node=2", "cluster.cpus_per_node=4",
                             "policy.parallel.pipeline=2", "policy.parallel.data=2", "policy.micro_batch_size=8",
                             f"rollout.num_engines={engines}", f"rollout.tensor_parallel={tp}"])
    pl = ClusterPlacement(cfg, timeout_s=60)
    probe = ray.remote(_Probe)
    actors = []
    try:
        assert [b for b, _ in pl.layout.bundles()] == [{"CPU": 1.0, "GPU": 1.0}] * 4
        t_opts = [pl.trainer_options(r) for r in range(4)]
        e_opts = [pl.engine_options(e) for e in range(engines)]
        trainers = [probe.options(**o).remote({}) for o in t_opts]
        engine_actors = [probe.options(**o).remote(pl.engine_env(e)) for e, o in enumerate(e_opts)]
        actors = trainers + engine_actors
        wait_placed(actors, [f"rank {r}" for r in range(4)] + [f"engine {e}" for e in range(engines)],
                    t_opts + e_opts, timeout_s=60)
        ranks = ray.get([a.where.remote() for a in trainers], timeout=60)
        assert [n for n, _, _ in ranks] == [pl.node_of_rank(r) for r in range(4)]
        assert all(len(g) == 1 and cvd == g[0] for _, g, cvd in ranks)  # one GPU each, the one CUDA sees
        assert len({(n, g[0]) for n, g, _ in ranks}) == 4  # four different GPUs
        for e, a in enumerate(engine_actors):
            workers = ray.get(a.start_tp_workers.remote(), timeout=60) if tp > 1 else [ray.get(a.where.remote())]
            assert [(n, g) for n, g, _ in workers] == [ranks[r][:2] for r in pl.layout.engine_bundles[e]], e
        # what no bundle has room for fails within its timeout, naming the actor and the cluster's resources
        extra = [probe.options(num_cpus=1, num_gpus=1).remote({})]
        actors += extra
        with pytest.raises(RuntimeError, match=r"could not place 1 of 1 actors within 2 s: one more trainer asks "
                                               r"\{num_cpus: 1, num_gpus: 1\}; the cluster has CPU .* GPU 0 free of 4"):
            wait_placed(extra, ["one more trainer"], [{"num_cpus": 1, "num_gpus": 1}], timeout_s=2)
    finally:
        for a in actors:
            ray.kill(a)
        pl.remove()


def test_the_colocated_example_in_docs_multinode_is_what_the_command_prints():
    import re
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs/multinode.md").read_text()
    block = re.search(r"<!-- colocated-example.*?-->\s*```\n\$ (.*?)\n(.*?)```\n<!-- end of colocated-example -->", doc,
                      re.S)
    assert block, "the colocated-example block of docs/multinode.md"
    cmd = shlex.split(block.group(1))
    assert cmd[:2] == ["python", "-c"]
    proc = subprocess.run([sys.executable, *cmd[1:]], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == block.group(2), "regenerate the colocated example in docs/multinode.md:\n" + proc.stdout
