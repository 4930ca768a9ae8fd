"""Block attention kernels: (q, k, v, mask, scale) -> (out, lse), and the matching backward.

A block is one set of queries against one set of keys (a rank's queries against the K/V shard that
has just arrived over the ring, or its branch queries against its own branch K/V). The mask rule is
an interval rule on integer metadata:

    query i may see key j  <=>  q_seg[i] == k_seg[j]  and  q_lo[i] <= k_pos[j] <= q_hi[i]

and it is only evaluated inside the listed tiles (contiguous query rows x contiguous key rows);
pairs outside every tile are masked. A tile is "full" (every pair visible), "causal" (a diagonal
tile: the same positions on both sides, q_hi = position, q_lo = position - window + 1),
"repeat_causal" (a diagonal tile whose queries come `rep` rows per key: rows q0 + i*rep ..
q0 + (i+1)*rep - 1 see keys k0 .. k0 + i; a run of consecutive branches of equal length rep, no
window) or "masked" (the rule decides pair by pair). Rows that see nothing get out = 0 and lse = -inf.

Forward, per tile (fp32; fp64 for fp64 inputs):  S = scale q k^T (masked to -inf), lse = logsumexp_j S, out = exp(S - lse) v,
and tiles that share query rows are merged by cotrain.parallel.lse. Backward, given the final
(out, lse) of each row and the incoming dout, dlse:
    P = exp(S - lse),  delta = rowsum(dout * out) - dlse,  dS = P * (dout v^T - delta),
    dq = scale dS k,  dk = scale dS^T q,  dv = P^T dout
(the dlse term makes the LSE output differentiable: d lse_i / d S_ij = P_ij). Grouped-query
attention: query head h uses K/V head h // (H / Hk); dk, dv sum over the heads of a group.

Kernels: TorchBlockKernel (plain torch, any device, the reference); CpuFusedBlockKernel (the
default on CPU: torch's fused CPU flash-attention op for full and causal tiles); FlashVarlenBlockKernel
(the default on CUDA when flash-attn imports: its varlen kernel for full and causal tiles, fp16/bf16).
The fused ones hand "masked" tiles and dtypes they do not take (fp64) to the torch kernel; an LSE
gradient is folded into one more head dimension for them (_fold_dlse).

Branch-local attention is block-diagonal (cotrain.parallel.blockdiag): the kernels here expose it as
forward_blocks / backward_blocks (plain torch, batched per branch length, any device and dtype). A
kernel with only forward / backward (the BlockKernel protocol) gets one exact tile per branch instead.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from cotrain.parallel import blockdiag
from cotrain.parallel.blockdiag import BlockDiagonal, compute_dtype
from cotrain.parallel.lse import merge_lse_

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # dq, dk, dv

FULL, CAUSAL, MASKED, REPEAT_CAUSAL = "full", "causal", "masked", "repeat_causal"
# What one more tile costs a kernel, in query-key pairs: the plan gives branches exact tiles of their
# own only where that saves more pairs than this (0: always, every tile exact). On CPU one more fused
# tile (fwd + bwd) costs about as much as 2,500 more pairs in a tile of 16 rows (measured with
# CpuFusedBlockKernel, one thread), hence 2048; 0 where tiles are batched into one call (varlen).
DEFAULT_TILE_COST_PAIRS = 2048


@dataclass(frozen=True)
class Tile:
    """Query rows [q0, q1) x key rows [k0, k1) and how the mask looks inside."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: str = MASKED
    rep: int = 1  # query rows per key of a repeat_causal tile

    @property
    def pairs(self) -> int:
        return (self.q1 - self.q0) * (self.k1 - self.k0)

    @property
    def pairs_computed(self) -> int:
        """Pairs a kernel that knows the tile kind computes: the lower triangle of (repeat-)causal tiles."""
        n = self.k1 - self.k0
        if self.kind == CAUSAL:
            return n * (n + 1) // 2
        if self.kind == REPEAT_CAUSAL:
            return self.rep * n * (n + 1) // 2
        return self.pairs


