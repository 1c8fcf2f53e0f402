# SPDX-License-Identifier: Apache-2.0
"""Getting the wheels of a bundle and reading what they need.

* :func:`download`: one ``pip download --no-deps --only-binary=:all:`` for the
  resolved versions, with the target's Python and every platform tag it accepts;
  a download the network cut short is retried.
* :func:`build_project_wheel`: a wheel of this project from the working tree (the
  files git sees: tracked and untracked-not-ignored, as they are on disk).
* :func:`check_requirements`: each bundled wheel's requirements, with markers
  evaluated for the target and the extras asked for, against the bundle and the
  target's have list: which present packages are used, which present versions do
  not satisfy a requirement (kept anyway: the target's own packages win), and
  which requirements nothing meets (excluded packages).
* :func:`install_order`: dependencies before their dependents.
"""

from __future__ import annotations

import email.parser
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from devkit.bundle.installer import BundleError, canonical_name, wheel_name
from devkit.bundle.target import Target, expand_platforms
from devkit.pip_retry import PIP_ATTEMPTS, is_network_error

try:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import (  # type: ignore[no-redef,assignment]
        InvalidRequirement,
        Requirement,
    )
    from pip._vendor.packaging.version import InvalidVersion, Version  # type: ignore[no-redef,assignment]

_SAVED = re.compile(r"^\s*(?:Saved|File was already downloaded) (.+\.whl)\s*$", re.M)


@dataclass(frozen=True)
class WheelInfo:
    path: Path
    name: str  # canonical
    version: str
    requires: tuple[str, ...]

    @classmethod
    def read(cls, path: Path) -> WheelInfo:
        """Name, version and ``Requires-Dist`` from the wheel's METADATA."""
        with zipfile.ZipFile(path) as z:
            metas = [
                n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")
            ]
            if len(metas) != 1:
                raise BundleError(
                    f"{path.name}: expected one .dist-info/METADATA, found {len(metas)}"
                )
            msg = email.parser.Parser().parsestr(z.read(metas[0]).decode("utf-8", "replace"))
        return cls(
            path,
            canonical_name(msg["Name"]),
            str(msg["Version"]),
            tuple(msg.get_all("Requires-Dist") or ()),
        )


def download(
    specs: Iterable[str], target: Target, dest: Path, say: Callable[[str], None]
) -> dict[str, Path]:
    """Download the wheels of ``specs`` (``name==version``) into ``dest``: name -> file."""
    specs = sorted(specs)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "off", "--no-input",
        "--python-version", target.python_minor, "--implementation", "cp", "-d", str(dest),
    ]  # fmt: skip
    for tag in expand_platforms(target.platforms):
        cmd += ["--platform", tag]
    for attempt in range(1, PIP_ATTEMPTS + 1):
        rc, out = _run_pip_download([*cmd, *specs], len(specs), say)
        if rc == 0:
            break
        if attempt < PIP_ATTEMPTS and is_network_error(out):
            say(f"   network error; retry {attempt}/{PIP_ATTEMPTS - 1}")
            time.sleep(5 * attempt)
            continue
        tail = "\n".join(out.strip().splitlines()[-12:])
        hint = ""
        m = re.search(r"No matching distribution found for (\S+)", out)
        if m:
            hint = (
                f"\nhint: {m.group(1)} has no wheel for Python {target.python_minor} on "
                f"{', '.join(target.platforms)}: --exclude it, or give a newer --platform"
            )
        raise BundleError(f"pip download failed (exit {rc}):\n{tail}{hint}")
    # the files pip chose this time (an old --work folder may hold other versions)
    found: dict[str, list[Path]] = {}
    for m in _SAVED.finditer(out):
        path = dest / Path(m.group(1).strip()).name
        found.setdefault(wheel_name(path.name), []).append(path)
    files: dict[str, Path] = {}
    for spec in specs:
        name = canonical_name(spec.split("==")[0])
        got = sorted(set(found.get(name, [])))
        if len(got) != 1 or not got[0].is_file():
            raise BundleError(f"expected one wheel of {spec} from pip, got {[p.name for p in got]}")
        files[name] = got[0]
    return files


