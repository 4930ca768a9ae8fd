import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # helper modules (_serving, _cp_draft) by name

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


@pytest.fixture(scope="session")
def target_of(builtin_model_path):
    """name -> the built-in model's TargetSpec (what drafters are built against), loaded once."""
    from cotrain.draft.taps import TargetSpec

    specs = {}

    def get(name: str = "tiny"):
        if name not in specs:
            specs[name] = TargetSpec.from_checkpoint(builtin_model_path(name))
        return specs[name]

    return get


@pytest.fixture(scope="session")
def hf_target_of(builtin_model_path):
    """name -> (the built-in model as a Hugging Face target, its tokenizer), loaded once."""
    from transformers import AutoTokenizer

    from cotrain.draft.taps import load_hf_target

    models = {}

    def get(name: str = "tiny"):
        if name not in models:
            path = builtin_model_path(name)
            models[name] = load_hf_target(path), AutoTokenizer.from_pretrained(str(path))
        return models[name]

    return get


@pytest.fixture(scope="session")
def target(target_of):
    return target_of("tiny")


@pytest.fixture(scope="session")
def hf_target(hf_target_of):
    return hf_target_of("tiny")


@pytest.fixture
def one_thread():
    """The tiny drafter shapes run fastest on one thread (and two threads on a busy 2-core box
    can be many times slower)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
