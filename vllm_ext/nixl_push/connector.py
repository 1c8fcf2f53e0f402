# SPDX-License-Identifier: Apache-2.0
"""Our push connector: a thin facade over the push scheduler and the push worker.

Registered by :func:`vllm_ext.register` as ``ExtNixlPushConnector`` (the name to
use) and, where vLLM has no push connector of its own, ``NixlPushConnector``.
Everything not push-specific is inherited from vLLM's ``NixlConnector``, which forwards to
``self.connector_scheduler`` / ``self.connector_worker``; this class only
builds the push variants of those two and adds the push hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from vllm_ext import compat, compat_nixl
from vllm_ext.compat_nixl import ConnectorBase
from vllm_ext.log import get_logger
from vllm_ext.nixl_push.config import PushConfig, check_side_channel_host, check_write_timeout
from vllm_ext.nixl_push.metadata import PushConnectorMetadata, PushWorkerMeta
from vllm_ext.nixl_push.scheduler import NixlPushConnectorScheduler
from vllm_ext.nixl_push.stats import PushKVConnectorStats, PushPromMetrics
from vllm_ext.nixl_push.worker import NixlPushConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig


logger = get_logger(__name__)


def check_parallel_support(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse, at startup, what push cannot do with pipeline parallelism (S-PP-3)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp <= 1:
        return
    kv = vllm_config.kv_transfer_config
    assert kv is not None
    if kv.is_kv_consumer:
        raise ValueError(
            f"NixlPushConnector: kv_role={kv.kv_role!r} with pipeline_parallel_size={pp} is "
            "not supported: decode-side pipeline parallelism is not implemented (a producer "
            "counts one completion per consumer rank). Run the decode engine with "
            "pipeline_parallel_size=1 (use tensor parallelism instead); prefill engines "
            "(kv_role='kv_producer') may use pipeline parallelism."
        )
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    has_mamba = any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups)
    if has_mamba or getattr(vllm_config.model_config, "is_hybrid", False):
        raise ValueError(
            f"NixlPushConnector: {vllm_config.model_config.model} is a Mamba/SSM hybrid "
            f"model; push mode does not support it with pipeline_parallel_size={pp}. Run the "
            "prefill engine with pipeline_parallel_size=1."
        )


def check_hybrid_support(vllm_config: Any, kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse, at startup, KV cache groups push cannot carry (S-HYB-1).

    Full attention and sliding windows, in any number of KV cache groups under vLLM's
    hybrid KV cache manager, are paired group by group. Refused:

    * any group of another kind (Mamba/SSM state, chunked local attention): every role;
    * a decode engine with several groups or a sliding window on vLLM 0.23, where a
      failed push can be reported only as invalid block ids of one group (vLLM's NIXL
      worker skips that for hybrid KV), so D would decode KV that was never written.
      0.32 and later report a failed load per request (``compat_nixl.HYBRID_RECV``)."""
    other = compat.unpushable_groups(kv_cache_config)
    if other:
        raise ValueError(
            f"NixlPushConnector: {vllm_config.model_config.model} has KV cache groups of "
            f"kind {', '.join(other)}, which push mode cannot write (it writes full-attention "
            "and sliding-window blocks, group by group). Serve this model with vLLM's "
            "pull-mode NixlConnector, or on one engine."
        )
    kv = vllm_config.kv_transfer_config
    if kv is None or not kv.is_kv_consumer or compat_nixl.HYBRID_RECV:
        return
    if getattr(vllm_config.scheduler_config, "disable_hybrid_kv_cache_manager", False):
        return
    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    if len(groups) > 1 or compat.has_sliding_groups(kv_cache_config):
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise ValueError(
            f"NixlPushConnector: {vllm_config.model_config.model} mixes attention kinds "
            f"({', '.join(kinds)}) under vLLM's hybrid KV cache manager; on this vLLM "
            "release a failed KV load cannot be reported for it (vLLM marks no block "
            f"invalid), so a decode engine (kv_role={kv.kv_role!r}) would answer from KV "
            "that was never written. Use vLLM 0.32 or later, or start it with "
            "--disable-hybrid-kv-cache-manager."
        )


