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

__all__ = [
    "CONNECTORS", "ENV", "_log", "install", "wrap", "read_events", "handoffs", "window",
    "d_steps",
]  # fmt: skip


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


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def d_steps(directory: Path, t0: float, t1: float) -> dict[str, Any]:
    """D's engine steps that ended in [t0, t1]: how many, how many ran requests, the
    batch (requests and tokens) of those, and the wall time the connector's hooks made
    each step wait (``hook_us``: p50 / p99 / mean over every step, and over the steps
    that ran requests), split for the steps that ran requests into the hooks' CPU time on
    the engine thread (``busy_hook_cpu_us``) and the rest (``busy_wait_us``: the thread
    blocked in a hook, on a lock, an event or the GIL). A step without its batch (vLLM
    ran the worker in another process than the scheduler) gets that of the latest
    ``d_sched`` before it."""
    events = sorted(read_events(directory), key=lambda e: e.get("t", 0.0))
    steps, sched = [], None
    for e in events:
        if e.get("ev") == "d_sched":
            sched = e
        elif e.get("ev") == "d_step" and t0 <= e["t"] <= t1:
            if e.get("reqs") is None and sched is not None:  # scheduled in another process
                e = {**e, "reqs": sched.get("reqs"), "tokens": sched.get("tokens")}
            steps.append(e)
    busy = [e for e in steps if e.get("reqs")]
    hooks = [float(e["hook_us"]) for e in steps]
    busy_hooks = [float(e["hook_us"]) for e in busy]
    # the hooks' own CPU, and the rest of their wall time: the engine thread not running
    # (blocked on a lock, an event or the GIL); traces written before hook_cpu_us have none
    timed = [e for e in busy if e.get("hook_cpu_us") is not None]
    busy_cpu = [float(e["hook_cpu_us"]) for e in timed]
    busy_wait = [max(0.0, float(e["hook_us"]) - float(e["hook_cpu_us"])) for e in timed]
    reqs = [float(e["reqs"]) for e in busy]
    tokens = [float(e["tokens"]) for e in busy if e.get("tokens") is not None]

    def stats(v: list[float]) -> dict[str, float | None]:
        return {
            "p50": _pct(v, 50), "p99": _pct(v, 99),
            "mean": sum(v) / len(v) if v else None,
        }  # fmt: skip

    return {
        "steps": len(steps), "busy_steps": len(busy),
        "hook_us": stats(hooks), "busy_hook_us": stats(busy_hooks),
        "busy_hook_cpu_us": stats(busy_cpu), "busy_wait_us": stats(busy_wait),
        "batch_reqs": stats(reqs), "batch_tokens": stats(tokens),
    }  # fmt: skip
