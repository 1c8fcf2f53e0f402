# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the push integration tests (real vLLM workers over the fake NIXL)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from push_engine import Engine
from push_harness import PushEnv, open_push_env

from devkit.testing.fake_nixl import FakeNixlAgent


@pytest.fixture(autouse=True)
def _loaded_machine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--step-delay-s`` / ``--poll-delay-s`` (tests/conftest.py): every engine step, or
    every poll of the fake NIXL (the writer threads' and the engines'), sleeps that long
    first, as on a loaded machine. Off (0) by default."""
    step_s = request.config.getoption("--step-delay-s")
    poll_s = request.config.getoption("--poll-delay-s")
    if step_s > 0:
        _slow(monkeypatch, Engine, "engine_step", step_s)
    if poll_s > 0:
        for method in ("check_xfer_state", "get_new_notifs"):
            _slow(monkeypatch, FakeNixlAgent, method, poll_s)


def _slow(monkeypatch: pytest.MonkeyPatch, cls: type, method: str, delay_s: float) -> None:
    orig = getattr(cls, method)

    def slow(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(delay_s)
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, slow)


@pytest.fixture
def env(tiny_model: Path) -> Iterator[PushEnv]:
    with open_push_env(tiny_model) as e:
        yield e


@pytest.fixture(params=[False, True], ids=["sync-scheduling", "async-scheduling"])
def env_both_ways(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[PushEnv]:
    """:func:`env` with vLLM's synchronous scheduling, then with its asynchronous one
    (its default on GPU engines: each step is scheduled before the previous step's
    output is processed)."""
    with open_push_env(tiny_model, async_scheduling=request.param) as e:
        yield e
