# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the push integration tests (real vLLM workers over the fake NIXL)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from push_harness import PushEnv, open_push_env


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