@dataclass
class BlockMask:
    """The interval rule of the module docstring, restricted to `tiles`."""

    tiles: list[Tile]
    q_seg: torch.Tensor
    q_lo: torch.Tensor
    q_hi: torch.Tensor
    k_seg: torch.Tensor
    k_pos: torch.Tensor
    window: Optional[int] = None  # the sliding window "causal" tiles carry (for kernels that need it)

    def allowed(self, tile: Tile) -> torch.Tensor:
        """(q1 - q0, k1 - k0) bool mask of one tile."""
        q = slice(tile.q0, tile.q1)
        k = slice(tile.k0, tile.k1)
        kpos = self.k_pos[k][None, :]
        return (
            (self.q_seg[q][:, None] == self.k_seg[k][None, :])
            & (kpos >= self.q_lo[q][:, None])
            & (kpos <= self.q_hi[q][:, None])
        )

    def pairs_computed(self) -> int:
        """Query-key pairs the tiles hand to the kernel: every pair of a full or masked tile, the lower
        triangle of a (repeat-)causal tile (what a causal kernel computes; the fused CPU op and
        flash-attn skip the upper triangle at their block granularity, the reference
        TorchBlockKernel computes and masks it)."""
        return sum(t.pairs_computed for t in self.tiles)

    def pairs_allowed(self) -> int:
        """Query-key pairs the rule makes visible."""
        return sum(t.pairs if t.kind == FULL else int(self.allowed(t).sum()) for t in self.tiles)

    def to(self, device: torch.device) -> "BlockMask":
        return BlockMask(
            self.tiles, self.q_seg.to(device), self.q_lo.to(device), self.q_hi.to(device),
            self.k_seg.to(device), self.k_pos.to(device), self.window,
        )


