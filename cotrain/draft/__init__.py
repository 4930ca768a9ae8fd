"""Drafters for speculative decoding, trained from target taps and served by vLLM (see docs/drafters.md).

- registry: ``build_drafter(kind, settings, target)``, ``register_drafter``, the ``Drafter`` base class
- eagle3 / dflash / dspark: the three families (EAGLE-3 with train-time test, DFlash, DSpark)
- common: ``DraftBatch`` (packed sequences + taps), ``DraftOutput`` (draft chains), branch attention
- losses: soft_ce, forward_kl, hard_ce, dspark_l1, e2e_tv (``draft_loss``)
- acceptance: the offline acceptance estimator (``estimate_acceptance``)
- export: vLLM's drafter formats (``export_drafter``, ``load_drafter``)
- taps: ``TargetSpec``, ``compute_taps`` (HF target), the layer-id conventions
- cp: ``fetch_rows`` (target rows across a CP group)
- distill: ``python -m cotrain.draft.distill --config ...``; cache: ``ensure_distilled``
"""

from cotrain.draft.acceptance import AcceptanceReport, estimate_acceptance
from cotrain.draft.common import BranchAttention, DraftBatch, DraftOutput
from cotrain.draft.cp import fetch_rows
from cotrain.draft.export import export_drafter, load_drafter, read_export, speculative_config
from cotrain.draft.losses import LOSSES, TargetDist, draft_loss, target_dist, target_probs
from cotrain.draft.registry import (
    DraftConfigError,
    Drafter,
    build_drafter,
    drafter_kinds,
    get_drafter_class,
    register_drafter,
)
from cotrain.draft.taps import TargetSpec, compute_taps, from_vllm_ids, to_vllm_ids

__all__ = [
    "AcceptanceReport", "BranchAttention", "DraftBatch", "DraftConfigError", "DraftOutput", "Drafter", "LOSSES",
    "TargetSpec", "build_drafter", "compute_taps", "draft_loss", "drafter_kinds", "estimate_acceptance",
    "export_drafter", "fetch_rows", "from_vllm_ids", "get_drafter_class", "load_drafter", "read_export",
    "register_drafter", "speculative_config", "target_dist", "target_probs", "to_vllm_ids", "TargetDist",
]
