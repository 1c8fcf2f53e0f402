# SPDX-License-Identifier: Apache-2.0
"""Running the proxy until a signal, and draining it (SPEC S-PRX-1).

On SIGTERM (what Kubernetes sends a pod it removes) the proxy:

1. says at once it is not ready: ``/health`` answers 503 (``status: draining``),
   so the Service stops sending it new requests once its endpoints are updated,
   and every answer from then on closes its connection;
2. keeps accepting and serving new requests for ``shutdown_delay`` seconds (default
   none; behind a Service, the time its endpoints take to follow: requests still
   routed to the proxy meanwhile are served, not refused);
3. stops listening and lets the requests in flight finish, until
   ``shutdown_grace`` seconds after the signal; those still running then are cut
   (a stream ends without ``[DONE]``, its legs are cancelled on the engines);
4. exits (status 0).

SIGINT (Ctrl-C) skips step 2. A second signal of either kind cuts what is in flight
and exits at once.

A worker of ``--workers N`` (:mod:`vllm_ext.proxy.workers`) binds its port with
``SO_REUSEPORT`` beside its siblings, and drains as on SIGTERM when its supervisor
is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

from aiohttp import web

from vllm_ext.proxy.app import ADMISSION, DRAIN

logger = logging.getLogger("vllm.ext.proxy")

#: how often the drain looks whether the requests in flight are done (seconds)
_POLL = 0.05


async def serve(
    app: web.Application,
    host: str,
    port: int,
    delay: float,
    grace: float,
    worker: bool = False,
) -> None:
    """Serve ``app`` on ``host:port`` until SIGTERM or SIGINT, then drain as the module
    docstring says (``delay``: seconds still accepting; ``grace``: seconds to exit;
    ``worker``: one of several processes on the port)."""
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, handle_signals=False, shutdown_timeout=0.5
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=worker or None)
    await site.start()
    signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    orphan = asyncio.create_task(_watch_parent(signals)) if worker else None
    try:
        first = await signals.get()
        started = time.monotonic()
        app[DRAIN].begin()
        accept = delay if first == signal.SIGTERM else 0.0
        logger.warning(
            "%s: draining: /health says 503 now; accepting new requests for %gs, then "
            "finishing the %d in flight within %gs of the signal",
            first.name,
            accept,
            app[ADMISSION].in_flight,
            grace,
        )
        if await _signalled(signals, accept):
            logger.warning("second signal: cutting the requests in flight")
        else:
            await site.stop()  # no new connection from here on
            left = await _in_flight_done(app, signals, started + grace)
            if left:
                logger.warning(
                    "drain: %d requests still in flight %gs after the signal: cut",
                    left,
                    time.monotonic() - started,
                )
            else:
                logger.warning(
                    "drain: nothing in flight %.1fs after the signal", time.monotonic() - started
                )
    finally:
        if orphan is not None:
            orphan.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()


async def _watch_parent(signals: asyncio.Queue[signal.Signals], period: float = 0.5) -> None:
    """A worker whose supervisor is gone (its parent changed) drains as on SIGTERM."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(period)
    logger.warning("the proxy's supervisor (pid %d) is gone: draining", parent)
    signals.put_nowait(signal.SIGTERM)


async def _signalled(signals: asyncio.Queue[signal.Signals], seconds: float) -> bool:
    """Wait ``seconds``; whether a signal came meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(signals.get(), max(0.0, seconds))
        return True
    return False


async def _in_flight_done(
    app: web.Application, signals: asyncio.Queue[signal.Signals], deadline: float
) -> int:
    """Wait until no client request is in flight, the deadline passes or a signal
    comes; the number still in flight then."""
    admission = app[ADMISSION]
    while admission.in_flight and time.monotonic() < deadline:
        if await _signalled(signals, min(_POLL, deadline - time.monotonic())):
            logger.warning("second signal: cutting the requests in flight")
            break
    return admission.in_flight
