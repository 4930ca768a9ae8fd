import os

import pytest
import torch

# One thread in the test process: on the 2-core CI machine two threads next to spawned ranks and
# engines oversubscribe the cores (measured up to 13-40x slower attention); ranks set their own.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_path():
    """The cached built-in tiny policy (built on first use, about a minute on 2 cores)."""
    from cotrain.models.build_tiny import ensure_tiny_model

    return ensure_tiny_model(progress=False)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
