# SPDX-License-Identifier: Apache-2.0
"""One in-process engine builder: vLLM's config, KV cache config and connector worker
ranks for the tiny model, over the fake NIXL fabric, with no model and no process.

The push integration harness (``tests/integration/push_harness.py``) and the scale
benchmark (:mod:`devkit.bench.scale_engines`) both build their engines here, and differ
only in what they do with them. What is real: ``VllmConfig``, ``KVCacheConfig``, the
connector (ours or vLLM's own push connector) in its worker role, registered KV
tensors. What is stood in for while a rank is built: NIXL (the fabric's
``NixlWrapper``), the tensor-parallel group (the rank is told its rank and size), and
on vLLM 0.32+ the attention backend's kernel block size (:func:`kernel_backend`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal
from unittest import mock

import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

from devkit.launch.process import free_port
from devkit.testing.fake_nixl import FakeNixlFabric, fake_nixl_wrapper_cls
from vllm_ext import compat_nixl

__all__ = [
    "DTYPE",
    "HEAD_SIZE",
    "LAYERS",
    "MAX_MODEL_LEN",
    "NUM_KV_HEADS",
    "NUM_LAYERS",
    "SAMPLED_TOKEN",
    "WORKER_MODULE",
    "EngineShape",
    "Role",
    "build_worker",
    "engine_env",
    "free_port",
    "kernel_backend",
    "kv_cache_config",
    "kv_cache_shape",
    "kv_cache_tensor",
    "stage_layers",
    "vllm_config",
    "wait_until",
]

Role = Literal["kv_producer", "kv_consumer"]
WORKER_MODULE = compat_nixl.WORKER_MODULE
#: The tiny model (devkit.testing.tiny_model): 4 layers, 2 KV heads of 64, bf16.
NUM_LAYERS = 4
NUM_KV_HEADS = 2
HEAD_SIZE = 64
DTYPE = torch.bfloat16
LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS))
#: The token a fake model runner samples (EOS is 1 for the tiny model).
SAMPLED_TOKEN = 7
MAX_MODEL_LEN = 1024


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """What an engine's config is made of (the rest is vLLM's defaults)."""

    engine_id: str
    role: Role
    #: the connector's name in ``kv_transfer_config`` (ours, or vLLM's push connector)
    connector: str
    tp: int = 1
    #: pipeline stages (a stage's ranks hold its layers, :func:`stage_layers`)
    pp: int = 1
    #: scheduler (logical) block size in tokens
    block_size: int = 16
    #: logical blocks in the KV cache
    num_blocks: int = 48
    max_num_batched_tokens: int = 4096
    max_num_seqs: int | None = None  # None: min(256, max_num_batched_tokens)
    #: the longest request (prompt and output) the engine accepts
    max_model_len: int = MAX_MODEL_LEN
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: more ``SchedulerConfig`` fields (e.g. ``long_prefill_token_threshold``)
    scheduler_extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def vllm_config(s: EngineShape, model_dir: Path) -> VllmConfig:
    """The engine's ``VllmConfig`` on the tiny model in ``model_dir``."""
    max_num_seqs = s.max_num_seqs or min(256, s.max_num_batched_tokens)
    cfg = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), dtype="bfloat16", max_model_len=s.max_model_len
        ),
        cache_config=CacheConfig(
            block_size=s.block_size, enable_prefix_caching=s.enable_prefix_caching
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=s.tp, pipeline_parallel_size=s.pp),
        scheduler_config=SchedulerConfig(
            max_model_len=s.max_model_len,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            async_scheduling=s.async_scheduling,
            is_encoder_decoder=False,
            **s.scheduler_extra,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector=s.connector,
            kv_role=s.role,
            kv_buffer_device="cpu",
            engine_id=s.engine_id,
            kv_connector_extra_config=dict(s.extra_config),
        ),
    )
    cfg.cache_config.num_gpu_blocks = s.num_blocks
    if hasattr(cfg.cache_config, "kv_cache_layout"):  # vLLM 0.32: the engine core's part
        cfg.cache_config.kv_cache_layout = "LBHNC"  # the CPU backend's only layout
    return cfg


#: Hybrid KV (``sliding_window``): the layers of each KV tensor, one of the
#: full-attention group (odd layers) and one of the sliding-window group (even layers).
HYBRID_SHARING = ((LAYERS[1], LAYERS[0]), (LAYERS[3], LAYERS[2]))


def kv_cache_tensor(num_blocks: int, page: int, layer: str, *shared: str) -> KVCacheTensor:
    """One layer's KV tensor in vLLM's ``KVCacheConfig`` (its fields changed in 0.32),
    with the layers of other KV cache groups that share it (vLLM 0.32 and later)."""
    fields = {f.name for f in dataclasses.fields(KVCacheTensor)}
    if "shared_by" in fields:
        return KVCacheTensor(size=num_blocks * page, shared_by=[layer, *shared])  # type: ignore[call-arg]
    assert not shared, "shared KV tensors need vLLM 0.32 or later"
    return KVCacheTensor(  # type: ignore[call-arg]
        size=num_blocks * page, layers=[layer], layer_stride=num_blocks * page, block_stride=page
    )


def stage_layers(stage: int, pp: int) -> tuple[str, ...]:
    """The layers of the tiny model that pipeline stage ``stage`` of ``pp`` holds
    (vLLM's own partition, ``get_pp_indices``)."""
    from vllm.distributed.utils import get_pp_indices

    start, end = get_pp_indices(NUM_LAYERS, stage, pp)
    return LAYERS[start:end]


