# SPDX-License-Identifier: Apache-2.0
"""The machine a bundle is for: Python version, platform tags, what it already has.

A target is described by command-line options or a TOML file (``--target-file``,
e.g. ``tools/targets/h200-cuda13-py312.toml``)::

    python = "3.12"                      # the target's Python (major.minor)
    platform = "manylinux_2_39_x86_64"   # its newest platform tag (glibc 2.39)
    have = "h200-cuda13-py312.txt"       # what it has (relative to the TOML file)
    exclude = ["flashinfer-python"]      # never bundle these
    override = ["cuda-python==13.3.1"]   # bundle exactly this version

The ``have`` list is ``pip list --format=freeze`` output (``name==version``); a bare
``name`` means "present, any version". Options on the command line add to the file's.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from devkit.bundle.installer import BundleError, canonical_name

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_FREEZE_RE = re.compile(rf"^({_NAME})\s*(?:\[[^\]]*\])?\s*(?:(===?)\s*(\S+)|@\s*\S.*)?$")
#: manylinux levels the pinned uv knows for ``--python-platform`` (besides 2_17).
_UV_MANYLINUX = (17, 28, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40)
_MANYLINUX_RE = re.compile(r"^manylinux_(\d+)_(\d+)_(\w+)$")
#: Legacy aliases pip still matches by name.
_LEGACY = {(2, 17): "manylinux2014", (2, 12): "manylinux2010", (2, 5): "manylinux1"}


def parse_have(text: str, source: str = "<have>") -> dict[str, str | None]:
    """Parse a have list: canonical name -> version, or None for "any version".

    Accepts ``name==version`` / ``name===version`` (``pip freeze``), ``name @ url``
    (present, any version), bare ``name``, comments and blank lines. ``-e`` lines
    (editable installs) carry no name and are skipped. Anything else is an error
    naming the line.
    """
    have: dict[str, str | None] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith(("-e ", "--editable")):
            continue
        m = _FREEZE_RE.match(line)
        if m is None:
            raise BundleError(f"{source}:{n}: not 'name', 'name==version' or 'name @ url': {raw!r}")
        have[canonical_name(m.group(1))] = m.group(3)
    return have


def expand_platforms(tags: Iterable[str]) -> list[str]:
    """Every platform tag the given ones imply, newest first (pip matches tags exactly).

    ``manylinux_2_28_x86_64`` -> ``manylinux_2_28_x86_64 ... manylinux_2_17_x86_64,
    manylinux2014_x86_64, ... manylinux1_x86_64``; other tags are kept as given.
    """
    out: list[str] = []
    for tag in tags:
        legacy = {v: k for k, v in _LEGACY.items()}
        m = re.match(r"^(manylinux\d+)_(\w+)$", tag)
        if m and m.group(1) in legacy:
            major, minor = legacy[m.group(1)]
            tag = f"manylinux_{major}_{minor}_{m.group(2)}"
        m = _MANYLINUX_RE.match(tag)
        if m is None:
            out.append(tag)
            continue
        major, top, arch = int(m.group(1)), int(m.group(2)), m.group(3)
        for minor in range(top, 4, -1):
            out.append(f"manylinux_{major}_{minor}_{arch}")
            if (major, minor) in _LEGACY:
                out.append(f"{_LEGACY[(major, minor)]}_{arch}")
    return list(dict.fromkeys(out))


def uv_platform(tags: Iterable[str]) -> str:
    """uv's ``--python-platform`` for the newest manylinux tag among ``tags``."""
    best: tuple[int, str] | None = None
    for tag in expand_platforms(tags):
        m = _MANYLINUX_RE.match(tag)
        if m and int(m.group(1)) == 2 and (best is None or int(m.group(2)) > best[0]):
            best = (int(m.group(2)), m.group(3))
    if best is None:
        raise BundleError(
            f"no manylinux platform tag among {list(tags)} (e.g. manylinux_2_28_x86_64)"
        )
    level = max((v for v in _UV_MANYLINUX if v <= best[0]), default=None)
    if level is None:
        raise BundleError(f"manylinux_2_{best[0]} is older than uv resolves for (2_17)")
    return f"{best[1]}-manylinux_2_{level}"


