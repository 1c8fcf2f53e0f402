# SPDX-License-Identifier: Apache-2.0
"""The ``pytest`` check of the PR kit: the test files each patch touches, run with the
pin's env interpreter over the branch's ``vllm/`` sources (an overlay of symlinks on
the env's compiled extensions), so the branch's code is what runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from .branch import PRBranch
from .checkresult import CheckOptions, CheckResult, not_run
from .common import Progress, patchtool, run

# -- pytest -----------------------------------------------------------------------------

_ENV_PROBE = (
    "import importlib.util, json, sys\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"
    "spec = importlib.util.find_spec('vllm')\n"
    "locs = list(spec.submodule_search_locations or []) if spec else []\n"
    "print(json.dumps({'vllm': locs[0] if locs else None,\n"
    "                  'pytest': importlib.util.find_spec('pytest') is not None}))\n"
)


def _test_files(branch: PRBranch) -> dict[str, list[str]]:
    """Patch name -> the test files it touches (that exist on the branch)."""
    out: dict[str, list[str]] = {}
    for c in branch.commits:
        tests = [
            f
            for f in c.files
            if f.startswith("tests/")
            and re.search(r"(^|/)(test_[^/]*|[^/]*_test)\.py$", f)
            and (branch.worktree / f).is_file()
        ]
        if tests:
            out[c.patch.name] = tests
    return out


def _overlay(tree_pkg: Path, env_pkg: Path, dest: Path) -> Path:
    """``dest/vllm``: the tree's sources, plus the env's files the tree lacks (compiled
    extensions), all as symlinks. Put ``dest`` first on PYTHONPATH."""
    for base in (tree_pkg, env_pkg):
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel = Path(dirpath).relative_to(base)
            for name in filenames:
                target = dest / "vllm" / rel / name
                if target.exists() or target.is_symlink():
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(Path(dirpath) / name)
    return dest


def _junit_counts(path: Path) -> dict[str, dict]:
    """Test file -> {passed, failed, skipped, first_failure, skip_reasons}."""
    per: dict[str, dict] = defaultdict(
        lambda: {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skip_reasons": []}
    )
    if not path.is_file():
        return per
    for case in ET.parse(path).getroot().iter("testcase"):
        f = case.get("file") or (case.get("classname") or "").replace(".", "/") + ".py"
        c = per[f]
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            c["failed"] += 1
            first = (bad.get("message") or "failed").strip().splitlines() or ["failed"]
            c["failures"].append(f"{case.get('name')}: {first[0][:200]}")
        elif skip is not None:
            c["skipped"] += 1
            c["skip_reasons"].append(skip.get("message") or "")
        else:
            c["passed"] += 1
    return per


def pytest_checks(branch: PRBranch, opts: CheckOptions, progress: Progress) -> list[CheckResult]:
    tests = _test_files(branch)
    if not tests:
        return [CheckResult("pytest", "skip", "the series touches no test files")]
    all_files = sorted({f for fs in tests.values() for f in fs})

    def skipped(why: str) -> list[CheckResult]:
        return [not_run("pytest", why, files=fs, patches=[p]) for p, fs in tests.items()]

    if opts.python is None:
        return skipped("no --python: pass the pin's env interpreter to run the patches' tests")
    python = opts.python
    probe = run([str(python), "-c", _ENV_PROBE], Path(tempfile.gettempdir()))
    if probe.returncode != 0:
        return skipped(f"{python} cannot run: {probe.stderr.strip()[-300:]}")
    env_info = json.loads(probe.stdout.strip().splitlines()[-1])
    if not env_info["pytest"]:
        return skipped(f"{python} has no pytest")
    if not env_info["vllm"]:
        return skipped(f"{python} has no vllm (its compiled extensions are needed)")
    env_pkg = Path(env_info["vllm"])
    env_version = patchtool.PackageTarget(env_pkg.parent).version()
    tree_version = patchtool.CheckoutTarget(branch.worktree).version()
    if (
        env_version is None
        or tree_version is None
        or patchtool.version_key(env_version) != patchtool.version_key(tree_version)
    ):
        return skipped(
            f"{python} has vLLM {env_version}, the tree is {tree_version}: the tree's "
            "sources need that release's compiled extensions (pass that pin's env)"
        )
    with tempfile.TemporaryDirectory(prefix="vllm-ext-pr-tests-") as tmp:
        overlay = _overlay(branch.worktree / "vllm", env_pkg, Path(tmp) / "overlay")
        junit = Path(tmp) / "junit.xml"
        base = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs"]
        base += ["--rootdir", str(branch.worktree), "--import-mode=append"]
        base += ["--junitxml", str(junit), "-o", "junit_family=xunit1"]
        paths = [str(branch.worktree / f) for f in all_files]
        env = {"PYTHONPATH": str(overlay), "PYTHONDONTWRITEBYTECODE": "1"}
        progress(
            f"  pytest on {len(all_files)} files with {python} (vLLM {env_version}'s compiled "
            f"extensions under the branch's sources; at most {opts.test_timeout:.0f} s) ..."
        )
        t0 = time.monotonic()
        note = ""
        try:
            res = run([*base, *paths], Path(tmp), env, timeout=opts.test_timeout)
            conftest_error = re.search(
                r"ImportError while loading conftest '([^']+)'.*?\n(?:.*\n)*?E\s+(\w+Error: .*)",
                res.stdout + res.stderr,
            )
            if conftest_error:
                left = opts.test_timeout - (time.monotonic() - t0)
                where = Path(conftest_error.group(1)).relative_to(branch.worktree)
                note = (
                    f"pytest ran with --noconftest: vLLM's {where} needs what the env "
                    f"lacks ({conftest_error.group(2)})"
                )
                progress(f"  {note}; running again")
                res = run([*base, "--noconftest", *paths], Path(tmp), env, timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            return skipped(f"timed out after {opts.test_timeout:.0f} s (bounded)")
        seconds = time.monotonic() - t0
        per = _junit_counts(junit)
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-15:])
    out = []
    for patch, files in tests.items():
        c = {"passed": 0, "failed": 0, "skipped": 0}
        failures: list[str] = []
        reasons: list[str] = []
        for f in files:
            got = per.get(f) or per.get(str(branch.worktree / f)) or {}
            for k in c:
                c[k] += got.get(k, 0)
            failures += [f"{f}::{x} ({patch})" for x in got.get("failures", [])]
            reasons += got.get("skip_reasons", [])
        ran = sum(c.values())
        if res.returncode not in (0, 1, 5) and not ran:
            status, summary = "fail", f"pytest exited {res.returncode}: {tail[-400:]}"
            failures = failures or [tail[-800:]]
        elif c["failed"]:
            status, summary = (
                "fail",
                f"{c['failed']} failed, {c['passed']} passed, {c['skipped']} skipped",
            )
        elif c["passed"]:
            status = "pass"
            summary = f"{c['passed']} passed" + (
                f", {c['skipped']} skipped" if c["skipped"] else ""
            )
        elif c["skipped"]:  # nothing was tested: as if it could not run
            status, summary = "skip", f"all {c['skipped']} tests skip here: {reasons[0][:200]}"
        else:
            status, summary = "fail", f"no test ran from {', '.join(files)}"
        out.append(
            CheckResult(
                "pytest",
                status,
                f"{summary} ({seconds:.0f} s for the series' tests)",
                files=files,
                patches=[patch],
                problems=failures,
                command="pytest {files}",
                seconds=seconds,
                counts=c,
                note=note,
                could_not_run=status == "skip",
            )
        )
    return out
