"""Drafter families: config validation, registry, branch layouts, and what each draft may see."""

import contextlib

import pytest
import torch
from pydantic import ValidationError

from cotrain.config.schema import DFlashConfig, DSparkConfig, Eagle3Config
from cotrain.draft.common import BranchAttention, DraftBatch
from cotrain.draft.registry import DraftConfigError, Drafter, build_drafter, drafter_kinds, get_drafter_class
from cotrain.parallel import dense_branch_attention

SETTINGS = {"eagle3": {"ttt_steps": 3}, "dflash": {"block_size": 4, "anchors_per_seq": 2},
            "dspark": {"block_size": 4, "anchors_per_seq": 2, "confidence_head": True}}


def batch_for(drafter, lens=(9, 7, 11), prompt=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    ids = torch.randint(4, 100, (T,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.tensor(lens), 0)])
    pos = torch.cat([torch.arange(n) for n in lens])
    taps = torch.randn(T, drafter.num_taps * drafter.target_arch.hidden_size, generator=g)
    return DraftBatch(ids, cu, taps, pos >= prompt, torch.randn(T, drafter.target_arch.vocab_size, generator=g),
                      torch.full((len(lens),), prompt))


@pytest.fixture(scope="module")
def drafters(target):
    return {k: build_drafter(k, s, target, seed=1).eval() for k, s in SETTINGS.items()}


# ----------------------------------------------------------------------------------- config
def test_registry_and_kinds(target):
    assert set(drafter_kinds()) >= {"eagle3", "dflash", "dspark"}
    for kind, method, arch in [("eagle3", "eagle3", "LlamaForCausalLMEagle3"), ("dflash", "dflash", "DFlashDraftModel"),
                               ("dspark", "dspark", "Qwen3DSparkModel")]:
        cls = get_drafter_class(kind)
        assert issubclass(cls, Drafter) and cls.vllm_method == method and cls.vllm_architecture == arch
    with pytest.raises(KeyError, match="registered: eagle3, dflash, dspark"):
        get_drafter_class("medusa")
    with pytest.raises(TypeError, match="Eagle3Config"):
        build_drafter("eagle3", DFlashConfig(), target)


@pytest.mark.parametrize("kind,settings,path,words", [
    ("eagle3", {"tap_layers": [0, 4]}, "tap_layers[1]", "not a layer of the target"),
    ("dflash", {"tap_layers": [2, 2]}, "tap_layers", "duplicates"),
    ("dspark", {"tap_layers": []}, "tap_layers", "at least one layer"),
    ("eagle3", {"draft_vocab_size": 129}, "draft_vocab_size", "exceeds the target's vocabulary of 128"),
])
def test_settings_checked_against_the_target(target, kind, settings, path, words):
    with pytest.raises(DraftConfigError) as e:
        build_drafter(kind, settings, target)
    assert any(p == path and words in msg for p, msg in e.value.issues), e.value.issues
    assert f"draft.{kind}.{path}" in str(e.value)


@pytest.mark.parametrize("cls,field,value", [
    (DFlashConfig, "block_size", 1), (DSparkConfig, "block_size", 0), (Eagle3Config, "ttt_steps", 0),
    (DFlashConfig, "anchors_per_seq", 0), (DSparkConfig, "markov_rank", 0), (DSparkConfig, "markov_head", "deep"),
])
def test_settings_ranges(cls, field, value):
    with pytest.raises(ValidationError, match=field):
        cls.model_validate({field: value})


def test_default_taps_and_vllm_ids(drafters):
    # tiny target: 4 layers. cotrain ids name a layer's output; vLLM's the residual entering it
    assert drafters["eagle3"].tap_layers == [0, 2, 3] and drafters["eagle3"].vllm_tap_ids == [1, 3, 4]
    assert drafters["dflash"].tap_layers == [0, 3] and drafters["dflash"].vllm_tap_ids == [1, 4]
    assert drafters["eagle3"].draft_width == 3
    assert drafters["dflash"].draft_width == 3  # block 4 = anchor + 3 masks
    assert drafters["dspark"].draft_width == 4  # every block position predicts the next token


