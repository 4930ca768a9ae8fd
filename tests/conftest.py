import os

import pytest
import torch

# One thread in the test process: on the 2-core CI machine two threads next to spawned ranks and
# engines oversubscribe the cores (measured up to 13-40x slower attention); ranks set their own.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def builtin_model_path():
    """name -> the cached built-in model's checkpoint (``builtin:<name>``: tiny, small, words; each
    built on first use, the tiny one in about a minute on 2 cores). The one way tests get them."""
    from cotrain.models.build_tiny import ensure_builtin_model

    paths = {}

    def get(name: str = "tiny"):
        if name not in paths:
            paths[name] = ensure_builtin_model(name, progress=False)
        return paths[name]

    return get


@pytest.fixture(scope="session")
def tiny_model_path(builtin_model_path):
    """The cached built-in tiny policy."""
    return builtin_model_path("tiny")


@pytest.fixture(scope="session")
def load_bench():
    """name -> ``bench/<name>.py`` imported as a module (the benchmark scripts are not a package),
    each once per session."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    modules = {}

    def get(name: str):
        if name not in modules:
            spec = importlib.util.spec_from_file_location(f"bench_{name}", root / "bench" / f"{name}.py")
            modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(modules[name])
        return modules[name]

    return get


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