class BlockKernel(Protocol):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (Nq, H, D), k/v (Nk, Hk, D) -> out (Nq, H, D) fp32, lse (Nq, H) fp32."""

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, mask: BlockMask, scale: float, dlse: Optional[torch.Tensor] = None,
        grads: Optional[Grads] = None,
    ) -> Grads:
        """Gradients (fp32) w.r.t. q, k, v of this block, given each row's final out and lse, added
        into ``grads`` (dq, dk, dv accumulators in the accumulation dtype, shaped like q, k, v) and
        returned; grads=None allocates zeros. The ring passes the same accumulators at every step, so
        a backward allocates them once."""


def _accumulators(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grads: Optional[Grads]) -> Grads:
    """grads, or zeros shaped like q, k, v in the accumulation dtype."""
    if grads is not None:
        return grads
    ctype = compute_dtype(q.dtype)
    return tuple(torch.zeros(t.shape, dtype=ctype, device=t.device) for t in (q, k, v))


def _heads(q: torch.Tensor, hk: int, ctype: torch.dtype = torch.float32) -> torch.Tensor:
    """(n, H, D) -> (Hk, g, n, D) in ctype."""
    n, h, d = q.shape
    return q.to(ctype).reshape(n, hk, h // hk, d).permute(1, 2, 0, 3)


def _unheads(x: torch.Tensor) -> torch.Tensor:
    """(Hk, g, n, ...) -> (n, H, ...)."""
    hk, g, n = x.shape[:3]
    return x.permute(2, 0, 1, *range(3, x.dim())).reshape(n, hk * g, *x.shape[3:])


def _finite_or_zero(lse: torch.Tensor) -> torch.Tensor:
    # exp(S - lse) for a row that sees nothing: S = -inf everywhere; use lse = 0 so P = 0, not nan.
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


class TorchBlockKernel:
    """Dense attention per tile in plain torch (CPU or GPU), in fp32 (fp64 for fp64 inputs)."""

    tile_cost_pairs = DEFAULT_TILE_COST_PAIRS

    def _scores(self, q, k, mask: BlockMask, tile: Tile, scale: float):
        hk, ctype = k.shape[1], compute_dtype(q.dtype)
        qt = _heads(q[tile.q0 : tile.q1], hk, ctype)  # (Hk, g, n, D)
        kt = k[tile.k0 : tile.k1].to(ctype).permute(1, 0, 2).unsqueeze(1)  # (Hk, 1, m, D)
        s = torch.matmul(qt, kt.transpose(-1, -2)).mul_(scale)  # (Hk, g, n, m)
        if tile.kind != FULL:
            s.masked_fill_(~mask.allowed(tile), float("-inf"))
        return qt, kt, s

    def forward(self, q, k, v, mask: BlockMask, scale: float):
        nq, h, d = q.shape
        ctype = compute_dtype(q.dtype)
        out = torch.zeros(nq, h, d, dtype=ctype, device=q.device)
        lse = torch.full((nq, h), float("-inf"), dtype=ctype, device=q.device)
        for tile in mask.tiles:
            _, _, s = self._scores(q, k, mask, tile, scale)
            # One exp per score: e = exp(S - rowmax), lse = rowmax + log(sum e), out = (e v) / sum e.
            row_max = _finite_or_zero(s.amax(dim=-1, keepdim=True))
            e = s.sub_(row_max).exp_()
            denom = e.sum(dim=-1, keepdim=True)  # 0 for rows that see nothing in this tile
            tile_lse = (row_max + torch.log(denom)).squeeze(-1)  # (Hk, g, n), -inf for those rows
            vt = v[tile.k0 : tile.k1].to(ctype).permute(1, 0, 2).unsqueeze(1)  # (Hk, 1, m, D)
            tile_out = torch.matmul(e, vt).div_(torch.where(denom > 0, denom, torch.ones_like(denom)))
            rows = slice(tile.q0, tile.q1)
            merge_lse_(out[rows], lse[rows], _unheads(tile_out), _unheads(tile_lse))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, mask: BlockMask, scale: float, dlse=None, grads=None):
        hk, ctype = k.shape[1], compute_dtype(q.dtype)
        dq, dk, dv = _accumulators(q, k, v, grads)
        if not mask.tiles:
            return dq, dk, dv
        delta = (dout.to(ctype) * out.to(ctype)).sum(-1)  # (Nq, H)
        if dlse is not None:
            delta = delta - dlse.to(ctype)
        for tile in mask.tiles:
            rows, cols = slice(tile.q0, tile.q1), slice(tile.k0, tile.k1)
            qt, kt, s = self._scores(q, k, mask, tile, scale)
            p = s.sub_(_finite_or_zero(_heads(lse[rows].unsqueeze(-1), hk, ctype))).exp_()  # (Hk, g, n, m)
            do = _heads(dout[rows], hk, ctype)  # (Hk, g, n, D)
            vt = v[cols].to(ctype).permute(1, 0, 2).unsqueeze(1)  # (Hk, 1, m, D)
            dp = torch.matmul(do, vt.transpose(-1, -2))  # (Hk, g, n, m)
            ds = dp.sub_(_heads(delta[rows].unsqueeze(-1), hk, ctype)).mul_(p)
            dq[rows] += _unheads(torch.matmul(ds, kt)) * scale
            dk[cols] += (torch.matmul(ds.transpose(-1, -2), qt).sum(1) * scale).permute(1, 0, 2)
            dv[cols] += torch.matmul(p.transpose(-1, -2), do).sum(1).permute(1, 0, 2)
        return dq, dk, dv

    def forward_blocks(self, q, k, v, blocks: BlockDiagonal, scale: float):
        """Block-diagonal (branch-local) attention: out, lse of the blocks alone."""
        return blockdiag.forward(q, k, v, blocks, scale)

    def backward_blocks(self, dout, q, k, v, out, lse, blocks: BlockDiagonal, scale: float, dlse=None):
        return blockdiag.backward(dout, q, k, v, out, lse, blocks, scale, dlse)


class _FusedTileKernel:
    """Dispatch shared by the fused kernels: the tile kinds in FUSED_KINDS go to a fused attention op
    that returns (out, lse) and whose backward takes the rows' final (out, lse) (an LSE gradient
    folded in by _fold_dlse: the ops have no dlse input); other tiles and inputs the op cannot take go
    to TorchBlockKernel."""

    FUSED_KINDS: tuple[str, ...] = (FULL, CAUSAL)
    tile_cost_pairs = DEFAULT_TILE_COST_PAIRS

    def __init__(self) -> None:
        self._torch = TorchBlockKernel()

    def _usable(self, q: torch.Tensor) -> bool:
        raise NotImplementedError

    def _fused_forward(self, q, k, v, mask: BlockMask, tiles: list[Tile], scale: float, out, lse) -> None:
        raise NotImplementedError

    def _fused_backward(self, dout, q, k, v, out, lse, mask: BlockMask, tiles: list[Tile], scale: float, dq, dk, dv) -> None:
        raise NotImplementedError

    def _fused_backward_fits(self, head_dim: int) -> bool:
        """Whether the fused backward takes this head dim (LSE-gradient column included)."""
        return True

    def _split(self, mask: BlockMask) -> tuple[list[Tile], BlockMask]:
        fused = [t for t in mask.tiles if t.kind in self.FUSED_KINDS]
        rest = [t for t in mask.tiles if t.kind not in self.FUSED_KINDS]
        return fused, BlockMask(rest, mask.q_seg, mask.q_lo, mask.q_hi, mask.k_seg, mask.k_pos, mask.window)

    def forward(self, q, k, v, mask: BlockMask, scale: float):
        if not self._usable(q):
            return self._torch.forward(q, k, v, mask, scale)
        fused, rest = self._split(mask)
        out, lse = self._torch.forward(q, k, v, rest, scale)
        if fused:
            self._fused_forward(q, k, v, mask, fused, scale, out, lse)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, mask: BlockMask, scale: float, dlse=None, grads=None):
        if not self._usable(q):
            return self._torch.backward(dout, q, k, v, out, lse, mask, scale, dlse, grads)
        head_dim = q.shape[-1] + (dlse is not None)  # _fold_dlse adds one column
        if not self._fused_backward_fits(head_dim):
            return self._torch.backward(dout, q, k, v, out, lse, mask, scale, dlse, grads)
        fused, rest = self._split(mask)
        dq, dk, dv = self._torch.backward(dout, q, k, v, out, lse, rest, scale, dlse, grads)
        if fused:
            if dlse is not None:
                dout, q, k, v, out = _fold_dlse(dout, q, k, v, out, dlse)
            self._fused_backward(dout, q, k, v, out, lse, mask, fused, scale, dq, dk, dv)
        return dq, dk, dv

    def forward_blocks(self, q, k, v, blocks: BlockDiagonal, scale: float):
        return self._torch.forward_blocks(q, k, v, blocks, scale)

    def backward_blocks(self, dout, q, k, v, out, lse, blocks: BlockDiagonal, scale: float, dlse=None):
        return self._torch.backward_blocks(dout, q, k, v, out, lse, blocks, scale, dlse)


def _fold_dlse(dout, q, k, v, out, dlse):
    """The fused backward ops take no LSE gradient; fold it into one more head dimension. With
    d lse_i / d s_ij = P_ij the score gradient is dS = P (dout v^T - delta + dlse), delta =
    rowsum(dout * out): appending a column of ones to v, dlse to dout, 0 to out, and 0 to q and k
    (the scores do not change) makes the op's dout v^T + its delta exactly that, so its dq, dk, dv are
    right in the first D columns (the extra column of dv is P^T dlse: dropped by the caller)."""
    def pad(x, value, dtype=None):
        x = x if dtype is None else x.to(dtype)
        return torch.cat([x, x.new_full((*x.shape[:-1], 1), value)], dim=-1)

    return (torch.cat([dout, dlse.to(dout.dtype)[..., None]], dim=-1), pad(q, 0.0), pad(k, 0.0), pad(v, 1.0),
            pad(out, 0.0, dout.dtype))


def _window_bias(n: int, window: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask of a square diagonal tile under a sliding window: 0 where i - window < j <= i."""
    i = torch.arange(n, device=device)
    ok = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    return torch.zeros(n, n, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))


