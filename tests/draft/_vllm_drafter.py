"""Load a drafter export into vLLM's *own* model class and run it there (EAGLE-3, DFlash, DSpark).

Usage: python _vllm_drafter.py KIND EXPORT_DIR TARGET_DIR INPUT.pt OUTPUT.pt   (KIND: eagle3 | dflash | dspark)

Writes {"params": the class's named parameters right after its ``load_weights`` (what it read from
our checkpoint, by vLLM's names), "logits": the drafts' logits computed by the class, "confidence"
(DSpark), "config": what the class read from config.json}.

Run in a subprocess: it initialises vLLM's distributed state. The classes are
``Eagle3LlamaForCausalLM``, ``DFlashQwen3ForCausalLM`` and ``Qwen3DSparkForCausalLM``, built from an
engine config of the tiny target with our export as its speculative model, loaded with their
``load_weights`` (vLLM's name mapping, stacked q/k/v and gate/up), the target's embeddings (and, for
the block drafters, its LM head) shared as vLLM shares them, then ``process_weights_after_loading``
(on CPU: the oneDNN linear kernels). Everything runs in vLLM's modules through the classes' own
``forward`` (embeddings, fc / ``combine_hidden_states``, norms, q/k/v, RoPE, o_proj, MLP, final norm,
``compute_logits``; DFlash/DSpark's fused context K/V through ``precompute_and_store_context_kv``;
DSpark's Markov head and confidence head) except the attention kernel, which needs an engine's KV
cache and metadata: each layer's ``attn`` is replaced by :class:`KVCacheAttention`, a KV cache written
out here that holds exactly what the serving engine's cache holds when it drafts (EAGLE-3: the
pass-0 keys of the context up to the anchor, then each draft step's; DFlash/DSpark: the context K/V
the class itself precomputes and stores), with vLLM's causality per family.

The inputs are what a serving engine feeds the drafter, not cotrain's training layout: EAGLE-3
drafts from anchor p (bonus token x[p+1]) after a context forward over the sequence (position q
reads token x[q+1] and the target's taps at q, RoPE position q; causal, so the drafter's cache for
the anchor is positions 0..p of it), then one forward per further draft t (token x[p+1+t]
teacher-forced, the previous step's pre-norm output as hidden state, position p+t, attending to
that cache and the earlier drafts); a block drafter runs [x[a], filler...] at positions a..a+B-1
over the context K/V of positions < a.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile

import torch
import torch.nn as nn

ARCH = {"eagle3": ("vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM"),
        "dflash": ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3ForCausalLM"),
        "dspark": ("vllm.model_executor.models.qwen3_dspark", "Qwen3DSparkForCausalLM")}


@contextlib.contextmanager
def vllm_drafter(kind: str, export_dir: str, target_dir: str, num_speculative_tokens: int):
    """Yields (model, params): vLLM's class for ``kind`` with our export loaded, ready to run, and
    its named parameters as ``load_weights`` left them. The one place the tests set up vLLM."""
    import importlib

    from safetensors.torch import load_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    cls = getattr(importlib.import_module(ARCH[kind][0]), ARCH[kind][1])
    spec = {"method": kind, "model": export_dir, "num_speculative_tokens": int(num_speculative_tokens)}
    # vLLM serves DSpark only with its V2 (GPU, Triton) model runner; the check that refuses it on
    # CPU (VllmConfig._validate_v1_model_runner) is skipped here *only to build the model class*
    orig = VllmConfig._validate_v1_model_runner
    if kind == "dspark":
        VllmConfig._validate_v1_model_runner = lambda self: None
    try:
        cfg = EngineArgs(model=target_dir, dtype="float32", enforce_eager=True, max_model_len=256,
                         kv_cache_memory_bytes=1 << 26, speculative_config=spec).create_engine_config()
    finally:
        VllmConfig._validate_v1_model_runner = orig
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{tempfile.mktemp()}", backend="gloo")
        initialize_model_parallel(1, 1)
        m = cls(vllm_config=cfg).eval()
        install_kv_cache_attention(m)  # before load_weights: DFlash's loader lists the attn modules
        m.load_weights(iter(load_file(f"{export_dir}/model.safetensors").items()))
        params = {n: p.detach().clone() for n, p in m.named_parameters()}
        target = load_file(f"{target_dir}/model.safetensors")
        # shared with the target, as vLLM's proposer shares them (never in a drafter export of ours)
        m.model.embed_tokens.weight.data.copy_(target["model.embed_tokens.weight"])
        if kind != "eagle3":
            m.lm_head.weight.data.copy_(target["lm_head.weight"])
        process_weights_after_loading(m, cfg.speculative_config.draft_model_config, torch.device("cpu"))
        yield m, params


class KVCacheAttention(nn.Module):
    """Stands in for vLLM's ``Attention`` layer (which needs an engine's KV cache and metadata):
    keys/values of earlier forwards stay in ``k`` / ``v`` like the engine's cache; a forward's
    queries attend to the cache and to the forward's own tokens (causally for EAGLE-3, fully for
    DFlash/DSpark's non-causal layers), then its keys/values are appended. DFlash's
    ``precompute_and_store_context_kv`` writes the context through ``impl.do_kv_cache_update``."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, causal: bool):
        super().__init__()
        self.nh, self.nkv, self.hd, self.scale, self.causal = num_heads, num_kv_heads, head_dim, scale, causal
        # precompute_and_store_context_kv calls attn.impl.do_kv_cache_update(attn, k, v, ...); set
        # past nn.Module's registration (a module that is its own child would recurse)
        object.__setattr__(self, "impl", self)
        self.kv_cache = None
        self.reset()

    def reset(self, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> None:
        self.k = torch.zeros(0, self.nkv, self.hd) if k is None else k.clone()
        self.v = torch.zeros(0, self.nkv, self.hd) if v is None else v.clone()

    def do_kv_cache_update(self, attn, k, v, kv_cache, slot_mapping) -> None:
        attn.k = torch.cat([attn.k, k.reshape(-1, self.nkv, self.hd).clone()])
        attn.v = torch.cat([attn.v, v.reshape(-1, self.nkv, self.hd).clone()])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, c = q.shape[0], self.k.shape[0]
        self.do_kv_cache_update(self, k, v, None, None)
        rep = self.nh // self.nkv
        K, V = self.k.repeat_interleave(rep, 1), self.v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q.view(n, self.nh, self.hd), K) * self.scale
        if self.causal:  # query i sees the cache and this forward's tokens 0..i
            see = torch.arange(c + n)[None, :] <= (c + torch.arange(n))[:, None]
            s = s.masked_fill(~see, float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), V).reshape(n, self.nh * self.hd)


