# SPDX-License-Identifier: Apache-2.0
"""Tables, targets and plots of the scale benchmark (``devkit.bench.scale``).

The targets (each a ratio or a rate of one run, judged here):

* T-SCALE-1: the connector's cost per step grows with the requests that change in
  the step, not with those tracked: ours, CPU per step at the largest tracked count /
  at 100 tracked <= 1.3, on P and on D;
* T-SCALE-2: ours <= vLLM's own push connector at 1,000 tracked (CPU per step) x 0.5
  on P and x 1.0 on D;
* T-SCALE-3: the writer posts >= 5,000 WRITEs per CPU second of one writer thread
  (the worst point), preparing a request's WRITEs in <= 50 us (the worst point:
  per request for short prompts, per WRITE for chunk WRITEs). Both judge our Python:
  the CPU time of the fake NIXL's own calls on the writer thread is left out (its
  ``initialize_xfer`` checks every descriptor and costs more than the rest of a
  WRITE); the report shows the numbers with it too.

T-SCALE-1 and -2 judge the connector's CPU per step on the engine thread (its hooks)
plus its writer thread(s): the mean of each per step, summed (the writer is measured
as a total over the steps, so as a mean; the engine thread's median is shown too).

A step point is invalid, and no target uses it, when D received fewer than
``MIN_SERVED`` of the requests the measured steps sent (none at all, or a backlog
that grew): its per-step cost is then not the cost of serving the requests.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from devkit.bench.report import compact
from devkit.bench.tables import md_table

SIDES = ("P", "D")
LIMITS = {"T-SCALE-1": 1.3, "writes": 5000.0, "prep_us": 50.0}
#: T-SCALE-2, per side: ours / vLLM's push at 1,000 tracked
SCALE2_LIMITS = {"P": 0.5, "D": 1.0}
#: the share of the requests sent in the measured steps that D must have received
#: (the last steps' requests may still be in flight when the measurement ends)
MIN_SERVED = 0.9


def invalid_reason(p: dict[str, Any]) -> str | None:
    """Why a step point can't be judged (None: it can)."""
    asked = p.get("asked", p["changed"] * p["steps"])
    got = p["completed"]
    if got == 0:
        return f"{p['connector']} served no request ({asked} sent in the measured steps)"
    if got < MIN_SERVED * asked:
        return (
            f"{p['connector']} served {got} of {asked} requests sent in the measured steps "
            f"(< {MIN_SERVED:.0%})"
        )
    return None


def _point(results: dict[str, Any], connector: str, tracked: int) -> dict[str, Any] | None:
    for p in results.get("step_points", []):
        if p["connector"] == connector and p["tracked"] == tracked:
            return p
    return None


def total_cpu_us(p: dict[str, Any], side: str) -> float:
    """The connector's CPU per step on one side: engine thread + writer thread(s), means."""
    return float(p["cpu_us"][side]["mean"]) + float(p["writer_cpu_us"][side])


