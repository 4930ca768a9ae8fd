"""How trained weights travel from the trainers into the rollout engines.

=================  ==========================================  ======================================
transport          where                                       how the bytes move
=================  ==========================================  ======================================
``shm``            CPU, or any sender/receiver on one node     one safetensors file per push under
                                                               ``/dev/shm`` (memory, not disk);
                                                               cotrain's own (vLLM has no CPU path)
``object_store``   CPU, engines on several nodes               ``shm`` for the engines on the
                                                               sender's node; the same bytes in Ray's
                                                               object store for the others
``cuda_ipc``       GPU, trainer and engine on the same GPU(s)  a copy on every engine GPU, one CUDA
                                                               IPC handle per tensor and GPU UUID;
                                                               vLLM's ``ipc`` worker engine maps it
``nccl``           GPU, engines on other GPUs / nodes          vLLM's NCCL weight-transfer engines
                                                               (a dedicated broadcast group: rank 0
                                                               = trainer, 1.. = engine workers)
=================  ==========================================  ======================================

Modules: :mod:`~cotrain.weights.checks` (what a handle is, the one check on the way in),
:mod:`~cotrain.weights.interfaces` (``WeightTransport``, ``push_through``),
``transports/`` (one file each), :mod:`~cotrain.weights.factory` (by name),
:mod:`~cotrain.weights.vllm_receiver` (the receiving end inside vLLM's workers). This package
imports torch only; vLLM and Ray only inside the GPU senders / receivers and ``object_store``.
"""

from cotrain.weights.checks import (
    SHARED_KEYS,
    TRANSPORTS,
    VLLM_BACKENDS,
    WeightPushError,
    check_handle,
    check_manifest,
    check_push,
    check_received,
    check_vllm_handle,
    manifest_of,
    shared_name_reasons,
    update_info_manifest,
)
from cotrain.weights.factory import make_transport, receiver_for, resolve_transport_name
from cotrain.weights.interfaces import WeightTransport, push_through

__all__ = ["SHARED_KEYS", "TRANSPORTS", "VLLM_BACKENDS", "WeightPushError", "WeightTransport", "check_handle",
           "check_manifest", "check_push", "check_received", "check_vllm_handle", "make_transport", "manifest_of",
           "push_through", "receiver_for", "resolve_transport_name", "shared_name_reasons", "update_info_manifest"]
