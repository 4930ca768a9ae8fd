"""Tap writers as forward hooks on a megatron-core model's configured layers (on each stage).

``attach_tap_hooks(model, channel)`` registers, for every tap layer this rank's stage runs, a forward
hook on ``model.decoder.layers[layer - offset]`` that takes the layer's output (megatron-core 0.16's
``TransformerLayer`` returns ``(hidden_states, context)``; ``hidden_states`` is ``[s, b, h]``),
turns it into batch-major tokens ``[b * s, h]``, keeps the first ``num_tokens`` rows and writes them
with ``channel.write`` - right when the layer has run, inside the stage's forward, without touching
the pipeline schedule. The hooks never modify the output and detach what they send.

Which microbatch: a forward pre-hook on the model advances a per-step counter (0, 1, 2, ... - the
order in which Megatron's schedules run forwards on every stage). ``hooks.set_microbatch(mb,
num_tokens)`` before a forward (e.g. in ``forward_step_func``) names it explicitly and sets the real
token count of a padded microbatch. A layer that runs again for the same microbatch (activation
recomputation) is not written twice.

``hooks.enabled = False`` switches the writers off (nothing is written, the microbatch counter does not
move): a training step taps only the forward that feeds the drafter, not the others it runs.

Not supported: sequence parallelism (the layer output would be a TP shard of the sequence); with
context parallelism each CP rank's pipeline carries its own tokens' taps.
"""

from __future__ import annotations

from functools import partial

import torch

from cotrain.tapchannel.errors import TapSpecMismatchError


def unwrap_model(model):
    """The GPTModel inside DDP / Float16Module-style wrappers (or a one-element model chunk list)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError("TapChannel hooks support one model chunk per stage (no interleaved schedule)")
        model = model[0]
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "decoder"):
        raise TypeError(f"{type(model).__name__} has no .decoder: not a megatron-core GPT-style model")
    return model


def decoder_layers(model) -> torch.nn.ModuleList:
    return unwrap_model(model).decoder.layers


def stage_layer_offset(model) -> int:
    """Global index of this stage's first decoder layer (megatron's layer_number is 1-based and global)."""
    layers = decoder_layers(model)
    return layers[0].layer_number - 1 if len(layers) else 0


class TapHooks:
    """Handle for the hooks attached to one stage's model (``remove()`` detaches them)."""

    def __init__(self, model, channel, *, check_model: bool = True):
        self.model = unwrap_model(model)
        self.channel = channel
        self._handles = []
        self._pending: tuple[int, int | None] | None = None
        self._step = None
        self._mb = -1
        self._num_tokens: int | None = None
        self._written: set[tuple[int, int]] = set()
        self.enabled = True
        cfg = self.model.config
        if getattr(cfg, "sequence_parallel", False):
            raise NotImplementedError("TapChannel hooks do not support sequence parallelism (sharded layer outputs)")
        layers = self.model.decoder.layers
        offset = stage_layer_offset(self.model)
        self.layers: list[int] = []
        for layer in channel.my_layers:
            local = layer - offset
            if not 0 <= local < len(layers):
                raise ValueError(f"tap layer {layer} is not on this stage (layers {offset}..{offset + len(layers) - 1}); "
                                 "the pipeline layout and the model disagree")
            if check_model:
                # the writer registers what the model will really produce; the channel checks it
                # against the reader's slots (width, dtype)
                dtype = getattr(cfg, "params_dtype", torch.float32)
                if getattr(cfg, "bf16", False):
                    dtype = torch.bfloat16
                elif getattr(cfg, "fp16", False):
                    dtype = torch.float16
                channel.register_writer(layer, cfg.hidden_size, dtype)
            self._handles.append(layers[local].register_forward_hook(partial(self._hook, layer)))
            self.layers.append(layer)
        self._handles.append(self.model.register_forward_pre_hook(self._pre))

    def set_microbatch(self, microbatch: int, num_tokens: int | None = None) -> None:
        """The next forward of the model is ``microbatch``; only its first ``num_tokens`` tokens are tapped."""
        self._pending = (int(microbatch), None if num_tokens is None else int(num_tokens))

    def _pre(self, module, args):
        if not self.enabled:
            return
        if self._step != self.channel.step:  # a new step: the counter restarts
            self._step, self._mb = self.channel.step, -1
            self._written.clear()
        if self._pending is not None:
            self._mb, self._num_tokens = self._pending
            self._pending = None
        else:
            self._mb, self._num_tokens = self._mb + 1, None

    def _hook(self, layer: int, module, inputs, output):
        if not self.enabled:
            return
        key = (layer, self._mb)
        if key in self._written:  # recomputation of an already tapped forward
            return
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.dim() != 3:
            raise TapSpecMismatchError(f"layer {layer} output has shape {tuple(hidden.shape)}, expected [s, b, h]")
        s, b, h = hidden.shape
        tokens = hidden.detach().transpose(0, 1).reshape(b * s, h)  # a view when b == 1
        n = b * s if self._num_tokens is None else self._num_tokens
        if not 0 <= n <= b * s:
            raise ValueError(f"num_tokens={n} for a microbatch of {b} x {s} tokens")
        self.channel.write(layer, self._mb, tokens[:n])
        self._written.add(key)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def attach_tap_hooks(model, channel, *, check_model: bool = True) -> TapHooks:
    """Attach tap writers to this rank's stage of ``model`` for the channel's layers (see module doc)."""
    return TapHooks(model, channel, check_model=check_model)
