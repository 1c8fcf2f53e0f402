# SPDX-License-Identifier: Apache-2.0
"""Push metrics: every counter the code increments is declared (so Prometheus exports
it), failures are one counter with a ``reason`` label, gauges add up over TP ranks."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

import vllm_ext.nixl_push as pkg
from vllm_ext.nixl_push.lifecycle import Answer
from vllm_ext.nixl_push.matching import _Indexes
from vllm_ext.nixl_push.stats import (
    COUNTERS,
    FAILURE_KEYS,
    FAILURE_REASONS,
    GAUGES,
    HISTOGRAMS,
    PushGauges,
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
    declared = set(COUNTERS) | set(FAILURE_KEYS)
    assert literal | formatted <= declared, sorted((literal | formatted) - declared)
    assert not set(COUNTERS) & set(FAILURE_KEYS), "a failure is counted under its reason"
    assert set(FAILURE_KEYS) <= literal, sorted(set(FAILURE_KEYS) - literal)


def test_every_help_text_says_something() -> None:
    texts = {**COUNTERS, **GAUGES, **{k: h.help for k, h in HISTOGRAMS.items()}}
    texts.update({f"reason {r}": t for r, t in FAILURE_REASONS.items()})
    for key, text in texts.items():
        assert key not in text and len(text.split()) >= 4, (key, text)


def _prom() -> tuple[PushPromMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    return PushPromMetrics(config, types, ["engine"], {0: ["0"]}), registry


def test_prometheus_exports_one_failure_counter_with_a_reason_label() -> None:
    prom, registry = _prom()
    stats = PushKVConnectorStats()
    stats.merge(
        {"push_failed_write_timeout": [1, 1], "push_failed_handshake": [1], "push_writes": [3]}
    )
    prom.observe(stats.data, 0)
    text = generate_latest(registry).decode()
    assert 'vllm:ext_push_failures_total{engine="0",reason="write_timeout"} 2.0' in text
    assert 'vllm:ext_push_failures_total{engine="0",reason="handshake"} 1.0' in text
    assert 'vllm:ext_push_failures_total{engine="0",reason="internal"} 0.0' in text
    assert 'vllm:ext_push_writes_total{engine="0"} 3.0' in text
    assert "push_failed_" not in text
    assert stats.reduce()["Push failures"] == 3
    for key, doc in COUNTERS.items():
        assert f"# HELP vllm:ext_{key}_total {doc}\n" in text


def test_gauges_add_up_over_ranks_and_reports() -> None:
    """Two TP ranks report their levels as changes; vLLM concatenates the ranks' stats
    of a step (``aggregate``) and Prometheus adds every step's: the exported level is
    the sum of the ranks' levels, also when a rank reports nothing in some step."""
    prom, registry = _prom()
    levels = [0, 0]
    ranks = [PushGauges({"push_writes_in_flight": functools.partial(levels.__getitem__, i)})
             for i in range(2)]  # fmt: skip

    def step() -> float:
        per_rank = []
        for g in ranks:
            s = PushKVConnectorStats()
            s.merge(g.drain())
            per_rank.append(s)
        merged = per_rank[0].aggregate(per_rank[1])
        if not merged.is_empty():
            prom.observe(merged.data, 0)
        m = re.search(r'^vllm:ext_push_writes_in_flight\{engine="0"\} (\S+)$',
                      generate_latest(registry).decode(), re.M)  # fmt: skip
        assert m is not None
        return float(m.group(1))

    assert step() == 0
    levels[0], levels[1] = 3, 2
    assert step() == 5
    assert step() == 5  # nothing changed: nothing reported, the level stays
    levels[0] = 1
    assert step() == 3
    levels[0], levels[1] = 0, 0
    assert step() == 0


def test_an_undeclared_gauge_is_refused() -> None:
    try:
        PushGauges({"push_made_up": lambda: 0})
    except ValueError as e:
        assert "push_made_up" in str(e)
    else:
        raise AssertionError("an undeclared gauge was accepted")


def test_the_metrics_reference_names_every_metric() -> None:
    doc = (Path(pkg.__file__).parents[2] / "docs" / "metrics.md").read_text()
    names = [f"`vllm:ext_{k}_total`" for k in COUNTERS]
    names += [f"`vllm:ext_{k}`" for k in (*GAUGES, *HISTOGRAMS)]
    names += [f"| `{reason}` |" for reason in FAILURE_REASONS]
    missing = [n for n in names if n not in doc]
    assert not missing, f"docs/metrics.md lacks {missing}"
