"""HF <-> Megatron conversion: exact round trips for Qwen3 and Llama, TP shard/gather inverse."""

import pytest
import torch

from cotrain.models import convert
from cotrain.models.hf_arch import ArchSpec

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def random_hf(model_type: str, tied: bool, bias: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if model_type == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**SMALL, tie_word_embeddings=tied, attention_bias=bias))
    else:
        model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=tied, attention_bias=bias))
    cfg = model.config.to_dict()
    # perturb the norms so that a swapped norm would be caught (they initialise to ones)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    state = {k: v for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    return model, cfg, state


CASES = [("qwen3", False, False), ("qwen3", True, False), ("llama", False, False), ("llama", True, False)]


@pytest.mark.parametrize("model_type,tied,bias", CASES)
def test_round_trip_is_bit_exact(model_type, tied, bias):
    _, cfg, hf = random_hf(model_type, tied, bias)
    arch = ArchSpec.from_hf(cfg)
    mc = convert.hf_to_megatron(hf, arch)
    assert ("output_layer.weight" in mc) == (not tied)
    assert any(k.endswith("q_layernorm.weight") for k in mc) == (model_type == "qwen3")
    back = convert.megatron_to_hf(mc, arch)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_qkv_fusion_is_group_major():
    arch = ArchSpec.from_hf(dict(SMALL, model_type="qwen3"))
    d, H = arch.head_dim, arch.hidden_size
    q = torch.arange(arch.num_heads * d)[:, None].float().expand(-1, H)
    k = 1000 + torch.arange(arch.num_kv_heads * d)[:, None].float().expand(-1, H)
    v = 2000 + torch.arange(arch.num_kv_heads * d)[:, None].float().expand(-1, H)
    fused = convert.fuse_qkv(q, k, v, arch)[:, 0]
    per_group = (arch.q_per_kv + 2) * d
    g0 = fused[:per_group]
    assert torch.equal(g0[: arch.q_per_kv * d], q[: arch.q_per_kv * d, 0])  # group 0's query heads
    assert torch.equal(g0[arch.q_per_kv * d: arch.q_per_kv * d + d], k[:d, 0])  # then its key head
    assert torch.equal(g0[-d:], v[:d, 0])  # then its value head


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_shard_gather_inverse(tp):
    _, cfg, hf = random_hf("qwen3", False)
    arch = ArchSpec.from_hf(cfg)
    mc = convert.hf_to_megatron(hf, arch)
    for name, full in mc.items():
        if name.endswith("linear_qkv.weight") and arch.num_kv_heads % tp:
            continue
        shards = [convert.tp_shard(name, full, r, tp) for r in range(tp)]
        assert torch.equal(convert.tp_gather(name, shards), full), name
    fc1 = mc["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    s0 = convert.tp_shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 0, tp)
    # each rank holds matching slices of gate and up (so SwiGLU stays local to the rank)
    assert torch.equal(s0, torch.cat([gate.chunk(tp)[0], up.chunk(tp)[0]]))


def test_pipeline_local_names_map_to_global():
    assert convert.local_to_global_name("decoder.layers.1.mlp.linear_fc2.weight", 2) == "decoder.layers.3.mlp.linear_fc2.weight"
    assert convert.local_to_global_name("output_layer.weight", 2) == "output_layer.weight"


def test_unsupported_architectures_are_rejected():
    with pytest.raises(ValueError, match="model_type.*allowed: qwen3, llama"):
        ArchSpec.from_hf(dict(SMALL, model_type="gpt2"))
    with pytest.raises(ValueError, match="attention_bias.*allowed: false"):
        ArchSpec.from_hf(dict(SMALL, model_type="llama", attention_bias=True))
    with pytest.raises(ValueError, match="rope_type"):
        ArchSpec.from_hf(dict(SMALL, model_type="llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}))