def kv_cache_config(
    block_size: int,
    num_blocks: int,
    tp: int,
    sliding_window: int | None = None,
    layers: tuple[str, ...] = LAYERS,
) -> KVCacheConfig:
    """One full-attention group over ``layers`` (every layer of the tiny model, or a
    pipeline stage's), a tensor per layer; with ``sliding_window``, two groups (hybrid
    KV: full and sliding-window layers, those of :data:`HYBRID_SHARING` in ``layers``)."""
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=NUM_KV_HEADS // tp, head_size=HEAD_SIZE, dtype=DTYPE
    )
    n = num_blocks
    if sliding_window is not None:
        window = SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=NUM_KV_HEADS // tp,
            head_size=HEAD_SIZE,
            dtype=DTYPE,
            sliding_window=sliding_window,
        )
        pairs = [pair for pair in HYBRID_SHARING if set(pair) <= set(layers)]
        shared = "shared_by" in {f.name for f in dataclasses.fields(KVCacheTensor)}
        tensors = (
            [kv_cache_tensor(n, spec.page_size_bytes, *pair) for pair in pairs]
            if shared  # vLLM 0.23 (which refuses a hybrid D): one tensor per layer
            else [
                kv_cache_tensor(n, spec.page_size_bytes, layer) for pair in pairs for layer in pair
            ]
        )
        return KVCacheConfig(
            num_blocks=n,
            kv_cache_tensors=tensors,
            kv_cache_groups=[
                KVCacheGroupSpec([full for full, _ in pairs], spec),
                KVCacheGroupSpec([sw for _, sw in pairs], window),
            ],
        )
    return KVCacheConfig(
        num_blocks=n,
        kv_cache_tensors=[kv_cache_tensor(n, spec.page_size_bytes, lay) for lay in layers],
        kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)],
    )


def kernel_backend(kernel_block_size: int) -> type[CPUAttentionBackend]:
    """vLLM's CPU attention backend restricted to one kernel block size.

    The stock CPU backend takes any multiple of 16, so a larger logical block
    is never split; with this one the worker learns
    ``physical_blocks_per_logical = block_size // kernel_block_size`` as it
    would on a GPU backend with a fixed kernel block size.
    """

    class FixedKernelCPUBackend(CPUAttentionBackend):
        @staticmethod
        def get_supported_kernel_block_sizes(*_: Any) -> list[Any]:
            return [kernel_block_size]

    return FixedKernelCPUBackend


@contextlib.contextmanager
def engine_env(
    config: VllmConfig, side_channel_port: int, extra: dict[str, str] | None = None
) -> Iterator[None]:
    """What both connector halves read while they are built: the side channel from
    vLLM's envs, and the current vLLM config."""
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        **(extra or {}),
    }
    with mock.patch.dict(os.environ, env), set_current_vllm_config(config):
        yield


def build_scheduler(
    config: VllmConfig,
    kv_config: KVCacheConfig,
    block_size: int,
    *,
    async_scheduling: bool = False,
    log_stats: bool = True,
) -> Any:
    """vLLM's engine-core scheduler (``AsyncScheduler`` with ``async_scheduling``) for
    ``config``, which builds the connector's scheduler half. Call inside
    :func:`engine_env`."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        log_stats=log_stats,
    )


def build_worker(
    config: VllmConfig,
    kv_config: KVCacheConfig,
    fabric: FakeNixlFabric,
    rank: int,
    *,
    connector_cls: Callable[..., Any] | None = None,
    kernel_block_size: int | None = None,
) -> Any:
    """One TP rank's connector in its worker role, on ``fabric``: NIXL is the fabric's,
    the rank is told ``rank`` of the config's TP size. ``connector_cls``: the class the
    config names, from vLLM's connector factory, unless given. Call inside
    :func:`engine_env`."""
    tp = config.parallel_config.tensor_parallel_size
    patches: list[Any] = [
        mock.patch(f"{WORKER_MODULE}.NixlWrapper", fake_nixl_wrapper_cls(fabric)),
        mock.patch(f"{WORKER_MODULE}.get_tensor_model_parallel_rank", return_value=rank),
        mock.patch(f"{WORKER_MODULE}.get_tensor_model_parallel_world_size", return_value=tp),
    ]
    if kernel_block_size is not None or compat_nixl.SPLIT_NIXL:
        # (vLLM 0.32's CPU backend takes multiples of 32 only: pin the block size)
        backend = kernel_backend(kernel_block_size or config.cache_config.block_size)
        patches.append(
            mock.patch(f"{WORKER_MODULE}.get_current_attn_backends", return_value=[backend])
        )
    if connector_cls is None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        assert config.kv_transfer_config is not None
        connector_cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        return connector_cls(config, KVConnectorRole.WORKER, kv_config)


def kv_cache_shape(num_blocks: int, block_size: int, tp: int) -> tuple[int, ...]:
    """A layer's KV tensor as vLLM's CPU attention backend lays it out (with the
    kernel block size the worker learnt)."""
    heads = NUM_KV_HEADS // tp
    if hasattr(CPUAttentionBackend, "get_kv_cache_shape"):
        return tuple(
            CPUAttentionBackend.get_kv_cache_shape(num_blocks, block_size, heads, HEAD_SIZE)
        )
    # vLLM 0.32: per layer (blocks, heads, tokens, K then V), i.e. LBHNC
    return (num_blocks, heads, block_size, 2 * HEAD_SIZE)


def wait_until(
    cond: Callable[[], Any],
    timeout: float = 20.0,
    step: Callable[[], Any] | None = None,
    what: str = "",
) -> Any:
    """Run ``step`` (if any), then ``cond``, until ``cond`` is truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        if step is not None:
            step()
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout}s: {what or cond}")
        time.sleep(0.0005)
