# SPDX-License-Identifier: Apache-2.0
"""The proxy's own Prometheus metrics (``GET /metrics``), through ``prometheus_client``.

Events are counted as they happen (requests, legs, refusals, with latency histograms);
state is read from the pool and the admission counter at scrape time (engines in
service, legs in flight, each pair's state and failures), so nothing is kept twice.
Each application has its own registry: several proxies in one process (tests) do not
share series. docs/proxy.md lists every series.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
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


class _StateCollector(Collector):
    """Series read from the proxy's state at each scrape."""

    def __init__(self, pool: Pool, admission: Callable[[], dict[str, int]]) -> None:
        self._pool = pool
        self._admission = admission

    def collect(self) -> Iterator[Metric]:
        adm = self._admission()
        yield GaugeMetricFamily(
            f"{PREFIX}_in_flight", "Client requests in flight through the proxy", adm["in_flight"]
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_max_in_flight",
            "Requests in flight past which new ones get 429 (0: no limit)",
            adm["max_in_flight"],
        )
        up = GaugeMetricFamily(
            f"{PREFIX}_engine_up", "1 while the engine is in service", labels=["role", "engine"]
        )
        legs = GaugeMetricFamily(
            f"{PREFIX}_engine_legs_in_flight",
            "Legs this proxy has in flight on the engine",
            labels=["role", "engine"],
        )
        engines = GaugeMetricFamily(
            f"{PREFIX}_engines",
            "Engines the proxy knows (configured or discovered)",
            labels=["role"],
        )
        for role, backends in self._pool.backends.items():
            engines.add_metric([role], len(backends))
            for b in backends:
                up.add_metric([role, b.name], 1.0 if b.up else 0.0)
                legs.add_metric([role, b.name], b.in_flight)
        yield from (up, legs, engines)
        state = GaugeMetricFamily(
            f"{PREFIX}_pair_state",
            "1 for the state each P-D pair is in (healthy, backed-off, probing)",
            labels=["prefill", "decode", "state"],
        )
        failures = CounterMetricFamily(
            f"{PREFIX}_pair_transfer_failures",
            "Transfer failures of the pair (they back it off)",
            labels=["prefill", "decode"],
        )
        backoffs = CounterMetricFamily(
            f"{PREFIX}_pair_backoffs", "Times the pair was backed off", labels=["prefill", "decode"]
        )
        now = time.monotonic()
        for pair in self._pool.pairs.values():
            pair.refresh(now)
            for name in PAIR_STATES:
                state.add_metric([pair.prefill, pair.decode, name], float(pair.state == name))
            failures.add_metric([pair.prefill, pair.decode], pair.transfer_failures)
            backoffs.add_metric([pair.prefill, pair.decode], pair.times_backed_off)
        yield from (state, failures, backoffs)


class ProxyMetrics:
    """The series of one proxy application; :meth:`render` is the ``/metrics`` body."""

    def __init__(self, pool: Pool, admission: Callable[[], dict[str, int]]) -> None:
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
        reg.register(_StateCollector(pool, admission))

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
        return generate_latest(self.registry)
