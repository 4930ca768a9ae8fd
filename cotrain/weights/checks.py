"""What a weight handle must be, checked once on the way into an engine.

A handle is the small picklable dict a :class:`~cotrain.weights.interfaces.WeightTransport` makes::

    transport  str                        one of TRANSPORTS
    version    int                        the pushed weights' version
    manifest   [[name, [dims...], dtype]]  what the push carries, in the sender's order
    ...                                    the transport's own fields (path, update_info, ...)

:func:`check_push` is the one check a push meets before anything in the engine changes (the
receiving backend calls it): the handle's shape, for GPU transports vLLM's payload against the
manifest, then the manifest against the engine's checkpoint (:func:`check_manifest`).
:func:`check_received` verifies a delivery against its manifest.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

TRANSPORTS = ("shm", "object_store", "cuda_ipc", "nccl")
#: cotrain transport name -> vLLM weight-transfer backend that moves the bytes
VLLM_BACKENDS = {"cuda_ipc": "ipc", "nccl": "nccl"}
SHARED_KEYS = ("lm_head", "embed_tokens")  # target modules a drafter may borrow (EAGLE-3, DFlash)

Manifest = list[list[Any]]  # [[name, [dims...], dtype_name], ...]


class WeightPushError(ValueError):
    """A weight push was rejected (names, shapes, dtypes or handle); the engine kept its weights."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise WeightPushError(f"unknown dtype {name!r} in a weight handle (allowed: torch dtype names "
                              "such as float32, bfloat16, float16, int64)")
    return dt


def manifest_of(named_tensors: dict[str, torch.Tensor]) -> Manifest:
    """``[[name, shape, dtype_name], ...]`` in the dict's order."""
    return [[n, list(t.shape), dtype_name(t.dtype)] for n, t in named_tensors.items()]


