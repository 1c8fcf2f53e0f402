# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures. Tests run inside the primary pin's env (see ci/test.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_ext import compat


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: starts real vLLM engines (slow, run serially)")
    config.addinivalue_line(
        "markers",
        "faults: the long fault-injection tests (tests/e2e/test_faults.py); they run only "
        "when the -m expression names them, e.g. pytest -m faults",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``faults`` tests stay out of the default runs (``-m e2e``, ``-m "not e2e"``):
    deselected, not skipped, unless the -m expression names them."""
    if "faults" in (config.option.markexpr or ""):
        return
    heavy = [item for item in items if item.get_closest_marker("faults") is not None]
    if heavy:
        config.hook.pytest_deselected(items=heavy)
        items[:] = [item for item in items if item.get_closest_marker("faults") is None]


@pytest.fixture(scope="session")
def pins() -> dict[str, compat.Pin]:
    return compat.load_pins()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from vllm_ext.testing.tiny_model import build_tiny_model

    return build_tiny_model()
