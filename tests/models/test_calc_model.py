"""builtin:calc (cotrain/models/calc.py): its warm-start conversations and their loss (the policy's
turns only), its cache key beside builtin:tiny's (unchanged), a reduced build through the real
build path, and the build's conversation evaluation against a hand-run conversation."""

from __future__ import annotations

import random

import torch

from cotrain.envs.calculator import reply, tool_call
from cotrain.models.build_tiny import build, build_key, sft_sampler
from cotrain.models.calc import CALC_SFT, conversation, encode_conversations
from cotrain.models.tokenizer import build_tokenizer
from cotrain.tasks.data import Problem


def test_warm_start_conversations_are_noisy_as_stated():
    rng = random.Random(0)
    p = Problem("37*48=", "1776")
    convs = [conversation(p, rng) for _ in range(4000)]
    direct = [c for c in convs if len(c) == 1]
    calls = [c for c in convs if len(c) == 3]
    assert len(direct) + len(calls) == len(convs)
    assert abs(len(direct) / len(convs) - CALC_SFT["direct"]) < 0.03
    assert all(c == [("policy", "1776")] for c in direct)
    typo = [c for c in calls if tool_call(c[0][1]) != "37*48"]
    assert abs(len(typo) / len(calls) - CALC_SFT["typo"]) < 0.03
    for who, _ in calls[0]:
        assert who in ("policy", "env")
    for c in calls:  # the reply is the calculator's on the (possibly mistyped) call
        assert c[1] == ("env", reply(tool_call(c[0][1])))
    miscopied = [c for c in calls if c[2][1] != c[1][1][1:-1]]
    assert abs(len(miscopied) / len(calls) - CALC_SFT["copy_noise"]) < 0.03


def test_loss_covers_the_policy_turns_only():
    tok = build_tokenizer()
    p = Problem("12*34=", "408")
    conv = [("policy", "<calc>12*34</calc>"), ("env", "[408]"), ("policy", "408")]
    b = encode_conversations(tok, [p, Problem("1*1=", "1")], [conv, [("policy", "1")]])
    eos = tok.eos_token_id
    ids = tok.encode("12*34=") + tok.encode("<calc>12*34</calc>") + [eos] + tok.encode("[408]") + tok.encode("408") + [eos]
    assert b["input_ids"][0].tolist() == ids
    lab = b["labels"][0].tolist()
    trained = [t for t, l in zip(ids, lab) if l != -100]
    assert trained == tok.encode("<calc>12*34</calc>") + [eos] + tok.encode("408") + [eos]
    assert b["labels"][1].tolist()[:6] == [-100] * 4 + tok.encode("1") + [eos]
    assert b["attention_mask"][1].sum().item() == 6


def test_cache_keys():
    assert build_key("tiny") == "b27c71af840d"  # builtin:tiny's weights, demo and drafters are unchanged
    assert build_key("calc") not in (build_key("tiny"), build_key("small"), build_key("words"))


def test_reduced_build_and_its_evaluation(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cotrain.models.calc import calc_accuracy

    rep = build(tmp_path / "calc", progress=False, model="calc",
                _test_overrides={"sft": {"steps": 3, "batch_size": 8, "eval_size": 4}})
    assert rep["model"] == "builtin:calc" and rep["task"] == "calculator" and 0.0 <= rep["accuracy"] <= 1.0
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "calc")).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "calc"))
    # the evaluation's conversation, run by hand with greedy steps
    p = Problem("3*4=", "12")
    hist = tok.encode(p.prompt)
    for _ in range(3):
        out = []
        with torch.no_grad():
            for _ in range(24):
                nxt = int(model(input_ids=torch.tensor([hist + out])).logits[0, -1].argmax())
                out.append(nxt)
                if nxt == tok.eos_token_id:
                    break
        text = tok.decode(out, skip_special_tokens=True)
        if tool_call(text) is None:
            break
        hist = hist + out + tok.encode(reply(tool_call(text)))
    assert calc_accuracy(model, tok, [p], max_new_tokens=24) == float(text.strip() == "12")
    sampler = sft_sampler("calc")
    problem, conv = sampler(random.Random(0))
    assert problem.prompt.count("*") == 1 and conv[-1][0] == "policy"
