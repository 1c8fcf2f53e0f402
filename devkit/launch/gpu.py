# SPDX-License-Identifier: Apache-2.0
"""Engines on NVIDIA GPUs: which GPUs each engine sees, memory, load format.

A P/D deployment runs on GPUs when its :class:`~devkit.launch.pd.PDConfig` has
``gpu=GpuOptions(...)``: P on GPU 0, D on GPU 1 and a single engine on GPU 0 by
default (``CUDA_VISIBLE_DEVICES`` per engine), no CPU binding (no ``taskset``, no
``VLLM_CPU_*``), ``kv_buffer_device: "cuda"``, and :data:`GPU_ENV` in every engine's
environment. Without ``gpu`` nothing changes (the CPU defaults).

A P with tensor parallelism spans several GPUs (``p_tp_size=2, p_devices="0,1"``)
and may share one with D (``d_devices="1"``): give each engine its share of GPU
memory (``p_memory_utilization``/``d_memory_utilization``, fractions of the whole
GPU that vLLM checks are free when the engine starts) and, for engines that share a
GPU and start at the same time, a fixed ``kv_cache_memory_bytes`` (vLLM then skips
its memory profiling, which measures the whole GPU and so would count the other
engine's allocations as its own).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

#: Set in every process started on the GPU hosts: NVLink multicast (NVLS) off
#: everywhere (see shared/GPU.md), FlashInfer's sampler off (FlashInfer is not installed).
GPU_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
}
#: Variables of vLLM's CPU backend that a GPU engine must not inherit.
CPU_ONLY_ENV = (
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
)
#: Seconds a GPU engine may take to answer /health: the first start of a model
#: compiles it (torch.compile + CUDA graphs; 54-100 s measured for Qwen3-8B shapes).
GPU_ENGINE_START_TIMEOUT_S = 900.0

Role = str  # "prefill" | "decode" | "single"


@dataclasses.dataclass
class GpuOptions:
    """Where and how each engine of a deployment runs on the GPUs."""

    #: ``CUDA_VISIBLE_DEVICES`` of P, D and the single engine
    p_devices: str = "0"
    d_devices: str = "1"
    single_devices: str = "0"
    #: fraction of each GPU an engine may use (per engine: the ``p_``/``d_`` ones win)
    memory_utilization: float = 0.85
    p_memory_utilization: float | None = None
    d_memory_utilization: float | None = None
    #: a fixed KV cache size per GPU (bytes); None: vLLM sizes it from the utilization
    kv_cache_memory_bytes: int | None = None
    #: e.g. ``"dummy"``: random weights from the config alone (no checkpoint needed)
    load_format: str | None = None
    #: ``--enforce-eager``: no torch.compile, no CUDA graphs (fast start, slower decode)
    enforce_eager: bool = False
    #: ``--async-scheduling`` on every engine: each step is scheduled before the previous
    #: step's output is processed (what exposes P's preemption of announced requests)
    async_scheduling: bool = False
    #: P's tensor parallelism (``--tensor-parallel-size``; its GPUs in ``p_devices``)
    p_tp_size: int = 1
    #: ``--max-num-batched-tokens`` of the engines that prefill (P, the single engine):
    #: their prefill chunk; None: vLLM's default (8192 on an H200). D keeps its default.
    max_num_batched_tokens: int | None = None
    start_timeout_s: float = GPU_ENGINE_START_TIMEOUT_S
    #: ``VLLM_CACHE_ROOT`` shared by every engine on the same GPUs (the compile cache of
    #: one deployment serves the next); None: per engine under the run folder
    cache_root: Path | None = None

    def __post_init__(self) -> None:
        if self.p_tp_size < 1:
            raise ValueError("p_tp_size must be >= 1")
        n = len(self.p_devices.split(","))
        if n != self.p_tp_size:
            raise ValueError(
                f"P has tensor parallelism {self.p_tp_size} but {n} GPU(s): {self.p_devices!r}"
            )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens {self.max_num_batched_tokens} is not >= 1")
        for frac in (self.memory_utilization, self.p_memory_utilization, self.d_memory_utilization):
            if frac is not None and not 0 < frac <= 1:
                raise ValueError(f"GPU memory utilization {frac} is not in (0, 1]")

    def devices(self, role: Role) -> str:
        return {"prefill": self.p_devices, "decode": self.d_devices}.get(role, self.single_devices)

    def utilization(self, role: Role) -> float:
        own = {"prefill": self.p_memory_utilization, "decode": self.d_memory_utilization}
        value = own.get(role)
        return self.memory_utilization if value is None else value

    def tp_size(self, role: Role) -> int:
        return self.p_tp_size if role == "prefill" else 1

    def args(self, role: Role) -> list[str]:
        """Server arguments of the engine playing ``role``."""
        out = ["--gpu-memory-utilization", f"{self.utilization(role):g}"]
        if self.kv_cache_memory_bytes:
            out += ["--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes)]
        if self.load_format:
            out += ["--load-format", self.load_format]
        if self.max_num_batched_tokens and role != "decode":
            out += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        tp = self.tp_size(role)
        if tp > 1:
            out += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
        if self.async_scheduling:
            out.append("--async-scheduling")
        return out

    def cache_dir(self, role: Role) -> Path | None:
        """The shared compile cache of the engine's GPUs (same GPUs, same model: same
        graphs; vLLM keys the cache by config, and the KV transfer config is not part of
        that key, so P of one mode reuses P of the previous one)."""
        if self.cache_root is None:
            return None
        return self.cache_root / ("gpu" + self.devices(role).replace(",", "-"))


def gpu_env(devices: str) -> dict[str, str]:
    """The environment every GPU engine gets on top of the launcher's."""
    return {**GPU_ENV, "CUDA_VISIBLE_DEVICES": devices}


def cross_layer_env(kv: dict[str, Any] | None) -> dict[str, str]:
    """Environment a GPU engine with this ``--kv-transfer-config`` needs for vLLM to lay
    its KV cache out cross-layer (one descriptor per block run instead of one per layer
    and run): the V1 model runner (compat.V1_RUNNER_ENV), unless the caller's
    environment chooses a runner itself. Empty for other connectors and on a vLLM
    without that layout (0.32 and later; 0.34 refuses the variable)."""
    from vllm_ext import EXT_CONNECTOR_NAME, PUSH_CONNECTOR_NAME
    from vllm_ext.compat import V1_RUNNER_ENV, has_cross_layer_layout
    from vllm_ext.nixl_push.config import PushConfig

    if not kv or kv.get("kv_connector") not in (PUSH_CONNECTOR_NAME, EXT_CONNECTOR_NAME):
        return {}
    extra = kv.get("kv_connector_extra_config") or {}
    if not PushConfig.from_extra_config(extra, "cuda").cross_layer_blocks:
        return {}
    if not has_cross_layer_layout():
        return {}
    key, value = V1_RUNNER_ENV
    return {} if key in os.environ else {key: value}
