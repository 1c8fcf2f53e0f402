# SPDX-License-Identifier: Apache-2.0
"""Errors the proxy reports to its clients, in OpenAI's error format."""

from __future__ import annotations

import json
import re
from typing import Any

#: Error ``type`` values used by the proxy.
BAD_REQUEST = "invalid_request_error"
UPSTREAM_ERROR = "upstream_error"
UPSTREAM_UNAVAILABLE = "upstream_unavailable"
UPSTREAM_TIMEOUT = "upstream_timeout"
UPSTREAM_BAD_RESPONSE = "upstream_bad_response"
#: 429: the proxy has as many requests in flight as it admits
OVER_CAPACITY = "rate_limit_exceeded"
#: 503: no engine of a role is in service (or known) to take the request now
NO_PAIR_AVAILABLE = "service_unavailable"

_MAX_DETAIL = 500

#: What an engine's address looks like inside an error text: a URL, an IPv4 address
#: (with its port), a ``host:port``. Clients never see these (the log keeps them).
_ADDRESS = re.compile(
    r"[a-z][a-z0-9+.-]*://\S+"
    r"|\(?'?\d{1,3}(?:\.\d{1,3}){3}'?(?:(?::|,\s*)\d{1,5})?\)?"
    r"|\[[0-9a-f:]+\](?::\d{1,5})?"
    r"|\b[\w.-]+:\d{2,5}\b",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """``text`` with every engine address replaced by ``<engine>``."""
    return _ADDRESS.sub("<engine>", text)


def error_body(message: str, type_: str, code: int) -> dict[str, Any]:
    """An OpenAI-style error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def sse_error_event(message: str, type_: str, code: int) -> bytes:
    """The same error as one server-sent event (for a stream already started)."""
    return f"data: {json.dumps(error_body(message, type_, code))}\n\n".encode()


class ClientGone(Exception):
    """The client closed its connection while the proxy was writing to it."""


class LegError(Exception):
    """One leg (``prefill`` or ``decode``) failed; carries what the client is told."""

    def __init__(self, leg: str, status: int, type_: str, detail: str) -> None:
        self.leg = leg
        self.status = status
        self.type = type_
        #: what the client is told: no engine address in it (the log line has those)
        self.detail = redact(detail)[:_MAX_DETAIL]
        #: the engine that served the leg, named when the proxy has several of its role
        self.engine: str | None = None
        #: seconds for ``Retry-After`` (503 only)
        self.retry_after: int | None = None
        #: the failure says the engine is unhealthy, not the request: its connection was
        #: refused, or dropped before any answer (SPEC S-PRX-2: only these, and its
        #: ``/health``, take an engine out of service)
        self.engine_unhealthy = False
        super().__init__(self.message)

    @property
    def message(self) -> str:
        """The client-facing message, e.g. ``prefill leg failed: HTTP 500: ...``
        (xPyD: ``prefill leg failed on P1: HTTP 500: ...``)."""
        where = f" on {self.engine}" if self.engine else ""
        return f"{self.leg} leg failed{where}: {self.detail}"

    def body(self) -> dict[str, Any]:
        """The OpenAI-style error body for the client."""
        return error_body(self.message, self.type, self.status)


def upstream_message(raw: bytes) -> str:
    """The error message inside an engine's error response (vLLM's formats), else the text."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        return text[:_MAX_DETAIL] or "(empty body)"
    if isinstance(parsed, dict):
        inner = parsed.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"][:_MAX_DETAIL]
        if isinstance(parsed.get("message"), str):  # vLLM's older ErrorResponse
            return parsed["message"][:_MAX_DETAIL]
        if isinstance(inner, str):
            return inner[:_MAX_DETAIL]
    return text[:_MAX_DETAIL]


def status_error(leg: str, status: int, raw: bytes) -> LegError:
    """The error for a leg that answered with a non-2xx status.

    A 4xx means the engine rejected the client's request (e.g. a prompt too long):
    the client gets that same status. Anything else is the gateway's 502.
    """
    detail = f"HTTP {status}: {upstream_message(raw)}"
    if 400 <= status < 500:
        return LegError(leg, status, BAD_REQUEST, detail)
    return LegError(leg, 502, UPSTREAM_ERROR, detail)
