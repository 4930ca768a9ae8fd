import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # helper modules (_serving, _cp_draft) by name

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


@pytest.fixture(scope="session")
def target(tiny_model_path):
    from cotrain.draft.taps import TargetSpec

    return TargetSpec.from_checkpoint(tiny_model_path)


@pytest.fixture(scope="session")
def hf_target(tiny_model_path):
    from transformers import AutoTokenizer

    from cotrain.draft.taps import load_hf_target

    return load_hf_target(tiny_model_path), AutoTokenizer.from_pretrained(str(tiny_model_path))


@pytest.fixture
def one_thread():
    """The tiny drafter shapes run fastest on one thread (and two threads on a busy 2-core box
    can be many times slower)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
