"""Packed rows' RoPE (cotrain.models.packed_rope) is megatron-core's THD RoPE at CP = 1, bit for bit:
values and gradients, full and partial rotary, fp32 and bf16, per-sequence and per-token
frequencies; what it does not cover goes to megatron's own function."""

import pytest
import torch

import cotrain.models.megatron_model  # noqa: F401  (installs the packed RoPE)
from cotrain.models import packed_rope


class _Group:  # what megatron's THD RoPE asks of its CP group
    def __init__(self, rank=0, size=1):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class _Config:
    apply_rope_fusion = False
    rotary_interleaved = False
    multi_latent_attention = False


def _freqs(rows: int, r: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    f = torch.outer(torch.arange(rows).float(), inv)
    return torch.cat([f, f], dim=-1)[:, None, None, :]  # [rows, 1, 1, r] as megatron's RotaryEmbedding


def _packed(seed=0, n=9, heads=6, d=64):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (n,), generator=g)
    lens[2] = 1  # a one-token sequence
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()])
    return torch.randn(int(lens.sum()), heads, d, generator=g), cu


@pytest.mark.parametrize("rotary", [64, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True])
def test_packed_rope_is_megatrons_thd_rope_bit_for_bit(rotary, dtype, per_token):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    x, cu = _packed()
    T = x.shape[0]
    if per_token:  # one row per packed position (megatron's "exact mapping" case)
        pos = torch.cat([torch.arange(int(n)) for n in cu[1:] - cu[:-1]])
        freqs = _freqs(64, rotary)[pos]
    else:
        freqs = _freqs(64, rotary)
    assert (freqs.shape[0] == T) == per_token
    x = x.to(dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ref = _apply_rotary_pos_emb_thd(a, cu, freqs, cp_group=_Group())
    packed_rope._CACHE.clear()
    out = packed_rope.apply_rotary_pos_emb(b, freqs, _Config(), cu_seqlens=cu, cp_group=_Group())
    assert torch.equal(out, ref)
    ref.backward(g)
    out.backward(g)
    assert torch.equal(b.grad, a.grad)
    assert not torch.equal(out, x) and out.dtype == dtype


def test_the_cos_sin_of_a_packed_row_are_computed_once_and_follow_a_change():
    x, cu = _packed(seed=3)
    freqs = _freqs(64, 64)
    packed_rope._CACHE.clear()
    first = packed_rope.packed_rope(x, freqs, cu)
    cached = packed_rope._CACHE[0][4]
    packed_rope.packed_rope(x[:, :2], freqs, cu)  # the keys of the same row: the same cos / sin
    assert packed_rope._CACHE[0][4] is cached
    cu[1:] -= 0  # an in-place change (same values): the version counter moves, recomputed
    again = packed_rope.packed_rope(x, freqs, cu)
    assert packed_rope._CACHE[0][4] is not cached and torch.equal(again, first)
    whole = torch.tensor([0, x.shape[0]], dtype=torch.int32)  # one sequence: positions no longer restart
    assert not torch.equal(packed_rope.packed_rope(x, _freqs(x.shape[0] + 1, 64), whole), first)


def test_what_it_does_not_cover_goes_to_megatron():
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb as megatron_rope
    from megatron.core.transformer import attention

    assert attention.apply_rotary_pos_emb is packed_rope.apply_rotary_pos_emb  # installed
    assert packed_rope._MEGATRON is megatron_rope
    x, cu = _packed(seed=5)
    freqs = _freqs(64, 64)
    padded = x[:20, None]  # [s, b, h, d] without cu_seqlens
    assert torch.equal(packed_rope.apply_rotary_pos_emb(padded, freqs[:20], _Config(), cp_group=_Group()),
                       megatron_rope(padded, freqs[:20], _Config(), cp_group=_Group()))
    calls = []
    real = packed_rope._MEGATRON
    packed_rope._MEGATRON = lambda *a, **k: calls.append(k) or real(*a, **k)
    try:
        even = torch.tensor([0, 8, 20, 32], dtype=torch.int32)  # CP = 2: lengths multiples of 2 x CP
        packed_rope.apply_rotary_pos_emb(x[:16], freqs, _Config(), cu_seqlens=even, cp_group=_Group(0, 2))
        cfg = _Config()
        cfg.rotary_interleaved = True
        packed_rope.apply_rotary_pos_emb(x, freqs, cfg, cu_seqlens=cu, cp_group=_Group())
        packed_rope.apply_rotary_pos_emb(x, freqs, _Config(), cu_seqlens=cu, mscale=2.0, cp_group=_Group())
    finally:
        packed_rope._MEGATRON = real
    assert len(calls) == 3
