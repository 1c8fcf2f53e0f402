# SPDX-License-Identifier: Apache-2.0
"""From a run's records to aggregates, the targets (docs/benchmarks.md), markdown tables and plots.

Everything here works on the run's JSON (plain dicts), so a report can be rebuilt
from a saved run: ``python -m devkit.bench --report runs/bench-.../results.json``.
Times in the JSON are seconds; tables and plots show milliseconds.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devkit.bench import modes as M
from devkit.bench.probes import buckets_of, histogram_quantile
from devkit.bench.tables import (
    fmt_ms,
    load_sort,
    md_table,
    point_order,
    ratio_of,
    row_at,
    verdict_of,
    worst_of,
)

# -- statistics ---------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


# -- aggregation ---------------------------------------------------------------------------


def aggregate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (mode, point) over all rounds: percentiles and connector metrics."""
    reqs: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in results.get("requests", []):
        reqs[(r["mode"], r["point"])].append(r)
    mets: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for p in results.get("points", []):
        acc = mets[(p["mode"], p["point"])]
        for side, d in (p.get("metrics") or {}).items():
            for k, v in d.items():
                acc[f"{side}:{k}"] += v
    rows = []
    for (mode, point), rs in reqs.items():
        ok = [r for r in rs if not r.get("error") and r.get("ttft") is not None]
        ttft = [r["ttft"] for r in ok]
        tpot = [r["tpot"] for r in ok if r.get("tpot") is not None]
        itl = [x for r in ok for x in r.get("itl", [])]
        e2e = [r["e2e"] for r in ok if r.get("e2e") is not None]
        m = mets.get((mode, point), {})
        row: dict[str, Any] = {
            "mode": mode, "point": point, "input_len": rs[0]["input_len"], "load": rs[0]["load"],
            "n": len(rs), "failed": len(rs) - len(ok),
            "prompt_len_mean": mean([r["prompt_len"] for r in ok]),
        }  # fmt: skip
        for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
            row[f"{name}_p50"] = percentile(xs, 50)
            row[f"{name}_p90"] = percentile(xs, 90)
            row[f"{name}_p99"] = percentile(xs, 99)
            row[f"{name}_mean"] = mean(xs)
        row.update(_connector_numbers(m))
        rows.append(row)
    order = {k: i for i, k in enumerate(point_order(rows))}
    mode_order = {n: i for i, n in enumerate(results.get("config", {}).get("modes", []))}
    rows.sort(key=lambda r: (order[(r["input_len"], r["load"])], mode_order.get(r["mode"], 99)))
    return rows


def _sum_sides(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k.split(":", 1)[-1] == name)


