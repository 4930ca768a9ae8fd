"""Run a DSpark block through vLLM's own ``Qwen3DSparkForCausalLM`` modules, loaded from our export.

Usage: python _vllm_dspark_forward.py EXPORT_DIR TARGET_DIR INPUT.pt OUTPUT.pt

vLLM serves DSpark only with its V2 (GPU, Triton) model runner, so no CPU engine can be made; the
config check that refuses it (``VllmConfig._validate_v1_model_runner``) is skipped here *only to
build the model class*. The drafter's checkpoint is loaded by vLLM's ``load_weights``; the target's
LM head is shared (as ``load_dspark_model`` does). Everything but the attention softmax runs in
vLLM's modules: ``combine_hidden_states`` (fc), the fused context-K/V projection with ``hidden_norm``
and grouped K-norm (``_project_context_kv`` / ``_normalize_context_k``), RoPE (``rotary_emb``), the
decoder layers' projections, norms and MLP, ``norm``, ``compute_draft_logits``, the Markov head
(``markov_embed`` / ``markov_bias``) and ``compute_confidence``. Attention is written out here:
block queries over the context before the anchor and the whole block (non-causal), as vLLM's DFlash
attention does. Run in a subprocess: it initialises vLLM's distributed state.
"""

import sys
import tempfile

import torch


def main(export_dir: str, target_dir: str, inp: str, outp: str) -> None:
    torch.set_num_threads(1)
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from safetensors.torch import load_file

    data = torch.load(inp)
    block = int(data["block_size"])
    orig = VllmConfig._validate_v1_model_runner
    VllmConfig._validate_v1_model_runner = lambda self: None
    try:
        cfg = EngineArgs(model=target_dir, dtype="float32", enforce_eager=True, max_model_len=256,
                         kv_cache_memory_bytes=1 << 26,
                         speculative_config={"method": "dspark", "model": export_dir,
                                             "num_speculative_tokens": block}).create_engine_config()
    finally:
        VllmConfig._validate_v1_model_runner = orig
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{tempfile.mktemp()}", backend="gloo")
        initialize_model_parallel(1, 1)
        m = Qwen3DSparkForCausalLM(vllm_config=cfg).eval()
        m.load_weights(iter(load_file(f"{export_dir}/model.safetensors").items()))
        target = load_file(f"{target_dir}/model.safetensors")
        m.lm_head.weight.data.copy_(target["lm_head.weight"])  # shared with the target
        m.model.embed_tokens.weight.data.copy_(target["model.embed_tokens.weight"])
        # what vLLM's loader does next (on CPU: the oneDNN linear kernels)
        process_weights_after_loading(m, cfg.speculative_config.draft_model_config, torch.device("cpu"))
        hf = m.config
        noise = int(hf.dspark_noise_token_id)
        with torch.no_grad():
            out = run(m, data, block, noise)
    torch.save({**out, "config": {"markov_rank": hf.markov_rank, "block": hf.dspark_block_size,
                                  "layer_ids": list(hf.dflash_config["target_layer_ids"])}}, outp)


def run(m, data, B: int, noise: int) -> dict:
    from vllm import _custom_ops as ops

    inner = m.model
    layers = inner.layers
    attn0 = layers[0].self_attn
    nkv, hd, nh = attn0.num_kv_heads, attn0.head_dim, attn0.num_heads
    logits_all, conf_all = [], []
    for seq_ids, taps, anchor in zip(data["ids"], data["taps"], data["anchors"]):
        a = int(anchor)
        ctx_states = m.combine_hidden_states(taps[:a])  # fc
        ctx_pos = torch.arange(a)
        # precompute_and_store_context_kv up to the cache write: hidden_norm, fused K/V, k_norm, RoPE
        L = len(layers)
        all_k, all_v = inner._project_context_kv(ctx_states, a, L, nkv, hd)
        all_k = inner._normalize_context_k(all_k).view(L * a, nkv * hd)
        ops.rotary_embedding(ctx_pos.repeat(L), all_k, None, inner._rope_head_size,
                             inner._rope_cos_sin_cache.to(all_k.dtype), inner._rope_is_neox)
        all_k = all_k.view(L, a, nkv, hd)
        ids = torch.full((B,), noise, dtype=torch.int64)
        ids[0] = seq_ids[a]
        pos = torch.arange(a, a + B)
        h = m.embed_input_ids(ids)
        residual = None
        for i, layer in enumerate(layers):
            at = layer.self_attn
            if residual is None:
                residual, x = h, layer.input_layernorm(h)
            else:
                x, residual = layer.input_layernorm(h, residual)
            qkv, _ = at.qkv_proj(x)
            q, k, v = qkv.split([at.q_size, at.kv_size, at.kv_size], dim=-1)
            q = at.q_norm(q.view(B, nh, hd)).view(B, -1)
            k = at.k_norm(k.view(B, nkv, hd)).view(B, -1)
            q, k = at.rotary_emb(pos, q, k)
            K = torch.cat([all_k[i], k.view(B, nkv, hd)]).repeat_interleave(nh // nkv, 1)
            V = torch.cat([all_v[i].reshape(a, nkv, hd), v.view(B, nkv, hd)]).repeat_interleave(nh // nkv, 1)
            s = torch.einsum("qhd,khd->hqk", q.view(B, nh, hd), K) * at.scaling
            o = torch.einsum("hqk,khd->qhd", s.softmax(-1), V).reshape(B, nh * hd)
            h, _ = at.o_proj(o)
            h, residual = layer.post_attention_layernorm(h, residual)
            h = layer.mlp(h)
        hidden, _ = inner.norm(h, residual)
        base = m.compute_draft_logits(hidden)
        prev = seq_ids[a : a + B]  # teacher forcing: previous token of block position i is x_{a+i}
        emb = m.markov_embed(prev)
        logits_all.append(base + m.markov_bias(emb))
        conf_all.append(m.compute_confidence(hidden, emb) if inner.confidence_head is not None else None)
    return {"logits": torch.stack(logits_all), "confidence": None if conf_all[0] is None else torch.stack(conf_all)}


if __name__ == "__main__":
    main(*sys.argv[1:5])
