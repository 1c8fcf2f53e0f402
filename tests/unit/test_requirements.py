# SPDX-License-Identifier: Apache-2.0
"""Every requirement id cited in the code, the tests and the docs is defined in
docs/requirements.md."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ID = re.compile(r"\bS-[A-Z]+-\d+\b")
#: A definition: the id in the first column of a table row.
DEFINED = re.compile(r"^\| (S-[A-Z]+-\d+) \| .+ \|$", re.MULTILINE)


def _cited() -> dict[str, set[str]]:
    cited: dict[str, set[str]] = {}
    paths = [
        *(REPO / "vllm_ext").rglob("*.py"),
        *(REPO / "devkit").rglob("*.py"),
        *(REPO / "tests").rglob("*.py"),
        *(REPO / "docs").glob("*.md"),
        REPO / "README.md",
    ]
    for path in paths:
        for rid in ID.findall(path.read_text(errors="replace")):
            cited.setdefault(rid, set()).add(str(path.relative_to(REPO)))
    return cited


def test_every_cited_requirement_is_defined() -> None:
    page = (REPO / "docs" / "requirements.md").read_text()
    defined = DEFINED.findall(page)
    assert len(defined) == len(set(defined)), "an id is defined twice"
    cited = _cited()
    assert cited, "no requirement id found: the pattern is wrong"
    missing = {rid: sorted(paths) for rid, paths in cited.items() if rid not in defined}
    assert not missing, f"cited but not defined in docs/requirements.md: {missing}"
