# SPDX-License-Identifier: Apache-2.0
"""What a check of the PR kit reports, and the options the checks run with.

A check ends in ``pass`` or ``fail``, or in ``skip`` where it has nothing to check (no
Python files, no test files) or was left out on request (``--skip``). A check that
should have run but *could not* (its tool missing or failing to start, no ``--python``
for the tests, a timeout, every test skipped) is marked ``could_not_run``: the kit
fails the run for it unless ``--allow-skip NAME`` accepts it, and the PR description
says it did not run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

#: The names ``--skip`` and ``--allow-skip`` take.
CHECK_NAMES = ("ruff", "spdx", "mypy", "pytest")


@dataclass
class CheckResult:
    check: str  # "ruff check", "ruff format", "SPDX header", "mypy", "pytest"
    status: str  # "pass", "fail" or "skip"
    summary: str
    files: list[str] = field(default_factory=list)
    patches: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # "file:line: message (patch)"
    command: str = ""
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    note: str = ""  # how it ran, where that differs from vLLM's CI
    could_not_run: bool = False  # it should have run here and did not (see above)
    allowed: bool = False  # ... and --allow-skip accepted that

    def line(self) -> str:
        who = f" [{', '.join(_short_names(self.patches))}]" if self.patches else ""
        return f"{self.status.upper():<4} {self.check}{who}: {self.summary}"

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def _short_names(names: list[str]) -> list[str]:
    return [n.split("-", 1)[0] for n in names]


@dataclass
class CheckOptions:
    python: Path | None = None  # the pin's env interpreter (mypy, pytest)
    mypy_timeout: float = 600.0
    test_timeout: float = 14400.0
    skip: tuple[str, ...] = ()  # check names to skip ("ruff", "spdx", "mypy", "pytest")
    allow_skip: tuple[str, ...] = ()  # checks that may fail to run without failing the run
    # The vLLM release of --python's env when it is not the tree's: its compiled
    # extensions are used under the tree's sources (a release with no CPU wheel).
    compiled_from: str | None = None
    # "folder": the whole folder of each test file a patch touches; "files": those files.
    test_scope: str = "folder"
    # Only these test files (tree paths) of those folders or files, where given.
    test_files: tuple[str, ...] = ()
    # Local stand-ins for the hub models the tests name and triton-cpu (prkit.standins).
    stand_ins: bool = True


def not_run(check: str, why: str, **kwargs) -> CheckResult:
    """A check that could not run here (see the module docstring)."""
    return CheckResult(check, "skip", why, could_not_run=True, **kwargs)
