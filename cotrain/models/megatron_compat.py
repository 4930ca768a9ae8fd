"""Run megatron-core on a machine without CUDA.

megatron-core 0.16 assumes a GPU in a handful of places that have nothing to do with the maths:
``torch.cuda.current_device()`` as the device for RoPE frequencies, the global memory buffer and the
pipeline's shape exchange; ``device="cuda"`` literals in the default causal mask and in every
forward-backward schedule; ``pin_memory=True`` in RoPE's context-parallel split; and the CUDA RNG
tracker (``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()``).

Rather than copying and editing those functions (which would drift from Megatron), this layer gives
the ``megatron.core`` modules a view of ``torch`` in which *the CUDA device is the CPU*:

* ``torch.cuda.current_device()`` returns ``torch.device("cpu")``; ``torch.cuda.synchronize()``
  (after the pipeline's batched P2P) and ``empty_cache()`` do nothing;
* tensor factories (``zeros``, ``empty``, ``arange``, ...) and ``Tensor.to``-style device arguments
  given as ``"cuda"`` / ``torch.device("cuda", i)`` become CPU, and ``pin_memory=True`` is dropped;
* the CUDA RNG tracker is replaced by :class:`CpuRNGStatesTracker`, which forks the CPU generator;
* RoPE's zigzag split for context parallelism (``get_pos_emb_on_this_cp_rank``, which moves its
  index tensor with ``Tensor.cuda()``) is replaced by :func:`pos_emb_on_this_cp_rank`, same rule.

Everything else is the real ``torch``. The view is installed per module (``module.torch``), so
code outside Megatron - vLLM, Ray, the project itself - is untouched. It is inactive when CUDA is
available: :func:`apply_cpu_compat` then does nothing and returns False.

Also CPU-only by nature (not patched, handled by the callers): Megatron's optimizer with
``clip_grad > 0`` and its distributed optimizer (see ``cotrain.models.megatron_model``).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
import warnings
from typing import Any

import torch

from cotrain.parallel.zigzag import zigzag_split

# Expected on CPU (transformer-engine and apex are GPU-only extras); megatron repeats it per module.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed")

# The megatron modules that are imported before patching; anything else from megatron.core that is
# already in sys.modules is patched too. Call apply_cpu_compat() again after importing more.
_MEGATRON_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.common.embeddings.language_model_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
)

_CPU = torch.device("cpu")
_FACTORIES = (
    "arange", "empty", "empty_like", "full", "full_like", "ones", "ones_like", "zeros", "zeros_like",
    "rand", "randn", "randint", "randperm", "tensor", "as_tensor", "eye", "linspace", "tril_indices",
    "triu_indices",
)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int):  # a bare device index means a CUDA device in torch's API
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _redirect_kwargs(kwargs: dict) -> dict:
    if "device" in kwargs and _is_cuda_device(kwargs["device"]):
        kwargs["device"] = _CPU
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False  # pinning needs an accelerator
    return kwargs


def _redirected(fn):
    def wrapper(*args, **kwargs):
        return fn(*args, **_redirect_kwargs(kwargs))

    wrapper.__name__ = getattr(fn, "__name__", "factory")
    wrapper.__wrapped__ = fn
    return wrapper


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as seen by Megatron on CPU: the current device is the CPU."""

    def __init__(self):
        super().__init__("torch.cuda")

    def current_device(self):
        return _CPU

    def synchronize(self, device=None):
        pass  # CPU ops are synchronous

    def empty_cache(self):
        pass

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by Megatron on CPU (see the module docstring)."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _redirected(getattr(torch, name)))

    def __getattr__(self, name):
        value = getattr(torch, name)
        setattr(self, name, value)  # cache: later lookups skip __getattr__
        return value


CPU_TORCH = _CpuTorch()


