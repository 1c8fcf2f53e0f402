# SPDX-License-Identifier: Apache-2.0
"""The GPU floor's code path, run for real on DRAM: two processes, real NIXL over UCX.

Everything the ``--device cuda`` run does except the memory type (VRAM), the torch
device and ``CUDA_VISIBLE_DEVICES``: the plan, the per-process agents and metadata
exchange, every layout and placement, the timed WRITE with its notification, the
data check of each case and the copy.
"""

from __future__ import annotations

import time

import pytest

from devkit.bench import floor as F

pytest.importorskip("nixl._api")


@pytest.mark.timeout(240)
def test_device_floor_on_dram() -> None:
    cfg = F.DeviceFloorConfig(
        device="cpu", input_lens=[64, 256], geometry=F.KvGeometry(4, 512, 16),
        repeats=2, warmup=1,
    )  # fmt: skip
    res = F.measure_device(cfg)
    assert "error" not in res, res.get("error")
    rows = res["cases"]
    assert [(r["input_len"], r["layout"], r["placement"]) for r in rows] == [
        (c.input_len, c.layout, c.placement) for c in F.plan(cfg)
    ]
    for r, c in zip(rows, F.plan(cfg)):
        assert r["data_ok"], r
        assert r["bytes"] == c.bytes
        if c.placement == "contiguous":
            assert r["descriptors"] == c.regions
        else:
            assert c.regions <= r["descriptors"] <= c.max_descriptors
        # (the target may see the notification before transfer() returns: no order)
        assert 0 < r["post_p50_s"] < 5 and 0 < r["notif_p50_s"] < 5
        assert r["prep_p50_s"] > 0 and r["repeats"] == 2
    assert [c["input_len"] for c in res["peer_copy"]] == [64, 256]
    assert res["config"]["mem_type"] == "DRAM"
    f = F.device_floor_by_len(res)
    assert set(f) == {64, 256} and f[256]["one_desc"] > 0 and "copy" in f[256]


@pytest.mark.timeout(240)
def test_runner_runs_the_device_floor_in_a_process_of_its_own(tmp_path) -> None:
    """The runner's path: config as JSON -> python -m devkit.bench.floor -> rows back,
    progress lines relayed, the log kept."""
    from devkit.bench.runner import run_gpu_floor

    cfg = F.DeviceFloorConfig(
        device="cpu", input_lens=[64], geometry=F.KvGeometry(2, 256, 16), repeats=2,
        warmup=1, layouts=["per-layer"], placements=["scattered"],
    )  # fmt: skip
    lines: list[str] = []
    res = run_gpu_floor(cfg, lines.append, 200.0, tmp_path / "logs" / "floor.log")
    assert "error" not in res, res.get("error")
    assert [(r["layout"], r["placement"]) for r in res["cases"]] == [
        ("cross-layer", "contiguous"), ("per-layer", "scattered"),
    ]  # fmt: skip
    assert all(r["data_ok"] for r in res["cases"]) and res["peer_copy"]
    assert any(ln.startswith("floor in=64 per-layer/scattered") for ln in lines)
    assert (tmp_path / "logs" / "floor.log").stat().st_size > 0


@pytest.mark.timeout(60)
def test_runner_stops_a_floor_that_runs_past_its_time(tmp_path) -> None:
    from devkit.bench.runner import run_gpu_floor

    cfg = F.DeviceFloorConfig(device="cpu", input_lens=[64], geometry=F.KvGeometry(2, 256, 16))
    t0 = time.monotonic()
    res = run_gpu_floor(cfg, lambda m: None, 1.0, tmp_path / "floor.log")
    assert time.monotonic() - t0 < 30
    assert res["cases"] == [] and "error" in res
