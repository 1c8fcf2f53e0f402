# SPDX-License-Identifier: Apache-2.0
"""What a PR description says about where its tests ran: no local path, and the
platform, so CPU tests without NIXL do not read as covering the GPU / NIXL path."""

from __future__ import annotations

from prkit.describe import local_paths  # tools/ is on sys.path through patch_support
from prkit.testrun import platform_note


def test_local_paths_are_found_and_vllm_paths_and_urls_are_not() -> None:
    text = (
        "env /work/main/.venvs/vllm-0.32.0/bin/python, cache ~/.cache/vllm-ext/x, "
        "tmp /tmp/pytest-of-root/p0/vllm; vllm/distributed/x.py, "
        "https://github.com/vllm-project/vllm/pull/48633, tests/v1/kv_connector/unit/a.py"
    )
    assert local_paths(text) == [
        "/work/main/.venvs/vllm-0.32.0/bin/python",
        "~/.cache/vllm-ext/x",
        "/tmp/pytest-of-root/p0/vllm",
    ]


def test_platform_note_says_what_did_not_run() -> None:
    cpu = platform_note({"python": "3.11.7", "torch": "2.9.0+cpu", "cuda": False, "nixl": False})
    assert cpu.startswith("Python 3.11.7, torch 2.9.0+cpu, no GPU (CPU only), NIXL not installed")
    assert "the GPU / NIXL transfer path did not run" in cpu
    gpu = platform_note({"python": "3.12.1", "torch": "2.9.0", "cuda": True, "nixl": True})
    assert gpu == "Python 3.12.1, torch 2.9.0, a CUDA GPU, NIXL installed"


def test_the_example_descriptions_hold_no_local_path() -> None:
    from patch_support import REPO

    examples = sorted((REPO / "docs" / "examples").glob("pr-*.md"))
    assert examples
    for example in examples:
        text = example.read_text()
        assert local_paths(text) == [], example.name
        assert "vllm-ext" not in text and "Python env" not in text, example.name