def test_gated_markov_head_trains_but_does_not_export(target):
    d = build_drafter("dspark", {"block_size": 3, "markov_head": "gated"}, target)
    b = batch_for(d)
    out = d(b, d.build_layout(b, torch.Generator().manual_seed(0)))
    out.logits.sum().backward()
    assert d.markov_head.gate.weight.grad is not None
    with pytest.raises(NotImplementedError, match="vanilla"):
        d.vllm_config()


# ----------------------------------------------------------------------------------- layouts
def test_layouts(drafters):
    e3 = drafters["eagle3"]
    b = batch_for(e3)
    lay = e3.build_layout(b)
    assert (lay.context, lay.intra) == ("inclusive", "causal")
    assert set(lay.branch_lens.tolist()) == {2}  # k - 1 unrolled passes per anchor
    # anchors: every position whose first draft (token p + 2) is a supervised response token
    pos = b.positions[lay.anchors]
    assert bool((pos + 2 >= 3).all()) and bool((lay.anchors + 2 < b.seq_end()[lay.anchors]).all())
    assert lay.num_branches == sum(n - 3 for n in (9, 7, 11))  # p = 1 .. n-3

    for kind in ("dflash", "dspark"):
        d = drafters[kind]
        lay = d.build_layout(b, torch.Generator().manual_seed(0))
        assert (lay.context, lay.intra) == ("exclusive", "full")
        assert set(lay.branch_lens.tolist()) == {4}
        seqs = lay.branch_seqs
        assert all(int((seqs == s).sum()) == 2 for s in range(3))  # anchors_per_seq
        apos = b.positions[lay.anchors]
        assert bool((apos >= 3).all())  # anchors are bonus tokens: inside the response
        full = d.build_layout(b, all_anchors=True)
        assert full.num_branches == sum(n - 1 - 3 for n in (9, 7, 11))


def test_branch_attention_with_main_queries_equals_the_dense_oracle(drafters):
    """CP = 1 with main and branch queries (EAGLE-3's layout, 4 sequences): BranchAttention trains
    through the kernel tiles, not the dense mask, and gives the oracle's outputs and all six
    gradients; the old bucketed dense path (reference.draft_path, the bench's "before" arm)
    gives them too."""
    from reference import draft_path
    from cotrain.parallel import CPStats, dense_branch_attention as oracle

    d = drafters["eagle3"]
    b = batch_for(d, lens=(30, 5, 17, 40))
    lay = d.build_layout(b)
    g = torch.Generator().manual_seed(3)
    T, NB = lay.total_len, lay.total_branch_tokens
    base = [torch.randn(n, h, 32, generator=g) for n, h in [(T, 4), (T, 2), (T, 2), (NB, 4), (NB, 2), (NB, 2)]]
    w, bw = torch.randn(T, 4, 32, generator=g), torch.randn(NB, 4, 32, generator=g)

    def run(fn):
        x = [t.clone().requires_grad_() for t in base]
        out, bout = fn(*x)
        ((out * w).sum() + (bout * bw).sum()).backward()
        return [out, bout] + [t.grad for t in x]

    ref = run(lambda *x: oracle(*x, lay)[::2])
    import cotrain.parallel.dense as dense

    calls = []
    mask = dense.branch_attention_mask
    try:  # every use of the dense oracle builds its mask: count them
        dense.branch_attention_mask = lambda *a: calls.append(1) or mask(*a)
        got = run(BranchAttention(lay))
        assert calls == []  # the training path never builds the dense mask
        old = run(lambda *x: draft_path.dense_bucket_attention(*x, lay, bucket_tokens=64))
    finally:
        dense.branch_attention_mask = mask
    assert len(calls) > 2  # the old path: one dense call per bucket
    for name, a, o, r in zip(("out", "bout", "dq", "dk", "dv", "dbq", "dbk", "dbv"), got, old, ref):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5, msg=name)
    stats = CPStats()
    from cotrain.parallel import local_branch_attention

    local_branch_attention(*base, lay, stats=stats)
    # kernel tiles: about the allowed pairs (masked tiles where one more tile costs more than the
    # pairs it saves), not the (T + NB)^2 of one mask (63,504 here)
    assert stats.pairs_computed < 2 * stats.pairs_allowed < 0.2 * (T + NB) ** 2


