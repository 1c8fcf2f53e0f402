# SPDX-License-Identifier: Apache-2.0
"""Offline installer of a vllm-ext bundle (ships next to the parts as ``install.py``).

Runs on the target with nothing but Python (>= 3.9) and pip: this file imports the
standard library only, and ``tools/bundle.py build`` copies it beside the parts.

Usage (in the folder that holds the parts, the ``*.index.json`` and this file)::

    python3 install.py check                       # every part and wheel checksum; writes nothing
    python3 install.py install --venv DIR          # a venv that sees this python's packages
    python3 install.py install --target DIR        # pip --target DIR; prints the PYTHONPATH
        [--python PY] [--parts DIR] [--work DIR] [--no-patches] [--no-compile] [--keep]

What ``install`` does, in order, stopping at the first problem with a message that
names it (a missing part, a checksum that does not match, a Python that is not the
bundle's):

1. checks the Python of the install (``--python``, default this one) against the
   bundle's version and machine;
2. checks each part's size and sha256 against the index, then reassembles the parts
   (a tar stream) into a scratch folder, checking each wheel's size and sha256
   against the manifest inside;
3. installs the wheels with ``pip install --no-index --no-deps`` in the manifest's
   groups, one pip run per group: wheels that write the same files with different
   contents (found from their RECORD when the bundle was built) go in separate runs,
   the dependent one later, so it wins;
4. ``--venv DIR``: creates the venv if it does not exist, with
   ``--system-site-packages``; when ``--python`` is itself a venv (e.g. the target's
   torch lives in one) a ``.pth`` file makes its site-packages visible too, after
   the new venv's own. ``--target DIR``: each group goes to a staging folder that is
   then merged into DIR (pip's own ``--target`` would skip or replace whole top-level
   folders that an earlier group wrote), and the PYTHONPATH that DIR needs is printed
   and written to ``DIR/bundle-env.sh``: DIR plus the folders named by ``.pth`` files
   in DIR, which Python reads only in site directories, never from PYTHONPATH;
5. applies the pin's patch series to the vLLM it just installed, with the copy of
   ``vllm_ext/patchtool`` (as the zip application ``patchtool.pyz``) and the patches
   carried in the bundle (needs ``git``);
6. prints what it did: wheels and bytes installed, pip runs, patches, time.

Exit status: 0 done, 1 a check or a step failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import csv
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
import time
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

#: Format tag of the index and the manifest; bump on an incompatible change.
FORMAT = "vllm-ext-bundle/1"
INDEX_SUFFIX = ".index.json"
MANIFEST_NAME = "manifest.json"
#: Where things lie inside the payload (the tar stream that the parts split).
WHEELS_DIR = "wheels"
PATCHES_DIR = "patches"
#: ``vllm_ext.patchtool`` as a zip application (``python patchtool.pyz apply ...``)
PATCHTOOL_NAME = "patchtool.pyz"
#: Written into DIR by ``install --target DIR``: ``source`` it to use DIR.
TARGET_ENV_FILE = "bundle-env.sh"
#: Written into a venv's site-packages when ``--python`` is a venv itself.
BASE_PTH_NAME = "_vllm_ext_bundle_base.pth"
_CHUNK = 1 << 20


class BundleError(RuntimeError):
    """A failure to report to the user; the message is the whole story."""


def say(msg: str) -> None:
    print(msg, flush=True)


def mib(n: float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def canonical_name(name: str) -> str:
    """PEP 503 normalized project name: ``Foo_Bar.baz`` -> ``foo-bar-baz``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(filename: str) -> str:
    """Canonical project name from a wheel file name (``foo_bar-1.0-py3-none-any.whl``)."""
    return canonical_name(filename.split("-", 1)[0])


# ----------------------------------------------------------------------------
# Parts: a byte stream cut into files of at most ``part_size`` bytes
# ----------------------------------------------------------------------------


