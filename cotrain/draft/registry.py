"""Drafters by kind: the model side of ``draft.kind``.

Each kind is registered once, by its :class:`cotrain.config.schema.DraftKind` record (settings
class, drafter class, vLLM method, losses); :func:`get_drafter_class` imports the class the record
names, and ``build_drafter(kind, settings, target)`` validates the settings against the target
and builds the module.

Every drafter implements:

- ``tap_layers`` (cotrain convention, output of layer i) and ``vllm_tap_ids``;
- ``build_layout(batch, generator, cp_size)`` -> its :class:`~cotrain.parallel.BranchLayout`;
- ``forward(batch, layout, group=None)`` -> :class:`~cotrain.draft.common.DraftOutput`
  (taps + tokens -> logits per branch position, as draft chains);
- ``vllm_state_dict()`` / ``load_vllm_state_dict(sd)`` (vLLM checkpoint names),
  ``vllm_config()`` (its config.json), ``push_names()`` (what a run-time draft update sends).
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
import torch.nn as nn

from cotrain.config.schema import DraftKind, DraftKindConfig, draft_kinds, get_draft_kind
from cotrain.draft.common import DraftBatch, DraftOutput
from cotrain.draft.taps import TargetSpec, to_vllm_ids
from cotrain.parallel import BranchLayout


class DraftConfigError(ValueError):
    """A drafter's settings do not fit its target; ``issues`` lists (path, message)."""

    def __init__(self, kind: str, issues: list[tuple[str, str]]):
        self.kind = kind
        self.issues = issues
        lines = "\n".join(f"  draft.{kind}.{path}: {msg}" for path, msg in issues)
        super().__init__(f"invalid drafter settings for kind {kind!r}:\n{lines}")


class Drafter(nn.Module):
    """Base class of the drafter families."""

    kind: ClassVar[str] = ""
    vllm_method: ClassVar[str] = ""
    vllm_architecture: ClassVar[str] = ""

    def __init__(self, cfg: DraftKindConfig, target: TargetSpec):
        super().__init__()
        cfg = cfg.model_copy(deep=True)
        cfg.resolve(target.num_layers)
        issues = cfg.check(target.num_layers) + self.extra_checks(cfg, target)
        if issues:
            raise DraftConfigError(self.kind, issues)
        self.cfg = cfg
        self.target_arch = target.arch
        self.target_hf_config = dict(target.hf_config)
        self.mask_token_id = int(target.mask_token_id)
        self.pad_token_id = int(target.pad_token_id)
        # frozen target tensors the drafter borrows (buffers: never trained, never exported)
        self.register_buffer("embed_weight", target.embed.detach().clone().float(), persistent=False)
        self.register_buffer("target_lm_head", target.lm_head.detach().clone().float(), persistent=False)

    # ----- config -----------------------------------------------------------------------------
    def extra_checks(self, cfg: DraftKindConfig, target: TargetSpec) -> list[tuple[str, str]]:
        """Family checks beyond DraftKindConfig.check (path, message)."""
        return []

    @property
    def tap_layers(self) -> list[int]:
        """Target layers tapped, cotrain convention (output of layer i), ascending."""
        return sorted(self.cfg.tap_layers)

    @property
    def vllm_tap_ids(self) -> list[int]:
        """The same layers as vLLM aux ids (residual stream entering layer i + 1)."""
        return to_vllm_ids(self.tap_layers)

    @property
    def num_taps(self) -> int:
        return len(self.tap_layers)

    @property
    def draft_width(self) -> int:
        """Draft tokens per chain the drafter is trained for."""
        raise NotImplementedError

    def default_num_speculative_tokens(self) -> int:
        return self.cfg.default_num_speculative_tokens()

    # ----- training ---------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids.to(self.embed_weight.device), self.embed_weight)  # host ids welcome

    def build_layout(self, batch: DraftBatch, generator: Optional[torch.Generator] = None,
                     cp_size: int = 1) -> BranchLayout:
        raise NotImplementedError

    def forward(self, batch: DraftBatch, layout: Optional[BranchLayout] = None, group=None) -> DraftOutput:
        raise NotImplementedError

    def target_rows_read(self, batch: DraftBatch, layout: BranchLayout) -> Optional[torch.Tensor]:
        """The packed rows of the target logits that ``forward(batch, layout)`` at CP = 1 supervises
        (its ``target_rows`` where valid), sorted and unique, without running it; None = every row."""
        return None

    # ----- vLLM -------------------------------------------------------------------------------
    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def load_vllm_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        mapping = self._vllm_name_map()
        own = dict(self.named_parameters())
        missing = [n for n in mapping if n not in state]
        unexpected = [n for n in state if n not in mapping]
        if strict and (missing or unexpected):
            raise KeyError(f"{self.kind} checkpoint: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            for vname, pname in mapping.items():
                if vname in state:
                    t = state[vname]
                    p = own[pname]
                    if tuple(t.shape) != tuple(p.shape):
                        raise ValueError(f"{vname}: shape {tuple(t.shape)} does not match {pname} {tuple(p.shape)}")
                    p.copy_(t.to(p.dtype))

    def _vllm_name_map(self) -> dict[str, str]:
        """vLLM checkpoint name -> parameter name (one to one)."""
        raise NotImplementedError

    def vllm_config(self) -> dict:
        raise NotImplementedError

    def push_names(self) -> list[str]:
        """vLLM names a run-time draft update sends: the drafter's own tensors only (never the
        target's embeddings or LM head it shares)."""
        return sorted(self.vllm_state_dict())

    def speculative_config(self, model_dir: str, num_speculative_tokens: Optional[int] = None, **extra) -> dict:
        """vLLM ``speculative_config`` serving this drafter from ``model_dir``."""
        k = num_speculative_tokens or self.default_num_speculative_tokens()
        out = {"method": self.vllm_method, "model": str(model_dir), "num_speculative_tokens": int(k)}
        out.update(extra)
        return out

    def _base_qwen_like_config(self) -> dict:
        a = self.target_arch
        return {
            "hidden_size": a.hidden_size,
            "intermediate_size": a.intermediate_size,
            "num_attention_heads": a.num_heads,
            "num_key_value_heads": a.num_kv_heads,
            "head_dim": a.head_dim,
            "rms_norm_eps": a.rms_norm_eps,
            "rope_theta": a.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},
            "max_position_embeddings": a.max_position_embeddings,
            "vocab_size": a.vocab_size,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "target_hidden_size": a.hidden_size,
            "torch_dtype": "float32",
            "pad_token_id": self.target_hf_config.get("pad_token_id"),
            "eos_token_id": self.target_hf_config.get("eos_token_id"),
        }