def total_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def flat_tensors(named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of a push, detached; refuses an empty push and non-tensors."""
    if not named_tensors:
        raise WeightPushError("nothing to send: the push has no tensors")
    out = {}
    for n, t in named_tensors.items():
        if not isinstance(t, torch.Tensor):
            raise WeightPushError(f"{n!r} is a {type(t).__name__}, not a torch.Tensor")
        out[n] = t.detach()
    return out


def _fmt_names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def check_manifest(
    got: Manifest,
    expected: dict[str, tuple[list[int], str]],
    *,
    kind: str = "policy",
    forbidden: dict[str, str] | None = None,
    require_all: bool = True,
) -> None:
    """Raise :class:`WeightPushError` unless ``got`` fits ``expected`` (name -> (shape, dtype)).

    Checks, in this order, and reports every failing category with its first offenders:
    names in ``forbidden`` (name -> why), unknown names, duplicated names, missing names (when
    ``require_all``), shape mismatches (expected vs got), dtype mismatches. Floating dtypes may
    differ (the engine casts on load: fp32 master weights into a bf16 engine is fine); a floating
    tensor for an integer parameter (or the reverse) is a mismatch.
    """
    forbidden = forbidden or {}
    names = [row[0] for row in got]
    problems: list[str] = []
    bad = [n for n in names if n in forbidden]
    if bad:
        problems.append(f"{len(bad)} name(s) not allowed in a {kind} push: {_fmt_names(bad)} "
                        f"({forbidden[bad[0]]})")
    unknown = [n for n in names if n not in expected and n not in forbidden]
    if unknown:
        sample = _fmt_names(sorted(expected)[:2], 2) if expected else "none"
        problems.append(f"{len(unknown)} unknown name(s): {_fmt_names(unknown)} (the engine's {kind} "
                        f"weights are named like {sample})")
    seen: set[str] = set()
    dups = [n for n in names if n in seen or seen.add(n)]
    if dups:
        problems.append(f"{len(dups)} duplicated name(s): {_fmt_names(dups)}")
    if require_all:
        have = set(names)
        missing = [n for n in expected if n not in have]
        if missing:
            problems.append(f"{len(missing)} missing name(s): {_fmt_names(missing)} (a {kind} push must "
                            f"carry all {len(expected)} tensors)")
    shape_bad, dtype_bad = [], []
    for name, shape, dt in got:
        if name not in expected:
            continue
        want_shape, want_dt = expected[name]
        if list(shape) != list(want_shape):
            shape_bad.append(f"{name!r} expected {list(want_shape)} got {list(shape)}")
        elif dtype_from_name(dt).is_floating_point != dtype_from_name(want_dt).is_floating_point:
            dtype_bad.append(f"{name!r} expected {want_dt} got {dt}")
    if shape_bad:
        more = f" (and {len(shape_bad) - 3} more)" if len(shape_bad) > 3 else ""
        problems.append(f"{len(shape_bad)} shape mismatch(es): " + "; ".join(shape_bad[:3]) + more)
    if dtype_bad:
        more = f" (and {len(dtype_bad) - 3} more)" if len(dtype_bad) > 3 else ""
        problems.append(f"{len(dtype_bad)} dtype mismatch(es): " + "; ".join(dtype_bad[:3]) + more)
    if problems:
        raise WeightPushError(f"{kind} weight push rejected: " + " | ".join(problems))


def shared_name_reasons(names: Iterable[str], shared: Iterable[str]) -> dict[str, str]:
    """``{name: why}`` for the names that fall in a module the drafter borrows from the target
    (``shared`` holds keys of :data:`SHARED_KEYS`): a draft push must not carry them."""
    shared = set(shared)
    out = {}
    for n in names:
        hit = [k for k in SHARED_KEYS if k in shared and k in n.split(".")]
        if hit:
            out[n] = (f"the drafter shares {hit[0]} with the target; a draft push carries only the drafter's own "
                      "parameters (push the target's through a policy push)")
    return out


def check_handle(handle: dict, transport: str | None = None) -> str:
    """The handle's shape (a dict naming a known transport, with ``version`` and ``manifest``);
    with ``transport`` it must be that one. Returns the transport's name."""
    got = handle.get("transport") if isinstance(handle, dict) else None
    if not isinstance(handle, dict) or "transport" not in handle:
        raise WeightPushError(f"not a weight handle: {type(handle).__name__} (expected a dict from a "
                              "WeightTransport.send)")
    if transport is not None and got != transport:
        raise WeightPushError(f"handle is for transport {got!r}, not {transport!r} (allowed: {TRANSPORTS})")
    if got not in TRANSPORTS:
        raise WeightPushError(f"handle transport {got!r} is unknown (allowed: {', '.join(TRANSPORTS)})")
    for key in ("version", "manifest"):
        if key not in handle:
            raise WeightPushError(f"{got} handle lacks {key!r}")
    return got


def update_info_manifest(info: dict) -> Manifest:
    """The manifest of a vLLM update payload (``names`` / ``dtype_names`` / ``shapes``)."""
    names, dts, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
    if not isinstance(names, list) or not isinstance(dts, list) or not isinstance(shapes, list) \
            or not len(names) == len(dts) == len(shapes):
        raise WeightPushError("a vLLM update payload needs names, dtype_names and shapes of one length")
    return [[n, [int(x) for x in s], d] for n, d, s in zip(names, dts, shapes)]


def check_vllm_handle(handle: dict) -> None:
    """A ``cuda_ipc`` / ``nccl`` handle carries vLLM's update payload, and its manifest is that
    payload's (what cotrain validates is exactly what vLLM's engine will receive)."""
    name = handle.get("transport") if isinstance(handle, dict) else None
    if name not in VLLM_BACKENDS:
        raise WeightPushError(f"not a vLLM-transport handle: {name!r} (allowed: {', '.join(VLLM_BACKENDS)})")
    check_handle(handle, name)
    info = handle.get("update_info")
    if not isinstance(info, dict):
        raise WeightPushError(f"{name} handle lacks vLLM's update_info")
    if update_info_manifest(info) != [[n, list(s), d] for n, s, d in handle["manifest"]]:
        raise WeightPushError(f"{name} handle's manifest differs from its vLLM update_info (version "
                              f"{handle.get('version')}); the push was not applied")


def check_push(handle: dict, expected: dict[str, tuple[list[int], str]], shared: Iterable[str] = (), *,
               kind: str = "policy") -> None:
    """The one check of a push on its way in, before the engine changes: the handle's shape, vLLM's
    payload against the manifest (GPU transports), then the manifest against ``expected`` (the
    engine's checkpoint, minus what a drafter borrows: ``shared``, whose names a draft push must
    not carry). Every tensor must be there."""
    transport = check_handle(handle)
    if transport in VLLM_BACKENDS:
        check_vllm_handle(handle)
    forbidden = shared_name_reasons([row[0] for row in handle["manifest"]], shared)
    check_manifest(handle["manifest"], expected, kind=kind, forbidden=forbidden, require_all=True)


def check_received(handle: dict, tensors: dict[str, torch.Tensor]) -> None:
    """The tensors a transport delivered are exactly what the handle's manifest announced."""
    want = {n: (list(s), d) for n, s, d in handle["manifest"]}
    got = manifest_of(tensors)
    if [r[0] for r in got] != list(want) or any(want[n] != (s, d) for n, s, d in got):
        raise WeightPushError(f"{handle.get('transport')} transport delivered tensors that differ from the "
                              f"handle's manifest (version {handle.get('version')}); the push was not applied")
