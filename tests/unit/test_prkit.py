# SPDX-License-Identifier: Apache-2.0
"""The upstream PR kit's pure parts: identity rules, commit messages, bench numbers,
the PR template (no vLLM tree needed; the kit end to end is tests/patches/test_upstream_pr.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from prkit import describe, identity  # noqa: E402
from prkit.branch import pr_message  # noqa: E402
from prkit.checks import CheckResult  # noqa: E402
from prkit.common import KitError, UsageError, patchtool  # noqa: E402

SERIES = patchtool.load_series(REPO / "patches" / "vllm-0.23.0")
ME = identity.Identity("Kit Tester", "kit.tester@vllm-ext.dev")


@pytest.mark.parametrize(
    "email,reserved",
    [
        ("a@example.com", "example.com"),
        ("a@mail.example.org", "example.org"),
        ("maintainers@users.noreply.a-seed-28d995dd.example", ".example"),
        ("dev@vllm-ext.invalid", ".invalid"),
        ("x@host.test", ".test"),
        ("root@localhost", ".localhost"),
        ("kit.tester@vllm-ext.dev", None),
        ("123+someone@users.noreply.github.com", None),
        ("a@examples.com", None),
    ],
)
def test_reserved_domains(email: str, reserved: str | None) -> None:
    assert identity.reserved_domain(email) == reserved


def test_validate_refuses_reserved_and_malformed_unless_allowed() -> None:
    bad = identity.Identity("Group", "maintainers@users.noreply.a-seed-28d995dd.example")
    with pytest.raises(UsageError, match=r"reserved domain \(\.example"):
        identity.validate(bad)
    assert identity.validate(bad, allow_reserved=True) == bad
    with pytest.raises(UsageError, match="not an e-mail address"):
        identity.validate(identity.Identity("No Mail", "nobody"))
    assert identity.validate(ME) == ME


def test_pr_message_drops_project_trailers_and_alias_signoff() -> None:
    original = (
        "[KV Connector] Subject\n\nWhy:\nBecause.\n\nUpstream-Since: none\n"
        "Signed-off-by: Seed maintainers <m@users.noreply.a-seed.example>\n"
    )
    msg = pr_message(original, ME)
    assert msg == "[KV Connector] Subject\n\nWhy:\nBecause.\n\nSigned-off-by: " + str(ME) + "\n"
    assert pr_message(msg, ME) == msg  # idempotent
    kept = pr_message("S\n\nBody.\n\nSigned-off-by: Other Person <o@vllm-ext.dev>\n", ME)
    assert kept.endswith(f"Signed-off-by: Other Person <o@vllm-ext.dev>\n{ME.signoff}\n")


def test_message_sections_of_a_real_patch() -> None:
    sections = describe.message_sections(SERIES[0])
    assert set(sections) >= {"Why", "How", "Related upstream PR", "When to drop it"}
    assert "has_pending_push_work" in sections["How"]
    assert "Upstream-Since" not in json.dumps(sections)


def _results_json(tmp_path: Path) -> Path:
    rows = []
    for point, n, load in (("in1024-c=1", 1024, "c=1"), ("in2048-c=4", 2048, "c=4")):
        for mode, ttft in (("pull-0.23", 0.190), ("push-0.23", 0.047), ("single-0.23", 0.038)):
            scale = n / 1024
            rows.append({"mode": mode, "point": point, "input_len": n, "load": load,
                         "ttft_p50": ttft * scale, "tpot_p50": 0.003})  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"run_id": "bench-test", "aggregates": rows,
                                "machine": {"cpu": "Test CPU", "cores": 2},
                                "git": {"commit": "0123456789abcdef", "dirty": False},
                                "versions": {"0.23.0": {"vllm": "0.23.0"}},
                                "command": ["tools/bench.py"]}))  # fmt: skip
    return path


def test_select_and_its_errors(tmp_path: Path) -> None:
    data = json.loads(_results_json(tmp_path).read_text())
    sel = "aggregates[mode=push-0.23,point=in1024-c=1].ttft_p50"
    assert describe.select(data, sel) == pytest.approx(0.047)
    with pytest.raises(UsageError, match=r"matches 0 elements of 'aggregates'"):
        describe.select(data, "aggregates[mode=nope].ttft_p50")
    with pytest.raises(UsageError, match=r"matches 3 elements"):
        describe.select(data, "aggregates[point=in1024-c=1].ttft_p50")
    with pytest.raises(UsageError, match=r"no 'nothing'"):
        describe.select(data, "nothing.at.all")


def test_bench_numbers_default_table_and_mapping(tmp_path: Path) -> None:
    results = _results_json(tmp_path)
    bench = describe.bench_numbers(results, None, "0.23.0")
    text = "\n".join(bench.lines)
    assert "**TTFT p50 (ms)**" in text
    assert "| in1024-c=1 | 190 | 47 | 38 |" in text and "| in2048-c=4 | 380 | 94 | 76 |" in text
    assert "run `bench-test`" in bench.source and "commit `0123456789ab`" in bench.source

    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({
        "patches": ["0001"],
        "numbers": [{"label": "TTFT p50 push, 1024, c=1",
                     "select": "aggregates[mode=push-0.23,point=in1024-c=1].ttft_p50",
                     "scale": 1000, "unit": "ms", "digits": 1}],
        "table": {"caption": "TTFT p50 (ms), pull vs push", "value": "ttft_p50",
                  "scale": 1000, "digits": 0, "select_rows": ["in2048-c=4"],
                  "select_cols": {"pull-0.23": "vLLM pull", "push-0.23": "push"}},
    }))  # fmt: skip
    bench = describe.bench_numbers(results, mapping, "0.23.0")
    text = "\n".join(bench.lines)
    assert "| point | vLLM pull | push |" in text and "| in2048-c=4 | 380 | 94 |" in text
    assert "| TTFT p50 push, 1024, c=1 | 47.0 ms |" in text
    assert bench.patches == ["0001"]

    mapping.write_text(json.dumps({"numbers": [{"label": "x", "select": "aggregates[mode=x].y"}]}))
    with pytest.raises(UsageError, match=r"'aggregates\[mode=x\]\.y' matches 0 elements"):
        describe.bench_numbers(results, mapping, "0.23.0")


def test_render_fills_vllms_template(tmp_path: Path) -> None:
    class FakeCommit:
        def __init__(self, patch: patchtool.Patch) -> None:
            self.patch, self.subject, self.files = patch, patch.subject, list(patch.hunks)

    commits = [FakeCommit(SERIES[0])]
    results = [
        CheckResult("ruff check", "pass", "4 files clean", files=list(SERIES[0].hunks),
                    command="ruff check --config pyproject.toml {files}"),
        CheckResult("mypy", "fail", "1 new error", files=["vllm/v1/core/sched/scheduler.py"],
                    patches=[SERIES[0].name],
                    problems=[f"vllm/v1/core/sched/scheduler.py:1: error ({SERIES[0].name})"],
                    command="mypy {files}"),
        CheckResult("pytest", "skip", "no --python", patches=[SERIES[1].name]),
    ]  # fmt: skip
    bench = describe.bench_numbers(_results_json(tmp_path), None, "0.23.0")
    text = describe.render(tmp_path, commits, results, bench, "vLLM 0.23.0")
    assert describe.title(commits) == SERIES[0].subject
    for heading in ("## Purpose", "## Test Plan", "## Test Result"):
        assert text.count(heading) == 1
    assert "PLEASE FILL IN" not in text and "Essential Elements" in text
    assert "- [x] The purpose of the PR" in text and "- [ ] (Optional)" in text
    assert "A KV connector that pushes KV" in text  # the patch's Why
    assert "`ruff check --config pyproject.toml tests/v1/" in text
    assert "| mypy | fail: 1 new error |" in text and "scheduler.py:1: error" in text
    assert "no --python" not in text  # another patch's test result
    assert "| in1024-c=1 | 190 | 47 | 38 |" in text


NEWER_TEMPLATE = """<!-- markdownlint-disable -->

