# SPDX-License-Identifier: Apache-2.0
"""The scale benchmark's quick mode runs end to end and writes what it promises: the
JSON's shape, finite positive numbers, every request it sent received, the report
and the plots. No timing is asserted (timings are the benchmark's output)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devkit.bench import scale, scale_report

REPO = Path(__file__).resolve().parents[2]


def _numbers(value: Any, path: str = "") -> list[tuple[str, float]]:
    """Every number in a JSON value, with where it sits."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [(path, float(value))]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _numbers(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [x for i, v in enumerate(value) for x in _numbers(v, f"{path}[{i}]")]
    return []


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("scale") / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "devkit.bench.scale", "--quick", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.timeout(660)
def test_quick_mode_writes_every_point_with_finite_positive_numbers(quick_run: Path) -> None:
    results = json.loads((quick_run / "results.json").read_text())
    cfg = results["config"]
    assert cfg["quick"] is True
    assert tuple(cfg["tracked"]) == scale.QUICK["tracked"]
    assert results["machine"]["cores"] >= 1 and results["git"].get("commit")
    assert "vllm-ext" in results["versions"]

    steps = results["step_points"]
    connectors = {p["connector"] for p in steps}
    assert "ours" in connectors
    # every (connector, tracked) point of the sweep is there, once
    assert sorted((p["connector"], p["tracked"]) for p in steps) == sorted(
        (c, n) for c in connectors for n in cfg["tracked"]
    )
    for p in steps:
        assert p["steps"] == cfg["steps"] and p["changed"] == cfg["changed"]
        for side in ("P", "D"):
            for what in ("cpu_us", "wall_us", "step_wall_us"):
                stats = p[what][side]
                assert set(stats) == {"median", "p99", "mean"}
                assert 0 < stats["median"] <= stats["p99"], (what, side, stats)
            assert p["by_hook_cpu_us"][side]
        # requests flowed while it was measured: P pushed, D received
        assert p["completed"] > 0

    writers = results["writer_points"]
    assert sorted((w["mode"], w["tp"], w["d_peers"]) for w in writers) == sorted(
        (m, tp, n) for m in cfg["modes"] for tp in cfg["tps"] for n in cfg["peers"]
    )
    for w in writers:
        # every request sent was received; each rank wrote each request at least once
        assert w["received"] == w["requests"]
        assert w["writes"] >= w["requests"] * w["tp"]
        assert w["writes_per_cpu_s"] > 0 and w["writes_per_cpu_s_ours"] >= w["writes_per_cpu_s"]

    for where, x in _numbers(steps) + _numbers(writers):
        assert math.isfinite(x) and x >= 0, (where, x)
        if where.endswith(("median", "p99", "mean", "_s", "_per_write", "_per_request")):
            assert x > 0, (where, x)

    ids = [(t["id"], t["side"]) for t in results["targets"]]
    assert ("T-SCALE-1", "P") in ids and ("T-SCALE-3", "P writer") in ids
    assert {t["verdict"] for t in results["targets"]} <= {"pass", "FAIL", "n/a"}


def test_quick_mode_writes_the_report_and_the_plots(quick_run: Path) -> None:
    md = (quick_run / "report.md").read_text()
    for heading in ("## Targets", "## Per-step connector cost", "## The writer's throughput"):
        assert heading in md
    for png in ("step_cost.png", "writer.png"):
        assert (quick_run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_rebuilds_from_the_json(quick_run: Path, tmp_path: Path) -> None:
    results = json.loads((quick_run / "results.json").read_text())
    paths = scale_report.write(results, tmp_path, plots=False)
    again = json.loads(paths["json"].read_text())
    assert again["step_points"] == results["step_points"]
    assert paths["md"].read_text() == (quick_run / "report.md").read_text()
