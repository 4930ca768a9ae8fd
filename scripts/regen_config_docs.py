"""Regenerate the schema-derived files: configs/base.yaml and docs/config.md's reference tables.

    .venv/bin/python scripts/regen_config_docs.py

docs/config.md keeps its hand-written text; the reference (from the first ``### `run``` heading to
the end of the ``checkpoint`` table) is replaced by ``python -m cotrain.config.docgen --markdown``.
"""

from __future__ import annotations

import re
from pathlib import Path

from cotrain.config.docgen import base_yaml, reference_markdown

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    (ROOT / "configs" / "base.yaml").write_text(base_yaml())
    doc_path = ROOT / "docs" / "config.md"
    doc = doc_path.read_text()
    new = reference_markdown()
    start = doc.index("### `run`")
    # the old reference ends at the last table row of the checkpoint section (rows start with "| `")
    m = re.compile(r"### `checkpoint`\n.*?(?:\n\| `[^\n]*)+\n?", re.S).search(doc, start)
    if m is None:
        raise SystemExit("docs/config.md: cannot find the end of the checkpoint table")
    end = m.end()
    if not new.endswith("\n"):
        new += "\n"
    doc_path.write_text(doc[:start] + new + doc[end:])
    print("wrote configs/base.yaml and docs/config.md")


if __name__ == "__main__":
    main()
