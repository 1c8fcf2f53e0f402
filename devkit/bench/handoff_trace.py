# SPDX-License-Identifier: Apache-2.0
"""The hand-off clock's files, read by the benchmarks: one hand-off per transfer id.

The engines write them (:mod:`vllm_ext.handoff_trace`, the runtime side, installed by
the plugin when ``$VLLM_EXT_HANDOFF_TRACE`` is set); its names are re-exported here for
the benchmarks and their tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vllm_ext.handoff_trace import CONNECTORS, ENV, _log, install, wrap

__all__ = ["CONNECTORS", "ENV", "_log", "install", "wrap", "read_events", "handoffs", "window"]


def read_events(directory: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(Path(directory).glob("handoff-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a stopped engine
    return events


def handoffs(events: Iterable[dict[str, Any]]) -> list[dict[str, float]]:
    """Per transfer id: ``{"t": p_done, "s": d_recv - p_done}`` (seconds; the first
    ``d_recv`` after D's allocation of that request)."""
    p_done: dict[str, float] = {}
    tid_of_rid: dict[str, str] = {}
    recv: dict[str, float] = {}
    for e in sorted(events, key=lambda e: e.get("t", 0.0)):
        ev, tid, rid = e.get("ev"), e.get("tid"), e.get("rid")
        if ev == "p_done" and tid:
            p_done.setdefault(tid, e["t"])
        elif ev == "d_alloc" and tid and rid:
            tid_of_rid[rid] = tid
        elif ev == "d_recv" and rid in tid_of_rid:
            recv.setdefault(tid_of_rid[rid], e["t"])
    return [{"t": p_done[tid], "s": recv[tid] - p_done[tid]} for tid in p_done if tid in recv]


def window(directory: Path, t0: float, t1: float) -> list[float]:
    """Hand-offs (seconds) of the transfers whose prefill finished in [t0, t1]."""
    return sorted(h["s"] for h in handoffs(read_events(directory)) if t0 <= h["t"] <= t1)
