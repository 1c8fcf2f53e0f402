# SPDX-License-Identifier: Apache-2.0
"""vLLM's NIXL connectors with the fixes our push connector applies to itself.

So the benchmark shows what push itself buys, pull runs once more with the same
settings our ``NixlPushConnectorWorker.__init__`` applies (``PushConfig`` keys in
``kv_connector_extra_config``, same defaults):

* ``nixl_progress_delay_us`` (100): NIXL's progress thread sleeps between polls
  instead of busy-polling a core (:func:`vllm_ext.compat.nixl_progress_delay`);
* ``ucx_use_mt_mutex`` (true): UCX guards its worker with a mutex, not a spinlock
  (:func:`vllm_ext.compat.ucx_mt_mutex`);
* ``keep_cpu_affinity`` (true): undo vLLM's re-pinning of the worker thread to the
  last core of each NUMA node, which puts P and D on one core on CPU hosts.

Loaded through ``kv_connector_module_path`` (no registered name)::

    {"kv_connector": "TunedNixlConnector",
     "kv_connector_module_path": "devkit.bench.tuned_pull", ...}

``TunedNixlPushConnector`` does the same for vLLM's own ``NixlPushConnector``
where the pin has one (0.24+).
"""

from __future__ import annotations

import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

from vllm_ext import compat
from vllm_ext.nixl_push.config import PushConfig


def _tuned_init(cls: type, self: Any, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
    """``super(cls, self).__init__`` with the NIXL agent tuned and the affinity kept."""
    kv = vllm_config.kv_transfer_config
    cfg = PushConfig.from_extra_config(kv.kv_connector_extra_config if kv else None)
    affinity = os.sched_getaffinity(0) if cfg.keep_cpu_affinity else None
    with compat.tuned_nixl_agents(cfg.nixl_progress_delay_us, cfg.ucx_use_mt_mutex):
        super(cls, self).__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
    if affinity is not None:
        os.sched_setaffinity(0, affinity)


class TunedNixlConnector(NixlConnector):
    """vLLM's pull ``NixlConnector`` + NIXL progress delay, UCX mutex, kept CPU affinity."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        _tuned_init(TunedNixlConnector, self, vllm_config, role, kv_cache_config)


try:  # vLLM's own push connector (0.24+)
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # type: ignore[attr-defined]
        NixlPushConnector as _VllmPush,
    )
except ImportError:  # pragma: no cover - pins without in-tree push
    _VllmPush = None

if _VllmPush is not None:

    class TunedNixlPushConnector(_VllmPush):  # type: ignore[misc,valid-type]
        """vLLM's own ``NixlPushConnector`` + the same settings."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            _tuned_init(TunedNixlPushConnector, self, vllm_config, role, kv_cache_config)
