"""DFlash block drafter; served by vLLM as method ``dflash`` (``DFlashQwen3ForCausalLM``).

Model (as vLLM runs it): the target's tapped states -> ``fc`` -> ``hidden_norm`` -> each layer's
K/V projection (+ ``k_norm`` and RoPE at the context positions): the *context* keys/values. No
decoder layer runs on the context. The *block* is the bonus (anchor) token followed by B-1 mask
tokens at positions a .. a+B-1, embedded with the target's embeddings; it runs through the
Qwen3-style decoder layers (q/k norms, RoPE), its queries attending to the context strictly before
the anchor and bidirectionally to the whole block (``dflash_layout``: context="exclusive",
intra="full"); ``norm`` then the target's LM head. Block position j >= 1 predicts the token *at*
a+j (the mask sits at the predicted position).

Training samples ``anchors_per_seq`` anchors per sequence among the response positions and weighs
draft j (block position j+1) by exp(-j/gamma) (``loss_gamma``; uniform when null).

Chains: one per block, bonus position a, B-1 drafts.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn as nn

from cotrain.config.schema import DFlashConfig
from cotrain.draft.common import (
    QKV,
    DraftBatch,
    DraftOutput,
    RMSNorm,
    SwiGLU,
    BranchAttention,
    chain_rows,
    exp_decay_weights,
    group_rank,
    init_linear_,
    local_rows,
    rope_cos_sin,
)
from cotrain.draft.registry import Drafter, register_drafter
from cotrain.draft.taps import TargetSpec
from cotrain.parallel import BranchLayout, balanced_anchors, dflash_layout, draw_anchors


class BlockLayer(nn.Module):
    """A Qwen3 decoder layer (vLLM's DFlashQwen3DecoderLayer)."""

    def __init__(self, a):
        super().__init__()
        H = a.hidden_size
        self.self_attn = QKV(H, H, a.num_heads, a.num_kv_heads, a.head_dim, qk_norm=True, eps=a.rms_norm_eps,
                             rope_theta=a.rope_theta)
        self.mlp = SwiGLU(H, a.intermediate_size)
        self.input_layernorm = RMSNorm(H, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, a.rms_norm_eps)


class BlockDrafter(Drafter):
    """The DFlash backbone shared by DFlash and DSpark."""

    #: True: block position i predicts the token at a+i+1 (DSpark); False: at a+i (DFlash masks)
    predicts_next: bool = False

    def __init__(self, cfg: DFlashConfig, target: TargetSpec, generator: Optional[torch.Generator] = None):
        super().__init__(cfg, target)
        a = target.arch
        H = a.hidden_size
        self.fc = nn.Linear(self.num_taps * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, a.rms_norm_eps)
        self.layers = nn.ModuleList([BlockLayer(a) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(H, a.rms_norm_eps)
        init_linear_(self, generator=generator)
        with torch.no_grad():
            self.norm.weight.copy_(target.final_norm)

    @property
    def block_size(self) -> int:
        return int(self.cfg.block_size)

    @property
    def block_token_id(self) -> int:
        """Id of the filler tokens after the anchor (mask / noise)."""
        return self.mask_token_id

    # ----- layout -------------------------------------------------------------------------------
    def anchor_candidates(self, batch: DraftBatch) -> torch.Tensor:
        """Packed positions that can be a bonus (anchor) token: a supervised response token (the
        policy's: an environment reply of a multi-turn response is never a bonus token) with a next
        token that is supervised."""
        T = batch.num_tokens
        p = torch.arange(T)
        ok = batch.positions >= batch.response_start[batch.seq_of]
        ok &= p + 1 < batch.seq_end()
        ok &= batch.loss_mask[(p + 1).clamp(max=T - 1)]
        # a later response position that is not supervised is an environment token (single-turn
        # responses are supervised to their end, so this changes nothing for them)
        ok &= batch.loss_mask | (batch.positions == batch.response_start[batch.seq_of])
        return p[ok]

    def sample_anchors(self, batch: DraftBatch, per_seq: Optional[int],
                       generator: Union[None, torch.Generator, Sequence[torch.Generator]] = None) -> torch.Tensor:
        """Up to ``per_seq`` distinct candidates per sequence (all of them when per_seq is None), sorted
        (:func:`cotrain.parallel.layout.draw_anchors`: one stream, or one generator per sequence)."""
        cand = self.anchor_candidates(batch)
        if per_seq is None:
            return cand
        return draw_anchors(cand, batch.seq_of[cand], batch.num_seqs, per_seq, generator)

    def build_layout(self, batch: DraftBatch, generator: Optional[torch.Generator] = None, cp_size: int = 1,
                     anchors: Optional[torch.Tensor] = None, all_anchors: bool = False) -> BranchLayout:
        if anchors is None and not all_anchors and self.cfg.anchor_sampling == "balanced":
            anchors = balanced_anchors(batch.cu_seqlens, self.anchor_candidates(batch), int(self.cfg.anchors_per_seq),
                                       cp_size, generator, block_size=self.block_size)
        if anchors is None:
            anchors = self.sample_anchors(batch, None if all_anchors else int(self.cfg.anchors_per_seq), generator)
        return dflash_layout(batch.cu_seqlens, anchors, self.block_size, cp_size=cp_size)

    def chains(self, anchors: torch.Tensor, batch: DraftBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(target_rows, valid) of the chains at ``anchors``: draft j of the block at anchor a is
        supervised by target row a + j (``draft_width`` drafts)."""
        return chain_rows(anchors, self.draft_width, batch)

    def target_rows_read(self, batch: DraftBatch, layout: BranchLayout) -> Optional[torch.Tensor]:
        rows, valid = self.chains(layout.anchors, batch)
        return torch.unique(rows[valid])  # sorted

    # ----- forward ------------------------------------------------------------------------------
    def backbone(self, batch: DraftBatch, layout: BranchLayout, group=None):
        """Block hidden states (NB, B, H) after the final norm, plus the local anchors and block ids."""
        a = self.target_arch
        D = a.head_dim
        B = self.block_size
        T = batch.num_tokens
        C = layout.cp_size
        rank = group_rank(group) if C > 1 else 0
        if layout.intra != "full" or layout.context != "exclusive":
            raise ValueError("block drafters need a dflash_layout (context='exclusive', intra='full')")
        rows = local_rows(layout, rank)
        r = rows.clamp(min=0)
        taps = batch.taps.to(self.fc.weight.dtype)
        if taps.shape[0] != rows.numel():
            raise ValueError(f"taps has {taps.shape[0]} rows, expected {rows.numel()} (this rank's trunk rows)")
        dev = taps.device
        cos_c, sin_c = rope_cos_sin(batch.positions[r].to(dev), D, a.rope_theta)
        ctx = self.hidden_norm(self.fc(taps))

        br = layout.local_branches(rank)
        if bool((layout.branch_lens[br] != B).any()):
            raise ValueError(f"every block must have block_size = {B} tokens")
        anchors = layout.anchors[br]
        NB = anchors.numel()
        ids = torch.full((NB, B), self.block_token_id, dtype=torch.int64)
        ids[:, 0] = batch.input_ids[anchors]
        bpos = batch.positions[anchors][:, None] + torch.arange(B)[None, :]
        cos_b, sin_b = rope_cos_sin(bpos.reshape(-1).to(dev), D, a.rope_theta)
        resid = self.embed(ids.reshape(-1)).to(taps.dtype)
        # No decoder layer runs on the context: its rows give keys/values only, so branch attention
        # runs without main queries (q=None): only the blocks' tiles are computed.
        attn = BranchAttention(layout, group)
        for layer in self.layers:
            kc, vc = layer.self_attn.kv(ctx, cos_c, sin_c)
            x = layer.input_layernorm(resid)
            q = layer.self_attn.q(x, cos_b, sin_b)
            kb, vb = layer.self_attn.kv(x, cos_b, sin_b)
            _, bout = attn(None, kc, vc, q, kb, vb)
            resid = resid + layer.self_attn.out(bout)
            resid = resid + layer.mlp(layer.post_attention_layernorm(resid))
        hidden = self.norm(resid).view(NB, B, resid.shape[-1])
        return hidden, anchors, ids

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.target_lm_head.t().to(hidden.dtype)

    def forward(self, batch: DraftBatch, layout: Optional[BranchLayout] = None, group=None) -> DraftOutput:
        if layout is None:
            layout = self.build_layout(batch)
        hidden, anchors, _ = self.backbone(batch, layout, group)
        logits = self.base_logits(hidden)[:, 1:]  # block position j+1 -> draft j
        target_rows, valid = self.chains(anchors, batch)
        return DraftOutput(logits=logits, bonus_pos=anchors, target_rows=target_rows, valid=valid,
                           loss_weight=exp_decay_weights(self.draft_width, self.cfg.loss_gamma))

    @property
    def draft_width(self) -> int:
        return self.block_size - 1

    # ----- vLLM ---------------------------------------------------------------------------------
    def _vllm_name_map(self) -> dict[str, str]:
        m = {"fc.weight": "fc.weight", "hidden_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight"}
        for i, layer in enumerate(self.layers):
            for name, _ in layer.named_parameters():
                m[f"layers.{i}.{name}"] = f"layers.{i}.{name}"
        return m

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        own = dict(self.named_parameters())
        return {v: own[p].detach().clone() for v, p in self._vllm_name_map().items()}

    def _dflash_config(self) -> dict:
        return {
            "target_layer_ids": self.tap_layers,  # "output of layer i"; vLLM adds 1
            "mask_token_id": self.block_token_id,
            "causal": False,
            "use_swa": False,
            "use_aux_hidden_state": True,
        }

    def vllm_config(self) -> dict:
        cfg = self._base_qwen_like_config()
        cfg.update({
            "architectures": [self.vllm_architecture],
            "model_type": "qwen3",
            "num_hidden_layers": len(self.layers),
            "layer_types": ["full_attention"] * len(self.layers),
            "block_size": self.block_size,
            "dflash_config": self._dflash_config(),
            "cotrain": {"kind": self.kind, "tap_layers": self.tap_layers, "block_size": self.block_size},
        })
        return cfg


class DFlashDrafter(BlockDrafter):
    vllm_architecture = "DFlashDraftModel"


register_drafter("dflash", DFlashDrafter)