class CpuFusedBlockKernel(_FusedTileKernel):
    """torch's fused CPU flash-attention op (the one behind scaled_dot_product_attention on CPU),
    which also returns the LSE, for full, causal and repeat_causal tiles (the latter as a batch of
    `rep` causal attentions sharing the keys: batch j holds rows q0 + i*rep + j); TorchBlockKernel
    for the rest."""

    FUSED_KINDS = (FULL, CAUSAL, REPEAT_CAUSAL)
    _fwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    _bwd = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

    def _usable(self, q):
        return self._fwd is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)

    @staticmethod
    def _rows_in(x: torch.Tensor, t: Tile, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Query-side rows (n*rep, heads, ...) of tile t -> (rep, heads, n, ...) (rep = 1 unless repeat_causal)."""
        rows = x[t.q0 : t.q1] if dtype is None else x[t.q0 : t.q1].to(dtype)
        rep = t.rep if t.kind == REPEAT_CAUSAL else 1
        rows = rows.reshape(rows.shape[0] // rep, rep, *rows.shape[1:])
        return rows.permute(1, 2, 0, *range(3, rows.dim()))

    @staticmethod
    def _rows_out(x: torch.Tensor) -> torch.Tensor:
        """The inverse of _rows_in: (rep, heads, n, ...) -> (n*rep, heads, ...)."""
        x = x.permute(2, 0, 1, *range(3, x.dim()))
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    @staticmethod
    def _keys(x: torch.Tensor, t: Tile, groups: int) -> torch.Tensor:
        """Key rows of tile t -> (rep, heads * groups, m, D), K/V heads repeated for grouped-query attention."""
        x = x[t.k0 : t.k1]
        if groups > 1:
            x = x.repeat_interleave(groups, dim=1)
        x = x.transpose(0, 1).unsqueeze(0)
        return x.expand(t.rep, *x.shape[1:]) if t.kind == REPEAT_CAUSAL else x

    def _bias(self, tile: Tile, mask: BlockMask, dtype) -> Optional[torch.Tensor]:
        if tile.kind == CAUSAL and mask.window is not None:
            return _window_bias(tile.q1 - tile.q0, mask.window, dtype, "cpu")
        return None

    def _fused_forward(self, q, k, v, mask, tiles, scale, out, lse):
        g = q.shape[1] // k.shape[1]
        for t in tiles:
            bias = self._bias(t, mask, q.dtype)
            o, l = self._fwd(
                self._rows_in(q, t), self._keys(k, t, g), self._keys(v, t, g),
                0.0, t.kind != FULL and bias is None, attn_mask=bias, scale=scale,
            )
            rows = slice(t.q0, t.q1)
            merge_lse_(out[rows], lse[rows], self._rows_out(o).float(), self._rows_out(l).float())

    def _fused_backward(self, dout, q, k, v, out, lse, mask, tiles, scale, dq, dk, dv):
        hk = k.shape[1]
        g = q.shape[1] // hk
        for t in tiles:
            rows, cols = slice(t.q0, t.q1), slice(t.k0, t.k1)
            bias = self._bias(t, mask, q.dtype)
            gq, gk, gv = self._bwd(
                self._rows_in(dout, t, q.dtype), self._rows_in(q, t), self._keys(k, t, g), self._keys(v, t, g),
                self._rows_in(out, t, q.dtype), self._rows_in(lse, t).contiguous(),
                0.0, t.kind != FULL and bias is None, attn_mask=bias, scale=scale,
            )
            m, d = t.k1 - t.k0, dq.shape[-1]  # d < the inputs' head dim when an LSE gradient was folded in
            dq[rows] += self._rows_out(gq)[..., :d].float()
            dk[cols] += gk.sum(0).reshape(hk, g, m, -1).sum(1).transpose(0, 1)[..., :d].float()
            dv[cols] += gv.sum(0).reshape(hk, g, m, -1).sum(1).transpose(0, 1)[..., :d].float()


class FlashVarlenBlockKernel(_FusedTileKernel):
    """flash-attn's varlen kernel (CUDA, fp16/bf16) for full and causal tiles; torch for the rest.

    Every eligible tile becomes one varlen "sequence" (its query rows and key rows gathered), so one
    flash call per tile kind covers a whole block, and exact per-branch tiles cost nothing extra
    (tile_cost_pairs = 0). repeat_causal tiles go to the torch kernel.

    Supported: flash-attn 2.7 and 2.8 (``flash_attn.__version__``; anything else is refused when the
    kernel is built, with an ImportError naming the installed version, and ``default_kernel`` falls
    back to the torch kernel with a warning). Read from Dao-AILab/flash-attention's
    ``flash_attn/flash_attn_interface.py`` at v2.6.3, v2.7.0, v2.7.4, v2.8.0 and v2.8.3: the public
    ``flash_attn_varlen_func`` is the same in all of them, but ``_flash_attn_varlen_backward`` took
    ``window_size`` as one tuple up to 2.6.3 and ``window_size_left`` / ``window_size_right`` from
    2.7.0 on (2.7.4 added ``zero_tensors``, with a default). The parameter names are also checked.

    Calls, all by keyword: the forward is the public ``flash_attn_varlen_func`` with
    ``return_attn_probs=True`` (it returns ``(out, softmax_lse, S_dmask)``, the LSE as (nheads,
    total_q); S_dmask is empty without dropout; it pads the head dim to a multiple of 8 itself); the
    backward is ``_flash_attn_varlen_backward``, the function flash-attn's own autograd calls: the
    public API has no backward that takes the rows' *merged* (out, lse), which the ring needs
    (ring-flash-attention calls the same function). That private function does not pad: its CUDA
    op (``mha_varlen_bwd`` in csrc/flash_attn/flash_api.cpp) requires head_size % 8 == 0 and
    head_size <= 256, so the backward pads dout, q, k, v and out with zero columns to the next
    multiple of 8, as ``FlashAttnVarlenFunc.backward`` does, and slices the gradients back (zero
    columns change neither the scores, nor dout v^T, nor rowsum(dout * out)). With an LSE gradient
    folded in (_fold_dlse: head dim D + 1) the padded dim must still be <= 256, i.e. D <= 248; above
    that the backward of the whole block runs on the torch kernel. The calls (keywords, shapes,
    padding, the LSE layout) are checked on CPU against stand-ins with 2.8.3's signatures
    (tests/parallel/test_flash_api.py); the kernel itself runs only in the CUDA tests.
    """

    tile_cost_pairs = 0
    _BACKWARD_KEYWORDS = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q",
                          "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal",
                          "window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic")

    SUPPORTED_VERSIONS = ((2, 7), (2, 8))  # (major, minor) of flash_attn.__version__
    MAX_HEAD_DIM = 256  # flash-attn 2's limit, forward and backward

    def __init__(self) -> None:
        import flash_attn
        from flash_attn import flash_attn_varlen_func
        from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

        version = getattr(flash_attn, "__version__", "unknown")
        if _major_minor(version) not in self.SUPPORTED_VERSIONS:
            raise ImportError(f"flash-attn {version} is installed; FlashVarlenBlockKernel supports flash-attn 2.7 - 2.8 "
                              "(the parameters of its private _flash_attn_varlen_backward differ in other versions)")
        missing = [name for name in self._BACKWARD_KEYWORDS if name not in _parameters(_flash_attn_varlen_backward)]
        if missing:
            raise ImportError(f"flash_attn._flash_attn_varlen_backward (flash-attn {version}) has no parameter(s) "
                              f"{', '.join(missing)}: FlashVarlenBlockKernel supports flash-attn 2.7 - 2.8")
        self._fwd, self._bwd = flash_attn_varlen_func, _flash_attn_varlen_backward
        super().__init__()

    def _fused_backward_fits(self, head_dim: int) -> bool:
        return _round8(head_dim) <= self.MAX_HEAD_DIM

    def _usable(self, q):
        return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= self.MAX_HEAD_DIM

    @staticmethod
    def _groups(mask: BlockMask, tiles: list[Tile]):
        window = (-1, -1) if mask.window is None else (mask.window - 1, 0)
        for kind in (FULL, CAUSAL):
            group = [t for t in tiles if t.kind == kind]
            if group:
                yield group, kind == CAUSAL, window if kind == CAUSAL else (-1, -1)

    @staticmethod
    def _gather(tiles: list[Tile], device):
        qi = torch.cat([torch.arange(t.q0, t.q1) for t in tiles]).to(device)
        ki = torch.cat([torch.arange(t.k0, t.k1) for t in tiles]).to(device)
        cq = torch.tensor([0] + [t.q1 - t.q0 for t in tiles], device=device).cumsum(0).to(torch.int32)
        ck = torch.tensor([0] + [t.k1 - t.k0 for t in tiles], device=device).cumsum(0).to(torch.int32)
        rows = [0] + torch.tensor([t.q1 - t.q0 for t in tiles]).cumsum(0).tolist()  # host copy of cq
        return qi, ki, cq, ck, rows, max(t.q1 - t.q0 for t in tiles), max(t.k1 - t.k0 for t in tiles)

    def _fused_forward(self, q, k, v, mask, tiles, scale, out, lse):
        for group, causal, window in self._groups(mask, tiles):
            qi, ki, cq, ck, rows, mq, mk = self._gather(group, q.device)
            o, l, _ = self._fwd(
                q=q[qi], k=k[ki], v=v[ki], cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk,
                dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=window, return_attn_probs=True,
            )
            l = l.transpose(0, 1).float()  # (total_q, H)
            # Tiles of one group may share query rows: merge them one tile at a time.
            for idx, t in enumerate(group):
                a, b = rows[idx], rows[idx + 1]
                merge_lse_(out[t.q0 : t.q1], lse[t.q0 : t.q1], o[a:b].float(), l[a:b])

    def _fused_backward(self, dout, q, k, v, out, lse, mask, tiles, scale, dq, dk, dv):
        pad = _round8(q.shape[-1]) - q.shape[-1]  # the CUDA op takes head_size % 8 == 0 only (class doc)
        widen = (lambda x: torch.nn.functional.pad(x, (0, pad))) if pad else (lambda x: x)  # noqa: E731
        d = dq.shape[-1]  # < the inputs' head dim when an LSE gradient was folded in, < the padded one always
        for group, causal, window in self._groups(mask, tiles):
            qi, ki, cq, ck, _, mq, mk = self._gather(group, q.device)
            qg, kg, vg = widen(q[qi]), widen(k[ki]), widen(v[ki])
            dqg, dkg, dvg = torch.empty_like(qg), torch.empty_like(kg), torch.empty_like(vg)
            self._bwd(
                dout=widen(dout[qi].to(q.dtype)), q=qg, k=kg, v=vg, out=widen(out[qi].to(q.dtype)),
                softmax_lse=lse[qi].transpose(0, 1).contiguous(), dq=dqg, dk=dkg, dv=dvg,
                cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk, dropout_p=0.0,
                softmax_scale=scale, causal=causal, window_size_left=window[0], window_size_right=window[1],
                softcap=0.0, alibi_slopes=None, deterministic=False,
            )
            dq.index_add_(0, qi, dqg[..., :d].float())
            dk.index_add_(0, ki, dkg[..., :d].float())
            dv.index_add_(0, ki, dvg[..., :d].float())


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def _major_minor(version: str) -> tuple[int, int] | None:
    """(2, 8) for "2.8.3" / "2.8.3.post1"; None when the string does not start with two integers."""
    parts = str(version).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def _parameters(fn) -> set[str]:
    """Parameter names of fn (a torch.library custom op keeps the Python function in _init_fn)."""
    import inspect

    return set(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def default_kernel(device: torch.device | str | None = None) -> BlockKernel:
    """flash-attn on CUDA when it imports; torch's fused CPU op on CPU; the plain torch kernel otherwise."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        try:
            return FlashVarlenBlockKernel()
        except ImportError as e:
            if "supports flash-attn" in str(e):  # installed, but not a version whose signature we know
                warnings.warn(f"{e}; branch attention uses the torch kernel", stacklevel=2)
            return TorchBlockKernel()
    if device.type == "cpu" and CpuFusedBlockKernel._fwd is not None:
        return CpuFusedBlockKernel()
    return TorchBlockKernel()
