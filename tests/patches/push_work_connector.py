# SPDX-License-Identifier: Apache-2.0
"""A KV connector that has push work in flight for a set number of engine steps.

Test helper for patch 0001 (``has_pending_push_work``), loaded by vLLM through
``kv_connector_module_path = "push_work_connector"`` (this directory must be on
``sys.path`` / ``PYTHONPATH`` of the process that creates the connector).

Scheduler side: when a request finishes whose ``kv_transfer_params`` carry
``{"push_steps": N}``, the connector reports pending push work for the next ``N``
engine steps (counted in ``build_connector_meta``, once per ``schedule()``);
``extra_config["initial_push_steps"]`` starts with pending work. Every scheduler step
and every worker-side ``get_finished`` call is appended as one JSON line to
``extra_config["report"]`` (if set), so a test can watch a real engine loop.
"""

from __future__ import annotations

import json
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)


class PushWorkConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._report: str | None = extra.get("report")
        self.pending_steps = int(extra.get("initial_push_steps", 0))

    def _log(self, event: str, **fields: Any) -> None:
        if self._report:
            with open(self._report, "a") as f:
                f.write(json.dumps({"event": event, "t": time.monotonic(), **fields}) + "\n")

    # -- scheduler side --------------------------------------------------------
    def has_pending_push_work(self) -> bool:
        return self.pending_steps > 0

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        params = request.kv_transfer_params or {}
        self.pending_steps += int(params.get("push_steps", 0))
        return False, None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._log(
            "schedule",
            tokens=scheduler_output.total_num_scheduled_tokens,
            pending=self.pending_steps,
        )
        if self.pending_steps > 0:
            self.pending_steps -= 1
        return KVConnectorMetadata()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        return None

    # -- worker side -----------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, None]:
        self._log("worker")
        return None, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any):
        return None

    def wait_for_save(self) -> None:
        return None
