"""scripts/warm_caches.py (``make warm``): it warms every built-in model and
distilled drafter the tests ask for, at the directories the tests' own calls fill, and a failure
there is reported without stopping the rest."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _warm():
    spec = importlib.util.spec_from_file_location("warm_caches", ROOT / "scripts" / "warm_caches.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _names_the_tests_ask_for() -> tuple[set, set]:
    """(built-in model names, distillation config files) named at the tests' call sites: the model
    fixtures, ``_serving.prepare`` / ``distilled`` (config ``distill_<config or kind>.yaml``, the kind
    often a module's ``KIND``) and ``ensure_distilled`` of a config file."""
    models, configs = set(), set()
    for path in (ROOT / "tests").rglob("*.py"):
        text = path.read_text()
        models |= set(re.findall(r'(?:builtin_model_path|target_of|hf_target_of|ensure_builtin_model)\("(\w+)"\)', text))
        if re.search(r"\btiny_model_path\b", text):
            models.add("tiny")
        kind = re.search(r'^KIND(?:, \w+)? = "(\w+)"', text, re.M)
        for args in re.findall(r"\bS\.(?:prepare|distilled)\(([^)]*)\)", text):
            config = re.search(r'config="(\w+)"', args)
            first = args.split(",")[0].strip()
            name = config.group(1) if config else (kind.group(1) if first == "KIND" else first.strip('"'))
            configs.add(f"distill_{name}.yaml")
        configs |= set(re.findall(r'ensure_distilled\(ROOT / "configs" / "(distill_\w+\.yaml)"\)', text))
    return models, configs


def test_every_cache_the_tests_name_is_warmed():
    models, configs = _names_the_tests_ask_for()
    assert {"tiny", "words", "calc"} <= models and {"distill_dflash.yaml", "distill_words_eagle3.yaml"} <= configs
    # the drafters benchmark (run --quick by tests/bench/test_bench_smoke.py) distills every family's config
    families = re.search(r"^FAMILIES = \{([^}]*)\}", (ROOT / "bench" / "drafters.py").read_text(), re.M).group(1)
    configs |= {f"distill_{kind}.yaml" for kind in re.findall(r'"(\w+)":', families)}
    warm = _warm().SUITE_CACHES
    assert {n for k, n in warm if k == "model"} == models
    assert {n for k, n in warm if k == "drafter"} == configs


def test_list_prints_the_directories_the_suites_calls_fill():
    from cotrain.draft.cache import distilled_dir
    from cotrain.draft.distill import load_distill_config
    from cotrain.models.build_tiny import cache_dir

    r = subprocess.run([sys.executable, "scripts/warm_caches.py", "--list"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()]
    assert [(k, n) for k, n, *_ in rows] == list(_warm().SUITE_CACHES)
    for kind, name, state, path in rows:
        want = cache_dir(name) if kind == "model" else distilled_dir(load_distill_config(ROOT / "configs" / name))
        assert Path(path) == want and state in ("cached", "missing")
        assert (state == "cached") == (want / ("cotrain_build.json" if kind == "model" else "metrics.json")).exists()


def test_a_failing_entry_is_reported_and_the_rest_still_run(monkeypatch, capsys):
    warm = _warm()
    done = []

    def fill(kind, name):
        if name == "broken":
            raise ValueError("no such thing")
        done.append(name)

    monkeypatch.setattr(warm, "SUITE_CACHES", (("model", "broken"), ("drafter", "distill_dflash.yaml")))
    monkeypatch.setattr(warm, "fill", fill)
    monkeypatch.setattr(warm.signal, "signal", lambda *a: None)  # leave pytest's SIGTERM handling alone
    assert warm.main([]) == 1
    out = capsys.readouterr().out
    assert "model broken: FAILED (ValueError: no such thing)" in out
    assert done == ["distill_dflash.yaml"] and "1 failed" in out
