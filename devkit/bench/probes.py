# SPDX-License-Identifier: Apache-2.0
"""What the benchmark reads from the engines: Prometheus connector metrics, idle CPU.

Metrics are scraped from ``/metrics`` of P and D before and after each point; the
difference is what the point moved. Histograms give ``_sum`` and ``_count``
(e.g. the mean hand-off latency), counters their increase. Samples are summed
over label sets (one engine per server here).
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections.abc import Iterable

#: Metric families kept from /metrics (connector metrics: ours and vLLM's NIXL ones).
PREFIXES = ("vllm:ext_push_", "vllm:nixl_")
#: Histograms whose buckets are kept too (quantiles of a point: p50/p90 of the hand-off,
#: of D's wait and of a NIXL transfer), as ``<name>_bucket:le=<bound>``.
BUCKET_FAMILIES = (
    "vllm:ext_push_handoff_seconds",
    "vllm:ext_push_recv_wait_seconds",
    "vllm:nixl_xfer_time_seconds",
)
#: The gauge of KV blocks in use (0..1), read by the correctness check.
KV_USAGE = "vllm:kv_cache_usage_perc"


def parse_prometheus(
    text: str, prefixes: Iterable[str] = PREFIXES, buckets: Iterable[str] = BUCKET_FAMILIES
) -> dict[str, float]:
    """``{sample name: value}`` summed over labels, for names starting with ``prefixes``.

    ``_created`` samples and histogram buckets (``_bucket``) are dropped, except the
    buckets of the ``buckets`` families: ``<family>_bucket:le=<bound>``, summed over
    the other labels.
    """
    prefixes = tuple(prefixes)
    keep = {f"{b}_bucket" for b in buckets}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or not line.startswith(prefixes):
            continue
        name_labels, _, rest = line.rpartition(" ")
        if not name_labels:
            continue
        name, _, labels = name_labels.partition("{")
        name = name.strip()
        if name in keep:
            le = _label(labels, "le")
            if le is None:
                continue
            name = f"{name}:le={le}"
        elif name.endswith(("_bucket", "_created")):
            continue
        try:
            value = float(rest)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def _label(labels: str, key: str) -> str | None:
    """The value of ``key`` in a Prometheus label set ``a="1",le="0.5"}``."""
    for part in labels.rstrip("}").split(","):
        k, _, v = part.partition("=")
        if k.strip() == key:
            return v.strip().strip('"')
    return None


def histogram_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a histogram from its cumulative bucket counts
    ``{upper bound: count}``, interpolated linearly inside a bucket (Prometheus's rule;
    a quantile in the ``+Inf`` bucket is the highest finite bound)."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lo_bound, lo_count = 0.0, 0.0
    for b in bounds:
        count = buckets[b]
        if count >= rank:
            if math.isinf(b):
                return lo_bound
            if count == lo_count:
                return b
            return lo_bound + (b - lo_bound) * (rank - lo_count) / (count - lo_count)
        lo_bound, lo_count = b, count
    return lo_bound


def buckets_of(metrics: dict[str, float], family: str) -> dict[float, float]:
    """``{upper bound: cumulative count}`` of ``family`` from parsed (or delta) metrics;
    keys may carry a ``side:`` prefix (summed)."""
    out: dict[float, float] = {}
    tag = f"{family}_bucket:le="
    for k, v in metrics.items():
        _, sep, le = k.partition(tag)
        if sep:
            bound = float(le)
            out[bound] = out.get(bound, 0.0) + v
    return out


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """The connector metrics of one server (empty on any error: a probe never fails a run)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as r:
            return parse_prometheus(r.read().decode(errors="replace"))
    except OSError:
        return {}


def engine_metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Every ``vllm:`` family of one server's /metrics, summed over labels, keyed
    ``name[source]`` where a sample has a ``source`` or ``reason`` label (e.g. D's
    ``vllm:prompt_tokens_by_source_total[external_kv_transfer]``, a push failure's
    ``vllm:ext_push_failures_total[write_timeout]``); buckets and
    ``_created`` samples dropped. Raises ``OSError`` when the server does not answer."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as r:
        text = r.read().decode(errors="replace")
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        if name.endswith(("_bucket", "_created")):
            continue
        source = (_label(labels, "source") or _label(labels, "reason")) if labels else None
        key = f"{name}[{source}]" if source else name
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What changed between two scrapes (metrics absent before count from 0). Histogram
    buckets are kept even when unchanged: an empty bucket is the lower bound of the next
    one when a quantile is interpolated."""
    out = {}
    for k, v in after.items():
        d = v - before.get(k, 0.0)
        if d or "_bucket:le=" in k:
            out[k] = d
    return out


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants (live ones)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def idle_cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Fraction of one core each process tree used over ``seconds`` of no load."""
    t0 = time.monotonic()
    c0 = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    c1 = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
    wall = time.monotonic() - t0
    return {name: max(c1[name] - c0[name], 0.0) / wall for name in pids}
