"""DSpark: the DFlash backbone plus a low-rank Markov head (and an optional confidence head).

vLLM (``Qwen3DSparkForCausalLM``, GPU V2 model runner only) runs it "anchor-as-first": the block
is the bonus token at position a followed by B-1 noise tokens (``dspark_noise_token_id``); *every*
block position i predicts the next token (a+i+1). Drafts are then sampled left to right with

    logits_i = lm_head(h_i) + W2 W1[prev_i]          (vanilla; prev_0 = the anchor token,
                                                      prev_i = draft i-1)

``markov_w1`` (V, r) embeds the previous token, ``markov_w2`` (V, r) maps it to a logit bias.
The ``gated`` variant trains ``logits_i = lm_head(h_i) + sigmoid(g . h_i) * W2 W1[prev_i]``; vLLM
0.32 serves only the vanilla head, so a gated drafter cannot be exported. The confidence head
(``proj``: H -> 1, with bias) predicts the probability that draft i is accepted; it is trained
with BCE against 1 - 0.5 * L1(p_i, q_i) (the overlap of target and drafter distributions).

Training uses teacher forcing: prev_i is the data token x_{a+i} (under greedy decoding with target
data, exactly the draft whenever it matters, i.e. when the earlier drafts were accepted).

Chains: one per block, bonus position a, B drafts.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from cotrain.config.schema import DSparkConfig
from cotrain.draft.common import DraftBatch, DraftOutput, exp_decay_weights
from cotrain.draft.dflash import BlockDrafter
from cotrain.draft.registry import register_drafter
from cotrain.draft.taps import TargetSpec
from cotrain.parallel import BranchLayout


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int, hidden: int, gated: bool, generator=None):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        with torch.no_grad():
            self.markov_w1.weight.normal_(0.0, 1.0, generator=generator)
            self.markov_w2.weight.zero_()  # starts as a no-op on the logits
        self.gate = nn.Linear(hidden, 1, bias=True) if gated else None

    def bias(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        b = self.markov_w2(self.markov_w1(prev.to(self.markov_w1.weight.device)))  # host ids welcome
        if self.gate is not None:
            b = torch.sigmoid(self.gate(hidden)) * b
        return b


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.proj = nn.Linear(hidden, 1, bias=True)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.float()).squeeze(-1)


class DSparkDrafter(BlockDrafter):
    vllm_architecture = "Qwen3DSparkModel"
    predicts_next = True

    def __init__(self, cfg: DSparkConfig, target: TargetSpec, generator: Optional[torch.Generator] = None):
        super().__init__(cfg, target, generator=generator)
        a = target.arch
        self.markov_head = MarkovHead(a.vocab_size, int(cfg.markov_rank), a.hidden_size,
                                      gated=cfg.markov_head == "gated", generator=generator)
        self.confidence_head = ConfidenceHead(a.hidden_size) if cfg.confidence_head else None

    @property
    def draft_width(self) -> int:
        return self.block_size

    def forward(self, batch: DraftBatch, layout: Optional[BranchLayout] = None, group=None) -> DraftOutput:
        if layout is None:
            layout = self.build_layout(batch)
        hidden, anchors, _ = self.backbone(batch, layout, group)
        B = self.block_size
        T = batch.num_tokens
        # previous token of block position i: x_{a+i} (teacher forcing), pad past the sequence end
        src = anchors[:, None] + torch.arange(B)[None, :]
        end = batch.seq_end()[anchors][:, None]
        prev = torch.where(src < end, batch.input_ids[src.clamp(max=T - 1)], torch.full_like(src, self.pad_token_id))
        logits = self.base_logits(hidden) + self.markov_head.bias(prev, hidden)
        conf = self.confidence_head(hidden) if self.confidence_head is not None else None
        target_rows, valid = self.chains(anchors, batch)
        return DraftOutput(logits=logits, bonus_pos=anchors, target_rows=target_rows, valid=valid, confidence=conf,
                           loss_weight=exp_decay_weights(B, self.cfg.loss_gamma))

    # ----- vLLM ---------------------------------------------------------------------------------
    def _vllm_name_map(self) -> dict[str, str]:
        m = super()._vllm_name_map()
        m["markov_head.markov_w1.weight"] = "markov_head.markov_w1.weight"
        m["markov_head.markov_w2.weight"] = "markov_head.markov_w2.weight"
        if self.markov_head.gate is not None:
            m["markov_head.gate.weight"] = "markov_head.gate.weight"
            m["markov_head.gate.bias"] = "markov_head.gate.bias"
        if self.confidence_head is not None:
            m["confidence_head.proj.weight"] = "confidence_head.proj.weight"
            m["confidence_head.proj.bias"] = "confidence_head.proj.bias"
        return m

    def vllm_config(self) -> dict:
        if self.markov_head.gate is not None:
            raise NotImplementedError(
                "draft.dspark.markov_head: 'gated' cannot be exported: vLLM 0.32's Qwen3 DSpark serves only the "
                "vanilla Markov head (logits += W2 W1[prev]); train with markov_head: vanilla to serve it")
        cfg = super().vllm_config()
        cfg.pop("block_size")
        cfg.update({
            "architectures": [self.vllm_architecture],
            "dspark_block_size": self.block_size,
            "dspark_noise_token_id": self.block_token_id,
            "markov_rank": int(self.cfg.markov_rank),
            "markov_head_type": "vanilla",
            "enable_confidence_head": self.confidence_head is not None,
            "confidence_head_with_markov": False,
            "sample_from_anchor": True,
            "dspark_bonus_anchor": False,
            "draft_vocab_size": self.target_arch.vocab_size,
            "cotrain": {"kind": self.kind, "tap_layers": self.tap_layers, "block_size": self.block_size},
        })
        return cfg


register_drafter("dspark", DSparkDrafter)
