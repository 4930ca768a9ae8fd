"""Export to vLLM's drafter formats: names, shapes, config keys, round trips; DSpark through vLLM's class."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cotrain.draft.common import DraftBatch
from cotrain.draft.export import export_drafter, load_drafter, read_export, speculative_config
from cotrain.draft.registry import build_drafter

H, I, Q, KV, D, V = 128, 384, 128, 64, 32, 128  # tiny target: hidden, mlp, q rows, k/v rows, head dim, vocab

LAYER_QWEN = {"self_attn.q_proj.weight": (Q, H), "self_attn.k_proj.weight": (KV, H), "self_attn.v_proj.weight": (KV, H),
              "self_attn.o_proj.weight": (H, Q), "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,),
              "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
              "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}


def expected_names(kind, rank=16):
    if kind == "eagle3":  # vLLM's Eagle3LlamaForCausalLM: midlayer (2H-wide q/k/v input), own lm_head
        layer = {k: v for k, v in LAYER_QWEN.items() if "_norm" not in k or "layernorm" in k}
        layer = {k: ((v[0], 2 * H) if k.split(".")[1] in ("q_proj", "k_proj", "v_proj") else v) for k, v in layer.items()}
        layer["hidden_norm.weight"] = (H,)
        out = {f"midlayer.{k}": v for k, v in layer.items()}
        out.update({"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (V, H)})
        return out
    out = {f"layers.0.{k}": v for k, v in LAYER_QWEN.items()}
    out.update({"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)})
    if kind == "dspark":
        out.update({"markov_head.markov_w1.weight": (V, rank), "markov_head.markov_w2.weight": (V, rank),
                    "confidence_head.proj.weight": (1, H), "confidence_head.proj.bias": (1,)})
    return out


SETTINGS = {"eagle3": {"ttt_steps": 3}, "dflash": {"block_size": 5},
            "dspark": {"block_size": 4, "markov_rank": 16, "confidence_head": True}}


def tiny_batch(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 100, (18,), generator=g)
    taps = torch.randn(18, d.num_taps * H, generator=g)
    return DraftBatch(ids, [0, 10, 18], taps, None, None, torch.tensor([3, 3]))


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
def test_names_shapes_and_round_trip(target, tmp_path, kind):
    d = build_drafter(kind, SETTINGS[kind], target, seed=1)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # every tensor distinct from its initial value
    state = d.vllm_state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_names(kind)
    # one to one: every trainable parameter is exported exactly once, nothing of the target is
    assert sum(v.numel() for v in state.values()) == sum(p.numel() for p in d.parameters())
    assert not any("embed_tokens" in n for n in state)
    assert ("lm_head.weight" in state) == (kind == "eagle3")  # DFlash/DSpark use the target's head

    out = export_drafter(d, tmp_path / kind)
    config, meta, saved = read_export(out)
    assert set(saved) == set(state) and all(torch.equal(saved[k], state[k]) for k in state)
    back = load_drafter(out, target)
    assert type(back) is type(d) and back.cfg == d.cfg
    b = tiny_batch(d)
    lay = d.build_layout(b, torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(b, lay).logits, d.eval()(b, lay).logits, atol=0, rtol=0)
    other = build_drafter(kind, SETTINGS[kind], target, seed=2)
    with torch.no_grad():
        assert not torch.allclose(other.eval()(b, lay).logits, d(b, lay).logits)
    other.load_vllm_state_dict(saved)
    with torch.no_grad():
        torch.testing.assert_close(other(b, lay).logits, d(b, lay).logits, atol=0, rtol=0)
    with pytest.raises(KeyError, match="missing"):
        other.load_vllm_state_dict({k: v for k, v in saved.items() if k != "fc.weight"})
    with pytest.raises(ValueError, match="shape"):
        other.load_vllm_state_dict({**saved, "norm.weight": torch.zeros(3)})


def test_config_json_conventions(target, tmp_path):
    # tiny target, 4 layers: cotrain taps are layer outputs; vLLM ids are "residual entering layer"
    e3 = export_drafter(build_drafter("eagle3", {"tap_layers": [0, 1, 3], "ttt_steps": 3}, target), tmp_path / "e")
    c = json.loads((e3 / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
    assert c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]  # used as given by vLLM: taps + 1
    assert (c["num_aux_hidden_states"], c["target_hidden_size"], c["draft_vocab_size"]) == (3, H, V)
    assert c["num_hidden_layers"] == 1 and c["head_dim"] == D and c["num_key_value_heads"] == 2

    df = export_drafter(build_drafter("dflash", {"tap_layers": [1, 2], "block_size": 6}, target), tmp_path / "d")
    c = json.loads((df / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["dflash_config"]["target_layer_ids"] == [1, 2]  # "output of layer i": vLLM adds 1 itself
    assert c["dflash_config"]["mask_token_id"] == target.mask_token_id == 3
    assert c["dflash_config"]["causal"] is False and c["layer_types"] == ["full_attention"]
    assert speculative_config(df) == {"method": "dflash", "model": str(df), "num_speculative_tokens": 5}

    ds = export_drafter(build_drafter("dspark", {"block_size": 7, "markov_rank": 8}, target), tmp_path / "s")
    c = json.loads((ds / "config.json").read_text())
    assert c["architectures"] == ["Qwen3DSparkModel"] and c["model_type"] == "qwen3"
    assert (c["dspark_block_size"], c["dspark_noise_token_id"], c["markov_rank"], c["markov_head_type"]) == (7, 3, 8,
                                                                                                          "vanilla")
    assert c["sample_from_anchor"] is True and c["enable_confidence_head"] is False
    assert speculative_config(ds)["num_speculative_tokens"] == 7  # anchor-as-first: block = drafts

    two = build_drafter("eagle3", {"num_layers": 2}, target)
    names = two.vllm_state_dict()
    assert "layers.0.self_attn.q_proj.weight" in names and names["layers.1.self_attn.q_proj.weight"].shape == (Q, H)


def _by_hand(d, kind):
    """{vLLM name: the module parameter it must hold}, written out per family from vLLM's classes
    (Eagle3LlamaForCausalLM's midlayer, DFlash/DSpark's qwen3 layers), not from the drafter's name map."""
    L = d.layers[0]
    attn = {f"self_attn.{p}_proj.weight": getattr(L.self_attn, f"{p}_proj").weight for p in ("q", "k", "v", "o")}
    mlp = {f"mlp.{p}_proj.weight": getattr(L.mlp, f"{p}_proj").weight for p in ("gate", "up", "down")}
    norms = {"input_layernorm.weight": L.input_layernorm.weight,
             "post_attention_layernorm.weight": L.post_attention_layernorm.weight}
    if kind == "eagle3":
        layer = {**attn, **mlp, **norms, "hidden_norm.weight": L.hidden_norm.weight}
        return {**{f"midlayer.{k}": v for k, v in layer.items()},
                "fc.weight": d.fc.weight, "norm.weight": d.norm.weight, "lm_head.weight": d.lm_head.weight}
    layer = {**attn, **mlp, **norms, "self_attn.q_norm.weight": L.self_attn.q_norm.weight,
             "self_attn.k_norm.weight": L.self_attn.k_norm.weight}
    out = {**{f"layers.0.{k}": v for k, v in layer.items()},
           "fc.weight": d.fc.weight, "hidden_norm.weight": d.hidden_norm.weight, "norm.weight": d.norm.weight}
    if kind == "dspark":
        out.update({"markov_head.markov_w1.weight": d.markov_head.markov_w1.weight,
                    "markov_head.markov_w2.weight": d.markov_head.markov_w2.weight,
                    "confidence_head.proj.weight": d.confidence_head.proj.weight,
                    "confidence_head.proj.bias": d.confidence_head.proj.bias})
    return out


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
def test_each_exported_tensor_is_the_parameter_it_names(target, tmp_path, kind):
    """Independent of the drafter's name map (a round trip through one map hides two names swapped
    in it): each tensor in the export equals the module parameter vLLM's class puts it in, and a
    checkpoint written by hand in vLLM's names loads into those very parameters."""
    d = build_drafter(kind, SETTINGS[kind], target, seed=1)
    with torch.no_grad():
        for i, p in enumerate(d.parameters()):
            p.copy_(torch.randn_like(p) + i)  # every parameter distinct (the norms are no longer ~1)
    want = _by_hand(d, kind)
    _, _, saved = read_export(export_drafter(d, tmp_path / kind))
    assert set(saved) == set(want)
    for name, param in want.items():
        assert torch.equal(saved[name], param.detach().float()), name
    fresh = build_drafter(kind, SETTINGS[kind], target, seed=2)
    fresh.load_vllm_state_dict({k: v.detach().clone() for k, v in want.items()})
    mine = _by_hand(fresh, kind)
    for name, param in want.items():
        assert torch.equal(mine[name].detach(), param.detach()), name


