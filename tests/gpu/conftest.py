"""The GPU tests that need neither Ray nor vLLM: they run on a GPU machine that has torch and the
carried wheels only (scripts/gpu_check.sh; docs/setup.md, "The GPU check").

Every test collected here is marked ``gpu`` and, without CUDA, skipped with one reason. The modules
are still imported on CPU (so an import that would fail there fails here first), and
tests/scripts/test_gpu_check.py checks that they import, transitively, only packages the GPU machine has or
the check carries (scripts/gpu_machine.txt, scripts/gpu_wheels.txt): no ray, vllm or other package
at module level that the machine lacks.
"""

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
