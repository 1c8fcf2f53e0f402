# SPDX-License-Identifier: Apache-2.0
"""vLLM's own checks on the files a PR branch touches.

* ``ruff check`` and ``ruff format --check`` with the tree's ruff settings (its
  ``pyproject.toml`` / ``ruff.toml``), else the copy this project keeps
  (``patches/ruff-vllm.toml``);
* the SPDX header rule of vLLM's ``check-spdx-header`` hook (license and copyright
  lines), checked without its auto-fix;
* mypy on the touched ``vllm/`` files with the tree's ``[tool.mypy]`` settings, as
  vLLM's ``tools/pre_commit/mypy.py`` runs it; bounded in time. The mypy of a pin's
  env is not the one vLLM pins, so errors already present at the base of the branch
  are reported but do not fail the check; only new ones do;
* pytest on the ``tests/`` files each patch touches, with the pin's env interpreter:
  the tree's ``vllm/`` sources over the env's compiled extensions (an overlay of
  symlinks), so the branch's code is what runs. Skipped, saying why, where that cannot
  work (no interpreter given, another vLLM release in the env, no pytest).

Every check yields a :class:`CheckResult`; a failing one names the check, the file and
the patch(es) that touch it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .branch import PRBranch
from .common import REPO, Progress, patchtool, run

LICENSE_LINE = "# SPDX-License-Identifier: Apache-2.0"
COPYRIGHT_LINE = "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project"
_RUFF_LINE = re.compile(r"^(?P<path>[^:\s]+\.pyi?):(?P<line>\d+):(?P<col>\d+): (?P<msg>.*)$")
_MYPY_LINE = re.compile(r"^(?P<path>[^:\s]+\.pyi?):(?P<line>\d+): error: (?P<msg>.*)$")


@dataclass
class CheckResult:
    check: str  # "ruff check", "ruff format", "SPDX header", "mypy", "pytest"
    status: str  # "pass", "fail" or "skip"
    summary: str
    files: list[str] = field(default_factory=list)
    patches: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # "file:line: message (patch)"
    command: str = ""
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    note: str = ""  # how it ran, where that differs from vLLM's CI

    def line(self) -> str:
        who = f" [{', '.join(_short_names(self.patches))}]" if self.patches else ""
        return f"{self.status.upper():<4} {self.check}{who}: {self.summary}"

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def _short_names(names: list[str]) -> list[str]:
    return [n.split("-", 1)[0] for n in names]


@dataclass
class CheckOptions:
    python: Path | None = None  # the pin's env interpreter (mypy, pytest)
    mypy_timeout: float = 600.0
    test_timeout: float = 900.0
    skip: tuple[str, ...] = ()  # check names to skip ("ruff", "spdx", "mypy", "pytest")


def run_checks(branch: PRBranch, opts: CheckOptions, progress: Progress) -> list[CheckResult]:
    wt = branch.worktree
    touched = sorted({f for c in branch.commits for f in c.files if (wt / f).is_file()})
    py_files = [f for f in touched if f.endswith((".py", ".pyi"))]
    results: list[CheckResult] = []

    def owners(path: str) -> list[str]:
        return branch.files_of(path)

    steps = [
        ("ruff", lambda: ruff_checks(wt, py_files, owners, opts.python)),
        ("spdx", lambda: [spdx_check(wt, py_files, owners)]),
        ("mypy", lambda: [mypy_check(branch, py_files, owners, opts, progress)]),
        ("pytest", lambda: pytest_checks(branch, opts, progress)),
    ]
    for name, step in steps:
        if name in opts.skip:
            results.append(CheckResult(name, "skip", "skipped on request (--skip)"))
            continue
        progress(f"check: {name} ...")
        t0 = time.monotonic()
        for res in step():
            res.seconds = res.seconds or time.monotonic() - t0
            progress(f"  {res.line()}")
            results.append(res)
    return results


# -- ruff -------------------------------------------------------------------------------


def ruff_config(tree: Path) -> tuple[Path, str]:
    """The ruff settings to use: the tree's own, else this project's copy of vLLM's."""
    pyproject = tree / "pyproject.toml"
    if pyproject.is_file() and "[tool.ruff" in pyproject.read_text(errors="replace"):
        return pyproject, "the tree's pyproject.toml"
    for name in ("ruff.toml", ".ruff.toml"):
        if (tree / name).is_file():
            return tree / name, f"the tree's {name}"
    return REPO / "patches" / "ruff-vllm.toml", "vllm-ext's patches/ruff-vllm.toml"


def _tool(name: str, python: Path | None) -> str | None:
    """``name`` next to ``python`` (the pin's env), else next to this interpreter or on PATH."""
    for d in [python.parent] if python else []:
        if (d / name).is_file():
            return str(d / name)
    here = Path(sys.executable).with_name(name)
    return str(here) if here.is_file() else shutil.which(name)


