"""Shared pieces of the rollout tests: a local Ray, HF references, statistics, a tiny DFlash drafter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

RAY_CPUS = 4  # logical: engines reserve 1 each; the machine may have 2 cores


def start_ray(num_cpus: int = RAY_CPUS) -> bool:
    """A local Ray on loopback; returns whether this call started it (then stop it after)."""
    import ray

    if ray.is_initialized():
        return False
    # Keep every Ray listener on 127.0.0.1 (otherwise: the host's address and 0.0.0.0). Ray reads
    # this variable when it is imported: the environment covers Ray's own processes, the constant
    # this process (which may have imported Ray before this point).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        import ray._private.ray_constants as ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=os.environ.get("COTRAIN_TEST_RAY_LOGS") == "1")
    return True


def stop_ray(started: bool) -> None:
    import ray

    if started and ray.is_initialized():
        ray.shutdown()


def load_hf(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def random_policy_state(tokenizer, seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A differently initialised tiny model (same architecture): its greedy output differs."""
    from cotrain.models.build_tiny import make_model

    model = make_model(tokenizer, seed=seed).eval()
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def token_logprobs(model, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """HF log-probabilities of ``response_ids`` after ``prompt_ids`` (logits / temperature)."""
    ids = torch.tensor([prompt_ids + response_ids])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


@torch.no_grad()
def second_token_distribution(model, prompt_ids: list[int], eos_id: int) -> torch.Tensor:
    """Exact distribution of the 2nd sampled token at temperature 1; index V = "stopped after
    the 1st token" (the 1st token was <eos>)."""
    ids = torch.tensor([prompt_ids])
    p1 = model(input_ids=ids).logits[0, -1].float().softmax(-1)
    V = p1.shape[0]
    seqs = torch.cat([ids.repeat(V, 1), torch.arange(V)[:, None]], dim=1)
    p2 = model(input_ids=seqs).logits[:, -1].float().softmax(-1)  # [first token, second token]
    out = torch.zeros(V + 1, dtype=torch.float64)
    keep = torch.ones(V, dtype=torch.bool)
    keep[eos_id] = False
    out[:V] = (p1[keep, None] * p2[keep]).sum(0).double()
    out[V] = p1[eos_id].double()
    return out / out.sum()


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's goodness of fit: cells with an expected count below ``min_expected`` are pooled.
    Returns (statistic, degrees of freedom, p-value)."""
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 1e-12:  # nothing pooled
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = int(obs.numel() - 1)
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts.double() / counts.sum() - probs.double()).abs().sum())


def sampling_tv(probs: torch.Tensor, n: int) -> float:
    """Expected total variation between ``n`` exact samples' frequencies and ``probs`` (normal
    approximation per cell): the noise floor a correct sampler shows."""
    p = probs.double()
    return float(0.5 * (2 * p * (1 - p) / (torch.pi * n)).sqrt().sum())


def make_dflash_drafter(out: str | Path, arch: dict, *, seed: int = 0, num_layers: int = 1,
                        target_layer_ids: tuple[int, ...] = (0, 2), mask_token_id: int = 2,
                        scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Write a random DFlash drafter for a Qwen3 target (vLLM's ``dflash`` format):
    ``config.json`` + ``model.safetensors`` with the drafter's own tensors only (it borrows the
    target's ``embed_tokens`` and ``lm_head``). Returns the tensors."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    H, inter = arch["hidden_size"], arch["intermediate_size"]
    nh, nkv, hd = arch["num_attention_heads"], arch["num_key_value_heads"], arch["head_dim"]
    cfg = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=H, intermediate_size=inter,
               num_hidden_layers=num_layers, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
               vocab_size=arch["vocab_size"], max_position_embeddings=arch["max_position_embeddings"],
               rope_theta=arch.get("rope_theta", 10000.0), rms_norm_eps=arch["rms_norm_eps"], hidden_act="silu",
               tie_word_embeddings=False, torch_dtype="float32", target_hidden_size=H,
               layer_types=["full_attention"] * num_layers,
               dflash_config={"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id,
                              "causal": False})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    w: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        p = f"layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rnd(nh * hd, H), p + "self_attn.k_proj.weight": rnd(nkv * hd, H),
                  p + "self_attn.v_proj.weight": rnd(nkv * hd, H), p + "self_attn.o_proj.weight": rnd(H, nh * hd),
                  p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
                  p + "mlp.gate_proj.weight": rnd(inter, H), p + "mlp.up_proj.weight": rnd(inter, H),
                  p + "mlp.down_proj.weight": rnd(H, inter), p + "input_layernorm.weight": torch.ones(H),
                  p + "post_attention_layernorm.weight": torch.ones(H)})
    w.update({"fc.weight": rnd(H, len(target_layer_ids) * H), "hidden_norm.weight": torch.ones(H),
              "norm.weight": torch.ones(H)})
    save_file(w, str(out / "model.safetensors"))
    return w
