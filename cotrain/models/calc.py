"""The calculator built-in policy (``builtin:calc``): the tiny architecture warm-started on noisy tool use.

Its task is 2-digit multiplication (``"37*48="``, the arithmetic task with ops ``*``), which a model
this size cannot do in its head but can with the calculator of :mod:`cotrain.envs.calculator`::

    37*48=  <calc>37*48</calc><eos>  [1776]  1776<eos>
    prompt  policy turn 1            reply   policy turn 2 (trained on the policy's turns only)

The warm start's conversations are noisy, so that the model's samples are right about half the
time and GRPO has headroom (the reward: the final answer's exact match):

- ``direct``: the share answered without the tool (the right product, which it cannot compute:
  these samples are mostly wrong);
- ``typo``: the share of tool calls with one operand digit mistyped (the calculator answers the
  wrong product, copied faithfully);
- ``copy_noise``: the share of final answers that copy the calculator's reply with one digit wrong.

Only constants, the data and the build's evaluation live here (like :mod:`cotrain.models.tiny`);
``cotrain.models.build_tiny`` builds and caches the checkpoint (``--model calc``); importing this
module imports no torch. ``builtin:tiny`` is unchanged (its cache key, demo, tests and drafters
depend on it).
"""

from __future__ import annotations

import random

from cotrain.envs.calculator import CLOSE, OPEN, reply, tool_call
from cotrain.models import tiny

# the tiny architecture and its character tokenizer (builtin:tiny's, shared)
VOCAB_SIZE = tiny.VOCAB_SIZE
CALC_QWEN3_CONFIG = dict(tiny.TINY_QWEN3_CONFIG)

# 2-digit multiplication (operands 1..2 digits): data.task=arithmetic, digits 2, ops ['*'].
CALC_TASK = dict(max_digits=2, ops=("*",))

CALC_SFT = dict(steps=500, batch_size=64, lr=3e-3, warmup=50, weight_decay=0.01, seed=1234, eval_size=256,
                direct=0.3, typo=0.2, copy_noise=0.2)

EVAL_MAX_NEW_TOKENS = 24  # per turn
MAX_TURNS = 3  # of the build's own evaluation

# Bump when the build changes in a way the constants above do not show (it is part of the cache key).
BUILD_VERSION = 1
BUILD_THREADS = 1


def _swap_digit(text: str, rng: random.Random) -> str:
    """``text`` with one of its digits replaced by a different digit (unchanged without digits)."""
    where = [i for i, c in enumerate(text) if c.isdigit()]
    if not where:
        return text
    i = rng.choice(where)
    d = rng.choice([c for c in "0123456789" if c != text[i]])
    return text[:i] + d + text[i + 1:]


def conversation(problem, rng: random.Random, sft: dict = CALC_SFT) -> list[tuple[str, str]]:
    """One warm-start conversation after the prompt: ("policy" | "env", text) segments."""
    if rng.random() < sft["direct"]:
        return [("policy", problem.answer)]
    expr = problem.prompt.rstrip("=")
    if rng.random() < sft["typo"]:
        expr = _swap_digit(expr, rng)
    obs = reply(expr)
    answer = obs[1:-1]
    if rng.random() < sft["copy_noise"]:
        answer = _swap_digit(answer, rng)
    return [("policy", f"{OPEN}{expr}{CLOSE}"), ("env", obs), ("policy", answer)]


def encode_conversations(tokenizer, problems, conversations) -> dict:
    """prompt + segments (each policy segment followed by <eos>), right-padded; the loss covers the
    policy's segments and their <eos> only."""
    import torch

    rows, labels = [], []
    eos = tokenizer.eos_token_id
    for p, conv in zip(problems, conversations):
        ids = tokenizer.encode(p.prompt)
        lab = [-100] * len(ids)
        for who, text in conv:
            seg = tokenizer.encode(text) + ([eos] if who == "policy" else [])
            ids += seg
            lab += seg if who == "policy" else [-100] * len(seg)
        rows.append(ids)
        labels.append(lab)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    return {"input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
            "labels": torch.tensor([r + [-100] * (width - len(r)) for r in labels])}


def _continue(model, tokenizer, histories: list[list[int]], max_new_tokens: int, temperature: float) -> list[list[int]]:
    """Each history's next policy turn (token ids up to and including <eos>), left-padded HF generate."""
    import torch

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    width = max(map(len, histories))
    ids = torch.tensor([[pad] * (width - len(h)) + h for h in histories])
    att = torch.tensor([[0] * (width - len(h)) + [1] * len(h) for h in histories])
    kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens, pad_token_id=pad,
                             eos_token_id=eos, **kw)[:, width:].tolist()
    turns = []
    for row in out:
        turns.append(row[: row.index(eos) + 1] if eos in row else row)
    return turns


def calc_accuracy(model, tokenizer, problems, temperature: float = 0.0, max_new_tokens: int = EVAL_MAX_NEW_TOKENS,
                  seed: int = 0, batch_size: int = 256, max_turns: int = MAX_TURNS) -> float:
    """Fraction of exactly right final answers over conversations with the calculator (HF generate;
    the turn rule of :class:`cotrain.envs.calculator.CalculatorEnv`)."""
    import torch

    from cotrain.tasks.rewards import exact_match_reward

    right = 0
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for b in range(0, len(problems), batch_size):
            chunk = problems[b:b + batch_size]
            hist = [tokenizer.encode(p.prompt) for p in chunk]
            final: list[str | None] = [None] * len(chunk)
            live = list(range(len(chunk)))
            for turn in range(max_turns):
                if not live:
                    break
                outs = _continue(model, tokenizer, [hist[i] for i in live], max_new_tokens, temperature)
                nxt = []
                for i, ids in zip(live, outs):
                    text = tokenizer.decode(ids, skip_special_tokens=True)
                    expr = tool_call(text)
                    if expr is None or turn == max_turns - 1:
                        final[i] = text
                        continue
                    hist[i] = hist[i] + ids + tokenizer.encode(reply(expr))
                    nxt.append(i)
                live = nxt
            right += sum(exact_match_reward(t or "", p.answer) for t, p in zip(final, chunk))
    return right / len(problems)
