# SPDX-License-Identifier: Apache-2.0
"""0.34.0's 0004 (requests waiting for remote KV kept out of the scheduling scan):
its test fails on the release as published and the scheduler tests it touches pass
with the series applied.

Its tests build vLLM's scheduler through ``tests/v1/kv_connector/unit/utils.py``
(``create_vllm_config``), which reads ``facebook/opt-125m``'s config from the model hub
and, on an x86 CPU, asks for triton-cpu. Neither is here, so the child pytest gets the
PR kit's two local stand-ins: an offline Hugging Face cache (``HF_HOME``) with
``facebook/opt-125m``'s config numbers and a tokenizer (no weights: a scheduler test
loads none; ``devkit.testing.hub_stand_in``), and a plugin under which vLLM's CPU
platform check sees Triton present (``prkit.standins``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from patch_support import run_tool, series_dir, source_tree
from test_patch_series import _pin_python, _pytest, _tree_over_env

from vllm_ext import patchtool

UNIT = Path("tests/v1/kv_connector/unit")
#: the KV connector test files 0004 touches (41 tests with its new one). It also
#: updates tests/v1/core/test_scheduler.py, whose run here needs models (multimodal)
#: that no local stand-in covers: docs/upstream.md says what of it ran.
FILES = (
    "test_remote_prefill_lifecycle.py",
    "test_error_propagation.py",
    "test_invalid_blocks_correctness.py",
    "test_kv_load_failure_recovery.py",
)
NEW_TEST = (
    "test_remote_prefill_lifecycle.py::test_remote_kv_wait_kept_out_of_scan_until_recv_finished"
)
#: how it fails on 0.34.0 as published: every step visits the 4 waiting requests
RELEASED = "AssertionError: assert 12 == 0"


def _stand_ins(tmp_path: Path) -> dict[str, str]:
    """The PR kit's stand-ins (tools/prkit/standins.py): ``facebook/opt-125m`` in an
    offline Hugging Face cache, and the plugin for the triton-cpu check."""
    from devkit.testing.hub_stand_in import build_hub_cache
    from prkit.standins import write_triton_plugin

    home = build_hub_cache(("facebook/opt-125m",), tmp_path / "stand-ins")
    plugin = write_triton_plugin(tmp_path / "plugins")
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "_PLUGIN": str(plugin)}


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_034_scan_patch_fails_released_passes_patched(tmp_path: Path) -> None:
    python = _pin_python("0.32.0")
    series = patchtool.load_series(series_dir("0.34.0"))
    patch = next(p for p in series if p.name.startswith("0004-"))
    touched = sorted(Path(f).name for f in patch.files("tests/"))
    assert touched == sorted([*FILES, "utils.py", "test_scheduler.py"])
    tree = source_tree(tmp_path / "vllm", pin="0.34.0", with_tests=True)
    env = _stand_ins(tmp_path)
    plugin = env.pop("_PLUGIN")
    from prkit.standins import TRITON_PLUGIN

    args = ("--noconftest", "--import-mode=append", "-p", TRITON_PLUGIN, "-n", "2")

    def run(paths: list[Path]) -> subprocess.CompletedProcess[str]:
        work = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
        work.mkdir()
        overlay = _tree_over_env(tree, python, work)
        env["PYTHONPATH"] = f"{overlay}:{plugin}"
        env["VLLM_TARGET_DEVICE"] = "cpu"
        return _pytest(tree, env, paths=paths, python=python, extra_args=args)

    # The release with 0004's tests only: the new test fails, as the scan visits them.
    subprocess.run(["git", "apply", "--include=tests/*", str(patch.path)], cwd=tree, check=True)
    before = run([tree / UNIT / NEW_TEST])
    assert before.returncode == 1, before.stdout[-3000:] + before.stderr[-2000:]
    assert RELEASED in before.stdout, before.stdout[-3000:]
    subprocess.run(["git", "checkout", "-q", "--", "tests"], cwd=tree, check=True)
    # The series applied: every test of the files it touches passes.
    res = run_tool("apply", "--checkout", tree)
    assert res.returncode == 0, res.stdout + res.stderr
    after = run([tree / UNIT / f for f in FILES])
    assert after.returncode == 0, after.stdout[-4000:] + after.stderr[-2000:]
    assert re.search(r"\b41 passed\b", after.stdout), after.stdout[-800:]
