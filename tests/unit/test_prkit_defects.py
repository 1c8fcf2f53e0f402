# SPDX-License-Identifier: Apache-2.0
"""Defects of the upstream PR kit, one test (or a few) each, on small synthetic git
trees (tests/unit/prkit_trees.py): no vLLM download, no engine."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import upstream_pr  # noqa: E402  (tools/upstream_pr.py)
from prkit import identity  # noqa: E402
from prkit.common import UsageError  # noqa: E402
from prkit_trees import (  # noqa: E402
    EMAIL,
    HEADER,
    NAME,
    SKIP_ALL,
    git,
    make_series,
    mini_tree,
    no_git_identity,
)
from prkit_trees import REPO as REPO_ROOT  # noqa: E402

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


# -- 2. a check that could not run fails the run unless --allow-skip names it ---------


def _tested_series(tmp_path: Path, pyproject: str = "") -> tuple[Path, Path]:
    files = {"vllm/a.py": HEADER + "A = 1\n"}
    if pyproject:
        files["pyproject.toml"] = pyproject
    tree = mini_tree(tmp_path / "tree", files)
    series = make_series(
        tree,
        tmp_path / "series" / "vllm-0.23.0",
        [
            (
                "[Misc] Add B",
                {
                    "vllm/a.py": HEADER + "A = 1\nB = 2\n",
                    "tests/test_b.py": HEADER + "def test_b():\n    assert True\n",
                },
            )
        ],
    )
    return tree, series


def test_a_check_that_could_not_run_fails_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree, series = _tested_series(tmp_path)
    out = tmp_path / "o"
    args = ["prepare", "--tree", str(tree), "--series", str(series), "--out", str(out)]
    args += ["--quiet", "--skip", "ruff", "--skip", "spdx", "--skip", "mypy"]  # no --python
    assert upstream_pr.main(args) == 1
    captured = capsys.readouterr()
    assert "FAIL pytest [0001]: could not run: no --python" in captured.out
    assert "--allow-skip pytest" in captured.err
    assert upstream_pr.main([*args, "--branch", "pr/b2", "--allow-skip", "pytest"]) == 0
    assert "SKIP pytest [0001]: did not run: no --python" in capsys.readouterr().out
    text = (out / "PR.md").read_text()
    assert "ran on every file" not in text
    assert "No check ran. Not run: ruff (skipped on request (--skip));" in text
    assert "pytest (did not run: no --python" in text


FAKE_MYPY = """#!/bin/sh
# an interpreter whose mypy starts but cannot load the tree's plugin (as vLLM's
# pydantic.mypy plugin fails where pydantic is missing)
if [ "$3" = "--version" ]; then echo "mypy 1.0.0 (fake)"; exit 0; fi
echo "error: Error importing plugin 'no_such_plugin_kit.mypy': No module named \\
'no_such_plugin_kit'" >&2
exit 2
"""


@pytest.mark.parametrize("interpreter", ["fake mypy", "none"])
def test_mypy_that_fails_to_start_fails_the_check(tmp_path: Path, interpreter: str) -> None:
    """With a mypy whose plugin is missing (exit 2, no error lines) and with no mypy at
    all (as in an env without it), the check did not run: FAIL, or SKIP when allowed."""
    from prkit import branch as branch_mod
    from prkit import checks

    pyproject = '[project]\nname = "vllm"\n\n[tool.mypy]\nplugins = ["no_such_plugin_kit.mypy"]\n'
    tree, series = _tested_series(tmp_path, pyproject)
    python = None
    if interpreter == "fake mypy":
        python = tmp_path / "bin" / "python"
        python.parent.mkdir()
        python.write_text(FAKE_MYPY)
        python.chmod(0o755)
    me = identity.Identity(NAME, EMAIL)
    patches = upstream_pr.patchtool.load_series(series)
    br = branch_mod.make_branch(tree, patches, me, "pr/t", "HEAD", lambda m: None)
    try:
        for allow, status in (((), "fail"), (("mypy",), "skip")):
            opts = checks.CheckOptions(python, skip=("ruff", "spdx", "pytest"), allow_skip=allow)
            (res,) = [r for r in checks.run_checks(br, opts, lambda m: None) if r.check == "mypy"]
            assert res.status == status and res.could_not_run, res
            assert ("could not run: " if status == "fail" else "did not run: ") in res.summary
            if python is not None:
                assert "mypy failed to start: error: Error importing plugin" in res.summary
    finally:
        br.remove_worktree()


def test_the_description_says_what_ran() -> None:
    from prkit import describe
    from prkit.checks import CheckResult

    results = [
        CheckResult("ruff check", "pass", "2 files clean", files=["vllm/a.py", "tests/t.py"]),
        CheckResult("SPDX header", "skip", "skipped on request (--skip)"),
        CheckResult("mypy", "skip", "did not run: mypy failed to start", could_not_run=True),
        CheckResult("pytest", "pass", "1 passed", files=["tests/t.py"]),
    ]
    assert describe.ran_statement(results, part=True) == (
        "Checks run: ruff check on the 2 files the branch touches; pytest on this PR's tests "
        "(1 file). Not run: SPDX header (skipped on request (--skip)); mypy (did not run: "
        "mypy failed to start)."
    )
    # the default scope runs the folders of the touched test files: named as folders
    folders = CheckResult("pytest", "pass", "9 passed", files=["tests/v1/core/", "tests/u/"])
    assert "pytest on the patches' tests (2 folders)." in describe.ran_statement([folders])
    mixed = CheckResult("pytest", "pass", "9 passed", files=["tests/v1/core/", "tests/t.py"])
    assert "(1 folder and 1 file)" in describe.ran_statement([mixed])


# -- 3. benchmark numbers must be of the series' vLLM and from a clean tree -----------

MEASURED = REPO_ROOT / "docs" / "results" / "gpu-h200x1-20261201.json"


def _measured_copy(tmp_path: Path, **changes) -> Path:
    data = json.loads(MEASURED.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    return path


def test_bench_from_a_dirty_tree_or_another_release_is_refused(tmp_path: Path) -> None:
    from prkit import describe

    with pytest.raises(
        UsageError, match=r"ran from a tree with uncommitted changes .*ff8b077327be"
    ):
        describe.bench_numbers(MEASURED, None, "0.23.0")  # its git.dirty is true
    clean = {"commit": "ff8b077327be510df7be12e4a71eb39b35b631a1", "dirty": False}
    path = _measured_copy(tmp_path, git=clean)
    bench = describe.bench_numbers(path, None, "0.23.0")
    assert "vLLM 0.23.0" in bench.source and "push-0.23" in "\n".join(bench.lines)
    with pytest.raises(
        UsageError, match=r"measured vLLM 0\.23\.0, the series is for vLLM 0\.32\.0"
    ):
        describe.bench_numbers(path, None, "0.32.0")
    with pytest.raises(UsageError, match=r"no 'versions' in it"):
        describe.bench_numbers(_measured_copy(tmp_path, git=clean, versions=None), None, "0.23.0")
    with pytest.raises(UsageError, match=r"no 'git\.dirty' in it"):
        describe.bench_numbers(_measured_copy(tmp_path, git={"commit": "ab"}), None, "0.23.0")


def test_prepare_refuses_a_dirty_bench_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(upstream_pr.branch_mod, "obtain_tree", _no_tree)
    monkeypatch.setenv("GIT_AUTHOR_NAME", NAME)
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", EMAIL)
    monkeypatch.chdir(tmp_path)
    args = ["prepare", "--version", "0.23.0", "--out", str(tmp_path / "o"), "--bench"]
    assert upstream_pr.main([*args, str(MEASURED)]) == 2
    assert "uncommitted changes" in capsys.readouterr().err


def _no_tree(*args, **kwargs):
    raise AssertionError("work started before the inputs were checked")


# -- 4. vLLM's current template: no HTML comments, duplicate work, AI assistance --------


class _Commit:
    def __init__(self, patch) -> None:
        self.patch, self.subject, self.files = patch, patch.subject, list(patch.hunks)


def test_the_body_follows_vllms_current_template(tmp_path: Path) -> None:
    from prkit import describe
    from prkit.checks import CheckResult

    series = upstream_pr.patchtool.load_series(REPO_ROOT / "patches" / "vllm-0.23.0")
    results = [CheckResult("ruff check", "pass", "1 file clean", files=["vllm/a.py"])]
    text = describe.render(tmp_path, [_Commit(p) for p in series[:2]], results, None, "vLLM 0.23.0")
    assert "<!--" not in text and "-->" not in text and "FILL IN" not in text
    assert "(Optional) Release notes update" in text  # the current checklist
    dup = text.split("## Duplicate-work check", 1)[1].split("\n## ", 1)[0]
    assert (
        f"- **{series[0].subject}**: vLLM's own push mode (NixlPushConnector, first released "
        "in v0.24.0) ships an equivalent scheduler hook;" in dup
    )
    assert f"- **{series[1].subject}**: " in dup and "gh pr list --repo vllm-project/vllm" in dup
    ai = text.split("## AI assistance", 1)[1]
    assert ai.lstrip().startswith("- [ ] AI assistance was used")  # the submitter ticks it
    before = text.split("**BEFORE SUBMITTING", 1)[0]  # GitHub Actions drops what follows
    assert "## Duplicate-work check" in before and "## AI assistance" in before
    assert "- [x] The purpose of the PR" in text


def test_comments_of_the_trees_template_are_dropped(tmp_path: Path) -> None:
    from prkit import describe

    series = upstream_pr.patchtool.load_series(REPO_ROOT / "patches" / "vllm-0.32.0")
    (tmp_path / ".github").mkdir()
    (tmp_path / ".github" / "PULL_REQUEST_TEMPLATE.md").write_text(
        "<!-- markdownlint-disable -->\nFILL IN THE PR DESCRIPTION HERE\n\n## Purpose\n"
        "<!-- say why,\n over two lines -->\n\n## Test Plan\n\n## Test Result\n\n"
        "<!--- pyml disable-next-line no-emphasis-as-heading -->\n**BEFORE SUBMITTING**\n"
    )
    text = describe.render(tmp_path, [_Commit(series[0])], [], None, "vLLM 0.32.0")
    assert "<!-" not in text and "say why" not in text and "over two lines" not in text
    assert "None yet. vLLM v0.23.0's single worker had the same parsing" in text
    assert text.index("## AI assistance") < text.index("**BEFORE SUBMITTING**")


# -- 5. refresh: hunks per file, code that is not gone, cascades ------------------------

A_BASE = HEADER + "".join(
    f"def alpha_function_number_{i}(argument_value):\n    return argument_value + {i}000\n\n"
    for i in range(8)
)
B_BASE = HEADER + "".join(
    f"def beta_function_number_{i}(argument_value):\n    return argument_value * {i}000\n\n"
    for i in range(8)
)


NEW_BLOCK = "".join(
    f"    gamma_intermediate_value_{i} = argument_value * {i} + {i}\n" for i in range(8)
)


def _series_05(tmp_path: Path) -> tuple[Path, Path]:
    """0001 adds a function to a.py (one hunk) and changes b.py (one hunk); 0002
    (trailer: upstream since 0.30.0) changes a line in the middle of 0001's function."""
    base = mini_tree(tmp_path / "base", {"vllm/a.py": A_BASE, "vllm/b.py": B_BASE})
    a1 = A_BASE + "def gamma_function(argument_value):\n" + NEW_BLOCK + "    return 0\n"
    b1 = B_BASE.replace("return argument_value * 6000", "return argument_value * 6001  # fixed")
    a2 = a1.replace("_value_4 = argument_value * 4 + 4", "_value_4 = argument_value * 4 + 5")
    series = make_series(
        base,
        tmp_path / "series" / "vllm-0.23.0",
        [
            ("[Misc] Fix alpha and beta", {"vllm/a.py": a1, "vllm/b.py": b1}),
            ("[Misc] Fix gamma", {"vllm/a.py": a2}, "0.30.0"),
        ],
    )
    return base, series