def host_platform() -> str:
    """This machine's newest manylinux tag, e.g. ``manylinux_2_36_x86_64``."""
    try:
        from packaging import tags
    except ImportError:  # pip always carries a copy
        from pip._vendor.packaging import tags  # type: ignore[no-redef]
    for tag in tags.sys_tags():
        if tag.platform.startswith("manylinux_"):
            return tag.platform
    raise BundleError("this machine has no manylinux platform tag; pass --platform")


def cuda_major(have: Mapping[str, str | None]) -> int | None:
    """The CUDA major version of the target's torch, if the have list tells it.

    From torch's local version (``2.11.0+cu130`` -> 13) or the CUDA runtime wheel
    (``nvidia-cuda-runtime==13.0.96``, ``nvidia-cuda-runtime-cu12``).
    """
    torch = have.get("torch") or ""
    m = re.search(r"\+cu(\d+?)(\d)$", torch)
    if m:
        return int(m.group(1))
    for name, version in have.items():
        m = re.fullmatch(r"nvidia-cuda-runtime(?:-cu(\d+))?", name)
        if m and m.group(1):
            return int(m.group(1))
        if m and version and version.split(".")[0].isdigit():
            return int(version.split(".")[0])
    return None


@dataclass
class Target:
    """What a bundle is built for."""

    python: str  # "3.12" (or "3.12.3")
    platforms: list[str]  # as given, e.g. ["manylinux_2_39_x86_64"]
    have: dict[str, str | None] = field(default_factory=dict)
    have_source: str | None = None
    exclude: dict[str, str] = field(default_factory=dict)  # canonical name -> where it was asked
    override: list[str] = field(default_factory=list)
    description: str | None = None  # the TOML file, if any

    @property
    def python_minor(self) -> str:
        return ".".join(self.python.split(".")[:2])

    @property
    def arch(self) -> str:
        m = _MANYLINUX_RE.match(expand_platforms(self.platforms)[0])
        return m.group(3) if m else "x86_64"

    def marker_env(self) -> dict[str, str]:
        """PEP 508 marker values of the target (for reading wheel requirements)."""
        full = self.python if self.python.count(".") == 2 else f"{self.python}.0"
        return {
            "python_version": self.python_minor,
            "python_full_version": full,
            "implementation_name": "cpython",
            "implementation_version": full,
            "platform_python_implementation": "CPython",
            "os_name": "posix",
            "sys_platform": "linux",
            "platform_system": "Linux",
            "platform_machine": self.arch,
            "platform_release": "",
            "platform_version": "",
        }


def load_target(
    target_file: Path | None,
    python: str | None,
    platforms: list[str] | None,
    have_file: Path | None,
    exclude: Iterable[str],
    override: Iterable[str],
) -> Target:
    """Merge a target TOML file (optional) with command-line options (they win/add).

    Without either, the target is this machine's Python and platform with nothing present.
    """
    spec: dict = {}
    base = Path.cwd()
    if target_file is not None:
        try:
            spec = tomllib.loads(target_file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise BundleError(f"cannot read the target file {target_file}: {e}") from e
        base = target_file.parent
        unknown = set(spec) - {"python", "platform", "have", "exclude", "override"}
        if unknown:
            raise BundleError(f"{target_file}: unknown keys {sorted(unknown)}")
    plat = platforms or spec.get("platform") or [host_platform()]
    target = Target(
        python=python or str(spec.get("python") or "{}.{}".format(*sys.version_info[:2])),
        platforms=[plat] if isinstance(plat, str) else list(plat),
        exclude={
            **{canonical_name(n): Path(str(target_file)).name for n in spec.get("exclude", [])},
            **{canonical_name(n): "--exclude" for n in exclude},
        },
        override=[*spec.get("override", []), *override],
        description=str(target_file) if target_file else None,
    )
    have_path = have_file or (base / spec["have"] if "have" in spec else None)
    if have_path is not None:
        try:
            text = have_path.read_text()
        except OSError as e:
            raise BundleError(f"cannot read the have list {have_path}: {e}") from e
        target.have = parse_have(text, str(have_path))
        target.have_source = str(have_path)
    for spec_line in target.override:
        if not re.fullmatch(rf"{_NAME}==\S+", spec_line):
            raise BundleError(f"--override wants name==version, got {spec_line!r}")
    uv_platform(target.platforms)  # a clear error now rather than from uv later
    return target
