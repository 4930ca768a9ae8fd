"""YAML loading: ``defaults:`` inheritance, deep merge, dotted command-line overrides.

- ``defaults: [base.yaml, ...]`` (or one string) at the top of a file names files to merge first,
  relative to the including file, recursively; cycles are errors. Merge order: each default in
  list order (later wins), then the file itself.
- Deep merge: mappings merge key by key; any other value (scalars, lists, null) replaces.
- Overrides ``a.b.c=value``: the value is parsed as a YAML scalar / flow list / flow mapping
  (``2``, ``0.7``, ``1e-5``, ``null``, ``[1, 2]``, ``{tensor: 2}``; empty = null); the key path
  must exist in the schema. Applied after all files, in order.
- YAML is read with PyYAML's safe loader plus YAML 1.2 floats (``1e-5`` is a number, not a
  string) and duplicate keys rejected.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from .errors import ConfigError, format_path, unknown_key_message
from .schema import CotrainConfig, section_keys

__all__ = ["load_yaml", "load_merged", "deep_merge", "parse_override", "apply_overrides", "read_config_dict"]


class _Loader(yaml.SafeLoader):
    """Safe loader with YAML 1.2 floats and duplicate-key detection."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise ConfigError([(where, f"invalid YAML: {e}")]) from None


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """One YAML file as a mapping (an empty file is ``{}``)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError([("", f"config file {str(p)!r} does not exist")]) from None
    except OSError as e:
        raise ConfigError([("", f"cannot read config file {str(p)!r}: {e}")]) from None
    data = _parse_yaml(text, str(p))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"{p}: the top level must be a mapping, got {type(data).__name__}")])
    return data


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """A new dict: ``over`` merged into ``base`` (mappings recursively, everything else replaced)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_merged(path: str | os.PathLike[str], _stack: tuple[Path, ...] = ()) -> tuple[dict[str, Any], list[str]]:
    """A file with its ``defaults:`` resolved: (merged mapping, files in merge order)."""
    p = Path(path).resolve()
    if p in _stack:
        chain = " -> ".join(_rel(s) for s in (*_stack, p))
        raise ConfigError([("defaults", f"inheritance cycle: {chain}")])
    data = load_yaml(p)
    defaults = data.pop("defaults", None)
    if defaults is None:
        defaults = []
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError([("defaults", f"in {_rel(p)}: expected a list of file paths, got {defaults!r}")])
    merged: dict[str, Any] = {}
    files: list[str] = []
    for d in defaults:
        child = (p.parent / d)
        if not child.is_file():
            raise ConfigError([("defaults", f"in {_rel(p)}: {d!r} does not exist (looked for {_rel(child)})")])
        sub, sub_files = load_merged(child, (*_stack, p))
        merged = deep_merge(merged, sub)
        files += sub_files
    return deep_merge(merged, data), files + [str(p)]


def _rel(p: Path) -> str:
    try:
        return os.path.relpath(p)
    except ValueError:
        return str(p)


_OVERRIDE_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\s*=(.*)$", re.S)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'policy.parallel.pipeline=2'`` -> ``(['policy', 'parallel', 'pipeline'], 2)``."""
    m = _OVERRIDE_RE.match(text)
    if not m:
        raise ConfigError([("", f"override {text!r} is not of the form key.path=value")])
    keys = m.group(1).split(".")
    raw = m.group(2).strip()
    value = None if raw == "" else _parse_yaml(raw, f"override {text!r}")
    return keys, value


def _check_key_path(keys: Sequence[str], text: str) -> None:
    cls = CotrainConfig
    for i, key in enumerate(keys):
        if cls is None:
            leaf = format_path(keys[:i])
            raise ConfigError([(format_path(keys), f"{leaf} is a value, not a section (override {text!r})")])
        valid = section_keys(cls)
        if key not in valid:
            where = format_path(keys[:i]) or "the top level"
            raise ConfigError([(format_path(keys[: i + 1]),
                                f"{unknown_key_message(key, valid, where)} (override {text!r})")])
        cls = valid[key]


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A new dict with the dotted overrides applied (mappings deep-merged, anything else set)."""
    out = dict(data)
    for text in overrides:
        keys, value = parse_override(text)
        if keys == ["defaults"]:
            raise ConfigError([("defaults", f"override {text!r}: defaults can only be set in files")])
        _check_key_path(keys, text)
        patch: Any = value
        for key in reversed(keys):
            patch = {key: patch}
        out = deep_merge(out, patch)
    return out


def read_config_dict(path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> tuple[dict[str, Any], list[str]]:
    """Files merged and overrides applied: (raw mapping, sources)."""
    overrides = list(overrides)
    data, files = load_merged(path)
    data = apply_overrides(data, overrides)
    return data, files + [f"override {o}" for o in overrides]
