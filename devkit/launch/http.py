# SPDX-License-Identifier: Apache-2.0
"""What a test or a fault tool asks a running engine or proxy over HTTP: its Prometheus
samples, one metric summed over label sets, whether it answers ``/health``."""

from __future__ import annotations

import contextlib
import re
import urllib.error
import urllib.request


def scrape_metrics(url: str, timeout: float = 10) -> dict[str, float]:
    """Prometheus text -> ``{'name{labels}': value}`` (one entry per label set)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^(\S+?)(\{.*\})?\s+(\S+)$", line)
        if m:
            with contextlib.suppress(ValueError):
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metric(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a metric over the label sets that contain ``labels``."""
    total = 0.0
    for k, v in metrics.items():
        if k.split("{", 1)[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items()):
            total += v
    return total


def http_alive(url: str) -> bool:
    """Whether ``url/health`` answers 200 within 5 s."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False
