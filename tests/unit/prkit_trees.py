# SPDX-License-Identifier: Apache-2.0
"""Small synthetic vLLM-like git trees and patch series for the PR kit's unit tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))

NAME, EMAIL = "Kit Tester", "kit.tester@vllm-ext.dev"
HEADER = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
)
SKIP_ALL = ("--skip", "ruff", "--skip", "spdx", "--skip", "mypy", "--skip", "pytest")


def git(repo: Path, *args: str, env: dict[str, str] | None = None) -> str:
    res = subprocess.run(
        ["git", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        env={**os.environ, "GIT_CEILING_DIRECTORIES": str(repo.parent), **(env or {})},
    )
    assert res.returncode == 0, f"git {args}: {res.stderr}"
    return res.stdout


def write(tree: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)


def mini_tree(root: Path, files: dict[str, str], version: str = "0.23.0") -> Path:
    """A git repository holding ``vllm/_version.py`` and ``files``, tagged ``v<version>``,
    with the tester's identity in its local config."""
    tree = root
    tree.mkdir(parents=True)
    write(tree, {"vllm/__init__.py": HEADER, "vllm/_version.py": f"version = '{version}'\n"})
    write(tree, files)
    git(tree, "init", "-q", "-b", "main")
    git(tree, "config", "user.name", NAME)
    git(tree, "config", "user.email", EMAIL)
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", f"vLLM {version}")
    git(tree, "tag", f"v{version}")
    return tree


def make_series(
    tree: Path,
    dest: Path,
    commits: list[tuple[str, dict[str, str]]] | list[tuple[str, dict[str, str], str]],
    author: tuple[str, str] = (NAME, EMAIL),
    upstream_since: str = "none",
) -> Path:
    """Commit each ``(subject, files[, upstream_since])`` on ``tree``, write the commits
    as a format-patch series to ``dest`` and reset ``tree`` to where it was."""
    head = git(tree, "rev-parse", "HEAD").strip()
    env = {"GIT_AUTHOR_NAME": author[0], "GIT_AUTHOR_EMAIL": author[1]}
    for subject, files, *since in commits:
        write(tree, files)
        git(tree, "add", "-A")
        message = (
            f"{subject}\n\nWhy:\nA test.\n\nRelated upstream PR:\nNone found for {subject}.\n\n"
            f"Upstream-Since: {since[0] if since else upstream_since}\n"
        )
        git(tree, "commit", "-qm", message, env=env)
    dest.mkdir(parents=True, exist_ok=True)
    git(tree, "format-patch", "-q", "--zero-commit", "-o", str(dest), head)
    git(tree, "reset", "-q", "--hard", head)
    return dest


def no_git_identity(monkeypatch, home: Path) -> None:
    """No identity anywhere: no global/system config, no GIT_AUTHOR_* variables."""
    home.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(home / "none"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for var in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "EMAIL"):
        monkeypatch.delenv(var, raising=False)
