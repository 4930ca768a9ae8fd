"""Context parallelism for branch attention (drafter co-training under CP).

- layout: BranchLayout (the attention rule), builders for EAGLE-3 TTT, DFlash, DSpark, and the one
  anchor sampler (draw_anchors; sample_anchors over whole sequences).
- zigzag: zigzag sharding of packed sequences, padding rule, branch ownership.
- dense: dense_branch_attention, the explicit-mask oracle.
- branch_attention: cp_branch_attention, the packed zigzag ring with branch-local attention (q=None:
  branch queries only); local_branch_attention, the same at CP = 1 without a process group.
- blockdiag: the branch-local (block-diagonal) part of it.
- balance: per-rank work of a layout, and balanced_anchors (anchor sampling with even work per rank).
- lse, ring, kernels: the LSE merge, the P2P ring, the pluggable block kernels.
- varlen: causal attention over packed sequences batched by length (the packed update at CP = 1 on CPU).
- megatron_adapter: a core_attention module for megatron-core layer specs (imported on demand).
"""

from cotrain.parallel.balance import balanced_anchors, rank_work, work_imbalance
from cotrain.parallel.branch_attention import CPStats, cp_branch_attention, local_branch_attention, ring_plan
from cotrain.parallel.dense import branch_attention_mask, dense_branch_attention
from cotrain.parallel.kernels import (
    BlockKernel,
    BlockMask,
    CpuFusedBlockKernel,
    FlashVarlenBlockKernel,
    TorchBlockKernel,
    default_kernel,
)
from cotrain.parallel.layout import (
    BranchLayout,
    cu_seqlens_from_lengths,
    dflash_layout,
    draw_anchors,
    dspark_layout,
    eagle3_ttt_layout,
    sample_anchors,
)
from cotrain.parallel.lse import merge_lse, merge_lse_
from cotrain.parallel.ring import RingComm
from cotrain.parallel.zigzag import (
    anchor_owner,
    padded_seqlens,
    shard_branches,
    unshard_branches,
    zigzag_index,
    zigzag_shard,
    zigzag_unshard,
)

__all__ = [
    "BlockKernel", "BlockMask", "BranchLayout", "CPStats", "CpuFusedBlockKernel", "FlashVarlenBlockKernel", "RingComm",
    "TorchBlockKernel", "anchor_owner", "balanced_anchors", "branch_attention_mask", "cp_branch_attention",
    "cu_seqlens_from_lengths", "default_kernel", "dense_branch_attention", "dflash_layout", "local_branch_attention",
    "draw_anchors", "dspark_layout", "eagle3_ttt_layout", "merge_lse", "merge_lse_", "padded_seqlens", "ring_plan",
    "rank_work", "sample_anchors", "shard_branches", "unshard_branches", "work_imbalance", "zigzag_index",
    "zigzag_shard", "zigzag_unshard",
]
