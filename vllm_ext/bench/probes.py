# SPDX-License-Identifier: Apache-2.0
"""What the benchmark reads from the engines: Prometheus connector metrics, idle CPU.

Metrics are scraped from ``/metrics`` of P and D before and after each point; the
difference is what the point moved. Histograms give ``_sum`` and ``_count``
(e.g. the mean hand-off latency), counters their increase. Samples are summed
over label sets (one engine per server here).
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterable

#: Metric families kept from /metrics (connector metrics: ours and vLLM's NIXL ones).
PREFIXES = ("vllm:ext_push_", "vllm:nixl_")


def parse_prometheus(text: str, prefixes: Iterable[str] = PREFIXES) -> dict[str, float]:
    """``{sample name: value}`` summed over labels, for names starting with ``prefixes``.

    Histogram buckets (``_bucket``) and ``_created`` samples are dropped.
    """
    prefixes = tuple(prefixes)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or not line.startswith(prefixes):
            continue
        name_labels, _, rest = line.rpartition(" ")
        if not name_labels:
            continue
        name = name_labels.split("{", 1)[0].strip()
        if name.endswith(("_bucket", "_created")):
            continue
        try:
            value = float(rest)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """The connector metrics of one server (empty on any error: a probe never fails a run)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as r:
            return parse_prometheus(r.read().decode(errors="replace"))
    except OSError:
        return {}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What changed between two scrapes (metrics absent before count from 0)."""
    out = {}
    for k, v in after.items():
        d = v - before.get(k, 0.0)
        if d:
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
