"""The drafters under context parallelism (CP = 2, gloo): same chains and gradients as CP = 1.

Each rank gets only its zigzag shard of the taps and of the target logits; the targets its chains
need from the other rank come through cotrain.draft.cp.fetch_rows."""

import pytest
import torch

pytestmark = pytest.mark.slow


def test_cp2_matches_cp1(tiny_model_path, one_thread):
    import _cp_draft

    ranks = _cp_draft.run_world(_cp_draft.rank_fn, 2, str(tiny_model_path))
    for kind in _cp_draft.SETTINGS:
        ref = _cp_draft.run_family(kind, str(tiny_model_path), 0, 1)
        bonus = torch.cat([r[kind]["bonus"] for r in ranks])
        order = torch.argsort(bonus)
        assert torch.equal(bonus[order], ref["bonus"]), kind  # every chain exactly once, on its anchor's owner
        assert all(r[kind]["bonus"].numel() > 0 for r in ranks), kind  # both ranks own some
        assert sum(r[kind]["remote_rows"] for r in ranks) > 0, kind  # some targets came from the other rank
        logits = torch.cat([r[kind]["logits"] for r in ranks])[order]
        valid = torch.cat([r[kind]["valid"] for r in ranks])[order]
        assert torch.equal(valid, ref["valid"])
        torch.testing.assert_close(logits, ref["logits"], atol=2e-5, rtol=2e-5)
        for name, g in ref["grads"].items():
            total = sum(r[kind]["grads"][name] for r in ranks)
            torch.testing.assert_close(total, g, atol=5e-5, rtol=5e-4, msg=f"{kind} {name}")


def test_new_path_matches_the_old_at_cp1_and_cp2(tiny_model_path, one_thread):
    # the current path: no main queries (q=None) and kernel tiles instead of all-zero main queries, dense
    # buckets at CP = 1 and full-tensor losses: the same chains and gradients, at CP = 1 and CP = 2
    import _cp_draft

    new = _cp_draft.run_world(_cp_draft.rank_fn, 2, str(tiny_model_path))
    old = _cp_draft.run_world(_cp_draft.rank_fn_old, 2, str(tiny_model_path))
    for kind in _cp_draft.SETTINGS:
        pairs = [(_cp_draft.run_family(kind, str(tiny_model_path), 0, 1),
                  _cp_draft.run_family(kind, str(tiny_model_path), 0, 1, old=True))]
        pairs += [(n[kind], o[kind]) for n, o in zip(new, old)]
        for a, b in pairs:
            assert torch.equal(a["bonus"], b["bonus"]) and torch.equal(a["valid"], b["valid"]), kind
            torch.testing.assert_close(a["logits"], b["logits"], atol=2e-5, rtol=2e-5)
            for name, g in b["grads"].items():
                torch.testing.assert_close(a["grads"][name], g, atol=5e-5, rtol=5e-4, msg=f"{kind} {name}")
            assert any(float(g.abs().sum()) > 0 for g in b["grads"].values()), kind


@pytest.mark.parametrize("owner", [0, 1])
def test_cp2_rank_without_blocks_matches_cp1(tiny_model_path, one_thread, owner):
    # Block drafters run branch attention without main queries; a rank that owns no block still
    # joins the ring (its trunk keys are seen by the other rank's blocks) and gets their gradients.
    import _cp_draft

    ranks = _cp_draft.run_world(_cp_draft.rank_fn_blocks_on_one_rank, 2, str(tiny_model_path), owner)
    for kind in ("dflash", "dspark"):
        ref = _cp_draft.run_family(kind, str(tiny_model_path), 0, 1, blocks_on_rank=owner)
        assert ranks[1 - owner][kind]["bonus"].numel() == 0 and ranks[owner][kind]["bonus"].numel() > 0, kind
        assert torch.equal(ranks[owner][kind]["bonus"], ref["bonus"]), kind
        torch.testing.assert_close(ranks[owner][kind]["logits"], ref["logits"], atol=2e-5, rtol=2e-5)
        for name, g in ref["grads"].items():
            total = ranks[0][kind]["grads"][name] + ranks[1][kind]["grads"][name]
            torch.testing.assert_close(total, g, atol=5e-5, rtol=5e-4, msg=f"{kind} {name}")
        # the rank without blocks still contributes: the context K/V projections it holds get gradients
        idle = ranks[1 - owner][kind]["grads"]
        assert any(float(g.abs().sum()) > 0 for n, g in idle.items() if "k_proj" in n or "v_proj" in n), kind
