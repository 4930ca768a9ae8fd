"""cp_branch_attention against the dense oracle at CP = 1, 2, 4 (gloo), plus bytes and balance.

One process group per CP degree runs every case (see _cp_cases.worker), with main queries and,
for NO_MAIN_CASES, without (q=None: branch outputs and the gradients flowing from them only); the
tests below read its results. fp32: max abs error <= 1e-5 for out, LSE and every gradient. bf16: |err| <= 2.5e-2 +
2.5e-2 |ref| (transformer-engine's CP test tolerance, atol = rtol = 2.5e-2), fp16 too. fp64: <= 1e-12 (the
oracle's own precision: fp64 is computed in fp64 end to end).
"""

from __future__ import annotations

import pytest

import _cp_cases
from _cp_cases import CASES, HEAD_DIM, NO_MAIN_CASES
from _cp_dist import run_world

CP_SIZES = [1, 2, 4]
_results: dict[int, list] = {}


def results(cp_size: int) -> list:
    """Per-rank results of the worker for one CP degree (computed once per session)."""
    if cp_size not in _results:
        if cp_size == 1:
            _results[1] = [_cp_cases.worker(0, 1)]  # no process group needed at CP = 1
        else:
            _results[cp_size] = run_world(_cp_cases.worker, cp_size)
    return _results[cp_size]


FP32 = [c for c in CASES if c.dtype == "float32" and c.grad_comm is None]
BF16 = [c for c in CASES if c.dtype in ("bfloat16", "float16")]
FP64 = [c for c in CASES if c.dtype == "float64"]
QUANTITIES = ["out", "lse", "bout", "blse", "dq", "dk", "dv", "dbq", "dbk", "dbv"]


@pytest.mark.parametrize("cp_size", CP_SIZES)
@pytest.mark.parametrize("case", FP32, ids=lambda c: c.name)
def test_fp32_matches_dense(cp_size, case):
    per_rank = [r["cases"][case.name]["abs"] for r in results(cp_size)]
    errors = {q: max(r[q] for r in per_rank) for q in QUANTITIES}
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.parametrize("cp_size", CP_SIZES)
@pytest.mark.parametrize("case", BF16, ids=lambda c: c.name)
def test_bf16_matches_dense(cp_size, case):
    per_rank = [r["cases"][case.name]["excess"] for r in results(cp_size)]
    excess = {q: max(r[q] for r in per_rank) for q in QUANTITIES}
    assert max(excess.values()) <= 2.5e-2, excess


@pytest.mark.parametrize("cp_size", CP_SIZES)
@pytest.mark.parametrize("case", FP64, ids=lambda c: c.name)
def test_fp64_matches_dense_to_fp64_precision(cp_size, case):
    per_rank = [r["cases"][case.name]["abs"] for r in results(cp_size)]
    errors = {q: max(r[q] for r in per_rank) for q in QUANTITIES}
    assert max(errors.values()) <= 1e-12, errors


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bf16_grad_comm_changes_only_dk_dv_and_only_by_rounding(cp_size, dtype):
    # Same inputs with dK/dV sent in fp32 (default) and in bf16: only dk/dv may differ, within
    # one bf16 rounding per hop of the partial sums (<= C-1 hops of relative size 2^-8).
    prefix = "bf16_" if dtype == "bfloat16" else ""
    default, bf16_comm = (f"{prefix}dflash", f"{prefix}dflash_bf16_grad_comm")
    for r in results(cp_size):
        a, b = r["cases"][default]["abs"], r["cases"][bf16_comm]["abs"]
        for q in ("out", "lse", "bout", "blse", "dq", "dbq", "dbk", "dbv"):
            assert b[q] == a[q], q
        if dtype == "float32":
            assert max(b["dk"], b["dv"]) <= 2e-2, b  # bf16 rounding of O(1) partial sums
        assert max(r["cases"][bf16_comm]["excess"].values()) <= 2.5e-2


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_padding_never_leaks(cp_size):
    # Padding rows were given random inputs and random loss weights; they must stay inert.
    for rank, r in enumerate(results(cp_size)):
        for name, res in r["cases"].items():
            assert res["pad_out"] == 0.0, (rank, name)
            assert res["pad_lse_all_neg_inf"], (rank, name)
            assert res["pad_grad"] == 0.0, (rank, name)


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_bytes_closed_form_and_independent_of_branches(cp_size):
    H_kv, D = 2, HEAD_DIM
    C = cp_size
    for dtype, size in (("float32", 4), ("bfloat16", 2), ("float64", 8)):
        seen = set()
        for (num_blocks, block_size, dt), _ in results(cp_size)[0]["bytes"].items():
            if dt != dtype:
                continue
            for rank, r in enumerate(results(cp_size)):
                stats = r["bytes"][(num_blocks, block_size, dtype)]
                L = stats.local_len
                shard = 2 * L * H_kv * D  # one K/V shard, elements
                assert stats.bytes_sent_forward == (C - 1) * shard * size, (rank, num_blocks, block_size)
                # K/V travel the ring again, and the dK/dV (fp32; fp64 for fp64) make C-1 hops home.
                expected_bwd = (C - 1) * shard * (size + max(size, 4))
                assert stats.bytes_sent_backward == expected_bwd, (rank, num_blocks, block_size)
                seen.add((rank, stats.bytes_sent_forward, stats.bytes_sent_backward))
        # The same numbers with 0, 1, 3 and 6 blocks per sequence and block sizes 1, 4, 16.
        assert len(seen) == len(results(cp_size)), seen


