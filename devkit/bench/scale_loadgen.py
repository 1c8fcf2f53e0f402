# SPDX-License-Identifier: Apache-2.0
"""The load generator of the proxy-at-scale benchmark, in its own process.

    python -m devkit.bench.scale_loadgen     # then one JSON command per stdin line

:mod:`devkit.bench.scale_proxy` starts it once and writes one :class:`Command` per
line; for each it answers one JSON line (:func:`run_point`'s result). A point is a
closed loop: ``concurrency`` workers, each sending ``per_worker`` streamed requests
one after the other over one shared keep-alive session (no connection limit). Each
worker's first request opens its connection and warms the target's pools; it is not
counted. Then worker ``i`` waits ``i / concurrency`` of ``stagger_s`` (one stream's
length) before its counted requests: the streams in flight are spread over a stream's
length as in a steady flow of requests, not sent in bursts of ``concurrency`` at once
(a closed loop of equal streams keeps its workers in step, and a burst makes the last
request of it wait for every other request's set-up, whatever the load).

Per request it records the time to the first byte of the answer's body (the first
SSE event: the time to first token) and to its end, and checks that the answer
carried ``expect_tokens`` events and ``[DONE]`` (else it counts as an error).

That it is not the bottleneck is measured, not assumed: each point also reports the
process's CPU use over the point (CPU seconds per wall second: near 1.0 means this
process, single-threaded, was saturated) and the lag of its event loop (how late a
5 ms timer fires: a loaded loop also delays reading the answers it times).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from devkit.bench.fake_engines import new_loop

#: the period of the event-loop lag probe
LAG_PERIOD_S = 0.005


@dataclass
class Command:
    url: str
    concurrency: int
    per_worker: int
    body: dict[str, Any]
    expect_tokens: int
    path: str = "/v1/completions"
    stagger_s: float = 0.0


@dataclass
class _Tally:
    ttft: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 3:
            self.error_samples.append(what[:300])


async def _one(
    session: aiohttp.ClientSession, cmd: Command, data: bytes, tally: _Tally | None
) -> None:
    sent = time.perf_counter()
    first: float | None = None
    chunks: list[bytes] = []
    try:
        async with session.post(
            cmd.url + cmd.path, data=data, headers={"Content-Type": "application/json"}
        ) as resp:
            async for chunk in resp.content.iter_any():
                if first is None:
                    first = time.perf_counter()
                chunks.append(chunk)
            ended = time.perf_counter()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        if tally is not None:
            tally.error(f"{type(exc).__name__}: {exc}")
        return
    if tally is None:
        return
    raw = b"".join(chunks)
    events = raw.count(b"data: {")
    if status != 200 or events != cmd.expect_tokens or not raw.rstrip().endswith(b"[DONE]"):
        tally.error(f"HTTP {status}, {events} events: {raw[:200]!r}")
        return
    assert first is not None
    tally.ttft.append(first - sent)
    tally.total.append(ended - sent)


async def _lag_probe(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        planned = time.perf_counter() + LAG_PERIOD_S
        await asyncio.sleep(LAG_PERIOD_S)
        lags.append(max(0.0, time.perf_counter() - planned))


def _quantiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p99": None, "max": None}
    s = sorted(xs)
    return {
        "p50": statistics.median(s),
        "p99": s[min(len(s) - 1, round(0.99 * (len(s) - 1)))],
        "max": s[-1],
    }


async def run_point(cmd: Command) -> dict[str, Any]:
    """One point (see the module docstring); the samples are in seconds."""
    data = json.dumps(cmd.body).encode()
    tally = _Tally()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=300)
    lags: list[float] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker(i: int) -> None:
            await _one(session, cmd, data, None)  # warm-up: not counted
            await asyncio.sleep(cmd.stagger_s * i / cmd.concurrency)
            for _ in range(cmd.per_worker):
                await _one(session, cmd, data, tally)

        probe = asyncio.create_task(_lag_probe(lags, stop))
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(cmd.concurrency)))
        wall = time.perf_counter() - wall0
        cpu = time.process_time() - cpu0
        stop.set()
        await probe
    return {
        "ttft": tally.ttft,
        "total": tally.total,
        "errors": tally.errors,
        "error_samples": tally.error_samples,
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_per_wall": cpu / wall if wall > 0 else None,
        "loop_lag_s": _quantiles(lags),
    }


def main() -> int:
    """Answer each command line of stdin with one result line on stdout."""
    loop = new_loop()
    asyncio.set_event_loop(loop)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = Command(**json.loads(line))
        result = loop.run_until_complete(run_point(cmd))
        print(json.dumps(result), flush=True)
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
