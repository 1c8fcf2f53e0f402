# SPDX-License-Identifier: Apache-2.0
"""The argv and environment the launcher gives engines on GPUs (and that CPU ones keep)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devkit.launch.engine import INDUCTOR_VEC_ISA_OK_ENV, EngineSpec
from devkit.launch.gpu import GPU_ENV, GpuOptions
from devkit.launch.pd import DEFAULT_CONNECTOR, PDConfig, PDDeployment

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
}


def _opt(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _specs(cfg: PDConfig) -> dict[str, EngineSpec]:
    """The engine specs a deployment would start (nothing is started)."""
    dep = PDDeployment(cfg)
    if cfg.mode == "single":
        return {"single": dep._spec("single", None, cfg.d_cpu)}
    out = {}
    for name, role, cpu in (
        ("prefill", "kv_producer", cfg.p_cpu),
        ("decode", "kv_consumer", cfg.d_cpu),
    ):
        connector = cfg.connector or DEFAULT_CONNECTOR[cfg.mode]
        out[name] = dep._spec(name, dep._kv(connector, role, name), cpu)
    return out


def test_gpu_env_constant() -> None:
    assert GPU_ENV == NO_MULTICAST


def test_cpu_engine_is_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = EngineSpec("prefill", "/m", port=8100, cpu=0)
    argv = spec.argv()
    assert "--enforce-eager" in argv
    for gpu_only in ("--gpu-memory-utilization", "--load-format", "--tensor-parallel-size"):
        assert gpu_only not in argv
    env = spec.env(tmp_path)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env[INDUCTOR_VEC_ISA_OK_ENV] == "1"  # the sampler's compile skips the ISA proofs
    assert "CUDA_VISIBLE_DEVICES" not in env and "NCCL_NVLS_ENABLE" not in env
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache-prefill")
    # the deployment: taskset on P's core, kv buffer on CPU
    specs = _specs(PDConfig(mode="push", model="/m", run_dir=tmp_path))
    kv = json.loads(_opt(specs["prefill"].argv(), "--kv-transfer-config") or "{}")
    assert kv["kv_buffer_device"] == "cpu"
    assert specs["prefill"].device == "cpu" and specs["decode"].cpu == 1


def test_gpu_pair_one_gpu_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # inherited: must not reach a GPU engine
    monkeypatch.delenv(INDUCTOR_VEC_ISA_OK_ENV, raising=False)
    gpu = GpuOptions(memory_utilization=0.85, load_format="dummy", cache_root=tmp_path / "cc")
    cfg = PDConfig(
        mode="push", model="/m", run_dir=tmp_path, max_model_len=20000,
        enable_prefix_caching=False, gpu=gpu,
    )  # fmt: skip
    specs = _specs(cfg)
    for name, devices in (("prefill", "0"), ("decode", "1")):
        spec = specs[name]
        argv, env = spec.argv(), spec.env(tmp_path)
        assert spec.wrapper == [] and spec.cpu is None and spec.device == "cuda"
        assert _opt(argv, "--gpu-memory-utilization") == "0.85"
        assert _opt(argv, "--load-format") == "dummy"
        assert _opt(argv, "--max-model-len") == "20000"
        assert "--no-enable-prefix-caching" in argv
        assert "--enforce-eager" not in argv  # the benchmark compiles by default
        assert "--tensor-parallel-size" not in argv and "--kv-cache-memory-bytes" not in argv
        kv = json.loads(_opt(argv, "--kv-transfer-config") or "{}")
        assert kv["kv_buffer_device"] == "cuda"
        assert env["CUDA_VISIBLE_DEVICES"] == devices
        assert {k: env[k] for k in NO_MULTICAST} == NO_MULTICAST
        assert not [k for k in env if k.startswith("VLLM_CPU_")]
        assert INDUCTOR_VEC_ISA_OK_ENV not in env  # a CPU engine's only
        assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cc" / f"gpu{devices}")
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(spec.side_channel_port)


def test_gpu_single_on_gpu0_eager(tmp_path: Path) -> None:
    gpu = GpuOptions(enforce_eager=True)
    (spec,) = _specs(PDConfig(mode="single", model="/m", run_dir=tmp_path, gpu=gpu)).values()
    assert spec.env(tmp_path)["CUDA_VISIBLE_DEVICES"] == "0"
    assert "--enforce-eager" in spec.argv() and "--kv-transfer-config" not in spec.argv()
    assert spec.env(tmp_path)["VLLM_CACHE_ROOT"] == str(tmp_path / "cache-single")


def test_gpu_prefill_chunk_is_set_on_the_engines_that_prefill(tmp_path: Path) -> None:
    gpu = GpuOptions(p_devices="0", d_devices="0", max_num_batched_tokens=2048)
    specs = _specs(PDConfig(mode="push", model="/m", run_dir=tmp_path, gpu=gpu))
    assert _opt(specs["prefill"].argv(), "--max-num-batched-tokens") == "2048"
    assert "--max-num-batched-tokens" not in specs["decode"].argv()  # D decodes only
    (single,) = _specs(PDConfig(mode="single", model="/m", run_dir=tmp_path, gpu=gpu)).values()
    assert _opt(single.argv(), "--max-num-batched-tokens") == "2048"
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        GpuOptions(max_num_batched_tokens=0)


def test_gpu_tp2_prefill_shares_gpu1_with_decode(tmp_path: Path) -> None:
    gpu = GpuOptions(
        p_devices="0,1", d_devices="1", p_tp_size=2, p_memory_utilization=0.3,
        d_memory_utilization=0.3, kv_cache_memory_bytes=2 << 30, enforce_eager=True,
    )  # fmt: skip
    specs = _specs(PDConfig(mode="push", model="/m", run_dir=tmp_path, gpu=gpu))
    p, d = specs["prefill"], specs["decode"]
    pa, da = p.argv(), d.argv()
    assert _opt(pa, "--tensor-parallel-size") == "2"
    assert _opt(pa, "--distributed-executor-backend") == "mp"
    assert "--tensor-parallel-size" not in da
    assert _opt(pa, "--gpu-memory-utilization") == _opt(da, "--gpu-memory-utilization") == "0.3"
    assert _opt(pa, "--kv-cache-memory-bytes") == str(2 << 30)
    assert p.env(tmp_path)["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert d.env(tmp_path)["CUDA_VISIBLE_DEVICES"] == "1"


def test_gpu_tp2_proxy_is_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy's push D leg carries P's tp_size: --p-tp-size reaches it."""
    started: list[list[str]] = []

    class FakeProcess:
        def __init__(self, name: str, argv: list[str], *a: object, **k: object) -> None:
            started.append(list(argv))
            self.argv = list(argv)

    import devkit.launch.engine as engine_mod
    import devkit.launch.pd as pd_mod

    monkeypatch.setattr(pd_mod, "ManagedProcess", FakeProcess)
    monkeypatch.setattr(engine_mod, "ManagedProcess", FakeProcess)
    gpu = GpuOptions(p_devices="0,1", p_tp_size=2)
    PDDeployment(PDConfig(mode="push", model="/m", run_dir=tmp_path, gpu=gpu)).start()
    proxy = next(a for a in started if "vllm_ext.proxy" in a)
    assert _opt(proxy, "--p-tp-size") == "2"
    started.clear()
    PDDeployment(PDConfig(mode="push", model="/m", run_dir=tmp_path)).start()
    proxy = next(a for a in started if "vllm_ext.proxy" in a)
    assert "--p-tp-size" not in proxy  # CPU argv unchanged