## Overview

<!-- Summarize the change in 1-2 lines. -->

## Claims

## Validation

## Details

---
"""


def test_render_fills_the_newer_template_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    """vLLM 0.32's template (Overview / Claims / Validation / Details) is filled too; a
    template with none of the known sections is an error, not an empty description."""

    class FakeCommit:
        def __init__(self, patch: patchtool.Patch) -> None:
            self.patch, self.subject, self.files = patch, patch.subject, list(patch.hunks)

    gh = tmp_path / ".github"
    gh.mkdir()
    (gh / "PULL_REQUEST_TEMPLATE.md").write_text(NEWER_TEMPLATE)
    results = [CheckResult("ruff check", "pass", "4 files clean", files=list(SERIES[0].hunks),
                           command="ruff check {files}")]  # fmt: skip
    text = describe.render(tmp_path, [FakeCommit(SERIES[0])], results, None, "vLLM 0.32.0")
    bodies = {}
    for heading in ("Overview", "Claims", "Validation", "Details"):
        bodies[heading] = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
        filled = [ln for ln in bodies[heading].splitlines() if ln.strip() and "<!--" not in ln]
        assert filled, (heading, bodies[heading])
    assert SERIES[0].subject in bodies["Overview"]  # the overview names the change
    assert "has_pending_push_work" in bodies["Claims"]  # what it does, from its How
    # the why and how are told once, in Details, not repeated in Overview / Claims
    assert "A KV connector that pushes KV" not in bodies["Overview"] + bodies["Claims"]
    assert "| ruff check | pass: 4 files clean |" in text.split("## Validation")[1]
    assert "A KV connector that pushes KV" in text.split("## Details")[1]
    (gh / "PULL_REQUEST_TEMPLATE.md").write_text("## Motivation\n\n## Changes\n")
    with pytest.raises(KitError, match=r"sections \['Motivation', 'Changes'\]"):
        describe.render(tmp_path, [FakeCommit(SERIES[0])], results, None, "vLLM 9.9")


def test_series_title_is_short() -> None:
    series_title = describe.series_title

    class C:
        def __init__(self, subject: str) -> None:
            self.subject = subject

    commits = [C("[KV Connector][NIXL] Count drops"), C("[KV Connector][NIXL] Validate regs")]
    assert series_title(commits) == "[KV Connector][NIXL] Count drops (+1 more)"
    assert series_title([C("[A] x"), C("[B] y")]) == "[A] x (+1 more)"
    assert series_title([C("only one")]) == "only one"