def test_branch_attention_without_main_queries_equals_dense_branch_rows(drafters):
    # q=None (block drafters, EAGLE-3's passes 1..k-1): the dense oracle's branch outputs, and the
    # gradients that flow from them (loss on the branch outputs only), with no main query computed.
    for kind in ("eagle3", "dflash"):
        d = drafters[kind]
        b = batch_for(d, lens=(30, 5, 17, 40))
        lay = d.build_layout(b, torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(4)
        T, NB = lay.total_len, lay.total_branch_tokens
        base = [torch.randn(n, h, 32, generator=g) for n, h in [(T, 4), (T, 2), (T, 2), (NB, 4), (NB, 2), (NB, 2)]]
        w = torch.randn(NB, 4, 32, generator=g)
        ref_in = [t.clone().requires_grad_() for t in base]
        _, _, bref, _ = dense_branch_attention(*ref_in, lay)
        (bref * w).sum().backward()
        got_in = [t.clone().requires_grad_() for t in base[1:]]
        out, bout = BranchAttention(lay)(None, *got_in)
        assert out is None
        (bout * w).sum().backward()
        torch.testing.assert_close(bout, bref, atol=1e-5, rtol=1e-5)
        for name, a, r in zip(("k", "v", "bq", "bk", "bv"), got_in, ref_in[1:]):
            torch.testing.assert_close(a.grad, r.grad, atol=1e-5, rtol=1e-5, msg=f"{kind} d{name}")


@pytest.mark.parametrize("passes", [2, 4])
def test_eagle3_live_slot_passes_equal_the_old_slot_layout(target, passes):
    """EAGLE-3's passes 1..k-1 through the live slot and the LSE merge with the earlier pass keys give
    the chains and gradients of the old path (every TTT slot queried through the dense oracle, zero
    queries for the others; reference.draft_path), at k = 2 (no earlier keys) and k = 4."""
    from reference import draft_path

    d = build_drafter("eagle3", {"ttt_steps": passes}, target, seed=1)
    b = batch_for(d, lens=(30, 5, 17, 40))
    lay = d.build_layout(b)

    def run(old):
        d.zero_grad(set_to_none=True)
        with draft_path.dense_attention() if old else contextlib.nullcontext():
            out = d(b, lay)
        (out.logits * torch.linspace(-1, 1, out.logits.shape[-1])).sum().backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}

    (new, gnew), (old, gold) = run(False), run(True)
    torch.testing.assert_close(new, old, atol=2e-5, rtol=2e-5)
    assert gnew.keys() == gold.keys()
    for name, g in gold.items():
        torch.testing.assert_close(gnew[name], g, atol=5e-5, rtol=5e-4, msg=name)
    assert float((new[:, -1] - new[:, 0]).abs().max()) > 1e-3  # the passes differ: a wrong merge would show


def test_drafters_compute_main_queries_only_where_they_are_used(drafters, monkeypatch):
    # DFlash/DSpark: no decoder layer on the context, so no main queries in any layer. EAGLE-3: main
    # queries on pass 0 (over the trunk alone, no branch queries), branch queries only on passes 1..k-1,
    # one per anchor (the live slot; the earlier slots' keys are merged in by LSE).
    calls = []
    call = BranchAttention.__call__

    def spy(self, q, k, v, bq, bk, bv, **kw):
        calls.append((q is not None, bq is not None, self.layout.num_branches > 0,
                      None if bq is None else bq.shape[0] == self.layout.total_branch_tokens == self.layout.num_branches))
        return call(self, q, k, v, bq, bk, bv, **kw)

    monkeypatch.setattr(BranchAttention, "__call__", spy)
    for kind, d in drafters.items():
        b = batch_for(d)
        lay = d.build_layout(b, torch.Generator().manual_seed(0))
        calls.clear()
        with torch.no_grad():
            d(b, lay)
        n = len(d.layers)
        if kind == "eagle3":  # passes 1..k-1: one query per anchor (the live slot), not k - 1
            assert calls == [(True, False, False, None)] * n + [(False, True, True, True)] * (d.num_passes - 1) * n
        else:
            assert calls == [(False, True, True, False)] * n, kind


