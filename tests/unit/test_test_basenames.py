# SPDX-License-Identifier: Apache-2.0
"""pytest imports each test folder's files as top-level modules (no packages, the default
import mode), so two test files of one basename in different folders break the collection
of whichever comes second in a run that collects both ("import file mismatch"), as the CI's
first run does."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if "__pycache__" not in path.parts and path.name != "__init__.py":
            seen[path.name].append(str(path.relative_to(TESTS)))
    shared = {
        name: paths for name, paths in seen.items() if len(paths) > 1 and name != "conftest.py"
    }
    assert not shared, f"test modules that share a basename: {shared}"
