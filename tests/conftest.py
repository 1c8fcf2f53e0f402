# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures. Tests run inside the primary pin's env (see ci/test.sh)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import vllm_ext
from vllm_ext import compat


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vllm-ext", "vllm-ext test harness")
    group.addoption(
        "--step-delay-s", type=float, default=0.0, metavar="S",
        help="integration harness: sleep S seconds before every engine step (a loaded "
        "machine's slow steps: finds tests that hold on timing, not on a condition)",
    )  # fmt: skip
    group.addoption(
        "--poll-delay-s", type=float, default=0.0, metavar="S",
        help="integration harness: the fake NIXL sleeps S seconds in every "
        "check_xfer_state and get_new_notifs (slow writer threads and completions)",
    )  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    mutant_root = os.environ.get("VLLM_EXT_MUTANT_ROOT")
    if mutant_root and Path(vllm_ext.__file__).parent.resolve() != Path(mutant_root).resolve():
        # tests/integration/test_mutants.py: a run meant for a mutant must test it
        raise pytest.UsageError(
            f"VLLM_EXT_MUTANT_ROOT is {mutant_root}, but vllm_ext was imported from "
            f"{Path(vllm_ext.__file__).parent}"
        )
    config.addinivalue_line("markers", "e2e: starts real vLLM engines (slow, run serially)")
    config.addinivalue_line(
        "markers",
        "faults: the long fault-injection tests (tests/e2e/test_faults.py); they run only "
        "when the -m expression names them, e.g. pytest -m faults",
    )
    config.addinivalue_line(
        "markers",
        "modelcheck_long: the long run of the push model check "
        "(tests/integration/test_push_modelcheck.py); only when the -m expression names it",
    )


#: Markers of tests that stay out of the default runs unless the -m expression names them.
OPT_IN_MARKERS = ("faults", "modelcheck_long")
#: Folders that the e2e run of ci/test.sh does not collect (importing them costs it 20 s):
#: no e2e test may live there.
NO_E2E_DIRS = ("tests/unit/", "tests/integration/")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``faults`` and ``modelcheck_long`` tests stay out of the default runs (``-m e2e``,
    ``-m "not e2e"``): deselected, not skipped, unless the -m expression names them.
    An e2e test in one of ``NO_E2E_DIRS`` is an error."""
    misplaced = [
        item.nodeid
        for item in items
        if item.get_closest_marker("e2e") is not None and item.nodeid.startswith(NO_E2E_DIRS)
    ]
    if misplaced:
        raise pytest.UsageError(
            f"e2e tests in {', '.join(NO_E2E_DIRS)}, which the e2e run of ci/test.sh does "
            f"not collect (move them to tests/e2e): {misplaced}"
        )
    markexpr = config.option.markexpr or ""
    for marker in OPT_IN_MARKERS:
        if marker in markexpr:
            continue
        heavy = [item for item in items if item.get_closest_marker(marker) is not None]
        if heavy:
            config.hook.pytest_deselected(items=heavy)
            items[:] = [item for item in items if item.get_closest_marker(marker) is None]


@pytest.fixture(scope="session")
def pins() -> dict[str, compat.Pin]:
    return compat.load_pins()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from devkit.testing.tiny_model import build_tiny_model

    return build_tiny_model()
