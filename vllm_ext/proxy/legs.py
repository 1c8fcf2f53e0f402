# SPDX-License-Identifier: Apache-2.0
"""HTTP calls of one leg: timing, status, and the mapping of failures to :class:`LegError`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from yarl import URL

from vllm_ext.proxy.config import LegTimeouts
from vllm_ext.proxy.errors import (
    UPSTREAM_BAD_RESPONSE,
    UPSTREAM_TIMEOUT,
    UPSTREAM_UNAVAILABLE,
    ClientGone,
    LegError,
    status_error,
)

#: Bytes of an error response read for the message (the rest is dropped).
_MAX_ERROR_BODY = 64 * 1024
#: A connection the engine closed or reset (before its answer: the engine is going)
_DROPPED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


@dataclass(frozen=True)
class Sessions:
    """The proxy's HTTP client sessions.

    ``pooled`` carries every leg over keep-alive connections. ``fresh`` opens a new
    connection per request and closes it after: the one retry of a leg whose request
    never reached the engine (see :func:`open_leg`) goes there, because other idle
    connections of the pool may be as dead as the one that failed.
    """

    pooled: aiohttp.ClientSession
    fresh: aiohttp.ClientSession


@dataclass
class _ConnectionUse:
    """Filled by aiohttp's tracing while a request gets its connection."""

    reused: bool = False


async def _on_connection_reused(
    session: aiohttp.ClientSession, ctx: Any, params: aiohttp.TraceConnectionReuseconnParams
) -> None:
    use = ctx.trace_request_ctx
    if isinstance(use, _ConnectionUse):
        use.reused = True


