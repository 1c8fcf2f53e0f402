# SPDX-License-Identifier: Apache-2.0
"""The upstream PR kit (tools/upstream_pr.py) end to end, on trees from tools/vllm_source.py.

* ``prepare`` on the 0.23.0 series and a 0.23.0 tree with the sdist's tests/: the
  branch, its commits and sign-offs, the checks (ruff, SPDX, the patches' tests on the
  pinned env; mypy on a small tree of its own below, to stay fast), the PR description
  with benchmark numbers;
* failures name the check, the file and the patch; a patch that does not apply is
  named with its hunk; refusal without an identity and with a reserved-domain one;
* ``refresh`` of the 0.23.0 series against 0.32.0: 0001-0003 already upstream (from
  the source), 0004 conflicts (its code moved); against 0.23.0 itself it reproduces
  the series byte for byte.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from patch_support import PIN, REPO, SERIES_DIR, vllm_source

KIT = REPO / "tools" / "upstream_pr.py"
PATCHES = sorted(p.name for p in SERIES_DIR.glob("*.patch"))
NAME, EMAIL = "Kit Tester", "kit.tester@vllm-ext.dev"
ALIAS = "maintainers@users.noreply.a-seed-28d995dd.example"
SKIP_ALL = ("--skip", "ruff", "--skip", "spdx", "--skip", "mypy", "--skip", "pytest")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout


def kit(*args: str | Path, env: dict[str, str] | None = None, timeout: float = 600):
    return subprocess.run(
        [sys.executable, str(KIT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def _tree(dest: Path, version: str = PIN, with_tests: bool = True, who=(NAME, EMAIL)) -> Path:
    tree = vllm_source.make_source_tree(version, dest, with_tests=with_tests, identity=False)
    if who is not None:
        _git(tree, "config", "user.name", who[0])
        _git(tree, "config", "user.email", who[1])
    return tree


def _no_global_git(tmp_path: Path) -> dict[str, str]:
    """An environment where git has no global or system identity."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {"HOME": str(home), "GIT_CONFIG_GLOBAL": str(home / "none"), "GIT_CONFIG_NOSYSTEM": "1"}


def _bench(tmp_path: Path) -> Path:
    rows = [
        {"mode": m, "point": "in1024-c=1", "input_len": 1024, "load": "c=1", "ttft_p50": t}
        for m, t in (("pull-0.23", 0.1904), ("push-0.23", 0.0471), ("single-0.23", 0.0383))
    ]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"run_id": "bench-kit-test", "aggregates": rows,
                                "versions": {PIN: {"vllm": PIN}},
                                "git": {"commit": "0" * 40, "dirty": False}}))  # fmt: skip
    return path


