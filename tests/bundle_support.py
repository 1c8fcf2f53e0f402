# SPDX-License-Identifier: Apache-2.0
"""Small synthetic wheels and bundles for the bundle tool's tests (no network)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from devkit.bundle import build, installer


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def make_wheel(
    directory: Path,
    name: str,
    version: str,
    files: Mapping[str, bytes],
    requires: Sequence[str] = (),
) -> Path:
    """A valid pure-Python wheel of ``name`` holding ``files`` (path -> content)."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"]
    meta += [f"Requires-Dist: {r}\n" for r in requires]
    contents = dict(files)
    contents[f"{dist}.dist-info/METADATA"] = "".join(meta).encode()
    contents[f"{dist}.dist-info/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = "".join(f"{p},{_record_hash(d)},{len(d)}\n" for p, d in contents.items())
    record += f"{dist}.dist-info/RECORD,,\n"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, d in contents.items():
            z.writestr(p, d)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return path


def make_bundle(
    out: Path,
    wheels: Sequence[Path],
    part_size: int = 4096,
    python: str = "3.11",
    package: str = "vllm",
) -> dict:
    """A bundle of ``wheels`` (dependencies first) in ``out``, as ``bundle build`` writes it.

    Returns the index. Install groups come from ``installer.plan_groups``.
    """
    out.mkdir(parents=True, exist_ok=True)
    records = {w.name: installer.wheel_record(w) for w in wheels}
    groups, overlaps = installer.plan_groups([w.name for w in wheels], records)
    manifest = {
        "format": installer.FORMAT,
        "pin": {
            "version": "0.23.0",
            "flavor": "cpu",
            "package": package,
            "patches": ["0001-not-shipped.patch"],
        },
        "target": {"python": python, "platforms": ["manylinux_2_28_x86_64"]},
        "wheels": [
            {
                "file": w.name,
                "name": installer.wheel_name(w.name),
                "size": w.stat().st_size,
                "sha256": installer.sha256_file(w),
            }
            for w in wheels
        ],
        "total_bytes": sum(w.stat().st_size for w in wheels),
        "install_groups": groups,
        "overlaps": overlaps,
    }
    return build.write_bundle(
        out, "test-bundle", manifest, {w.name: w for w in wheels}, [], part_size, lambda _: None
    )
