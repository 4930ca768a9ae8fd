"""Paths as the benchmarks record them: never an absolute path of the machine that ran them.

``recorded(p)``: relative to the checkout when inside it, ``$COTRAIN_CACHE/<rest>`` when inside the
model cache, else the file's name alone.
"""

from __future__ import annotations

import os
from argparse import Namespace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def recorded(path: str | os.PathLike) -> str:
    from cotrain.models.build_tiny import cache_root

    p = Path(path).resolve()
    for base, prefix in ((ROOT, ""), (cache_root().resolve(), "$COTRAIN_CACHE/")):
        try:
            return prefix + str(p.relative_to(base))
        except ValueError:
            pass
    return p.name


def recorded_args(args: Namespace) -> dict:
    """``vars(args)`` with every ``Path`` value recorded."""
    return {k: (recorded(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