def _judged(
    results: dict[str, Any], connector: str, tracked: int | None, side: str, skipped: list[str]
) -> tuple[float | None, str]:
    """(total CPU per step, its breakdown) of a valid point; None when it is missing
    or invalid (the reason appended to ``skipped``)."""
    p = None if tracked is None else _point(results, connector, tracked)
    if p is None:
        return None, "-"
    why = invalid_reason(p)
    if why:
        skipped.append(f"{tracked} tracked: {why}")
        return None, f"invalid ({why})"
    e, w = float(p["cpu_us"][side]["mean"]), float(p["writer_cpu_us"][side])
    med = float(p["cpu_us"][side]["median"])
    return e + w, f"{e + w:.0f} (engine {e:.0f}, p50 {med:.0f}; writer {w:.0f})"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("pass" if ok else "FAIL")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    tracked = sorted({p["tracked"] for p in results.get("step_points", [])})
    top = tracked[-1] if tracked else None
    what = "CPU per step (engine + writer threads)"
    for side in SIDES:
        skipped: list[str] = []
        base, base_s = _judged(results, "ours", 100, side, skipped)
        big, big_s = _judged(results, "ours", top if top and top > 100 else None, side, skipped)
        r = _ratio(big, base)
        out.append({
            "id": "T-SCALE-1", "side": side,
            "target": f"ours, {what}, {top} / 100 tracked <= {LIMITS['T-SCALE-1']}",
            "measured": r, "detail": f"{big_s} / {base_s} us",
            "verdict": _verdict(None if r is None else r <= LIMITS["T-SCALE-1"]),
            "skipped": skipped,
        })  # fmt: skip
    for side in SIDES:
        skipped = []
        ours, ours_s = _judged(results, "ours", 1000, side, skipped)
        vllm, vllm_s = _judged(results, "vllm", 1000, side, skipped)
        r = _ratio(ours, vllm)
        out.append({
            "id": "T-SCALE-2", "side": side,
            "target": f"ours / vLLM's push, {what} at 1000 tracked <= {SCALE2_LIMITS[side]}",
            "measured": r, "detail": f"{ours_s} / {vllm_s} us",
            "verdict": _verdict(None if r is None else r <= SCALE2_LIMITS[side]),
            "skipped": skipped,
        })  # fmt: skip
    wp = results.get("writer_points", [])
    if wp:
        worst_rate = min(p["writes_per_cpu_s"] for p in wp)
        worst_ours = min(p["writes_per_cpu_s_ours"] for p in wp)
        out.append({
            "id": "T-SCALE-3", "side": "P writer",
            "target": f">= {LIMITS['writes']:.0f} WRITEs per CPU second of one writer "
                      "thread (worst point; our Python: without the fake NIXL's calls)",
            "measured": worst_ours,
            "detail": f"with the fake NIXL's calls: {worst_rate:,.0f}",
            "verdict": _verdict(worst_ours >= LIMITS["writes"]),
        })  # fmt: skip
        preps = [_prep(p) for p in wp]
        worst = max(preps, key=lambda t: t[0])
        out.append({
            "id": "T-SCALE-3", "side": "P writer",
            "target": f"preparing a WRITE <= {LIMITS['prep_us']:.0f} us (worst point; per "
                      "request for short prompts, per WRITE for chunk WRITEs; our Python: "
                      "descriptors and their lists, without the fake NIXL's initialize_xfer)",
            "measured": worst[0],
            "detail": f"with the fake NIXL's calls: {worst[1]:.0f} us",
            "verdict": _verdict(worst[0] <= LIMITS["prep_us"]),
        })  # fmt: skip
    return out


def _prep(p: dict[str, Any]) -> tuple[float, float]:
    """(ours, with the fake NIXL) preparation time: per request (whole), per WRITE."""
    if p["mode"] == "whole":
        ratio = (
            p["prep_ours_us_per_write"] / p["prep_us_per_write"] if p["prep_us_per_write"] else 1
        )
        return p["prep_us_per_request"] * ratio, p["prep_us_per_request"]
    return p["prep_ours_us_per_write"], p["prep_us_per_write"]


def _us(x: float | None, digits: int = 0) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:,.{digits}f}"


def _step_table(results: dict[str, Any]) -> str:
    body = []
    for p in sorted(results.get("step_points", []), key=lambda p: (p["tracked"], p["connector"])):
        row = [str(p["tracked"]), p["connector"]]
        for side in SIDES:
            c, w = p["cpu_us"][side], p["wall_us"][side]
            core = (p.get("writer_core_pct") or {}).get(side)
            row += [_us(c["median"]), _us(c["p99"]), _us(w["median"]),
                    _us(p["writer_cpu_us"][side]), _us(core, 1)]  # fmt: skip
        row += [_us(total_cpu_us(p, s)) for s in SIDES]
        asked = p.get("asked", p["changed"] * p["steps"])
        row += [_us(p.get("gc_us")), f"{p['completed']} / {asked}"]
        row += ["no" if invalid_reason(p) else "yes"]
        body.append(row)
    header = ["tracked", "connector"]
    for side in SIDES:
        header += [f"{side} CPU p50", f"{side} CPU p99", f"{side} wall p50",
                   f"{side} writer CPU", f"{side} writer % core"]  # fmt: skip
    header += ["P total CPU", "D total CPU", "GC per round", "received / sent", "valid"]
    return md_table(header, body)


