"""The house stays acyclic: no cotrain module imports itself through others, at any depth of the code
(module level or inside a function: a lazy import that breaks a circle at import time still ties
the two files together). ``if TYPE_CHECKING:`` imports (annotations only) do not count; a package
importing its own submodules (its ``__init__``) is not a circle."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    out = {}
    for p in (ROOT / "cotrain").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _runtime_imports(tree: ast.AST):
    """Import nodes outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for m, path in mods.items():
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if not (node.module or "").startswith("cotrain"):
                    continue
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            else:
                targets = [a.name for a in node.names if a.name.startswith("cotrain")]
            for t in map(resolve, targets):
                if t and t != m and not (mods[m].name == "__init__.py" and t.startswith(m + ".")):
                    graph[m].add(t)
    return graph


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_module_imports_itself_through_others():
    g = import_graph()
    assert len(g) > 100
    assert not cycles(g), f"import circles: {cycles(g)}"
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # (the finder finds)


def test_the_checker_sees_lazy_imports():
    """(So that a clean result means something.) The driver imports the drafter cache inside a
    function, and the trainer imports the weights layer inside one."""
    g = import_graph()
    assert "cotrain.draft.cache" in g["cotrain.rl.driver"]
    assert "cotrain.weights" in g["cotrain.rl.trainer"] or any(t.startswith("cotrain.weights") for t in g["cotrain.rl.trainer"])


def test_the_package_imports_nothing_beside_it():
    """cotrain imports neither the test oracles (``reference``) nor the tests, benchmarks, scripts or
    launchers beside it, at any depth: the installed package stands alone."""
    beside = {"reference", "tests", "bench", "scripts", "launch"}
    bad = []
    for p in (ROOT / "cotrain").rglob("*.py"):
        for node in _runtime_imports(ast.parse(p.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bad += [f"{p.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in beside]
    assert not bad, bad


def test_generic_drafter_code_imports_no_family():
    """The online trainer and SpecOPD ask the kind's record (``registry.record_of``) what a family
    needs; they import no family module (EAGLE-3, DFlash, DSpark), at any depth of the code."""
    g = import_graph()
    families = {"cotrain.draft.eagle3", "cotrain.draft.dflash", "cotrain.draft.dspark"}
    for m in ("cotrain.draft.online", "cotrain.draft.specopd"):
        assert not g[m] & families, (m, sorted(g[m] & families))
    assert "cotrain.draft.registry" in g["cotrain.draft.online"]  # (the checker sees the edges)
