# SPDX-License-Identifier: Apache-2.0
"""The proxy's aiohttp application: routes, admission, client-body validation, health, logging."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from vllm_ext.log import event
from vllm_ext.proxy import bodies
from vllm_ext.proxy.config import ProxyConfig
from vllm_ext.proxy.discovery import EngineDiscovery
from vllm_ext.proxy.dispatch import Exchange, dispatch
from vllm_ext.proxy.errors import (
    BAD_REQUEST,
    NO_PAIR_AVAILABLE,
    OVER_CAPACITY,
    LegError,
    error_body,
    redact,
    status_error,
)
from vllm_ext.proxy.legs import (
    LegRecord,
    Sessions,
    client_timeout,
    connection_tracing,
    translate_errors,
)
from vllm_ext.proxy.metrics import ProxyMetrics
from vllm_ext.proxy.pairs import NoPairAvailable
from vllm_ext.proxy.pool import Pool
from vllm_ext.proxy.workers import Worker

# Named like vllm_ext.log's loggers, without importing vLLM (the proxy never needs it).
logger = logging.getLogger("vllm.ext.proxy")

CONFIG = web.AppKey("config", ProxyConfig)
SESSIONS = web.AppKey("sessions", Sessions)
POOL = web.AppKey("pool", Pool)

#: seconds a client refused at capacity is told to wait (``Retry-After``)
RETRY_AFTER_OVER_CAPACITY = 1

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class BadRequest(Exception):
    """The client's request is unusable; answered with ``status`` and an OpenAI error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Admission:
    """Client requests in flight through the proxy; past ``limit`` new ones are refused.

    The first refusal of an episode is logged, and its end (in flight back to three
    quarters of the limit) with the number refused meanwhile, not every refusal: a
    burst must not also flood the log.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        #: refusals since the proxy started
        self.rejected = 0
        #: requests admitted since the proxy started
        self.admitted = 0
        self._rejected_in_episode = 0
        self._full = False

    def try_enter(self) -> bool:
        """Count one more request in flight, or refuse it (``False``) at the limit."""
        if self.limit and self.in_flight >= self.limit:
            self.rejected += 1
            self._rejected_in_episode += 1
            if not self._full:
                self._full = True
                logger.warning(
                    "admission: %d requests in flight (max_in_flight %d): "
                    "new requests get 429 until some end",
                    self.in_flight,
                    self.limit,
                )
            return False
        self.in_flight += 1
        self.admitted += 1
        return True

    def leave(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        if self._full and self.in_flight <= self.limit * 3 // 4:
            self._full = False
            logger.warning(
                "admission: %d requests in flight, admitting again; %d refused meanwhile",
                self.in_flight,
                self._rejected_in_episode,
            )
            self._rejected_in_episode = 0

    def describe(self) -> dict[str, int]:
        return {"in_flight": self.in_flight, "max_in_flight": self.limit, "rejected": self.rejected}


class Drain:
    """Whether the proxy is draining (from SIGTERM on, :mod:`vllm_ext.proxy.serve`):
    ``/health`` answers 503 and every answer closes its connection, so clients'
    keep-alive connections move to the proxies that stay."""

    def __init__(self) -> None:
        #: monotonic time the drain began; ``None`` while serving
        self.since: float | None = None

    @property
    def active(self) -> bool:
        return self.since is not None

    def begin(self) -> None:
        if self.since is None:
            self.since = time.monotonic()


ADMISSION = web.AppKey("admission", Admission)
METRICS = web.AppKey("metrics", ProxyMetrics)
DRAIN = web.AppKey("drain", Drain)
WORKER = web.AppKey("worker", Worker)


def create_app(config: ProxyConfig, worker: Worker | None = None) -> web.Application:
    """The proxy application for ``config`` (its client session lives with the app);
    ``worker``: this process is one of ``--workers N`` (:mod:`vllm_ext.proxy.workers`)."""
    app = web.Application(
        client_max_size=config.max_request_bytes, middlewares=[openai_errors, require_api_key]
    )
    app.on_response_prepare.append(close_while_draining)
    app[CONFIG] = config
    app[DRAIN] = Drain()
    app[POOL] = Pool(config)
    app[ADMISSION] = Admission(config.max_in_flight)
    if worker is not None:
        app[WORKER] = worker
    app[METRICS] = ProxyMetrics(
        app[POOL], app[ADMISSION].describe, worker.multiprocess_dir if worker else None
    )
    app.cleanup_ctx.append(_client_session)
    for path in GENERATION_PATHS:
        app.router.add_post(path, handle_generation)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/metrics", handle_metrics)
    return app


#: the routes a client needs an API key for (``--api-key``); ``/health`` and ``/metrics``
#: never need one (probes and scrapes)
KEYED_PATHS = (*GENERATION_PATHS, "/v1/models")


@web.middleware
async def require_api_key(request: web.Request, handler: Any) -> web.StreamResponse:
    """With API keys configured, the OpenAI routes answer 401 (an OpenAI error, with
    ``WWW-Authenticate: Bearer``) to a request without ``Authorization: Bearer <key>``
    naming one of them; the key is compared in constant time and never logged."""
    keys = request.app[CONFIG].api_keys
    if not keys or request.path not in KEYED_PATHS:
        return await handler(request)
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    given_bytes = given.strip().encode()
    ok = scheme.lower() == "bearer" and any(
        hmac.compare_digest(given_bytes, key.encode()) for key in keys
    )
    if ok:
        return await handler(request)
    message = "invalid API key" if given else "missing API key (send Authorization: Bearer <key>)"
    logger.info(
        "path=%s status=401 %s",
        request.path,
        message,
        extra=event("rejected", path=request.path, status=401),
    )
    metrics = request.app[METRICS]
    metrics.rejected.labels("unauthorized").inc()
    if request.path in GENERATION_PATHS:
        metrics.request_done(request.path, "401", 0.0)
    response = web.json_response(error_body(message, BAD_REQUEST, 401), status=401)
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


async def close_while_draining(request: web.Request, response: web.StreamResponse) -> None:
    """While draining, each answer says ``Connection: close`` and closes its connection."""
    if request.app[DRAIN].active:
        response.force_close()
        response.headers["Connection"] = "close"  # the hook runs after aiohttp set it


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every error status in OpenAI's error JSON, also aiohttp's own (404, 405, 413) and
    an unexpected exception's 500 (its traceback goes to the log, not to the client)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = f"{exc.reason}: {request.method} {request.path}"
        if isinstance(exc, web.HTTPMethodNotAllowed):
            message += f" (allowed: {', '.join(sorted(exc.allowed_methods))})"
        type_ = BAD_REQUEST if exc.status < 500 else "server_error"
        response = web.json_response(error_body(message, type_, exc.status), status=exc.status)
        for name in ("Allow", "Retry-After"):
            if name in exc.headers:
                response.headers[name] = exc.headers[name]
        return response
    except Exception:
        logger.exception("%s %s: unexpected error", request.method, request.path)
        body = error_body("internal error in the proxy (see its log)", "server_error", 500)
        return web.json_response(body, status=500)


def make_runner(config: ProxyConfig) -> web.AppRunner:
    """An app runner as the proxy must run: a client disconnect cancels its handler."""
    return web.AppRunner(create_app(config), handler_cancellation=True, access_log=None)


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    """The client sessions of all legs: one pool, and one for retries on new connections.

    The pool drops a connection idle for ``keepalive_timeout``, before the engine does
    (vLLM's server closes idle connections after 5 s), so that a request rarely goes
    out on a connection the engine is closing; :func:`~vllm_ext.proxy.legs.open_leg`
    retries the rest. The pool's background health probes (and, routing by engine load,
    its /metrics scrapes; with engines found by DNS, their look-ups) run while the app runs.
    """
    config = app[CONFIG]
    pooled = aiohttp.TCPConnector(
        limit=config.max_connections, limit_per_host=0, keepalive_timeout=config.keepalive_timeout
    )
    fresh = aiohttp.TCPConnector(limit=0, force_close=True)
    # no engine sets cookies, and one client's must never reach another's legs
    no_cookies = aiohttp.DummyCookieJar()
    async with (
        aiohttp.ClientSession(
            connector=pooled, trace_configs=[connection_tracing()], cookie_jar=no_cookies
        ) as p,
        aiohttp.ClientSession(connector=fresh, cookie_jar=no_cookies) as f,
    ):
        app[SESSIONS] = Sessions(pooled=p, fresh=f)
        watchers = []
        if config.discovery is not None:
            failures = app[METRICS].discovery_failures
            found = EngineDiscovery(config, app[POOL], lambda role: failures.labels(role).inc())
            await found.refresh()  # the first engines before the first request
            watchers.append(asyncio.create_task(found.watch(), name="dns-discovery"))
        watchers.append(asyncio.create_task(app[POOL].watch(p), name="health-probes"))
        if config.routing != "least-in-flight":
            watchers.append(asyncio.create_task(app[POOL].watch_loads(p), name="load-scrapes"))
        if app[METRICS].multiprocess_dir is not None:
            publish = app[METRICS].publish_state()
            watchers.append(asyncio.create_task(publish, name="publish-state"))
        try:
            yield
        finally:
            for watcher in watchers:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher


def _json_error(status: int, message: str, type_: str, request_id: str | None) -> web.Response:
    headers = {"X-Request-Id": request_id} if request_id else None
    return web.json_response(error_body(message, type_, status), status=status, headers=headers)


async def _read_client_body(request: web.Request) -> tuple[bytes, bodies.Body]:
    """The client's body as it came and as a JSON object, or :class:`BadRequest`."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        limit = request.app[CONFIG].max_request_bytes
        raise BadRequest(413, f"request body too large (limit {limit} bytes)") from exc
    if not raw:
        raise BadRequest(400, "request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except ValueError as exc:  # also bad UTF-8
        raise BadRequest(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest(400, "'stream' must be a boolean")
    return raw, body


async def handle_generation(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` and ``POST /v1/chat/completions``.

    Past ``max_in_flight`` requests in flight the answer is 429 at once, before the
    body is read.
    """
    config = request.app[CONFIG]
    request_id = request.headers.get("X-Request-Id") or bodies.new_request_id()
    admission = request.app[ADMISSION]
    if not admission.try_enter():
        logger.debug(
            "request_id=%s path=%s status=429 over capacity",
            request_id,
            request.path,
            extra=event("rejected", request_id, path=request.path, status=429),
        )
        message = (
            f"the proxy is at capacity: {admission.in_flight} requests in flight "
            f"(max_in_flight {admission.limit}); retry after {RETRY_AFTER_OVER_CAPACITY}s"
        )
        response = _json_error(429, message, OVER_CAPACITY, request_id)
        response.headers["Retry-After"] = str(RETRY_AFTER_OVER_CAPACITY)
        metrics = request.app[METRICS]
        metrics.rejected.labels("over_capacity").inc()
        metrics.request_done(request.path, "429", 0.0)
        return response
    try:
        return await _admitted_generation(request, config, request_id)
    finally:
        admission.leave()


async def _admitted_generation(
    request: web.Request, config: ProxyConfig, request_id: str
) -> web.StreamResponse:
    started = time.monotonic()
    try:
        raw, body = await _read_client_body(request)
    except BadRequest as err:
        logger.info(
            "request_id=%s path=%s mode=%s status=%d rejected: %s",
            request_id,
            request.path,
            config.mode,
            err.status,
            err.message,
            extra=event("rejected", request_id, path=request.path, status=err.status),
        )
        metrics = request.app[METRICS]
        metrics.rejected.labels("bad_request").inc()
        metrics.request_done(request.path, str(err.status), time.monotonic() - started)
        return _json_error(err.status, err.message, BAD_REQUEST, request_id)

    ex = Exchange(
        request=request,
        path=request.path,
        body=body,
        raw=raw,
        stream=bool(body.get("stream", False)),
        request_id=request_id,
        transfer_id=bodies.new_transfer_id(),
        leg_headers=bodies.leg_headers(
            request_id, request.headers, config.engine_api_key, config.forward_authorization
        ),
    )
    metrics = request.app[METRICS]
    ex.on_first_byte = lambda: metrics.first_byte(ex.path, time.monotonic() - started)
    try:
        return await dispatch(ex, request.app[SESSIONS], config, request.app[POOL])
    finally:
        _log_exchange(ex, config, started)
        _count_exchange(metrics, ex, started)


def _count_exchange(metrics: ProxyMetrics, ex: Exchange, started: float) -> None:
    """The request's series: its answer's status, its legs, a refusal's reason."""
    code = ex.status.split("(")[0].split("+")[0]
    if not code.isdigit():
        code = "499"  # the client went away before its answer began
    if ex.status.startswith("503("):
        metrics.rejected.labels(ex.status[4:-1].replace("-", "_")).inc()
    elif ex.status == "503":
        metrics.rejected.labels("engine_unreachable").inc()
    metrics.request_done(ex.path, code, time.monotonic() - started)
    metrics.leg_done(ex.prefill, ex.p_engine)
    metrics.leg_done(ex.decode, ex.d_engine)


def _log_exchange(ex: Exchange, config: ProxyConfig, started: float) -> None:
    """The one INFO line per request (a prefill failure after D finished adds a warning)."""
    notes = ex.prefill.notes() + ex.decode.notes()
    if ex.probed is not None:
        notes.append(f"probed_pair={ex.probed}")
    if ex.redispatched_after is not None:
        notes.append(f"redispatched_after={json.dumps(ex.redispatched_after)}")
    total_ms = (time.monotonic() - started) * 1000
    fields: dict[str, Any] = {
        "transfer_id": ex.transfer_id,
        "path": ex.path,
        "mode": config.mode,
        "stream": ex.stream,
        "status": ex.status,
        "prefill": ex.prefill.summary(),
        "decode": ex.decode.summary(),
        "p": ex.p_engine,
        "d": ex.d_engine,
        "total_ms": round(total_ms, 1),
    }
    for note in notes:  # key=value, the value JSON where it is quoted
        key, _, value = note.partition("=")
        fields[key] = json.loads(value) if value.startswith('"') else value
    logger.info(
        "request_id=%s transfer_id=%s path=%s mode=%s stream=%s status=%s "
        "prefill=%s decode=%s p=%s d=%s total=%.1fms%s",
        ex.request_id,
        ex.transfer_id,
        ex.path,
        config.mode,
        ex.stream,
        ex.status,
        ex.prefill.summary(),
        ex.decode.summary(),
        ex.p_engine,
        ex.d_engine,
        total_ms,
        "".join(" " + note for note in notes),
        extra=event("request", ex.request_id, **fields),
    )
    if ex.late_prefill_error:
        logger.warning(
            "request_id=%s: %s (after the decode leg completed)",
            ex.request_id,
            ex.late_prefill_error,
            extra=event("late_prefill_error", ex.request_id),
        )


async def handle_health(request: web.Request) -> web.Response:
    """``GET /health``: the proxy's readiness, and every engine probed now.

    The HTTP status says whether this proxy takes requests: 200 while it serves,
    whatever its engines' state (with none in service it answers clients a 503 with
    ``Retry-After`` itself, SPEC S-PRX-2), 503 once it drains (SIGTERM,
    :mod:`vllm_ext.proxy.serve`). The payload's ``status`` tells the engines' side:
    ``ok``, ``degraded`` (an engine down or a pair not ``healthy``), ``unavailable``
    (a role has no engine that answers), or ``draining``. With one P and one D it names
    them ``prefill`` and ``decode`` (and ``down`` lists those two words); with several,
    ``down`` lists engine names. ``engines`` gives each engine's name, state, load and
    whether it is in service (never its address: those are in the log); ``pairs`` each
    (P, D) pair's health; ``admission`` the requests in flight, the limit and the
    refusals so far (with ``--workers``: this worker's, and ``worker`` names it).
    """
    config = request.app[CONFIG]
    pool = request.app[POOL]
    backends = pool.all()  # as of now: discovery may change the pool during the probes
    states = await pool.probe_all(request.app[SESSIONS].pooled, backends)
    down = [b.name for b, state in zip(backends, states) if state != "up"]
    serving = all(
        any(state == "up" for b, state in zip(backends, states) if b.role == role)
        for role in ("prefill", "decode")
    )
    pairs = pool.describe_pairs()
    degraded = down or any(pair["state"] != "healthy" for pair in pairs)
    draining = request.app[DRAIN].active
    status = "unavailable" if not serving else "degraded" if degraded else "ok"
    payload: dict[str, Any] = {"status": "draining" if draining else status, "mode": config.mode}
    for role in ("prefill", "decode"):
        mine = [state for b, state in zip(backends, states) if b.role == role]
        if len(mine) == 1:
            payload[role] = redact(mine[0])
    payload["down"] = down
    payload["engines"] = [b.describe() for b in backends]
    payload["pairs"] = pairs
    payload["admission"] = request.app[ADMISSION].describe()
    if WORKER in request.app:
        admitted = request.app[ADMISSION].admitted
        payload["worker"] = {**request.app[WORKER].describe(), "admitted": admitted}
    return web.json_response(payload, status=503 if draining else 200)


async def handle_models(request: web.Request) -> web.Response:
    """``GET /v1/models``, answered by D."""
    config = request.app[CONFIG]
    try:
        decode = request.app[POOL].peek("decode")
    except NoPairAvailable as none:
        headers = {"Retry-After": str(none.retry_after)}
        body = error_body(none.message, NO_PAIR_AVAILABLE, 503)
        return web.json_response(body, status=503, headers=headers)
    headers = bodies.leg_headers(
        bodies.new_request_id(),
        request.headers,
        config.engine_api_key,
        config.forward_authorization,
    )
    del headers["Content-Type"]
    record = LegRecord("decode")
    record.start()
    try:
        with translate_errors(record, config.decode_timeouts):
            async with request.app[SESSIONS].pooled.get(
                decode.url + "/v1/models",
                headers=headers,
                timeout=client_timeout(config.decode_timeouts),
            ) as resp:
                raw = await resp.read()
                if not 200 <= resp.status < 300:
                    raise status_error("decode", resp.status, raw)
                content_type = resp.headers.get("Content-Type", "application/json")
                return web.Response(body=raw, headers={"Content-Type": content_type})
    except LegError as err:
        retry = None
        if err.status == 503:
            retry = {"Retry-After": str(request.app[POOL].retry_after_unreachable())}
        return web.json_response(err.body(), status=err.status, headers=retry)


async def handle_metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: the proxy's own series in Prometheus' text format."""
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
