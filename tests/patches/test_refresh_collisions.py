# SPDX-License-Identifier: Apache-2.0
"""``refresh`` lists every hunk that does not apply (not only the first) and flags a
wire constant (a ``*_VERSION`` / ``*_PREFIX``) that the new tree already uses: the
collision of a series bumping NIXL_CONNECTOR_VERSION to a number upstream took for
another change, which would let patched and unpatched peers pair."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from test_upstream_pr import kit

_METADATA = "vllm/nixl/metadata.py"
_WORKER = "vllm/nixl/worker.py"
_BASE = {
    _METADATA: "# versions\n#  15: older change\nNIXL_CONNECTOR_VERSION: int = 15\n",
    _WORKER: "def a():\n    return 1\n\n\n" + "# filler\n" * 12 + "\ndef b():\n    return 2\n",
}


def _write(tree: Path, files: dict[str, str], version: str) -> None:
    for rel, text in {**files, "vllm/_version.py": f"__version__ = version = '{version}'\n"}.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)


def _git(tree: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@vllm-ext.dev", *args],
        cwd=tree, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip


def _series_and_new_tree(root: Path) -> tuple[Path, Path]:
    base = root / "base"
    base.mkdir()
    _git(base, "init", "-q", "-b", "main")
    _write(base, _BASE, "0.33.0")
    _git(base, "add", "-A")
    _git(base, "commit", "-qm", "base")
    # The patch: bump the version for its field, and change both functions.
    changed = {
        _METADATA: _BASE[_METADATA].replace(
            "NIXL_CONNECTOR_VERSION: int = 15", "#  16: our field\nNIXL_CONNECTOR_VERSION: int = 16"
        ),
        _WORKER: _BASE[_WORKER].replace("return 1", "return 10").replace("return 2", "return 20"),
    }
    _write(base, changed, "0.33.0")
    _git(base, "commit", "-qam", "[KV Connector] Ours\n\nWhy:\nA test.\n\nUpstream-Since: none")
    series = root / "vllm-0.33.0"
    series.mkdir()
    _git(base, "format-patch", "-q", "--zero-commit", "-1", "-o", str(series))
    # Upstream's next release: version 16 for another change, both functions changed.
    new = root / "new"
    new.mkdir()
    _git(new, "init", "-q", "-b", "main")
    upstream = {
        _METADATA: _BASE[_METADATA].replace(
            "NIXL_CONNECTOR_VERSION: int = 15",
            "#  16: upstream's own change\nNIXL_CONNECTOR_VERSION: int = 16",
        ),
        _WORKER: _BASE[_WORKER].replace("return 1", "return 1.5").replace("return 2", "return 2.5"),
    }
    _write(new, upstream, "0.34.0")
    _git(new, "add", "-A")
    _git(new, "commit", "-qm", "0.34.0")
    _git(new, "tag", "v0.34.0")
    return series, new


def test_refresh_lists_every_conflicting_hunk_and_the_version_collision(tmp_path: Path) -> None:
    series, tree = _series_and_new_tree(tmp_path)
    out = tmp_path / "out"
    res = kit("refresh", "--series", series, "--tree", tree, "--out", out, "--no-base-tree",
              "--quiet")  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    (row,) = json.loads((out / "refresh.json").read_text())["patches"]
    assert row["status"] == "conflicts"
    evidence = " / ".join(row["evidence"])
    assert (
        "wire constant: NIXL_CONNECTOR_VERSION = 16 collides with upstream's: "
        "vllm/nixl/metadata.py already has NIXL_CONNECTOR_VERSION = 16 (the patch moved "
        "it from 15); take 17"
    ) in evidence
    # every hunk that does not apply, in both files (git itself names only the first)
    assert (
        "3 hunks do not apply: hunk #1 of vllm/nixl/metadata.py; hunks #1, #2 of "
        "vllm/nixl/worker.py"
    ) in evidence
    assert "wire constant: NIXL_CONNECTOR_VERSION = 16 collides" in res.stderr


def test_a_free_version_is_not_flagged(tmp_path: Path) -> None:
    series, tree = _series_and_new_tree(tmp_path)
    patch = next(series.glob("*.patch"))
    patch.write_text(patch.read_text().replace("int = 16", "int = 17"))
    out = tmp_path / "out"
    kit("refresh", "--series", series, "--tree", tree, "--out", out, "--no-base-tree", "--quiet")
    (row,) = json.loads((out / "refresh.json").read_text())["patches"]
    assert not any("wire constant" in e for e in row["evidence"]), row
