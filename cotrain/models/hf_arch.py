"""The architecture numbers of a Hugging Face Qwen3 / Llama config, read once and checked.

Everything that builds or converts a model (Megatron, vLLM export, drafters) reads these through
:class:`ArchSpec` so that the handling of optional keys (``head_dim``, ``rope_theta`` vs
``rope_parameters``, tied embeddings) lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_MODEL_TYPES = ("qwen3", "llama")


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict) -> "ArchSpec":
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: {model_type!r} is not supported (allowed: {', '.join(SUPPORTED_MODEL_TYPES)})")
        rope = hf.get("rope_parameters") or {}
        rope_scaling = hf.get("rope_scaling")
        rope_type = rope.get("rope_type", (rope_scaling or {}).get("rope_type", "default"))
        if rope_type not in (None, "default"):
            raise ValueError(f"rope_parameters.rope_type: {rope_type!r} is not supported (allowed: default)")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            # HF puts the bias on q/k/v *and* o_proj; Megatron can bias linear_proj only together
            # with the MLP (add_bias_linear), which HF does not have, so the two can't match exactly.
            raise ValueError("attention_bias / mlp_bias: true is not supported (allowed: false)")
        num_heads = int(hf["num_attention_heads"])
        num_kv = int(hf.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}")
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
        )

