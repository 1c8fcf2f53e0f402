# SPDX-License-Identifier: Apache-2.0
"""The patch tool on both target kinds: apply, status, revert, conflicts, upstream skips."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from patch_support import PIN, REPO, SERIES_DIR, run_tool, tree_digest

from vllm_ext import patchtool

WORKER = "vllm/distributed/kv_transfer/kv_connector/v1/nixl/worker.py"
PATCHES = sorted(p.name for p in SERIES_DIR.glob("*.patch"))


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout


def _states(*target: str | Path) -> dict[str, str]:
    res = run_tool("status", "--json", *target)
    assert res.returncode in (0, 1), res.stderr
    return {row["patch"]: row["state"] for row in json.loads(res.stdout)["patches"]}


def _break_hunk(path: Path) -> None:
    """Change a line that patch 0004's hunk in _get_new_notifs needs as context."""
    text = path.read_text()
    old = '                msg = notif.decode("utf-8")\n'
    assert text.count(old) == 1
    path.write_text(text.replace(old, '                msg = notif.decode("latin-1")\n'))


def test_series_is_what_the_tool_sees() -> None:
    series = patchtool.load_series(patchtool.series_dir(PIN))
    assert [p.name for p in series] == PATCHES and len(PATCHES) == 4
    assert patchtool.patches_root().resolve() == (REPO / "patches").resolve()


@pytest.mark.timeout(120)
def test_installed_apply_status_revert_is_byte_exact(site_copy: Path) -> None:
    before = tree_digest(site_copy)
    target = ("--site-packages", site_copy)

    res = run_tool("check", *target)
    assert res.returncode == 0 and "would apply 4 patches" in res.stdout, res.stdout
    assert tree_digest(site_copy) == before

    res = run_tool("apply", *target)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "applied 4 patches" in res.stdout
    patched = tree_digest(site_copy)
    changed = {f for f in before if before[f] != patched[f]}
    assert changed == {
        "vllm/distributed/kv_transfer/kv_connector/v1/base.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py",
        "vllm/v1/core/sched/scheduler.py",
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py",
        WORKER,
        "vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py",
        "vllm/distributed/kv_transfer/kv_connector/utils.py",
    }
    assert set(patched) == set(before)  # no test files land in site-packages
    assert _states(*target) == dict.fromkeys(PATCHES, "applied")

    res = run_tool("apply", *target)  # idempotent
    assert res.returncode == 0 and "already applied" in res.stdout
    assert tree_digest(site_copy) == patched

    res = run_tool("revert", *target)
    assert res.returncode == 0 and "reverted 4 patches" in res.stdout, res.stdout
    assert tree_digest(site_copy) == before
    assert _states(*target) == dict.fromkeys(PATCHES, "not applied")
    res = run_tool("revert", *target)
    assert res.returncode == 0 and "nothing to revert" in res.stdout


@pytest.mark.timeout(180)
def test_checkout_apply_status_revert_is_byte_exact(checkout: Path) -> None:
    head = _git(checkout, "rev-parse", "HEAD").strip()
    before = tree_digest(checkout)
    target = ("--checkout", checkout)

    res = run_tool("apply", *target)
    assert res.returncode == 0, res.stdout + res.stderr
    subjects = _git(checkout, "log", "--format=%s", f"{head}..HEAD").splitlines()
    assert len(subjects) == 4
    assert all(s.startswith("[KV Connector]") for s in subjects), subjects  # kept by git am
    body = _git(checkout, "log", "-1", "--format=%B")
    assert "Signed-off-by: Seed 28d995dd maintainers" in body
    assert (checkout / "tests/v1/kv_connector/unit/test_pending_push_work.py").is_file()
    assert _git(checkout, "status", "--porcelain") == ""
    assert _states(*target) == dict.fromkeys(PATCHES, "applied")

    res = run_tool("apply", *target)
    assert res.returncode == 0 and "already applied" in res.stdout

    res = run_tool("revert", *target)
    assert res.returncode == 0 and "reverted 4 patches" in res.stdout, res.stdout + res.stderr
    assert _git(checkout, "rev-parse", "HEAD").strip() == head
    assert tree_digest(checkout) == before
    assert _states(*target) == dict.fromkeys(PATCHES, "not applied")


@pytest.mark.timeout(120)
def test_partial_series_is_completed(site_copy: Path, tmp_path: Path) -> None:
    first_two = tmp_path / "series" / f"vllm-{PIN}"
    first_two.mkdir(parents=True)
    for name in PATCHES[:2]:
        shutil.copy(SERIES_DIR / name, first_two)
    res = run_tool("apply", "--site-packages", site_copy, "--patches", first_two.parent)
    assert res.returncode == 0 and "applied 2 patches" in res.stdout, res.stdout
    assert list(_states("--site-packages", site_copy).values()) == [
        "applied", "applied", "not applied", "not applied"
    ]  # fmt: skip
    res = run_tool("apply", "--site-packages", site_copy)
    assert res.returncode == 0 and "applied 2 patches (2 were already)" in res.stdout


@pytest.mark.timeout(120)
def test_installed_conflict_names_patch_and_hunk_and_changes_nothing(site_copy: Path) -> None:
    _break_hunk(site_copy / WORKER)
    before = tree_digest(site_copy)
    for cmd in ("check", "apply"):
        res = run_tool(cmd, "--site-packages", site_copy)
        assert res.returncode == 1, res.stdout + res.stderr
        assert "0004-nixl-malformed-notifications.patch does not apply" in res.stderr
        assert f"hunk #4 of {WORKER} (@@ -1811,33 +1826,56 @@" in res.stderr
        assert "nothing was changed" in res.stderr
        assert tree_digest(site_copy) == before
    res = run_tool("status", "--site-packages", site_copy)
    assert res.returncode == 1 and "conflict     0004-nixl-malformed" in res.stdout, res.stdout


