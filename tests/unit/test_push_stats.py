# SPDX-License-Identifier: Apache-2.0
"""Every push counter the code increments and every gauge it sets is declared (so
Prometheus exports it)."""

from __future__ import annotations

import re
from pathlib import Path

import prometheus_client
from vllm.config import VllmConfig

import vllm_ext.nixl_push as pkg
from vllm_ext.nixl_push.lifecycle import Answer
from vllm_ext.nixl_push.matching import _Indexes
from vllm_ext.nixl_push.stats import (
    COUNTERS,
    GAUGES,
    PushCounters,
    PushKVConnectorStats,
    PushPromMetrics,
)


def test_every_incremented_counter_is_declared() -> None:
    src = "\n".join(p.read_text() for p in Path(pkg.__file__).parent.glob("*.py"))
    literal = set(re.findall(r'\.inc\(\s*"([a-z_]+)"', src))
    assert literal, "the pattern found nothing"
    # the two formatted ones: f"push_match_{rule}" and f"push_notifs_{how.value}"
    formatted = {f"push_match_{rule}" for rule in _Indexes.RULES}
    formatted |= {f"push_notifs_{a.value}" for a in Answer if a is not Answer.ACCEPTED}
    assert len(re.findall(r'\.inc\(\s*f"', src)) == 2, "a new formatted counter: list it here"
    assert literal | formatted <= set(COUNTERS), sorted((literal | formatted) - set(COUNTERS))
    assert len(COUNTERS) == len(set(COUNTERS))


def test_every_gauge_set_is_declared_and_reaches_prometheus() -> None:
    """A gauge (``set_gauge``) is declared, reported only when it changed, and its
    latest value is what Prometheus shows."""
    src = "\n".join(p.read_text() for p in Path(pkg.__file__).parent.glob("*.py"))
    literal = set(re.findall(r'\.set_gauge\(\s*"([a-z_]+)"', src))
    assert literal and literal <= set(GAUGES), sorted(literal - set(GAUGES))
    counters = PushCounters()
    for value in (0, 24, 24, 48, 0, 24):
        counters.set_gauge("push_blocks_quarantined_now", value)
    assert counters.totals()["push_blocks_quarantined_now"] == 24
    stats = PushKVConnectorStats()
    stats.reset()
    stats.merge(counters.drain())
    assert stats.data["push_blocks_quarantined_now"] == [0, 24, 48, 0, 24]  # changes only
    assert not stats.is_empty()
    registry = prometheus_client.CollectorRegistry()
    types = {
        prometheus_client.Gauge: _in(registry, prometheus_client.Gauge),
        prometheus_client.Counter: _in(registry, prometheus_client.Counter),
        prometheus_client.Histogram: _in(registry, prometheus_client.Histogram),
    }
    prom = PushPromMetrics(VllmConfig(), types, ["engine"], {0: ["0"]})
    prom.observe(stats.data, 0)
    got = registry.get_sample_value("vllm:ext_push_blocks_quarantined_now", {"engine": "0"})
    assert got == 24
    stats.reset()
    prom.observe(stats.data, 0)  # no change reported: kept
    assert registry.get_sample_value("vllm:ext_push_blocks_quarantined_now", {"engine": "0"}) == 24


def _in(registry: object, cls: type) -> type:
    """``cls`` registering into ``registry`` (not the process-wide default)."""

    class Local(cls):  # type: ignore[valid-type,misc]
        def __init__(self, *args: object, multiprocess_mode: str = "", **kw: object) -> None:
            kw.setdefault("registry", registry)
            if cls is prometheus_client.Gauge and multiprocess_mode:
                kw["multiprocess_mode"] = multiprocess_mode
            super().__init__(*args, **kw)

    return Local
