"""Moved to :mod:`cotrain.rl.vllm.engine`. These names stay importable here only for files other work
in progress owns (bench/drafters.py, tests/draft/_serving.py, tests/test_vllm_parity.py); delete this
module once they import cotrain.rl.vllm.engine."""

from cotrain.rl.vllm.engine import make_cotrain_llm, make_llm  # noqa: F401
