"""Megatron on CPU: the policy as a GPTModel matches Hugging Face, and PP=2 matches PP=1."""

import pytest
import torch

from cotrain.distributed import spawn_local

from _megatron_workers import make_batch, pp_train_step

MICRO = make_batch(num_micro=3, micro_batch=4, seq_len=12)


@pytest.fixture(scope="module")
def runs(tiny_model_path):
    pp1 = spawn_local(pp_train_step, 1, str(tiny_model_path), 1, MICRO)
    pp2 = spawn_local(pp_train_step, 2, str(tiny_model_path), 2, MICRO)
    return pp1, pp2


def test_megatron_logits_match_hf(runs, tiny_model_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()
    ids = MICRO[0][0]
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    got = runs[0][0]["logits"]
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_pp2_losses_and_grad_norm_match_pp1(runs):
    (pp1,), pp2 = runs
    last = pp2[-1]
    assert pp2[0]["losses"] is None and last["losses"] is not None
    assert len(last["losses"]) == len(MICRO)
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(pp1["losses"]), atol=1e-6, rtol=1e-6)
    for r in pp2:
        assert r["grad_norm"] == pytest.approx(pp1["grad_norm"], rel=1e-6)
    assert pp1["grad_norm"] > 0


def test_pp2_gradients_match_pp1_per_parameter(runs):
    (pp1,), pp2 = runs
    merged = {}
    for r in pp2:
        assert not (set(merged) & set(r["grads"])), "a parameter lives on two stages"
        merged.update(r["grads"])
    assert set(merged) == set(pp1["grads"])
    for name, g in pp1["grads"].items():
        torch.testing.assert_close(merged[name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_tied_llama_logits_match_hf(tmp_path):
    """Llama with tied embeddings (no q/k norms): conversion and the Megatron model agree with HF."""
    from test_convert import random_hf

    from _megatron_workers import megatron_logits

    model, _, _ = random_hf("llama", tied=True)
    model.save_pretrained(str(tmp_path))
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    (got,) = spawn_local(megatron_logits, 1, str(tmp_path), ids)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
