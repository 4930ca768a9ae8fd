"""The policy as a megatron-core ``GPTModel``, built from a Hugging Face Qwen3/Llama config.

On CPU the local (non-transformer-engine) layer spec is used (on CUDA also transformer-engine's, see
:func:`gpt_layer_spec`), with fusions off and
``use_cpu_initialization``; :mod:`cotrain.models.megatron_compat` supplies what Megatron expects
from CUDA. ``core_attention`` can be swapped (context parallelism on CPU goes through
``cotrain.parallel``'s adapter). Weight loading goes through :mod:`cotrain.models.convert`, so the
same full (global) Megatron state dict feeds any (PP, TP) layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cotrain.models import convert
from cotrain.models.hf_arch import ArchSpec
from cotrain.models.megatron_compat import apply_cpu_compat

apply_cpu_compat()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

apply_cpu_compat()  # again: the imports above loaded more megatron modules

from cotrain.models import packed_rope  # noqa: E402

packed_rope.install()  # packed rows' RoPE in one vectorised call (megatron's loops over the sequences)


def transformer_config(arch: ArchSpec, *, dtype: torch.dtype = torch.float32, **overrides) -> TransformerConfig:
    """A TransformerConfig with the architecture of ``arch``; parallel degrees from parallel_state."""
    ps_ready = parallel_state.model_parallel_is_initialized()
    kw = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # the fused kernels are CUDA/apex-only; the unfused paths are exact in fp32
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size() if ps_ready else 1,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size() if ps_ready else 1,
        context_parallel_size=parallel_state.get_context_parallel_world_size() if ps_ready else 1,
        sequence_parallel=False,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def have_transformer_engine() -> bool:
    """Megatron's own test: transformer-engine imports (megatron's ``HAVE_TE``)."""
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(gpt_layer_specs.HAVE_TE)


def resolve_layer_spec(name: str, device: torch.device | str) -> str:
    """``policy.layer_spec`` on this rank: auto -> transformer_engine when transformer-engine imports and the
    device is CUDA, else local; a named one as named (validation refuses transformer_engine on CPU or without it)."""
    if name == "auto":
        return "transformer_engine" if torch.device(device).type == "cuda" and have_transformer_engine() else "local"
    if name == "transformer_engine" and not (torch.device(device).type == "cuda" and have_transformer_engine()):
        raise RuntimeError("policy.layer_spec=transformer_engine needs CUDA and transformer-engine importable here")
    return name


def gpt_layer_spec(arch: ArchSpec, core_attention: type | ModuleSpec | None = None, kind: str = "local") -> ModuleSpec:
    """Megatron's GPT layer spec: ``local`` (torch modules; CPU and GPU) or ``transformer_engine`` (TE's fused
    layers, input norms folded into the QKV / FC1 linears: see :data:`TE_NAMES`). ``core_attention``
    replaces the spec's attention core (cotrain's CP ring, TE's attention on the local spec)."""
    if kind == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    elif kind == "local":
        spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    else:
        raise ValueError(f"unknown layer spec {kind!r} (allowed: local, transformer_engine)")
    if core_attention is not None:
        spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec


#: local-spec parameter name -> the transformer-engine spec's (its layer norms live inside the linears that
#: follow them: TELayerNormColumnParallelLinear); every other name is the same in both specs
TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _renamed(state: dict, mapping: dict[str, str]) -> dict:
    out = {}
    for k, v in state.items():
        for a, b in mapping.items():
            if k.endswith("." + a):
                k = k[: -len(a)] + b
                break
        out[k] = v
    return out


def _uses_te_names(model: torch.nn.Module) -> bool:
    return any(k.endswith(".linear_qkv.layer_norm_weight") for k in model.state_dict())


def load_tensor_state(model: torch.nn.Module, state: dict[str, torch.Tensor]):
    """``model.load_state_dict(state, strict=False)`` for a state in local-spec names (:func:`tensor_state`),
    whatever the model's spec; returns (missing, unexpected) in the model's names."""
    if _uses_te_names(model):
        state = _renamed(state, TE_NAMES)
    return model.load_state_dict(state, strict=False)


def build_gpt_model(
    arch: ArchSpec,
    config: TransformerConfig | None = None,
    *,
    layer_spec: ModuleSpec | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
) -> GPTModel:
    """A GPTModel for this rank's pipeline stage (pre/post from parallel_state by default)."""
    config = config or transformer_config(arch)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage() if parallel_state.model_parallel_is_initialized() else True
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage() if parallel_state.model_parallel_is_initialized() else True
    tp = config.tensor_model_parallel_size
    if arch.vocab_size % tp:
        raise ValueError(f"policy.parallel.tensor: vocab_size={arch.vocab_size} is not divisible by TP={tp}")
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec or gpt_layer_spec(arch),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
    )


def layer_offset(model: GPTModel) -> int:
    """Global index of this stage's first transformer layer."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def tensor_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict without Megatron's ``_extra_state`` entries, in the local spec's names
    (a transformer-engine spec's norm names mapped back: :data:`TE_NAMES`)."""
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    return _renamed(state, {b: a for a, b in TE_NAMES.items()}) if _uses_te_names(model) else state


def load_megatron_state(model: GPTModel, full: dict[str, torch.Tensor], arch: ArchSpec) -> None:
    """Copy a full (global, TP=1) Megatron state dict into this rank's stage of ``model``."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    tp_size = model.config.tensor_model_parallel_size
    names = list(tensor_state(model))
    local = convert.to_local(full, names, layer_offset(model), tp_rank, tp_size, arch)
    missing, unexpected = load_tensor_state(model, local)
    missing = [m for m in missing if not m.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"weight load mismatch: missing={missing} unexpected={unexpected}")


def load_hf_weights(model: GPTModel, hf_state: dict[str, torch.Tensor], arch: ArchSpec) -> None:
    load_megatron_state(model, convert.hf_to_megatron(hf_state, arch), arch)


def stage_state_global(model: GPTModel) -> dict[str, torch.Tensor]:
    """This stage's tensors under global names (TP=1): gather these from all stages for export."""
    return convert.from_local(tensor_state(model), layer_offset(model))
