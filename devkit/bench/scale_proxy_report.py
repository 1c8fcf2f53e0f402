# SPDX-License-Identifier: Apache-2.0
"""Summary, targets, tables and plots of :mod:`devkit.bench.scale_proxy`'s results.

The targets (docs/benchmarks.md, *The proxy at scale*):

* ``SCALE-1``: at 256 concurrent streams our proxy adds at most 1 ms at p50 and 5 ms
  at p99, to the time to first token and to the total time;
* ``SCALE-2``: at every level our added latency is at most 1.5x vllm-router's (p50
  and p99, first token and total), or below it; an added latency under
  :data:`NOISE_FLOOR_S` counts as that floor (two numbers that small are equal within
  the run's noise, and a ratio of them says nothing);
* ``SCALE-3``: memory per in-flight request, stated for both (no limit).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
#: the added latency (s) below which two proxies count as equal (``SCALE-2``)
NOISE_FLOOR_S = 0.0002
TARGET_LEVEL = 256
LIMITS = {"p50": 0.001, "p99": 0.005}
RATIO_LIMIT = 1.5


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    if q == 50:
        return statistics.median(s)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def _ms(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x * 1e3:.{digits}f}"


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (level, target): latencies pooled over the rounds, added latency
    against ``direct``, the proxy's memory and CPU, the harness's load."""
    rows = []
    idle = results.get("idle_rss_bytes", {})
    levels = sorted({p["concurrency"] for p in results["points"]})
    for c in levels:
        pts = {t: [p for p in results["points"] if p["concurrency"] == c and p["target"] == t]
               for t in results["targets_measured"]}  # fmt: skip
        lat = {
            t: {k: [x for p in ps for x in p[k]] for k in ("ttft", "total")}
            for t, ps in pts.items()
        }
        for t, ps in pts.items():
            row: dict[str, Any] = {"concurrency": c, "target": t,
                                   "n": len(lat[t]["ttft"]),
                                   "errors": sum(p["errors"] for p in ps)}  # fmt: skip
            for k in ("ttft", "total"):
                for q in (50, 99):
                    v = _q(lat[t][k], q)
                    row[f"{k}_p{q}"] = v
                    base = _q(lat["direct"][k], q)
                    row[f"added_{k}_p{q}"] = (
                        None if t == "direct" or v is None or base is None else v - base
                    )
            row["loadgen_cpu_per_wall"] = max((p["cpu_per_wall"]["loadgen"] for p in ps),
                                              default=None)  # fmt: skip
            row["loadgen_lag_p99"] = max((p["loop_lag_s"]["p99"] or 0.0 for p in ps), default=None)
            row["fake_d_cpu_per_wall"] = max((p["cpu_per_wall"]["decode"] for p in ps),
                                             default=None)  # fmt: skip
            row["fake_p_cpu_per_wall"] = max((p["cpu_per_wall"]["prefill"] for p in ps),
                                             default=None)  # fmt: skip
            row["machine_busy"] = max((p["machine_busy"] or 0.0 for p in ps), default=None)
            if t in results["proxies"]:
                peak = max((p["rss_peak_bytes"] or 0 for p in ps), default=0)
                above = max(0, peak - idle.get(t, peak))
                row["rss_peak_bytes"] = peak
                row["rss_above_idle_bytes"] = above
                row["bytes_per_in_flight"] = above / c
                row["cpu_ms_per_request"] = statistics.fmean(
                    p["proxy_cpu_ms_per_request"] for p in ps
                )
                row["proxy_cpu_per_wall"] = max(p["cpu_per_wall"][t] for p in ps)
            rows.append(row)
    return rows


def _row(rows: list[dict[str, Any]], c: int, target: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["concurrency"] == c and r["target"] == target), None)


