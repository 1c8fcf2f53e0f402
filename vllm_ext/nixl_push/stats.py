# SPDX-License-Identifier: Apache-2.0
"""Push metrics, reported through vLLM's connector stats path.

The writer thread counts into :class:`PushCounters` (thread-safe); the engine
thread drains them into the pin's ``NixlKVConnectorStats`` each time vLLM asks
for connector stats, so they reach the CLI log line (``reduce``) and Prometheus
(``PushPromMetrics``) like vLLM's own NIXL numbers.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.v1.metrics.utils import create_metric_per_engine

#: Counters (each observation is a count to add).
COUNTERS = (
    "push_regs_sent",
    "push_regs_received",
    "push_regs_rejected",
    "push_regs_duplicate",
    "push_regs_late",
    "push_match_transfer_id",
    "push_match_exact",
    "push_match_base_id",
    "push_writes",
    "push_chunk_writes",
    "push_bytes",
    "push_completions_received",
    "push_notifs_malformed",
    "push_notifs_foreign",
    "push_notifs_duplicate",
    "push_heartbeats_sent",
    "push_heartbeats_received",
    "push_failed_handshake",
    "push_peers_forgotten",
    "push_failed_send_notif",
    "push_failed_write_submit",
    "push_failed_write_state",
    "push_failed_write_timeout",
    "push_failed_write_stuck",
    "push_failed_lease_cap",
    "push_lease_cap_pinned",
    "push_failed_descriptors",
    "push_failed_remote",
    "push_failed_lease_expired",
    "push_failed_preempted",
    "push_regs_expired",
    "push_watchdog_expired",
    "push_failed_internal",
    "push_cancels_sent",
    "push_cancels_unsent",
    "push_cancels_received",
    # No KV in the wrong blocks (docs/design.md, "Which blocks a WRITE may touch")
    "push_regs_after_cancel",
    "push_regs_unauthorized",
    "push_regs_not_replayed",
    "push_cancels_before_registration",
    "push_xfer_state_errors",
    "push_writes_unreleased",
    "push_agents_removed",
    "push_blocks_quarantined",
    "push_cancels_resent",
    "push_quarantine_expired",
    # Liveness: dead and broken peers
    "push_handshakes_backed_off",
    "push_peers_healed",
    "push_leases_renewed_queued",
)


class Histogram(NamedTuple):
    label: str  #: in the logged stats, as a p50 in ms
    help: str  #: Prometheus help text
    buckets: list[float]  #: seconds


#: Distributions (each observation is a value), as Prometheus histograms ``vllm:ext_<key>``.
HISTOGRAMS: dict[str, Histogram] = {
    "push_handoff_seconds": Histogram(
        "Push hand-off p50 (ms)",
        "vllm-ext push (P): KV final (end of the forward pass that ran the last prompt "
        "token) -> WRITE complete",
        [ms / 1e3 for ms in (0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1e3, 5e3)],
    ),
    "push_recv_wait_seconds": Histogram(
        "Push recv wait p50 (ms)",
        "vllm-ext push (D): registration handed to the writer -> the KV of every producer "
        "rank arrived (includes P's queueing and prefill)",
        [ms / 1e3 for ms in (1, 5, 10, 25, 50, 100, 250, 500, 1e3, 2.5e3, 5e3, 1e4, 3e4, 6e4)],
    ),
}
SERIES = tuple(HISTOGRAMS)
#: The base NIXL keys the writer may add to (WRITE telemetry).
BASE_SERIES = ("transfer_duration", "post_duration", "bytes_transferred", "num_descriptors")


class PushCounters:
    """Accumulates observations from any thread until drained by the engine thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, list[float | int]] = defaultdict(list)
        self._totals: dict[str, float] = defaultdict(float)

    def inc(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._data[key].append(n)
            self._totals[key] += n

    def observe(self, key: str, value: float) -> None:
        with self._lock:
            self._data[key].append(value)
            self._totals[key + ":count"] += 1

    def drain(self) -> dict[str, list[float | int]]:
        with self._lock:
            out, self._data = dict(self._data), defaultdict(list)
        return out

    def totals(self) -> dict[str, float]:
        """Lifetime totals (never reset): for tests and debugging."""
        with self._lock:
            return dict(self._totals)


class PushKVConnectorStats(NixlKVConnectorStats):
    """vLLM's NIXL stats plus the push counters (all values are lists, as vLLM expects)."""

    def reset(self) -> None:
        super().reset()
        for key in (*COUNTERS, *SERIES):
            self.data[key] = []

    def merge(self, drained: dict[str, list[float | int]]) -> None:
        for key, values in drained.items():
            self.data.setdefault(key, []).extend(values)

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(k) for k in (*COUNTERS, *SERIES))

    def aggregate(self, other: Any) -> PushKVConnectorStats:
        if not other.is_empty():
            for k, v in other.data.items():
                self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        out = super().reduce()
        writes = int(sum(self.data.get("push_writes", [])))
        out["Push WRITEs"] = writes
        out["Push MB"] = round(sum(self.data.get("push_bytes", [])) / 2**20, 3)
        for key, hist in HISTOGRAMS.items():
            values = self.data.get(key, [])
            if values:
                out[hist.label] = round(float(np.median(values)) * 1e3, 3)
        failures = sum(sum(v) for k, v in self.data.items() if k.startswith("push_failed_"))
        if failures:
            out["Push failures"] = int(failures)
        return out


class PushPromMetrics(NixlPromMetrics):
    """vLLM's NIXL Prometheus metrics plus ``vllm:ext_push_*``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:  # type: ignore[no-untyped-def]
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._push_counters: dict[str, Any] = {}
        for key in COUNTERS:
            c = self._counter_cls(
                name=f"vllm:ext_{key}", documentation=f"vllm-ext push: {key}", labelnames=labelnames
            )
            self._push_counters[key] = create_metric_per_engine(c, self.per_engine_labelvalues)
        self._push_histograms: dict[str, Any] = {}
        for key, (_, doc, buckets) in HISTOGRAMS.items():
            h = self._histogram_cls(  # type: ignore[call-arg]
                name=f"vllm:ext_{key}", documentation=doc, buckets=buckets, labelnames=labelnames
            )
            self._push_histograms[key] = create_metric_per_engine(h, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        for key, metric in self._push_counters.items():
            total = sum(transfer_stats_data.get(key, ()))
            if total:
                metric[engine_idx].inc(total)
        for key, metric in self._push_histograms.items():
            for v in transfer_stats_data.get(key, ()):
                metric[engine_idx].observe(v)