class PartWriter(io.RawIOBase):
    """A write-only stream that lands in ``DIR/STEM.part000``, ``.part001``, ...

    Each part holds at most ``part_size`` bytes. :meth:`close` returns nothing; the
    parts (name, size, sha256) and the whole stream's size and sha256 are in
    :attr:`parts` and :meth:`payload` afterwards. ``progress(parts_done, bytes)`` is
    called each time a part is complete.
    """

    def __init__(self, directory: Path, stem: str, part_size: int, progress=None) -> None:
        if part_size <= 0:
            raise ValueError("part_size must be positive")
        self.directory = directory
        self.stem = stem
        self.part_size = part_size
        self.parts: list[dict] = []
        self._progress = progress
        self._whole = hashlib.sha256()
        self._total = 0
        self._file: io.BufferedWriter | None = None
        self._hash = hashlib.sha256()
        self._in_part = 0

    def writable(self) -> bool:
        return True

    def _part_path(self, index: int) -> Path:
        return self.directory / f"{self.stem}.part{index:03d}"

    def _finish_part(self) -> None:
        assert self._file is not None
        self._file.close()
        path = self._part_path(len(self.parts))
        self.parts.append(
            {"file": path.name, "size": self._in_part, "sha256": self._hash.hexdigest()}
        )
        self._file = None
        if self._progress is not None:
            self._progress(len(self.parts), self._total)

    def write(self, data) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        n = len(view)
        while len(view):
            if self._file is None:
                self._file = self._part_path(len(self.parts)).open("wb")
                self._hash = hashlib.sha256()
                self._in_part = 0
            room = self.part_size - self._in_part
            piece = view[:room]
            self._file.write(piece)
            self._hash.update(piece)
            self._whole.update(piece)
            self._in_part += len(piece)
            self._total += len(piece)
            view = view[len(piece) :]
            if self._in_part == self.part_size:
                self._finish_part()
        return n

    def close(self) -> None:
        if not self.closed and self._file is not None:
            self._finish_part()
        super().close()

    def payload(self) -> dict:
        return {"size": self._total, "sha256": self._whole.hexdigest()}


def find_index(directory: Path) -> Path:
    """The one ``*.index.json`` in ``directory``."""
    found = sorted(directory.glob(f"*{INDEX_SUFFIX}"))
    if not found:
        raise BundleError(f"no *{INDEX_SUFFIX} in {directory} (pass --parts DIR or --index FILE)")
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise BundleError(f"several bundles in {directory} ({names}); pass --index FILE")
    return found[0]


def load_index(path: Path) -> dict:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BundleError(f"cannot read the bundle index {path}: {e}") from e
    if index.get("format") != FORMAT:
        raise BundleError(f"{path}: format {index.get('format')!r}, this installer reads {FORMAT}")
    return index


def verify_parts(directory: Path, index: Mapping, progress=None) -> int:
    """Check that every part is there with its size and sha256; returns the bytes read.

    Raises :class:`BundleError` naming every missing part, or the first part whose
    size or checksum is wrong.
    """
    parts = index["parts"]
    missing = [p["file"] for p in parts if not (directory / p["file"]).is_file()]
    if missing:
        raise BundleError(
            f"{len(missing)} of {len(parts)} parts missing in {directory}: {', '.join(missing)}"
        )
    total = 0
    for i, p in enumerate(parts, 1):
        path = directory / p["file"]
        size = path.stat().st_size
        if size != p["size"]:
            raise BundleError(
                f"{p['file']}: {size} bytes, the index says {p['size']} (truncated or wrong file)"
            )
        got = sha256_file(path)
        if got != p["sha256"]:
            raise BundleError(f"{p['file']}: bad checksum (sha256 {got}, expected {p['sha256']})")
        total += size
        if progress is not None:
            progress(i, len(parts), total)
    return total