def register_drafter(kind: str, cls: type[Drafter]) -> type[Drafter]:
    """Bind a drafter module's class ``cls`` to the record of ``kind``: the record is the
    registration (it names the class, the vLLM method and the losses), so the class takes its
    ``kind`` and ``vllm_method`` from it; this checks that the record names this very class."""
    record = get_draft_kind(kind)  # KeyError with the registered kinds
    if not (isinstance(cls, type) and issubclass(cls, Drafter)):
        raise TypeError(f"{cls!r} is not a Drafter subclass")
    if record.model != f"{cls.__module__}:{cls.__qualname__}":
        raise ValueError(f"drafter kind {kind!r} is registered as {record.model}, "
                         f"not {cls.__module__}:{cls.__qualname__}")
    cls.kind, cls.vllm_method = kind, record.vllm_method
    return cls


def get_drafter_class(kind: str) -> type[Drafter]:
    try:
        record = get_draft_kind(kind)
    except KeyError:
        raise KeyError(f"no drafter registered for kind {kind!r} (registered: {', '.join(drafter_kinds())})") from None
    return record.model_class()


def record_of(drafter: Drafter) -> DraftKind:
    """The registration of ``drafter``'s kind: what generic code (the online trainer, SpecOPD) asks
    of its family (``anchors``, ``branches``, ``vocab_rows``) instead of testing its class."""
    return get_draft_kind(drafter.kind)


def drafter_kinds() -> tuple[str, ...]:
    """The registered kinds, in registration order."""
    return draft_kinds()


def build_drafter(kind: str, settings: DraftKindConfig | dict | None, target: TargetSpec,
                  seed: Optional[int] = 0) -> Drafter:
    """Validated drafter of ``kind`` for ``target`` (settings: the ``draft.<kind>`` section)."""
    cls = get_drafter_class(kind)
    cfg_cls = get_draft_kind(kind).config
    if settings is None:
        settings = cfg_cls()
    elif isinstance(settings, dict):
        settings = cfg_cls.model_validate(settings)
    elif not isinstance(settings, cfg_cls):
        raise TypeError(f"settings for {kind!r} must be a {cfg_cls.__name__}, got {type(settings).__name__}")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return cls(settings, target, generator=gen)
