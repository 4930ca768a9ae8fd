"""A tiny megatron-core GPTModel at CP = 2 (CPBranchCoreAttention over gloo) matches CP = 1."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import _cp_megatron
from _cp_dist import run_world


@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window5"])
def test_gpt_model_cp2_matches_cp1(window):
    results = run_world(_cp_megatron.cp_vs_cp1, 2, window)
    for rank, r in enumerate(results):
        assert abs(r["cp_loss"] - r["ref_loss"]) <= 1e-5, (rank, r["cp_loss"], r["ref_loss"])
        worst = max(r["grad_err"], key=r["grad_err"].get)
        assert r["grad_err"][worst] <= 1e-5, (rank, worst, r["grad_err"][worst], r["grad_scale"])
