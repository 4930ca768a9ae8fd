"""Moved to :mod:`cotrain.rl.vllm` (one job per module). These names stay importable here only for
files other work in progress owns (tests/draft/_serving.py, tests/draft/test_serve_eagle3_vocab.py);
delete this module once they import cotrain.rl.vllm.client / cotrain.rl.vllm.sampler_fix."""

from cotrain.rl.vllm.client import push_weights
from cotrain.rl.vllm.sampler_fix import cpu_rejection_sampler_fixed  # noqa: F401


def push_draft_weights(llm, named_tensors, version, transport=None):
    """``cotrain.rl.vllm.client.push_weights(llm, "draft", ...)``."""
    return push_weights(llm, "draft", named_tensors, version, transport)