# ----- vLLM's own classes (slow: one subprocess per family, shared by the tests below) --------------------
VLLM_SETTINGS = {"eagle3": {"ttt_steps": 3}, "dflash": {"block_size": 5},
                 "dspark": {"block_size": 4, "markov_rank": 8, "confidence_head": True}}
LENS = [14, 11]  # two sequences, response from position 3


def _perturbed(kind, target, seed):
    """A drafter whose every tensor is moved off its initial value and whose norms are spread over
    [0.5, 1.5] (near 1 two swapped norms would barely change the logits)."""
    d = build_drafter(kind, VLLM_SETTINGS[kind], target, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return d


@pytest.fixture(scope="module")
def vllm_run(target, tiny_model_path, tmp_path_factory):
    """kind -> {our drafter, our DraftOutput, the chains compared, batch, layout, vLLM's result}: our
    export loaded into vLLM's class for the family and run there (tests/draft/_vllm_drafter.py), once
    per family."""
    cache = {}

    def run(kind):
        if kind in cache:
            return cache[kind]
        tmp = tmp_path_factory.mktemp(f"vllm_{kind}")
        d = _perturbed(kind, target, seed=5)
        out = export_drafter(d, tmp / kind)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(4, 100, (sum(LENS),), generator=g)
        taps = torch.randn(sum(LENS), d.num_taps * H, generator=g)
        cu = [0, LENS[0], sum(LENS)]
        b = DraftBatch(ids, cu, taps, None, None, torch.tensor([3, 3]))
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if kind == "eagle3":
                lay = d.build_layout(b)
                with torch.no_grad():
                    ours = d.eval()(b, lay)
                # every chain whose k teacher-forced drafts all exist: anchor p with p + k < its sequence's end
                k = d.num_passes
                end = torch.tensor([cu[1]] * LENS[0] + [cu[2]] * LENS[1])
                keep = (ours.bonus_pos - 1 + k < end[ours.bonus_pos - 1]).nonzero().squeeze(1)
                anchors = [[int(p) - cu[s] for p in ours.bonus_pos[keep] - 1 if cu[s] <= p < cu[s + 1]]
                           for s in range(2)]
                data = {"k": k}
            else:
                anchors = [[6, 9], [4]]  # sequence-local: DFlash B=5 runs to 13 < 14, DSpark B=4
                lay = d.build_layout(b, anchors=torch.tensor([a + cu[s] for s in range(2) for a in anchors[s]]))
                with torch.no_grad():
                    ours = d.eval()(b, lay)
                keep = torch.arange(ours.logits.shape[0])
                data = {"block_size": d.block_size}
        finally:
            torch.set_num_threads(old)
        assert sum(map(len, anchors)) == keep.numel() >= 3
        torch.save({**data, "ids": [ids[cu[s]:cu[s + 1]] for s in range(2)],
                    "taps": [taps[cu[s]:cu[s + 1]] for s in range(2)], "anchors": anchors}, tmp / "in.pt")
        helper = Path(__file__).with_name("_vllm_drafter.py")
        res = subprocess.run([sys.executable, str(helper), kind, str(out), str(tiny_model_path), str(tmp / "in.pt"),
                              str(tmp / "out.pt")], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        cache[kind] = {"drafter": d, "ours": ours, "keep": keep, "batch": b, "layout": lay,
                       "theirs": torch.load(tmp / "out.pt")}
        return cache[kind]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
def test_vllms_own_class_reproduces_our_logits(vllm_run, target, kind):
    """Our export, loaded into vLLM's own model class (Eagle3LlamaForCausalLM, DFlashQwen3ForCausalLM,
    Qwen3DSparkForCausalLM) and run through its modules as its proposer drafts (EAGLE-3: a context
    forward, then one forward per draft on the previous pre-norm state; DFlash/DSpark: the fused
    context K/V, then the block), gives our drafter's logits: every tensor sits where vLLM reads it
    and our forward is the one vLLM serves. (vLLM serves DSpark only on GPU; on CPU its class still
    runs.) Two norms swapped in a name map, a transposed fc, or a forward that drifts from vLLM's
    (attention input order, RoPE positions, context norm) all move these logits."""
    r = vllm_run(kind)
    d, ours, keep, theirs = r["drafter"], r["ours"], r["keep"], r["theirs"]
    mine = ours.logits[keep]
    assert theirs["logits"].shape == mine.shape
    torch.testing.assert_close(theirs["logits"], mine, atol=2e-4, rtol=1e-4)
    # a tolerance that excludes wrong answers: another drafter of the family is far outside it
    with torch.no_grad():
        other = _perturbed(kind, target, seed=6).eval()(r["batch"], r["layout"]).logits[keep]
    assert (theirs["logits"] - other).abs().max() > 100 * 2e-4
    cfg = theirs["config"]
    if kind == "eagle3":
        assert cfg == {"aux_layer_ids": [t + 1 for t in d.tap_layers], "draft_vocab_size": V}
    else:
        assert cfg["layer_ids"] == d.tap_layers and cfg["causal"] == [False]
    if kind == "dspark":
        assert (cfg["markov_rank"], cfg["block"]) == (8, 4)
        torch.testing.assert_close(theirs["confidence"], torch.sigmoid(ours.confidence[keep]), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_export_loads_into_vllms_own_class_by_role(vllm_run, kind):
    """vLLM's own model class (Eagle3LlamaForCausalLM / DFlashQwen3ForCausalLM) loads our export
    with its load_weights, as when it serves the drafter; each of its parameters, by role, is ours
    (q/k/v and gate/up stacked as vLLM stacks them). A norm put under another norm's name lands in
    the wrong module here, which greedy serving tests do not see."""
    r = vllm_run(kind)
    d, theirs = r["drafter"], r["theirs"]["params"]
    L = d.layers[0]
    at, mlp = L.self_attn, L.mlp
    want = {"model.layers.0.self_attn.qkv_proj.weight": torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]),
            "model.layers.0.self_attn.o_proj.weight": at.o_proj.weight,
            "model.layers.0.mlp.gate_up_proj.weight": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            "model.layers.0.mlp.down_proj.weight": mlp.down_proj.weight,
            "model.layers.0.input_layernorm.weight": L.input_layernorm.weight,
            "model.layers.0.post_attention_layernorm.weight": L.post_attention_layernorm.weight,
            "model.fc.weight": d.fc.weight, "model.norm.weight": d.norm.weight}
    if kind == "eagle3":
        want.update({"model.layers.0.hidden_norm.weight": L.hidden_norm.weight, "lm_head.weight": d.lm_head.weight})
    else:
        want.update({"model.hidden_norm.weight": d.hidden_norm.weight,
                     "model.layers.0.self_attn.q_norm.weight": at.q_norm.weight,
                     "model.layers.0.self_attn.k_norm.weight": at.k_norm.weight})
    for name, w in want.items():
        assert torch.equal(theirs[name], w.detach().float()), name
