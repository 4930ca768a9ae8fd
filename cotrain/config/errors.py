"""ConfigError and the translation of pydantic's errors into dotted YAML key paths."""

from __future__ import annotations

import difflib
import re
from typing import Any, Iterable, Sequence

from pydantic import BaseModel, ValidationError

from .schema import section_keys

__all__ = ["ConfigError", "format_path", "from_validation_error", "unknown_key_message"]


class ConfigError(ValueError):
    """An invalid configuration. ``issues`` is a list of ``(key_path, message)``; the message
    of the exception is one ``key.path: message`` line per issue."""

    def __init__(self, issues: str | Sequence[tuple[str, str]], source: str | None = None):
        if isinstance(issues, str):
            issues = [("", issues)]
        self.issues: list[tuple[str, str]] = list(issues)
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        lines = [f"{p}: {m}" if p else m for p, m in self.issues]
        if len(lines) == 1:
            return lines[0]
        return f"{len(lines)} config errors:\n" + "\n".join(f"  - {line}" for line in lines)

    @property
    def paths(self) -> list[str]:
        """The key paths of the issues."""
        return [p for p, _ in self.issues]


def format_path(loc: Iterable[Any]) -> str:
    """``('draft', 'eagle3', 'tap_layers', 1)`` -> ``draft.eagle3.tap_layers[1]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def unknown_key_message(key: str, valid: Iterable[str], where: str | None = None) -> str:
    """``unknown key 'paralel' in policy (did you mean: parallel? valid keys: ...)``."""
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
    close += [v for v in valid if v not in close and len(key) >= 3 and (v.startswith(key) or key.startswith(v))]
    hint = f"did you mean: {', '.join(close)}? " if close else ""
    loc = f" in {where}" if where else ""
    return f"unknown key {key!r}{loc} ({hint}valid keys: {', '.join(valid)})"


def _clean_loc(root: type[BaseModel], loc: Sequence[Any]) -> tuple[tuple[Any, ...], type[BaseModel] | None]:
    """Drop pydantic's union-member tags from ``loc`` by walking the schema; also return the
    section class that holds the last key (for listing valid keys)."""
    cls: type[BaseModel] | None = root
    parent: type[BaseModel] | None = root
    out: list[Any] = []
    in_leaf = False
    for part in loc:
        if isinstance(part, int):
            out.append(part)
            continue
        if cls is not None and not in_leaf:
            keys = section_keys(cls)
            parent = cls
            out.append(part)
            if part in keys:
                cls = keys[part]
                in_leaf = cls is None
            else:
                cls = None
                in_leaf = True
            continue
        # inside a leaf value: string parts are union tags such as 'bool', 'str', 'list[int]'
        if re.fullmatch(r"[a-z_]+(\[.*\])?", str(part)) and ("[" in str(part) or part in _TYPE_TAGS):
            continue
        out.append(part)
    return tuple(out), parent


_TYPE_TAGS = {"bool", "str", "int", "float", "list", "dict", "none", "tuple"}
_EXPECTED = {
    "bool_type": "a boolean (true/false)",
    "bool_parsing": "a boolean (true/false)",
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping (section)",
    "model_attributes_type": "a mapping (section)",
    "none_required": "null",
}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than_equal": ("<=", "le"), "less_than": ("<", "lt")}


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _message(err: dict[str, Any], parent: type[BaseModel] | None) -> str:
    etype, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if etype == "extra_forbidden":
        key = err["loc"][-1] if err["loc"] else "?"
        return unknown_key_message(str(key), section_keys(parent) if parent else [])
    if etype == "missing":
        return "required key is missing"
    if etype in ("literal_error", "enum"):
        allowed = re.findall(r"'((?:[^'\\]|\\.)*)'", str(ctx.get("expected", "")))
        return f"{_show(value)} is not allowed (allowed: {', '.join(allowed)})"
    if etype in _BOUNDS:
        op, key = _BOUNDS[etype]
        return f"{_show(value)} is out of range (allowed: {op} {ctx.get(key)})"
    if etype == "too_short":
        return f"{_show(value)} is too short (allowed: at least {ctx.get('min_length')} items)"
    if etype == "too_long":
        return f"{_show(value)} is too long (allowed: at most {ctx.get('max_length')} items)"
    if etype == "value_error":
        return str(err["msg"]).removeprefix("Value error, ")
    if etype in _EXPECTED:
        return f"expected {_EXPECTED[etype]}, got {_show(value)} ({type(value).__name__})"
    return f"{err['msg']} (got {_show(value)})"


def from_validation_error(exc: ValidationError, root: type[BaseModel], prefix: Sequence[Any] = ()) -> ConfigError:
    """Turn a pydantic ValidationError on ``root`` into a ConfigError with dotted key paths.

    Several errors on one path (the members of a union) are merged into one message."""
    merged: dict[str, list[str]] = {}
    type_only: dict[str, list[str]] = {}
    for err in exc.errors():
        loc, parent = _clean_loc(root, err["loc"])
        path = format_path((*prefix, *loc))
        msg = _message(dict(err), parent)
        merged.setdefault(path, [])
        if err["type"] in _EXPECTED:
            type_only.setdefault(path, []).append(_EXPECTED[err["type"]])
        if msg not in merged[path]:
            merged[path].append(msg)
    issues: list[tuple[str, str]] = []
    for path, msgs in merged.items():
        expected = type_only.get(path, [])
        if len(expected) > 1 and len(expected) == len(msgs):
            value = next(e.get("input") for e in exc.errors() if format_path((*prefix, *_clean_loc(root, e["loc"])[0])) == path)
            issues.append((path, f"expected {' or '.join(dict.fromkeys(expected))}, got {_show(value)}"))
        else:
            issues.append((path, "; ".join(msgs)))
    return ConfigError(issues)
