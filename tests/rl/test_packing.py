"""Packed micro batches by hand (cotrain.rl.packing): the LPT plan against a brute-force optimum,
the packed row's layout cut by hand, and attention that never crosses from one packed sequence into
its neighbour (a huge value planted in one sequence leaves the other's outputs bit-identical)."""

import itertools

import pytest
import torch

from cotrain.rl.batch import build_batch
from cotrain.rl.interfaces import Sample
from cotrain.rl.packing import lpt, pack, plan_micro_batches


def _sample(prompt, response):
    return Sample(prompt_index=0, prompt_token_ids=prompt, token_ids=response, logprobs=[-0.5] * len(response),
                  text="", finish_reason="stop", weight_version=0)


def _best_makespan(sizes, bins):
    return min(max(sum(s for s, b in zip(sizes, a) if b == k) for k in range(bins))
               for a in itertools.product(range(bins), repeat=len(sizes)))


@pytest.mark.parametrize("seed", range(6))
def test_lpt_is_within_graham_bound_of_the_optimum(seed):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 60, (7,), generator=g).tolist()
    groups = lpt(sizes, 3)
    assert sorted(i for grp in groups for i in grp) == list(range(7))  # each sequence exactly once
    load = max(sum(sizes[i] for i in grp) for grp in groups)
    assert load <= 4 / 3 * _best_makespan(sizes, 3) + 1e-9


def test_plan_respects_the_budget_balances_ranks_and_is_deterministic():
    g = torch.Generator().manual_seed(0)
    lengths = (torch.randint(8, 40, (48,), generator=g).tolist()
               + [150, 160, 140])  # a long tail, as a real rollout has
    plan = plan_micro_batches(lengths, dp=2, budget=256, cp=2)
    assert plan == plan_micro_batches(list(lengths), dp=2, budget=256, cp=2)
    seen = sorted(r for rank in plan for mb in rank for r in mb)
    assert seen == list(range(len(lengths)))
    padded = [-(-n // 4) * 4 for n in lengths]  # 2C = 4
    for rank in plan:
        for mb in rank:
            assert sum(padded[r] for r in mb) <= 256
    per_rank = [sum(padded[r] for mb in rank for r in mb) for rank in plan]
    assert max(per_rank) - min(per_rank) <= max(padded)  # LPT: within one sequence of each other
    # the fewest micro batches that fit: never more than one above the token lower bound
    for rank, tokens in zip(plan, per_rank):
        assert len(rank) <= -(-tokens // 256) + 1


def test_plan_refuses_a_sequence_over_the_budget_and_too_few_sequences():
    with pytest.raises(ValueError, match="exceeds the micro batch token budget 16"):
        plan_micro_batches([10, 17], dp=1, budget=16)
    with pytest.raises(ValueError, match="cannot fill 4 data-parallel ranks"):
        plan_micro_batches([3, 4, 5], dp=4, budget=16)


def test_packed_row_by_hand():
    # rows: [1 2 3 | 4 5] (L=5), [1 2 | 6] (L=3), [7 | 8 9 10] (L=4); C = 2 pads to multiples of 4
    batch = build_batch([_sample([1, 2, 3], [4, 5]), _sample([1, 2], [6]), _sample([7], [8, 9, 10])],
                        [1.0, -1.0, 0.5], pad_id=0, multiple_of=8)
    assert batch.lengths.tolist() == [5, 3, 4]
    mb0 = pack(batch, [0, 2], cp=2, rank=0, width=16)
    mb1 = pack(batch, [0, 2], cp=2, rank=1, width=16)
    # sequence 0 padded to 8 (chunks of 2), sequence 2 to 4 (chunks of 1), filler of 4 (chunks of 1)
    assert mb0.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 9, 13]
    assert mb0.packed_seq_params.cu_seqlens_q_padded.tolist() == [0, 8, 12, 16]
    assert mb0.inputs.tolist() == [[1, 2, 0, 0, 7, 10, 0, 0]]  # chunks 0 and 3 of every sequence
    assert mb1.inputs.tolist() == [[3, 4, 5, 0, 8, 9, 0, 0]]  # chunks 1 and 2
    assert mb0.seq.tolist() == [[0, 0, -1, -1, 1, 1, -1, -1]]
    assert mb1.mask.tolist() == [[1, 1, 0, 0, 1, 1, 0, 0]]  # targets 4, 5 and 9, 10 are responses
    assert mb0.advantages.tolist() == [[1.0, 1.0, 0, 0, 0.5, 0.5, 0, 0]]
    assert mb0.num_real == 6 and mb0.width == 16 and mb0.widths.tolist() == [8, 4]
    assert mb0.seq_tokens.tolist() == [2.0, 3.0]  # whole sequences' response targets, not the shard's
    # scattering each rank's positions back rebuilds the rows (real positions only)
    grid = torch.zeros(3, batch.seq_len)
    for mb in (mb0, mb1):
        mb.scatter(mb.inputs.float(), grid)
    expect = batch.inputs.float().clone()
    expect[1] = 0
    for r, n in enumerate(batch.lengths.tolist()):
        expect[r, n:] = 0
    torch.testing.assert_close(grid, expect)
    # CP = 1: no padding, positions restart per sequence
    one = pack(batch, [1, 0], cp=1)
    assert one.inputs.tolist() == [[1, 2, 6, 1, 2, 3, 4, 5]]
    assert one.positions().tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]


def test_packed_attention_never_crosses_sequences(monkeypatch):
    """CPBranchCoreAttention on a packed row (CP = 1, Megatron's THD shapes): planting a huge key / value in
    one sequence changes nothing in the other; and each sequence's output is that of its own causal
    attention run alone."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cotrain.parallel.megatron_adapter import CPBranchCoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, kv_channels=8,
                            num_query_groups=2, attention_dropout=0.0, hidden_dropout=0.0)
    core = CPBranchCoreAttention(cfg, 1, AttnMaskType.causal, "self")
    lens = [5, 7, 3]
    cu = torch.tensor([0, 5, 12, 15], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=7, max_seqlen_kv=7)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(15, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = core(q, k, v, None, packed_seq_params=params)
    k2, v2 = k.clone(), v.clone()
    k2[5:12] += 1e4  # sequence 1 only
    v2[5:12] = 1e6
    out2 = core(q, k2, v2, None, packed_seq_params=params)
    assert torch.equal(out2[:5], out[:5]) and torch.equal(out2[12:], out[12:])
    assert (out2[5:12] - out[5:12]).abs().max() > 1e3  # the plant did reach its own sequence
    for a, n in zip([0, 5, 12], lens):  # each sequence alone, causal, by the formula
        s = torch.einsum("qhd,khd->hqk", q[a:a + n], k[a:a + n]) * 8 ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[a:a + n]).reshape(n, 16)
        torch.testing.assert_close(out[a:a + n], ref, atol=1e-12, rtol=1e-12)
