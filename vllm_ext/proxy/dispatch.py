# SPDX-License-Identifier: Apache-2.0
"""Dispatch of one client request over the P and D legs.

Push mode (SPEC S-LEG-1): both legs start at once; D's response is what the
client gets. Pull mode: P first, then D with the ``kv_transfer_params`` P
returned. When a leg fails, the other is cancelled: cancelling an in-flight
aiohttp request closes its connection, and vLLM aborts a request whose client
went away, so nothing is left running on either engine.

xPyD: the :class:`~vllm_ext.proxy.pool.Pool` picks the least-loaded P and D of
each request; the D leg carries the chosen P's coordinates. A leg whose engine
refused the connection (nothing listens there: the engine is gone) takes that
engine out of service, and the request is dispatched once more to other
engines if nothing was sent to the client yet.

Each request's outcome is also accounted to its (P, D) pair
(:mod:`vllm_ext.proxy.pairs`): transfer failures in a row back the pair off,
while other pairs are usable it is skipped. A pair's probe that fails is
dispatched once more to another pair, nothing having been sent to the client yet.
While a role has no engine in service the client gets 503 with ``Retry-After``
(SPEC S-PRX-2).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
from aiohttp import web

from vllm_ext.proxy import bodies
from vllm_ext.proxy.config import LegTimeouts, ProxyConfig
from vllm_ext.proxy.errors import (
    NO_PAIR_AVAILABLE,
    UPSTREAM_BAD_RESPONSE,
    ClientGone,
    LegError,
    error_body,
    sse_error_event,
)
from vllm_ext.proxy.legs import (
    LegRecord,
    Sessions,
    describe,
    open_leg,
    parse_json_object,
    post_json,
    translate_errors,
)
from vllm_ext.proxy.pairs import NoPairAvailable, PairLease, counts_against_pair
from vllm_ext.proxy.pool import ROLES, Backend, Pool, Role
from vllm_ext.proxy.routing import prefix_key


@dataclass
class Exchange:
    """One client request on its way through the proxy, and what became of it."""

    request: web.Request
    path: str
    body: bodies.Body
    stream: bool
    request_id: str
    transfer_id: str
    leg_headers: dict[str, str]
    #: the client's body as it came (``body`` was parsed from it)
    raw: bytes = b"{}"
    prefill: LegRecord = field(default_factory=lambda: LegRecord("prefill"))
    decode: LegRecord = field(default_factory=lambda: LegRecord("decode"))
    #: The client's response once prepared (headers sent).
    response: web.StreamResponse | None = None
    #: Non-streaming D result held until it is sent: (status, content type, body).
    decode_result: tuple[int, str, bytes] | None = None
    #: The last two chunks streamed to the client, not copied (to see whether the stream
    #: ends on an SSE event boundary, and with D's closing ``[DONE]`` event).
    last_chunks: tuple[bytes, bytes] = (b"", b"")
    #: Outcome for the log line.
    status: str = "-"
    late_prefill_error: str | None = None
    #: the engines that served the legs (names, for the log line)
    p_engine: str = "-"
    d_engine: str = "-"
    #: why the request was dispatched a second time, if it was
    redispatched_after: str | None = None
    #: the pair this request probed after its back-off, if it did
    probed: str | None = None
    #: called once, as the first bytes of D's stream go to the client (its first token)
    on_first_byte: Callable[[], None] | None = None

    @property
    def at_event_boundary(self) -> bool:
        """Whether the bytes streamed so far end on an SSE event boundary."""
        return self.stream_tail.endswith((b"\n\n", b"\r\n\r\n")) or not self.last_chunks[1]

    @property
    def stream_tail(self) -> bytes:
        """The last bytes streamed to the client (up to 64)."""
        before, last = self.last_chunks
        return last[-64:] if len(last) >= 64 else (before + last)[-64:]

    @property
    def streamed_in_full(self) -> bool:
        """Whether the client was sent D's whole stream, its ``[DONE]`` event included:
        a client that closes then (as a streaming client may) got its answer."""
        return self.stream_tail.rstrip().endswith(b"data: [DONE]")

    def client_left(self) -> str:
        """The request's status once the client closed its connection. Closed after the
        whole stream, the decode leg counts as answered too: D sent everything, only
        the end of its chunked body was not read."""
        if self.response is not None and self.streamed_in_full:
            if self.decode.outcome in ("cancelled", "client-gone"):
                self.decode.outcome = str(self.response.status)
            return f"{self.response.status}(closed-at-end)"
        return "client-gone"

    def response_headers(self, content_type: str) -> dict[str, str]:
        return {"Content-Type": content_type, "X-Request-Id": self.request_id}


class _Redispatch(Exception):
    """The client got nothing yet and other engines may serve: a leg never reached its
    engine, or the request probed a pair that still fails."""

    def __init__(self, failed: str, reason: str) -> None:
        super().__init__(reason)
        self.failed = failed


async def dispatch(ex: Exchange, sessions: Sessions, config: ProxyConfig, pool: Pool) -> Any:
    """Run the legs for ``ex`` and answer the client; returns the prepared response."""
    try:
        try:
            await _run_rechecked(ex, sessions, config, pool)
        except _Redispatch as again:
            ex.redispatched_after = f"{again.failed}: {again}"
            ex.prefill, ex.decode = LegRecord("prefill"), LegRecord("decode")
            ex.transfer_id = bodies.new_transfer_id()
            await _run_once(ex, sessions, config, pool, may_redispatch=False)
    except LegError as err:
        ex.status = f"{err.status}" if ex.response is None else f"{ex.response.status}+error"
        await _send_error(ex, err)
    except NoPairAvailable as none:
        ex.status = f"503({none.reason})"
        await _send_unavailable(ex, none)
    except ClientGone:
        ex.status = ex.client_left()
    except asyncio.CancelledError:
        ex.status = ex.client_left()
        raise
    return ex.response if ex.response is not None else web.Response(status=499)


async def _run_rechecked(ex: Exchange, sessions: Sessions, config: ProxyConfig, pool: Pool) -> None:
    """:func:`_run_once`; when every engine of a role was out of service before a leg
    was sent, those engines are probed now (:meth:`Pool.recheck`) and, one being back
    (an engine restarted since the last background probe), the request goes on."""
    try:
        await _run_once(ex, sessions, config, pool, may_redispatch=True)
    except NoPairAvailable as none:
        role = none.out_of_service
        if role not in ROLES or ex.prefill.started is not None:
            raise
        if not await pool.recheck(sessions.pooled, cast(Role, role)):
            raise
        await _run_once(ex, sessions, config, pool, may_redispatch=True)


async def _run_once(
    ex: Exchange, sessions: Sessions, config: ProxyConfig, pool: Pool, may_redispatch: bool
) -> None:
    """One dispatch of ``ex`` over engines the pool picks; its outcome goes to their pair."""
    engines: dict[str, Backend] = {}
    lease: PairLease | None = None

    def note(backend: Backend) -> Backend:
        engines[backend.role] = backend
        if backend.role == "prefill":
            ex.p_engine = backend.name
        else:
            ex.d_engine = backend.name
        return backend

    def pick_decode(p: Backend) -> Backend:
        nonlocal lease
        d, lease = pool.pick_decode(p)
        _note_probe(ex, lease)
        return note(d)

    prefix = None
    if config.routing == "prefix-affinity":
        prefix = prefix_key(ex.body, config.prefix_chars, config.prefix_chunk_chars)
    try:
        if config.mode == "push":
            p, d, lease = pool.pick_pair(prefix)
            _note_probe(ex, lease)
            await _run_push(ex, sessions, config, note(p), note(d))
        else:
            await _run_pull(ex, sessions, config, note(pool.pick_prefill(prefix)), pick_decode)
    except LegError as err:
        backend = engines.get(err.leg)
        if backend is not None and pool.several(backend.role):
            err.engine = backend.name  # its address goes to the log, not to the client
        against_pair = counts_against_pair(err, ex.response is not None)
        if lease is not None:
            lease.end("failure" if against_pair else "neutral", err.message)
        if backend is None:
            raise
        if isinstance(err.__cause__, aiohttp.ClientConnectorError):
            pool.leg_unreachable(backend, describe(err.__cause__))
            err.retry_after = pool.retry_after_unreachable()
            others = [b for b in pool.backends[backend.role] if b.up and b is not backend]
            if may_redispatch and ex.response is None and others:
                raise _Redispatch(backend.name, err.detail) from err
        elif err.engine_unhealthy and err.__cause__ is not None:
            pool.leg_dropped(backend, describe(err.__cause__))
        elif _probe_may_redispatch(lease, against_pair, may_redispatch, ex, pool):
            assert lease is not None
            raise _Redispatch(f"probe of pair {lease.pair.name}", err.message) from err
        raise
    except BaseException:
        if lease is not None:
            lease.end("neutral")
        raise
    if lease is not None:
        lease.end("success")


def _probe_may_redispatch(
    lease: PairLease | None, against_pair: bool, may_redispatch: bool, ex: Exchange, pool: Pool
) -> bool:
    """A pair's probe failed on the transfer: another pair may still serve the request."""
    if lease is None or not (lease.probe and against_pair and may_redispatch):
        return False
    return ex.response is None and pool.any_pair_usable()


