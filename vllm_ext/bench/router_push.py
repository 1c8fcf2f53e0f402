# SPDX-License-Identifier: Apache-2.0
"""Push behind a router that runs the legs one after the other (``vllm-router``).

``vllm-router --vllm-pd-disaggregation`` (kv connector ``nixl``) sends the P leg,
waits for P's answer, and sends the D leg with the ``kv_transfer_params`` P
answered, verbatim. Our P answers what vLLM's ``NixlConnector`` answers (pull
params: ``remote_block_ids``, ``remote_request_id``, ...), so D takes the pull
path and READs the KV: correct, but not push.

``RouterPushConnector`` is our connector with one change on P: a finished P leg
answers the D-leg params of push (SPEC S-LEG-1: ``do_remote_prefill``,
``remote_engine_id``, ``remote_host``, ``remote_port``, ``tp_size``, ``pp_size``;
no ``remote_block_ids``). The router hands those to D unchanged, D registers its
blocks with P (``PUSH_REG``) after P finished, and P, which holds the blocks
under its lease, WRITEs at once. That is push with sequential legs: the two legs
no longer overlap. This module is the experiment behind docs/xpyd.md (the
connector itself is unchanged); the same answer could become a connector option.

Loaded through ``kv_connector_module_path`` on P::

    {"kv_connector": "RouterPushConnector",
     "kv_connector_module_path": "vllm_ext.bench.router_push", "kv_role": "kv_producer", ...}
"""

from __future__ import annotations

from typing import Any

from vllm_ext.nixl_push.connector import NixlPushConnector


def push_answer(params: dict[str, Any] | None, pp_size: int) -> dict[str, Any] | None:
    """vLLM's pull answer of a finished P leg turned into push's D-leg params."""
    if not params or not params.get("do_remote_prefill") or "remote_block_ids" not in params:
        return params
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": params["remote_engine_id"],
        "remote_host": params["remote_host"],
        "remote_port": params["remote_port"],
        "tp_size": params["tp_size"],
        "pp_size": pp_size,
    }


class RouterPushConnector(NixlPushConnector):
    """Our push connector whose P answers push D-leg params (see the module docstring)."""

    def _answer(self, finished: tuple[bool, dict[str, Any] | None]) -> tuple[bool, Any]:
        delay, params = finished
        pp = self._vllm_config.parallel_config.pipeline_parallel_size
        return delay, push_answer(params, pp)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._answer(super().request_finished(request, block_ids))

    def request_finished_all_groups(
        self, request: Any, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._answer(super().request_finished_all_groups(request, block_ids))
