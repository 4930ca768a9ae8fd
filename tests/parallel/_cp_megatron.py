"""Per-rank body of the Megatron adapter test (spawned ranks import this module)."""

from __future__ import annotations

import torch

HF_CONFIG = dict(  # a tiny Qwen3 (GQA, qk-norm), as a Hugging Face config
    model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=64, tie_word_embeddings=False,
)


def _run(model, ids, labels):
    b, s = ids.shape
    pos = torch.arange(s)[None].expand(b, s)
    return model(ids, pos, None, labels=labels)  # per-token loss [b, s]


def cp_vs_cp1(rank: int, world: int, window=None, batch: int = 2, seq_len: int = 16) -> dict:
    """Loss and gradients of a tiny GPTModel: Megatron's own attention at CP=1 vs the adapter at CP=world."""
    from cotrain.models.megatron_compat import apply_cpu_compat, model_parallel_manual_seed

    apply_cpu_compat()
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from cotrain.models.hf_arch import ArchSpec
    from cotrain.models.megatron_model import build_gpt_model, gpt_layer_spec, tensor_state, transformer_config
    from cotrain.parallel.megatron_adapter import CPBranchCoreAttention

    apply_cpu_compat()
    arch = ArchSpec.from_hf(HF_CONFIG)
    overrides = {} if window is None else {"window_size": (window - 1, 0)}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (batch, seq_len + 1), generator=g)
    tokens, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    count = tokens.numel()

    # Reference: CP = 1 (the world is data parallel), Megatron's DotProductAttention.
    ps.initialize_model_parallel(context_parallel_size=1)
    model_parallel_manual_seed(0)
    ref_model = build_gpt_model(arch, transformer_config(arch, **overrides))
    ref_loss = _run(ref_model, tokens, labels).sum() / count
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    weights = tensor_state(ref_model)
    ps.destroy_model_parallel()

    # CP = world with the adapter, same weights, Megatron's own zigzag split of the batch.
    ps.initialize_model_parallel(context_parallel_size=world)
    model_parallel_manual_seed(0)
    cfg = transformer_config(arch, **overrides)
    model = build_gpt_model(arch, cfg, layer_spec=gpt_layer_spec(arch, core_attention=CPBranchCoreAttention))
    model.load_state_dict(weights, strict=False)
    assert type(model.decoder.layers[0].self_attention.core_attention) is CPBranchCoreAttention
    assert type(ref_model.decoder.layers[0].self_attention.core_attention).__name__ == "DotProductAttention"
    local = get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels})
    local_sum = _run(model, local["tokens"], local["labels"]).sum()
    (local_sum / count).backward()
    loss = local_sum.detach().clone()
    cp_group = ps.get_context_parallel_group()
    torch.distributed.all_reduce(loss, group=cp_group)
    grads = {}
    for n, p in model.named_parameters():
        grad = p.grad.clone()
        torch.distributed.all_reduce(grad, group=cp_group)  # what Megatron's grad sync does over CP
        grads[n] = grad
    ps.destroy_model_parallel()
    return {
        "ref_loss": ref_loss.item(),
        "cp_loss": (loss / count).item(),
        "grad_err": {n: float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads},
        "grad_scale": max(float(g.abs().max()) for g in ref_grads.values()),
    }
