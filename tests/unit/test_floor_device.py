# SPDX-License-Identifier: Apache-2.0
"""The GPU floor's plan: layouts, placements, descriptor counts, memory, per-process env."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from devkit.bench import floor as F
from vllm_ext.nixl_push.descriptors import build_write_descs

KIB, MIB = 1024, 1024 * 1024


def test_cuda_defaults_are_qwen3_8b_on_two_gpus() -> None:
    cfg = F.DeviceFloorConfig()
    assert cfg.device == "cuda" and cfg.mem_type == "VRAM"
    assert cfg.input_lens == [2048, 8192, 16384]
    g = cfg.geometry
    assert (g.layers, g.block_tokens) == (36, 16)
    assert g.regions("per-layer") == (36, 64 * KIB)
    assert g.regions("kv-split") == (72, 32 * KIB)
    assert g.regions("cross-layer") == (1, 36 * 64 * KIB)  # 2.25 MiB per block
    # one process per GPU, as P and D get them, with multicast off; the copy sees both
    env_i, env_t, env_c = cfg.env("initiator"), cfg.env("target"), cfg.env("copy")
    assert env_i["CUDA_VISIBLE_DEVICES"] == "0" and env_t["CUDA_VISIBLE_DEVICES"] == "1"
    assert env_c["CUDA_VISIBLE_DEVICES"] == "0,1"
    for env in (env_i, env_t, env_c):
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    # 2 x the largest request (1024 blocks) + block 0, per side: ~4.5 GiB of VRAM
    assert cfg.pool_blocks == 2049
    assert cfg.buffer_bytes == 2049 * 36 * 64 * KIB
    assert cfg.buffer_bytes < 5 * 2**30


def test_cpu_device_has_no_gpu_env() -> None:
    cfg = F.DeviceFloorConfig(device="cpu", input_lens=[64], geometry=F.KvGeometry(4, 512, 16))
    assert cfg.mem_type == "DRAM" and cfg.env("initiator") == {} and cfg.env("copy") == {}
    with pytest.raises(ValueError, match="cuda or cpu"):
        F.DeviceFloorConfig(device="tpu")
    with pytest.raises(ValueError, match="unknown KV layout"):
        F.DeviceFloorConfig(layouts=["per-head"])
    with pytest.raises(ValueError, match="placement"):
        F.DeviceFloorConfig(placements=["interleaved"])


def test_plan_cases_bytes_and_descriptors() -> None:
    cases = F.plan(F.DeviceFloorConfig())
    by_key = {c.key: c for c in cases}
    # per length: one descriptor of everything first, then 3 layouts x 2 placements
    assert len(cases) == 3 * 6
    assert cases[0].key == "in2048-cross-layer-contiguous"
    for n in (2048, 8192, 16384):
        row = [c for c in cases if c.input_len == n]
        assert {c.bytes for c in row} == {n * 144 * KIB}  # the same bytes in every layout
    c16 = "in16384-"
    assert by_key[c16 + "cross-layer-contiguous"].max_descriptors == 1
    assert by_key[c16 + "per-layer-contiguous"].max_descriptors == 36
    assert by_key[c16 + "per-layer-scattered"].max_descriptors == 36 * 1024  # 36,864
    assert by_key[c16 + "kv-split-scattered"].max_descriptors == 72 * 1024  # vLLM pull: 73,728
    assert by_key[c16 + "cross-layer-scattered"].max_descriptors == 1024
    assert by_key[c16 + "per-layer-contiguous"].bytes == 2_415_919_104


def test_scattered_blocks_make_one_descriptor_per_block_and_region() -> None:
    cfg = F.DeviceFloorConfig()
    case = next(c for c in F.plan(cfg) if c.key == "in2048-per-layer-scattered")
    rng = random.Random(0)
    src_ids, dst_ids = F.case_blocks(case, cfg.pool_blocks, rng)
    assert len(set(src_ids)) == len(src_ids) == 128 and 0 not in src_ids + dst_ids
    assert max(src_ids + dst_ids) < cfg.pool_blocks
    assert F.case_blocks(case, cfg.pool_blocks, rng) != (src_ids, dst_ids)  # new pick per repeat
    local = F.case_layout(case, 1 << 40, cfg.pool_blocks, 0)
    remote = F.case_layout(case, 1 << 41, cfg.pool_blocks, 0)
    src, dst = build_write_descs(local, remote, src_ids, dst_ids)
    assert len(src) == len(dst) == 36 * 128  # random picks hardly ever pair up into runs
    # every descriptor stays inside its side's buffer
    assert all(a >= 1 << 40 and a + n <= (1 << 40) + cfg.buffer_bytes for a, n, _ in src)
    assert all(a >= 1 << 41 and a + n <= (1 << 41) + cfg.buffer_bytes for a, n, _ in dst)
    contiguous = next(c for c in F.plan(cfg) if c.key == "in2048-per-layer-contiguous")
    ids = F.case_blocks(contiguous, cfg.pool_blocks, rng)
    src, _ = build_write_descs(
        F.case_layout(contiguous, 0, cfg.pool_blocks, 0),
        F.case_layout(contiguous, 0, cfg.pool_blocks, 0),
        *ids,
    )
    assert [n for _, n, _ in src] == [128 * 64 * KIB] * 36


def test_cli_plan_is_a_dry_run() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "devkit.bench.floor", "--device", "cuda", "--plan"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "in16384-per-layer-scattered: 2304.0 MiB, 36 regions x 1024 blocks" in out.stdout
    assert "<= 36864 descriptors" in out.stdout
    assert "(VRAM)" in out.stdout and "'CUDA_VISIBLE_DEVICES': '1'" in out.stdout


def test_floor_by_len_picks_one_descriptor_best_and_copy() -> None:
    res = {
        "cases": [
            {"input_len": 2048, "bytes": 9, "layout": "cross-layer", "placement": "contiguous",
             "notif_p50_s": 0.002, "descriptors": 1},
            {"input_len": 2048, "bytes": 9, "layout": "per-layer", "placement": "scattered",
             "notif_p50_s": 0.030, "descriptors": 4608},
            {"input_len": 2048, "bytes": 9, "layout": "per-layer", "placement": "contiguous",
             "notif_p50_s": 0.0018, "descriptors": 36},
        ],
        "peer_copy": [{"input_len": 2048, "bytes": 9, "copy_p50_s": 0.001}],
    }  # fmt: skip
    f = F.device_floor_by_len(res)[2048]
    assert f["one_desc"] == 0.002 and f["best"] == 0.0018 and f["copy"] == 0.001
    assert f["per-layer/scattered"] == 0.030 and f["per-layer/scattered:descriptors"] == 4608


def test_connector_mt_mutex_default() -> None:
    assert F.connector_mt_mutex("cpu") is True
    assert isinstance(F.connector_mt_mutex("cuda"), bool)


def test_both_visible_fallback_uses_device_indexes() -> None:
    own = F.DeviceFloorConfig()
    assert own.device_index("initiator") == own.device_index("target") == 0
    both = F.DeviceFloorConfig(visible="both")
    assert both.env("initiator")["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert both.env("target")["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert (both.device_index("initiator"), both.device_index("target")) == (0, 1)
    assert F.DeviceFloorConfig(device="cpu", visible="both").device_index("target") == 0
    with pytest.raises(ValueError, match="own or both"):
        F.DeviceFloorConfig(visible="some")
    # the runner hands the config to a floor process as JSON
    assert F.config_from_json(F.config_to_json(both)) == both
