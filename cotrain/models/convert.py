"""Hugging Face <-> Megatron-core weight conversion for Qwen3 and Llama (exact, no arithmetic).

Name map (HF ``model.layers.i.`` = Megatron ``decoder.layers.i.``):

    model.embed_tokens                      embedding.word_embeddings
    input_layernorm                         input_layernorm
    self_attn.{q,k,v}_proj                  self_attention.linear_qkv        (fused, see below)
    self_attn.{q,k}_norm                    self_attention.{q,k}_layernorm   (Qwen3)
    self_attn.o_proj                        self_attention.linear_proj
    post_attention_layernorm                pre_mlp_layernorm
    mlp.{gate,up}_proj                      mlp.linear_fc1                   ([gate; up])
    mlp.down_proj                           mlp.linear_fc2
    model.norm                              decoder.final_layernorm
    lm_head                                 output_layer                     (absent when tied)

Megatron fuses Q, K and V per query group: with G = num_kv_heads groups of q_per_kv query heads,
``linear_qkv`` rows are ``[q_g0 (q_per_kv*d), k_g0 (d), v_g0 (d), q_g1, k_g1, v_g1, ...]``. This
group-major order is also why tensor parallelism can split ``linear_qkv`` into contiguous row chunks.

The functions work on *full* state dicts (all layers, global layer numbers, no TP split);
:func:`to_local` / :func:`from_local` map between the full dict and one (pp, tp) rank's module
state dict.
"""

from __future__ import annotations

import re

import torch

from cotrain.models.hf_arch import ArchSpec

_LAYER_MAP = {  # HF suffix -> Megatron suffix, for the 1:1 tensors of a layer
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ArchSpec) -> torch.Tensor:
    g, d = arch.num_kv_heads, arch.head_dim
    tail = q.shape[1:]  # (H,) for weights, () for biases
    q = q.reshape(g, arch.q_per_kv * d, *tail)
    k = k.reshape(g, d, *tail)
    v = v.reshape(g, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, arch: ArchSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = arch.num_kv_heads, arch.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (arch.q_per_kv + 2) * d, *tail)
    q, k, v = torch.split(grouped, [arch.q_per_kv * d, d, d], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(), v.reshape(-1, *tail).contiguous())


def hf_to_megatron(hf: dict[str, torch.Tensor], arch: ArchSpec) -> dict[str, torch.Tensor]:
    """Full HF state dict -> full Megatron state dict (global layer numbers)."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i in range(arch.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for h, m in _LAYER_MAP.items():
            if src + h in hf:
                out[dst + m] = hf[src + h]
        a = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], arch
        )
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]], dim=0
        )
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not arch.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def megatron_to_hf(mc: dict[str, torch.Tensor], arch: ArchSpec) -> dict[str, torch.Tensor]:
    """Full Megatron state dict -> full HF state dict (inverse of :func:`hf_to_megatron`)."""
    out = {"model.embed_tokens.weight": mc["embedding.word_embeddings.weight"]}
    for i in range(arch.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for h, m in _LAYER_MAP.items():
            if src + m in mc:
                out[dst + h] = mc[src + m]
        a = dst + "self_attn."
        q, k, v = split_qkv(mc[src + "self_attention.linear_qkv.weight"], arch)
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        gate, up = torch.chunk(mc[src + "mlp.linear_fc1.weight"], 2, dim=0)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
        out[dst + "mlp.down_proj.weight"] = mc[src + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = mc["decoder.final_layernorm.weight"]
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = mc["output_layer.weight"]
    return out


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: how each Megatron tensor is partitioned across TP ranks.

_COLUMN = ("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def tp_shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slice of ``full`` that TP rank ``tp_rank`` holds (norms are replicated)."""
    if tp_size == 1:
        return full
    if name.endswith("linear_fc1.weight"):  # [gate; up]: each rank holds its slice of both
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size)[tp_rank], torch.chunk(up, tp_size)[tp_rank]]).contiguous()
    if name.endswith(_COLUMN):
        if full.shape[0] % tp_size:
            raise ValueError(f"{name}: dim 0 ({full.shape[0]}) is not divisible by tensor parallel size {tp_size}")
        return torch.chunk(full, tp_size, dim=0)[tp_rank].contiguous()
    if name.endswith(_ROW):
        return torch.chunk(full, tp_size, dim=1)[tp_rank].contiguous()
    return full


def tp_gather(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`tp_shard` given every rank's shard in rank order."""
    if len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if name.endswith(_COLUMN):
        return torch.cat(shards, dim=0)
    if name.endswith(_ROW):
        return torch.cat(shards, dim=1)
    return shards[0]


# ---------------------------------------------------------------------------------------------
# Pipeline parallelism: local module names <-> global names.

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def local_to_global_name(name: str, layer_offset: int) -> str:
    m = _LAYER_RE.match(name)
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{m.group(2)}" if m else name


def to_local(
    full: dict[str, torch.Tensor], local_names: list[str], layer_offset: int, tp_rank: int, tp_size: int,
    arch: ArchSpec,
) -> dict[str, torch.Tensor]:
    """Build a rank's module state dict (``local_names``) from a full Megatron state dict."""
    out = {}
    for name in local_names:
        g = local_to_global_name(name, layer_offset)
        if g == "output_layer.weight" and arch.tie_word_embeddings:
            g = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
        if g not in full:
            raise KeyError(f"Megatron parameter {name!r} (global {g!r}) has no source in the checkpoint")
        out[name] = tp_shard(g, full[g], tp_rank, tp_size)
    return out


def from_local(local: dict[str, torch.Tensor], layer_offset: int) -> dict[str, torch.Tensor]:
    """A rank's module state dict -> its part of the full state dict (global layer names, TP=1)."""
    return {local_to_global_name(k, layer_offset): v for k, v in local.items()}