def install_kv_cache_attention(m) -> list[KVCacheAttention]:
    out = []
    for layer in m.model.layers:
        at = layer.self_attn
        causal = bool(getattr(at, "causal", True))  # Llama (EAGLE-3) layers are causal; DFlash's say
        at.attn = KVCacheAttention(at.num_heads, at.num_kv_heads, at.head_dim, at.scaling, causal)
        out.append(at.attn)
    return out


def attns(m) -> list[KVCacheAttention]:
    return [layer.self_attn.attn for layer in m.model.layers]


def eagle3_logits(m, data: dict) -> torch.Tensor:
    """(chains, k, V): for each (sequence, anchor p), draft t's logits as vLLM's EAGLE-3 proposer
    computes them with the drafts teacher-forced (x[p+1+t])."""
    k = int(data["k"])
    out = []
    for ids, taps, anchors in zip(data["ids"], data["taps"], data["anchors"]):
        L = ids.numel()
        for a in attns(m):
            a.reset()
        # context forward: position q reads token x[q+1] and the target's taps at q
        normed, prenorm = m.model.forward(ids[1:L], torch.arange(L - 1), m.combine_hidden_states(taps[:L - 1]))
        logits0 = m.compute_logits(normed)
        ctx = [(a.k.clone(), a.v.clone()) for a in attns(m)]
        for p in map(int, anchors):
            for a, (kk, vv) in zip(attns(m), ctx):
                a.reset(kk[:p + 1], vv[:p + 1])  # the drafter's cache: the context up to the anchor
            steps, h = [logits0[p]], prenorm[p:p + 1]
            for t in range(1, k):
                normed_t, h = m.model.forward(ids[p + 1 + t:p + 2 + t], torch.tensor([p + t]), h)
                steps.append(m.compute_logits(normed_t)[0])
            out.append(torch.stack(steps))
    return torch.stack(out)


def block_logits(m, data: dict, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DFlash: (blocks, B-1, V), block position j >= 1 predicting the token at a+j; DSpark:
    (blocks, B, V) with the Markov bias of the teacher-forced previous token, and the confidence."""
    B = int(data["block_size"])
    hf = m.config
    filler = int(hf.dspark_noise_token_id) if kind == "dspark" else int(m.model.mask_token_id)
    logits, conf = [], []
    for ids, taps, anchors in zip(data["ids"], data["taps"], data["anchors"]):
        for a in map(int, anchors):
            for at in attns(m):
                at.reset()
            # the context K/V of positions < a, through the class's own fused precompute path
            m.precompute_and_store_context_kv(m.combine_hidden_states(taps[:a]), torch.arange(a),
                                              context_slot_mapping=torch.zeros(a, dtype=torch.int64))
            block = torch.full((B,), filler, dtype=torch.int64)
            block[0] = ids[a]
            hidden = m.model.forward(block, torch.arange(a, a + B))
            if kind == "dflash":
                logits.append(m.compute_logits(hidden)[1:])
                continue
            emb = m.markov_embed(ids[a:a + B])  # teacher forcing: block position i's previous token is x[a+i]
            logits.append(m.compute_draft_logits(hidden) + m.markov_bias(emb))
            conf.append(m.compute_confidence(hidden, emb) if m.model.confidence_head is not None else None)
    return torch.stack(logits), (torch.stack(conf) if conf and conf[0] is not None else None)


def main(kind: str, export_dir: str, target_dir: str, inp: str, outp: str) -> None:
    torch.set_num_threads(1)
    data = torch.load(inp)
    k = int(data["k"]) if kind == "eagle3" else int(data["block_size"]) - (kind == "dflash")
    with vllm_drafter(kind, export_dir, target_dir, k) as (m, params):
        hf = m.config
        with torch.no_grad():
            if kind == "eagle3":
                logits, conf = eagle3_logits(m, data), None
                config = {"aux_layer_ids": list(hf.eagle_aux_hidden_state_layer_ids),
                          "draft_vocab_size": int(hf.draft_vocab_size)}
            else:
                logits, conf = block_logits(m, data, kind)
                config = {"layer_ids": list(hf.dflash_config["target_layer_ids"]),
                          "causal": [bool(c) for c in m.get_draft_attn_causal()]}
                if kind == "dspark":
                    config.update({"markov_rank": hf.markov_rank, "block": hf.dspark_block_size})
    torch.save({"params": params, "logits": logits, "confidence": conf, "config": config}, outp)


if __name__ == "__main__":
    main(*sys.argv[1:6])
