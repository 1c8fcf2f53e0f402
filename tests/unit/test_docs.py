# SPDX-License-Identifier: Apache-2.0
"""README.md and docs/ state what is true now (docs/results/ keeps the history): every
``vllm_ext.*`` module they name exists, and they cite no issue numbers, no internal
machine labels and no path outside the repository."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [REPO / "README.md"]
    + [p for p in (REPO / "docs").rglob("*.md") if "results" not in p.relative_to(REPO).parts]
)
#: ``vllm_ext.a.b`` (a module, or an attribute of one: the longest importable prefix counts)
MODULE = re.compile(r"\bvllm_ext(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
#: This project's issue numbers ("issue 15", "#13"). vLLM's issues and PRs (five digits:
#: "#48633", or named by repository: ``router#187``) are references a reader can follow;
#: docs/examples/ holds pull request bodies for vLLM, whose "issue #n" are vLLM's.
RULES = {
    "an issue number": re.compile(r"\bissues?[ -]#?\d+\b|(?<![\w/])#\d{1,3}\b", re.I),
    "a machine label": re.compile(r"\bnvidia-[a-z0-9]+-x\d+\b|\bh200-x\d\b", re.I),
    "a path outside the repository": re.compile(r"\.\./shared\b|(?<![\w.])\.\./\.\./"),
}


def _module_exists(dotted: str) -> bool:
    """The name, or its longest prefix that is a module with the rest as attributes."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        if n == len(parts):
            return True
        # the rest must be defined in that module's source (no import: cheap and safe)
        origin = spec.origin
        if origin is None or not origin.endswith(".py"):
            return False
        source = Path(origin).read_text()
        return re.search(rf"^\s*(?:def |class )?{parts[n]}\b", source, re.M) is not None
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_named_module_exists(doc: Path) -> None:
    missing = sorted({m for m in MODULE.findall(doc.read_text()) if not _module_exists(m)})
    assert not missing, f"{doc.name} names modules that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_issue_numbers_machine_labels_or_outside_paths(doc: Path) -> None:
    found = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for what, rule in RULES.items():
            if what == "an issue number" and "examples" in doc.relative_to(REPO).parts:
                continue
            for m in rule.finditer(line):
                found.append(f"{doc.name}:{n}: {what}: {m.group(0)!r}")
    assert not found, "\n".join(found)


def test_the_rules_catch_what_they_are_for() -> None:
    assert RULES["an issue number"].search("## Bounded quarantine (issue 15)")
    assert RULES["an issue number"].search("see #13")
    assert RULES["a machine label"].search("measured on nvidia-h200-x2")
    assert RULES["a path outside the repository"].search("see ../shared/GPU.md")
    assert not RULES["an issue number"].search("S-SAFE-1 and N-REL-1, 2 issues remain")
    assert not RULES["an issue number"].search("tracked in vllm#48633 and router#187")
    assert _module_exists("vllm_ext.nixl_push.config.PushConfig")
    assert not _module_exists("devkit.bench.router_push")
