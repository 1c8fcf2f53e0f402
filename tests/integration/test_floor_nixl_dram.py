# SPDX-License-Identifier: Apache-2.0
"""The GPU floor's code path, run for real on DRAM: two processes, real NIXL over UCX.

Everything the ``--device cuda`` run does except the memory type (VRAM), the torch
device and ``CUDA_VISIBLE_DEVICES``: the plan, the per-process agents and metadata
exchange, every layout and placement, the timed WRITE with its notification, the
data check of each case and the copy.
"""

from __future__ import annotations

import pytest

from vllm_ext.bench import floor as F

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
        assert 0 < r["post_p50_s"] <= r["notif_p50_s"] < 5
        assert r["prep_p50_s"] > 0 and r["repeats"] == 2
    assert [c["input_len"] for c in res["peer_copy"]] == [64, 256]
    assert res["config"]["mem_type"] == "DRAM"
    f = F.device_floor_by_len(res)
    assert set(f) == {64, 256} and f[256]["one_desc"] > 0 and "copy" in f[256]
