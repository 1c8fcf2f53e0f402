# SPDX-License-Identifier: Apache-2.0
"""A patch series: its ``.patch`` files parsed (hunks, the ``Upstream-Since:`` trailer),
where the series of a pin lives, which series covers a vLLM release."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

#: Committer used by ``git am`` where the checkout has no identity configured.
_FALLBACK_COMMITTER = {
    "GIT_COMMITTER_NAME": "vllm-ext patch tool",
    "GIT_COMMITTER_EMAIL": "vllm-ext@users.noreply.example",
}
_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@ ?(.*)$")
_FAILED_AT_RE = re.compile(r"patch failed: (.+):(\d+)\s*$", re.M)
_VERSION_RE = re.compile(r"""^(?:__version__\s*=\s*)?version\s*=\s*['"]([^'"]+)['"]""", re.M)


class PatchToolError(RuntimeError):
    """A failure to report to the user (the message is the whole story)."""


class UsageError(PatchToolError):
    """Bad usage (a missing interpreter, an unknown series): exit status 2."""


# ----------------------------------------------------------------------------
# The series
# ----------------------------------------------------------------------------


def version_key(version: str) -> tuple[int, ...]:
    """``"0.23.0+cpu"`` -> ``(0, 23, 0)``; pre-release suffixes are ignored."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


@dataclass(frozen=True)
class Hunk:
    old_start: int
    new_start: int
    header: str  # the whole "@@ ... @@ context" line

    def describe(self, index: int, path: str) -> str:
        return f"hunk #{index} of {path} ({self.header})"


@dataclass
class Patch:
    """One ``git format-patch`` file of the series."""

    path: Path
    subject: str
    upstream_since: str | None
    hunks: dict[str, list[Hunk]] = field(default_factory=dict)  # file -> hunks

    @property
    def name(self) -> str:
        return self.path.name

    def files(self, prefix: str = "") -> list[str]:
        return [f for f in self.hunks if f.startswith(prefix)]

    def is_upstream_in(self, version: str | None) -> bool:
        return (
            version is not None
            and self.upstream_since is not None
            and version_key(version) >= version_key(self.upstream_since)
        )

    def locate(self, path: str, line: int, reverse: bool) -> str:
        """Describe the hunk of ``path`` that git reported failing at ``line``."""
        hunks = self.hunks.get(path, [])
        if not hunks:
            return f"{path}:{line}"
        starts = [h.new_start if reverse else h.old_start for h in hunks]
        index = min(range(len(hunks)), key=lambda i: abs(starts[i] - line))
        return hunks[index].describe(index + 1, path)


def parse_patch(path: Path) -> Patch:
    """Read subject, ``Upstream-Since:`` trailer and hunks of a format-patch file."""
    text = path.read_text(encoding="utf-8", errors="replace")
    head, sep, _ = text.partition("\n---\n")
    if not sep:
        raise PatchToolError(f"{path}: not a git format-patch file (no '---' separator)")
    subject_lines: list[str] = []
    for line in head.splitlines():
        if subject_lines and line.startswith((" ", "\t")):
            subject_lines.append(line.strip())
        elif subject_lines:
            break
        elif line.startswith("Subject:"):
            subject_lines.append(line[len("Subject:") :].strip())
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", " ".join(subject_lines))
    trailer = re.search(r"^Upstream-Since:[ \t]*(\S+)", head, re.M)
    if trailer is None:
        raise PatchToolError(f"{path.name}: no 'Upstream-Since:' trailer in its message")
    since = trailer.group(1)
    patch = Patch(path, subject, None if since.lower() == "none" else since)
    current: str | None = None
    for line in text.splitlines():
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[-1]
            patch.hunks[current] = []
        elif current is not None and (m := _HUNK_RE.match(line)):
            patch.hunks[current].append(Hunk(int(m.group(1)), int(m.group(3)), line))
    if not patch.hunks:
        raise PatchToolError(f"{path.name}: contains no diff")
    return patch


def patches_root() -> Path:
    """Where the series live: ``$VLLM_EXT_PATCHES``, else next to the package."""
    env = os.environ.get("VLLM_EXT_PATCHES")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent.parent  # vllm_ext/
    for candidate in (here / "patches", here.parent / "patches"):
        if candidate.is_dir():
            return candidate
    raise PatchToolError(f"no patches directory next to {here} (set VLLM_EXT_PATCHES)")


def series_dir(pin: str, root: Path | None = None) -> Path:
    """The series directory of ``pin``: its ``patch_dir`` in pins.toml, else by name."""
    root = root or patches_root()
    try:
        from vllm_ext import compat

        entry = compat.pin_for(pin)
    except Exception:  # pins unreadable: fall back to the naming convention
        entry = None
    if entry is not None:
        return root / Path(entry.patch_dir).name
    return root / f"vllm-{pin}"


def load_series(directory: Path) -> list[Patch]:
    return [parse_patch(p) for p in sorted(directory.glob("*.patch"))]


def available_series(root: Path | None = None) -> dict[str, Path]:
    """Version -> directory of every series under ``root`` (``vllm-<version>/``)."""
    found = {}
    for directory in (root or patches_root()).glob("vllm-*"):
        version = directory.name[len("vllm-") :]
        if directory.is_dir() and version_key(version) and any(directory.glob("*.patch")):
            found[version] = directory
    return dict(sorted(found.items(), key=lambda kv: version_key(kv[0])))


def is_pinned(version: str) -> bool:
    """Whether ``version`` is covered by a pin of ``pins.toml`` (a pin may have no series)."""
    try:
        from vllm_ext import compat

        return compat.pin_for(version) is not None
    except Exception:  # pins unreadable: only the series directories tell
        return False


def nearest_older_series(version: str, root: Path | None = None) -> tuple[str, Path] | None:
    """The newest series for a vLLM release at or before ``version``, if any."""
    older = [
        (v, d) for v, d in available_series(root).items() if version_key(v) <= version_key(version)
    ]
    return older[-1] if older else None


def upstream_elsewhere(version: str, root: Path | None = None) -> list[tuple[Patch, str]]:
    """Patches of any series whose change is upstream in ``version``: (patch, series)."""
    found = []
    for directory in sorted((root or patches_root()).glob("vllm-*")):
        for patch in load_series(directory):
            if patch.is_upstream_in(version):
                found.append((patch, directory.name))
    return found