def _run_pip_download(cmd: list[str], count: int, say: Callable[[str], None]) -> tuple[int, str]:
    """Run pip, printing a progress line at most every 10 s; returns (exit code, output)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    seen = 0
    last = time.monotonic()
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("Collecting "):
            seen += 1
            if time.monotonic() - last > 10:
                last = time.monotonic()
                say(f"   downloading {seen}/{count}: {line.split()[1]}")
    return proc.wait(), "".join(lines)


def git_files(repo: Path) -> list[str]:
    """The working tree as git sees it: tracked and untracked-not-ignored files."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=repo, capture_output=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as e:
        raise BundleError(f"{repo} is not a git checkout ({e}); pass --no-project") from e
    return sorted({f for f in out.decode().split("\0") if f})


def build_project_wheel(repo: Path, dest: Path) -> Path:
    """``pip wheel`` of the working tree (a copy of the files git sees) into ``dest`` (emptied)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="vllm-ext-src-") as tmp:
        src = Path(tmp) / "src"
        for rel in git_files(repo):
            path = repo / rel
            if not (path.is_file() or path.is_symlink()):
                continue  # deleted in the working tree
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / rel, follow_symlinks=False)
        isolated = not all(importlib.util.find_spec(m) for m in ("setuptools", "wheel"))
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dest), str(src)]
        if not isolated:
            cmd.insert(5, "--no-build-isolation")
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise BundleError(
                f"building the vllm-ext wheel failed:\n{(res.stdout + res.stderr)[-2000:]}"
            )
    wheels = sorted(dest.glob("vllm_ext-*.whl"))
    if len(wheels) != 1:
        raise BundleError(
            f"expected one vllm_ext wheel in {dest}, found {[w.name for w in wheels]}"
        )
    return wheels[0]


@dataclass
class RequirementCheck:
    """What the bundled wheels need, against the bundle and the target."""

    #: present on the target and needed: name -> the bundled packages that need it
    present: dict[str, set[str]] = field(default_factory=dict)
    #: a present version that does not satisfy a requirement (the target's is kept)
    conflicts: list[dict] = field(default_factory=list)
    #: needed but neither bundled nor present: name -> the packages that need it
    unmet: dict[str, set[str]] = field(default_factory=dict)
    #: edges between bundled packages: name -> the bundled packages it needs
    needs: dict[str, set[str]] = field(default_factory=dict)


def _applies(req: Requirement, env: Mapping[str, str], extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in {"", *extras})


def _satisfies(version: str, req: Requirement) -> bool:
    if not str(req.specifier):
        return True
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def check_requirements(
    wheels: Mapping[str, WheelInfo],
    roots: Iterable[str],
    have: Mapping[str, str | None],
    env: Mapping[str, str],
) -> RequirementCheck:
    """Walk the bundled wheels' requirements from ``roots`` (see the module docstring)."""
    extras: dict[str, set[str]] = {name: set() for name in wheels}
    for line in roots:
        r = Requirement(line)
        if canonical_name(r.name) in extras:
            extras[canonical_name(r.name)] |= set(r.extras)
    while True:  # extras asked for by one wheel change what another needs: to a fixpoint
        check = RequirementCheck()
        before = {n: set(e) for n, e in extras.items()}
        for name, info in sorted(wheels.items()):
            check.needs[name] = set()
            for line in info.requires:
                try:
                    req = Requirement(line)
                except InvalidRequirement as e:
                    raise BundleError(f"{info.path.name}: bad requirement {line!r}: {e}") from e
                if not _applies(req, env, extras[name]):
                    continue
                dep = canonical_name(req.name)
                label = f"{name}=={info.version}"
                if dep in wheels:
                    extras[dep] |= set(req.extras)
                    check.needs[name].add(dep)
                elif dep in have:
                    check.present.setdefault(dep, set()).add(name)
                    version = have[dep]
                    if version is not None and not _satisfies(version, req):
                        check.conflicts.append(
                            {
                                "name": dep,
                                "target_version": version,
                                "requirement": f"{req.name}{req.specifier}",
                                "required_by": label,
                            }
                        )
                else:
                    check.unmet.setdefault(dep, set()).add(name)
        if extras == before:
            return check


def install_order(needs: Mapping[str, set[str]]) -> list[str]:
    """Names with each one's needs before it (name order otherwise; cycles broken by name)."""
    order: list[str] = []
    state: dict[str, int] = {}  # 1: in progress, 2: done

    def visit(n: str) -> None:
        if state.get(n):
            return
        state[n] = 1
        for dep in sorted(needs.get(n, ())):
            visit(dep)
        state[n] = 2
        order.append(n)

    for n in sorted(needs):
        visit(n)
    return order
