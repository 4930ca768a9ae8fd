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
right = 0 that is the layout's window = left + 1.

Packed sequences (THD, ``packed_seq_params``; also at CP = 1, where Megatron's local attention has
no THD path): query [t, np, hn], t the rank's zigzag share of the packed row; the layout is the
sequences' real lengths (cu_seqlens_q), each padded to a multiple of 2C as cu_seqlens_q_padded
says (:mod:`cotrain.rl.packing`). At CP = 1 (no window) the sequences run batched by length through
torch's attention (:mod:`cotrain.parallel.varlen`) instead of a kernel call per sequence, unless
flash-attn's varlen kernel serves (CUDA), which takes them in one call.

Not supported (clear errors): attention dropout, attention bias, masks other than causal.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from cotrain.parallel.branch_attention import cp_branch_attention, local_branch_attention
from cotrain.parallel.kernels import BlockKernel, FlashVarlenBlockKernel
from cotrain.parallel.layout import BranchLayout, cu_seqlens_from_lengths, spans
from cotrain.parallel.varlen import VarlenPlan, varlen_causal_attention


@functools.lru_cache(maxsize=1)
def _has_flash_varlen() -> bool:
    """Whether flash-attn's varlen kernel serves this process (cotrain.parallel.kernels)."""
    try:
        FlashVarlenBlockKernel()
    except ImportError:
        return False
    return True


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
        if attention_bias is not None:
            raise NotImplementedError("CPBranchCoreAttention: attention_bias is not supported")
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type must be causal, got {attn_mask_type}")
        # attention_mask is ignored: the mask is causal by construction (Megatron passes None or the
        # default causal mask here).
        cp_size, group = self._cp()
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, cp_size, group)
        sq, b, nq, hn = query.shape
        layout = self._layout(b, sq * cp_size, cp_size)

        def packed(x):  # [sq, b, n, hn] -> [b * sq, n, hn]
            return x.transpose(0, 1).reshape(b * sq, x.shape[2], hn)

        out, _, _, _ = cp_branch_attention(
            packed(query), packed(key), packed(value), None, None, None, layout, group,
            softmax_scale=self.softmax_scale, kernel=self.kernel,
        )
        return out.reshape(b, sq, nq * hn).transpose(0, 1).contiguous()

    def _packed(self, query, key, value, params, cp_size: int, group) -> torch.Tensor:
        """THD: query [t, np, hn], key / value [t, ng, hn] (Megatron squeezes the batch of one), t this
        rank's zigzag share of the packed row: sequences ``params.cu_seqlens_q`` (real lengths), each
        at its ``cu_seqlens_q_padded`` slot. Returns [t, np * hn] (Megatron reshapes it to [t, 1, h])."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"CPBranchCoreAttention: packed qkv_format {params.qkv_format!r} (allowed: thd)")
        cu = params.cu_seqlens_q.to("cpu", torch.int64)
        key_ = (tuple(cu.tolist()), cp_size)
        t, nq, hn = query.shape
        if (cp_size == 1 and self.window is None and self.kernel is None
                and (query.device.type != "cuda" or not _has_flash_varlen())):
            # many short sequences: batched by length (cotrain.parallel.varlen), not one kernel call each
            # (flash-attn's varlen kernel, where it serves, takes them all in one call itself)
            plan = self._layouts.get(key_)
            if not isinstance(plan, VarlenPlan):
                plan = VarlenPlan(cu)
                self._layouts = {key_: plan}
            return varlen_causal_attention(query, key, value, plan, self.softmax_scale).reshape(t, nq * hn)
        layout = self._layouts.get(key_)
        if layout is None:
            layout = BranchLayout(cu, [], [], window=self.window, cp_size=cp_size)
            if params.cu_seqlens_q_padded is not None:
                padded = params.cu_seqlens_q_padded.to("cpu", torch.int64)
                if not torch.equal(torch.cat([cu[:1], torch.cumsum(layout.padded_seqlens, 0)]), padded):
                    raise ValueError("CPBranchCoreAttention: cu_seqlens_q_padded must pad each sequence to a multiple "
                                     f"of 2 * context_parallel_size = {2 * cp_size} (the zigzag rule)")
            self._layouts = {key_: layout}  # one packed layout at a time (they change every micro batch)
        if t != layout.local_len:
            raise ValueError(f"CPBranchCoreAttention: {t} packed positions on this rank, the layout holds "
                             f"{layout.local_len}")
        out, _, _, _ = cp_branch_attention(query, key, value, None, None, None, layout, group,
                                           softmax_scale=self.softmax_scale, kernel=self.kernel)
        return out.reshape(t, nq * hn)


# ------------------------------------------------------------------------------- tree scoring
# SpecOPD's target scoring inside the Megatron policy (cotrain.draft.specopd, docs/cotrain.md): the
# log-prob recomputation already ran the policy over the stem (the rollout rows); its keys and
# values are captured at every layer's core_attention (``StemKV``), and the branch tokens then run
# through the policy alone: rotary positions by semantic position (anchor + j), every
# core_attention replaced for that forward by branch attention with no main queries (q=None) over
# the captured stem keys/values on the tree layout (context inclusive, intra causal: branch token j
# sees the stem up to its anchor and its own tokens 1..j). The stem's outputs are the log-prob
# forward's, untouched: stem tokens never see branch tokens by construction.
#
# ``tree_stage_forward`` is one pipeline stage's part of that forward (embedding on the first stage,
# this stage's layers, final norm and output layer on the last). At PP = 1 the whole forward is that
# one stage (``tree_branch_logits``); at PP > 1 ``TreePipeline`` runs it through the stages after
# Megatron's schedule: the last stage (the drafter's) sends a header to the earlier stages, hidden
# states travel stage by stage as in the schedule, and the last stage returns the logits.


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
    """Keys and values every core_attention of ``gpt`` (this pipeline stage's layers) receives
    (post-rotary, [s, b, ng, hn]), captured while ``active``, under the microbatch index
    ``microbatch`` (set before each forward; a forward of the same index overwrites it). At PP = 1
    the drafter's stage scores each microbatch right after its forward and clears it; at PP > 1
    every microbatch of the log-prob forward is kept until the tree forward after the schedule."""

    def __init__(self, gpt):
        self.active = False
        self.microbatch = 0
        self.kv: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        #: packed micro batches (THD captures [t, ng, hn]): the positions each row takes, per microbatch
        self.widths: dict[int, torch.Tensor] = {}
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
                self.kv.setdefault(self.microbatch, {})[i] = (key.detach(), value.detach())
        return hook

    def _layer(self, i: int, microbatch: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
        mb = self.microbatch if microbatch is None else microbatch
        if mb not in self.kv:
            raise RuntimeError(f"tree scoring: no stem keys/values captured for microbatch {mb} "
                               f"(captured: {sorted(self.kv)})")
        return self.kv[mb][i]

    def packed(self, i: int, keep: torch.Tensor, microbatch: Optional[int] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's keys and values as packed rows [len(keep), ng, hn]: ``keep`` indexes the
        microbatch's b * s positions row after row (at CP = 1 the rows without their padding; at
        CP > 1 every row of the rank's zigzag shard, padding included, as the drafter's layout); a
        packed capture [t, ng, hn] is already one row."""
        k, v = self._layer(i, microbatch)
        flat = lambda x: x if x.dim() == 3 else x.transpose(0, 1).reshape(-1, x.shape[2], x.shape[3])  # noqa: E731
        return flat(k)[keep], flat(v)[keep]

    def keep_rows(self, layout: BranchLayout, microbatch: Optional[int] = None) -> torch.Tensor:
        """The captured positions the tree ``layout``'s stem is made of (``keep`` of :meth:`packed`):
        at CP = 1 the first ``layout.seqlens[r]`` positions of every captured row r (the rows without
        their padding); at CP > 1 every position of the rank's shard (whole rows, as captured). Packed
        (THD) captures: rows of ``widths[microbatch]`` positions, end to end (a filler after them)."""
        mb = self.microbatch if microbatch is None else microbatch
        captured = self._layer(0, mb)[0]
        if captured.dim() == 3:
            widths = self.widths.get(mb)
            if widths is None:
                raise RuntimeError(f"tree scoring: a packed stem for microbatch {mb} without its row widths")
            if layout.num_seqs != len(widths):
                raise ValueError(f"tree scoring: the layout has {layout.num_seqs} sequences, the packed stem "
                                 f"{len(widths)}")
            if layout.cp_size > 1:
                return torch.arange(layout.local_len)
            return spans(torch.cumsum(widths, 0) - widths, layout.seqlens)
        s, b = captured.shape[:2]
        if layout.num_seqs != b:
            raise ValueError(f"tree scoring: the layout has {layout.num_seqs} sequences, the captured stem {b} rows")
        if layout.cp_size > 1:
            if layout.local_len != b * s:
                raise ValueError(f"tree scoring: the layout's shard holds {layout.local_len} rows, the captured "
                                 f"stem {b} x {s}")
            return torch.arange(b * s)
        lens = layout.seqlens
        if bool((lens > s).any()):
            raise ValueError(f"tree scoring: a sequence of {int(lens.max())} tokens in captured rows of {s}")
        return spans(torch.arange(b) * s, lens)

    def clear(self, microbatch: Optional[int] = None) -> None:
        """Drop one microbatch's keys/values (all with None)."""
        if microbatch is None:
            self.kv.clear()
            self.widths.clear()
        else:
            self.kv.pop(microbatch, None)
            self.widths.pop(microbatch, None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _require_tree_layout(layout: BranchLayout) -> None:
    """The tree forward's layout rule: context up to and including the anchor, causal inside."""
    if layout.context != "inclusive" or layout.intra != "causal":
        raise ValueError(f"tree scoring needs the layout context='inclusive', intra='causal'; got "
                         f"context={layout.context!r}, intra={layout.intra!r}")


@torch.no_grad()
def tree_stage_forward(gpt, stem: StemKV, layout: BranchLayout, branch_ids: torch.Tensor,
                       branch_pos: torch.Tensor, group=None, *, microbatch: Optional[int] = None,
                       keep: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This pipeline stage's part of the tree forward of the branch tokens ``branch_ids`` (Nb,) of
    ``layout`` (context inclusive, intra causal; packed branch after branch) over the stem whose
    keys/values ``stem`` captured for ``microbatch`` (default: ``stem.microbatch``).

    ``gpt`` is this stage's Megatron GPTModel: on the first stage (pre_process) it embeds the
    tokens, otherwise it takes ``hidden`` [max(Nb, 1), 1, h] from the previous stage; it runs its
    layers with every core_attention replaced by branch attention (q=None) on its own captured stem
    keys/values and rotary at ``branch_pos`` (Nb,), the tokens' semantic positions (anchor's
    in-sequence position + j). Returns the logits [Nb, V/tp] on the last stage (post_process),
    otherwise the hidden states [max(Nb, 1), 1, h] for the next stage. ``keep``: the stem's packed
    rows among the captured positions (default :meth:`StemKV.keep_rows`). ``group``: the CP group
    (None at CP = 1).

    A rank that holds no branch (Nb = 0, CP > 1) still takes part in every layer's ring: Megatron's
    layers cannot run zero tokens, so one placeholder token runs through them, attends to nothing
    (zero rows go to the attention, zeros come back) and is dropped from the logits."""
    _require_tree_layout(layout)
    if not gpt.pre_process and hidden is None:
        raise ValueError("tree scoring: a stage after the first needs the previous stage's hidden states")
    cores = _core_attentions(gpt)
    mb = stem.microbatch if microbatch is None else microbatch
    if keep is None and cores:
        keep = stem.keep_rows(layout, mb)
    rope = gpt.rotary_pos_emb
    pos = branch_pos.to(torch.int64)
    ids = branch_ids.to(torch.int64)
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
            k, v = stem.packed(i, keep, mb)
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
    device = next(gpt.parameters()).device
    ids, pos = ids.to(device), pos.to(device)
    if not gpt.pre_process:
        gpt.set_input_tensor(hidden.to(device))
    try:
        out = gpt(ids[None], pos[None], None)
    finally:
        del rope.forward
        for core in cores:
            del core.forward
        if not gpt.pre_process:
            gpt.set_input_tensor(None)
    if not gpt.post_process:
        return out  # [max(Nb, 1), 1, h]: to the next stage
    return out[0, :0] if empty else out[0]


def tree_branch_logits(gpt, stem: StemKV, keep: Optional[torch.Tensor], layout: BranchLayout,
                       branch_ids: torch.Tensor, branch_pos: torch.Tensor, group=None,
                       microbatch: Optional[int] = None) -> torch.Tensor:
    """Logits [Nb, V/tp] of the policy ``gpt`` (a whole Megatron GPTModel: PP = 1, the one-stage
    case of :func:`tree_stage_forward`) at the branch tokens ``branch_ids`` of ``layout``, given the
    stem whose keys and values ``stem`` captured in the forward that ran (``keep``: its packed rows,
    None = :meth:`StemKV.keep_rows`). PP > 1: :class:`TreePipeline`."""
    if not (gpt.pre_process and gpt.post_process):
        raise ValueError("tree_branch_logits runs a whole model (PP = 1); through a pipeline use TreePipeline")
    return tree_stage_forward(gpt, stem, layout, branch_ids, branch_pos, group, microbatch=microbatch, keep=keep)


class TreePipeline:
    """The tree forward through the pipeline stages, outside Megatron's schedule (PP >= 1).

    Every stage's :class:`StemKV` holds the stem keys/values of every microbatch of the log-prob
    forward. After the schedule the last stage (the drafter's) calls :meth:`logits` once per
    microbatch it scores and :meth:`finish` at the end; every earlier stage calls :meth:`serve`,
    which runs its part until :meth:`finish`'s sentinel. Per call the last stage broadcasts over
    the pipeline group a header (microbatch, token count, the layout's cu_seqlens / anchors /
    branch lengths / cp_size, the tokens and their semantic positions); the first stage embeds and
    runs its layers, each stage sends its hidden states [max(Nb, 1), 1, h] to the next (point to
    point in the pipeline group, as Megatron's schedule does), and the last stage returns the
    logits [Nb, V/tp]. Each TP / CP rank of a stage takes part through its own pipeline group, as
    at PP = 1 (CP: its own branches, the ring inside each stage's attention; TP: the replicas'
    identical headers). At PP = 1 :meth:`logits` is :func:`tree_stage_forward` on the whole model
    and :meth:`finish` / :meth:`serve` do nothing."""

    _FIXED = 7  # kind, microbatch, tokens, branches, cu entries, cp_size, window (-1: none)
    _DONE, _FORWARD = 0, 1

    def __init__(self, gpt, stem: StemKV, cp_group=None):
        self.gpt, self.stem, self.cp_group = gpt, stem, cp_group
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.is_first = parallel_state.is_pipeline_first_stage()
        self.is_last = parallel_state.is_pipeline_last_stage()
        self.device = next(gpt.parameters()).device
        cfg = gpt.config
        self.dtype = cfg.pipeline_dtype or cfg.params_dtype
        self.hidden_size = cfg.hidden_size
        #: True between a header sent and the last stage's hidden states received (a failure then
        #: leaves the earlier stages mid-exchange: no sentinel is sent after it)
        self.in_flight = False
        if self.pp > 1:
            self.group = parallel_state.get_pipeline_model_parallel_group()
            self.src = parallel_state.get_pipeline_model_parallel_last_rank()
            self.prev = None if self.is_first else parallel_state.get_pipeline_model_parallel_prev_rank()
            self.next = None if self.is_last else parallel_state.get_pipeline_model_parallel_next_rank()

    def _forward(self, microbatch: int, layout: BranchLayout, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        hidden = None
        if not self.is_first:
            hidden = torch.empty(max(ids.numel(), 1), 1, self.hidden_size, dtype=self.dtype, device=self.device)
            dist.recv(hidden, src=self.prev, group=self.group)
        if self.is_last:
            self.in_flight = False
        group = self.cp_group if layout.cp_size > 1 else None
        out = tree_stage_forward(self.gpt, self.stem, layout, ids, pos, group, microbatch=microbatch, hidden=hidden)
        if not self.is_last:
            dist.send(out.to(self.dtype).contiguous(), dst=self.next, group=self.group)
        return out

    def logits(self, microbatch: int, layout: BranchLayout, branch_ids: torch.Tensor,
               branch_pos: torch.Tensor) -> torch.Tensor:
        """Last stage: the policy's logits [Nb, V/tp] at the branch tokens of ``layout`` over the stem
        of ``microbatch`` (the whole pipeline takes part)."""
        if not self.is_last:
            raise RuntimeError("TreePipeline.logits runs on the last pipeline stage (the others serve)")
        ids, pos = branch_ids.to(torch.int64).cpu(), branch_pos.to(torch.int64).cpu()
        if self.pp == 1:
            return self._forward(microbatch, layout, ids, pos)
        _require_tree_layout(layout)  # before the earlier stages see it
        fixed = torch.tensor([self._FORWARD, microbatch, ids.numel(), layout.num_branches, layout.cu_seqlens.numel(),
                              layout.cp_size, -1 if layout.window is None else layout.window], dtype=torch.int64)
        payload = torch.cat([ids, pos, layout.cu_seqlens, layout.anchors, layout.branch_lens])
        self.in_flight = True
        dist.broadcast(fixed.to(self.device), src=self.src, group=self.group)
        dist.broadcast(payload.to(self.device), src=self.src, group=self.group)
        return self._forward(microbatch, layout, ids, pos)

    def finish(self) -> None:
        """Last stage: the sentinel that ends the earlier stages' :meth:`serve`."""
        if self.pp > 1 and self.is_last:
            fixed = torch.zeros(self._FIXED, dtype=torch.int64)
            dist.broadcast(fixed.to(self.device), src=self.src, group=self.group)

    def serve(self) -> int:
        """A stage before the last: run this stage's part of every tree forward the last stage asks
        for, until its sentinel. Returns the number of forwards served."""
        if self.is_last:
            raise RuntimeError("TreePipeline.serve runs on the stages before the last")
        served = 0
        while True:
            fixed = torch.empty(self._FIXED, dtype=torch.int64, device=self.device)
            dist.broadcast(fixed, src=self.src, group=self.group)
            kind, mb, n, nb, ncu, cp_size, window = fixed.tolist()
            if kind == self._DONE:
                return served
            payload = torch.empty(2 * n + ncu + 2 * nb, dtype=torch.int64, device=self.device)
            dist.broadcast(payload, src=self.src, group=self.group)
            ids, pos, cu, anchors, lens = payload.cpu().split([n, n, ncu, nb, nb])
            layout = BranchLayout(cu, anchors, lens, context="inclusive", intra="causal",
                                  window=None if window < 0 else window, cp_size=cp_size)
            self._forward(mb, layout, ids, pos)
            served += 1
