"""Helpers the config tests share: the paths they read and the issue assertions."""

from __future__ import annotations

from pathlib import Path

import pytest

from cotrain.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
DEMO = ROOT / "tests" / "configs" / "small.yaml"  # the validator tests' own fixed base
LAUNCH = ROOT / "launch" / "grpo.py"


def write(dirpath: Path, name: str, text: str) -> Path:
    p = dirpath / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def shipped(name: str, overrides=()):
    """A shipped config, its run folder away from the checkout's runs/ (where a user's run of it,
    e.g. `make demo`'s runs/demo, is a folder that validation refuses to mix a fresh run with)."""
    import tempfile

    away = Path(tempfile.gettempdir()) / "cotrain-tests-no-run" / Path(name).stem
    return load_config(CONFIGS / name, [f"run.output_dir={away}", *overrides])


def error_of(overrides, path=DEMO) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value


def assert_issue(err: ConfigError, path: str, *fragments: str) -> str:
    """The error has an issue at ``path`` whose message holds every fragment; returns it."""
    msgs = [m for p, m in err.issues if p == path]
    assert msgs, f"no issue at {path!r}; got {err.issues}"
    line = f"{path}: {msgs[0]}"
    assert line in str(err)
    for frag in fragments:
        assert frag in msgs[0], f"{frag!r} not in {msgs[0]!r}"
    return msgs[0]