def _note_probe(ex: Exchange, lease: PairLease) -> None:
    if lease.probe:
        ex.probed = lease.pair.name


async def _run_push(
    ex: Exchange, sessions: Sessions, config: ProxyConfig, p: Backend, d: Backend
) -> None:
    """Both legs at once (or P first, ``push_legs: sequential``): P in a task of its
    own, D's relay in the request's own task. A P leg that fails while D's relay runs
    cancels the request's task, and the relay ends as a cancelled D leg would."""
    assert p.coords is not None  # checked by ProxyConfig
    secret = bodies.transfer_secret(ex.transfer_id)
    p_task = asyncio.create_task(
        post_json(
            sessions,
            ex.prefill,
            p.url + ex.path,
            bodies.push_prefill_body(ex.body, ex.transfer_id, secret),
            ex.leg_headers,
            config.prefill_timeouts,
            check_only=True,
        ),
        name=f"prefill-{ex.request_id}",
    )
    p_task.add_done_callback(lambda _: p.release())
    if config.push_legs == "sequential":
        try:
            await p_task  # P answered (else its error ends the request: D was never asked)
        except BaseException:
            d.release()
            raise
    d_params = bodies.push_decode_params(p.coords, ex.transfer_id, secret)
    d_body = bodies.with_fields(ex.raw, ex.body, {"kv_transfer_params": d_params})
    me = asyncio.current_task()
    assert me is not None
    prefill_failed = False
    relaying = True

    def on_prefill_done(task: asyncio.Task[dict[str, Any]]) -> None:
        nonlocal prefill_failed
        if relaying and not task.cancelled() and task.exception() is not None:
            prefill_failed = True
            me.cancel()

    p_task.add_done_callback(on_prefill_done)
    try:
        try:
            # P's leg goes out first, as it did in a task started before D's; a cancel
            # from on_prefill_done can only land in here, never after the relay ended
            await asyncio.sleep(0)
            await _relay_decode(ex, sessions, d.url + ex.path, d_body, config.decode_timeouts)
        except asyncio.CancelledError:
            if not (prefill_failed and me.uncancel() == 0):
                raise
        finally:
            relaying = False
            d.release()
        if prefill_failed:
            raise cast(BaseException, p_task.exception())  # with its __cause__
        if not p_task.done():
            await asyncio.sleep(0)  # a P failure already on its way wins, as below
        if p_task.done() and not p_task.cancelled() and (exc := p_task.exception()) is not None:
            raise exc  # P failed as D ended, before its callback cancelled the relay
        await _finish(ex)
        # D is done: the client has its answer. P normally finished first; if not, let it
        # end within its own timeout (its failure now only goes to the log).
        try:
            await p_task
        except LegError as err:
            ex.late_prefill_error = err.message
    finally:
        await _cancel(p_task)


