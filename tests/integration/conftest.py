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
