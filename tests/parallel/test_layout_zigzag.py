"""Single-process properties: layout validation and builders, zigzag sharding, LSE merge, the oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cotrain.parallel import (
    BranchLayout,
    cu_seqlens_from_lengths,
    dense_branch_attention,
    dflash_layout,
    dspark_layout,
    eagle3_ttt_layout,
    merge_lse,
    sample_anchors,
    shard_branches,
    unshard_branches,
    zigzag_shard,
    zigzag_unshard,
)

CU = cu_seqlens_from_lengths([5, 3, 9])  # sequences at [0,5) [5,8) [8,17)


# ----- validation ------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(anchors=[17], branch_lens=[2]), r"anchors\[0\] = 17 lies outside the packed main sequence \[0, 17\)"),
        (dict(anchors=[-1], branch_lens=[2]), r"anchors\[0\] = -1 lies outside"),
        (dict(anchors=[4, 6], branch_lens=[2, 2], branch_seqs=[0, 0]),
         r"anchors\[1\] = 6 lies outside its sequence branch_seqs\[1\] = 0, which holds packed positions \[0, 5\)"),
        (dict(anchors=[1], branch_lens=[0]), r"branch_lens\[0\] = 0; branch lengths must be >= 1"),
        (dict(anchors=[1, 2], branch_lens=[1]), r"anchors has 2 entries but branch_lens has 1"),
        (dict(anchors=[1], branch_lens=[1], context="before"), r"context must be one of \('inclusive', 'exclusive'\)"),
        (dict(anchors=[1], branch_lens=[1], intra="bidirectional"), r"intra must be one of \('causal', 'full'\)"),
        (dict(anchors=[1], branch_lens=[1], window=0), r"window must be None or an int >= 1"),
        (dict(anchors=[1], branch_lens=[1], cp_size=0), r"cp_size must be an int >= 1"),
    ],
)
def test_layout_rejects_bad_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BranchLayout(CU, **kwargs)


def test_layout_rejects_bad_cu_seqlens():
    with pytest.raises(ValueError, match="sequence 1 has length 0"):
        BranchLayout([0, 3, 3, 5], [], [])
    with pytest.raises(ValueError, match="must start at 0"):
        BranchLayout([1, 3], [], [])
    with pytest.raises(TypeError, match="anchors must hold integers"):
        BranchLayout(CU, [1.5], [1])


def test_shape_errors_name_the_field():
    from cotrain.parallel import cp_branch_attention

    layout = dflash_layout(CU, [2, 10], 3)
    q = torch.zeros(17, 4, 8)
    kv = torch.zeros(17, 2, 8)
    b = torch.zeros(6, 4, 8)
    bkv = torch.zeros(6, 2, 8)
    with pytest.raises(ValueError, match=r"q has shape \(16, 4, 8\), expected \(17, 4, 8\)"):
        cp_branch_attention(q[:16], kv, kv, b, bkv, bkv, layout)
    with pytest.raises(ValueError, match=r"bk has shape \(5, 2, 8\), expected \(6, 2, 8\)"):
        cp_branch_attention(q, kv, kv, b, bkv[:5], bkv, layout)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of key/value heads \(3\)"):
        cp_branch_attention(q, torch.zeros(17, 3, 8), torch.zeros(17, 3, 8), b, bkv, bkv, layout)
    with pytest.raises(ValueError, match="layout.cp_size is 2"):
        cp_branch_attention(q, kv, kv, b, bkv, bkv, layout.with_cp(2))
    ints = [t.to(torch.int32) for t in (q, kv, kv, b, bkv, bkv)]
    with pytest.raises(TypeError, match=r"q is torch.int32; cp_branch_attention takes torch.float32, .*torch.float64"):
        cp_branch_attention(*ints, layout)
    with pytest.raises(TypeError, match="grad_comm_dtype must be None or a floating torch.dtype"):
        cp_branch_attention(q, kv, kv, b, bkv, bkv, layout, grad_comm_dtype=torch.int8)


# ----- builders --------------------------------------------------------------------------------------

def test_eagle3_ttt_layout():
    layout = eagle3_ttt_layout(CU, num_passes=4)
    assert layout.context == "inclusive" and layout.intra == "causal"
    assert layout.anchors.tolist() == list(range(17))
    assert layout.branch_lens.tolist() == [3] * 17
    assert eagle3_ttt_layout(CU, num_passes=1).num_branches == 0
    sub = eagle3_ttt_layout(CU, 2, positions=[9, 0, 4])
    assert sub.anchors.tolist() == [0, 4, 9] and sub.branch_seqs.tolist() == [0, 0, 2]


def test_dflash_and_dspark_layouts():
    a = dflash_layout(CU, [0, 6, 12], 16, window=4, cp_size=2)
    b = dspark_layout(CU, [0, 6, 12], 16, window=4, cp_size=2)
    for layout in (a, b):
        assert layout.context == "exclusive" and layout.intra == "full"
        assert layout.branch_lens.tolist() == [16, 16, 16]
        assert layout.context_last.tolist() == [-1, 0, 3]  # strictly before the anchor, in-sequence
        assert layout.window == 4 and layout.cp_size == 2


def test_sample_anchors_stay_in_their_sequences():
    g = torch.Generator().manual_seed(0)
    anchors = sample_anchors(CU, 4, g, min_position=1)
    layout = dflash_layout(CU, anchors, 2)
    assert (layout.anchor_positions >= 1).all()
    assert torch.equal(layout.branch_seqs, torch.tensor([0] * 4 + [1] * 2 + [2] * 4))


# ----- zigzag ----------------------------------------------------------------------------------------

seqlens_st = st.lists(st.integers(1, 40), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(seqlens=seqlens_st, cp_size=st.integers(1, 4), data=st.data())
def test_zigzag_shard_properties(seqlens, cp_size, data):
    cu = cu_seqlens_from_lengths(seqlens)
    T = int(cu[-1])
    anchors = torch.tensor(data.draw(st.lists(st.integers(0, T - 1), max_size=6)), dtype=torch.int64)
    lens = torch.tensor(data.draw(st.lists(st.integers(1, 4), min_size=len(anchors), max_size=len(anchors))), dtype=torch.int64)
    layout = BranchLayout(cu, anchors, lens, cp_size=cp_size)

    # Every rank holds the same number of rows; every real token lives on exactly one rank.
    idx = [layout.zigzag_index(r) for r in range(cp_size)]
    assert {i.numel() for i in idx} == {layout.local_len}
    real = torch.cat([i[i >= 0] for i in idx])
    assert torch.equal(torch.sort(real).values, torch.arange(T))
    # Padding: none at CP=1; otherwise P_s = ceil(L_s / 2C) * 2C, padding at the end of a sequence.
    padded = layout.padded_seqlens
    if cp_size == 1:
        assert torch.equal(padded, layout.seqlens)
    else:
        assert ((padded % (2 * cp_size)) == 0).all() and ((padded - layout.seqlens) < 2 * cp_size).all()
    for r in range(cp_size):
        for run in layout.zigzag_runs(r):
            assert run.real_stop == min(run.stop, int(layout.seqlens[run.seq]))
            chunks_per_seq = 1 if cp_size == 1 else 2 * cp_size
            assert run.stop - run.start == int(padded[run.seq]) // chunks_per_seq

    # Shard / unshard round trip, main and branches.
    x = torch.randn(T, 3)
    shards = [zigzag_shard(x, layout, r) for r in range(cp_size)]
    assert all((s[i < 0] == 0).all() for s, i in zip(shards, idx))
    assert torch.equal(zigzag_unshard(shards, layout), x)
    bx = torch.randn(layout.total_branch_tokens, 2)
    assert torch.equal(unshard_branches([shard_branches(bx, layout, r) for r in range(cp_size)], layout), bx)

    # A branch lives on the rank that holds its anchor.
    for b, owner in enumerate(layout.branch_owner.tolist()):
        assert int(layout.anchors[b]) in idx[owner].tolist()


def test_zigzag_rank_holds_chunks_r_and_mirror():
    layout = BranchLayout(cu_seqlens_from_lengths([16]), [], [], cp_size=4)  # chunks of 2
    assert layout.zigzag_index(0).tolist() == [0, 1, 14, 15]
    assert layout.zigzag_index(1).tolist() == [2, 3, 12, 13]
    assert layout.zigzag_index(3).tolist() == [6, 7, 8, 9]
    short = BranchLayout(cu_seqlens_from_lengths([3]), [], [], cp_size=4)  # padded to 8
    assert [short.zigzag_index(r).tolist() for r in range(4)] == [[0, -1], [1, -1], [2, -1], [-1, -1]]


# ----- LSE merge -------------------------------------------------------------------------------------

def _partial(scores, values, keep):
    s = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[:, None])
    return p @ values, lse


def test_merge_lse_is_exact_for_any_split():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 10, generator=g, dtype=torch.float64) * 3
    values = torch.randn(10, 4, generator=g, dtype=torch.float64)
    part = torch.randint(0, 3, (6, 10), generator=g)
    part[0] = 1  # row 0: everything in part 1, parts 0 and 2 empty
    full_out, full_lse = _partial(scores, values, torch.ones(6, 10, dtype=torch.bool))
    out = torch.zeros(6, 4, dtype=torch.float64)
    lse = torch.full((6,), float("-inf"), dtype=torch.float64)
    for p in range(3):
        out, lse = merge_lse(out, lse, *_partial(scores, values, part == p))
    assert torch.allclose(out, full_out, atol=1e-12) and torch.allclose(lse, full_lse, atol=1e-12)


def test_merge_lse_of_empty_parts_stays_empty():
    out, lse = merge_lse(torch.zeros(2, 3), torch.full((2,), float("-inf")), torch.zeros(2, 3), torch.full((2,), float("-inf")))
    assert (out == 0).all() and torch.isneginf(lse).all()


# ----- the oracle against independent formulations ------------------------------------------------------

def test_dense_main_equals_causal_sdpa_per_sequence():
    g = torch.Generator().manual_seed(0)
    layout = BranchLayout(CU, [], [])
    q, k, v = torch.randn(17, 4, 8, generator=g), torch.randn(17, 2, 8, generator=g), torch.randn(17, 2, 8, generator=g)
    out, _, _, _ = dense_branch_attention(q, k, v, None, None, None, layout)
    for s in range(3):
        a, b = int(CU[s]), int(CU[s + 1])
        ref = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].repeat_interleave(2, 1).transpose(0, 1),
            v[a:b].repeat_interleave(2, 1).transpose(0, 1), is_causal=True,
        ).transpose(0, 1)
        assert torch.allclose(out[a:b], ref, atol=1e-6)


@pytest.mark.parametrize("window", [None, 2])
def test_dense_branch_rows_by_hand(window):
    """Each branch query, computed alone from the rule written out in the layout docstring."""
    g = torch.Generator().manual_seed(1)
    layouts = [dflash_layout(CU, [0, 7, 13], 3, window=window), eagle3_ttt_layout(CU, 3, positions=[2, 5, 16], window=window)]
    for layout in layouts:
        T, NB = 17, layout.total_branch_tokens
        q, k, v = (torch.randn(T, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
        bq, bk, bv = (torch.randn(NB, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
        _, _, bout, blse = dense_branch_attention(q, k, v, bq, bk, bv, layout)
        row = 0
        for b in range(layout.num_branches):
            s = int(layout.branch_seqs[b])
            start, a = int(CU[s]), int(layout.anchors[b])
            last = a if layout.context == "inclusive" else a - 1  # packed index of last visible main key
            first = start if window is None else max(start, last - window + 1)
            ctx = list(range(first, last + 1))
            W = int(layout.branch_lens[b])
            for j in range(W):
                own = range(row - j, row - j + (j + 1 if layout.intra == "causal" else W))
                keys = torch.cat([k[ctx], bk[list(own)]])
                vals = torch.cat([v[ctx], bv[list(own)]])
                scores = torch.einsum("hd,khd->hk", bq[row], keys) / 2.0
                assert torch.allclose(blse[row], torch.logsumexp(scores, -1))
                assert torch.allclose(bout[row], torch.einsum("hk,khd->hd", scores.softmax(-1), vals))
                row += 1


# ----- GPU (skipped without CUDA) -----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cp1_matches_dense_with_default_kernel():
    from cotrain.parallel import cp_branch_attention

    g = torch.Generator().manual_seed(0)
    layout = dflash_layout(CU, [1, 6, 12], 4, window=5)
    ts = [torch.randn(n, h, 64, generator=g) for n, h in [(17, 4), (17, 2), (17, 2), (12, 4), (12, 2), (12, 2)]]
    ref = dense_branch_attention(*[t.double() for t in ts], layout)
    got = cp_branch_attention(*[t.cuda().bfloat16() for t in ts], layout)
    for a, b in zip(got, ref):
        assert torch.allclose(a.double().cpu(), b, atol=2.5e-2, rtol=2.5e-2)


# ----- kernels: the fused CPU kernel against the plain torch kernel, tile kind by tile kind ----------------

@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_fused_kernel_matches_torch_kernel(window, dtype):
    from cotrain.parallel.kernels import CAUSAL, FULL, MASKED, BlockMask, CpuFusedBlockKernel, Tile, TorchBlockKernel

    g = torch.Generator().manual_seed(0)
    n = 12  # queries 0..11 and keys 0..11 at positions 0..11 of one sequence, plus 6 earlier keys
    pos = torch.arange(n)
    k_pos = torch.cat([pos, torch.arange(-6, 0)]) + 6
    q_hi = pos + 6
    q_lo = q_hi - (window - 1) if window else torch.zeros(n, dtype=torch.int64)
    tiles = [Tile(0, n, 0, n, CAUSAL), Tile(0, n, n, n + 6, FULL if window is None else MASKED), Tile(3, 7, 0, 4, MASKED)]
    mask = BlockMask(tiles, torch.zeros(n, dtype=torch.int64), q_lo, q_hi, torch.zeros(n + 6, dtype=torch.int64), k_pos, window)
    q = torch.randn(n, 4, 8, generator=g).to(dtype)
    k, v = (torch.randn(n + 6, 2, 8, generator=g).to(dtype) for _ in range(2))
    ref, fused = TorchBlockKernel(), CpuFusedBlockKernel()
    out_r, lse_r = ref.forward(q, k, v, mask, 0.3)
    out_f, lse_f = fused.forward(q, k, v, mask, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out_f, out_r, atol=tol) and torch.allclose(lse_f, lse_r, atol=tol)
    dout = torch.randn(out_r.shape, generator=g)
    for a, b in zip(fused.backward(dout, q, k, v, out_r, lse_r, mask, 0.3), ref.backward(dout, q, k, v, out_r, lse_r, mask, 0.3)):
        assert torch.allclose(a, b, atol=tol * 4), float((a - b).abs().max())
    # with an LSE gradient (folded into one more head dimension for the fused op), into given accumulators
    dlse = torch.randn(lse_r.shape, generator=g)
    acc = tuple(torch.ones(t.shape) for t in (q, k, v))
    got = fused.backward(dout, q, k, v, out_r, lse_r, mask, 0.3, dlse, grads=acc)
    assert all(a is b for a, b in zip(got, acc))
    want = ref.backward(dout, q, k, v, out_r, lse_r, mask, 0.3, dlse)
    no_dlse = ref.backward(dout, q, k, v, out_r, lse_r, mask, 0.3)
    for a, b in zip(got, want):
        assert torch.allclose(a - 1, b, atol=tol * 4), float((a - 1 - b).abs().max())
    for b, c in zip(want[:2], no_dlse[:2]):  # the LSE gradient moves dq and dk (dv = P^T dout does not see it)
        assert not torch.allclose(b, c, atol=tol * 40)
