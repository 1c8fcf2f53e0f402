# SPDX-License-Identifier: Apache-2.0
"""Push metrics, reported through vLLM's connector stats path.

The writer thread counts into :class:`PushCounters` (thread-safe); the engine
thread drains them into the pin's ``NixlKVConnectorStats`` each time vLLM asks
for connector stats, so they reach the CLI log line (``reduce``) and Prometheus
(``PushPromMetrics``) like vLLM's own NIXL numbers. Levels (gauges) are read on
the engine thread by :class:`PushGauges` and travel as changes, so that vLLM's sum
over TP ranks and steps gives the engine's level. docs/metrics.md lists them all.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.v1.metrics.utils import create_metric_per_engine

#: Prometheus names are ``vllm:ext_<key>`` (counters get ``_total`` appended).
PROM_PREFIX = "vllm:ext_"

#: Counters (each observation is a count to add): key -> Prometheus help text.
#: "P" / "D": the side that counts it. Every count is per TP rank (an engine's
#: metric is the sum over its ranks).
COUNTERS: dict[str, str] = {
    "push_regs_sent": "D: requests whose registration (PUSH_REG) reached every producer rank",
    "push_regs_resent": (
        "D: registrations sent again over a new connection after the send to every "
        "producer rank failed (a restarted P)"
    ),
    "push_regs_received": "P: registrations (PUSH_REG) received from D ranks",
    "push_regs_rejected": "P: registrations dropped as malformed",
    "push_regs_duplicate": "P: registrations dropped because the same one is waiting or served",
    "push_regs_late": "P: registrations that came after P freed the request's KV (D is told)",
    "push_regs_ended_on_heal": (
        "P: registrations (waiting, or matched and not posted) ended because P dropped its "
        "failed connection to their D (D is answered over a new one)"
    ),
    "push_peer_hosts_refused": (
        "P: connections to a D host outside push_peer_hosts refused (named by a PUSH_REG or "
        "PUSH_CANCEL)"
    ),
    "push_regs_taken": (
        "P: registrations whose P request serves another request of the same D engine and "
        "rank (D is told)"
    ),
    "push_regs_engine_id_shared": (
        "P: registrations refused because another D engine uses their engine id (D is told)"
    ),
    "push_d_engine_ids_shared": (
        "P: D engine ids and ranks that proved to be used by two engines at once (a "
        "configuration slip, logged as an error)"
    ),
    "push_match_transfer_id": "P: registrations matched to a request by the leg's transfer id",
    "push_match_exact": "P: registrations matched to a request by its request id",
    "push_match_base_id": "P: registrations matched by the request id without vLLM's suffix",
    "push_writes": "P: final WRITEs posted (one per request, P rank and D rank it serves)",
    "push_chunk_writes": "P: chunk WRITEs posted while the prompt was still prefilling",
    "push_bytes": "P: bytes posted in WRITEs (final and chunk)",
    "push_completions_received": "D: WRITE completions accepted from producer ranks",
    "push_notifs_malformed": "Both: push notifications dropped as malformed",
    "push_notifs_foreign": "Both: push notifications dropped: not from the request's peer agent",
    "push_notifs_duplicate": "D: producer answers dropped: that producer answered already",
    "push_heartbeats_sent": "P: renewals (PUSH_HB) sent for registrations of waiting requests",
    "push_heartbeats_received": "D: renewals (PUSH_HB) accepted from producer ranks",
    "push_peers_forgotten": "Both: peers whose agents and layouts were dropped (to handshake anew)",
    "push_lease_cap_pinned": "P: requests past the lease cap kept: a running WRITE reads them",
    "push_regs_expired": (
        "P: registrations dropped after waiting too long for their request's KV, or once "
        "the P request that awaited them ended without it"
    ),
    "push_watchdog_expired": "D: requests whose wait for KV expired (watchdog)",
    "push_cancels_sent": "D: cancels (PUSH_CANCEL) sent to producers",
    "push_cancels_unsent": "D: requests cancelled before their registration went out",
    "push_cancels_received": "P: cancels (PUSH_CANCEL) accepted",
    "push_regs_after_cancel": "P: registrations refused because D cancelled them before (a replay)",
    "push_regs_unauthorized": "P: registrations refused: the leg's secret was missing or wrong",
    "push_regs_prompt_mismatch": "P: registrations refused: their request's prompt is not D's",
    "push_notifs_forged": "Both: forged notifications dropped (D: no token; P: HB without proof)",
    "push_regs_not_replayed": "D: registrations not sent: cancelled while the handshake ran",
    "push_cancels_before_registration": "P: cancels for a registration P never stored",
    "push_xfer_state_errors": "P: NIXL state queries that raised (the transfer is asked again)",
    "push_writes_unreleased": "P: given-up WRITEs NIXL may still run (held until NIXL ends them)",
    "push_agents_removed": "Both: peer NIXL agents removed (the peer restarted or is unreachable)",
    "push_requests_quarantined": "D: requests whose blocks entered quarantine (a producer silent)",
    "push_cancels_resent": "D: cancels re-sent to producers that had not answered",
    "push_quarantine_expired": "D: quarantines ended by the push_quarantine_s bound",
    "push_producers_lost": "D: silent producers known gone (unreachable past the bound, N-LIV-1)",
    "push_producers_refused": "D: re-asks whose producer's side channel refused (not proof)",
    "push_handshakes_backed_off": "Both: requests failed at once: the peer's handshake just failed",
    "push_peers_healed": "P: peers reconnected after a failed notification",
    "push_leases_renewed_queued": "P: leases renewed for requests D still waits on (queued P legs)",
}

#: Why a push failed: reason -> help. Counted internally as ``push_failed_<reason>``,
#: exported as one counter ``vllm:ext_push_failures_total{reason=...}``.
FAILURE_REASONS: dict[str, str] = {
    "handshake": "a NIXL handshake with the peer failed",
    "send_notif": "a push notification could not be sent",
    "write_submit": "P: NIXL refused to post a WRITE",
    "write_state": "P: NIXL reported a WRITE failed",
    "write_timeout": "P: a WRITE was not done within push_write_timeout_s (given up)",
    "write_stuck": "P: a given-up WRITE NIXL still runs after the release bound",
    "lease_cap": "P: blocks freed at the hard cap on lease extensions",
    "descriptors": "P: a WRITE's descriptors could not be built (layouts do not fit)",
    "remote": "D: a producer reported a failed push (PUSH_FAIL)",
    "lease_expired": "P: vLLM's lease on the blocks ended before the WRITE",
    "preempted": "P: vLLM preempted an announced request before its WRITE was posted",
    "internal": "an unexpected error in the push writer (a bug: see the log)",
}
FAILURE_PREFIX = "push_failed_"
FAILURE_KEYS = tuple(FAILURE_PREFIX + reason for reason in FAILURE_REASONS)
FAILURES_METRIC = "push_failures"

#: Levels, per TP rank: key -> help. Sampled on the engine thread at each stats report.
GAUGES: dict[str, str] = {
    "push_writes_in_flight": "P: WRITEs NIXL may be moving bytes for now (final and chunk)",
    "push_regs_pending": "P: registrations from D waiting for their request's KV or a match",
    "push_recvs_pending": "D: requests waiting for KV from P (quarantined ones included)",
    "push_leases_held": "P: finished requests whose KV blocks P holds for D",
    "push_blocks_quarantined_now": (
        "D: blocks held for requests whose producers may still write into them "
        "(quarantined; freed when each answers or is known gone, N-LIV-1)"
    ),
}


class Histogram(NamedTuple):
    label: str  #: in the logged stats, as a p50 in ms
    help: str  #: Prometheus help text
    buckets: list[float]  #: seconds


#: Distributions (each observation is a value), as Prometheus histograms ``vllm:ext_<key>``.
HISTOGRAMS: dict[str, Histogram] = {
    "push_handoff_seconds": Histogram(
        "Push hand-off p50 (ms)",
        "P: KV final (end of the forward pass that ran the last prompt token) -> the "
        "request's final WRITE complete, per P rank",
        [ms / 1e3 for ms in (0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1e3, 5e3)],
    ),
    "push_recv_wait_seconds": Histogram(
        "Push recv wait p50 (ms)",
        "D: registration handed to the writer -> the KV of every producer rank arrived "
        "(includes P's queueing and prefill), per D rank",
        [ms / 1e3 for ms in (1, 5, 10, 25, 50, 100, 250, 500, 1e3, 2.5e3, 5e3, 1e4, 3e4, 6e4)],
    ),
}
SERIES = tuple(HISTOGRAMS)
#: Every push key of the stats' data (counters, failures, gauge changes, histograms).
PUSH_KEYS = (*COUNTERS, *FAILURE_KEYS, *GAUGES, *SERIES)
_PUSH_KEY_SET = frozenset(PUSH_KEYS)
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
        if not self._data:  # nothing counted: no allocation (a count racing in is next)
            return {}
        with self._lock:
            out, self._data = self._data, defaultdict(list)
        return out

    def totals(self) -> dict[str, float]:
        """Lifetime totals (never reset): for tests and debugging."""
        with self._lock:
            return dict(self._totals)


class PushGauges:
    """One TP rank's levels (:data:`GAUGES`), read on the engine thread when vLLM asks
    for stats, and reported as the change since the last report: vLLM adds the stats
    of every rank and step, so the changes add up to the engine's level."""

    def __init__(self, readers: Mapping[str, Callable[[], int]]) -> None:
        unknown = set(readers) - set(GAUGES)
        if unknown:
            raise ValueError(f"undeclared push gauges: {sorted(unknown)} (declare them in GAUGES)")
        self._readers = dict(readers)
        self._reported: dict[str, int] = dict.fromkeys(readers, 0)

    def levels(self) -> dict[str, int]:
        return {key: int(read()) for key, read in self._readers.items()}

    def drain(self) -> dict[str, list[float | int]]:
        out: dict[str, list[float | int]] = {}
        reported = self._reported
        for key, read in self._readers.items():
            level = int(read())
            if level != reported[key]:
                out[key] = [level - reported[key]]
                reported[key] = level
        return out


