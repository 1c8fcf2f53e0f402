# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures. Tests run inside the primary pin's env (see ci/test.sh)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import envs  # noqa: E402  (tools/envs.py: the env builder, also the venv locator)

from vllm_ext import compat  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: starts real vLLM engines (slow, run serially)")


@pytest.fixture(scope="session")
def pins() -> dict[str, compat.Pin]:
    return compat.load_pins()


def pin_python(version: str) -> Path:
    """The python of a pinned env; skips cleanly is not an option: the env must exist."""
    py = envs.venv_python(version)
    assert py.exists(), f"env for vLLM {version} missing: run `python3 tools/envs.py build`"
    return py


def run_in_pin(version: str, code: str, env: dict[str, str] | None = None, timeout: float = 180):
    """Run ``code`` in a fresh interpreter of the pin's env; returns CompletedProcess."""
    import os

    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [str(pin_python(version)), "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
    )


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from vllm_ext.testing.tiny_model import build_tiny_model

    return build_tiny_model()