def _connector_numbers(m: dict[str, float]) -> dict[str, Any]:
    """Hand-off and bytes from the metric deltas (both sides summed)."""
    out: dict[str, Any] = {}
    h_sum = _sum_sides(m, "vllm:ext_push_handoff_seconds_sum")
    h_cnt = _sum_sides(m, "vllm:ext_push_handoff_seconds_count")
    out["handoff_mean"] = h_sum / h_cnt if h_cnt else None
    out["handoff_count"] = int(h_cnt)
    push_bytes = _sum_sides(m, "vllm:ext_push_bytes_total")
    out["push_writes"] = int(_sum_sides(m, "vllm:ext_push_writes_total"))
    x_sum = _sum_sides(m, "vllm:nixl_xfer_time_seconds_sum")
    x_cnt = _sum_sides(m, "vllm:nixl_xfer_time_seconds_count")
    out["xfer_mean"] = x_sum / x_cnt if x_cnt else None
    out["xfer_count"] = int(x_cnt)
    # per transfer, not per measured request: the load generator's warm-up requests
    # (one per concurrency slot before each point) move KV too
    if push_bytes and out["push_writes"]:
        out["kv_bytes_per_request"] = push_bytes / out["push_writes"]
    else:
        b_sum = _sum_sides(m, "vllm:nixl_bytes_transferred_sum")
        b_cnt = _sum_sides(m, "vllm:nixl_bytes_transferred_count")
        out["kv_bytes_per_request"] = b_sum / b_cnt if b_cnt else None
    # quantiles from the histograms' buckets (as fine as the buckets: interpolated)
    for key, family in (
        ("handoff", "vllm:ext_push_handoff_seconds"),
        ("recv_wait", "vllm:ext_push_recv_wait_seconds"),
        ("xfer", "vllm:nixl_xfer_time_seconds"),
    ):
        b = buckets_of(m, family)
        out[f"{key}_p50"] = histogram_quantile(b, 0.5)
        out[f"{key}_p90"] = histogram_quantile(b, 0.9)
    # descriptors per NIXL transfer (ours: per WRITE; vLLM's pull: per READ)
    d_sum = _sum_sides(m, "vllm:nixl_num_descriptors_sum")
    d_cnt = _sum_sides(m, "vllm:nixl_num_descriptors_count")
    out["descriptors_per_xfer"] = d_sum / d_cnt if d_cnt else None
    p_sum = _sum_sides(m, "vllm:nixl_post_time_seconds_sum")
    p_cnt = _sum_sides(m, "vllm:nixl_post_time_seconds_count")
    out["post_mean"] = p_sum / p_cnt if p_cnt else None
    return out


def add_overhead(rows: list[dict[str, Any]], baseline: str = M.SINGLE) -> None:
    """``overhead_p50`` = TTFT p50 of the row - TTFT p50 of ``baseline`` at the same point."""
    base = {r["point"]: r for r in rows if r["mode"] == baseline}
    for r in rows:
        b = base.get(r["point"])
        if b is None or r["mode"] == baseline or r["ttft_p50"] is None or b["ttft_p50"] is None:
            r["overhead_p50"] = None
        else:
            r["overhead_p50"] = r["ttft_p50"] - b["ttft_p50"]


# -- targets -------------------------------------------------------------------------------