def _new_tree(tmp_path: Path, a: str, b: str) -> Path:
    return mini_tree(tmp_path / "new", {"vllm/a.py": a, "vllm/b.py": b}, version="0.32.0")


def _refresh(series: Path, tree: Path, out: Path) -> dict[str, object]:
    from prkit import refresh

    results = refresh.refresh(series, tree, out, lambda m: None)
    return {r.patch.name[:4]: r for r in results}


def test_a_patch_on_top_of_an_earlier_one_applies_and_is_not_gone(tmp_path: Path) -> None:
    _, series = _series_05(tmp_path)
    extra = HEADER + "EXTRA_CONSTANT_OF_THE_NEW_RELEASE = 1\n"
    tree = _new_tree(tmp_path, A_BASE.replace(HEADER, extra), B_BASE)
    got = _refresh(series, tree, tmp_path / "out")
    assert [got[k].status for k in ("0001", "0002")] == ["applies cleanly"] * 2, got
    assert not any("gone" in e for r in got.values() for e in r.evidence), got


def test_refresh_tells_a_cascade_from_a_conflict_and_numbers_hunks_per_file(
    tmp_path: Path,
) -> None:
    _, series = _series_05(tmp_path)
    # the new release rewrote alpha 7 (0001's a.py hunk conflicts) and dropped beta 4-7
    a_new = A_BASE.replace("return argument_value + 7000", "return int(argument_value) + 7000")
    b_new = B_BASE.split("def beta_function_number_4")[0]
    got = _refresh(series, _new_tree(tmp_path, a_new, b_new), tmp_path / "out")
    first, second = got["0001"], got["0002"]
    assert first.status == "conflicts", first
    assert "the code of hunk #1 of vllm/b.py is gone" in first.evidence, first.evidence
    assert not any("hunk #2 of vllm/b.py" in e for e in first.evidence)
    assert second.status == "blocked", second
    assert second.evidence[0].startswith(
        f"blocked by {first.patch.name}: hunk #1 of vllm/a.py (@@"
    ), second.evidence


