# SPDX-License-Identifier: Apache-2.0
"""The parts of a GPU run's report (``vllm_ext.bench.gpu``) that differ from the CPU one:
the GPU floor table, the hand-off and transfers per point, and the targets of issue 17.

Works on the run's JSON like :mod:`vllm_ext.bench.report`, which calls it for runs
whose config says ``device: cuda``.
"""

from __future__ import annotations

from typing import Any

from vllm_ext.bench import modes as M
from vllm_ext.bench.floor import device_floor_by_len
from vllm_ext.bench.report import _ms, _point_order, _ratio, _row, _table, _verdict, _worst

#: The floor a hand-off is judged on: one NIXL WRITE descriptor of the request's bytes.
FLOOR_KEY = "one_desc"


def _rate(load: str) -> float | None:
    kind, _, v = load.partition("=")
    return float(v.rstrip("/s")) if kind == "rate" else None


def _handoff(r: dict[str, Any] | None) -> tuple[float | None, str]:
    """The hand-off p50 of a row (from the histogram's buckets), else its mean."""
    if r is None:
        return None, ""
    if r.get("handoff_p50") is not None:
        return float(r["handoff_p50"]), "p50"
    if r.get("handoff_mean") is not None:
        return float(r["handoff_mean"]), "mean"
    return None, ""


def summary(results: dict[str, Any]) -> str:
    """One paragraph: GPUs, engine settings, what the budget left out."""
    m = results.get("machine") or {}
    cfg = results.get("config") or {}
    gpu = cfg.get("gpu") or {}
    gpus = ", ".join(m.get("gpus") or []) or "?"
    parts = [
        f"\nGPUs: {gpus}. Model {cfg.get('model_name', '?')}"
        f" (`--load-format {gpu.get('load_format') or 'auto'}`), max model len "
        f"{cfg.get('max_model_len', '?')}, GPU memory {gpu.get('memory_utilization', '?')}, "
        f"{'eager' if gpu.get('enforce_eager') else 'compiled + CUDA graphs'}; P on GPU "
        f"{gpu.get('p_devices', '?')}, D on GPU {gpu.get('d_devices', '?')}."
    ]
    skipped = results.get("skipped") or []
    if skipped:
        parts.append(
            f" Not run (time budget): {len(skipped)} mode x point(s): "
            + ", ".join(f"{s['mode']} {s['point']}" for s in skipped[:12])
            + (" ..." if len(skipped) > 12 else "")
            + "."
        )
    if results.get("budget_stop"):
        parts.append(f" {results['budget_stop']}")
    return "".join(parts)


def floor_table(results: dict[str, Any]) -> str:
    """The GPU floor per input length: copy, one descriptor, every layout/placement."""
    fl = results.get("floor_gpu") or {}
    by_len = device_floor_by_len(fl)
    if not by_len:
        err = fl.get("error") if fl else "not measured"
        return f"(no GPU floor: {err})"
    variants = []
    for row in fl.get("cases") or []:
        key = f"{row['layout']}/{row['placement']}"
        if key not in variants:
            variants.append(key)
    header = ["input", "KV MiB", "torch peer copy", *variants]
    body = []
    for n in sorted(by_len):
        f = by_len[n]
        cells = [str(n), f"{f['bytes'] / 2**20:,.0f}", _ms(f.get("copy"), 2)]
        for v in variants:
            t, d = f.get(v), f.get(f"{v}:descriptors")
            cells.append("-" if t is None else f"{_ms(t, 2)} ({d:,} desc)")
        body.append(cells)
    note = (
        "\n\nNIXL WRITE post -> notification at the target, p50 ms (descriptors per WRITE); "
        "one process per GPU, VRAM; `cross-layer/contiguous` is one descriptor of all the "
        "bytes; `scattered`: a random pick of free blocks on each side."
    )
    err = f"\n(floor error: {fl['error']})" if fl.get("error") else ""
    bad = [f"{r['layout']}/{r['placement']}" for r in fl.get("cases") or [] if not r["data_ok"]]
    bad_note = f"\n(DATA CHECK FAILED: {', '.join(bad)})" if bad else ""
    return _table(header, body) + note + err + bad_note