def floor_by_len(results: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The floor per input length: of the measurements (run start and end; free cores
    and pinned to P's/D's cores), the one with the lowest NIXL p50: the strictest."""
    out: dict[int, dict[str, Any]] = {}
    for f in [*(results.get("floor") or []), *(results.get("floor_end") or [])]:
        cur = out.get(f["input_len"])
        if cur is None or f["nixl_write_notif_p50_s"] < cur["nixl_write_notif_p50_s"]:
            out[f["input_len"]] = f
    return out


def _val(rows: list[dict[str, Any]], mode: str, n: int, load: str, key: str) -> float | None:
    r = row_at(rows, mode, n, load)
    v = None if r is None else r.get(key)
    return None if v is None else float(v)


def targets(results: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The CPU targets (docs/benchmarks.md, *CPU targets*), each with its ratio and verdict."""
    out: list[dict[str, Any]] = []
    lens = sorted({r["input_len"] for r in rows})
    loads = sorted({r["load"] for r in rows})

    def add(tid: str, text: str, ratio: float | None, limit: float, detail: str) -> None:
        out.append({"id": tid, "target": text, "ratio": ratio, "limit": limit,
                    "verdict": verdict_of(ratio, limit), "detail": detail})  # fmt: skip

    # 1a. overhead ratio at 2k / c=4 (a pull overhead <= 0 leaves nothing to halve: n/a)
    big = 2048 if 2048 in lens else (max(lens) if lens else 0)
    ov_o = _val(rows, M.OURS, big, "c=4", "overhead_p50")
    ov_p = _val(rows, M.PULL, big, "c=4", "overhead_p50")
    r = ratio_of(ov_o, ov_p) if ov_p is not None and ov_p > 0 else None
    add("T1a", f"push overhead <= 0.5x pull overhead (in={big}, c=4)", r, 0.5,
        f"push {fmt_ms(ov_o)} ms, pull {fmt_ms(ov_p)} ms")  # fmt: skip
    # 1b. never worse than pull at c=1 (compared as differences: overheads may be <= 0)
    ratios: list[float] = []
    details: list[str] = []
    verdict = "n/a"
    for n in lens:
        ov_o = _val(rows, M.OURS, n, "c=1", "overhead_p50")
        ov_p = _val(rows, M.PULL, n, "c=1", "overhead_p50")
        if ov_o is None or ov_p is None:
            continue
        if ov_o > ov_p:
            verdict = "FAIL"
        elif verdict == "n/a":
            verdict = "pass"
        if ov_p > 0:
            ratios.append(ov_o / ov_p)
        details.append(f"in={n}: {ov_o * 1e3:.0f} vs {ov_p * 1e3:.0f} ms")
    add("T1b", "push overhead <= pull overhead at c=1 (every length; worst ratio)",
        worst_of(ratios), 1.0, ", ".join(details))  # fmt: skip
    out[-1]["verdict"] = verdict
    # 2. TTFT p50 vs vLLM's own push
    ratios, details = [], []
    for n in lens:
        for load in loads:
            rr = ratio_of(
                _val(rows, M.OURS, n, load, "ttft_p50"),
                _val(rows, M.VLLM_PUSH, n, load, "ttft_p50"),
            )
            if rr is not None:
                ratios.append(rr)
                details.append(f"in={n} {load}: {rr:.2f}")
    add("T2", "push TTFT p50 <= 0.8x vLLM 0.32 push (every point; worst shown)",
        worst_of(ratios), 0.8, ", ".join(details))  # fmt: skip
    # 3. hand-off vs the floor (the strict one; the fresh-blocks floor in the detail)
    floor = floor_by_len(results)
    ratios, details = [], []
    for n in lens:
        h = _val(rows, M.OURS, n, "c=1", "handoff_mean")
        f = floor.get(n, {}).get("nixl_write_notif_p50_s")
        rr = ratio_of(h, f)
        if rr is not None and h is not None and f is not None:
            ratios.append(rr)
            text = f"in={n}: {h * 1e3:.2f} / {f * 1e3:.2f} ms = {rr:.2f}"
            fresh = ratio_of(h, _fresh_floor(results, n))
            if fresh is not None:
                text += f" (fresh blocks: {fresh:.2f})"
            details.append(text)
    add("T3", "hand-off (mean, c=1) <= 1.5x floor (raw NIXL WRITE + notif p50, lowest)",
        worst_of(ratios), 1.5, "; ".join(details))  # fmt: skip
    # 4. TPOT at c=4
    ratios, details = [], []
    for n in lens:
        rr = ratio_of(
            _val(rows, M.OURS, n, "c=4", "tpot_p50"), _val(rows, M.PULL, n, "c=4", "tpot_p50")
        )
        if rr is not None:
            ratios.append(rr)
            details.append(f"in={n}: {rr:.2f}")
    add("T4", "push TPOT p50 <= pull TPOT p50 at c=4 (every length; worst shown)",
        worst_of(ratios), 1.0, ", ".join(details))  # fmt: skip
    # 5. idle CPU
    idle = (results.get("idle_cpu") or {}).get(M.OURS) or {}
    eng = {k: float(v) for k, v in idle.items() if k in ("prefill", "decode")}
    add("T5", "idle engine with our connector <= 5% of a core (P and D; worst shown)",
        max(eng.values()) if eng else None, 0.05,
        ", ".join(f"{k} {v * 100:.1f}%" for k, v in eng.items()))  # fmt: skip
    return out


# -- markdown ------------------------------------------------------------------------------


def _modes(results: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    present = {r["mode"] for r in rows}
    order = list(results.get("config", {}).get("modes", []))
    return [m for m in order if m in present] + sorted(present - set(order))


def is_gpu(results: dict[str, Any]) -> bool:
    """A run on GPUs (``devkit.bench.gpu``): its own tables, floor and targets."""
    return (results.get("config") or {}).get("device") == "cuda"


def high_q(results: dict[str, Any]) -> str:
    """The upper percentile of the tables: p90 on GPUs (fewer requests per point), else p99."""
    return "p90" if is_gpu(results) else "p99"


def _metric_table(results: dict[str, Any], rows: list[dict[str, Any]], name: str) -> str:
    modes = _modes(results, rows)
    hq = high_q(results)
    body = []
    for n, load in point_order(rows):
        cells = [str(n), load]
        for m in modes:
            r = row_at(rows, m, n, load)
            if r is None:
                cells.append("-")
            else:
                fail = f" ({r['failed']} failed)" if r["failed"] else ""
                hi = r.get(f"{name}_{hq}")
                cells.append(f"{fmt_ms(r[name + '_p50'])} / {fmt_ms(hi)}{fail}")
        body.append(cells)
    return md_table(["input", "load", *modes], body)


def markdown(results: dict[str, Any]) -> str:
    """All tables of a run, as markdown."""
    rows = results.get("aggregates") or []
    modes = _modes(results, rows)
    out = []
    cfg = results.get("config", {})
    out.append(
        f"Run `{results.get('run_id', '?')}`: {len(modes)} modes, "
        f"{cfg.get('rounds', '?')} rounds, {cfg.get('num_requests', '?')} requests per point "
        f"and round, output {cfg.get('output_len', '?')} tokens, prefix caching off; "
        f"machine: {results.get('machine', {}).get('cpu', '?')}, "
        f"{results.get('machine', {}).get('cores', '?')} cores."
    )
    gpu = is_gpu(results)
    if gpu:
        from devkit.bench import report_gpu

        out.append(report_gpu.summary(results))
    hq = high_q(results)
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        out.append(f"\n**{title} p50 / {hq} (ms)**\n")
        out.append(_metric_table(results, rows, name))
    dis = [m for m in modes if M.disaggregated(m)]
    if any(r.get("overhead_p50") is not None for r in rows):
        out.append(f"\n**Disaggregation overhead: TTFT p50 - TTFT p50 of `{M.SINGLE}` (ms)**\n")
        body = []
        for n, load in point_order(rows):
            body.append([str(n), load] + [
                fmt_ms((row_at(rows, m, n, load) or {}).get("overhead_p50")) for m in dis
            ])  # fmt: skip
        out.append(md_table(["input", "load", *dis], body))
    if gpu:
        out.append(report_gpu.handoff_tables(results, rows))
    else:
        out.append("\n**KV hand-off and the floor (ms)**\n")
        out.append(_handoff_table(results, rows))
    from devkit.bench import report_dstep

    out.extend(
        t for t in (report_dstep.d_step_table(results), report_dstep.goodput_table(results)) if t
    )
    idle = results.get("idle_cpu") or {}
    if idle:
        out.append("\n**Idle CPU per process tree (% of one core, no load)**\n")
        body = [[m] + [f"{idle[m].get(k, 0) * 100:.1f}" if k in idle[m] else "-"
                       for k in ("prefill", "decode", "single", "proxy")]
                for m in modes if m in idle]  # fmt: skip
        out.append(md_table(["mode", "P", "D", "single", "proxy"], body))
    tg = results.get("targets") or []
    if tg:
        out.append(f"\n**Targets ({'GPU' if gpu else 'CPU'}; docs/benchmarks.md)**\n")
        body = [[t["id"], t["target"], "-" if t["ratio"] is None else f"{t['ratio']:.2f}",
                 f"<= {t['limit']:g}", t["verdict"], t["detail"]] for t in tg]  # fmt: skip
        out.append(md_table(["", "target", "measured", "limit", "verdict", "detail"], body))
    return "\n".join(out) + "\n"


def _floor_variant(results: dict[str, Any], n: int, pinned: bool) -> float | None:
    vals = [
        f["nixl_write_notif_p50_s"]
        for key in ("floor", "floor_end")
        for f in results.get(key) or []
        if f["input_len"] == n and any(c is not None for c in f.get("cpus") or [None]) == pinned
    ]
    return min(vals) if vals else None


def _fresh_floor(results: dict[str, Any], n: int) -> float | None:
    """The lowest raw WRITE + notification p50 into fresh blocks (older runs: None)."""
    vals = [
        f["nixl_write_notif_fresh_p50_s"]
        for key in ("floor", "floor_end")
        for f in results.get(key) or []
        if f["input_len"] == n and f.get("nixl_write_notif_fresh_p50_s") is not None
    ]
    return min(vals) if vals else None


def _handoff_table(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Floor, our hand-off at every load level, ratios at the lightest (c=1 when run)."""
    floor = floor_by_len(results)
    pulls = [m for m in _modes(results, rows) if "pull" in m]
    loads = list(dict.fromkeys(load for _, load in point_order(rows))) or ["c=1"]
    first = loads[0]
    header = ["input", "KV MiB", "memcpy", "NIXL WRITE+notif p50, free cores",
              "pinned to P/D cores", "fresh blocks"]  # fmt: skip
    header += [f"push hand-off {load}" for load in loads]
    header += [f"hand-off / floor ({first})", "hand-off / fresh-blocks floor"]
    header += [f"{m} transfer {first}" for m in pulls]
    body = []
    for n in sorted({r["input_len"] for r in rows} | set(floor)):
        f = floor.get(n, {})
        hs = [(row_at(rows, M.OURS, n, load) or {}).get("handoff_mean") for load in loads]
        ratio = ratio_of(hs[0], f.get("nixl_write_notif_p50_s"))
        fresh = _fresh_floor(results, n)
        ratio_fresh = ratio_of(hs[0], fresh)
        body.append([
            str(n), f"{f['bytes'] / 2**20:.2f}" if f else "-", fmt_ms(f.get("memcpy_s"), 3),
            fmt_ms(_floor_variant(results, n, False), 2),
            fmt_ms(_floor_variant(results, n, True), 2),
            fmt_ms(fresh, 2), *(fmt_ms(h, 2) for h in hs),
            "-" if ratio is None else f"{ratio:.2f}",
            "-" if ratio_fresh is None else f"{ratio_fresh:.2f}",
        ] + [fmt_ms((row_at(rows, m, n, first) or {}).get("xfer_mean"), 2)
             for m in pulls])  # fmt: skip
    return md_table(header, body)


# -- plots ---------------------------------------------------------------------------------


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """TTFT, TPOT and overhead vs input length: one panel per load level, a line per mode.
    A run of one input length at several closed-loop levels (``c=N``) is drawn against
    the requests in flight instead, in one panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results.get("aggregates") or []
    if not rows:
        return []
    modes = _modes(results, rows)
    hq = high_q(results)
    loads = sorted({r["load"] for r in rows}, key=lambda s: load_sort((0, s)))
    lens = sorted({r["input_len"] for r in rows})
    by_flight = len(lens) == 1 and len(loads) > 1 and all(ld.startswith("c=") for ld in loads)
    panels = [f"{lens[0]} tokens"] if by_flight else loads
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(modes)}
    paths = []
    for key, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("overhead", "Disaggregation overhead")):
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
        drawn = False
        values: list[float] = []
        for ax, load in zip(axes[0], panels):
            for m in modes:
                if by_flight:  # x: requests in flight
                    pts = sorted((int(r["load"][2:]), r) for r in rows if r["mode"] == m)
                else:
                    pts = sorted((r["input_len"], r) for r in rows
                                 if r["mode"] == m and r["load"] == load)  # fmt: skip
                if key == "overhead":
                    xy = [(n, r.get("overhead_p50")) for n, r in pts]
                    xy = [(n, v * 1e3) for n, v in xy if v is not None]
                    hi: list[tuple[int, float]] = []
                else:
                    xy = [(n, r[f"{key}_p50"] * 1e3) for n, r in pts if r[f"{key}_p50"] is not None]
                    hi = [(n, r[f"{key}_{hq}"] * 1e3) for n, r in pts
                          if r.get(f"{key}_{hq}") is not None]  # fmt: skip
                if not xy:
                    continue
                drawn = True
                values += [v for _, v in xy + hi]
                style = "-" if M.disaggregated(m) else "--"
                lw = 2.6 if m == M.OURS else 1.5
                ax.plot(*zip(*xy), style, marker="o", color=colors[m], label=m, linewidth=lw)
                if hi:
                    ax.plot(*zip(*hi), ":", color=colors[m], linewidth=0.9, alpha=0.7)
            ax.set_title(f"{title} — {load}")
            ax.set_xlabel("requests in flight" if by_flight else "input length (tokens)")
            ax.set_ylabel(f"{title} {'p50 ' if key != 'overhead' else 'p50 - single '}(ms)")
            ax.set_xscale("log", base=2)
            ax.set_xticks([int(ld[2:]) for ld in loads] if by_flight else lens)
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.grid(True, alpha=0.3)
        if not drawn:
            plt.close(fig)
            continue
        positive = [v for v in values if v > 0]
        if key != "overhead" and positive and max(positive) / min(positive) > 20:
            for ax in axes[0]:  # modes an order of magnitude apart: log scale
                ax.set_yscale("log")
                ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(10, subs=(1, 2, 5)))
                ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        handles, labels = axes[0][0].get_legend_handles_labels()
        for ax in axes[0][1:]:
            h, lab = ax.get_legend_handles_labels()
            for hh, ll in zip(h, lab):
                if ll not in labels:
                    handles.append(hh)
                    labels.append(ll)
        note = f" (dotted: {hq})" if key != "overhead" else ""
        versus = "requests in flight" if by_flight else "input length"
        fig.suptitle(f"{title} vs {versus}{note}", fontsize=11)
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=9,
                   frameon=False)  # fmt: skip
        fig.tight_layout(rect=(0, 0.08, 1, 0.95))
        path = out_dir / f"{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# -- files ---------------------------------------------------------------------------------