# -- 7. format-patch files and the git am -3 commands for a real vLLM checkout ----------


def test_format_patch_files_apply_to_a_real_checkout_at_the_base(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {"vllm/a.py": HEADER + "A = 1\n"}
    tree = mini_tree(tmp_path / "made-from-wheel", files)
    series = make_series(
        tree,
        tmp_path / "series" / "vllm-0.23.0",
        [("[Misc] Add B", {"vllm/a.py": HEADER + "A = 1\nB = 2\n"}),
         ("[Misc] Add C", {"vllm/a.py": HEADER + "A = 1\nB = 2\nC = 3\n"})],
    )  # fmt: skip
    out = tmp_path / "o"
    args = ["prepare", "--tree", str(tree), "--series", str(series), "--out", str(out)]
    assert upstream_pr.main([*args, "--base", "v0.23.0", *SKIP_ALL]) == 0
    printed = capsys.readouterr().out
    made = sorted((out / "format-patch").glob("*.patch"))
    assert [p.name[:4] for p in made] == ["0001", "0002"]
    assert "git switch -c pr/vllm-0.23.0 v0.23.0" in printed
    am = next(ln.strip() for ln in printed.splitlines() if ln.strip().startswith("git am -3 "))
    assert am == "git am -3 --keep-non-patch " + " ".join(str(p) for p in made)
    assert am in (out / "format-patch" / "APPLY.md").read_text()

    # "vLLM's own repository": the same files at v0.23.0, another history
    upstream = mini_tree(tmp_path / "upstream", files)
    git(upstream, "commit", "-q", "--allow-empty", "-m", "an unrelated upstream commit")
    git(upstream, "switch", "-q", "-c", "pr/vllm-0.23.0", "v0.23.0")
    git(upstream, *shlex.split(am)[1:])
    log = git(upstream, "log", "--format=%s|%an <%ae>|%(trailers:key=Signed-off-by,valueonly)")
    assert [ln for ln in log.splitlines() if ln.strip()][:2] == [
        f"[Misc] Add C|{NAME} <{EMAIL}>|{NAME} <{EMAIL}>",
        f"[Misc] Add B|{NAME} <{EMAIL}>|{NAME} <{EMAIL}>",
    ]
    assert (upstream / "vllm" / "a.py").read_text().endswith("C = 3\n")


# -- 4. vLLM's tests run with vLLM's own plugins only ---------------------------------


def test_vllms_tests_load_only_vllms_own_general_plugins() -> None:
    """A connector package installed in the env (this one's plugin guards vLLM's own
    NixlPushConnector name) loaded in some test processes and not in others: the whole
    folder's run failed ten NixlPushConnector cases of
    test_mooncake_connector_hybrid_mamba.py on the branch that passed on the base."""
    from prkit.testrun import _ENV_PROBE, vllm_own_plugins

    names, left_out = vllm_own_plugins(
        [("vllm_ext", "vllm_ext:register"),
         ("lora_filesystem_resolver", "vllm.plugins.lora_resolvers.filesystem_resolver:r")]
    )  # fmt: skip
    assert (names, left_out) == ("lora_filesystem_resolver", True)
    assert vllm_own_plugins([]) == ("", False)
    assert vllm_own_plugins([("other", "other_pkg.sub:f")]) == ("", True)  # "" loads none
    # the probe of the env lists the entry points as they are installed here
    import subprocess

    probe = subprocess.run([sys.executable, "-c", _ENV_PROBE], capture_output=True,
                           text=True, timeout=120, check=True)  # fmt: skip
    plugins = json.loads(probe.stdout.strip().splitlines()[-1])["general_plugins"]
    assert ["vllm_ext", "vllm_ext:register"] in plugins
    assert "vllm_ext" not in vllm_own_plugins(plugins)[0].split(",")