def connection_tracing() -> aiohttp.TraceConfig:
    """The tracing the pooled session needs to tell a reused connection from a new one."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_on_connection_reused)
    return trace


def never_reached_engine(exc: BaseException, reused: bool) -> bool:
    """Whether a request that failed with ``exc`` certainly never reached the engine.

    Either no connection could be opened (nothing was sent), or a pooled keep-alive
    connection was closed by the engine as the request went out on it: the engine
    answers nothing and drops what it got, which is how an HTTP server closes an idle
    connection (vLLM's server does after 5 s). A new connection that is dropped
    without an answer may have been an engine that took the request and died: not
    retried.
    """
    if isinstance(exc, aiohttp.ClientConnectorError):
        return True
    return reused and isinstance(exc, _DROPPED)


@functools.lru_cache(maxsize=16)
def client_timeout(timeouts: LegTimeouts) -> aiohttp.ClientTimeout:
    """aiohttp's timeout object for one leg (one per timeouts: both are immutable)."""
    return aiohttp.ClientTimeout(
        total=timeouts.total, connect=timeouts.connect, sock_read=timeouts.idle
    )


@dataclass
class LegRecord:
    """What happened on one leg, for the request's log line."""

    name: str
    outcome: str = "-"
    started: float | None = None
    ended: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: ``<exception class>: <message>`` (or ``HTTP <status>: ...``) of the leg's failure
    error: str | None = None
    #: the failure of a first attempt that was retried on a new connection
    retried_after: str | None = None
    #: whether the engine answered (a status line arrived)
    answered: bool = False

    def start(self) -> None:
        self.started = time.monotonic()

    def end(self, outcome: str | None = None) -> None:
        if outcome is not None:
            self.outcome = outcome
        if self.ended is None:
            self.ended = time.monotonic()

    def seconds(self) -> float | None:
        """How long the leg took (``None`` if never sent)."""
        if self.started is None:
            return None
        return (self.ended if self.ended is not None else time.monotonic()) - self.started

    def summary(self) -> str:
        """``<outcome>/<ms>`` e.g. ``200/35.1ms``, ``timeout/500.2ms``, ``-`` if never sent."""
        if self.started is None:
            return self.outcome
        end = self.ended if self.ended is not None else time.monotonic()
        return f"{self.outcome}/{(end - self.started) * 1000:.1f}ms"

    def notes(self) -> list[str]:
        """``<leg>_error="..."`` / ``<leg>_retried_after="..."`` items for the log line."""
        out = []
        if self.retried_after is not None:
            out.append(f"{self.name}_retried_after={json.dumps(self.retried_after)}")
        if self.error is not None:
            out.append(f"{self.name}_error={json.dumps(self.error)}")
        return out


def describe(exc: BaseException) -> str:
    """``<exception class>: <message>`` for logs (aiohttp's messages can be empty)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextlib.contextmanager
def translate_errors(record: LegRecord, timeouts: LegTimeouts | None = None) -> Iterator[None]:
    """Turn transport failures inside the block into :class:`LegError`; time the leg."""
    leg = record.name
    try:
        yield
    except LegError as err:
        if err.type == UPSTREAM_BAD_RESPONSE:
            record.outcome = f"{record.outcome}(bad-body)"
        record.error = record.error or err.detail
        raise
    except ClientGone:
        record.end("client-gone")
        raise
    except asyncio.CancelledError:
        record.end("cancelled")
        raise
    except TimeoutError as exc:  # also aiohttp's connect/read timeouts
        record.end("timeout")
        record.error = describe(exc)
        detail = f"timed out after {record.summary().split('/')[-1]}"
        if str(exc):
            detail += f" ({exc})"
        if timeouts is not None:
            limits = {"connect": timeouts.connect, "total": timeouts.total, "idle": timeouts.idle}
            shown = (f"{k}={'none' if v is None else f'{v:g}s'}" for k, v in limits.items())
            detail += f" [limits: {' '.join(shown)}]"
        raise LegError(leg, 504, UPSTREAM_TIMEOUT, detail) from exc
    except aiohttp.ClientConnectorError as exc:
        # Nothing listens there (or the engine cannot be reached at all): the service
        # is unavailable for now, which load balancers expect as 503.
        record.end("error")
        record.error = describe(exc)
        detail = f"{type(exc).__name__}: cannot connect to the engine"
        failure = LegError(leg, 503, UPSTREAM_UNAVAILABLE, detail)
        failure.engine_unhealthy = True
        raise failure from exc
    except aiohttp.ClientError as exc:
        record.end("error")
        record.error = describe(exc)
        failure = LegError(leg, 502, UPSTREAM_UNAVAILABLE, record.error)
        # dropped before any answer, on a new connection (open_leg retried a reused one)
        failure.engine_unhealthy = not record.answered and isinstance(exc, _DROPPED)
        raise failure from exc
    finally:
        record.end()


@functools.lru_cache(maxsize=1024)
def leg_url(url: str) -> URL:
    """``url`` parsed once (an engine's address and a route: few distinct ones)."""
    return URL(url)


async def open_leg(
    sessions: Sessions,
    record: LegRecord,
    url: str,
    body: dict[str, Any] | bytes,
    headers: dict[str, str],
    timeouts: LegTimeouts,
) -> aiohttp.ClientResponse:
    """Send one leg and return its response once a 2xx status line arrived.

    A request that certainly never reached the engine (:func:`never_reached_engine`)
    is sent once more, on a new connection; the first failure is kept in
    ``record.retried_after``. The caller owns the returned response and must
    ``close()`` or ``release()`` it. Call inside :func:`translate_errors`.
    """
    record.start()
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    target = leg_url(url)
    use = _ConnectionUse()
    try:
        resp = await sessions.pooled.post(
            target, data=data, headers=headers, timeout=client_timeout(timeouts),
            trace_request_ctx=use,
        )  # fmt: skip
    except aiohttp.ClientError as exc:
        if not never_reached_engine(exc, use.reused):
            raise
        record.retried_after = describe(exc)
        resp = await sessions.fresh.post(
            target, data=data, headers=headers, timeout=client_timeout(timeouts)
        )
    record.outcome = str(resp.status)
    record.answered = True
    if 200 <= resp.status < 300:
        return resp
    try:
        raw = await resp.content.read(_MAX_ERROR_BODY)
    finally:
        resp.close()
    raise status_error(record.name, resp.status, raw)


def parse_json_object(leg: str, raw: bytes) -> dict[str, Any]:
    """The leg's body as a JSON object, else a 502 :class:`LegError`."""
    try:
        parsed = json.loads(raw)
    except ValueError as exc:
        raise LegError(leg, 502, UPSTREAM_BAD_RESPONSE, f"response is not JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise LegError(leg, 502, UPSTREAM_BAD_RESPONSE, "response is not a JSON object")
    return parsed


def check_json_object(leg: str, raw: bytes) -> None:
    """Whether the leg's body looks like a JSON object (its first and last bytes), else a
    502 :class:`LegError`: for an answer nothing is read from (push mode's P leg), a
    check without a parse."""
    text = raw.strip()
    if not (text[:1] == b"{" and text.endswith(b"}")):
        shown = raw[:40].decode("utf-8", errors="replace")
        raise LegError(leg, 502, UPSTREAM_BAD_RESPONSE, f"response is not JSON: {shown!r}")


async def post_json(
    sessions: Sessions,
    record: LegRecord,
    url: str,
    body: dict[str, Any] | bytes,
    headers: dict[str, str],
    timeouts: LegTimeouts,
    check_only: bool = False,
) -> dict[str, Any]:
    """A non-streaming leg: POST, require 2xx, return the response's JSON object; with
    ``check_only`` (an answer nothing is read from), the JSON is not parsed, only
    checked by :func:`check_json_object`, and ``{}`` returned."""
    with translate_errors(record, timeouts):
        resp = await open_leg(sessions, record, url, body, headers, timeouts)
        try:
            raw = await resp.read()
        except BaseException:
            resp.close()
            raise
        resp.release()
        if check_only:
            check_json_object(record.name, raw)
            return {}
        return parse_json_object(record.name, raw)