def targets(rows: list[dict[str, Any]], proxies: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    ours = _row(rows, TARGET_LEVEL, "ours")
    if ours is None:
        out.append({"id": "SCALE-1", "verdict": "not measured",
                    "text": f"no level of {TARGET_LEVEL} streams in this run"})  # fmt: skip
    else:
        checks = [
            (f"added {k} p{q}", ours[f"added_{k}_p{q}"], LIMITS[f"p{q}"])
            for k in ("ttft", "total") for q in (50, 99)
        ]  # fmt: skip
        failed = [name for name, v, lim in checks if v is None or v > lim]
        detail = "; ".join(f"{name} {_ms(v)} ms (limit {_ms(lim, 0)})" for name, v, lim in checks)
        out.append({
            "id": "SCALE-1", "verdict": "FAIL" if failed else "PASS",
            "text": f"ours adds <= 1 ms p50 and <= 5 ms p99 at {TARGET_LEVEL} streams",
            "detail": detail, "failed": failed,
        })  # fmt: skip
    failed_levels, details = [], []
    for c in sorted({r["concurrency"] for r in rows}):
        o, r = _row(rows, c, "ours"), _row(rows, c, "vllm-router")
        if o is None or r is None:
            continue
        worst = None
        for key in ("added_ttft_p50", "added_ttft_p99", "added_total_p50", "added_total_p99"):
            if o[key] is None or r[key] is None:
                continue
            ratio = max(o[key], NOISE_FLOOR_S) / max(r[key], NOISE_FLOOR_S)
            if worst is None or ratio > worst[1]:
                worst = (key, ratio)
        if worst is None:
            continue
        details.append(f"c={c}: worst {worst[0]} x{worst[1]:.2f}")
        if worst[1] > RATIO_LIMIT:
            failed_levels.append(c)
    out.append({
        "id": "SCALE-2",
        "verdict": "not measured" if not details else "FAIL" if failed_levels else "PASS",
        "text": f"ours adds at most {RATIO_LIMIT}x vllm-router's added latency at every level",
        "detail": "; ".join(details), "failed_levels": failed_levels,
    })  # fmt: skip
    mem = []
    for t in proxies:
        per = [(r["concurrency"], r["bytes_per_in_flight"]) for r in rows if r["target"] == t]
        if per:
            mem.append(f"{t}: " + ", ".join(f"c={c} {b / 1024:.1f} KiB" for c, b in per))
    out.append({"id": "SCALE-3", "verdict": "stated",
                "text": "memory per in-flight request (RSS above idle / streams)",
                "detail": "; ".join(mem)})  # fmt: skip
    return out


def finish(results: dict[str, Any]) -> None:
    rows = summarize(results)
    results["summary"] = rows
    results["targets"] = targets(rows, results["proxies"])


def point_line(p: dict[str, Any]) -> str:
    ttft = sorted(p["ttft"])
    tot = sorted(p["total"])
    return (
        f"c={p['concurrency']:<5} r{p['round']} {p['target']:<12} n={len(ttft):<5} "
        f"err={p['errors']} ttft p50 {_ms(_q(ttft, 50))} p99 {_ms(_q(ttft, 99))} "
        f"total p50 {_ms(_q(tot, 50))} ms; loadgen cpu {p['cpu_per_wall']['loadgen']:.2f}"
    )


def _table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def latency_table(rows: list[dict[str, Any]]) -> str:
    header = ["streams", "target", "n", "errors", "TTFT p50", "TTFT p99", "total p50",
              "total p99", "added TTFT p50", "added TTFT p99", "added total p50",
              "added total p99"]  # fmt: skip
    body = [
        [str(r["concurrency"]), r["target"], str(r["n"]), str(r["errors"]),
         *(_ms(r[k]) for k in ("ttft_p50", "ttft_p99", "total_p50", "total_p99",
                               "added_ttft_p50", "added_ttft_p99", "added_total_p50",
                               "added_total_p99"))]
        for r in rows
    ]  # fmt: skip
    return _table(header, body)


def proxy_table(rows: list[dict[str, Any]], proxies: list[str]) -> str:
    header = ["streams", "proxy", "RSS idle -> peak (MiB)", "per in-flight request (KiB)",
              "CPU per request (ms)", "proxy CPU (cores)"]  # fmt: skip
    body = []
    for r in rows:
        if r["target"] not in proxies:
            continue
        idle = r["rss_peak_bytes"] - r["rss_above_idle_bytes"]
        body.append([
            str(r["concurrency"]), r["target"],
            f"{idle / 2**20:.1f} -> {r['rss_peak_bytes'] / 2**20:.1f}",
            f"{r['bytes_per_in_flight'] / 1024:.1f}", f"{r['cpu_ms_per_request']:.3f}",
            f"{r['proxy_cpu_per_wall']:.2f}",
        ])  # fmt: skip
    return _table(header, body)


def harness_table(rows: list[dict[str, Any]]) -> str:
    header = ["streams", "target", "load generator CPU (cores)", "its loop lag p99 (ms)",
              "fake D CPU (cores)", "fake P CPU (cores)", "machine busy"]  # fmt: skip
    body = [
        [str(r["concurrency"]), r["target"], f"{r['loadgen_cpu_per_wall']:.2f}",
         _ms(r["loadgen_lag_p99"]), f"{r['fake_d_cpu_per_wall']:.2f}",
         f"{r['fake_p_cpu_per_wall']:.2f}", f"{r['machine_busy']:.0%}"]
        for r in rows
    ]  # fmt: skip
    return _table(header, body)


def targets_markdown(results: dict[str, Any]) -> str:
    body = [[t["id"], t["text"], f"**{t['verdict']}**", t.get("detail", "")]
            for t in results["targets"]]  # fmt: skip
    return _table(["target", "what", "verdict", "measured"], body)


def markdown(results: dict[str, Any]) -> str:
    cfg, m = results["config"], results["machine"]
    rows = results["summary"]
    idle = results.get("idle_rss_bytes", {})
    git = results.get("git", {})
    return "\n\n".join([
        "# The proxy at scale: ours and vllm-router on the same fake engines",
        f"Run {results['started']} to {results['finished']}; commit "
        f"{git.get('commit', '?')[:12]}{' (dirty)' if git.get('dirty') else ''}; machine: "
        f"{m['cpu']}, {m['cores']} cores, load average {m['loadavg_start']} at the start, "
        f"{m.get('loadavg_end')} at the end (a shared machine: other sessions ran too).",
        f"Fake D streams {cfg['tokens']} tokens {cfg['gap_ms']} ms apart; prompt "
        f"{cfg['prompt_chars']} characters; closed loop (the workers' starts spread over "
        f"one stream), at least {cfg['min_requests']} counted "
        f"requests per target and level, {cfg['rounds']} round(s), the order of the targets "
        f"reversed every round. Idle RSS: "
        + ", ".join(f"{t} {b / 2**20:.1f} MiB" for t, b in idle.items()) + ".",
        "## Targets\n\n" + targets_markdown(results),
        "## Latency (ms); added = through the proxy minus direct to the fake D\n\n"
        + latency_table(rows),
        "## The proxies' memory and CPU\n\n" + proxy_table(rows, results["proxies"]),
        "## The harness (was the load generator or a fake the bottleneck?)\n\n"
        + harness_table(rows),
        "Fakes' counts (requests; with `kv_transfer_params`; D legs with P's coordinates): "
        + json.dumps(results.get("fake_stats", {})),
    ]) + "\n"  # fmt: skip


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["summary"]
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("ttft", "total")):
        for t, color in zip(results["proxies"], COLORS):
            rs = [r for r in rows if r["target"] == t]
            cs = [r["concurrency"] for r in rs]
            for q, style in ((50, "-o"), (99, "--s")):
                ys = [(r[f"added_{kind}_p{q}"] or 0.0) * 1e3 for r in rs]
                ax.plot(cs, ys, style, color=color, label=f"{t} p{q}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("added latency (ms)")
        ax.set_title(f"added {'time to first token' if kind == 'ttft' else 'total time'}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "scale-proxy-latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for t, color in zip(results["proxies"], COLORS):
        rs = [r for r in rows if r["target"] == t]
        cs = [r["concurrency"] for r in rs]
        axes[0].plot(cs, [r["bytes_per_in_flight"] / 1024 for r in rs], "-o", color=color, label=t)
        axes[1].plot(cs, [r["cpu_ms_per_request"] for r in rs], "-o", color=color, label=t)
    for ax, label in zip(axes, ("KiB per in-flight request", "proxy CPU ms per request")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "scale-proxy-cost.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _point_digest(p: dict[str, Any]) -> dict[str, Any]:
    """A point without its samples: their count and quantiles (seconds)."""
    out = {k: v for k, v in p.items() if k not in ("ttft", "total")}
    for k in ("ttft", "total"):
        xs = p[k]
        out[k] = {
            "n": len(xs),
            "mean": statistics.fmean(xs) if xs else None,
            **{f"p{q}": _q(xs, q) for q in (50, 90, 99)},
            "max": max(xs, default=None),
        }
    return out


def write(results: dict[str, Any], out_dir: Path, plots: bool = True) -> dict[str, Path]:
    """``results.json`` (every point, its samples as quantiles), ``samples.json`` (every
    request's times), ``report.md`` and the PNGs under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "samples": out_dir / "samples.json",
             "md": out_dir / "report.md"}  # fmt: skip
    digest = {**results, "points": [_point_digest(p) for p in results["points"]]}
    paths["json"].write_text(json.dumps(digest, indent=1, default=str))
    samples = [{k: p[k] for k in ("target", "concurrency", "round", "ttft", "total")}
               for p in results["points"]]  # fmt: skip
    paths["samples"].write_text(json.dumps(samples, separators=(",", ":")))
    text = markdown(results)
    if plots:
        try:
            for p in plot(results, out_dir):
                paths[p.stem] = p
        except ImportError as e:
            text += f"\n(no plots: {e})\n"
    paths["md"].write_text(text)
    return paths