@pytest.mark.parametrize("cp_size", [2, 4])
def test_bytes_closed_form_with_bf16_grad_comm(cp_size):
    C, shard_elems = cp_size, None
    for (num_blocks, block_size, dtype), _ in results(cp_size)[0]["bytes_bf16_grad_comm"].items():
        size = {"float32": 4, "bfloat16": 2}[dtype]
        for rank, r in enumerate(results(cp_size)):
            stats = r["bytes_bf16_grad_comm"][(num_blocks, block_size, dtype)]
            shard_elems = 2 * stats.local_len * 2 * HEAD_DIM
            assert stats.bytes_sent_forward == (C - 1) * shard_elems * size
            assert stats.bytes_sent_backward == (C - 1) * shard_elems * (size + 2)  # dK/dV in 2 bytes
            default = r["bytes"][(num_blocks, block_size, dtype)]
            assert default.bytes_sent_backward - stats.bytes_sent_backward == (C - 1) * shard_elems * 2


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("with_branches", [False, True], ids=["main_only", "dflash_uniform"])
def test_zigzag_balance(cp_size, with_branches):
    computed = [r["balance"][with_branches].pairs_computed for r in results(cp_size)]
    allowed = [r["balance"][with_branches].pairs_allowed for r in results(cp_size)]
    for counts in (computed, allowed):
        mean = sum(counts) / len(counts)
        assert max(counts) / mean <= 1.05, counts


def test_balance_totals_cover_every_visible_pair():
    # Summed over ranks, the visible pairs are the same at every CP degree: nothing lost or doubled.
    totals = {c: [sum(r["balance"][wb].pairs_allowed for r in results(c)) for wb in (False, True)] for c in CP_SIZES}
    assert totals[1] == totals[2] == totals[4], totals


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_clear_errors(cp_size):
    for rank, r in enumerate(results(cp_size)):
        msgs = r["errors"]
        assert f"layout.cp_size is {cp_size + 1}" in msgs["cp_size"] and f"has {cp_size} ranks" in msgs["cp_size"]
        assert msgs["bq"].startswith("bq has shape") and "local_branch_tokens" in msgs["bq"]


# ----- no main queries (q=None) -----------------------------------------------------------------------

NO_MAIN_QUANTITIES = ["bout", "blse", "dk", "dv", "dbq", "dbk", "dbv"]
NO_MAIN_FP32 = [c for c in NO_MAIN_CASES if c.dtype == "float32" and c.grad_comm is None]
NO_MAIN_LOW = [c for c in NO_MAIN_CASES if c.dtype in ("bfloat16", "float16") or c.grad_comm is not None]
NO_MAIN_FP64 = [c for c in NO_MAIN_CASES if c.dtype == "float64"]


def _no_main(cp_size, case):
    return [r["no_main"][case.name] for r in results(cp_size)]


