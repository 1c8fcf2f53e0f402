# SPDX-License-Identifier: Apache-2.0
"""Our proxy, with the one D-leg field vLLM's own push connector requires (0.26.0 to 0.34.0).

vLLM 0.32.0's and 0.34.0's ``NixlPushConnector`` read ``kv_transfer_params["remote_request_id"]``
on D (``NixlConnectorMetadata.add_new_req_to_recv``); without it D's engine core
dies with ``KeyError: 'remote_request_id'`` on the first request. Our proxy's push
D leg (``vllm_ext.proxy.bodies.push_decode_params``) does not send it: the field names
P's request id, which D uses only for lease heartbeats ("HB:<P request ids>"), and
with concurrent legs no one knows P's (suffixed) request id yet. Here the transfer
id stands in: a heartbeat naming an unknown id is ignored by P, and these requests
finish long before P's 30 s lease.

vLLM 0.34.0 also reads ``remote_registration_generation`` there, optional (0 when
absent, which matches a D that registered its KV once).

Used by the benchmark for the ``vllm-push-*`` modes only; same CLI as
``python -m vllm_ext.proxy``.
"""

from __future__ import annotations

from typing import Any

from vllm_ext.proxy import bodies

_push_decode_params = bodies.push_decode_params


def push_decode_params_with_remote_request_id(
    prefill: Any, transfer_id: str, secret: str | None = None
) -> dict[str, Any]:
    params = _push_decode_params(prefill, transfer_id, secret)
    params.setdefault("remote_request_id", transfer_id)
    return params


def main() -> int:
    bodies.push_decode_params = push_decode_params_with_remote_request_id  # type: ignore[assignment]
    from vllm_ext.proxy.cli import main as proxy_main

    return int(proxy_main() or 0)


if __name__ == "__main__":
    raise SystemExit(main())
