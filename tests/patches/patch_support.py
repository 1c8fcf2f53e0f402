# SPDX-License-Identifier: Apache-2.0
"""Helpers for the tests of the vLLM patch series and the patch tool.

Trees used here never touch the shared env: the pristine vLLM source tree comes
from ``tools/vllm_source.py`` (cached under ``~/.cache/vllm-ext``), "installed
package" targets are copies in ``tmp_path``, and an unpatched vLLM is emulated by
an overlay of the env's package (symlinks, with the patched files reverted in
real copies) put first on ``PYTHONPATH`` of a child process.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The primary pin: the one this suite's interpreter runs (its env is the patched one).
PIN = "0.23.0"
#: Every pin with a patch series.
PINS = ("0.23.0", "0.32.0")
TOOL = REPO / "tools" / "patches.py"


def series_dir(pin: str = PIN) -> Path:
    return REPO / "patches" / f"vllm-{pin}"


SERIES_DIR = series_dir(PIN)

if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))

import vllm_source  # noqa: E402  (tools/vllm_source.py)


def run_tool(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``tools/patches.py`` with this interpreter; output in ``.stdout``/``.stderr``."""
    return subprocess.run(
        [sys.executable, str(TOOL), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (git metadata and bytecode excluded)."""
    digest = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_dir() or rel.parts[0] == ".git" or "__pycache__" in rel.parts:
            continue
        digest[str(rel)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest


def installed_vllm_dir() -> Path:
    """The ``vllm`` package of this interpreter (the patched pinned env)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0])


def make_unpatched_overlay(dest: Path) -> Path:
    """A ``dest/vllm`` that mirrors the installed package by symlinks, with the series
    reverted in real copies of the touched files; put ``dest`` first on PYTHONPATH."""
    src = installed_vllm_dir()
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = Path(dirpath).relative_to(src)
        (dest / "vllm" / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            (dest / "vllm" / rel / name).symlink_to(Path(dirpath) / name)
    res = run_tool("revert", "--pin", PIN, "--site-packages", dest)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "reverted 4 patches" in res.stdout, res.stdout
    return dest


def source_tree(dest: Path | None = None, pin: str = PIN, with_tests: bool = False) -> Path:
    """The cached pristine tree of ``pin``, or (with ``dest``) a fresh clone of it;
    ``with_tests``: with the tests/ of vLLM's sdist (needed by series that change
    vLLM's own test files)."""
    return vllm_source.make_source_tree(pin, dest, with_tests=with_tests)
