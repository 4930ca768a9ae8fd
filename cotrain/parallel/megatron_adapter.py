"""CPBranchCoreAttention: a megatron-core `core_attention` that runs context parallelism without TE.

Megatron's own context parallelism lives in transformer-engine's attention; the local
DotProductAttention refuses context_parallel_size > 1. This module takes its place in a layer spec

    spec.submodules.self_attention.submodules.core_attention = CPBranchCoreAttention

and computes causal self-attention (optionally with Megatron's sliding window) over the CP group
with cp_branch_attention and no branches: a packed zigzag ring.

Shapes follow Megatron: query [sq, b, np, hn], key/value [sq, b, ng, hn], output [sq, b, np * hn],
where sq = s / C is this rank's share of every sequence in Megatron's zigzag order
(get_batch_on_this_cp_rank: chunks r and 2C-1-r of the 2C chunks). That is exactly
cotrain.parallel.zigzag's layout for b sequences of length s (s divisible by 2C, so no padding):
[sq, b] transposed to [b, sq] and flattened is the rank's packed local shard.

Window: Megatron's window_size = (left, right) lets query i see keys i - left .. i + right; with
right = 0 that is the layout's window = left + 1. Not supported (clear errors): attention dropout,
packed sequences (THD), attention bias, masks other than causal.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from cotrain.parallel.branch_attention import cp_branch_attention
from cotrain.parallel.kernels import BlockKernel
from cotrain.parallel.layout import BranchLayout, cu_seqlens_from_lengths


class CPBranchCoreAttention(MegatronModule):
    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        kernel: Optional[BlockKernel] = None,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type must be AttnMaskType.causal, got {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout must be 0 for CPBranchCoreAttention, got {dropout}")
        self.layer_number = max(1, layer_number)
        head_dim = config.kv_channels
        # Megatron's query-key layer scaling divides the scores by layer_number and multiplies them
        # back inside its softmax; the net scale is the plain one.
        self.softmax_scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
        self.window: Optional[int] = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            if right != 0:
                raise ValueError(f"window_size must be (left, 0) for causal attention, got {config.window_size}")
            self.window = left + 1 if left >= 0 else None  # left = -1 means unbounded
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is None and parallel_state.model_parallel_is_initialized():
            self.cp_group = parallel_state.get_context_parallel_group()
        self.kernel = kernel
        self._layouts: dict[tuple, BranchLayout] = {}

    def _cp(self) -> tuple[int, Optional[torch.distributed.ProcessGroup]]:
        if self.cp_group is None:
            return 1, None
        return torch.distributed.get_world_size(self.cp_group), self.cp_group

    def _layout(self, batch: int, seq_len: int, cp_size: int) -> BranchLayout:
        key = (batch, seq_len, cp_size)
        if key not in self._layouts:
            if seq_len % (2 * cp_size) and cp_size > 1:
                raise ValueError(f"sequence length {seq_len} must be divisible by 2 * context_parallel_size = {2 * cp_size}")
            self._layouts[key] = BranchLayout(
                cu_seqlens_from_lengths([seq_len] * batch), [], [], window=self.window, cp_size=cp_size
            )
        return self._layouts[key]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("CPBranchCoreAttention: packed sequences (THD) are not supported; use [s, b] batches")
        if attention_bias is not None:
            raise NotImplementedError("CPBranchCoreAttention: attention_bias is not supported")
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type must be causal, got {attn_mask_type}")
        # attention_mask is ignored: the mask is causal by construction (Megatron passes None or the
        # default causal mask here).
        sq, b, nq, hn = query.shape
        cp_size, group = self._cp()
        layout = self._layout(b, sq * cp_size, cp_size)

        def packed(x):  # [sq, b, n, hn] -> [b * sq, n, hn]
            return x.transpose(0, 1).reshape(b * sq, x.shape[2], hn)

        out, _, _, _ = cp_branch_attention(
            packed(query), packed(key), packed(value), None, None, None, layout, group,
            softmax_scale=self.softmax_scale, kernel=self.kernel,
        )
        return out.reshape(b, sq, nq * hn).transpose(0, 1).contiguous()
