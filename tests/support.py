# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by tests (importable as ``support`` from any test module)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))

import envs  # noqa: E402  (tools/envs.py: the env builder, also the venv locator)


def pin_python(version: str) -> Path:
    """The python of a pinned env (it must exist: ci/test.sh builds it first)."""
    py = envs.venv_python(version)
    assert py.exists(), f"env for vLLM {version} missing: run `python3 tools/envs.py build`"
    return py


def run_in_pin(
    version: str, code: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter of the pin's env."""
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