@pytest.mark.slow  # the kit end to end (80 s); prkit's own tests cover each step
@pytest.mark.timeout(600)
def test_prepare_the_0230_series(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "vllm")
    head = _git(tree, "rev-parse", "HEAD")
    out = tmp_path / "out"
    res = kit(
        "prepare", "--tree", tree, "--series", SERIES_DIR, "--python", sys.executable,
        "--bench", _bench(tmp_path), "--out", out, "--skip", "mypy", "--test-timeout", "400",
        "--test-scope", "files",
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert re.search(r"\[ *\d+\.\ds\] \[4/4\] git am -3 0004", res.stdout)  # progress

    # The branch: one commit per patch, authored and signed off by the configured identity.
    log = _git(tree, "log", "--format=%H%x1f%an <%ae>%x1f%B%x1e", f"v{PIN}..pr/vllm-{PIN}")
    commits = [c.strip().split("\x1f") for c in log.split("\x1e") if c.strip()][::-1]
    assert len(commits) == 4
    for _sha, author, body in commits:
        assert author == f"{NAME} <{EMAIL}>"
        assert re.findall(r"^Signed-off-by: .*$", body, re.M) == [
            f"Signed-off-by: {NAME} <{EMAIL}>"
        ]
        assert "Upstream-Since" not in body and ALIAS not in body
        assert body.startswith("[KV Connector]")
        # vLLM's AGENTS.md: AI-assisted commits name the assistant, before the sign-off.
        trailers = body.strip().splitlines()[-2:]
        assert trailers == ["Co-authored-by: Claude <noreply@anthropic.com>",
                            f"Signed-off-by: {NAME} <{EMAIL}>"]  # fmt: skip
    assert _git(tree, "rev-parse", "HEAD") == head  # the checkout itself is untouched
    assert _git(tree, "status", "--porcelain") == ""
    assert len(_git(tree, "worktree", "list").splitlines()) == 1

    report = json.loads((out / "report.json").read_text())
    assert [c["patch"] for c in report["commits"]] == PATCHES
    assert all(c["patch_bytes"] > 10_000 and c["insertions"] > 200 for c in report["commits"])
    checks = {(c["check"], tuple(c["patches"])): c for c in report["checks"]}
    status = {k: c["status"] for k, c in checks.items()}
    assert status[("ruff check", tuple(PATCHES))] == "pass"
    assert status[("ruff format", ())] == "pass"
    assert status[("SPDX header", ())] == "pass"
    assert status[("mypy", ())] == "skip"
    counts = {k[1][0]: c["counts"]["passed"] for k, c in checks.items() if k[0] == "pytest"}
    assert counts == dict(zip(PATCHES, (7, 8, 5, 18))), counts  # the patches' own tests
    assert all(checks[("pytest", (p,))]["status"] == "pass" for p in PATCHES)

    text = (out / "PR.md").read_text()
    for part in ("## Purpose", "## Test Plan", "## Test Result", "Essential Elements",
                 "- [x] The test plan", "run `bench-kit-test`", "| in1024-c=1 | 190 | 47 | 38 |",
                 "| pytest | pass: 18 passed"):  # fmt: skip
        assert part in text, part
    for patch in PATCHES:
        one = (out / "pr" / patch.replace(".patch", ".md")).read_text()
        assert one.count("## Purpose") == 1 and "| in1024-c=1 | 190 | 47 | 38 |" in one


def _series_copy(tmp_path: Path, edits: dict[str, tuple[str, str]]) -> Path:
    """The 0.23.0 series with ``old -> new`` replacements in some patches."""
    series = tmp_path / "series" / f"vllm-{PIN}"
    series.mkdir(parents=True)
    for name in PATCHES:
        text = (SERIES_DIR / name).read_text()
        if name in edits:
            old, new = edits[name]
            assert text.count(old) == 1, (name, old)
            text = text.replace(old, new)
        (series / name).write_text(text)
    return series


@pytest.mark.timeout(300)
def test_failing_checks_name_check_file_and_patch(tmp_path: Path) -> None:
    series = _series_copy(
        tmp_path,
        {
            PATCHES[0]: ("+        return False\n", "+        return  False\n"),
            PATCHES[1]: (
                "+# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n",
                "+# Copyright: somebody\n",
            ),
        },
    )
    tree = _tree(tmp_path / "vllm")
    res = kit("prepare", "--tree", tree, "--series", series, "--out", tmp_path / "out",
              "--skip", "mypy", "--skip", "pytest")  # fmt: skip
    assert res.returncode == 1, res.stdout + res.stderr
    err = res.stderr
    assert "FAILED:" in err
    assert re.search(
        r"vllm/distributed/kv_transfer/kv_connector/v1/base.py: would be reformatted "
        rf"\({PATCHES[0]}\)",
        err,
    ), err
    assert re.search(
        rf"tests/v1/kv_connector/unit/test_nixl_region_members.py: no SPDX copyright line "
        rf"\({PATCHES[1]}\)",
        err,
    ), err
    assert "FAIL ruff format" in res.stdout and "FAIL SPDX header" in res.stdout
    text = (tmp_path / "out" / "PR.md").read_text()
    assert "| ruff format | fail:" in text and "would be reformatted" in text
    # No local path (the tree, the env, a cache) and no name of this kit in a body; a
    # one-patch body says that the lint rows are of the whole branch.
    from prkit.describe import local_paths  # tools/ is on sys.path through patch_support

    for body in [text, *((tmp_path / "out" / "pr").glob("*.md"))]:
        body = body if isinstance(body, str) else body.read_text()
        assert local_paths(body) == [] and str(tmp_path) not in body
        assert "vllm-ext" not in body and "PR kit" not in body
    one = (tmp_path / "out" / "pr" / PATCHES[0].replace(".patch", ".md")).read_text()
    assert "rows are of the branch with the whole series applied" in one


@pytest.mark.timeout(300)
def test_a_patch_that_does_not_apply_is_named(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "vllm")
    worker = tree / "vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py"
    text = worker.read_text()
    worker.write_text(text.replace('msg = notif.decode("utf-8")', 'msg = notif.decode("latin-1")'))
    _git(tree, "commit", "-qam", "a local change that conflicts with 0004")
    res = kit("prepare", "--tree", tree, "--series", SERIES_DIR, "--out", tmp_path / "o", *SKIP_ALL)
    assert res.returncode == 1
    assert f"{PATCHES[3]} does not apply to {tree}" in res.stderr, res.stderr
    assert "hunk #4 of vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py" in res.stderr
    assert "pr/vllm-0.23.0" not in _git(tree, "branch", "--list")  # nothing left behind
    assert len(_git(tree, "worktree", "list").splitlines()) == 1


def test_refused_without_an_identity(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "vllm", with_tests=False, who=None)
    res = kit("prepare", "--tree", tree, "--out", tmp_path / "o", *SKIP_ALL,
              env=_no_global_git(tmp_path))  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no git identity (user.name (GIT_AUTHOR_NAME) and user.email (GIT_AUTHOR_EMAIL)" in (
        res.stderr
    )
    assert "git config --global user.name" in res.stderr and "Traceback" not in res.stderr
    assert _git(tree, "branch", "--list").split() == ["*", "main"]


def test_refused_with_a_reserved_domain_identity(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "vllm", with_tests=False, who=("Seed maintainers", ALIAS))
    res = kit("prepare", "--tree", tree, "--out", tmp_path / "o", *SKIP_ALL,
              env=_no_global_git(tmp_path))  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"<{ALIAS}> is at a reserved domain (.example" in res.stderr
    assert "DCO" in res.stderr
    # Allowed explicitly (tests, dry runs): the branch is made and signed off by it.
    res = kit("prepare", "--tree", tree, "--out", tmp_path / "o", *SKIP_ALL,
              "--allow-reserved-identity", env=_no_global_git(tmp_path))  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    body = _git(tree, "log", "-1", "--format=%B", f"pr/vllm-{PIN}")
    assert re.findall("^Signed-off-by: .*", body, re.M) == [
        f"Signed-off-by: Seed maintainers <{ALIAS}>"
    ]


@pytest.mark.timeout(300)
def test_refresh_against_0320_finds_what_is_upstream(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "vllm-0.32.0", version="0.32.0", with_tests=False)
    out = tmp_path / "out"
    res = kit("refresh", "--series", SERIES_DIR, "--tree", tree, "--out", out)
    assert res.returncode == 1, res.stdout + res.stderr  # 0004 needs a rewrite
    rows = {r["patch"]: r for r in json.loads((out / "refresh.json").read_text())["patches"]}
    assert [rows[p]["status"] for p in PATCHES] == ["already upstream"] * 3 + ["conflicts"]
    ev = {p[:4]: " / ".join(rows[p]["evidence"]) for p in PATCHES}
    # from the source: the symbols 0001/0002 add are defined; 0003's code is gone
    assert "every symbol it adds is defined in the tree: has_pending_push_work (" in ev["0001"]
    assert "kv_connector/v1/base.py" in ev["0001"]
    assert "region_members (kv_connector/v1/nixl/metadata.py" in ev["0002"]
    assert "superseded: the code of hunks #1, #2, #3 of kv_connector/utils.py is gone" in ev["0003"]
    assert "not upstream: none of the symbols it adds" in ev["0004"]
    assert "is now in kv_connector/v1/nixl/pull_worker.py" in ev["0004"]
    assert f"FAILED: does not apply to the new tree:\n  {PATCHES[3]}: hunk #1 of" in res.stderr
    assert not (out / "patches").exists()  # nothing applied

    # A trailer that claims more than the source shows is called out.
    lying = _series_copy(tmp_path, {PATCHES[3]: ("Upstream-Since: none", "Upstream-Since: 0.30.0")})
    res = kit("refresh", "--series", lying, "--tree", tree, "--out", tmp_path / "out2", "--quiet")
    rows = {
        r["patch"]: r
        for r in json.loads((tmp_path / "out2" / "refresh.json").read_text())["patches"]
    }
    assert rows[PATCHES[3]]["status"] == "conflicts"
    assert any(
        "trailer says 0.30.0 (<= 0.32.0), but the source does not show the change" in e
        for e in rows[PATCHES[3]]["evidence"]
    )


@pytest.mark.timeout(300)
def test_refresh_against_its_own_base_reproduces_the_series(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "vllm", with_tests=False)
    out = tmp_path / "out"
    res = kit("refresh", "--series", SERIES_DIR, "--tree", tree, "--out", out, "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads((out / "refresh.json").read_text())["patches"]
    assert [r["status"] for r in rows] == ["applies cleanly"] * 4
    for name in PATCHES:
        assert (out / "patches" / name).read_bytes() == (SERIES_DIR / name).read_bytes(), name


def _mini_vllm(root: Path) -> tuple[Path, Path]:
    """A tiny vLLM-like tree (with a mypy error already at its base) and a one-patch
    series that adds one more mypy error."""
    tree = root / "mini"
    (tree / "vllm").mkdir(parents=True)
    header = (
        "# SPDX-License-Identifier: Apache-2.0\n"
        "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
    )
    (tree / "vllm" / "__init__.py").write_text(header)
    (tree / "vllm" / "_version.py").write_text("__version__ = version = '0.23.0'\n")
    (tree / "vllm" / "a.py").write_text(header + 'OLD: int = "already wrong"\n')
    (tree / "pyproject.toml").write_text(
        '# SPDX-License-Identifier: Apache-2.0\n[project]\nname = "vllm"\n'
        'requires-python = ">=3.10"\n\n[tool.mypy]\nignore_missing_imports = true\n'
    )
    env = {"GIT_CEILING_DIRECTORIES": str(root)}
    for args in (["init", "-q", "-b", "main"], ["config", "user.name", NAME],
                 ["config", "user.email", EMAIL], ["add", "-A"], ["commit", "-qm", "base"],
                 ["tag", "v0.23.0"]):  # fmt: skip
        subprocess.run(["git", *args], cwd=tree, check=True, env={**os.environ, **env})
    (tree / "vllm" / "b.py").write_text(header + 'def f() -> int:\n    return "new error"\n')
    (tree / "vllm" / "a.py").write_text(header + 'OLD: int = "already wrong"\nNEW = 1\n')
    _git(tree, "add", "-A")
    _git(tree, "commit", "-qm", "[Misc] Add f\n\nWhy:\nA test.\n\nUpstream-Since: none")
    series = root / "series" / "vllm-0.23.0"
    _git(tree, "format-patch", "-q", "--zero-commit", "-o", str(series), "HEAD~1")
    _git(tree, "reset", "-q", "--hard", "HEAD~1")
    return tree, series


@pytest.mark.timeout(300)
def test_mypy_counts_only_new_errors(tmp_path: Path) -> None:
    tree, series = _mini_vllm(tmp_path)
    res = kit("prepare", "--tree", tree, "--series", series, "--out", tmp_path / "out",
              "--python", sys.executable, "--skip", "pytest", "--mypy-timeout", "240")  # fmt: skip
    out = res.stdout + res.stderr
    if "could not run" in out or "timed out" in out:
        pytest.skip(f"mypy unavailable here: {out[-500:]}")
    assert res.returncode == 1, out
    assert "FAIL mypy [0001]: 2 files: 1 new errors, 1 present at the base too" in res.stdout, out
    assert "PASS ruff format" in res.stdout, out
    assert re.search(r"vllm/b.py:4: Incompatible return value type .*\(0001-", res.stderr), out
    assert "already wrong" not in res.stderr  # the base's own error does not fail the check
    assert shutil.which("git")


def test_relations_name_each_pr_of_a_patch_once() -> None:
    """A message that cites a PR several times (e.g. 0.32.0's 0004) lists it once."""
    from prkit import relations  # tools/ is on sys.path through patch_support

    rows = relations.collect()
    assert rows
    for row in rows:
        assert len(row.prs) == len(set(row.prs)), (row.series, row.patch, row.prs)
    watchdog = next(
        r
        for r in rows
        if (r.series, r.patch) == ("vllm-0.32.0", "0004-nixl-push-registration-watchdog")
    )
    assert watchdog.prs[0] == 46289 and watchdog.relation == "open PR #46289"
