"""The CP partitions mode of bench/cp_attention.py (every rank's share computed in turn on one
device, the ring replayed), on CPU with small sizes: both arms' outputs and their dQ against the
dense fp64 oracle (torch autograd), for several CP degrees. The same code runs on CUDA in the
GPU check (python bench/cp_attention.py --device cuda ...)."""

from types import SimpleNamespace

import pytest
import torch

from cotrain.parallel import dense_branch_attention

ARGS = dict(seed=3, num_seqs=4, min_len=8, max_len=40, blocks_per_seq=3, block_size=4, heads=4, kv_heads=2,
            head_dim=8, warmup=1, rounds=1, budget_s=0.0, cp=[2])


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_partitions_match_the_dense_oracle(load_bench, cp):
    bench = load_bench("cp_attention")
    args = SimpleNamespace(**ARGS)
    layout, tensors, weights, arms, _ = bench.build_partitions(args, cp, torch.device("cpu"), torch.float64)
    x = [t.clone().requires_grad_() for t in tensors]
    out, _, bout, _ = dense_branch_attention(*x, layout.with_cp(1))
    ((out * weights[0]).sum() + (bout * weights[1]).sum()).backward()
    H, D = args.heads, args.head_dim
    for name, ranks in arms.items():
        results = [arm.step() for arm in ranks]
        got_out, got_bout = bench.assemble(layout, ranks, results, H, D, "cpu")
        torch.testing.assert_close(got_out.double(), out.detach(), atol=1e-6, rtol=1e-6, msg=f"{name} out")
        torch.testing.assert_close(got_bout.double(), bout.detach(), atol=1e-6, rtol=1e-6, msg=f"{name} bout")
        # dQ depends only on the K/V a rank receives (real ones), so it is exact per rank
        grads = [(arm.inputs[0].grad, arm.inputs[3].grad) for arm in ranks]
        dq, dbq = bench.assemble(layout, ranks, grads, H, D, "cpu")
        torch.testing.assert_close(dq.double(), x[0].grad, atol=1e-6, rtol=1e-6, msg=f"{name} dq")
        torch.testing.assert_close(dbq.double(), x[3].grad, atol=1e-6, rtol=1e-6, msg=f"{name} dbq")


def test_partitions_report_per_rank_times(load_bench):
    bench = load_bench("cp_attention")
    res = bench.run_partitions(SimpleNamespace(**ARGS), 2, torch.device("cpu"), torch.float32)
    assert res["max_abs_diff_ours_vs_usp"] < 1e-4
    for arm in ("ours", "usp"):
        times = res["arms"][arm]["time_s_per_rank"]
        assert len(times) == 2 and all(t > 0 for t in times)
        assert res["arms"][arm]["peak_bytes_per_rank"] == [None, None]  # memory is measured on CUDA only
    assert res["usp_over_ours_time"] > 0