def _hook_table(results: dict[str, Any]) -> str:
    pts = results.get("step_points", [])
    if not pts:
        return ""
    top = max(p["tracked"] for p in pts)
    cols = [(c, s) for c in ("ours", "vllm") for s in SIDES if _point(results, c, top)]
    hooks: set[str] = set()
    for c, s in cols:
        hooks |= set(_point(results, c, top)["by_hook_cpu_us"][s])  # type: ignore[index]
    rows = []
    for h in sorted(hooks):
        vals = [_point(results, c, top)["by_hook_cpu_us"][s].get(h) for c, s in cols]  # type: ignore[index]
        if max((v or 0) for v in vals) >= 1.0:
            rows.append([h, *(_us(v, 1) for v in vals)])
    head = ["hook (mean CPU us per step)", *(f"{c} {s}" for c, s in cols)]
    return f"At {top} tracked requests:\n\n" + md_table(head, rows)


def _writer_table(results: dict[str, Any]) -> str:
    body = []
    for p in results.get("writer_points", []):
        body.append([
            p["mode"], str(p["tp"]), str(p["d_peers"]), str(p["requests"]), str(p["writes"]),
            _us(p["writes_per_cpu_s"]), _us(p["writes_per_cpu_s_ours"]),
            _us(p["prep_us_per_request"], 1), _us(p["prep_us_per_write"], 1),
            _us(p["prep_ours_us_per_write"], 1), _us(p["descs_us_per_write"], 1),
            f"{p['wall_s']:.2f}",
        ])  # fmt: skip
    head = ["mode", "TP", "D peers", "requests", "WRITEs", "WRITEs/CPU-s",
            "WRITEs/CPU-s (ours)", "prep us/request", "prep us/WRITE", "prep us/WRITE (ours)",
            "descs us/WRITE", "wall s"]  # fmt: skip
    return md_table(head, body)


