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
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from .branch import PRBranch
from .checkresult import CHECK_NAMES, CheckOptions, CheckResult, not_run
from .common import REPO, Progress, run
from .testrun import pytest_checks

LICENSE_LINE = "# SPDX-License-Identifier: Apache-2.0"
COPYRIGHT_LINE = "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project"
_RUFF_LINE = re.compile(r"^(?P<path>[^:\s]+\.pyi?):(?P<line>\d+):(?P<col>\d+): (?P<msg>.*)$")
_MYPY_LINE = re.compile(r"^(?P<path>[^:\s]+\.pyi?):(?P<line>\d+): error: (?P<msg>.*)$")


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
            if res.could_not_run:
                judge_not_run(res, name, opts.allow_skip)
            progress(f"  {res.line()}")
            results.append(res)
    return results


def judge_not_run(res: CheckResult, name: str, allow_skip: tuple[str, ...]) -> None:
    """A check that could not run fails the run, unless ``--allow-skip name`` says so."""
    if name in allow_skip:
        res.status, res.allowed = "skip", True
        res.summary = f"did not run: {res.summary} (accepted: --allow-skip {name})"
    else:
        res.status = "fail"
        res.summary = f"could not run: {res.summary}"
        res.problems = res.problems or [
            f"{res.check} did not run ({res.summary}); make it run, or pass "
            f"--allow-skip {name} to accept a PR description without it"
        ]


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
        return [not_run("ruff", "ruff not found (install it into --python's env)")]
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
        return not_run(name, "mypy not found (install it into --python's env)")
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
        return not_run(
            name, f"timed out after {opts.mypy_timeout:.0f} s (bounded)", files=files, command=shown
        )
    if res.returncode not in (0, 1) or (res.returncode == 1 and not _mypy_errors(res.stdout)):
        detail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        return not_run(
            name, f"mypy failed to start: {' / '.join(detail)}", files=files, command=shown
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


__all__ = ["CHECK_NAMES", "CheckOptions", "CheckResult", "not_run", "run_checks"]
