# SPDX-License-Identifier: Apache-2.0
"""Defects of the patch tool found in the issue-13 review, one test each.

* ``--python /nonexistent`` ended in a traceback: now a clear error, exit status 2;
* ``check`` on a release between two pins (0.24.0) said "already applied: 0 patches;
  nothing to do": now it checks the newest older series and reports each patch;
* after a conflict ``status`` showed every patch as "unknown": now each patch's state;
* ``source`` was missing from ``--help``;
* ``status --checkout`` tried each patch alone on HEAD, so a patch that builds on an
  earlier one showed as "conflict" while ``check`` said the series applies: now the
  rest of the series is replayed in order, as ``check`` does.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from patch_support import SERIES_DIR, run_tool

WORKER = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py"
PATCHES = sorted(p.name for p in SERIES_DIR.glob("*.patch"))


def _set_version(site: Path, version: str) -> None:
    version_file = site / "vllm" / "_version.py"
    version_file.write_text(version_file.read_text().replace("'0.23.0'", f"'{version}'"))


def _break_0004(path: Path) -> None:
    text = path.read_text()
    old = '                msg = notif.decode("utf-8")\n'
    assert text.count(old) == 1
    path.write_text(text.replace(old, '                msg = notif.decode("latin-1")\n'))


def _states(*target: str | Path) -> dict[str, str]:
    res = run_tool("status", "--json", *target)
    assert res.returncode in (0, 1), res.stderr
    return {row["patch"]: row["state"] for row in json.loads(res.stdout)["patches"]}


@pytest.mark.parametrize("python", ["/nonexistent", "/bin/true"])
def test_python_that_is_no_interpreter_is_a_usage_error(python: str) -> None:
    for cmd in ("status", "check", "apply"):
        res = run_tool(cmd, "--python", python)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "Traceback" not in res.stderr
        assert res.stderr.startswith(f"error: --python {python}: "), res.stderr


def test_unknown_series_is_a_usage_error(site_copy: Path) -> None:
    res = run_tool("check", "--pin", "0.99.0", "--site-packages", site_copy)
    assert res.returncode == 2 and "no series for vLLM 0.99.0" in res.stderr, res.stderr
    assert "vllm-0.99.0" in res.stderr and "0.23.0" in res.stderr  # names what exists


@pytest.mark.timeout(120)
def test_check_between_pins_reports_each_patch(site_copy: Path) -> None:
    """A 0.24.0 target has no series of its own: the 0.23.0 series is checked patch by
    patch (0001 is upstream there; the others are missing and would apply)."""
    _set_version(site_copy, "0.24.0")
    res = run_tool("check", "--site-packages", site_copy)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "already applied: 0 patches" not in out
    assert "no series for vLLM 0.24.0; checking the 0.23.0 series" in out
    assert "0001-has-pending-push-work.patch: already upstream since vLLM 0.24.0" in out
    for name in PATCHES[1:]:
        assert f"would apply {name}" in out
    assert "would apply 3 patches" in out

    _break_0004(site_copy / WORKER)  # now one of them conflicts: each is still reported
    res = run_tool("check", "--site-packages", site_copy)
    assert res.returncode == 1
    lines = res.stdout.splitlines()
    assert any(ln.split() == ["not", "applied", PATCHES[1]] for ln in lines), res.stdout
    assert any(ln.split()[:2] == ["conflict", PATCHES[3]] for ln in lines), res.stdout
    assert f"{PATCHES[3]} does not apply: hunk #4 of {WORKER}" in res.stderr


@pytest.mark.timeout(120)
def test_status_after_a_conflict_shows_each_patch(site_copy: Path) -> None:
    _break_0004(site_copy / WORKER)
    assert run_tool("apply", "--site-packages", site_copy).returncode == 1
    res = run_tool("status", "--site-packages", site_copy)
    assert res.returncode == 1
    assert "unknown" not in res.stdout
    assert f"conflict     {PATCHES[3]} (hunk #4 of {WORKER}" in res.stdout, res.stdout
    assert _states("--site-packages", site_copy) == {
        **dict.fromkeys(PATCHES[:3], "not applied"),
        PATCHES[3]: "conflict",
    }
    # With the first three applied by hand (out of the tool's view), each is still told.
    for name in PATCHES[:3]:
        subprocess.run(
            ["git", "apply", "--include=vllm/*", str(SERIES_DIR / name)],
            cwd=site_copy,
            check=True,
            env={"GIT_CEILING_DIRECTORIES": str(site_copy.parent), "PATH": "/usr/bin:/bin"},
        )
    assert _states("--site-packages", site_copy) == {
        **dict.fromkeys(PATCHES[:3], "applied"),
        PATCHES[3]: "conflict",
    }


@pytest.mark.timeout(180)
def test_checkout_status_names_the_patch_that_does_not_apply(checkout: Path) -> None:
    _break_0004(checkout / WORKER)
    subprocess.run(["git", "commit", "-qam", "conflicting edit"], cwd=checkout, check=True)
    assert run_tool("apply", "--checkout", checkout).returncode == 1
    res = run_tool("status", "--checkout", checkout)
    assert res.returncode == 1, res.stdout
    assert f"does not apply to the target: {PATCHES[3]}" in res.stdout
    assert _states("--checkout", checkout) == {
        **dict.fromkeys(PATCHES[:3], "not applied"),
        PATCHES[3]: "conflict",
    }


def test_help_lists_source() -> None:
    res = run_tool("--help")
    assert res.returncode == 0
    assert "source" in res.stdout.split("positional arguments:")[1].split("options:")[0]
    assert "vllm-ext-patches source --version" in res.stdout
    res = run_tool("source", "--help")
    assert res.returncode == 0 and "--with-tests" in res.stdout and "--version" in res.stdout


def _mini_checkout(root: Path) -> tuple[Path, Path]:
    """A tiny git tree of "vLLM 0.23.0" and a two-patch series whose 0002 changes a line
    that 0001 adds (so 0002 alone does not apply to the tree)."""
    tree = root / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "_version.py").write_text("version = '0.23.0'\n")
    (tree / "vllm" / "a.py").write_text("".join(f"VALUE_{i} = {i}\n" for i in range(10)))
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root)}

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tree, check=True, env=env, capture_output=True)

    git("init", "-q", "-b", "main")
    git("config", "user.name", "Patch Tester")
    git("config", "user.email", "patch.tester@vllm-ext.dev")
    git("add", "-A")
    git("commit", "-qm", "base")
    text = (tree / "vllm" / "a.py").read_text()
    for subject, old, new in (
        ("Add ADDED", "VALUE_5 = 5\n", "VALUE_5 = 5\nADDED = 1\n"),
        ("Change ADDED", "ADDED = 1\n", "ADDED = 2\n"),
    ):
        text = text.replace(old, new)
        (tree / "vllm" / "a.py").write_text(text)
        git("commit", "-qam", f"[Misc] {subject}\n\nUpstream-Since: none")
    series = root / "patches" / "vllm-0.23.0"
    git("format-patch", "-q", "--zero-commit", "-o", str(series), "HEAD~2")
    git("reset", "-q", "--hard", "HEAD~2")
    return tree, series


def test_checkout_status_replays_the_series_in_order(tmp_path: Path) -> None:
    tree, series = _mini_checkout(tmp_path)
    names = sorted(p.name for p in series.glob("*.patch"))
    target = ("--checkout", tree, "--patches", series.parent)
    res = run_tool("check", *target)
    assert res.returncode == 0 and "would apply 2 patches" in res.stdout, res.stdout + res.stderr
    res = run_tool("status", *target)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _states(*target) == dict.fromkeys(names, "not applied")
    # a real conflict is still one: break 0001's context, 0002 then cannot apply either
    (tree / "vllm" / "a.py").write_text(
        (tree / "vllm" / "a.py").read_text().replace("VALUE_5 = 5", "VALUE_5 = 55")
    )
    subprocess.run(["git", "commit", "-qam", "edit"], cwd=tree, check=True)
    rows = json.loads(run_tool("status", "--json", *target).stdout)["patches"]
    assert [r["state"] for r in rows] == ["conflict", "conflict"], rows
    assert rows[0]["detail"].startswith("hunk #1 of vllm/a.py")
    assert rows[1]["detail"].endswith(f"with {names[0]} not applied before it"), rows[1]