def finish(results: dict[str, Any]) -> None:
    """Fill in aggregates, overhead and targets (idempotent)."""
    rows = aggregate(results)
    add_overhead(rows)
    results["aggregates"] = rows
    if is_gpu(results):
        from devkit.bench import report_gpu

        results["targets"] = report_gpu.targets(results, rows)
    else:
        results["targets"] = targets(results, rows)


def compact(value: Any, digits: int = 6) -> Any:
    """``value`` with every float rounded to ``digits`` decimals (seconds: to the µs)."""
    if isinstance(value, float):
        return round(value, digits) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: compact(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [compact(v, digits) for v in value]
    return value


def write(
    results: dict[str, Any], out_dir: Path, plots: bool = True, small: bool = False
) -> dict[str, Path]:
    """results.json, report.md and the PNGs under ``out_dir``. ``small``: floats rounded
    to the microsecond and no indentation (a GPU run's JSON stays well under 1 MB)."""
    finish(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "md": out_dir / "report.md"}
    if small:
        text = json.dumps(compact(results), separators=(",", ":"), default=str)
    else:
        text = json.dumps(results, indent=1, default=str)
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(text)
    tmp.replace(paths["json"])  # a reader (the runbook's copy) never sees half a file
    paths["md"].write_text(markdown(results))
    if plots:
        try:
            for p in plot(results, out_dir):
                paths[p.stem] = p
        except ImportError as e:  # matplotlib missing: tables still written
            paths["md"].write_text(markdown(results) + f"\n(no plots: {e})\n")
    return paths
