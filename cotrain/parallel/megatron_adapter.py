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

from cotrain.parallel.branch_attention import cp_branch_attention, local_branch_attention
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


# ------------------------------------------------------------------------------- tree scoring
# SpecOPD's target scoring inside the Megatron policy (cotrain.draft.specopd, docs/cotrain.md): the
# log-prob recomputation already ran the policy over the stem (the rollout rows); its keys and
# values are captured at every layer's core_attention (``StemKV``), and the branch tokens then run
# through the policy alone (``tree_branch_logits``): rotary positions by semantic position
# (anchor + j), every core_attention replaced for that forward by branch attention with no main
# queries (q=None) over the captured stem keys/values on the tree layout (context inclusive, intra
# causal: branch token j sees the stem up to its anchor and its own tokens 1..j). The stem's outputs
# are the log-prob forward's, untouched: stem tokens never see branch tokens by construction.


def _core_attentions(gpt) -> list:
    return [layer.self_attention.core_attention for layer in gpt.decoder.layers]


def _plain_scale(module) -> float:
    """The net softmax scale of a core_attention (Megatron's query-key layer scaling multiplies back
    inside its softmax what DotProductAttention's softmax_scale divided out)."""
    if isinstance(module, CPBranchCoreAttention):
        return module.softmax_scale
    cfg = module.config
    return cfg.softmax_scale if cfg.softmax_scale is not None else cfg.kv_channels**-0.5


def _window_of(module) -> Optional[int]:
    cfg = module.config
    if cfg.window_size is not None and is_layer_window_attention(cfg.window_size, cfg.window_attn_skip_freq,
                                                                  getattr(module, "layer_number", 1)):
        return cfg.window_size
    return None


class StemKV:
    """Keys and values every core_attention of ``gpt`` receives (post-rotary, [s, b, ng, hn]),
    captured while ``active``: one microbatch's worth (each forward overwrites the last)."""

    def __init__(self, gpt):
        self.active = False
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles = []
        for i, core in enumerate(_core_attentions(gpt)):
            if _window_of(core) is not None:
                raise NotImplementedError(f"tree scoring: layer {i} uses sliding-window attention "
                                          "(not supported by the on-policy branch scoring)")
            self._handles.append(core.register_forward_pre_hook(self._hook(i), with_kwargs=True))

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            if self.active:
                key = args[1] if len(args) > 1 else kwargs["key"]
                value = args[2] if len(args) > 2 else kwargs["value"]
                self.kv[i] = (key.detach(), value.detach())
        return hook

    def packed(self, i: int, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values as packed rows [len(keep), ng, hn]: ``keep`` indexes the
        microbatch's b * s positions row after row (at CP = 1 the rows without their padding; at
        CP > 1 every row of the rank's zigzag shard, padding included, as the drafter's layout)."""
        k, v = self.kv[i]
        flat = lambda x: x.transpose(0, 1).reshape(-1, x.shape[2], x.shape[3])  # noqa: E731
        return flat(k)[keep], flat(v)[keep]

    def clear(self) -> None:
        self.kv.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@torch.no_grad()
def tree_branch_logits(gpt, stem: StemKV, keep: torch.Tensor, layout: BranchLayout, branch_ids: torch.Tensor,
                       branch_pos: torch.Tensor, group=None) -> torch.Tensor:
    """Logits [Nb, V/tp] of the policy ``gpt`` (a Megatron GPTModel, whole: PP = 1) at ``branch_ids``
    (Nb,) - the branch tokens of ``layout`` (context inclusive, intra causal), packed branch after
    branch - given the stem whose keys and values ``stem`` captured in the forward that just ran.

    ``keep`` selects the stem's packed rows from that forward's [b, s] positions (layout.cu_seqlens
    describes them); ``branch_pos`` (Nb,) are the tokens' semantic positions (anchor's in-sequence
    position + j), used for the rotary embedding. ``group``: the CP group (None at CP = 1)."""
    if layout.context != "inclusive" or layout.intra != "causal":
        raise ValueError(f"tree scoring needs the layout context='inclusive', intra='causal'; got "
                         f"context={layout.context!r}, intra={layout.intra!r}")
    cores = _core_attentions(gpt)
    rope = gpt.rotary_pos_emb
    pos = branch_pos.to(torch.int64)
    ids = branch_ids.to(torch.int64)
    # a rank that holds no branch still takes part in every layer's ring (CP > 1); Megatron's layers
    # cannot run zero tokens, so one placeholder token runs through them, attends to nothing (zero
    # rows go to the attention, zeros come back) and is dropped from the logits
    empty = ids.numel() == 0
    if empty:
        ids, pos = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)

    def rotary(*args, **kwargs):  # [Nb, 1, 1, dim]: the embedding of each token's own position
        n = int(pos.max()) + 1 if pos.numel() else 1
        return rope.get_emb(n)[pos]

    def tree(i, module):
        scale = _plain_scale(module)

        def forward(query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            nb, b, nq, hn = query.shape
            if b != 1:
                raise ValueError(f"tree scoring runs one packed row of branch tokens, got batch {b}")
            k, v = stem.packed(i, keep)
            n = 0 if empty else nb
            bq, bk, bv = query[:n, 0], key[:n, 0], value[:n, 0]
            if layout.cp_size == 1:
                _, _, out, _ = local_branch_attention(None, k, v, bq, bk, bv, layout,
                                                      softmax_scale=scale)
            else:
                _, _, out, _ = cp_branch_attention(None, k, v, bq, bk, bv, layout, group,
                                                   softmax_scale=scale)
            if empty:
                out = query.new_zeros(nb, nq, hn)
            return out.reshape(nb, 1, nq * hn)
        return forward

    rope.forward = rotary
    for i, core in enumerate(cores):
        core.forward = tree(i, core)
    device = gpt.embedding.word_embeddings.weight.device
    ids, pos = ids.to(device), pos.to(device)
    try:
        logits = gpt(ids[None], pos[None], None)
    finally:
        del rope.forward
        for core in cores:
            del core.forward
    return logits[0, :0] if empty else logits[0]
