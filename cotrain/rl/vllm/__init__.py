"""cotrain's side of vLLM, one job per module.

* :mod:`~cotrain.rl.vllm.engine` - building an engine (CPU and GPU settings, speculative config,
  the worker extension wired in);
* :mod:`~cotrain.rl.vllm.client` - driving a running engine: the weight push, status;
* inside vLLM's worker processes: :mod:`~cotrain.rl.vllm.extension` (the worker extension, which
  installs the next two), :mod:`~cotrain.rl.vllm.transfer_backend` (the ``cotrain`` weight-transfer
  backend: checked, atomic pushes; the bytes arrive through :mod:`cotrain.weights.vllm_receiver`), :mod:`~cotrain.rl.vllm.sampler_fix` (the CPU
  rejection-sampler repair), :mod:`~cotrain.rl.vllm.dflash_rebuild` (DFlash's buffers after a
  drafter push), :mod:`~cotrain.rl.vllm.manifest` (what a push must carry).
"""