async def _run_pull(
    ex: Exchange,
    sessions: Sessions,
    config: ProxyConfig,
    p: Backend,
    pick_decode: Callable[[Backend], Backend],
) -> None:
    try:
        p_json = await post_json(
            sessions,
            ex.prefill,
            p.url + ex.path,
            bodies.pull_prefill_body(ex.body),
            ex.leg_headers,
            config.prefill_timeouts,
        )
    finally:
        p.release()
    kv_params = p_json.get("kv_transfer_params")
    if not isinstance(kv_params, dict) or not kv_params:
        ex.prefill.outcome = f"{ex.prefill.outcome}(no-kv-params)"
        raise LegError(
            "prefill",
            502,
            UPSTREAM_BAD_RESPONSE,
            "response has no kv_transfer_params (is P started as a kv_producer?)",
        )
    d = pick_decode(p)  # the least-loaded D usable with P, now that P is done
    try:
        await _relay_decode(
            ex,
            sessions,
            d.url + ex.path,
            bodies.pull_decode_body(ex.body, kv_params),
            config.decode_timeouts,
        )
    finally:
        d.release()
    await _finish(ex)


async def _cancel(*tasks: asyncio.Task[Any]) -> None:
    """Cancel unfinished legs and wait until their connections are closed."""
    for task in tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _relay_decode(
    ex: Exchange,
    sessions: Sessions,
    url: str,
    body: bodies.Body | bytes,
    timeouts: LegTimeouts,
) -> None:
    """Run the D leg: stream its body to the client as it comes, or hold the JSON."""
    with translate_errors(ex.decode, timeouts):
        resp = await open_leg(sessions, ex.decode, url, body, ex.leg_headers, timeouts)
        try:
            content_type = resp.headers.get("Content-Type", "application/json")
            if ex.stream:
                async for chunk in resp.content.iter_any():
                    await _write(ex, chunk, resp.status, content_type)
                await _write(ex, b"", resp.status, content_type)
            else:
                raw = await resp.read()
                parse_json_object("decode", raw)
                ex.decode_result = (resp.status, content_type, raw)
        except BaseException:
            resp.close()
            raise
        resp.release()


