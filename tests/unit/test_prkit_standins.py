# SPDX-License-Identifier: Apache-2.0
"""The PR kit's hub model stand-ins (tools/prkit/standins.py): which ids a test run
gets, the env it runs with, and what the report says (the cache's own layout and
offline resolution: tests/unit/test_hub_stand_in.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from prkit.common import Progress  # noqa: E402
from prkit.standins import named_ids, setup  # noqa: E402


def test_the_ids_the_folder_names(tmp_path: Path) -> None:
    unit = tmp_path / "tests" / "unit"
    (unit / "sub").mkdir(parents=True)
    (unit / "test_a.py").write_text("create_vllm_config()\n")
    # the default model of a helper beside the test counts; an id in a sub-folder too
    (unit / "utils.py").write_text('def create_vllm_config(model: str = "facebook/opt-125m"):\n')
    (unit / "sub" / "test_b.py").write_text("LLM(model='Qwen/Qwen3-0.6B')\n")
    # an id without a stand-in, and a known id only as part of a longer one, do not
    (unit / "test_c.py").write_text('m = "facebook/opt-1.3b"; n = "facebook/opt-125m-x"\n')
    assert named_ids([unit]) == ["Qwen/Qwen3-0.6B", "facebook/opt-125m"]
    # a test file: it and the helpers beside it, not the other tests
    assert named_ids([unit / "test_a.py"]) == ["facebook/opt-125m"]
    assert named_ids([unit / "sub" / "test_b.py"]) == ["Qwen/Qwen3-0.6B"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "test_d.py").write_text("x = 1\n")
    assert named_ids([other]) == []


@pytest.mark.timeout(120)
def test_setup_points_the_run_at_the_built_cache(tmp_path: Path) -> None:
    env, note = setup(Path(sys.executable), ["facebook/opt-125m"], tmp_path, Progress(True))
    home = Path(env["HF_HOME"])
    assert home.parent == tmp_path and env["HF_HUB_CACHE"] == str(home / "hub")
    assert env["HF_HUB_OFFLINE"] == "1"
    assert json.loads((home / "stand_ins.json").read_text()).keys() == {"facebook/opt-125m"}
    assert (home / "hub" / "models--facebook--opt-125m" / "refs" / "main").is_file()
    assert "(facebook/opt-125m)" in note and "no weights" in note
    assert str(tmp_path) not in note  # the note goes into a PR description
    # nothing named: nothing built, nothing said
    assert setup(Path(sys.executable), [], tmp_path / "none", Progress(True)) == ({}, "")
    assert not (tmp_path / "none").exists()


def test_setup_that_cannot_build_says_so(tmp_path: Path) -> None:
    env, note = setup(Path("/bin/false"), ["facebook/opt-125m"], tmp_path, Progress(True))
    assert env == {}
    assert note.startswith("no local stand-ins for the hub models the tests name")


def test_test_file_narrows_the_run_to_files_of_the_patches_folders(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from prkit.testrun import _test_files

    unit = "tests/v1/kv_connector/unit/"
    for f in ("test_nixl_heartbeat.py", "test_multi_connector.py", "utils.py"):
        (tmp_path / unit).mkdir(parents=True, exist_ok=True)
        (tmp_path / unit / f).write_text("")

    def commit(name: str, *files: str) -> SimpleNamespace:
        return SimpleNamespace(patch=SimpleNamespace(name=name), files=list(files))

    branch = SimpleNamespace(
        worktree=tmp_path,
        commits=[commit("0001-a", "vllm/x.py", unit + "test_nixl_heartbeat.py"),
                 commit("0002-b", "vllm/y.py")],
    )  # fmt: skip
    assert _test_files(branch, "folder") == {"0001-a": [unit]}  # type: ignore[arg-type]
    assert _test_files(branch, "files") == {"0001-a": [unit + "test_nixl_heartbeat.py"]}  # type: ignore[arg-type]
    only = (unit + "test_multi_connector.py", "tests/v1/core/test_scheduler.py")
    # a file of a touched folder that the patch does not touch runs; one elsewhere does not
    assert _test_files(branch, "files", only) == {"0001-a": [unit + "test_multi_connector.py"]}  # type: ignore[arg-type]
    assert _test_files(branch, "folder", ("tests/v1/core/test_scheduler.py",)) == {}  # type: ignore[arg-type]


def test_the_triton_stand_in_only_where_the_tree_refuses_a_config_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import platform

    from prkit.standins import TRITON_PLUGIN, TRITON_REFUSAL, triton_stand_in

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    cpu = tmp_path / "tree" / "vllm" / "platforms" / "cpu.py"
    cpu.parent.mkdir(parents=True)
    cpu.write_text(f'raise RuntimeError("vLLM on x86 CPUs {TRITON_REFUSAL}.")\n')
    got = triton_stand_in(tmp_path / "tree", False, tmp_path / "plugins")
    assert got is not None and got[0] == str(tmp_path / "plugins")
    src = (tmp_path / "plugins" / f"{TRITON_PLUGIN}.py").read_text()
    compile(src, TRITON_PLUGIN, "exec")
    assert 'mock.patch("vllm.triton_utils.HAS_TRITON", True)' in src
    assert triton_stand_in(tmp_path / "tree", True, tmp_path / "p2") is None  # a GPU
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert triton_stand_in(tmp_path / "tree", False, tmp_path / "p3") is None
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    cpu.write_text("class CpuPlatform: ...\n")  # a release without the refusal
    assert triton_stand_in(tmp_path / "tree", False, tmp_path / "p4") is None


def test_a_collection_error_is_run_again_on_the_base_as_its_file(tmp_path: Path) -> None:
    """pytest's xunit1 report names a module that did not import with an empty
    classname; ``file::module`` selects nothing ("found no collectors"), and pytest
    then runs none of the other ids given with it."""
    from prkit.testrun import _failed_ids

    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="" name="tests.unit.test_bad" file="tests/unit/test_bad.py">'
        '<error message="collection failure"/></testcase>'
        '<testcase classname="tests.unit.test_ok" name="test_ok[org/model-512]" '
        'file="tests/unit/test_ok.py"><failure message="boom"/></testcase>'
        '<testcase classname="tests.unit.test_ok.TestC" name="test_m" '
        'file="tests/unit/test_ok.py"><failure message="boom"/></testcase>'
        '<testcase classname="tests.unit.test_ok" name="test_fine" file="tests/unit/test_ok.py"/>'
        "</testsuite></testsuites>"
    )
    assert _failed_ids(junit) == [
        "tests/unit/test_bad.py",
        "tests/unit/test_ok.py::test_ok[org/model-512]",
        "tests/unit/test_ok.py::TestC::test_m",
    ]
