"""The built-in task, tokenizer, data sources and the tiny warm-started policy."""

import json
import random

import pytest
import torch

from cotrain.models.tokenizer import build_tokenizer
from cotrain.tasks.data import Problem, PromptStream, arithmetic_dataset, arithmetic_problem, load_jsonl
from cotrain.tasks.rewards import exact_match_reward


def test_tokenizer_is_char_level_and_round_trips():
    tok = build_tokenizer()
    text = "457+86= 543 Hello, world!"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.eos_token_id == 1 and tok.pad_token_id == 0
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    assert max(tok.get_vocab().values()) < 128


def test_tokenizer_loads_back_from_disk(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer().save_pretrained(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.decode(tok.encode("12+34=")) == "12+34="


def test_arithmetic_problems_are_correct_and_seeded():
    probs = arithmetic_dataset(200, seed=3, max_digits=3, ops=("+", "-", "*"))
    for p in probs:
        lhs = p.prompt.rstrip("=")
        assert str(eval(lhs)) == p.answer  # the prompt is a valid expression; eval is the oracle
    assert probs == arithmetic_dataset(200, seed=3, max_digits=3, ops=("+", "-", "*"))
    assert probs != arithmetic_dataset(200, seed=4, max_digits=3, ops=("+", "-", "*"))
    with pytest.raises(ValueError, match="allowed"):
        arithmetic_problem(random.Random(0), ops=("/",))


def test_reward_is_exact_match_on_first_line():
    assert exact_match_reward("543", "543") == 1.0
    assert exact_match_reward(" 543\nmore text", "543") == 1.0
    assert exact_match_reward("5430", "543") == 0.0
    assert exact_match_reward("", "543") == 0.0
    assert exact_match_reward("543", "543", correct=2.0) == 2.0


def test_jsonl_loader_and_its_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n\n" + json.dumps({"prompt": "a", "answer": "b"}) + "\n")
    assert load_jsonl(good) == [Problem("1+1=", "2"), Problem("a", "b")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing key 'answer'"):
        load_jsonl(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:1: not valid JSON"):
        load_jsonl(broken)


def test_prompt_stream_resumes_exactly():
    probs = arithmetic_dataset(10, seed=0)
    a = PromptStream(probs, seed=5)
    a.take(7)
    state = a.state()
    expected = a.take(25)  # crosses two epoch boundaries
    b = PromptStream(probs, seed=5)
    b.load_state(state)
    assert b.take(25) == expected
    epoch0 = PromptStream(probs, seed=5).take(10)
    assert sorted(p.prompt for p in epoch0) == sorted(p.prompt for p in probs)  # a permutation per epoch


def test_tiny_model_is_partly_right(tiny_model_path):
    """The warm start leaves headroom for GRPO: sampled (temperature 1) held-out accuracy - the
    reward GRPO sees - between 30% and 70%, while the greedy answer is right more often (the model
    knows more than its samples show, which is what GRPO sharpens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cotrain.models.build_tiny import accuracy, build_report, eval_problems

    report = build_report(tiny_model_path)
    assert 0.3 <= report["accuracy"] <= 0.7
    assert report["greedy_accuracy"] > report["accuracy"] + 0.15
    cfg = json.loads((tiny_model_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    # the reported accuracy is reproducible from the saved checkpoint (independent re-evaluation)
    assert accuracy(model, tok, eval_problems()[:128], temperature=1.0) == pytest.approx(report["accuracy"], abs=0.12)
    assert accuracy(model, tok, eval_problems()[:128]) == pytest.approx(report["greedy_accuracy"], abs=0.12)


def test_label_noise_corrupts_digits_at_the_given_rate():
    from cotrain.models.build_tiny import noisy

    rng = random.Random(0)
    probs = arithmetic_dataset(2000, seed=1)
    changed = total = 0
    for p in probs:
        q = noisy(p, rng, 0.2)
        assert q.prompt == p.prompt and len(q.answer) == len(p.answer)
        changed += sum(a != b for a, b in zip(p.answer, q.answer))
        total += len(p.answer)
    assert changed / total == pytest.approx(0.2 * 0.9, abs=0.02)  # a replaced digit stays the same 1 time in 10


def test_tiny_model_cache_is_reused(tiny_model_path):
    from cotrain.models.build_tiny import ensure_tiny_model

    mtime = (tiny_model_path / "model.safetensors").stat().st_mtime
    assert ensure_tiny_model(progress=False) == tiny_model_path
    assert (tiny_model_path / "model.safetensors").stat().st_mtime == mtime