class _Concat(io.RawIOBase):
    """The parts read back as one stream."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self._paths = list(paths)
        self._file: io.BufferedReader | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        while True:
            if self._file is None:
                if not self._paths:
                    return 0
                self._file = self._paths.pop(0).open("rb")
            n = self._file.readinto(buffer)
            if n:
                return n
            self._file.close()
            self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        super().close()


def _member_path(name: str) -> Path:
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise BundleError(f"unsafe path in the bundle: {name!r}")
    return rel


def iter_payload(
    directory: Path, index: Mapping
) -> Iterator[tuple[str, tarfile.TarFile, tarfile.TarInfo]]:
    """Members of the reassembled payload, in order (regular files and folders only)."""
    stream = io.BufferedReader(_Concat([directory / p["file"] for p in index["parts"]]), _CHUNK)
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            _member_path(member.name)
            if not (member.isfile() or member.isdir()):
                raise BundleError(f"unexpected entry in the bundle: {member.name!r}")
            yield member.name, tar, member


def unpack(directory: Path, index: Mapping, dest: Path, progress=None) -> dict[str, str]:
    """Reassemble the parts into ``dest``; returns member name -> sha256 of each file.

    The parts should have passed :func:`verify_parts` first.
    """
    hashes: dict[str, str] = {}
    done = 0
    for name, tar, member in iter_payload(directory, index):
        out = dest / _member_path(name)
        if member.isdir():
            out.mkdir(parents=True, exist_ok=True)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        src = tar.extractfile(member)
        assert src is not None
        h = hashlib.sha256()
        with out.open("wb") as f:
            for chunk in iter(lambda: src.read(_CHUNK), b""):  # noqa: B023
                f.write(chunk)
                h.update(chunk)
        hashes[name] = h.hexdigest()
        done += member.size
        if progress is not None:
            progress(name, done)
    return hashes


def hash_payload(directory: Path, index: Mapping) -> tuple[dict, dict[str, str]]:
    """Read the payload without writing it: (manifest, member name -> sha256)."""
    manifest: dict | None = None
    hashes: dict[str, str] = {}
    for name, tar, member in iter_payload(directory, index):
        if not member.isfile():
            continue
        src = tar.extractfile(member)
        assert src is not None
        h = hashlib.sha256()
        data = b""
        for chunk in iter(lambda: src.read(_CHUNK), b""):  # noqa: B023
            h.update(chunk)
            if name == MANIFEST_NAME:
                data += chunk
        hashes[name] = h.hexdigest()
        if name == MANIFEST_NAME:
            manifest = json.loads(data)
    if manifest is None:
        raise BundleError(f"the bundle has no {MANIFEST_NAME}")
    return manifest, hashes


def verify_wheels(
    manifest: Mapping, hashes: Mapping[str, str], sizes: Mapping[str, int] | None = None
) -> None:
    """Every wheel of the manifest is in the payload with its sha256 (and size), and no other."""
    listed = {f"{WHEELS_DIR}/{w['file']}": w for w in manifest["wheels"]}
    present = {n for n in hashes if n.startswith(f"{WHEELS_DIR}/") and n.endswith(".whl")}
    missing = sorted(set(listed) - present)
    if missing:
        raise BundleError(f"wheels missing from the bundle: {', '.join(missing)}")
    extra = sorted(present - set(listed))
    if extra:
        raise BundleError(f"wheels in the bundle but not in its manifest: {', '.join(extra)}")
    for name, w in listed.items():
        if hashes[name] != w["sha256"]:
            raise BundleError(
                f"{w['file']}: bad checksum (sha256 {hashes[name]}, expected {w['sha256']})"
            )
        if sizes is not None and sizes[name] != w["size"]:
            raise BundleError(f"{w['file']}: {sizes[name]} bytes, the manifest says {w['size']}")


# ----------------------------------------------------------------------------
# Wheels that write the same paths
# ----------------------------------------------------------------------------


def wheel_record(path: Path) -> dict[str, str]:
    """The files a wheel installs (its RECORD): path -> hash (``""`` where RECORD has none)."""
    with zipfile.ZipFile(path) as z:
        records = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise BundleError(f"{path.name}: expected one .dist-info/RECORD, found {len(records)}")
        text = z.read(records[0]).decode("utf-8")
    return {
        row[0]: (row[1] if len(row) > 1 else "") for row in csv.reader(io.StringIO(text)) if row
    }


def plan_groups(
    order: Sequence[str], records: Mapping[str, Mapping[str, str]]
) -> tuple[list[list[str]], list[dict]]:
    """Split wheels into pip runs so that no run holds two wheels writing one path differently.

    ``order``: wheel files in install order (dependencies first); ``records``: each
    wheel's :func:`wheel_record`. A wheel goes into the group after the last group
    holding an earlier wheel that writes one of its paths with other contents (or
    without a hash to compare), else into the first group: the later wheel's files
    win, and wheels that clash with nothing share one pip run.

    Returns ``(groups, overlaps)``; each overlap is ``{"first", "then", "shared",
    "differ", "example"}``, the two wheel files and how many paths they share and
    write differently. Identical shared files (same hash) never split a group.
    """
    group_of: dict[str, int] = {}
    overlaps: list[dict] = []
    owners: dict[str, list[str]] = {}  # path -> earlier wheels writing it
    for wheel in order:
        after = -1
        clashes: dict[str, list[str]] = {}
        for path in records[wheel]:
            if ".dist-info/" in path:
                continue
            for other in owners.get(path, ()):
                clashes.setdefault(other, []).append(path)
        for other, paths in sorted(clashes.items()):
            differ = [
                p for p in paths if not records[other][p] or records[other][p] != records[wheel][p]
            ]
            overlaps.append(
                {
                    "first": other,
                    "then": wheel,
                    "shared": len(paths),
                    "differ": len(differ),
                    "example": sorted(paths)[0],
                }
            )
            if differ:
                after = max(after, group_of[other])
        group_of[wheel] = after + 1
        for path in records[wheel]:
            owners.setdefault(path, []).append(wheel)
    groups: list[list[str]] = [[] for _ in range(max(group_of.values(), default=-1) + 1)]
    for wheel in order:
        groups[group_of[wheel]].append(wheel)
    return groups, overlaps


# ----------------------------------------------------------------------------
# --target: what PYTHONPATH needs
# ----------------------------------------------------------------------------


def pythonpath_dirs(target: Path, python: str | None = None) -> tuple[list[Path], list[str]]:
    """Folders to put on PYTHONPATH for ``target`` (a ``pip --target`` folder).

    ``target`` itself, then each existing folder named by a ``.pth`` file in it (in
    file name order, as ``site`` reads them). A ``.pth`` line that runs code
    (``import ...``; ``nvidia-cutlass-dsl``'s puts its ``dsl_packages`` on ``sys.path``
    that way) cannot be expressed on PYTHONPATH: with ``python`` (the install's
    interpreter), ``site`` runs those files in a child process over ``target`` and the
    folders they add are kept too. Returns ``(dirs, notes)``: what could not be
    followed is reported in ``notes``.
    """
    dirs = [target]
    notes: list[str] = []
    code_lines: list[tuple[str, str]] = []
    for pth in sorted(target.glob("*.pth")):
        for line in pth.read_text(errors="replace").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith(("import ", "import\t")):
                code_lines.append((pth.name, line[:80]))
                continue
            folder = (target / line).resolve()
            if folder.is_dir() and folder not in dirs:
                dirs.append(folder)
    if not code_lines:
        return dirs, notes
    added, why = _dirs_added_by_pth_code(target, python) if python else ([], "no interpreter")
    for folder in added:
        if folder.is_dir() and folder not in dirs:
            dirs.append(folder)
    if why:
        notes += [
            f"{name}: runs code at startup, which PYTHONPATH cannot do ({why}): {line}"
            for name, line in code_lines
        ]
    return dirs, notes


_PTH_PROBE = (
    "import json, os, site, sys\n"
    "before = set(sys.path)\n"
    "site.addsitedir(sys.argv[1])\n"
    "print(json.dumps([p for p in sys.path if p not in before and os.path.isdir(p)]))\n"
)


def _dirs_added_by_pth_code(target: Path, python: str) -> tuple[list[Path], str]:
    """The folders ``site`` adds to ``sys.path`` when it reads ``target``'s ``.pth``
    files (their ``import`` lines run), in ``python`` with ``target`` on PYTHONPATH;
    ``([], reason)`` where that fails."""
    env = {**os.environ, "PYTHONPATH": str(target)}
    try:
        res = subprocess.run(
            [python, "-c", _PTH_PROBE, str(target)],
            capture_output=True, text=True, check=False, env=env, timeout=120,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"{python}: {e}"
    if res.returncode != 0:
        return [], f"reading them failed: {res.stderr.strip()[-200:]}"
    try:
        added = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return [], f"unexpected answer {res.stdout[-200:]!r}"
    return [Path(p).resolve() for p in added if Path(p).resolve() != target.resolve()], ""


def merge_tree(src: Path, dst: Path) -> int:
    """Move every file of ``src`` to the same place under ``dst`` (replacing); returns the count."""
    moved = 0
    for root, _dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            target = dst / rel / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(Path(root) / name, target)
            moved += 1
    shutil.rmtree(src)
    return moved


# ----------------------------------------------------------------------------
# Installing
# ----------------------------------------------------------------------------

_PROBE = (
    "import json, platform, sys, sysconfig\n"
    "paths = sysconfig.get_paths()\n"
    "print(json.dumps({'version': '%d.%d' % sys.version_info[:2],"
    " 'full': platform.python_version(), 'machine': platform.machine(),"
    " 'prefix': sys.prefix, 'base_prefix': sys.base_prefix,"
    " 'purelib': paths['purelib'], 'platlib': paths['platlib']}))\n"
)


def probe_python(python: str) -> dict:
    exe = shutil.which(python) or python
    try:
        res = subprocess.run([exe, "-c", _PROBE], capture_output=True, text=True, check=False)
    except OSError as e:
        raise BundleError(f"cannot run {python}: {e}") from e
    if res.returncode != 0:
        raise BundleError(f"cannot run {python}: {res.stderr.strip()[-400:]}")
    info = json.loads(res.stdout.strip().splitlines()[-1])
    info["exe"] = exe
    return info


def check_python(info: Mapping, index: Mapping) -> None:
    """The install's Python is the bundle's version and machine; else a clear error."""
    want = str(index["python"])
    if info["version"] != ".".join(want.split(".")[:2]):
        raise BundleError(
            f"this bundle is for Python {want}; {info['exe']} is Python {info['full']} "
            "(pass --python with a matching interpreter)"
        )
    arches = {_platform_arch(p) for p in index.get("platforms", [])} - {None}
    if arches and info["machine"] not in arches:
        raise BundleError(
            f"this bundle is for {'/'.join(sorted(a for a in arches if a))}; "
            f"{info['exe']} runs on {info['machine']}"
        )


def _platform_arch(tag: str) -> str | None:
    m = re.match(r"^(?:manylinux_\d+_\d+|musllinux_\d+_\d+|manylinux\d+|linux)_(.+)$", tag)
    return m.group(1) if m else None


class Installer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.parts_dir: Path = args.parts.resolve()
        self.index_path: Path = args.index.resolve() if args.index else find_index(self.parts_dir)
        if args.index and args.parts == _default_parts_dir():
            self.parts_dir = self.index_path.parent
        self.index = load_index(self.index_path)

    def step(self, msg: str) -> None:
        say(f"[install +{time.monotonic() - self.t0:5.1f}s] {msg}")

    def _part_progress(self, i: int, n: int, total: int) -> None:
        if i == n or i % 5 == 0:
            self.step(f"   part {i}/{n} ok ({mib(total)})")

    def check(self) -> int:
        idx = self.index
        self.step(
            f"bundle {idx['bundle']}: {len(idx['parts'])} parts, {mib(idx['payload']['size'])}"
        )
        verify_parts(self.parts_dir, idx, self._part_progress)
        manifest, hashes = hash_payload(self.parts_dir, idx)
        verify_wheels(manifest, hashes)
        self.step(
            f"ok: {len(idx['parts'])} parts and {len(manifest['wheels'])} wheels "
            "match their checksums"
        )
        return 0

    def install(self) -> int:
        args, idx = self.args, self.index
        info = probe_python(args.python or sys.executable)
        check_python(info, idx)
        self.step(
            f"bundle {idx['bundle']} (vLLM {idx['pin']} {idx['flavor']}, Python {idx['python']}): "
            f"{len(idx['parts'])} parts, {mib(idx['payload']['size'])}"
        )
        verify_parts(self.parts_dir, idx, self._part_progress)
        work = Path(tempfile.mkdtemp(prefix="vllm-ext-bundle-", dir=args.work))
        try:
            self.step(f"reassembling into {work}")
            sizes: dict[str, int] = {}

            def progress(name: str, done: int) -> None:
                sizes[name] = (work / name).stat().st_size

            hashes = unpack(self.parts_dir, idx, work, progress)
            manifest = json.loads((work / MANIFEST_NAME).read_text())
            verify_wheels(manifest, hashes, sizes)
            n, total = len(manifest["wheels"]), sum(w["size"] for w in manifest["wheels"])
            self.step(f"{n} wheels ({mib(total)}) match their checksums")
            runs = self._install_wheels(manifest, work, info)
            patched = self._patch(manifest, work, info)
        finally:
            if args.keep:
                self.step(f"kept the unpacked bundle in {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
        where = f"venv {self.dest}" if args.venv else f"{self.dest} (--target)"
        self.step(
            f"done: {n} wheels ({mib(total)}) in {runs} pip runs into {where}; {patched}; "
            f"{time.monotonic() - self.t0:.0f} s"
        )
        if args.target:
            self._print_target_env(info["exe"])
        else:
            say(
                f"use it: {self.dest / 'bin' / 'python'} "
                f"(or: source {self.dest / 'bin' / 'activate'})"
            )
        return 0

    # -- steps ---------------------------------------------------------------------
    @property
    def dest(self) -> Path:
        return Path(self.args.venv or self.args.target).absolute()

    def _make_venv(self, info: Mapping) -> Path:
        py = self.dest / "bin" / "python"
        if py.exists():
            self.step(f"using the existing venv {self.dest}")
        else:
            self.step(f"creating venv {self.dest} (--system-site-packages) from {info['exe']}")
            self._run(
                [info["exe"], "-m", "venv", "--system-site-packages", str(self.dest)],
                "python -m venv",
            )
        new = probe_python(str(py))
        if info["prefix"] != info["base_prefix"]:
            # --python is a venv: its packages (the target's torch...) are not "system" ones
            bases = list(dict.fromkeys([info["purelib"], info["platlib"]]))
            lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in bases)
            (Path(new["purelib"]) / BASE_PTH_NAME).write_text(lines)
            self.step(f"   the venv also sees {', '.join(bases)} (after its own packages)")
        return py

    def _install_wheels(self, manifest: Mapping, work: Path, info: Mapping) -> int:
        args = self.args
        groups: list[list[str]] = manifest["install_groups"]
        common = ["install", "--no-index", "--no-deps", "--disable-pip-version-check", "--no-input"]
        if args.no_compile:
            common.append("--no-compile")
        env = {"PIP_NO_INDEX": "1"}
        if args.venv:
            py = str(self._make_venv(info))
            common.append("--ignore-installed")  # never touch what the venv sees from outside
        else:
            py = info["exe"]
            self.dest.mkdir(parents=True, exist_ok=True)
        for i, group in enumerate(groups, 1):
            wheels = [str(work / WHEELS_DIR / f) for f in group]
            size = sum((work / WHEELS_DIR / f).stat().st_size for f in group)
            self.step(f"pip run {i}/{len(groups)}: {len(group)} wheels ({mib(size)})")
            if args.venv:
                self._run([py, "-m", "pip", *common, *wheels], f"pip run {i}", env)
            else:
                staging = self.dest / f".bundle-staging-{i}"
                shutil.rmtree(staging, ignore_errors=True)
                self._run(
                    [py, "-m", "pip", *common, "--target", str(staging), *wheels],
                    f"pip run {i}",
                    env,
                )
                merge_tree(staging, self.dest)
        return len(groups)

    def _patch(self, manifest: Mapping, work: Path, info: Mapping) -> str:
        pin = manifest["pin"]
        vllm = {canonical_name(pin["package"])}
        if self.args.no_patches:
            return "patches skipped (--no-patches)"
        if not pin.get("patches"):
            return "no patches for this pin"
        if not any(canonical_name(w["name"]) in vllm for w in manifest["wheels"]):
            return f"patches not applied: the bundle has no {pin['package']}"
        if shutil.which("git") is None:
            raise BundleError("applying the patches needs git on PATH (or pass --no-patches)")
        tool = [info["exe"], str(work / PATCHTOOL_NAME), "apply", "--pin", pin["version"]]
        tool += ["--patches", str(work / PATCHES_DIR)]
        if self.args.venv:
            tool += ["--installed", "--python", str(self.dest / "bin" / "python")]
        else:
            tool += ["--site-packages", str(self.dest)]
        self.step(f"applying the vLLM {pin['version']} patches ({len(pin['patches'])})")
        out = self._run(tool, "applying the patches")
        for line in out.strip().splitlines():
            self.step(f"   {line}")
        return f"{len(pin['patches'])} patches applied"

    def _print_target_env(self, python: str) -> None:
        dirs, notes = pythonpath_dirs(self.dest, python)
        value = ":".join(str(d) for d in dirs)
        line = f"export PYTHONPATH={value}${{PYTHONPATH:+:$PYTHONPATH}}"
        (self.dest / TARGET_ENV_FILE).write_text(
            "# written by the vllm-ext bundle installer: source this file to use the packages\n"
            f"{line}\n"
            f"export PATH={self.dest / 'bin'}${{PATH:+:$PATH}}\n"
        )
        say("PYTHONPATH for this --target (also in " + str(self.dest / TARGET_ENV_FILE) + "):")
        say(f"  {line}")
        for note in notes:
            say(f"  note: {note}")

    def _run(self, cmd: Sequence[str], what: str, env: Mapping[str, str] | None = None) -> str:
        res = subprocess.run(
            list(cmd),
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, **(env or {})},
        )
        if res.returncode != 0:
            tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-15:])
            raise BundleError(f"{what} failed (exit {res.returncode}):\n{tail}")
        return res.stdout


def _default_parts_dir() -> Path:
    return Path(__file__).resolve().parent


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="install.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text in {
        "check": "check every part and wheel against its checksum; writes nothing",
        "install": "check, reassemble, install with pip (no index) and apply the patches",
    }.items():
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument(
            "--parts",
            type=Path,
            default=_default_parts_dir(),
            metavar="DIR",
            help="folder holding the parts (default: this file's)",
        )
        p.add_argument("--index", type=Path, metavar="FILE", help="the bundle's *.index.json")
        if name == "install":
            where = p.add_mutually_exclusive_group(required=True)
            where.add_argument("--venv", type=Path, metavar="DIR", help="install into this venv")
            where.add_argument(
                "--target", type=Path, metavar="DIR", help="pip install --target DIR"
            )
            p.add_argument(
                "--python", metavar="PY", help="interpreter of the install (default: this one)"
            )
            p.add_argument(
                "--work", type=Path, metavar="DIR", help="scratch folder parent (default: $TMPDIR)"
            )
            p.add_argument(
                "--no-patches", action="store_true", help="do not apply the vLLM patches"
            )
            p.add_argument("--no-compile", action="store_true", help="pip --no-compile (faster)")
            p.add_argument("--keep", action="store_true", help="keep the unpacked bundle")
    return ap


def main(argv: Iterable[str] | None = None) -> int:
    args = build_parser().parse_args(None if argv is None else list(argv))
    try:
        inst = Installer(args)
        return inst.check() if args.cmd == "check" else inst.install()
    except BundleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
