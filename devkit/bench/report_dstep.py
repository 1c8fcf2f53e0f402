# SPDX-License-Identifier: Apache-2.0
"""Two tables of a run's report, CPU or GPU: D's engine steps (the batch it ran and the
wall time the connector's hooks made each step wait, from the hand-off trace's
``d_step`` events, :mod:`vllm_ext.handoff_trace`) and goodput under a TTFT and a TPOT
SLO (``--slo-ttft-ms`` / ``--slo-tpot-ms``: requests per second that met both)."""

from __future__ import annotations

from typing import Any

from devkit.bench.tables import md_table


def _f(v: float | None, nd: int = 0) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def d_step_table(results: dict[str, Any]) -> str:
    """Per mode and point (rounds pooled by their mean): D's steps that ran requests,
    their batch (requests) and the wall time the connector's hooks took per step (us),
    split into the engine thread's CPU in them and the rest, when it did not run
    (blocked in a hook, on a lock, an event or the GIL)."""
    body = []
    for p in results.get("points") or []:
        s = p.get("d_steps")
        if not s or not s.get("steps"):
            continue
        busy, batch = s.get("busy_hook_us") or {}, s.get("batch_reqs") or {}
        cpu, wait = s.get("busy_hook_cpu_us") or {}, s.get("busy_wait_us") or {}
        body.append([
            p["mode"], str(p.get("round", 0) + 1), p["point"], str(s["busy_steps"]),
            f"{_f(batch.get('p50'))} / {_f(batch.get('mean'), 1)}",
            f"{_f(busy.get('p50'))} / {_f(busy.get('p99'))} / {_f(busy.get('mean'))}",
            f"{_f(cpu.get('p50'))} / {_f(cpu.get('mean'))}",
            f"{_f(wait.get('p50'))} / {_f(wait.get('p99'))} / {_f(wait.get('mean'))}",
            f"{_f((s.get('hook_us') or {}).get('p50'))} ({s['steps'] - s['busy_steps']} empty)",
        ])  # fmt: skip
    if not body:
        return ""
    head = ["mode", "round", "point", "D steps with requests", "D batch p50 / mean (requests)",
            "D wall time in the connector per step p50 / p99 / mean (us)",
            "of which CPU p50 / mean (us)", "of which not running p50 / p99 / mean (us)",
            "every step p50 (us)"]  # fmt: skip
    return "\n**D's engine steps (hand-off trace `d_step`)**\n\n" + md_table(head, body)


def goodput_table(results: dict[str, Any]) -> str:
    """Requests per second of point time that met both SLOs, per mode and point."""
    cfg = results.get("config") or {}
    ttft_ms, tpot_ms = cfg.get("slo_ttft_ms"), cfg.get("slo_tpot_ms")
    if ttft_ms is None or tpot_ms is None:
        return ""
    duration: dict[tuple[str, str], float] = {}
    for p in results.get("points") or []:
        key = (p["mode"], p["point"])
        duration[key] = duration.get(key, 0.0) + float(p.get("duration_s") or 0.0)
    met: dict[tuple[str, str], list[int]] = {}
    for r in results.get("requests") or []:
        key = (r["mode"], r["point"])
        good = (
            not r.get("error") and r.get("ttft") is not None and r.get("tpot") is not None
            and r["ttft"] * 1e3 <= ttft_ms and r["tpot"] * 1e3 <= tpot_ms
        )  # fmt: skip
        m = met.setdefault(key, [0, 0])
        m[0] += int(good)
        m[1] += 1
    body = [
        [mode, point, f"{good} / {n}",
         _f(good / duration[(mode, point)] if duration.get((mode, point)) else None, 2)]
        for (mode, point), (good, n) in sorted(met.items())
    ]  # fmt: skip
    head = ["mode", "point", "met both SLOs", "goodput (requests/s)"]
    return f"\n**Goodput: TTFT <= {ttft_ms:g} ms and TPOT <= {tpot_ms:g} ms**\n\n" + md_table(
        head, body
    )