async def _write(ex: Exchange, data: bytes, status: int, content_type: str) -> None:
    """Send ``data`` to the client at once, preparing the streamed response on first use."""
    try:
        if ex.response is None:
            response = web.StreamResponse(status=status, headers=ex.response_headers(content_type))
            response.headers["Cache-Control"] = "no-cache"
            await response.prepare(ex.request)
            ex.response = response
        if data:
            if ex.on_first_byte is not None:
                ex.on_first_byte()
                ex.on_first_byte = None
            await ex.response.write(data)
            ex.last_chunks = (ex.last_chunks[1], data)
    except ConnectionError as exc:
        raise ClientGone(str(exc)) from exc


async def _finish(ex: Exchange) -> None:
    """Complete the client's response after a successful D leg."""
    try:
        if ex.decode_result is not None:
            status, content_type, raw = ex.decode_result
            ex.response = web.Response(
                body=raw, status=status, headers=ex.response_headers(content_type)
            )
            await ex.response.prepare(ex.request)
        assert ex.response is not None
        ex.status = str(ex.response.status)
        await ex.response.write_eof()
    except ConnectionError as exc:
        raise ClientGone(str(exc)) from exc


async def _send_unavailable(ex: Exchange, none: NoPairAvailable) -> None:
    """503 with ``Retry-After``: no pair may take the request now (nothing was sent yet)."""
    headers = {"X-Request-Id": ex.request_id, "Retry-After": str(none.retry_after)}
    ex.response = web.json_response(
        error_body(none.message, NO_PAIR_AVAILABLE, 503), status=503, headers=headers
    )
    try:
        await ex.response.prepare(ex.request)
        await ex.response.write_eof()
    except ConnectionError:
        ex.status = "client-gone"


async def _send_error(ex: Exchange, err: LegError) -> None:
    """Tell the client a leg failed: an error response, or an SSE error event mid-stream."""
    try:
        if ex.response is None:
            headers = {"X-Request-Id": ex.request_id}
            if err.retry_after is not None:
                headers["Retry-After"] = str(err.retry_after)
            ex.response = web.json_response(err.body(), status=err.status, headers=headers)
            await ex.response.prepare(ex.request)
        else:
            event = sse_error_event(err.message, err.type, err.status)
            if not ex.at_event_boundary:
                event = b"\n\n" + event
            await ex.response.write(event + b"data: [DONE]\n\n")
        await ex.response.write_eof()
    except ConnectionError:
        ex.status = "client-gone"
