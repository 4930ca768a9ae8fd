"""Fill the caches the test suite, the benchmarks and the demo build on first use (``make warm``).

On a clean machine the suite builds three built-in models and distills four drafters the first
time a test asks for them. This script builds the same through the same entry points, in the order
the suite first needs them, so that a fresh machine can do it ahead (or beside other work, with
``--nice``). Nothing changes in what is built: ``ensure_builtin_model`` and ``ensure_distilled`` fix
their threads, build under a file lock and publish atomically, so whichever process gets there
first builds, the other waits on the lock and then reads the finished directory. A failure is
reported and the rest still run.

    python scripts/warm_caches.py            # fill what is missing (progress on stdout)
    python scripts/warm_caches.py --list     # what the suite uses: name, cache directory, cached or not
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (kind, name) in the order the suite first needs them (tests/bench, tests/draft, tests/models, tests/rl):
# the built-in models by name, the drafters by their distillation config under configs/.
SUITE_CACHES = (
    ("model", "tiny"),
    ("drafter", "distill_dflash.yaml"),
    ("drafter", "distill_eagle3.yaml"),
    ("drafter", "distill_dspark.yaml"),
    ("model", "words"),
    ("drafter", "distill_words_eagle3.yaml"),
    ("model", "calc"),
)


def cache_path(kind: str, name: str) -> Path:
    """The directory the suite's own call (``ensure_builtin_model`` / ``ensure_distilled``) fills."""
    if kind == "model":
        from cotrain.models.build_tiny import cache_dir

        return cache_dir(name)
    from cotrain.draft.cache import distilled_dir
    from cotrain.draft.distill import load_distill_config

    return distilled_dir(load_distill_config(ROOT / "configs" / name))


def is_cached(kind: str, path: Path) -> bool:
    if kind == "model":
        from cotrain.models.build_tiny import is_built

        return is_built(path)
    from cotrain.draft.cache import is_distilled

    return is_distilled(path)


def fill(kind: str, name: str) -> None:
    if kind == "model":
        from cotrain.models.build_tiny import ensure_builtin_model

        ensure_builtin_model(name, progress=False)
    else:
        from cotrain.draft.cache import ensure_distilled

        ensure_distilled(ROOT / "configs" / name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the caches and whether each is filled; build nothing")
    ap.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority by this much first")
    a = ap.parse_args(argv)
    if a.list:
        for kind, name in SUITE_CACHES:
            path = cache_path(kind, name)
            print(f"{kind:8s} {name:28s} {'cached ' if is_cached(kind, path) else 'missing'} {path}")
        return 0
    if a.nice:
        os.nice(a.nice)
    # SIGTERM as an exception: the builders' cleanup removes their temporary folder
    def stop(*_):
        print("[warm_caches] stopped", flush=True)
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop)
    failed = 0
    t0 = time.time()
    for kind, name in SUITE_CACHES:
        t = time.time()
        try:
            fill(kind, name)
        except Exception as e:  # the suite builds it itself and reports the error there
            failed += 1
            print(f"[warm_caches] {kind} {name}: FAILED ({type(e).__name__}: {e})", flush=True)
            continue
        print(f"[warm_caches] {kind} {name}: ready after {time.time() - t:.0f} s", flush=True)
    print(f"[warm_caches] done in {time.time() - t0:.0f} s, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
