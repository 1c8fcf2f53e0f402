# SPDX-License-Identifier: Apache-2.0
"""The env builder retries a pip install that the network cut short, and only that."""

from __future__ import annotations

import pytest
from support import envs

CUT = "ERROR: Download failed after 6 attempts because not enough bytes were received (151/423 MB)"


class _Builder(envs.Builder):
    """A Builder whose commands are scripted: each run() pops the next outcome."""

    def __init__(self, outcomes: list[str | None]) -> None:
        self.outcomes = outcomes
        self.calls = 0
        self.said: list[str] = []

    def run(self, *args: str, what: str) -> str:
        self.calls += 1
        err = self.outcomes.pop(0)
        if err is not None:
            raise envs.BuildError(f"{what} failed (exit 1):\n{err}")
        return "ok"

    def say(self, step: str) -> None:
        self.said.append(step)

    @property
    def py(self):  # type: ignore[no-untyped-def,override]
        return "python"


@pytest.fixture(autouse=True)
def _no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envs.time, "sleep", lambda s: None)


def test_a_cut_download_is_retried_until_it_succeeds() -> None:
    b = _Builder([CUT, CUT, None])
    assert b.pip("torch==2.11.0", what="installing torch") == "ok"
    assert b.calls == 3 and len(b.said) == 2 and "network error" in b.said[0]


def test_retries_are_bounded() -> None:
    b = _Builder([CUT] * envs.PIP_ATTEMPTS)
    with pytest.raises(envs.BuildError, match="not enough bytes"):
        b.pip("torch==2.11.0", what="installing torch")
    assert b.calls == envs.PIP_ATTEMPTS


def test_other_failures_are_not_retried() -> None:
    b = _Builder(["ERROR: No matching distribution found for torch==9.9", None])
    with pytest.raises(envs.BuildError, match="No matching distribution"):
        b.pip("torch==9.9", what="installing torch")
    assert b.calls == 1
