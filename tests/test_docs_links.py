"""Every relative link in the README and docs/ leads somewhere: the file it names exists, and a
``#fragment`` names a heading of that page, by the rule GitHub uses to make a heading's anchor
(lowercase; everything but letters, digits, spaces, ``-`` and ``_`` dropped; spaces to ``-``; a
repeated heading gets ``-1``, ``-2``, ...). Links inside fenced code blocks are not links."""

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def anchor(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text()):
        m = HEADING.match(line)
        if m:
            a = anchor(m.group(1))
            n = seen.get(a, 0)
            out.add(a if n == 0 else f"{a}-{n}")
            seen[a] = n + 1
    return frozenset(out)


def test_anchor_rule_by_hand():
    assert anchor("Why the offline T = 1 walk fell below vLLM: the samples, not the walk") == \
        "why-the-offline-t--1-walk-fell-below-vllm-the-samples-not-the-walk"
    assert anchor("10,240 steps, with `accept_weighted_tv` (DFlash)") == "10240-steps-with-accept_weighted_tv-dflash"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_and_fragments_resolve(page):
    bad = []
    for n, line in enumerate(_prose(page.read_text()), 1):
        for target in LINK.findall(line) + IMAGE.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, frag = target.partition("#")
            dest = page if not path else (page.parent / path).resolve()
            if not dest.exists():
                bad.append(f"{target}: no such file")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                bad.append(f"{target}: no heading with this anchor in {dest.name}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)
