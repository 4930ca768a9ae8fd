"""Which installed packages do the GPU tests (and the GPU measurements) import, and does the GPU machine have them?

    python scripts/gpu_imports.py [--json FILE] [--check] TARGET...
    python scripts/gpu_imports.py [--json FILE] [--check] --gpu-check    # what the GPU check runs (gpu_check_targets)

A TARGET is a Python file (a test module, a conftest, a bench script) or a dotted module name. Each is
imported in this process (a file as pytest's default "prepend" import mode would: its folder and the
repository's tests/ folder first on sys.path), then every top-level package that appeared in
``sys.modules`` is mapped to the installed distribution whose files hold it (from each distribution's
RECORD: vendored packages such as setuptools/_vendor/jaraco count as setuptools). Left out: the
standard library (``sys.stdlib_module_names``) and modules loaded from inside the repository.

What the GPU machine can import (``allowed_distributions``): the wheels the check carries
(scripts/gpu_wheels.txt), the machine's own packages (scripts/gpu_machine.txt) and everything those
require, transitively, as this machine's installed metadata says (extras not taken). A package is
``outside`` when its distribution is none of those, unless the module that first imported it belongs to
one of the machine's own packages (recorded by a meta-path finder while importing): those come with
their own requirements there and import their optional extras (e.g. sniffio) only when present.

The JSON: ``{"targets": [...], "errors": {target: "Type: message"}, "skipped": {target: reason}, "packages": {top-level name:
distribution or null}, "outside": [top-level names whose distribution neither list carries]}``.
``--check`` exits 1 when ``errors`` or ``outside`` is not empty. Importing only: a module that imports
a package inside a function is covered by running it (the measurements record what they loaded).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "scripts" / "gpu_wheels.txt"
MACHINE = ROOT / "scripts" / "gpu_machine.txt"


#: modules the GPU measurements import inside functions (run there by scripts/gpu_check.sh)
MEASUREMENT_MODULES = ("cotrain.config", "cotrain.rl.trainer", "cotrain.rl.draft_stage", "cotrain.rl.calibrate")


def cotrain_imports(path: Path) -> list[str]:
    """The cotrain modules a file imports anywhere, also inside functions (spawned helpers, lazy imports)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return sorted(n for n in names if n == "cotrain" or n.startswith("cotrain."))


