# SPDX-License-Identifier: Apache-2.0
"""The scale benchmark's verdicts (``scale_report.targets``) on made-up step points:
they judge engine + writer thread CPU, and leave out a point where a connector served
no request or fewer than it was sent. And ``--prompt-tokens`` reaches the step part's
config. No benchmark runs here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from devkit.bench import scale, scale_report

REPO = Path(__file__).resolve().parents[2]


def _point(
    connector: str, tracked: int, engine_us: float, writer_us: float, completed: int = 1200
) -> dict[str, Any]:
    stats = {"median": engine_us, "p99": engine_us * 2, "mean": engine_us}
    return {
        "connector": connector, "tracked": tracked, "changed": 4, "steps": 300,
        "prompt_tokens": 16, "asked": 1200, "completed": completed,
        "cpu_us": {"P": stats, "D": stats}, "wall_us": {"P": stats, "D": stats},
        "writer_cpu_us": {"P": writer_us, "D": writer_us},
        "writer_core_pct": {"P": 1.0, "D": 1.0}, "gc_us": 1.0,
        "by_hook_cpu_us": {"P": {"build_connector_meta": engine_us}, "D": {}},
    }  # fmt: skip


def _target(results: dict[str, Any], tid: str, side: str = "P") -> dict[str, Any]:
    (t,) = [t for t in scale_report.targets(results) if t["id"] == tid and t["side"] == side]
    return t


def test_a_point_that_served_nothing_or_too_little_is_invalid() -> None:
    assert scale_report.invalid_reason(_point("ours", 100, 1, 1, completed=1200)) is None
    # the last steps' requests may still be in flight when measuring stops
    assert scale_report.invalid_reason(_point("ours", 100, 1, 1, completed=1196)) is None
    none = scale_report.invalid_reason(_point("vllm", 4000, 1, 1, completed=0))
    assert none is not None and "served no request" in none
    few = scale_report.invalid_reason(_point("vllm", 4000, 1, 1, completed=600))
    assert few is not None and "600 of 1200" in few


def test_a_json_without_asked_counts_changed_times_steps() -> None:
    p = _point("vllm", 4000, 1, 1, completed=1000)
    del p["asked"]
    assert "1000 of 1200" in (scale_report.invalid_reason(p) or "")


def test_growth_is_judged_on_engine_plus_writer_cpu() -> None:
    # engine thread alone: 110 / 100 = 1.1 (would pass); with the writers: 310 / 200 = 1.55
    results = {"step_points": [_point("ours", 100, 100, 100), _point("ours", 4000, 110, 200)]}
    t = _target(results, "T-SCALE-1")
    assert t["measured"] == pytest.approx(310 / 200)
    assert t["verdict"] == "FAIL"
    assert "engine 110" in t["detail"] and "writer 200" in t["detail"]


def test_ours_vs_vllm_is_judged_on_engine_plus_writer_cpu() -> None:
    # engine thread alone: 100 / 300 = 0.33 (would pass); with the writers: 1100 / 400
    results = {"step_points": [_point("ours", 1000, 100, 1000), _point("vllm", 1000, 300, 100)]}
    t = _target(results, "T-SCALE-2", "D")
    assert t["measured"] == pytest.approx(1100 / 400)
    assert t["verdict"] == "FAIL"
    cheap = {"step_points": [_point("ours", 1000, 100, 50), _point("vllm", 1000, 300, 100)]}
    assert _target(cheap, "T-SCALE-2", "D")["verdict"] == "pass"


def test_ours_vs_vllm_asks_half_of_vllms_cost_on_p_and_no_more_than_it_on_d() -> None:
    # 0.9 x vLLM's push on both sides: within D's limit (1.0), over P's (0.5)
    results = {"step_points": [_point("ours", 1000, 90, 90), _point("vllm", 1000, 100, 100)]}
    assert _target(results, "T-SCALE-2", "D")["verdict"] == "pass"
    assert _target(results, "T-SCALE-2", "P")["verdict"] == "FAIL"
    # growth: 1.25 passes (<= 1.3), 1.35 fails
    ok = {"step_points": [_point("ours", 100, 100, 100), _point("ours", 4000, 150, 100)]}
    assert _target(ok, "T-SCALE-1", "D")["verdict"] == "pass"
    bad = {"step_points": [_point("ours", 100, 100, 100), _point("ours", 4000, 170, 100)]}
    assert _target(bad, "T-SCALE-1", "D")["verdict"] == "FAIL"


def test_an_invalid_point_gives_no_verdict_and_says_why() -> None:
    results = {
        "step_points": [
            _point("ours", 100, 100, 100),
            _point("ours", 1000, 10, 10),
            _point("ours", 4000, 100, 100),
            _point("vllm", 1000, 500, 500, completed=0),
        ],
        "config": {"changed": 4, "prompt_tokens": 16},
    }
    t = _target(results, "T-SCALE-2")
    assert t["measured"] is None and t["verdict"] == "n/a"
    assert t["skipped"] and "served no request" in t["skipped"][0]
    assert "invalid" in t["detail"]
    # the growth target has only valid points: judged
    assert _target(results, "T-SCALE-1")["verdict"] == "pass"
    results["targets"] = scale_report.targets(results)
    md = scale_report.markdown(results)
    assert "Invalid points (left out of the targets)" in md
    assert "* vllm, 1000 tracked: vllm served no request" in md


def test_the_published_run_flags_vllm_push_at_4000_tracked() -> None:
    """docs/results/scale-20261203.json: vLLM's push received nothing at 4,000 tracked."""
    results = json.loads((REPO / "docs/results/scale-20261203.json").read_text())
    bad = {
        (p["connector"], p["tracked"])
        for p in results["step_points"]
        if scale_report.invalid_reason(p)
    }
    assert bad == {("vllm", 4000)}


def test_prompt_tokens_option() -> None:
    assert scale.parse_args([]).prompt_tokens == 16
    args = scale.parse_args(["--quick", "--prompt-tokens", "2048"])
    assert args.prompt_tokens == 2048 and scale._config(args)["prompt_tokens"] == 2048
    with pytest.raises(SystemExit):
        scale.parse_args(["--prompt-tokens", "100"])


def test_step_config_sizes_the_engines_for_the_prompt() -> None:
    from devkit.bench import scale_step

    short = scale_step.StepConfig(tracked=10)
    assert short.prompt_tokens == 16 and short.max_model_len == 1024
    long = scale_step.StepConfig(tracked=10, changed=4, prompt_tokens=16384)
    assert long.max_model_len >= 16384 + 1 and long.max_num_batched_tokens >= 4 * 16384
    # the prompt and the sampled token fit in a request's blocks
    assert long.blocks_per_request * 16 >= 16384 + 1
    assert len(scale_step.step_prompt(3, 2048)) == 2048