def markdown(results: dict[str, Any]) -> str:
    m, v, g = results.get("machine", {}), results.get("versions", {}), results.get("git", {})
    lines = [
        "# Connector cost as the work grows (engine side)",
        "",
        f"Machine: {m.get('cpu')}, {m.get('cores')} cores, load average at start "
        f"{m.get('loadavg_start')}, at end {m.get('loadavg_end')}. vLLM {results.get('vllm')}; "
        f"versions {v}; commit {g.get('commit', '?')[:12]}{' (dirty)' if g.get('dirty') else ''}.",
        "",
        f"Config: `{json.dumps(results.get('config', {}))}`",
        "",
        "## Targets",
        "",
        md_table(
            ["target", "side", "what", "measured", "detail", "verdict"],
            [
                [
                    t["id"],
                    t["side"],
                    t["target"],
                    _us(t["measured"], 2 if (t["measured"] or 0) < 100 else 0),
                    t["detail"],
                    t["verdict"],
                ]
                for t in results.get("targets", [])
            ],
        ),  # fmt: skip
    ]
    bad = [(p, invalid_reason(p)) for p in results.get("step_points", [])]
    bad = [(p, why) for p, why in bad if why]
    if bad:
        lines += ["", "Invalid points (left out of the targets):", ""]
        lines += [f"* {p['connector']}, {p['tracked']} tracked: {why}" for p, why in bad]
    if results.get("step_points"):
        lines += [
            "",
            "## Per-step connector cost vs tracked requests",
            "",
            "Engine-thread CPU (`CLOCK_THREAD_CPUTIME_ID`) and wall time in the connector's "
            "hooks per engine step (us), scheduler side and worker side; `writer CPU`: the "
            "writer thread(s) per step (mean us; it polls every millisecond while busy, so "
            "this grows with the step's length, and vLLM's own scheduler takes longer with "
            "more requests) and as a share of one core; `GC per round`: Python's garbage "
            "collections per round (a P step and a D step, mean us, whatever code they "
            "landed in); `total CPU`: engine-thread mean plus writer per step (us), what "
            "the targets judge. Each step adds "
            f"{results['config'].get('changed')} requests to both engines, each with a "
            f"{results['config'].get('prompt_tokens', 16)}-token prompt.",
            "",
            _step_table(results),
            "",
            _hook_table(results),
        ]
    if results.get("writer_points"):
        lines += ["", "## The writer's throughput", "", _writer_table(results)]
    for n in results.get("notes", []):
        lines += ["", f"Note: {n}"]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    pts = results.get("step_points", [])
    if pts:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for c, color in (("ours", "tab:blue"), ("vllm", "tab:orange")):
            for side, style in (("P", "-"), ("D", "--")):
                xy = sorted((p["tracked"], p["cpu_us"][side]["median"]) for p in pts
                            if p["connector"] == c)  # fmt: skip
                if xy:
                    label = f"{'ours' if c == 'ours' else 'vLLM push'} {side}"
                    ax.plot(*zip(*xy), style, marker="o", color=color, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("idle requests tracked per engine")
        ax.set_ylabel("connector CPU per engine step, median (us)")
        ax.set_title("Per-step connector cost vs tracked requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=9)
        fig.tight_layout()
        path = out_dir / "step_cost.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    wp = results.get("writer_points", [])
    if wp:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
        for mode, tp in sorted({(p["mode"], p["tp"]) for p in wp}):
            rows = sorted((p["d_peers"], p) for p in wp if p["mode"] == mode and p["tp"] == tp)
            label = f"{mode}, TP {tp}"
            (line,) = axes[0].plot([n for n, _ in rows], [p["writes_per_cpu_s_ours"]
                                   for _, p in rows], marker="o", label=label)  # fmt: skip
            axes[0].plot([n for n, _ in rows], [p["writes_per_cpu_s"] for _, p in rows], ":",
                         color=line.get_color(), linewidth=0.9)  # fmt: skip
            axes[1].plot([n for n, _ in rows], [_prep(p)[0] for _, p in rows], marker="o",
                         label=label)  # fmt: skip
        axes[0].axhline(LIMITS["writes"], color="grey", linestyle=":", linewidth=1)
        axes[1].axhline(LIMITS["prep_us"], color="grey", linestyle=":", linewidth=1)
        axes[0].set_ylabel("WRITEs per CPU second, one writer thread")
        axes[0].set_title("ours (dotted: with the fake NIXL's calls)", fontsize=9)
        axes[1].set_ylabel("prep per request (whole) / per WRITE (chunks), us")
        axes[1].set_title("ours, without the fake NIXL's initialize_xfer", fontsize=9)
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("D peers")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=9)
        fig.suptitle("The writer's throughput (fake NIXL)")
        fig.tight_layout()
        path = out_dir / "writer.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def write(results: dict[str, Any], out_dir: Path, plots: bool = True) -> dict[str, Path]:
    """results.json, report.md and (``plots``) the PNGs under ``out_dir``."""
    results["targets"] = targets(results)
    # (tables and plots from the rounded numbers: a report rebuilt from the JSON is the same)
    results = compact(results, 3)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "md": out_dir / "report.md"}
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(paths["json"])
    text = markdown(results)
    if plots:
        try:
            for p in plot(results, out_dir):
                paths[p.stem] = p
        except ImportError as e:  # matplotlib missing: the tables still stand
            text += f"\n(no plots: {e})\n"
    paths["md"].write_text(text)
    return paths