class PushKVConnectorStats(NixlKVConnectorStats):
    """vLLM's NIXL stats plus the push keys (all values are lists, as vLLM expects)."""

    # A push key is in ``data`` only once something was observed under it (every
    # reader uses ``data.get``): a report with nothing of push allocates nothing more.
    def merge(self, drained: dict[str, list[float | int]]) -> None:
        data = self.data
        for key, values in drained.items():
            if (have := data.get(key)) is None:
                data[key] = values
            else:
                have.extend(values)

    def is_empty(self) -> bool:
        if not super().is_empty():
            return False
        return not any(v for k, v in self.data.items() if k in _PUSH_KEY_SET)

    def clone_and_reset(self) -> PushKVConnectorStats:
        """vLLM's (a shallow copy that keeps the data, then ``reset``), without
        ``copy.copy``'s generic protocol: this runs at every step that counted."""
        old = object.__new__(type(self))
        old.__dict__.update(self.__dict__)
        self.reset()
        return old

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
        failures = sum(sum(self.data.get(k, ())) for k in FAILURE_KEYS)
        if failures:
            out["Push failures"] = int(failures)
        return out


class PushPromMetrics(NixlPromMetrics):
    """vLLM's NIXL Prometheus metrics plus ``vllm:ext_push_*`` (docs/metrics.md)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:  # type: ignore[no-untyped-def]
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        per_engine = self.per_engine_labelvalues
        #: stats key -> engine index -> the metric child its sum is added to
        self._push_sums: dict[str, dict[int, Any]] = {}
        for key, doc in COUNTERS.items():
            c = self._counter_cls(name=PROM_PREFIX + key, documentation=doc, labelnames=labelnames)
            self._push_sums[key] = create_metric_per_engine(c, per_engine)
        failures = self._counter_cls(
            name=PROM_PREFIX + FAILURES_METRIC,
            documentation="Both: pushes that failed, by reason (docs/metrics.md)",
            labelnames=[*labelnames, "reason"],
        )
        for reason in FAILURE_REASONS:  # every reason exported from the start, at 0
            self._push_sums[FAILURE_PREFIX + reason] = {
                idx: failures.labels(*values, reason) for idx, values in per_engine.items()
            }
        for key, doc in GAUGES.items():
            g = self._gauge_cls(  # type: ignore[call-arg]
                name=PROM_PREFIX + key,
                documentation=doc,
                labelnames=labelnames,
                multiprocess_mode="livesum",
            )
            self._push_sums[key] = create_metric_per_engine(g, per_engine)  # changes add up
        self._push_histograms: dict[str, Any] = {}
        for key, (_, doc, buckets) in HISTOGRAMS.items():
            h = self._histogram_cls(  # type: ignore[call-arg]
                name=PROM_PREFIX + key, documentation=doc, buckets=buckets, labelnames=labelnames
            )
            self._push_histograms[key] = create_metric_per_engine(h, per_engine)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        for key, metric in self._push_sums.items():
            total = sum(transfer_stats_data.get(key, ()))
            if total:
                metric[engine_idx].inc(total)
        for key, metric in self._push_histograms.items():
            for v in transfer_stats_data.get(key, ()):
                metric[engine_idx].observe(v)
