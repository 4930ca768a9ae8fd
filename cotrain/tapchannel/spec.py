"""What is tapped, where it comes from, and the layer-id convention.

Layer ids
---------
A :class:`TapSpec` ``layer`` is a **global, 0-based decoder-layer index** and the tap is the **output of
that layer**: the residual stream after layer ``layer`` (``model.decoder.layers[i]`` on the stage that
holds it), before the final norm. So ``layer = num_layers - 1`` is the last layer's output.

vLLM numbers hidden states as the residual stream *entering* layer L (0 = embeddings, num_layers = the
last layer's output), so ``vllm_id = layer + 1`` (:func:`to_vllm_hidden_state_id`). DFlash / DSpark
configs give ``target_layer_ids`` as "output of layer i": the same numbers as ``layer`` here (vLLM adds
the 1 itself). EAGLE-3's ``eagle_aux_hidden_state_layer_ids`` are vLLM ids: convert them with
:func:`from_vllm_hidden_state_id`. The embeddings (vLLM id 0) are not a tap.

Tokens
------
A tap for one microbatch is a 2-D tensor ``[num_tokens, width]``: the layer output ``[s, b, h]`` in
batch-major token order (``transpose(0, 1).reshape(b * s, h)``), first ``num_tokens`` rows. With
packed sequences (``b = 1``) that is exactly the real tokens of a right-padded microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import torch

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4, torch.int64: 5, torch.int32: 6}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype} is not supported by TapChannel (allowed: {sorted(map(str, DTYPE_CODES))})")
    return DTYPE_CODES[dtype]


@dataclass(frozen=True)
class TapSpec:
    """One tap: a layer's output, its producing stage and rank, its feature width and dtype."""

    layer: int
    width: int
    dtype: torch.dtype = torch.float32
    stage: int | None = None  # pipeline stage that runs ``layer`` (filled by :meth:`resolve`)
    rank: int | None = None  # global rank of that stage in this pipeline (filled by :meth:`resolve`)

    def __post_init__(self):
        if self.layer < 0:
            raise ValueError(f"tap layer {self.layer}: layer ids are 0-based 'output of layer i' (>= 0)")
        if self.width <= 0:
            raise ValueError(f"tap layer {self.layer}: width must be positive, got {self.width}")
        dtype_code(self.dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def nbytes(self, num_tokens: int) -> int:
        return num_tokens * self.width * self.itemsize

    def resolve(self, layout: "PipelineLayout") -> "TapSpec":
        stage = layout.stage_of_layer(self.layer)
        if self.stage is not None and self.stage != stage:
            raise ValueError(f"tap layer {self.layer}: spec says stage {self.stage}, the pipeline runs it on stage {stage}")
        rank = layout.stage_ranks[stage]
        if self.rank is not None and self.rank != rank:
            raise ValueError(f"tap layer {self.layer}: spec says rank {self.rank}, stage {stage} is rank {rank}")
        return replace(self, stage=stage, rank=rank)


@dataclass(frozen=True)
class PipelineLayout:
    """One pipeline: the global rank of each stage and how many decoder layers each stage runs.

    The drafter (reader) sits on ``reader_stage`` (default: the last stage).
    """

    stage_ranks: tuple[int, ...]
    layers_per_stage: tuple[int, ...]
    reader_stage: int = -1

    def __post_init__(self):
        object.__setattr__(self, "stage_ranks", tuple(int(r) for r in self.stage_ranks))
        object.__setattr__(self, "layers_per_stage", tuple(int(n) for n in self.layers_per_stage))
        if not self.stage_ranks or len(self.stage_ranks) != len(self.layers_per_stage):
            raise ValueError(f"stage_ranks {self.stage_ranks} and layers_per_stage {self.layers_per_stage} differ in length")
        if len(set(self.stage_ranks)) != len(self.stage_ranks):
            raise ValueError(f"stage_ranks {self.stage_ranks} repeat a rank")
        if any(n < 0 for n in self.layers_per_stage):
            raise ValueError(f"layers_per_stage {self.layers_per_stage} has a negative count")
        rs = self.reader_stage % len(self.stage_ranks)
        object.__setattr__(self, "reader_stage", rs)

    @classmethod
    def even(cls, stage_ranks: Sequence[int], num_layers: int, reader_stage: int = -1) -> "PipelineLayout":
        pp = len(stage_ranks)
        if num_layers % pp:
            raise ValueError(f"num_layers={num_layers} does not split evenly over {pp} stages; give layers_per_stage")
        return cls(tuple(stage_ranks), (num_layers // pp,) * pp, reader_stage)

    @classmethod
    def from_megatron(cls, model, reader_stage: int = -1) -> "PipelineLayout":
        """This rank's pipeline, read from megatron's parallel_state and the model (collective over the PP group)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from cotrain.tapchannel.hooks import decoder_layers, stage_layer_offset

        layers = decoder_layers(model)
        group = ps.get_pipeline_model_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        mine = (stage_layer_offset(model), len(layers))
        gathered: list = [None] * len(ranks)
        dist.all_gather_object(gathered, mine, group=group)
        offsets = [g[0] for g in gathered]
        counts = [g[1] for g in gathered]
        for s in range(1, len(ranks)):
            if offsets[s] != offsets[s - 1] + counts[s - 1]:
                raise ValueError(f"pipeline stages are not contiguous in layers: offsets {offsets}, counts {counts}")
        return cls(tuple(ranks), tuple(counts), reader_stage)

    @property
    def pp_size(self) -> int:
        return len(self.stage_ranks)

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_stage)

    @property
    def reader_rank(self) -> int:
        return self.stage_ranks[self.reader_stage]

    def first_layer(self, stage: int) -> int:
        return sum(self.layers_per_stage[:stage])

    def stage_of_layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"tap layer {layer} is outside the model's layers 0..{self.num_layers - 1}")
        acc = 0
        for s, n in enumerate(self.layers_per_stage):
            if layer < acc + n:
                return s
            acc += n
        raise AssertionError("unreachable")

    def stage_of_rank(self, rank: int) -> int | None:
        return self.stage_ranks.index(rank) if rank in self.stage_ranks else None


def tap_specs(layers: Iterable[int], layout: PipelineLayout, width: int, dtype: torch.dtype = torch.float32) -> list[TapSpec]:
    """Resolved specs for ``layers`` (output of each), all of one width and dtype, sorted by layer."""
    layers = sorted(set(int(i) for i in layers))
    return [TapSpec(i, width, dtype).resolve(layout) for i in layers]


def to_vllm_hidden_state_id(layer: int) -> int:
    """vLLM's id of the residual stream after layer ``layer`` (vLLM counts the stream entering a layer)."""
    return layer + 1


def from_vllm_hidden_state_id(vllm_id: int) -> int:
    """Our layer id for a vLLM hidden-state id (e.g. EAGLE-3's ``eagle_aux_hidden_state_layer_ids``)."""
    if vllm_id < 1:
        raise ValueError(f"vLLM hidden-state id {vllm_id} is the embeddings (or invalid), not a layer output")
    return vllm_id - 1


def eagle3_default_layers(num_layers: int) -> list[int]:
    """vLLM's EAGLE-3 default aux ids (2, L//2, L-3), converted to our 'output of layer i' ids."""
    return [from_vllm_hidden_state_id(i) for i in (2, num_layers // 2, num_layers - 3)]


def tap_bytes(num_tokens: int, specs: Iterable[TapSpec]) -> int:
    """Payload of one microbatch: tokens x sum of tap widths x element size (each feature once)."""
    return sum(s.nbytes(num_tokens) for s in specs)