def transfer_table(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Per point: our hand-off against the floor, descriptors and transfer times."""
    floor = device_floor_by_len(results.get("floor_gpu") or {})
    pull = M.PULL
    header = [
        "input", "load", "push hand-off p50 / p90 (mean)", "/ floor (1 desc)",
        "push desc/WRITE", "push WRITE (nixl xfer) mean", "push D recv wait p50",
        "pull READ mean / p50", "pull desc/READ", "pull post mean",
    ]  # fmt: skip
    body = []
    for n, load in _point_order(rows):
        ours, theirs = _row(rows, M.OURS, n, load) or {}, _row(rows, pull, n, load) or {}
        if not ours and not theirs:
            continue
        h, _ = _handoff(ours)
        ratio = _ratio(h, floor.get(n, {}).get(FLOOR_KEY))
        descs = ours.get("descriptors_per_xfer")
        p_descs = theirs.get("descriptors_per_xfer")
        body.append([
            str(n), load,
            f"{_ms(ours.get('handoff_p50'), 2)} / {_ms(ours.get('handoff_p90'), 2)} "
            f"({_ms(ours.get('handoff_mean'), 2)})",
            "-" if ratio is None else f"{ratio:.2f}",
            "-" if descs is None else f"{descs:,.0f}",
            _ms(ours.get("xfer_mean"), 2), _ms(ours.get("recv_wait_p50"), 1),
            f"{_ms(theirs.get('xfer_mean'), 1)} / {_ms(theirs.get('xfer_p50'), 1)}",
            "-" if p_descs is None else f"{p_descs:,.0f}", _ms(theirs.get("post_mean"), 1),
        ])  # fmt: skip
    note = (
        "\n\nHand-off: P's KV final -> WRITE done (`vllm:ext_push_handoff_seconds`; p50/p90 "
        "interpolated in its buckets). Descriptors and transfer times: NIXL telemetry "
        "(`vllm:nixl_num_descriptors`, `vllm:nixl_xfer_time_seconds`, "
        "`vllm:nixl_post_time_seconds`)."
    )
    return _table(header, body) + note


def handoff_tables(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    return (
        "\n**The floor between the two GPUs (ms)**\n\n"
        + floor_table(results)
        + "\n\n**KV hand-off and transfers per point (ms)**\n\n"
        + transfer_table(results, rows)
    )


def targets(results: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of issue 17, each with its measured ratio and verdict."""
    out: list[dict[str, Any]] = []

    def add(tid: str, text: str, ratio: float | None, limit: float, detail: str) -> None:
        out.append({"id": tid, "target": text, "ratio": ratio, "limit": limit,
                    "verdict": _verdict(ratio, limit), "detail": detail})  # fmt: skip

    points = _point_order(rows)
    for tid, key, limit, text in (
        ("G1", "ttft_p50", 0.7, "push TTFT p50 <= 0.7x pull (every point; worst shown)"),
        ("G2", "tpot_p50", 1.0, "push TPOT p50 <= pull (every point; worst shown)"),
    ):
        ratios, details = [], []
        for n, load in points:
            o, p = _row(rows, M.OURS, n, load) or {}, _row(rows, M.PULL, n, load) or {}
            rr = _ratio(o.get(key), p.get(key))
            if rr is not None:
                ratios.append(rr)
                details.append(f"in={n} {load}: {rr:.2f}")
        add(tid, text, _worst(ratios), limit, ", ".join(details))
    floor = device_floor_by_len(results.get("floor_gpu") or {})
    for tid, rate, limit in (("G3", 2.0, 2.0), ("G4", 8.0, 4.0)):
        ratios, details = [], []
        for n, load in points:
            if _rate(load) != rate:
                continue
            h, kind = _handoff(_row(rows, M.OURS, n, load))
            f = floor.get(n, {}).get(FLOOR_KEY)
            rr = _ratio(h, f)
            if rr is not None and h is not None and f is not None:
                ratios.append(rr)
                details.append(f"in={n}: {h * 1e3:.2f} ({kind}) / {f * 1e3:.2f} ms = {rr:.2f}")
        add(tid, f"hand-off p50 <= {limit:g}x floor (one NIXL descriptor) at {rate:g} QPS",
            _worst(ratios), limit, "; ".join(details))  # fmt: skip
    failed = {m: 0 for m in sorted({r["mode"] for r in rows})}
    for r in rows:
        failed[r["mode"]] += int(r.get("failed") or 0)
    total = sum(failed.values())
    add("G5", "zero failed requests (every mode and point)", float(total) if rows else None, 0.0,
        ", ".join(f"{m}: {v}" for m, v in failed.items()))  # fmt: skip
    return out
