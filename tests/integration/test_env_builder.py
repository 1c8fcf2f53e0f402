# SPDX-License-Identifier: Apache-2.0
"""The env builder is idempotent: a second run changes nothing and takes seconds."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from support import REPO, envs


@pytest.mark.timeout(120)
def test_second_build_is_a_noop() -> None:
    pins = envs.load_pins()["pins"]
    stamps = {v: (envs.venv_dir(v) / envs.STAMP_NAME).stat().st_mtime_ns for v in pins}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "envs.py"), "build"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    for v in pins:
        assert f"[env {v}" in proc.stdout and "up to date" in proc.stdout
        assert (envs.venv_dir(v) / envs.STAMP_NAME).stat().st_mtime_ns == stamps[v]
    assert "installing" not in proc.stdout
    assert took < 20, f"second run took {took:.1f}s"


def test_unknown_pin_is_a_clear_error() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "envs.py"), "build", "--pin", "9.9.9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown pin" in proc.stderr and "0.23.0" in proc.stderr
