"""TapChannel: target hidden states ("taps") from any pipeline stage straight to the drafter's stage.

Public API::

    TapSpec, PipelineLayout, tap_specs            what is tapped and where (spec.py)
    TapChannel                                    write(layer, mb, x) / read(mb) / reading(mb) (channel.py)
    attach_tap_hooks, TapHooks                    writers as megatron-core forward hooks (hooks.py)
    TapTransport, TransportContext                the transport interface (interfaces.py)
    transports: "shm", "gloo", "nccl", "cuda_ipc" (transports/); "auto" = one per source by its node
    errors: TapTimeoutError, TapLappedError, TapSourceDeadError, TapReaderDeadError, TapSpecMismatchError

Layer ids are "output of layer i" (0-based, global); vLLM's hidden-state id is i + 1. See
docs/tapchannel.md.
"""

from cotrain.tapchannel.channel import TapChannel
from cotrain.tapchannel.errors import (
    TapError,
    TapLappedError,
    TapPeerDeadError,
    TapReaderDeadError,
    TapSourceDeadError,
    TapSpecMismatchError,
    TapTimeoutError,
)
from cotrain.tapchannel.hooks import TapHooks, attach_tap_hooks
from cotrain.tapchannel.interfaces import TapTransport, TransportContext
from cotrain.tapchannel.metrics import TapMetrics
from cotrain.tapchannel.spec import (
    PipelineLayout,
    TapSpec,
    eagle3_default_layers,
    from_vllm_hidden_state_id,
    tap_bytes,
    tap_specs,
    to_vllm_hidden_state_id,
)
from cotrain.tapchannel.transports import TRANSPORT_CODES, TRANSPORTS, make_transport, register_transport

__all__ = [
    "TapChannel", "TapSpec", "PipelineLayout", "tap_specs", "tap_bytes", "attach_tap_hooks", "TapHooks",
    "TapTransport", "TransportContext", "TapMetrics", "TRANSPORTS", "TRANSPORT_CODES", "make_transport", "register_transport",
    "to_vllm_hidden_state_id", "from_vllm_hidden_state_id", "eagle3_default_layers",
    "TapError", "TapTimeoutError", "TapLappedError", "TapPeerDeadError", "TapSourceDeadError", "TapReaderDeadError",
    "TapSpecMismatchError",
]