class CpuRNGStatesTracker:
    """Megatron's CUDA RNG tracker, for the CPU generator.

    Megatron forks a named RNG stream around dropout and weight init so that tensor-parallel ranks
    draw different (or identical) random numbers. Here each named stream is a saved CPU generator
    state; ``fork`` swaps it in and out of the default generator.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def get_states(self):
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states):
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int):
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        self.seeds_.add(seed)
        gen = torch.Generator().manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not added (known: {sorted(self.states_)})")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


_TRACKER = CpuRNGStatesTracker()


def model_parallel_manual_seed(seed: int) -> None:
    """CPU counterpart of ``tensor_parallel.model_parallel_cuda_manual_seed``.

    Same seeding rule as Megatron: the default stream gets ``seed``, the tensor-parallel stream gets
    ``seed + 2718 + tp_rank`` so that TP ranks draw distinct dropout masks.
    """
    from megatron.core import parallel_state

    torch.manual_seed(seed)
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
    _TRACKER.reset()
    _TRACKER.add("model-parallel-rng", seed + 2718 + tp_rank)
    _TRACKER.add("data-parallel-rng", seed)  # name used by some Megatron modules; same seed as Megatron


def seed_model_parallel(seed: int, device: str | torch.device) -> None:
    """Seed the default and model-parallel RNG streams the way ``device`` needs them.

    On ``cuda``: ``torch.manual_seed(seed)`` and Megatron's own
    ``tensor_parallel.model_parallel_cuda_manual_seed(seed)``, which fills Megatron's CUDA RNG
    tracker (weight init with ``use_cpu_initialization=False`` draws through its ``fork()``). On
    ``cpu``: the stand-in :func:`model_parallel_manual_seed` (same seeds), which only the compatibility
    layer's tracker reads, so it is refused when the layer is off (CUDA available: Megatron's own
    tracker and device choices are then in force and a CPU policy cannot run).
    """
    kind = torch.device(device).type
    if kind == "cuda":
        from megatron.core import tensor_parallel

        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    if kind != "cpu":
        raise ValueError(f"seed_model_parallel: device {device!r} is neither cpu nor cuda")
    if not is_active():
        raise RuntimeError("a CPU policy on a machine with CUDA: megatron-core runs on CPU only through cotrain's "
                           "compatibility layer, which is off when CUDA is available (use cluster.device=cuda, or "
                           "hide the GPUs with CUDA_VISIBLE_DEVICES='')")
    model_parallel_manual_seed(seed)


def pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Rotary embeddings of the two zigzag chunks this CP rank holds: r and 2C-1-r of 2C."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    return zigzag_split(pos_emb, cp_group.size(), cp_group.rank(), dim=seq_dim)


def is_active() -> bool:
    return not torch.cuda.is_available()


_patched: set[str] = set()


def apply_cpu_compat() -> bool:
    """Install the CPU view of torch into the megatron modules. Idempotent; no-op with CUDA.

    Returns True if the compatibility layer is active.
    """
    if not is_active():
        return False
    for name in _MEGATRON_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # a module renamed in another megatron release: nothing to patch there
            pass
    for name, module in list(sys.modules.items()):
        if name in _patched or not name.startswith("megatron.core") or module is None:
            continue
        if getattr(module, "torch", None) is torch:
            module.torch = CPU_TORCH
        _patched.add(name)

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = _TRACKER
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom.model_parallel_cuda_manual_seed = model_parallel_manual_seed
    mrandom.get_cuda_rng_tracker = lambda *a, **k: _TRACKER
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "get_pos_emb_on_this_cp_rank", None) is not None:
            module.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
    for name, module in list(sys.modules.items()):
        # modules that did `from ...random import get_cuda_rng_tracker` hold their own reference
        if name.startswith("megatron.core") and module is not None:
            if getattr(module, "get_cuda_rng_tracker", None) is not None and module is not mrandom:
                module.get_cuda_rng_tracker = mrandom.get_cuda_rng_tracker
    return True
