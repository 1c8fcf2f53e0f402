# SPDX-License-Identifier: Apache-2.0
"""Which versions go into a bundle: uv resolves, as of the pin's release date.

* :func:`release_time`: when a release was uploaded (the newest file of that
  version on the index, from the PEP 691 JSON "simple" API, which also serves
  ``upload-time``). The index is this machine's (:mod:`devkit.index_config`).
* :func:`ensure_uv`: the pinned uv (PyPI package ``uv``), installed once with pip
  into ``~/.cache/vllm-ext/uv-<version>`` (``$VLLM_EXT_UV`` names another binary).
* :func:`compile_requirements`: ``uv pip compile`` for the target's Python and
  platform, with the target's packages excluded (``--excludes``: they are not
  resolved and their dependencies are not followed), ``--exclude-newer`` at the
  release date (except for the packages named in ``undated``) and the overrides.
* :func:`prune`: drops excluded packages and whatever only they needed, using the
  ``# via`` graph of uv's output, and says why each one went.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from devkit import index_config
from devkit.bundle.installer import BundleError, canonical_name

#: The uv release the bundle tool uses (bump deliberately: resolution may change).
UV_VERSION = "0.13.8"
#: Name of the requirements file given to uv; its lines are the roots of the graph.
ROOTS_FILE = "requirements.in"
_LINE_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s*(?:#\s*via\s+(.*))?$")


def _utc(ts: str) -> datetime:
    return datetime.fromisoformat(ts.replace("Z", "+00:00"))


def iso(ts: datetime) -> str:
    """RFC 3339 in UTC, whole seconds: ``2026-06-15T05:12:55Z``."""
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _file_version(filename: str, name: str) -> str | None:
    """The version in a wheel or sdist file name of project ``name`` (None: another project)."""
    parts = re.sub(r"\.(whl|tar\.gz|zip|tar\.bz2)$", "", filename).split("-")
    want = re.sub(r"[-_.]+", "_", name).lower()
    for i in range(1, len(parts)):
        if re.sub(r"[-_.]+", "_", "-".join(parts[:i])).lower() == want:
            return parts[i]
    return None


def release_time(name: str, version: str, index_url: str | None = None) -> datetime:
    """Upload time of the newest file of ``name==version`` (rebuilds included), read from
    ``index_url`` (default: the index this machine is configured to use)."""
    if index_url is None:
        try:
            index_url = index_config.simple_api_index()
        except index_config.IndexNotConfigured as e:
            raise BundleError(f"{e}; or pass --as-of DATE") from e
    url = f"{index_url.rstrip('/')}/{canonical_name(name)}/"
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            data = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise BundleError(f"cannot read {url} ({e}); pass --as-of DATE instead") from e
    times = [
        f.get("upload-time")
        for f in data.get("files", [])
        if _file_version(f.get("filename", ""), name) == version
    ]
    if not times:
        raise BundleError(f"{index_url} has no files of {name}=={version}")
    if not all(times):
        raise BundleError(f"{url} gives no upload times; pass --as-of DATE instead")
    return max(_utc(t) for t in times if t)


def ensure_uv(say: Callable[[str], None]) -> Path:
    """Path of the pinned uv binary, installing it (pip, once) if needed."""
    env = os.environ.get("VLLM_EXT_UV")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    home = cache / "vllm-ext" / f"uv-{UV_VERSION}"
    uv = home / "bin" / "uv"
    if uv.is_file():
        return uv
    say(f"installing uv {UV_VERSION} into {home} (once)")
    tmp = home.with_name(home.name + ".tmp")
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "--no-deps", "--target", str(tmp), f"uv=={UV_VERSION}"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if res.returncode != 0 or not (tmp / "bin" / "uv").is_file():
        raise BundleError(f"installing uv {UV_VERSION} failed:\n{res.stdout}{res.stderr}"[-2000:])
    if home.exists():
        import shutil

        shutil.rmtree(home)
    tmp.rename(home)
    return uv


@dataclass
class Resolution:
    """uv's answer: name -> version, and who needs each (``via``; roots have ``ROOT``)."""

    versions: dict[str, str] = field(default_factory=dict)
    via: dict[str, set[str]] = field(default_factory=dict)

    ROOT = "<root>"

    @classmethod
    def parse(cls, text: str) -> Resolution:
        """Parse ``uv pip compile --annotation-style line`` output."""
        res = cls()
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            m = _LINE_RE.match(line)
            if m is None:
                raise BundleError(f"unexpected line in uv's output: {raw!r}")
            name = canonical_name(m.group(1))
            res.versions[name] = m.group(2)
            parents: set[str] = set()
            for item in (m.group(3) or "").split(","):
                item = item.strip()
                if item.startswith(("-r ", "-c ", "--override", "--constraint")):
                    parents.add(cls.ROOT if item.startswith("-r ") else item)
                elif item:
                    parents.add(canonical_name(item))
            res.via[name] = parents
        return res

    @property
    def roots(self) -> list[str]:
        return sorted(n for n, p in self.via.items() if self.ROOT in p)


def compile_requirements(
    uv: Path,
    requirements: Iterable[str],
    *,
    python: str,
    platform: str,
    as_of: datetime,
    excludes: Iterable[str],
    overrides: Iterable[str],
    undated: Iterable[str],
    workdir: Path,
    index_url: str | None = None,
) -> Resolution:
    """Run ``uv pip compile`` and parse its answer (see the module docstring).

    ``index_url`` None: the index this machine is configured to use, or uv's default
    where none is (:meth:`devkit.index_config.IndexConfig.uv_args`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / ROOTS_FILE).write_text("".join(f"{r}\n" for r in requirements))
    (workdir / "excludes.txt").write_text("".join(f"{e}\n" for e in sorted(set(excludes))))
    (workdir / "overrides.txt").write_text("".join(f"{o}\n" for o in overrides))
    now = iso(datetime.now(UTC) + timedelta(days=1))
    if index_url is None:
        index_args = index_config.configured().uv_args()
    else:
        index_args = ["--index-url", index_url]
    cmd = [
        str(uv), "pip", "compile", ROOTS_FILE,
        "--excludes", "excludes.txt", "--overrides", "overrides.txt",
        "--python-version", python, "--python-platform", platform,
        "--exclude-newer", iso(as_of), "--only-binary", ":all:",
        *index_args,
        "--annotation-style", "line", "--no-header", "--quiet", "--no-config",
        "-o", "resolved.txt",
    ]  # fmt: skip
    for name in sorted(set(undated)):
        cmd += ["--exclude-newer-package", f"{name}={now}"]
    res = subprocess.run(
        cmd,
        cwd=workdir,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "NO_COLOR": "1"},
    )
    if res.returncode != 0:
        raise BundleError(f"uv could not resolve the bundle:\n{res.stderr.strip()[-3000:]}")
    return Resolution.parse((workdir / "resolved.txt").read_text())
