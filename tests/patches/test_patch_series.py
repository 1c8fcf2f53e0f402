# SPDX-License-Identifier: Apache-2.0
"""The 0.23.0 series itself: form of each patch, its index, vLLM's lint, its own tests.

The patches carry tests in vLLM's layout (``tests/v1/kv_connector/unit/...``). They
are extracted from the series and run against the patched env (where they must
pass) and against an overlay of the same package with the series reverted (where
they must fail, showing that they test the change).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from patch_support import PIN, REPO, SERIES_DIR, make_unpatched_overlay, run_tool

from vllm_ext import patchtool

SERIES = patchtool.load_series(SERIES_DIR)
SIGN_OFF = (
    "Signed-off-by: Seed 28d995dd maintainers <maintainers@users.noreply.a-seed-28d995dd.example>"
)
SECTIONS = ("Why:", "How:", "Related upstream PR:", "When to drop it:")


def _message(patch: patchtool.Patch) -> str:
    return patch.path.read_text().partition("\n---\n")[0]


@pytest.mark.parametrize("patch", SERIES, ids=[p.name for p in SERIES])
def test_patch_form(patch: patchtool.Patch) -> None:
    message = _message(patch)
    assert re.match(r"\[KV Connector\]", patch.subject), patch.subject
    for section in SECTIONS:
        assert re.search(rf"^{re.escape(section)}$", message, re.M), section
    assert SIGN_OFF in message
    tests = patch.files("tests/")
    code = patch.files("vllm/")
    assert code and tests, "each patch carries the change and its own tests"
    assert all(re.fullmatch(r"tests/v1/kv_connector/unit/test_\w+\.py", t) for t in tests)
    assert set(code) | set(tests) == set(patch.hunks)
    text = patch.path.read_text()
    for test_file in tests:  # new files start with vLLM's SPDX header
        added = text.split(f"+++ b/{test_file}\n", 1)[1]
        assert added.split("\n")[1] == "+# SPDX-License-Identifier: Apache-2.0"


def test_readme_index_matches_trailers() -> None:
    readme = (REPO / "patches" / "README.md").read_text()
    for patch in SERIES:
        row = next(ln for ln in readme.splitlines() if f"`{patch.name}`" in ln)
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == patch.subject
        assert cells[4] == (patch.upstream_since or "none")


def test_upstream_since_values() -> None:
    since = {p.name[:4]: p.upstream_since for p in SERIES}
    assert since == {"0001": "0.24.0", "0002": "0.31.0", "0003": "0.26.0", "0004": None}


@pytest.mark.timeout(300)
def test_touched_files_pass_vllm_ruff_settings(checkout: Path) -> None:
    res = run_tool("apply", "--checkout", checkout)
    assert res.returncode == 0, res.stdout + res.stderr
    files = sorted({f for p in SERIES for f in p.hunks})
    ruff = Path(sys.executable).with_name("ruff")
    config = str(REPO / "patches" / "ruff-vllm.toml")
    for args in (["check"], ["format", "--check"]):
        res = subprocess.run(
            [str(ruff), *args, "--config", config, *files],
            cwd=checkout,
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stdout + res.stderr


def _extract_tests(dest: Path) -> list[Path]:
    """The series' test files (new files), written under ``dest`` in vLLM's layout."""
    dest.mkdir(parents=True)
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(dest.parent)}
    for patch in SERIES:
        subprocess.run(
            ["git", "apply", "--include=tests/*", str(patch.path)],
            cwd=dest,
            env=env,
            check=True,
        )
    return sorted(dest.rglob("test_*.py"))


def _pytest(tests_root: Path, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **env_extra, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
         "--rootdir", str(tests_root), str(tests_root)],
        cwd=tests_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )  # fmt: skip


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_series_tests_pass_patched_and_fail_unpatched(tmp_path: Path) -> None:
    tests = _extract_tests(tmp_path / "vllm-tests")
    assert [t.name for t in tests] == [
        "test_nixl_cpu_kv_registration.py",
        "test_nixl_malformed_notifs.py",
        "test_nixl_region_members.py",
        "test_pending_push_work.py",
    ]

    patched = _pytest(tmp_path / "vllm-tests", {})
    assert patched.returncode == 0, patched.stdout[-4000:] + patched.stderr[-2000:]
    assert re.search(r"\b38 passed\b", patched.stdout), patched.stdout[-500:]

    overlay = make_unpatched_overlay(tmp_path / "unpatched")
    unpatched = _pytest(tmp_path / "vllm-tests", {"PYTHONPATH": str(overlay)})
    out = unpatched.stdout
    assert unpatched.returncode == 1, out[-3000:]
    for test_file in tests:  # every file has tests that need its patch
        assert f"FAILED {test_file.relative_to(tmp_path / 'vllm-tests')}" in out, test_file.name
    # 0003: without it, vLLM 0.23.0's own registration fails on the CPU KV cache.
    assert "All kv cache tensors must have the same number of blocks" in out
    assert PIN in run_tool("status", "--site-packages", overlay).stdout
