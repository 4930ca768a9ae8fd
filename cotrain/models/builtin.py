"""The built-in models (``policy.model_path: builtin:<name>``): what each one is, without building it.

Each entry names its architecture (a Qwen3 ``config.json`` without the vocabulary), its vocabulary
size, the built-in task it is warm-started on and the supervised recipe; config validation reads
the architecture from here before anything is built, ``cotrain.models.build_tiny`` builds, caches
and resolves the checkpoints. Importing this module imports no torch.

- ``builtin:tiny`` (:mod:`cotrain.models.tiny`): 0.8 M parameters, 1-2 digit addition, answers of
  2-4 tokens. The demo's policy.
- ``builtin:small`` (:mod:`cotrain.models.small`): the ``gcd`` task's worked solutions, responses
  of 9-120 tokens (median 30) with a long tail. The speculative-decoding benchmark's policy.
- ``builtin:words`` (:mod:`cotrain.models.words`): a word-level tokenizer of 8,192 tokens and a copy
  task over Zipf-distributed words (1.4 M parameters, most of them the tied embedding / LM head): the
  target of the reduced EAGLE-3 draft vocabulary's tests and benchmark.
- ``builtin:calc`` (:mod:`cotrain.models.calc`): the tiny architecture warm-started on noisy tool
  use of the calculator task (:mod:`cotrain.envs.calculator`): 2-digit multiplication answered after
  a ``<calc>`` call. The multi-turn example's policy (configs/calc.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

PREFIX = "builtin:"


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    hf_config: dict = field(repr=False)
    vocab_size: int
    task: str  # a built-in task: "arithmetic" or "gcd" (cotrain.tasks), "words" (cotrain.models.words),
    # "calculator" (cotrain.envs.calculator, arithmetic problems answered with the tool)
    task_params: dict
    sft: dict  # the warm start; see cotrain.models.build_tiny.train_sft
    build_version: int
    threads: int  # torch CPU threads of the build: fixed, so the weights do not depend on the machine
    eval_max_new_tokens: int
    tokenizer: str = "chars"  # "chars" (cotrain.models.tokenizer) or "words" (cotrain.models.words)

    @property
    def model_path(self) -> str:
        return PREFIX + self.name

    def config_dict(self) -> dict[str, Any]:
        """The architecture as validation reads it (a HF config with the vocabulary size)."""
        return dict(self.hf_config, vocab_size=self.vocab_size)


def _registry() -> dict[str, BuiltinModel]:
    from cotrain.models import calc, small, tiny, words

    return {
        "tiny": BuiltinModel("tiny", tiny.TINY_QWEN3_CONFIG, tiny.VOCAB_SIZE, "arithmetic", tiny.TINY_TASK, tiny.TINY_SFT,
                             tiny.BUILD_VERSION, tiny.BUILD_THREADS, eval_max_new_tokens=8),
        "small": BuiltinModel("small", small.SMALL_QWEN3_CONFIG, small.VOCAB_SIZE, "gcd", small.SMALL_TASK,
                              small.SMALL_SFT, small.BUILD_VERSION, small.BUILD_THREADS,
                              eval_max_new_tokens=small.EVAL_MAX_NEW_TOKENS),
        "words": BuiltinModel("words", words.WORDS_QWEN3_CONFIG, words.VOCAB_SIZE, "words", words.WORDS_TASK,
                              words.WORDS_SFT, words.BUILD_VERSION, words.BUILD_THREADS,
                              eval_max_new_tokens=words.EVAL_MAX_NEW_TOKENS, tokenizer="words"),
        "calc": BuiltinModel("calc", calc.CALC_QWEN3_CONFIG, calc.VOCAB_SIZE, "calculator", calc.CALC_TASK,
                             calc.CALC_SFT, calc.BUILD_VERSION, calc.BUILD_THREADS,
                             eval_max_new_tokens=calc.EVAL_MAX_NEW_TOKENS),
    }


BUILTIN_NAMES = ("tiny", "small", "words", "calc")


def allowed() -> str:
    return ", ".join(PREFIX + n for n in BUILTIN_NAMES)


def is_builtin(model_path: str) -> bool:
    return isinstance(model_path, str) and model_path.startswith(PREFIX)


def get_builtin(model_path_or_name: str) -> BuiltinModel:
    """The built-in model of ``builtin:<name>`` (or of ``<name>``); ValueError naming the allowed ones."""
    name = model_path_or_name[len(PREFIX):] if is_builtin(model_path_or_name) else model_path_or_name
    models = _registry()
    if name not in models:
        raise ValueError(f"unknown built-in model {PREFIX}{name} (allowed: {allowed()}, or a HF checkpoint directory)")
    return models[name]


def builtin_or_none(model_path: str) -> Optional[BuiltinModel]:
    return get_builtin(model_path) if is_builtin(model_path) else None


def tokenizer_for(kind: str = "chars"):
    """The tokenizer of a built-in model (its ``tokenizer`` field): ``chars``
    (:mod:`cotrain.models.tokenizer`) or ``words`` (:mod:`cotrain.models.words`)."""
    if kind == "words":
        from cotrain.models.words import build_words_tokenizer

        return build_words_tokenizer()
    if kind != "chars":
        raise ValueError(f"unknown built-in tokenizer {kind!r} (allowed: chars, words)")
    from cotrain.models.tokenizer import build_tokenizer

    return build_tokenizer()
