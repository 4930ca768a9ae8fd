"""No file of the repository points outside it: no absolute path of a machine (a checkout, a home,
a cache), no tracker reference ("issue" and a number), no notes kept beside the checkout. Scans
every tracked or untracked-but-not-ignored text file, committed benchmark results included."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: (what, pattern); this file, whose examples match them, is the one file not scanned
RULES = [
    ("a machine's absolute path", re.compile(r"(?<![\w.~/-])/(?:work|root|home|Users)/[\w.]")),
    ("a script outside the repository", re.compile(r"(?<![\w.~/-])/tmp/[\w./-]*\.(?:py|sh)\b")),
    ("a tracker reference", re.compile(r"\bissues?[ -]?#?\d+", re.I)),
    ("notes outside the repository", re.compile(r"STACK\.md|\.\./shared")),
]
#: a JSON string that starts with "/" is a recorded absolute path
JSON_ABS = re.compile(r'"/[^"/\s][^"]*"')


def _files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                             capture_output=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the file list is git's")
    me = Path(__file__).resolve()
    return [ROOT / n for n in out.decode().split("\0") if n and (ROOT / n).is_file() and (ROOT / n).resolve() != me]


def _hits(path: Path) -> list[str]:
    raw = path.read_bytes()
    if b"\0" in raw[:8192]:
        return []  # binary
    text = raw.decode("utf-8", errors="replace")
    rules = RULES + ([("a recorded absolute path", JSON_ABS)] if path.suffix == ".json" else [])
    out = []
    for what, rx in rules:
        for m in rx.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append(f"{path.relative_to(ROOT)}:{line}: {what}: {m.group(0)[:60]!r}")
    return out


def test_no_file_points_outside_the_repository():
    hits = [h for p in _files() for h in _hits(p)]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("text, what", [
    ("see /work/main/x.py", "a machine's absolute path"), ('"target":"/root/.cache/x"', "a machine's absolute path"),
    ("python /tmp/drift.py", "a script outside the repository"), ("as in Issue #12", "a tracker reference"),
    ("(issue 17)", "a tracker reference"), ("(#path-issue-17)", "a tracker reference"), ("../shared/seeds", "notes outside the repository"),
])
def test_each_rule_catches_its_kind(tmp_path, text, what):
    f = tmp_path / "x.md"
    f.write_text(f"line one\n{text}\n")
    hits = _hits_at(f, tmp_path)
    assert len(hits) == 1 and f"x.md:2: {what}" in hits[0]


def test_defaults_and_relative_paths_pass(tmp_path):
    f = tmp_path / "x.json"
    f.write_text('{"out": "bench/results/x.json", "target": "$COTRAIN_CACHE/tiny", "key": "time/step",\n'
                 ' "cmd": "mktemp -d /tmp/gpu_check.XXXXXX", "cache": "~/.cache/cotrain", "url": "https://a.b/home/x"}')
    assert _hits_at(f, tmp_path) == []
    f.write_text('{"out": "/data/x.json"}')
    assert len(_hits_at(f, tmp_path)) == 1


def _hits_at(path: Path, root: Path) -> list[str]:
    global ROOT
    old, ROOT = ROOT, root
    try:
        return _hits(path)
    finally:
        ROOT = old