def gpu_check_targets() -> list[str]:
    """Everything scripts/gpu_check.sh runs on the GPU machine: the test folder's conftests and files,
    the measurements' scripts, and the cotrain modules any of them imports lazily (inside functions or
    spawned helpers) plus MEASUREMENT_MODULES."""
    files = [ROOT / "tests" / "conftest.py", *sorted((ROOT / "tests" / "gpu").glob("*.py")),
             *sorted((ROOT / "bench").glob("gpu_*.py")), ROOT / "bench" / "cp_attention.py", ROOT / "bench" / "tapchannel.py"]
    files = [f for f in files if f.exists()]
    modules = sorted({m for f in files for m in cotrain_imports(f)} | set(MEASUREMENT_MODULES))
    return [str(f.relative_to(ROOT)) for f in files] + modules


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path) -> dict[str, str | None]:
    """canonical name -> pinned version (None when the line gives none) of a requirement list."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        out[canonical(name)] = version.strip() or None
    return out


def _requires(dist_name: str) -> list[str]:
    from importlib import metadata

    try:
        reqs = metadata.distribution(dist_name).requires or []
    except metadata.PackageNotFoundError:
        return []
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover - pip vendors it
        from pip._vendor.packaging.requirements import Requirement
    out = []
    for r in reqs:
        try:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                out.append(canonical(req.name))
        except Exception:  # noqa: BLE001 - a malformed requirement in someone's metadata: not ours to judge
            continue
    return out


def allowed_distributions() -> set[str]:
    """Distributions importable on the GPU machine: the carried wheels, the machine's packages and
    their requirements (transitively)."""
    todo = list(read_list(MACHINE))
    seen = set(todo)
    while todo:
        for dep in _requires(todo.pop()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen | set(read_list(WHEELS))


def _file_owners() -> dict[str, str]:
    """absolute file path -> canonical distribution name, for every installed distribution. A file
    that two distributions record (setuptools vendors others' dist-info in setuptools/_vendor) goes
    to the one installed outermost (setuptools)."""
    from importlib import metadata

    owners, depth = {}, {}
    for dist in metadata.distributions():
        if not dist.metadata["Name"]:  # a broken installation without metadata
            continue
        name = canonical(dist.metadata["Name"])
        d = len(Path(str(dist.locate_file(""))).resolve().parts)
        for f in dist.files or []:
            try:
                path = str(Path(dist.locate_file(f)).resolve())
            except (OSError, ValueError):
                continue
            if path not in owners or d < depth[path]:
                owners[path], depth[path] = name, d
    return owners


class ImporterLog(importlib.abc.MetaPathFinder):
    """Records, for every top-level package, the module that first imported it (finds nothing itself)."""

    def __init__(self):
        self.first: dict[str, str] = {}

    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top not in self.first:
            f = sys._getframe(1)
            while f is not None:
                who = f.f_globals.get("__name__") or ""
                if who and not who.startswith(("importlib", "_frozen_importlib")) and who.split(".")[0] != top:
                    self.first[top] = who
                    break
                f = f.f_back
        return None


def import_target(target: str) -> None:
    path = Path(target)
    if path.suffix == ".py":
        path = path.resolve()
        for d in (ROOT / "tests", path.parent):
            if str(d) not in sys.path:
                sys.path.insert(0, str(d))
        name = "gpu_imports_" + re.sub(r"\W", "_", str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.stem)
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    else:
        importlib.import_module(target)


def loaded_packages(before: set[str] | None = None) -> dict[str, str | None]:
    """top-level name -> owning distribution of the non-standard-library modules in sys.modules
    (those in ``before`` left out) that are not loaded from the repository or the Python
    installation. A namespace package (no file of its own, e.g. google) is judged by its loaded
    subpackages, named ``google.protobuf``."""
    import sysconfig

    owners = _file_owners()
    stdlib = str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + "/"
    out = {}
    for name, mod in sorted(sys.modules.items()):
        parts = name.split(".")
        top = parts[0]
        if (before and name in before) or top in sys.stdlib_module_names or top.startswith("gpu_imports_"):
            continue
        topmod = sys.modules.get(top)
        namespace = topmod is not None and getattr(topmod, "__file__", None) is None and hasattr(topmod, "__path__")
        key = ".".join(parts[:2]) if namespace else top
        if key in out or (namespace and len(parts) < 2) or (name != key and key in sys.modules):
            continue
        f = getattr(mod, "__file__", None)
        if f is None:
            continue  # built-in or synthetic (e.g. __mp_main__)
        f = str(Path(f).resolve())
        if f.startswith(stdlib) and "site-packages" not in f:
            continue  # the Python installation (e.g. _sysconfigdata_*)
        if f.startswith(str(ROOT) + "/") and "site-packages" not in f:
            continue  # cotrain, tests, bench
        out[key] = owners.get(f)
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("targets", nargs="*")
    ap.add_argument("--gpu-check", action="store_true", help="add the GPU check's targets (gpu_check_targets)")
    ap.add_argument("--json", help="write the result here too")
    ap.add_argument("--check", action="store_true", help="exit 1 on an import error or a package neither list carries")
    args = ap.parse_args(argv)
    if args.gpu_check:
        args.targets = [*args.targets, *gpu_check_targets()]
    if not args.targets:
        ap.error("no TARGET (give files or modules, or --gpu-check)")
    log = ImporterLog()
    sys.meta_path.insert(0, log)
    before = set(sys.modules)
    errors, skipped = {}, {}
    for t in args.targets:
        try:
            import_target(t)
        except BaseException as e:  # noqa: BLE001 - a skip or an import error: both are results
            if type(e).__name__ == "Skipped":  # pytest.skip(allow_module_level=True) / importorskip
                skipped[t] = str(e)[:300]
            else:
                errors[t] = f"{type(e).__name__}: {str(e)[:300]}"
    sys.meta_path.remove(log)
    packages = loaded_packages(before)
    allowed = allowed_distributions()
    machine = allowed - set(read_list(WHEELS))
    owners = _file_owners()
    importers, outside = {}, []
    for key, dist in packages.items():
        who = log.first.get(key.split(".")[0])
        mod = sys.modules.get(who or "")
        f = getattr(mod, "__file__", None)
        who_dist = owners.get(str(Path(f).resolve())) if f else None
        importers[key] = f"{who} ({who_dist})" if who_dist else who
        if (dist is None or dist not in allowed) and who_dist not in machine:
            outside.append(key)
    result = {"targets": args.targets, "errors": errors, "skipped": skipped, "packages": packages,
              "importers": importers, "outside": outside}
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 1 if args.check and (errors or outside) else 0


if __name__ == "__main__":
    sys.exit(main())