# -------------------------------------------------------------------------- what drafts see
def _changed(d, b, lay, edit):
    """Per chain and draft: did the logits change after ``edit(batch)``?"""
    with torch.no_grad():
        before = d(b, lay).logits
        b2 = DraftBatch(b.input_ids.clone(), b.cu_seqlens, b.taps.clone(), b.loss_mask, b.target_logits,
                        b.response_start)
        edit(b2)
        after = d(b2, lay).logits
    return (before - after).abs().amax(-1) > 1e-5


def test_eagle3_ttt_causality(drafters):
    d = drafters["eagle3"]
    b = batch_for(d, lens=(12,))
    lay = d.build_layout(b)
    anchors = lay.anchors.tolist()
    p = 6
    n = anchors.index(p)

    def taps_at(t):
        return lambda x: x.taps[t].add_(1.0)

    def token_at(t):
        return lambda x: x.input_ids.__setitem__(t, 50 if int(x.input_ids[t]) != 50 else 51)

    # pass t at anchor p reads tokens x_{p+1..p+1+t} and taps up to p
    ch = _changed(d, b, lay, taps_at(p + 1))
    assert not ch[n].any() and ch[anchors.index(p + 1)].all()
    assert _changed(d, b, lay, taps_at(p))[n].all()
    assert _changed(d, b, lay, taps_at(0))[n].all()  # the trunk up to p
    ch = _changed(d, b, lay, token_at(p + 2))  # first read by pass 1
    assert ch[n].tolist() == [False, True, True]
    ch = _changed(d, b, lay, token_at(p + 3))  # first read by pass 2
    assert ch[n].tolist() == [False, False, True]
    assert not _changed(d, b, lay, token_at(p + 4))[n].any()


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_drafter_sees_only_context_before_the_anchor(drafters, kind):
    d = drafters[kind]
    b = batch_for(d, lens=(14,))
    a = 7
    lay = d.build_layout(b, anchors=torch.tensor([a]))
    # context strictly before the anchor: taps at a and later are invisible, earlier ones are not
    assert not _changed(d, b, lay, lambda x: x.taps[a:].add_(1.0)).any()
    assert _changed(d, b, lay, lambda x: x.taps[a - 1].add_(1.0)).all()
    assert _changed(d, b, lay, lambda x: x.taps[0].add_(1.0)).all()
    # the anchor (bonus) token is the block's first token
    assert _changed(d, b, lay, lambda x: x.input_ids.__setitem__(a, 60)).all()
    # later data tokens: invisible to DFlash; for DSpark only the Markov head of the next position reads
    # x_{a+i} (its previous token under teacher forcing)
    ch = _changed(d, b, lay, lambda x: x.input_ids.__setitem__(a + 2, 61))
    if kind == "dflash":
        assert not ch.any()
    else:
        with torch.no_grad():
            d.markov_head.markov_w2.weight.normal_()  # a non-trivial Markov head (it starts at zero)
        ch = _changed(d, b, lay, lambda x: x.input_ids.__setitem__(a + 2, 61))
        assert ch[0].tolist() == [False, False, True, False]
        with torch.no_grad():
            d.markov_head.markov_w2.weight.zero_()


def test_chains_and_targets(drafters):
    for kind, d in drafters.items():
        b = batch_for(d)
        lay = d.build_layout(b, torch.Generator().manual_seed(0))
        out = d(b, lay)
        assert out.logits.shape == (out.num_chains, d.draft_width, d.target_arch.vocab_size)
        # draft j after the bonus at b predicts token b + 1 + j: supervised by target row b + j
        j = torch.arange(d.draft_width)
        ok = out.valid
        assert bool((out.target_rows[ok] == (out.bonus_pos[:, None] + j)[ok]).all())
        assert bool((out.target_rows[~ok] == -1).all())
        assert bool(b.loss_mask[out.target_rows[ok] + 1].all())
        if kind == "dspark":
            assert out.confidence.shape == out.valid.shape
        if kind != "eagle3":
            assert out.loss_weight[0] == 1.0 and bool((out.loss_weight[1:] < out.loss_weight[:-1]).all())