@pytest.mark.parametrize("cp_size", CP_SIZES)
@pytest.mark.parametrize("case", NO_MAIN_FP32, ids=lambda c: c.name)
def test_no_main_queries_fp32_matches_dense_branch_rows(cp_size, case):
    # Branch outputs, LSEs, dK/dV of the main keys (from branch queries alone) and dQ/dK/dV of the
    # branches against the oracle's, with the loss on the branch outputs only.
    per_rank = _no_main(cp_size, case)
    assert all(r["main_is_none"] for r in per_rank)
    errors = {q: max(r["abs"][q] for r in per_rank) for q in NO_MAIN_QUANTITIES}
    assert max(errors.values()) <= 1e-5, errors
    assert all(r["pad_grad"] == 0.0 for r in per_rank)


@pytest.mark.parametrize("cp_size", CP_SIZES)
@pytest.mark.parametrize("case", NO_MAIN_LOW, ids=lambda c: c.name)
def test_no_main_queries_bf16_fp16_and_bf16_grad_comm(cp_size, case):
    per_rank = _no_main(cp_size, case)
    excess = {q: max(r["excess"][q] for r in per_rank) for q in NO_MAIN_QUANTITIES}
    assert max(excess.values()) <= 2.5e-2, excess
    if case.dtype == "float32":  # fp32 inputs, dK/dV sent in bf16: only dk/dv round
        errors = {q: max(r["abs"][q] for r in per_rank) for q in NO_MAIN_QUANTITIES}
        assert max(errors[q] for q in ("bout", "blse", "dbq", "dbk", "dbv")) <= 1e-5, errors
        assert max(errors["dk"], errors["dv"]) <= 2e-2, errors


@pytest.mark.parametrize("cp_size", CP_SIZES)
@pytest.mark.parametrize("case", NO_MAIN_FP64, ids=lambda c: c.name)
def test_no_main_queries_fp64_matches_dense_to_fp64_precision(cp_size, case):
    per_rank = _no_main(cp_size, case)
    errors = {q: max(r["abs"][q] for r in per_rank) for q in NO_MAIN_QUANTITIES}
    assert max(errors.values()) <= 1e-12, errors


@pytest.mark.parametrize("cp_size", [2, 4])
def test_no_main_queries_ranks_without_branches_take_part(cp_size):
    # Blocks only on the last rank: the others own no branch, yet their trunk keys are seen, so
    # their dK/dV arrive over the ring; forward and backward completed on every rank (no deadlock:
    # a rank skipping a ring exchange would stall the others until the group's timeout).
    for name in ("dflash_last_rank", "dflash_last_rank_exact", "dflash_last_rank_window_torch"):
        per_rank = [r["no_main"][name] for r in results(cp_size)]
        assert [r["local_branch_tokens"] == 0 for r in per_rank] == [True] * (cp_size - 1) + [False], name
        assert all(r["dkv_nonzero"] for r in per_rank), name
        assert max(max(r["abs"].values()) for r in per_rank) <= 1e-5, name
    # No branch anywhere: empty outputs, dK/dV exactly zero, on every rank.
    per_rank = [r["no_main"]["no_branches"] for r in results(cp_size)]
    assert all(r["local_branch_tokens"] == 0 and not r["dkv_nonzero"] and max(r["abs"].values()) == 0.0 for r in per_rank)


@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_no_main_queries_compute_only_the_branches_pairs(cp_size):
    # CPStats per rank: the pairs the tiles hold are exactly the pairs the oracle's mask allows the
    # rank's branch queries when the kernel makes every tile exact (tile_cost_pairs = 0; windows
    # included: without main queries there is no band tile), and never fewer otherwise; no main
    # query tile is computed (with main queries the same case computes more).
    main_names = {c.name for c in CASES}
    for case in NO_MAIN_CASES:
        name = case.name
        for rank, r in enumerate(results(cp_size)):
            res = r["no_main"][name]
            stats = res["stats"]
            assert stats.pairs_allowed == res["oracle_pairs"], (name, rank)
            if case.kernel.startswith("exact"):
                assert stats.pairs_computed == res["oracle_pairs"], (name, rank, stats.pairs_computed)
            assert stats.pairs_computed >= stats.pairs_allowed, (name, rank)
            if name in main_names:
                with_main = r["cases"][name]["stats"]
                assert stats.pairs_computed < with_main.pairs_computed, (name, rank)
                # the ring moves the same K/V (and dK/dV) with or without main queries
                assert stats.bytes_sent_forward == with_main.bytes_sent_forward, (name, rank)
                assert stats.bytes_sent_backward == with_main.bytes_sent_backward, (name, rank)
