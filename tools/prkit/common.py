# SPDX-License-Identifier: Apache-2.0
"""Shared pieces of the PR kit: errors, subprocess/git helpers, progress lines."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))

from vllm_ext import patchtool  # noqa: E402

#: Committer of scratch commits that never leave the kit (refresh's work clone).
SCRATCH_IDENTITY = {
    "GIT_AUTHOR_NAME": "vllm-ext refresh",
    "GIT_AUTHOR_EMAIL": "refresh@vllm-ext.invalid",
    "GIT_COMMITTER_NAME": "vllm-ext refresh",
    "GIT_COMMITTER_EMAIL": "refresh@vllm-ext.invalid",
}


class KitError(RuntimeError):
    """A failure to report as is (the message names what does not pass)."""

    exit_code = 1


class UsageError(KitError):
    """Bad usage or a refusal (no identity, a reserved identity): exit status 2."""

    exit_code = 2


def run(
    args: Sequence[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``args``; never raises for a non-zero exit (``returncode`` tells)."""
    return subprocess.run(
        list(args),
        cwd=cwd,
        env={**os.environ, **(env or {})},
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def git(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    res = run(["git", *args], cwd, env)
    if res.returncode != 0:
        raise KitError(f"git {' '.join(args)} failed in {cwd}:\n{res.stderr.strip()}")
    return res.stdout


class Progress:
    """One line per step, with the time since the start, flushed at once."""

    def __init__(self, quiet: bool = False) -> None:
        self.t0 = time.monotonic()
        self.quiet = quiet

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)


def short(path: str, limit: int = 60) -> str:
    return path if len(path) <= limit else "..." + path[-(limit - 3) :]


__all__ = ["KitError", "Progress", "UsageError", "git", "patchtool", "run", "REPO"]
