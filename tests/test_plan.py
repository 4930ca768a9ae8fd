"""The planner's formulas against what the code really holds and sends (tiny model, CPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cotrain.plan import Arch, drafter_push_params, load_arch, ring_bytes, tap_bytes

ROOT = Path(__file__).resolve().parents[1]


def test_parameter_count_and_push_bytes_equal_the_checkpoint(tiny_model_path):
    from cotrain.models.hf_io import load_hf_state_dict

    state = load_hf_state_dict(tiny_model_path)
    arch = load_arch("builtin:tiny")
    assert arch == Arch.from_hf(json.loads((Path(tiny_model_path) / "config.json").read_text()))
    assert arch.params() == sum(t.numel() for t in state.values())
    assert arch.params() * 4 == sum(t.numel() * t.element_size() for t in state.values())  # a policy push, fp32


def test_tied_embeddings_count_once():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, vocab_size=100, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg))
    assert Arch.from_hf(cfg).params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind, settings", [("eagle3", {}), ("dflash", {"num_layers": 2}),
                                            ("dspark", {"markov_rank": 8})])
def test_drafter_push_size_equals_the_drafter(kind, settings, tiny_model_path):
    from cotrain.draft.registry import build_drafter
    from cotrain.draft.taps import TargetSpec

    target = TargetSpec.from_checkpoint(tiny_model_path)
    d = build_drafter(kind, settings, target)
    sd = d.vllm_state_dict()
    pushed = sum(sd[n].numel() for n in d.push_names())
    arch = load_arch("builtin:tiny")
    assert drafter_push_params(kind, arch, d.num_taps, settings.get("num_layers", 1), settings.get("markov_rank", 16)) \
        == pushed


def _ring(rank, world):
    from cotrain.parallel import CPStats, cp_branch_attention, cu_seqlens_from_lengths
    from cotrain.parallel.layout import BranchLayout
    from cotrain.parallel.zigzag import zigzag_shard

    torch.manual_seed(0)
    lens = [32, 16]
    layout = BranchLayout(cu_seqlens_from_lengths(lens), torch.zeros(0, dtype=torch.int64),
                          torch.zeros(0, dtype=torch.int64), cp_size=world)
    T, Hq, Hk, D = sum(lens), 4, 2, 8
    q, k, v = (torch.randn(T, h, D, requires_grad=False) for h in (Hq, Hk, Hk))
    q, k, v = (zigzag_shard(x, layout, rank).requires_grad_() for x in (q, k, v))
    stats = CPStats()
    out, _, _, _ = cp_branch_attention(q, k, v, None, None, None, layout, None, stats=stats)
    out.sum().backward()
    return q.shape[0], stats.bytes_sent_forward, stats.bytes_sent_backward


def test_cp_ring_bytes_equal_the_measured_ones():
    from cotrain.distributed import spawn_local

    for local, fwd, bwd in spawn_local(_ring, 2):
        assert (fwd, bwd) == ring_bytes(local, kv_heads=2, head_dim=8, elem_bytes=4, cp=2)


def test_tap_bytes_formula():
    from cotrain.tapchannel import PipelineLayout, tap_specs

    layout = PipelineLayout.even([0, 1], 4)
    specs = [s for s in tap_specs([0, 1, 3], layout, width=128, dtype=torch.bfloat16) if s.stage == 0]
    from cotrain.tapchannel import tap_bytes as channel_bytes

    assert tap_bytes(96, 128, 2, len(specs)) == channel_bytes(96, specs)


def test_cli_prints_a_plan():
    proc = subprocess.run([sys.executable, "-m", "cotrain.plan", "--config", "configs/demo_pp2.yaml", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["layout"]["pp"] == 2 and len(plan["stages"]) == 2
    assert plan["stages"][0]["tap_bytes_per_microbatch"] > 0 and plan["stages"][0]["tap_link"] == "intra"


def test_the_example_in_docs_multinode_is_what_the_command_prints():
    """docs/multinode.md's planner example (Qwen3-8B on 2 x 8 GPUs) is the command's current output."""
    import re
    import shlex

    doc = (ROOT / "docs/multinode.md").read_text()
    block = re.search(r"<!-- plan-example.*?-->\s*```\n\$ (.*?)\n(.*?)```\n<!-- end of plan-example -->", doc, re.S)
    assert block, "the plan-example block of docs/multinode.md"
    cmd, expected = shlex.split(block.group(1)), block.group(2)
    assert cmd[:3] == ["python", "-m", "cotrain.plan"]
    proc = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected, "regenerate the example in docs/multinode.md:\n" + proc.stdout


def test_async_model_by_hand_and_from_a_runs_metrics(tmp_path):
    """T_k = R + U + W + O - h min(R, U) for k >= 1 (max(R, U) + W + O at h = 1), read from the medians
    of a synchronous run's metrics (first step left out); an asynchronous run's metrics are refused."""
    from cotrain.plan import async_steps, read_phases

    rows = [{"step": 1, "time/rollout": 9.0, "time/update": 9.0, "time/weight_push": 9.0, "time/step": 40.0}]
    rows += [{"step": s, "time/rollout": r, "time/update": u, "time/weight_push": 0.5, "time/step": r + u + 0.5 + 0.2}
             for s, (r, u) in enumerate([(3.0, 5.0), (4.0, 6.0), (2.0, 7.0)], start=2)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ph = read_phases(path)
    assert ph == pytest.approx({"rollout": 3.0, "update": 6.0, "push": 0.5, "other": 0.2})
    k0, k1, k2 = async_steps(ph, max_staleness=2)
    assert k0["step_s"] == pytest.approx(3 + 6 + 0.5 + 0.2) and k0["speedup"] == 1.0
    assert k1["step_s"] == pytest.approx(6 + 0.5 + 0.2) == k2["step_s"]  # max(R, U) + W + O
    assert k1["speedup"] == pytest.approx(9.7 / 6.7)
    assert k1["engine_idle"] == pytest.approx(1 - 3 / 6.7) and k1["trainer_idle"] == pytest.approx(1 - 6.5 / 6.7)
    half = async_steps(ph, 1, hidden=0.5)[1]
    assert half["step_s"] == pytest.approx(9.7 - 0.5 * 3)
    with pytest.raises(ValueError, match="--hidden"):
        async_steps(ph, 1, hidden=1.5)
    proc = subprocess.run([sys.executable, "-m", "cotrain.plan", "--config", "configs/demo.yaml", "--phases",
                           str(path), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["async"]["steps"][1]["step_s"] == pytest.approx(6.7)
    path.write_text(json.dumps({**rows[1], "async/policy_lag": 1.0}) + "\n")
    with pytest.raises(ValueError, match="asynchronous run"):
        read_phases(path)
