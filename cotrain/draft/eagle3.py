"""EAGLE-3 drafter trained with train-time test (TTT); served by vLLM as method ``eagle3``.

Model (vLLM's ``Eagle3LlamaForCausalLM``): the target's tapped states -> ``fc`` -> h; the first
decoder layer's attention input is ``input_layernorm(embed(token)) ++ hidden_norm(h)`` (2H wide),
its residual stream starts at h; more layers take the residual stream only; the pre-norm output
("prenorm") is fed back as the next step's h; logits = ``lm_head(norm(prenorm))`` (own LM head,
initialised from the target's; embeddings are the target's).

Train-time test with k passes. Pass 0 runs on the whole sequence: at position p it reads token
x_{p+1} and the taps of p and predicts x_{p+2}. Pass t >= 1 at anchor p reads token x_{p+1+t} and
the prenorm output of pass t-1 at p, sits at RoPE position p+t and predicts x_{p+2+t}; it attends
to pass 0's keys at positions <= p and to passes 1..t at p - the layout
``eagle3_ttt_layout`` (context="inclusive", intra="causal"), exactly what vLLM's drafter sees when
it drafts k tokens after bonus token x_{p+1}. The passes run one after another (pass t needs pass
t-1's output); pass 0 attends over the trunk alone. Pass t has one live query per anchor (its own
slot; the later slots do not exist yet), so it queries only that: with K_p the trunk keys up to p
and k_1..k_t the anchor's pass keys,

    (o_a, l_a) = branch attention of q_t over K_p and k_t    (q=None: the trunk gives keys/values only;
                                                               a layout of one token per anchor, built once)
    (o_b, l_b) = attention of q_t over k_1..k_{t-1}           (t - 1 keys per anchor, plain torch)
    o = (e^{l_a} o_a + e^{l_b} o_b) / (e^{l_a} + e^{l_b})     (exact LSE merge; o = o_a for t = 1)

which is attention over K_p and k_1..k_t: no zero query for the other k-2 slots, no trunk tile for
them (under CP the ring exchange is the same).

Chains: the chain at anchor p has bonus position p+1 and k drafts (pass t = draft t+1).

On-policy passes (SpecOPD, :mod:`cotrain.draft.specopd`): ``forward(..., next_tokens=f)`` calls
``f(t, logits of pass t-1)`` before each pass t >= 1 and embeds the (target) token ids it returns
instead of the reference x_{p+1+t}: the drafter's own draws, as when it drafts in serving. Nothing
else changes (same layout, attention and state), and without ``next_tokens`` the forward is the
teacher-forced one, operation for operation.

Reduced draft vocabulary (``draft_vocab_size`` N below the target's V): the LM head has N rows,
one per token of ``self.vocab`` (:class:`~cotrain.draft.vocab.DraftVocab`), initialised from the
target's head rows of those tokens; the chains' logits are over the N draft ids, the losses and the
acceptance estimator map them (:mod:`cotrain.draft.vocab`), and the export carries vLLM's ``d2t``.
Built without data the mapping is a placeholder (the first N ids) until :meth:`set_vocab` installs
one built from token counts (distillation, co-training) or a checkpoint's ``d2t`` is loaded.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from cotrain.config.schema import DraftKindConfig, Eagle3Config
from cotrain.draft.common import (
    QKV,
    DraftBatch,
    DraftOutput,
    RMSNorm,
    SwiGLU,
    BranchAttention,
    chain_rows,
    group_rank,
    init_linear_,
    local_rows,
    rope_cos_sin,
)
from cotrain.draft.registry import Drafter, register_drafter
from cotrain.draft.taps import TargetSpec
from cotrain.draft.vocab import DraftVocab
from cotrain.parallel import BranchLayout, anchor_owner, eagle3_ttt_layout


class Eagle3Layer(nn.Module):
    def __init__(self, a, first: bool):
        super().__init__()
        H = a.hidden_size
        self.first = first
        self.self_attn = QKV(2 * H if first else H, H, a.num_heads, a.num_kv_heads, a.head_dim, qk_norm=False,
                             eps=a.rms_norm_eps, rope_theta=a.rope_theta)
        self.mlp = SwiGLU(H, a.intermediate_size)
        self.input_layernorm = RMSNorm(H, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, a.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, a.rms_norm_eps)  # vLLM builds it in every layer; layer 0 uses it

    def attn_input(self, emb: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
        if self.first:
            return torch.cat([self.input_layernorm(emb), self.hidden_norm(resid)], dim=-1)
        return self.input_layernorm(resid)

    def finish(self, resid: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        resid = resid + self.self_attn.out(attn_out)
        return resid + self.mlp(self.post_attention_layernorm(resid))


class Eagle3Drafter(Drafter):
    vllm_architecture = "LlamaForCausalLMEagle3"

    def __init__(self, cfg: Eagle3Config, target: TargetSpec, generator: Optional[torch.Generator] = None):
        super().__init__(cfg, target)
        a = target.arch
        H = a.hidden_size
        self.fc = nn.Linear(self.num_taps * H, H, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(a, first=(i == 0)) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(H, a.rms_norm_eps)
        V = a.vocab_size
        #: the reduced draft vocabulary (None: the drafter's head covers the target's whole vocabulary)
        self.vocab: Optional[DraftVocab] = DraftVocab.first(cfg.draft_vocab_size, V) if cfg.reduced_vocab(V) else None
        self.lm_head = nn.Linear(H, self.vocab.size if self.vocab is not None else V, bias=False)
        init_linear_(self, generator=generator)
        with torch.no_grad():
            # the target's head plus a little noise: vLLM aliases a drafter head that is *identical* to
            # the target's, after which run-time pushes of lm_head are refused (they would overwrite
            # the target's); the noise keeps the two apart from the start
            noise = torch.randn(target.lm_head.shape, generator=generator) * 1e-4
            rows = target.lm_head + noise
            self.lm_head.weight.copy_(rows if self.vocab is None else rows[self.vocab.target_ids])
            self.norm.weight.copy_(target.final_norm)

    def extra_checks(self, cfg: DraftKindConfig, target: TargetSpec) -> list[tuple[str, str]]:
        return cfg.check_vocab(target.arch.vocab_size)

    # ----- draft vocabulary ---------------------------------------------------------------------
    @torch.no_grad()
    def set_vocab(self, vocab: DraftVocab, remap: bool = True) -> torch.Tensor:
        """Install the draft vocabulary ``vocab`` (same size). With ``remap`` the LM head follows it:
        a token in both keeps its row, a new token gets the target's current head row
        (``target_lm_head``, the policy's under co-training). Returns, for each new draft id, its old
        draft id (-1 = new token), for the optimizer state (:func:`cotrain.draft.optim.remap_optimizer_rows`)."""
        if self.vocab is None:
            raise ValueError("this EAGLE-3 drafter has no reduced vocabulary (draft_vocab_size is null or the "
                             "target's vocab_size)")
        if vocab.size != self.vocab.size or vocab.vocab_size != self.vocab.vocab_size:
            raise ValueError(f"draft vocabulary of {vocab.size} tokens over {vocab.vocab_size} does not fit the "
                             f"drafter's {self.vocab.size} over {self.vocab.vocab_size}")
        old = self.vocab
        src = old.to_draft(vocab.target_ids)
        if remap:
            w = self.lm_head.weight
            w.copy_(vocab.remap_rows(old, w.detach().clone(), self.target_lm_head.to(w.device)))
        self.vocab = vocab
        return src

    @property
    def num_passes(self) -> int:
        return int(self.cfg.ttt_steps)

    @property
    def draft_width(self) -> int:
        return self.num_passes

    # ----- layout -------------------------------------------------------------------------------
    def chain_anchors(self, batch: DraftBatch) -> torch.Tensor:
        """Packed positions p whose first draft (token p+2) is supervised; bonus token = x_{p+1}."""
        T = batch.num_tokens
        p = torch.arange(T)
        ok = p + 2 < batch.seq_end()
        ok &= batch.loss_mask[(p + 2).clamp(max=T - 1)]
        return p[ok]

    def build_layout(self, batch: DraftBatch, generator: Optional[torch.Generator] = None,
                     cp_size: int = 1) -> BranchLayout:
        return eagle3_ttt_layout(batch.cu_seqlens, self.num_passes, positions=self.chain_anchors(batch),
                                 cp_size=cp_size)

    def chains(self, anchors: torch.Tensor, batch: DraftBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(target_rows, valid) of the chains at chain anchors p: bonus x_{p+1}, draft j supervised by
        target row p + 1 + j (``num_passes`` drafts)."""
        return chain_rows(anchors + 1, self.num_passes, batch)

    def target_rows_read(self, batch: DraftBatch, layout: BranchLayout) -> Optional[torch.Tensor]:
        """Every chain anchor's rows: the response positions (from the one before the first supervised
        token), none of the prompt's."""
        rows, valid = self.chains(self.chain_anchors(batch), batch)
        return torch.unique(rows[valid])

    # ----- forward ------------------------------------------------------------------------------
    def forward(self, batch: DraftBatch, layout: Optional[BranchLayout] = None, group=None,
                next_tokens: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None) -> DraftOutput:
        """The chains at this rank's anchors (teacher-forced: pass t reads the reference token
        x_{p+1+t}). ``next_tokens`` (on-policy passes, :mod:`cotrain.draft.specopd`): called before
        pass t >= 1 as ``next_tokens(t, logits)`` with pass t-1's logits (NB, draft vocabulary; with
        their graph), it returns the (NB,) *target* token ids pass t reads instead of the reference
        tokens (e.g. draws from those logits, mapped to target ids). ``target_rows`` / ``valid`` stay
        the reference's."""
        if layout is None:
            layout = self.build_layout(batch)
        k = self.num_passes
        C = layout.cp_size
        rank = group_rank(group) if C > 1 else 0
        a = self.target_arch
        D = a.head_dim
        T = batch.num_tokens
        ids = batch.input_ids
        rows = local_rows(layout, rank)
        real = rows >= 0
        r = rows.clamp(min=0)
        end = batch.seq_end()
        pos = batch.positions
        nxt = r + 1
        tok0 = torch.where(real & (nxt < end[r]), ids[nxt.clamp(max=T - 1)], torch.full_like(r, self.pad_token_id))
        taps = batch.taps.to(self.fc.weight.dtype)
        if taps.shape[0] != rows.numel():
            raise ValueError(f"taps has {taps.shape[0]} rows, expected {rows.numel()} (this rank's trunk rows)")

        # chain anchors this rank owns, and their local trunk rows
        anchors = self.chain_anchors(batch)
        if C > 1:
            anchors = anchors[anchor_owner(batch.cu_seqlens, anchors, C) == rank]
        inv = torch.full((T,), -1, dtype=torch.int64)
        inv[rows[real]] = torch.nonzero(real).squeeze(1)
        arow = inv[anchors]
        NB = anchors.numel()
        nbt = NB * (k - 1)
        if k > 1 and layout.local_branch_tokens(rank) != nbt:
            raise ValueError("layout does not match this batch's chain anchors (build it with build_layout)")

        dev = taps.device
        cos0, sin0 = rope_cos_sin(pos[r].to(dev), D, a.rope_theta)
        emb0 = self.embed(tok0)

        # pass 0 has main queries and no branch query yet: it attends over the trunk alone (the
        # layout without its branches; main tokens never see branch tokens, so nothing changes but the
        # work); passes 1..k-1 query their live slot only (module doc; q=None below)
        attn0 = BranchAttention(layout.subset([]), group)
        live = eagle3_ttt_layout(batch.cu_seqlens, 2, positions=layout.anchors, cp_size=C) if k > 1 else None
        # pass 0 (the trunk)
        resid = self.fc(taps)
        trunk_kv = []
        for layer in self.layers:
            x = layer.attn_input(emb0, resid)
            q = layer.self_attn.q(x, cos0, sin0)
            kk, vv = layer.self_attn.kv(x, cos0, sin0)
            trunk_kv.append((kk, vv))
            out, _ = attn0(q, kk, vv, None, None, None)
            resid = layer.finish(resid, out)
        prenorm = resid[arow]
        logits = [self._logits(prenorm)]

        # passes 1..k-1 (the branches)
        branch_kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]
        apos = pos[anchors]
        aend = end[anchors]
        for t in range(1, k):
            if next_tokens is None:
                src = anchors + 1 + t
                tok = torch.where(src < aend, ids[src.clamp(max=T - 1)], torch.full_like(src, self.pad_token_id))
            else:
                tok = next_tokens(t, logits[-1]).to(torch.int64)
            emb = self.embed(tok)
            cos, sin = rope_cos_sin((apos + t).to(dev), D, a.rope_theta)
            resid = prenorm
            for li, layer in enumerate(self.layers):
                x = layer.attn_input(emb, resid)
                q = layer.self_attn.q(x, cos, sin)
                branch_kv[li].append(layer.self_attn.kv(x, cos, sin))
                o = self._pass_attention(live, group, t, trunk_kv[li], q, branch_kv[li])
                resid = layer.finish(resid, o)
            prenorm = resid
            logits.append(self._logits(prenorm))

        bonus = anchors + 1
        target_rows, valid = self.chains(anchors, batch)
        return DraftOutput(logits=torch.stack(logits, dim=1), bonus_pos=bonus, target_rows=target_rows, valid=valid)

    def _logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(prenorm))

    def _pass_attention(self, live: BranchLayout, group, t: int, trunk_kv, q, kvs):
        """Pass t's attention output (NB, heads, D) for its live query q (NB, heads, D), with the
        trunk's (k, v) and the anchor's pass keys/values ``kvs`` = [(k_1, v_1) .. (k_t, v_t)]: the
        LSE merge of the module doc."""
        _, o_a, l_a = BranchAttention(live, group)(None, trunk_kv[0], trunk_kv[1], q, *kvs[-1], with_lse=True)
        if t == 1:
            return o_a
        ek = torch.stack([kv[0] for kv in kvs[:-1]], dim=1)  # (NB, t-1, Hk, D)
        ev = torch.stack([kv[1] for kv in kvs[:-1]], dim=1)
        g = q.shape[1] // ek.shape[2]
        s = torch.einsum("nhd,nmhd->nhm", q.float(), ek.float().repeat_interleave(g, dim=2)) * q.shape[-1] ** -0.5
        l_b = torch.logsumexp(s, dim=-1)
        o_b = torch.einsum("nhm,nmhd->nhd", torch.softmax(s, dim=-1), ev.float().repeat_interleave(g, dim=2))
        lse = torch.logaddexp(l_a, l_b)
        o = o_a.float() * torch.exp(l_a - lse)[..., None] + o_b * torch.exp(l_b - lse)[..., None]
        return o.to(q.dtype)

    # ----- vLLM ---------------------------------------------------------------------------------
    def _vllm_name_map(self) -> dict[str, str]:
        m = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
        for i, layer in enumerate(self.layers):
            prefix = "midlayer." if len(self.layers) == 1 else f"layers.{i}."
            for name, _ in layer.named_parameters():
                m[prefix + name] = f"layers.{i}.{name}"
        return m

    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        own = dict(self.named_parameters())
        out = {v: own[p].detach().clone() for v, p in self._vllm_name_map().items()}
        if self.vocab is not None:  # vLLM's draft -> target offsets (int64; t2d is not read by vLLM)
            out["d2t"] = self.vocab.d2t.clone()
        return out

    def load_vllm_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        state = dict(state)
        d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
        V = self.target_arch.vocab_size
        if self.vocab is None and d2t is not None and d2t.numel() != V:
            raise ValueError(f"checkpoint has a reduced draft vocabulary of {d2t.numel()} tokens (d2t); this drafter "
                             f"has the whole vocabulary (set draft.eagle3.draft_vocab_size: {d2t.numel()})")
        if self.vocab is not None:
            if d2t is None:
                if strict:
                    raise KeyError(f"eagle3 checkpoint: no d2t, but draft_vocab_size is {self.vocab.size} (a reduced "
                                   "vocabulary needs its mapping)")
            else:
                if d2t.numel() != self.vocab.size:
                    raise ValueError(f"d2t has {d2t.numel()} entries, draft.eagle3.draft_vocab_size is "
                                     f"{self.vocab.size} (set it to {d2t.numel()})")
                vocab = DraftVocab.from_d2t(d2t, V)
                if t2d is not None and not torch.equal(t2d.bool().cpu(), vocab.t2d):
                    raise ValueError("t2d does not select the target ids of d2t (nonzero(t2d) must equal "
                                     "arange(N) + d2t)")
                self.set_vocab(vocab, remap=False)
        super().load_vllm_state_dict(state, strict)

    def vllm_config(self) -> dict:
        cfg = self._base_qwen_like_config()
        cfg.update({
            "architectures": [self.vllm_architecture],
            "model_type": "llama",
            "num_hidden_layers": len(self.layers),
            "draft_vocab_size": self.vocab.size if self.vocab is not None else self.target_arch.vocab_size,
            "num_aux_hidden_states": self.num_taps,
            "eagle_aux_hidden_state_layer_ids": self.vllm_tap_ids,
            "norm_before_fc": False,
            "cotrain": {"kind": self.kind, "tap_layers": self.tap_layers, "ttt_steps": self.num_passes,
                        **({"draft_vocab": {"source": self.vocab.source, "version": self.vocab.version}}
                           if self.vocab is not None else {})},
        })
        return cfg


register_drafter("eagle3", Eagle3Drafter)