def test_gpu_options_validation() -> None:
    with pytest.raises(ValueError, match="2 GPU"):
        GpuOptions(p_devices="0,1", p_tp_size=1)
    with pytest.raises(ValueError, match="utilization"):
        GpuOptions(memory_utilization=1.5)
    assert GpuOptions().start_timeout_s >= 600


def test_push_on_gpu_runs_vllm_v1_model_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's V2 model runner never lays the KV out cross-layer (seen on an H200:
    36 descriptors per block at 16k tokens); a push engine on a GPU gets V1."""
    from devkit.launch.gpu import cross_layer_env

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    push = {"kv_connector": "NixlPushConnector", "kv_connector_extra_config": {}}
    assert cross_layer_env(push) == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    off = {**push, "kv_connector_extra_config": {"enable_cross_layers_blocks": "false"}}
    assert cross_layer_env(off) == {}
    assert cross_layer_env({"kv_connector": "NixlConnector"}) == {}
    assert cross_layer_env(None) == {}
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # the caller's choice wins
    assert cross_layer_env(push) == {}


def test_push_on_a_vllm_without_the_cross_layer_layout_names_no_runner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.32 and later allocate per-layer KV only, and vLLM 0.34.0 has no V1 model
    runner: it refuses ``VLLM_USE_V2_MODEL_RUNNER=0`` at startup (on an H100 every push
    engine of the 0.34.0 bench died so). Such a vLLM is one whose connector base has no
    ``register_cross_layers_kv_cache``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from devkit.launch.gpu import cross_layer_env

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.delattr(KVConnectorBase_V1, "register_cross_layers_kv_cache", raising=False)
    push = {"kv_connector": "ExtNixlPushConnector", "kv_connector_extra_config": {}}
    assert cross_layer_env(push) == {}


def test_push_deployment_on_gpu_sets_the_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    gpu = GpuOptions(p_devices="0", d_devices="1", enforce_eager=True)
    for mode, want in (("push", "0"), ("pull", None)):
        specs = _specs(PDConfig(mode=mode, model="/m", run_dir=tmp_path, gpu=gpu))
        for spec in specs.values():
            assert spec.env(tmp_path).get("VLLM_USE_V2_MODEL_RUNNER") == want, (mode, spec.name)


@pytest.mark.parametrize(
    ("gpu", "waits"),
    [
        (GpuOptions(p_devices="0", d_devices="0"), True),  # shared, D profiles memory
        (GpuOptions(p_devices="0", d_devices="0", kv_cache_memory_bytes=36 << 30), False),
        (GpuOptions(p_devices="0", d_devices="1"), False),
    ],
)
def test_d_waits_for_p_only_where_its_memory_profiling_would_see_p(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu: GpuOptions, waits: bool
) -> None:
    """On one GPU D starts after P is ready unless the KV cache size is fixed (vLLM then
    skips the profiling that would count P's allocations as D's): then both start at once."""
    events: list[str] = []

    class FakeProcess:
        def __init__(self, name: str, argv: list[str], *a: object, **k: object) -> None:
            events.append(f"start {name}")
            self.argv = list(argv)

    import devkit.launch.engine as engine_mod
    import devkit.launch.pd as pd_mod

    monkeypatch.setattr(pd_mod, "ManagedProcess", FakeProcess)
    monkeypatch.setattr(engine_mod, "ManagedProcess", FakeProcess)
    monkeypatch.setattr(
        PDDeployment, "wait_engines",
        lambda self, engines, *a: events.extend(f"wait {e.spec.name}" for e in engines),
    )  # fmt: skip
    PDDeployment(PDConfig(mode="push", model="/m", run_dir=tmp_path, gpu=gpu)).start()
    starts = [e for e in events if e.startswith("start") and e != "start proxy"]
    assert starts == ["start prefill", "start decode"]
    assert ("wait prefill" in events) is waits
    if waits:
        assert events.index("wait prefill") < events.index("start decode")
