# SPDX-License-Identifier: Apache-2.0
"""The bodies of the P and D legs, built from the client's body (pure functions).

Field names follow vLLM's NIXL connectors (SPEC S-LEG-1), so the same legs can
drive vLLM's own connectors as well as ours.

A leg's body is a shallow copy of the client's: its own top-level dict and its own
``kv_transfer_params``, the client's nested values (``messages``, ``prompt`` lists,
tools...) shared, since nothing changes them between parsing and sending. Copying
them deeply cost up to a tenth of a millisecond per request for a long chat.

The push D leg is not serialized again at all where it need not be
(:func:`with_fields`): it is the client's body as it came, bytes for bytes, with
``kv_transfer_params`` added before its closing brace.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import secrets
import uuid
from collections.abc import Mapping
from typing import Any

from vllm_ext.proxy.config import PrefillCoordinates

Body = dict[str, Any]

#: Fields that only make sense for the full generation, dropped from the P leg.
_PREFILL_DROPPED = ("stream_options", "min_tokens")


def new_request_id() -> str:
    """A request id for a client that sent none (vLLM's completion id style)."""
    return f"cmpl-{uuid.uuid4().hex}"


def new_transfer_id() -> str:
    """A transfer id shared by the two legs of one request."""
    return uuid.uuid4().hex


#: This proxy process's key for transfer secrets; never leaves the process.
_SECRET_KEY = secrets.token_bytes(32)


def transfer_secret(transfer_id: str) -> str:
    """The secret both legs of a push transfer carry (S-LEG-3): P serves only a
    registration that brings it back, so no other NIXL agent can register under
    this transfer. Derived from the transfer id with this process's random key:
    unguessable without seeing a leg."""
    return hmac.new(_SECRET_KEY, transfer_id.encode(), hashlib.sha256).hexdigest()[:32]


def _prefill_only(client_body: Body) -> Body:
    """The client body turned into a one-token, non-streaming prefill request."""
    body = dict(client_body)
    for name in _PREFILL_DROPPED:
        body.pop(name, None)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    return body


def push_prefill_body(client_body: Body, transfer_id: str, secret: str | None = None) -> Body:
    """P leg of push mode: prefill only, then P pushes the KV to D (``secret``:
    :func:`transfer_secret` of ``transfer_id``, computed here when not given)."""
    body = _prefill_only(client_body)
    body["kv_transfer_params"] = {
        "do_remote_decode": True,
        "transfer_id": transfer_id,
        "transfer_secret": secret or transfer_secret(transfer_id),
    }
    return body


def push_decode_params(
    prefill: PrefillCoordinates, transfer_id: str, secret: str | None = None
) -> dict[str, Any]:
    """The ``kv_transfer_params`` of the push D leg: P's coordinates and the transfer."""
    return {
        "do_remote_prefill": True,
        "remote_engine_id": prefill.engine_id,
        "remote_host": prefill.host,
        "remote_port": prefill.side_channel_port,
        "tp_size": prefill.tp_size,
        "pp_size": prefill.pp_size,
        "transfer_id": transfer_id,
        "transfer_secret": secret or transfer_secret(transfer_id),
    }


def push_decode_body(client_body: Body, prefill: PrefillCoordinates, transfer_id: str) -> Body:
    """D leg of push mode: the client's request plus P's coordinates."""
    body = dict(client_body)
    body["kv_transfer_params"] = push_decode_params(prefill, transfer_id)
    return body


def with_fields(raw: bytes, client_body: Body, fields: Body) -> bytes:
    """The JSON bytes of ``client_body`` with ``fields`` set, ``raw`` being the bytes
    ``client_body`` was parsed from (a UTF-8 JSON object).

    When none of ``fields`` is in the client's body, that is ``raw`` itself with the
    fields added before its closing brace: the client's values, a long prompt or
    chat above all, are not serialized again. Otherwise (or for bytes that do not
    end in the object's brace, e.g. UTF-16) the body is serialized in full.
    """
    head = raw.strip()  # the same object when there is nothing to strip
    if head[:1] == b"{" and head.endswith(b"}") and not any(k in client_body for k in fields):
        head = head[:-1].rstrip()
        added = json.dumps(fields).encode()[1:]  # '"key": value, ...}' without its '{'
        return head + added if head.endswith(b"{") else head + b"," + added
    return json.dumps({**client_body, **fields}).encode()


def pull_prefill_body(client_body: Body) -> Body:
    """P leg of pull mode (as vLLM's NIXL toy proxy sends it)."""
    body = _prefill_only(client_body)
    body["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return body


def pull_decode_body(client_body: Body, prefill_kv_params: dict[str, Any]) -> Body:
    """D leg of pull mode: the client's request plus the kv_transfer_params P returned."""
    body = dict(client_body)
    body["kv_transfer_params"] = copy.deepcopy(prefill_kv_params)
    return body


#: Client headers both legs carry as they came: the W3C trace context (so that an
#: OpenTelemetry trace goes on into the engines).
FORWARDED_HEADERS = ("traceparent", "tracestate")


def leg_headers(
    request_id: str,
    client_headers: Mapping[str, str],
    engine_api_key: str = "",
    forward_authorization: bool = False,
) -> dict[str, str]:
    """Headers sent on both legs: the shared request id, :data:`FORWARDED_HEADERS`, and
    an ``Authorization``: the proxy's own ``engine_api_key`` for engines started with
    vLLM's ``--api-key``, else the client's only with ``forward_authorization``. The
    client's credentials never reach the engines otherwise."""
    headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
    for name in FORWARDED_HEADERS:
        if value := client_headers.get(name):
            headers[name] = value
    if engine_api_key:
        headers["Authorization"] = f"Bearer {engine_api_key}"
    elif forward_authorization and (value := client_headers.get("Authorization")):
        headers["Authorization"] = value
    return headers
