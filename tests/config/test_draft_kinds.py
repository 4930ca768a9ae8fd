"""The drafter-kind registry: one record per kind drives the config, the draft registry and the models;
registering and replacing kinds. Pure Python, a second."""

from __future__ import annotations

import pytest

from cotrain.config import (
    DraftKind,
    DraftKindConfig,
    draft_kinds,
    get_draft_kind,
    load_config,
    register_draft_kind,
    speculative_methods,
)
from cotrain.config import schema as schema_mod
from _config_helpers import CONFIGS, DEMO, error_of, assert_issue


# --------------------------------------------------------------------------- drafter registry
@pytest.fixture
def registry():
    saved = dict(schema_mod._DRAFT_KINDS)
    yield
    schema_mod._DRAFT_KINDS.clear()
    schema_mod._DRAFT_KINDS.update(saved)


class MedusaConfig(DraftKindConfig):
    """A test kind."""

    num_heads: int = 2
    """Heads."""


MEDUSA = DraftKind("medusa", MedusaConfig, "medusa_pkg:MedusaDrafter", vllm_method="medusa", losses=("hard_ce",),
                   default_loss="hard_ce")


def test_register_new_draft_kind(registry):
    assert "medusa" not in draft_kinds()
    register_draft_kind(MEDUSA)
    assert get_draft_kind("medusa") is MEDUSA and "medusa" in speculative_methods()
    cfg = load_config(DEMO, ["draft.kind=medusa", "draft.medusa.num_heads=4", "rollout.speculative.method=medusa",
                             "rollout.speculative.num_speculative_tokens=2"])
    assert cfg.draft.settings.num_heads == 4 and cfg.draft.medusa.num_heads == 4
    assert cfg.draft.settings.tap_layers == [0, 2, 3]
    assert "medusa" in cfg.to_dict()["draft"]
    err = error_of(["draft.kind=hydra"])
    assert_issue(err, "draft.kind", "allowed: null, eagle3, dflash, dspark, medusa")
    assert_issue(error_of(["draft.medusa.num_heads=x"]), "draft.medusa.num_heads", "expected an integer")
    # the record's losses decide what draft.loss may be, and its default
    cfg = load_config(DEMO, ["draft.kind=medusa", "draft.loss=null", "rollout.speculative.method=medusa",
                             "rollout.speculative.num_speculative_tokens=2"])
    assert cfg.draft.loss == "hard_ce" and cfg.draft.settings.default_loss == "hard_ce"
    assert_issue(error_of(["draft.kind=medusa", "draft.loss=soft_ce", "rollout.speculative.method=medusa"]),
                 "draft.loss", "soft_ce is not available for draft.kind=medusa (allowed: hard_ce)")
    assert_issue(error_of(["draft.loss=l2"]), "draft.loss",
                 "allowed: null, soft_ce, forward_kl, hard_ce, e2e_tv, accept_weighted_tv, dspark_l1")
    # its record names no on-policy branches: draft.branches=on_policy is refused, naming the kinds that have them
    assert_issue(error_of(["draft.kind=medusa", "draft.loss=hard_ce", "draft.branches=on_policy",
                           "rollout.speculative.method=medusa", "rollout.speculative.num_speculative_tokens=2"]),
                 "draft.branches", "on_policy is built for kinds eagle3, dflash, dspark (cotrain.draft.specopd), not medusa")
    with pytest.raises(ValueError, match="anchors 'some' is not"):
        register_draft_kind(DraftKind("hydra", MedusaConfig, "x:Y", vllm_method=None, anchors="some"))
    with pytest.raises(ValueError, match="branches 'tree' is not"):
        register_draft_kind(DraftKind("hydra", MedusaConfig, "x:Y", vllm_method=None, branches="tree"))
    with pytest.raises(ValueError, match="already registered"):
        register_draft_kind(DraftKind("eagle3", MedusaConfig, "x:Y", vllm_method="eagle3"))
    with pytest.raises(ValueError, match="clashes"):
        register_draft_kind(DraftKind("loss", MedusaConfig, "x:Y", vllm_method=None))
    with pytest.raises(ValueError, match="default_loss 'soft_ce' is not one of its losses"):
        register_draft_kind(DraftKind("hydra", MedusaConfig, "x:Y", vllm_method=None, losses=("hard_ce",)))
    with pytest.raises(KeyError, match="registered: eagle3"):
        get_draft_kind("hydra")


def test_replace_builtin_kind(registry):
    import dataclasses

    class Eagle3Plus(get_draft_kind("eagle3").config):
        extra: int = 1

    register_draft_kind(dataclasses.replace(get_draft_kind("eagle3"), config=Eagle3Plus), replace=True)
    cfg = load_config(CONFIGS / "demo_eagle3.yaml", ["draft.eagle3.extra=5"])
    assert isinstance(cfg.draft.settings, Eagle3Plus) and cfg.draft.settings.extra == 5


def test_one_record_per_drafter_kind_drives_config_registry_and_models():
    """The record names the drafter class and the vLLM method; the class the registry imports is that
    one and speaks that method; a class the record does not name is refused."""
    from cotrain.draft.registry import Drafter, get_drafter_class, register_drafter

    for kind in draft_kinds():
        record = get_draft_kind(kind)
        cls = get_drafter_class(kind)
        assert f"{cls.__module__}:{cls.__qualname__}" == record.model and cls.vllm_method == record.vllm_method
        assert record.vllm_method in speculative_methods() and record.default_loss in record.losses
    with pytest.raises(ValueError, match="registered as cotrain.draft.dflash:DFlashDrafter, not cotrain.draft.eagle3:Eagle3Drafter"):
        register_drafter("dflash", get_drafter_class("eagle3"))
    with pytest.raises(TypeError, match="not a Drafter subclass"):
        register_drafter("dflash", object)
    assert issubclass(get_drafter_class("dspark"), Drafter)
    from cotrain.draft import losses  # every loss a record allows is implemented

    assert set(schema_mod.draft_losses()) == set(losses.LOSSES)
