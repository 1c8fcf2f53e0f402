# SPDX-License-Identifier: Apache-2.0
"""HTTP calls of one leg: timing, status, and the mapping of failures to :class:`LegError`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

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


def client_timeout(timeouts: LegTimeouts) -> aiohttp.ClientTimeout:
    """aiohttp's timeout object for one leg."""
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

    def start(self) -> None:
        self.started = time.monotonic()

    def end(self, outcome: str | None = None) -> None:
        if outcome is not None:
            self.outcome = outcome
        if self.ended is None:
            self.ended = time.monotonic()

    def summary(self) -> str:
        """``<outcome>/<ms>`` e.g. ``200/35.1ms``, ``timeout/500.2ms``, ``-`` if never sent."""
        if self.started is None:
            return self.outcome
        end = self.ended if self.ended is not None else time.monotonic()
        return f"{self.outcome}/{(end - self.started) * 1000:.1f}ms"


@contextlib.contextmanager
def translate_errors(record: LegRecord, timeouts: LegTimeouts | None = None) -> Iterator[None]:
    """Turn transport failures inside the block into :class:`LegError`; time the leg."""
    leg = record.name
    try:
        yield
    except LegError as err:
        if err.type == UPSTREAM_BAD_RESPONSE:
            record.outcome = f"{record.outcome}(bad-body)"
        raise
    except ClientGone:
        record.end("client-gone")
        raise
    except asyncio.CancelledError:
        record.end("cancelled")
        raise
    except TimeoutError as exc:  # also aiohttp's connect/read timeouts
        record.end("timeout")
        detail = f"timed out after {record.summary().split('/')[-1]}"
        if str(exc):
            detail += f" ({exc})"
        if timeouts is not None:
            detail += (
                f" [limits: connect={timeouts.connect}s total={timeouts.total}s"
                f" idle={timeouts.idle}s]"
            )
        raise LegError(leg, 504, UPSTREAM_TIMEOUT, detail) from exc
    except aiohttp.ClientError as exc:
        record.end("error")
        raise LegError(leg, 502, UPSTREAM_UNAVAILABLE, f"{type(exc).__name__}: {exc}") from exc
    finally:
        record.end()


async def open_leg(
    session: aiohttp.ClientSession,
    record: LegRecord,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeouts: LegTimeouts,
) -> aiohttp.ClientResponse:
    """Send one leg and return its response once a 2xx status line arrived.

    The caller owns the returned response and must ``close()`` or ``release()`` it.
    Call inside :func:`translate_errors`.
    """
    record.start()
    resp = await session.post(
        url, data=json.dumps(body), headers=headers, timeout=client_timeout(timeouts)
    )
    record.outcome = str(resp.status)
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


async def post_json(
    session: aiohttp.ClientSession,
    record: LegRecord,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeouts: LegTimeouts,
) -> dict[str, Any]:
    """A non-streaming leg: POST, require 2xx, return the response's JSON object."""
    with translate_errors(record, timeouts):
        resp = await open_leg(session, record, url, body, headers, timeouts)
        try:
            raw = await resp.read()
        except BaseException:
            resp.close()
            raise
        resp.release()
        return parse_json_object(record.name, raw)
