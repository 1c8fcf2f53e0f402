# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures. Tests run inside the primary pin's env (see ci/test.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_ext import compat


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: starts real vLLM engines (slow, run serially)")


@pytest.fixture(scope="session")
def pins() -> dict[str, compat.Pin]:
    return compat.load_pins()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from vllm_ext.testing.tiny_model import build_tiny_model

    return build_tiny_model()