class NixlPushConnector(ConnectorBase):  # type: ignore[misc]
    """Push-mode NIXL connector: P WRITEs KV into D's blocks as soon as prefill ends."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        kv = vllm_config.kv_transfer_config
        if kv is None or kv.engine_id is None:
            raise ValueError("NixlPushConnector needs a --kv-transfer-config with an engine_id")
        check_parallel_support(vllm_config, kv_cache_config)
        check_hybrid_support(vllm_config, kv_cache_config)
        device = compat.engine_device_type(vllm_config)
        push_config = PushConfig.from_extra_config(kv.kv_connector_extra_config, device)
        if kv.is_kv_producer:  # N-REL-2: P gives a WRITE up before its failure's hold ends
            check_write_timeout(
                push_config,
                compat.effective_tcp_user_timeout_s(push_config.ucx_tcp_user_timeout_s),
                compat.tcp_user_timeout_source(),
            )
        side_channel = check_side_channel_host(envs.VLLM_NIXL_SIDE_CHANNEL_HOST)
        if side_channel is not None and role == KVConnectorRole.SCHEDULER:
            logger.warning("push: %s", side_channel)  # once per engine, not per rank
        if push_config.cross_layer_blocks:
            # vLLM reads its own key (prefer_cross_layer_blocks) when it allocates the
            # KV cache; our device default sets it where the user did not.
            kv.kv_connector_extra_config.setdefault("enable_cross_layers_blocks", True)
        # NixlConnector.__init__ would build the pull halves; set its fields directly.
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        self.kv_cache_config = kv_cache_config
        self.engine_id = kv.engine_id
        self.kv_transfer_config = kv
        self.push_config = push_config
        self.connector_scheduler: NixlPushConnectorScheduler | None = None  # type: ignore[assignment]
        self.connector_worker: NixlPushConnectorWorker | None = None  # type: ignore[assignment]
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPushConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config, push_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = NixlPushConnectorWorker(
                vllm_config, self.engine_id, kv_cache_config, push_config
            )

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Worker side, per-layer KV tensors (vLLM calls ``register_cross_layers_kv_cache``
        instead when it laid all layers of a block out together)."""
        if self.push_config.cross_layer_blocks:
            logger.warning(
                "push: enable_cross_layers_blocks is set but vLLM kept %d per-layer KV "
                "tensors (%s): each WRITE takes one descriptor per layer and block run",
                len(kv_caches), compat.cross_layer_refusal(self),
            )  # fmt: skip
        super().register_kv_caches(kv_caches)

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        """vLLM 0.23 only (``compat_nixl.CROSS_LAYER_KV``): vLLM 0.32 and 0.34 have no
        cross-layer KV layout and never call it."""
        logger.info(
            "push: cross-layer KV blocks: one tensor %s (%s), one descriptor per block run",
            tuple(kv_cache.shape), attn_backend.get_name(),
        )  # fmt: skip
        super().register_cross_layers_kv_cache(kv_cache, attn_backend)

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Scheduler side: serve the handshake metadata of every PP stage and TP rank."""
        assert self.connector_scheduler is not None
        self.connector_scheduler.set_xfer_handshake_metadata_pp_aware(metadata)

    def has_pending_block_frees(self) -> bool:
        """vLLM 0.32 asks before it preempts a request (0.23 never asks)."""
        if self.connector_scheduler is None:
            return False
        return self.connector_scheduler.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        """Scheduler side (patch 0001): keep the engine stepping while pushes are in flight."""
        if self.connector_scheduler is None:
            return False
        return self.connector_scheduler.has_pending_push_work()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        assert isinstance(self._connector_metadata, PushConnectorMetadata)
        self.connector_worker.start_load_kv(self._connector_metadata)

    def wait_for_save(self) -> None:
        super().wait_for_save()
        assert self.connector_worker is not None
        self.connector_worker.wait_for_save()

    def build_connector_worker_meta(self) -> PushWorkerMeta | None:  # type: ignore[override]
        """Worker side: what the scheduler half learns from this step (renewed watchdogs)."""
        if self.connector_worker is None:
            return None
        return self.connector_worker.build_connector_worker_meta()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PushKVConnectorStats:
        return PushKVConnectorStats(data=data) if data is not None else PushKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):  # type: ignore[no-untyped-def]
        return PushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