@pytest.mark.timeout(180)
def test_checkout_conflict_names_patch_and_hunk_and_changes_nothing(checkout: Path) -> None:
    _break_hunk(checkout / WORKER)
    _git(checkout, "commit", "-qam", "a local change that conflicts with 0004")
    head = _git(checkout, "rev-parse", "HEAD").strip()
    before = tree_digest(checkout)
    refs = _git(checkout, "for-each-ref")
    res = run_tool("apply", "--checkout", checkout)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "0004-nixl-malformed-notifications.patch does not apply" in res.stderr
    assert f"hunk #4 of {WORKER}" in res.stderr
    assert _git(checkout, "rev-parse", "HEAD").strip() == head
    assert _git(checkout, "for-each-ref") == refs
    assert _git(checkout, "status", "--porcelain") == ""
    assert not (checkout / ".git" / "rebase-apply").exists()
    assert tree_digest(checkout) == before


def test_checkout_with_local_changes_is_refused(checkout: Path) -> None:
    (checkout / WORKER).write_text("# local edit\n")
    res = run_tool("apply", "--checkout", checkout)
    assert res.returncode == 1 and "uncommitted changes" in res.stderr
    assert (checkout / WORKER).read_text() == "# local edit\n"


@pytest.mark.timeout(120)
def test_patches_already_upstream_are_skipped(site_copy: Path) -> None:
    version_file = site_copy / "vllm" / "_version.py"
    version_file.write_text(version_file.read_text().replace("'0.23.0'", "'0.31.0'"))
    res = run_tool("apply", "--pin", PIN, "--site-packages", site_copy)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "the target is vLLM 0.31.0, the series is for 0.23.0" in out
    assert "0001-has-pending-push-work.patch: already upstream since vLLM 0.24.0" in out
    assert "0002-nixl-region-members.patch: already upstream since vLLM 0.31.0" in out
    assert "0003-nixl-cpu-kv-registration.patch: already upstream since vLLM 0.26.0" in out
    assert "applied 1 patches" in out and "applied 0004-nixl-malformed-notifications" in out
    states = _states("--pin", PIN, "--site-packages", site_copy)
    assert list(states.values()) == ["upstream", "upstream", "upstream", "applied"]


def test_pin_without_patches_reports_what_is_upstream(tmp_path: Path, site_copy: Path) -> None:
    """A pin whose series is empty (here 0.32.0 in a patches root that holds only the
    0.23.0 series) says which patches of other series its vLLM has upstream."""
    root = tmp_path / "patches"
    shutil.copytree(SERIES_DIR, root / SERIES_DIR.name)
    version_file = site_copy / "vllm" / "_version.py"
    version_file.write_text(version_file.read_text().replace("'0.23.0'", "'0.32.0'"))
    res = run_tool("apply", "--site-packages", site_copy, "--patches", root)
    assert res.returncode == 0, res.stderr
    assert "no patches for vLLM 0.32.0" in res.stdout
    for since in ("0.24.0", "0.31.0", "0.26.0"):
        assert f"since {since})" in res.stdout
    assert "Count and drop malformed" not in res.stdout  # 0004 is not upstream


@pytest.mark.timeout(120)
@pytest.mark.timeout(120)
def test_a_machine_without_git_gets_a_clear_error_and_no_change(
    site_copy: Path, tmp_path: Path
) -> None:
    """Found building the CUDA engine image on a base without git: a traceback."""
    import sys

    bare = tmp_path / "bin"  # this interpreter, and no git
    bare.mkdir()
    (bare / "python3").symlink_to(sys.executable)
    before = tree_digest(site_copy)
    res = subprocess.run(
        [str(bare / "python3"), str(REPO / "tools" / "patches.py"), "apply",
         "--site-packages", str(site_copy)],
        capture_output=True, text=True, timeout=100, cwd=REPO, env={"PATH": str(bare)},
    )  # fmt: skip
    assert res.returncode != 0
    assert "needs git on PATH" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert tree_digest(site_copy) == before


def test_console_script_and_installed_target_read_only() -> None:
    """The console script targets the env's own vllm (patched by the env builder)."""
    import sys

    script = Path(sys.executable).with_name("vllm-ext-patches")
    assert script.exists(), "reinstall vllm-ext: python3 tools/envs.py build"
    res = subprocess.run(
        [str(script), "status", "--json"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    status = json.loads(res.stdout)
    assert status["kind"] == "installed package" and status["version"] == PIN
    assert [r["state"] for r in status["patches"]] == ["applied"] * 4


def test_vllm_source_tree_is_tagged_and_reproducible(pristine_tree: Path, checkout: Path) -> None:
    assert _git(pristine_tree, "tag").split() == [f"v{PIN}"]
    assert _git(checkout, "rev-parse", f"v{PIN}") == _git(pristine_tree, "rev-parse", "HEAD")
    # Fixed identity and dates: the same wheel gives the same commit everywhere.
    assert _git(pristine_tree, "log", "-1", "--format=%an|%ad|%cd", "--date=iso-strict") == (
        "vLLM release (from wheel)|2000-01-01T00:00:00+00:00|2000-01-01T00:00:00+00:00\n"
    )
    assert not list(pristine_tree.rglob("*.so"))
    assert (pristine_tree / "vllm" / "distributed" / "kv_transfer").is_dir()
