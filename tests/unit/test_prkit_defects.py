# SPDX-License-Identifier: Apache-2.0
"""Defects of the upstream PR kit, one test (or a few) each, on small synthetic git
trees (tests/unit/prkit_trees.py): no vLLM download, no engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from prkit_trees import EMAIL, HEADER, NAME, SKIP_ALL, git, make_series, mini_tree, no_git_identity

import upstream_pr  # noqa: E402  (tools/, put on sys.path by prkit_trees)
from prkit import identity  # noqa: E402
from prkit.common import UsageError  # noqa: E402

RESERVED = "Group Alias <alias@users.noreply.example.org>"


# -- 1. the identity comes first; GIT_AUTHOR_* win; --keep-author ---------------------


def test_identity_is_checked_before_any_tree_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    no_git_identity(monkeypatch, tmp_path / "home")
    monkeypatch.chdir(tmp_path)

    def no_download(*args, **kwargs):
        raise AssertionError("the tree was made before the identity was checked")

    monkeypatch.setattr(upstream_pr.branch_mod, "obtain_tree", no_download)
    rc = upstream_pr.main(["prepare", "--version", "0.23.0", "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no git identity" in err and "GIT_AUTHOR_EMAIL" in err


def test_git_author_variables_win_over_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = mini_tree(tmp_path / "t", {})
    monkeypatch.setenv("GIT_AUTHOR_NAME", "Env Person")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "env.person@vllm-ext.dev")
    assert identity.from_git(tree) == identity.Identity("Env Person", "env.person@vllm-ext.dev")
    monkeypatch.delenv("GIT_AUTHOR_NAME")  # one of them alone: the other from the config
    assert identity.from_git(tree) == identity.Identity(NAME, "env.person@vllm-ext.dev")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "env@host.example.com")
    with pytest.raises(UsageError, match="reserved domain"):
        identity.from_git(tree)
    # an identity only in the environment is enough
    no_git_identity(monkeypatch, tmp_path / "home")
    monkeypatch.setenv("GIT_AUTHOR_NAME", "Env Person")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "env.person@vllm-ext.dev")
    bare = tmp_path / "bare"
    bare.mkdir()
    git(bare, "init", "-q")
    assert identity.from_git(bare).email == "env.person@vllm-ext.dev"


def _reserved_author_series(tmp_path: Path) -> tuple[Path, Path]:
    tree = mini_tree(tmp_path / "tree", {"vllm/a.py": HEADER + "A = 1\n"})
    name, _, mail = RESERVED.partition(" <")
    series = make_series(
        tree,
        tmp_path / "series" / "vllm-0.23.0",
        [("[Misc] Add B", {"vllm/a.py": HEADER + "A = 1\nB = 2\n"})],
        author=(name, mail.rstrip(">")),
    )
    return tree, series


def test_keep_author_refuses_a_reserved_domain_author(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tree, series = _reserved_author_series(tmp_path)
    assert identity.patch_author(next(series.glob("*.patch"))) == identity.Identity(
        "Group Alias", "alias@users.noreply.example.org"
    )
    args = ["prepare", "--tree", str(tree), "--series", str(series), "--quiet", *SKIP_ALL]
    args += ["--out", str(tmp_path / "o"), "--keep-author"]
    assert upstream_pr.main(args) == 2
    err = capsys.readouterr().err
    assert "--keep-author would keep authors at reserved domains" in err
    assert "0001-Misc-Add-B.patch: Group Alias <alias@users.noreply.example.org>" in err
    assert "pr/vllm-0.23.0" not in git(tree, "branch", "--list")
    # allowed explicitly: the author is kept, the sign-off is the runner's
    assert upstream_pr.main([*args, "--allow-reserved-identity"]) == 0
    log = git(tree, "log", "-1", "--format=%an <%ae>|%cn <%ce>|%B", "pr/vllm-0.23.0")
    assert log.startswith(f"{RESERVED}|{NAME} <{EMAIL}>|")
    assert f"Signed-off-by: {NAME} <{EMAIL}>" in log
