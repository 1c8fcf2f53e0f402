# SPDX-License-Identifier: Apache-2.0
"""The vLLM 0.34.0 GPU comparison: its modes, its default, its proxy, its host check."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from devkit.bench import gpu, vllm_push_proxy
from devkit.bench import modes as M
from vllm_ext import compat

MODES_034 = ["push-0.34", "vllm-push-0.34", "single-0.34"]


def test_the_034_modes_run_ours_vllms_push_and_one_engine_on_one_release() -> None:
    ours, vllms, single = M.resolve(MODES_034)
    assert {m.pin for m in (ours, vllms, single)} == {"0.34.0"}
    # ours under the name vLLM 0.34.0 leaves free; the launcher's settings go to it only
    assert (ours.launch, ours.connector, ours.vllm_connector) == (
        "push", "ExtNixlPushConnector", False,
    )  # fmt: skip
    assert ours.proxy_module is None
    # vLLM's own push, as released, behind the proxy that adds its D-leg field
    assert (vllms.launch, vllms.connector, vllms.vllm_connector) == (
        "push", "NixlPushConnector", True,
    )  # fmt: skip
    assert vllms.proxy_module == M.VLLM_PUSH_PROXY == vllm_push_proxy.__name__
    assert (single.launch, single.connector, single.disaggregated) == ("single", None, False)
    assert not set(MODES_034) & set(M.DEFAULT_MODES)  # not in the CPU run
    assert M.pins_of([ours, vllms, single]) == ["0.34.0"]


def test_the_gpu_bench_defaults_to_the_comparison_of_the_installed_pin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert gpu.default_modes("0.34.0") == MODES_034
    assert gpu.default_modes("0.23.0") == gpu.DEFAULT_MODES
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.34.0")
    assert gpu.default_modes() == MODES_034
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: None)  # no vLLM
    assert gpu.default_modes() == gpu.DEFAULT_MODES
    assert gpu.default_modes("0.32.0") == gpu.DEFAULT_MODES
    # a list of its own: the caller may not change the table
    gpu.default_modes("0.34.0").append("x")
    assert gpu.DEFAULT_MODES_BY_PIN["0.34.0"] == MODES_034


def test_a_034_install_runs_every_034_mode_with_its_own_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.34.0")
    assert gpu._pythons(M.resolve(gpu.default_modes())) == {"0.34.0": sys.executable}
    # and the 0.23.0 default would not run there without another python
    with pytest.raises(SystemExit, match=r"need vLLM \['0.23.0'\]"):
        gpu._pythons(M.resolve(gpu.DEFAULT_MODES))


def test_the_dry_run_of_the_034_modes_starts_vllms_connector_as_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.34.0")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    model = tmp_path / "model"
    model.mkdir()
    args = gpu.build_parser().parse_args(
        ["--out", str(tmp_path / "run"), "--model", str(model), "--gpus", "0,0",
         "--input-lens", "2048", "--rates", "--concurrency", "16", "--floor-repeats", "0"]
    )  # fmt: skip
    cfg = gpu.make_config(args, "test")
    assert cfg.modes == MODES_034
    plan = gpu.dry_run(cfg)
    assert list(plan["engines"]) == MODES_034
    assert set(plan["engines"]["single-0.34"]) == {"single"}

    def kv_connector(mode: str, role: str) -> str:
        argv = plan["engines"][mode][role]["argv"]
        kv = argv[argv.index("--kv-transfer-config") + 1]
        return str(json.loads(kv)["kv_connector"])

    assert kv_connector("push-0.34", "prefill") == "ExtNixlPushConnector"
    assert kv_connector("vllm-push-0.34", "decode") == "NixlPushConnector"
    # P and D on GPU 0, both connectors
    for mode in ("push-0.34", "vllm-push-0.34"):
        for role in ("prefill", "decode"):
            assert plan["engines"][mode][role]["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    # vLLM's connector gets none of the settings the launcher gives ours
    assert "VLLM_USE_V2_MODEL_RUNNER" not in plan["engines"]["vllm-push-0.34"]["prefill"]["env"]


def test_the_push_proxy_of_vllms_connector_names_a_remote_request_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[Any] = []

    def base(prefill: Any, transfer_id: str, secret: str | None = None) -> dict[str, Any]:
        seen.append((prefill, transfer_id, secret))
        return {"do_remote_prefill": True}

    monkeypatch.setattr(vllm_push_proxy, "_push_decode_params", base)
    params = vllm_push_proxy.push_decode_params_with_remote_request_id(None, "t-1", "s")
    # vLLM 0.34.0's D reads kv_transfer_params["remote_request_id"] (KeyError without it)
    assert params == {"do_remote_prefill": True, "remote_request_id": "t-1"}
    assert seen == [(None, "t-1", "s")]


@pytest.mark.skipif(
    compat.installed_vllm_version() != "0.34.0", reason="vLLM 0.34.0's registry (run on that pin)"
)
def test_the_host_check_finds_ours_beside_vllms_own_push_connector() -> None:
    from devkit.bench import hostcheck

    ok, ours = hostcheck._registered()
    # vLLM 0.34.0 keeps its NixlPushConnector; ours is registered as ExtNixlPushConnector
    assert ours == {"NixlPushConnector": False, "ExtNixlPushConnector": True}
    assert ok