def ruff_checks(tree: Path, files: list[str], owners, python: Path | None) -> list[CheckResult]:
    if not files:
        return [CheckResult("ruff", "skip", "no Python files touched")]
    ruff = _tool("ruff", python)
    if ruff is None:
        return [CheckResult("ruff", "skip", "ruff not found (install it into --python's env)")]
    config, where = ruff_config(tree)
    label = (
        str(config.relative_to(tree))
        if config.is_relative_to(tree)
        else str(config.relative_to(REPO))
    )
    version = run([ruff, "--version"], tree).stdout.strip()
    out = []
    cmd = [ruff, "check", "--no-cache", "--output-format", "concise", "--config", str(config)]
    res = run([*cmd, *files], tree)
    problems = []
    for line in res.stdout.splitlines():
        m = _RUFF_LINE.match(line.strip())
        if m:
            problems.append(f"{line.strip()} ({', '.join(owners(m['path']))})")
    ok = res.returncode == 0
    if not ok and not problems:
        problems = [(res.stderr or res.stdout).strip()[-800:]]
    out.append(
        CheckResult(
            "ruff check",
            "pass" if ok else "fail",
            (f"{len(files)} files clean" if ok else f"{len(problems)} problems")
            + f" ({version}, settings of {where})",
            files=files,
            patches=sorted({p for f in files for p in owners(f)}) if ok else _owners_of(problems),
            problems=problems,
            command=f"ruff check --config {label} {{files}}",
        )
    )
    cmd = [ruff, "format", "--check", "--no-cache", "--config", str(config)]
    res = run([*cmd, *files], tree)
    # "Would reformat: PATH" (older ruff) or "unformatted: ..." then "--> PATH:L:C"
    unformatted = list(
        dict.fromkeys(
            m.group(1) or m.group(2)
            for m in re.finditer(
                r"^Would reformat: (\S+)$|^\s*--> (\S+?\.pyi?):\d+:\d+$", res.stdout, re.M
            )
        )
    )
    ok = res.returncode == 0
    problems = [f"{f}: would be reformatted ({', '.join(owners(f))})" for f in unformatted]
    if not ok and not problems:
        problems = [(res.stderr or res.stdout).strip()[-800:]]
    out.append(
        CheckResult(
            "ruff format",
            "pass" if ok else "fail",
            (f"{len(files)} files formatted" if ok else f"{len(unformatted)} files to reformat")
            + f" ({version})",
            files=files,
            patches=_owners_of(problems) if not ok else [],
            problems=problems,
            command=f"ruff format --check --config {label} {{files}}",
        )
    )
    return out


def _owners_of(problems: list[str]) -> list[str]:
    names: set[str] = set()
    for p in problems:
        m = re.search(r"\(([^()]*\.patch(?:, [^()]*\.patch)*)\)$", p)
        if m:
            names.update(m.group(1).split(", "))
    return sorted(names)


# -- SPDX -------------------------------------------------------------------------------


def spdx_lines(tree: Path) -> tuple[str, str]:
    """vLLM's required header lines, read from the tree's hook where it has one."""
    hook = tree / "tools" / "pre_commit" / "check_spdx_header.py"
    lic, cop = LICENSE_LINE, COPYRIGHT_LINE
    if hook.is_file():
        text = hook.read_text(errors="replace")
        m1 = re.search(r'^LICENSE_LINE = "([^"]+)"', text, re.M)
        m2 = re.search(r'^COPYRIGHT_LINE = "([^"]+)"', text, re.M)
        lic, cop = (m1.group(1) if m1 else lic), (m2.group(1) if m2 else cop)
    return lic, cop


def spdx_check(tree: Path, files: list[str], owners) -> CheckResult:
    if not files:
        return CheckResult("SPDX header", "skip", "no Python files touched")
    lic, cop = spdx_lines(tree)
    problems = []
    for f in files:
        lines = {ln.strip() for ln in (tree / f).read_text(errors="replace").splitlines()}
        if not lines:
            continue  # an empty __init__.py needs none
        missing = [what for what, ln in (("license", lic), ("copyright", cop)) if ln not in lines]
        if missing:
            problems.append(f"{f}: no SPDX {' and '.join(missing)} line ({', '.join(owners(f))})")
    return CheckResult(
        "SPDX header",
        "fail" if problems else "pass",
        f"{len(files) - len(problems)}/{len(files)} files have vLLM's two SPDX lines",
        files=files,
        patches=_owners_of(problems),
        problems=problems,
        command="SPDX header: vLLM's check-spdx-header rule (license + copyright) on {files}",
    )


# -- mypy -------------------------------------------------------------------------------


def _mypy_cmd(python: Path | None) -> list[str] | None:
    if python is not None and run([str(python), "-m", "mypy", "--version"], REPO).returncode == 0:
        return [str(python), "-m", "mypy"]
    mypy = _tool("mypy", None)
    if mypy is None:
        return None
    return [mypy] + (["--python-executable", str(python)] if python else [])


