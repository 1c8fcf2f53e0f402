# SPDX-License-Identifier: Apache-2.0
"""The proxy's own Prometheus metrics (``GET /metrics``), through ``prometheus_client``.

Events are counted as they happen (requests, legs, refusals, with latency histograms);
state is read from the pool and the admission counter at scrape time (engines in
service, legs in flight, each pair's state and failures), so nothing is kept twice.
Each application has its own registry: several proxies in one process (tests) do not
share series. docs/proxy.md lists every series.

With ``--workers N`` (:mod:`vllm_ext.proxy.workers`) each worker counts its events in
prometheus_client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, set by the
supervisor) and publishes its state every :data:`STATE_PERIOD_S` seconds; whichever
worker answers a scrape sums the events of every worker (its
``MultiProcessCollector``) and the states (:func:`state_families`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from vllm_ext.proxy.pairs import PAIR_STATES

if TYPE_CHECKING:
    from vllm_ext.proxy.legs import LegRecord
    from vllm_ext.proxy.pool import Pool

PREFIX = "vllm_ext_proxy"
#: request latency buckets (seconds): from a rejected request to a long generation
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: leg latency buckets (seconds): a prefill leg is short, a decode leg as long as its answer
LEG_BUCKETS = REQUEST_BUCKETS
#: time-to-first-token buckets (seconds): P's prefill, the KV hand-off and D's first step
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2.5, 5, 10, 30, 60, 120)
#: ``reason`` values of ``vllm_ext_proxy_rejected_total``
REJECT_REASONS = ("over_capacity", "unauthorized", "no_engine", "engine_unreachable", "bad_request")


#: how often a worker of ``--workers N`` writes its state for the others' scrapes (seconds)
STATE_PERIOD_S = 1.0
#: a worker's state file older than this is left out of a scrape (its worker is gone)
STATE_STALE_S = 10 * STATE_PERIOD_S


def state_snapshot(pool: Pool, admission: Callable[[], dict[str, int]]) -> dict[str, Any]:
    """The state series of one proxy process as plain data (JSON for other workers)."""
    adm = admission()
    now = time.monotonic()
    pairs = []
    for pair in pool.pairs.values():
        pair.refresh(now)
        pairs.append(
            [pair.prefill, pair.decode, pair.state, pair.transfer_failures, pair.times_backed_off]
        )
    return {
        "in_flight": adm["in_flight"],
        "max_in_flight": adm["max_in_flight"],
        "engines": {role: len(backends) for role, backends in pool.backends.items()},
        "backends": [
            [role, b.name, 1.0 if b.up else 0.0, b.in_flight]
            for role, backends in pool.backends.items()
            for b in backends
        ],
        "pairs": pairs,
    }


def state_families(snapshots: list[dict[str, Any]]) -> Iterator[Metric]:
    """The state series of one process's snapshot, or of several workers' summed: requests
    and legs in flight, limits, failures and back-offs add up; an engine is up where
    every worker has it in service, ``engines`` the most any worker knows; a pair's
    state is the number of workers that see it in each state (1 for one process)."""
    yield GaugeMetricFamily(
        f"{PREFIX}_in_flight",
        "Client requests in flight through the proxy",
        sum(s["in_flight"] for s in snapshots),
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_max_in_flight",
        "Requests in flight past which new ones get 429 (0: no limit; with --workers, the "
        "sum of the workers' limits)",
        sum(s["max_in_flight"] for s in snapshots),
    )
    up: dict[tuple[str, str], float] = {}
    legs: dict[tuple[str, str], float] = {}
    engines: dict[str, int] = {}
    states: dict[tuple[str, str], dict[str, int]] = {}
    failures: dict[tuple[str, str], int] = {}
    backoffs: dict[tuple[str, str], int] = {}
    for snap in snapshots:
        for role, n in snap["engines"].items():
            engines[role] = max(engines.get(role, 0), n)
        for role, name, is_up, in_flight in snap["backends"]:
            up[role, name] = min(up.get((role, name), 1.0), is_up)
            legs[role, name] = legs.get((role, name), 0) + in_flight
        for prefill, decode, state, failed, backed_off in snap["pairs"]:
            counts = states.setdefault((prefill, decode), dict.fromkeys(PAIR_STATES, 0))
            counts[state] = counts.get(state, 0) + 1
            failures[prefill, decode] = failures.get((prefill, decode), 0) + failed
            backoffs[prefill, decode] = backoffs.get((prefill, decode), 0) + backed_off
    up_f = GaugeMetricFamily(
        f"{PREFIX}_engine_up", "1 while the engine is in service", labels=["role", "engine"]
    )
    legs_f = GaugeMetricFamily(
        f"{PREFIX}_engine_legs_in_flight",
        "Legs this proxy has in flight on the engine",
        labels=["role", "engine"],
    )
    for key, value in up.items():
        up_f.add_metric(list(key), value)
        legs_f.add_metric(list(key), legs[key])
    engines_f = GaugeMetricFamily(
        f"{PREFIX}_engines", "Engines the proxy knows (configured or discovered)", labels=["role"]
    )
    for role, n in engines.items():
        engines_f.add_metric([role], n)
    yield from (up_f, legs_f, engines_f)
    state_f = GaugeMetricFamily(
        f"{PREFIX}_pair_state",
        "1 for the state each P-D pair is in (healthy, backed-off, probing); with --workers, "
        "the number of workers that see it in that state",
        labels=["prefill", "decode", "state"],
    )
    failures_f = CounterMetricFamily(
        f"{PREFIX}_pair_transfer_failures",
        "Transfer failures of the pair (they back it off)",
        labels=["prefill", "decode"],
    )
    backoffs_f = CounterMetricFamily(
        f"{PREFIX}_pair_backoffs", "Times the pair was backed off", labels=["prefill", "decode"]
    )
    for key, counts in states.items():
        for name in PAIR_STATES:
            state_f.add_metric([*key, name], float(counts.get(name, 0)))
        failures_f.add_metric(list(key), failures[key])
        backoffs_f.add_metric(list(key), backoffs[key])
    yield from (state_f, failures_f, backoffs_f)
    if len(snapshots) > 1:
        yield GaugeMetricFamily(
            f"{PREFIX}_workers", "Worker processes whose series this scrape sums", len(snapshots)
        )


class _StateCollector(Collector):
    """Series read from the proxy's state at each scrape (with ``state_dir``: summed
    with the other workers' last published states)."""

    def __init__(
        self, pool: Pool, admission: Callable[[], dict[str, int]], state_dir: str | None = None
    ) -> None:
        self._pool = pool
        self._admission = admission
        self._dir = state_dir

    def snapshot(self) -> dict[str, Any]:
        return state_snapshot(self._pool, self._admission)

    def collect(self) -> Iterator[Metric]:
        snapshots = [self.snapshot()]
        if self._dir is not None:
            snapshots += read_states(self._dir, exclude=os.getpid())
        yield from state_families(snapshots)


