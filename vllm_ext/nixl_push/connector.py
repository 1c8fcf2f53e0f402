# SPDX-License-Identifier: Apache-2.0
"""NixlPushConnector: thin facade over the push scheduler and the push worker."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector


class NixlPushConnector(NixlConnector):
    """Push-mode NIXL connector (shell; the push scheduler/worker come with issue 4)."""