def _mypy_args(tree: Path) -> list[str]:
    pyproject = tree / "pyproject.toml"
    text = pyproject.read_text(errors="replace") if pyproject.is_file() else ""
    args = []
    m = re.search(r'requires-python\s*=\s*"[^"]*>=\s*(3\.\d+)', text)
    if m:
        args += ["--python-version", m.group(1)]
    if "[tool.mypy]" in text:
        args += ["--config-file", str(pyproject)]
    else:  # vLLM's settings when the tree does not carry them (a wheel-only tree)
        args += ["--ignore-missing-imports", "--check-untyped-defs", "--follow-imports", "silent"]
    return args


def _mypy_errors(output: str) -> list[tuple[str, str, str]]:
    """(path, line, message) of each error line."""
    return [
        (m["path"], m["line"], m["msg"]) for m in map(_MYPY_LINE.match, output.splitlines()) if m
    ]


def mypy_check(
    branch: PRBranch, py_files: list[str], owners, opts: CheckOptions, progress: Progress
) -> CheckResult:
    files = [f for f in py_files if f.startswith("vllm/")]
    name = "mypy"
    if not files:
        return CheckResult(name, "skip", "no vllm/ files touched")
    cmd = _mypy_cmd(opts.python)
    if cmd is None:
        return CheckResult(name, "skip", "mypy not found (install it into --python's env)")
    tree = branch.worktree
    version = run([*cmd, "--version"], tree).stdout.strip()
    import vllm_source  # the kit's cache lives next to the source trees

    key = hashlib.sha256(f"{cmd}{version}".encode()).hexdigest()[:12]
    cache = vllm_source.cache_root() / "mypy" / key
    full = [*cmd, *_mypy_args(tree), "--cache-dir", str(cache), "--no-pretty"]
    shown = (
        " ".join(["mypy", *(a.replace(str(tree) + "/", "") for a in _mypy_args(tree))]) + " {files}"
    )
    deadline = time.monotonic() + opts.mypy_timeout

    def mypy_run(label: str) -> subprocess.CompletedProcess[str] | None:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        progress(f"  mypy on {len(files)} files ({label}; at most {left:.0f} s) ...")
        try:
            return run([*full, *files_now()], tree, timeout=left)
        except subprocess.TimeoutExpired:
            return None

    def files_now() -> list[str]:
        return [f for f in files if (tree / f).is_file()]

    res = mypy_run("the branch")
    if res is None:
        return CheckResult(
            name,
            "skip",
            f"timed out after {opts.mypy_timeout:.0f} s (bounded)",
            files,
            command=shown,
        )
    if res.returncode not in (0, 1) or (res.returncode == 1 and not _mypy_errors(res.stdout)):
        detail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        return CheckResult(
            name, "skip", f"mypy could not run: {' / '.join(detail)}", files, command=shown
        )
    errors = _mypy_errors(res.stdout)
    if not errors:
        return CheckResult(
            name, "pass", f"{len(files)} files, no errors ({version})", files, command=shown
        )
    # Errors: which were there before the series? Check the base versions of the same
    # files at the same paths (so mypy's cache stays valid), then restore the branch.
    at_base = [
        f
        for f in files
        if run(["git", "cat-file", "-e", f"{branch.base}:{f}"], tree).returncode == 0
    ]
    new_files = [f for f in files if f not in at_base]
    base_res: subprocess.CompletedProcess[str] | None
    if not at_base:
        base_res = subprocess.CompletedProcess([], 0, "", "")  # every file is new
    else:
        try:
            run(["git", "checkout", branch.base, "--", *at_base], tree)
            for f in new_files:  # absent at the base
                (tree / f).rename(tree / (f + ".kit-aside"))
            base_res = mypy_run("the base, for errors that were there before")
        finally:
            for f in new_files:
                if (tree / (f + ".kit-aside")).exists():
                    (tree / (f + ".kit-aside")).rename(tree / f)
            run(["git", "checkout", "HEAD", "--", *at_base], tree)
    if base_res is None:
        base_errors: list[tuple[str, str, str]] = []
        note = "; the base run timed out, so every error counts as new"
    else:
        base_errors = _mypy_errors(base_res.stdout)
        note = ""
    before = Counter((p, m) for p, _, m in base_errors)
    new = []
    for p, line, m in errors:
        if before[(p, m)] > 0:
            before[(p, m)] -= 1
        else:
            new.append(f"{p}:{line}: {m} ({', '.join(owners(p))})")
    old = len(errors) - len(new)
    summary = (
        f"{len(files)} files: {len(new)} new errors, {old} present at the base too "
        f"({version}){note}"
    )
    return CheckResult(
        name,
        "fail" if new else "pass",
        summary,
        files,
        patches=_owners_of(new),
        problems=new,
        command=shown,
        counts={"errors": len(errors), "new": len(new), "at_base": old},
    )


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
        return [
            CheckResult("pytest", "skip", why, files=fs, patches=[p]) for p, fs in tests.items()
        ]

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
        elif c["skipped"]:
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
            )
        )
    return out
