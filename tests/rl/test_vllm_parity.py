"""The tiny checkpoint gives the same logits and greedy outputs in vLLM as in Hugging Face (fp32)."""

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = ["457+86=", "12+3=", "999+1=", "5+40="]


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    from cotrain.rl.vllm.engine import make_llm

    # raw_logits: vLLM returns the model's logits (before any processing) instead of log-probs
    engine = make_llm(str(tiny_model_path), max_logprobs=128, logprobs_mode="raw_logits")
    yield engine
    del engine


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(str(tiny_model_path)))


def test_prompt_logits_match_hf(llm, hf):
    from vllm import SamplingParams

    model, tok = hf
    V = model.config.vocab_size
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=V))
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert list(out.prompt_token_ids) == ids
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids])).logits[0]
        # prompt_logprobs[t] scores token t given tokens < t, i.e. HF's logits at position t-1
        for t in range(1, len(ids)):
            row = out.prompt_logprobs[t]
            got = torch.full((V,), float("nan"))
            for token_id, lp in row.items():
                got[token_id] = lp.logprob
            assert not torch.isnan(got).any(), "vLLM did not return the full distribution"
            torch.testing.assert_close(got, ref[t - 1], atol=1e-4, rtol=1e-4)


def test_greedy_outputs_match_hf(llm, hf):
    from vllm import SamplingParams

    from cotrain.models.build_tiny import greedy_answers

    model, tok = hf
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
    assert [o.outputs[0].text for o in outs] == greedy_answers(model, tok, PROMPTS, max_new_tokens=8)