def state_path(state_dir: str, pid: int) -> str:
    return os.path.join(state_dir, f"state_{pid}.json")


def write_state(state_dir: str, snapshot: dict[str, Any]) -> None:
    """Publish this worker's state (atomically: a reader sees the old or the new file)."""
    path = state_path(state_dir, os.getpid())
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(snapshot, f)
    os.replace(tmp, path)


def read_states(state_dir: str, exclude: int) -> list[dict[str, Any]]:
    """The other workers' published states, those fresher than :data:`STATE_STALE_S`."""
    out = []
    now = time.time()
    for name in os.listdir(state_dir):
        if not (name.startswith("state_") and name.endswith(".json")):
            continue
        if name == f"state_{exclude}.json":
            continue
        path = os.path.join(state_dir, name)
        try:
            if now - os.stat(path).st_mtime > STATE_STALE_S:
                continue
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            continue  # its worker is just exiting or writing
    return out


class ProxyMetrics:
    """The series of one proxy application; :meth:`render` is the ``/metrics`` body."""

    def __init__(
        self,
        pool: Pool,
        admission: Callable[[], dict[str, int]],
        multiprocess_dir: str | None = None,
    ) -> None:
        #: the folder shared by the workers of ``--workers N``; ``None``: one process
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Client requests answered, by path and HTTP status (499: the client went away)",
            ["path", "code"],
            registry=reg,
        )
        self.request_seconds = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "Time from a client request's arrival to its answer's end",
            ["path"],
            buckets=REQUEST_BUCKETS,
            registry=reg,
        )
        self.ttft_seconds = Histogram(
            f"{PREFIX}_ttft_seconds",
            "Streamed requests: time from a client request's arrival to the first bytes of "
            "D's stream sent to the client (its first token)",
            ["path"],
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.legs = Counter(
            f"{PREFIX}_legs",
            "Legs sent, by leg, engine and outcome (HTTP status, timeout, error, cancelled)",
            ["leg", "engine", "outcome"],
            registry=reg,
        )
        self.leg_seconds = Histogram(
            f"{PREFIX}_leg_duration_seconds",
            "Time of one leg, from sending it to its last byte",
            ["leg"],
            buckets=LEG_BUCKETS,
            registry=reg,
        )
        self.rejected = Counter(
            f"{PREFIX}_rejected",
            "Requests refused without an answer from D, by reason",
            ["reason"],
            registry=reg,
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self.discovery_failures = Counter(
            f"{PREFIX}_discovery_failures",
            "DNS look-ups of engines that failed (the last known engines are kept)",
            ["role"],
            registry=reg,
        )
        self.state = _StateCollector(pool, admission, multiprocess_dir)
        if multiprocess_dir is None:
            reg.register(self.state)
            self._scraped = reg
        else:
            self._scraped = CollectorRegistry()
            MultiProcessCollector(self._scraped, path=multiprocess_dir)
            self._scraped.register(self.state)

    def request_done(self, path: str, code: str, seconds: float) -> None:
        self.requests.labels(path, code).inc()
        self.request_seconds.labels(path).observe(seconds)

    def first_byte(self, path: str, seconds: float) -> None:
        self.ttft_seconds.labels(path).observe(seconds)

    def leg_done(self, record: LegRecord, engine: str) -> None:
        seconds = record.seconds()
        if seconds is None:
            return  # never sent
        self.legs.labels(record.name, engine, record.outcome).inc()
        self.leg_seconds.labels(record.name).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self._scraped)

    async def publish_state(self) -> None:
        """With ``--workers``: publish this worker's state for the others' scrapes, every
        :data:`STATE_PERIOD_S` seconds until cancelled, then withdraw it."""
        assert self.multiprocess_dir is not None
        try:
            while True:
                write_state(self.multiprocess_dir, self.state.snapshot())
                await asyncio.sleep(STATE_PERIOD_S)
        finally:
            with contextlib.suppress(OSError):
                os.remove(state_path(self.multiprocess_dir, os.getpid()))
