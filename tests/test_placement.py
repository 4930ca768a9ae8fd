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
           "draft.init=null", "policy.parallel.pipeline=2", "rollout.num_engines=2", "rollout.colocate=true"]
    assert load_config(DEMO, gpu).rollout.weight_transport == "nccl"  # colocated, but engine 1 is on node 1
    _issue([*gpu, "rollout.weight_transport=cuda_ipc"], "rollout.weight_transport",
           "engine(s) [1] run on another node than trainer rank 0")
    one = ["cluster.gpus_per_node=8", "cluster.cpus_per_node=96", "cluster.device=cuda", "draft.init=null",
           "rollout.colocate=true"]
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
