# SPDX-License-Identifier: Apache-2.0
"""The parts of a GPU run's report (``devkit.bench.gpu``) that differ from the CPU one:
the GPU floor table, the hand-off and transfers per point, the stages of traced
hand-offs, and the GPU targets.

Works on the run's JSON like :mod:`devkit.bench.report`, which calls it for runs
whose config says ``device: cuda``.
"""

from __future__ import annotations

from typing import Any

from devkit.bench import modes as M
from devkit.bench.floor import device_floor_by_len
from devkit.bench.tables import (
    fmt_ms,
    md_table,
    point_order,
    ratio_of,
    row_at,
    verdict_of,
    worst_of,
)

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
        cells = [str(n), f"{f['bytes'] / 2**20:,.0f}", fmt_ms(f.get("copy"), 2)]
        for v in variants:
            t, d = f.get(v), f.get(f"{v}:descriptors")
            cells.append("-" if t is None else f"{fmt_ms(t, 2)} ({d:,} desc)")
        body.append(cells)
    note = (
        "\n\nNIXL WRITE post -> notification at the target, p50 ms (descriptors per WRITE); "
        "one process per GPU, VRAM; `cross-layer/contiguous` is one descriptor of all the "
        "bytes; `scattered`: a random pick of free blocks on each side."
    )
    err = f"\n(floor error: {fl['error']})" if fl.get("error") else ""
    bad = [f"{r['layout']}/{r['placement']}" for r in fl.get("cases") or [] if not r["data_ok"]]
    bad_note = f"\n(DATA CHECK FAILED: {', '.join(bad)})" if bad else ""
    return md_table(header, body) + note + err + bad_note


def _known(rows: list[dict[str, Any]]) -> list[str]:
    """The run's modes that the mode table knows (variants included), sorted."""
    return sorted({r["mode"] for r in rows if r["mode"].split("+", 1)[0] in M.MODES})


def _our_push(rows: list[dict[str, Any]]) -> str:
    """The mode the transfer table shows as ours: ``push-0.23``, else our push on
    another pin (``push-0.34``), else (a run of traced or other variants only) the first
    mode of ours in the run."""
    names = _known(rows)
    if M.OURS in names:
        return M.OURS
    plain = [m for m in names if "+" not in m and M.mode_of(m).ours]
    if plain:
        return plain[0]
    return next((m for m in names if M.mode_of(m).extends_ours), M.OURS)


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
    mine = _our_push(rows)
    for n, load in point_order(rows):
        ours, theirs = row_at(rows, mine, n, load) or {}, row_at(rows, pull, n, load) or {}
        if not ours and not theirs:
            continue
        h, _ = _handoff(ours)
        ratio = ratio_of(h, floor.get(n, {}).get(FLOOR_KEY))
        descs = ours.get("descriptors_per_xfer")
        p_descs = theirs.get("descriptors_per_xfer")
        body.append([
            str(n), load,
            f"{fmt_ms(ours.get('handoff_p50'), 2)} / {fmt_ms(ours.get('handoff_p90'), 2)} "
            f"({fmt_ms(ours.get('handoff_mean'), 2)})",
            "-" if ratio is None else f"{ratio:.2f}",
            "-" if descs is None else f"{descs:,.0f}",
            fmt_ms(ours.get("xfer_mean"), 2), fmt_ms(ours.get("recv_wait_p50"), 1),
            f"{fmt_ms(theirs.get('xfer_mean'), 1)} / {fmt_ms(theirs.get('xfer_p50'), 1)}",
            "-" if p_descs is None else f"{p_descs:,.0f}", fmt_ms(theirs.get("post_mean"), 1),
        ])  # fmt: skip
    note = (
        "\n\nHand-off: P's KV final -> WRITE done (`vllm:ext_push_handoff_seconds`; p50/p90 "
        "interpolated in its buckets). Descriptors and transfer times: NIXL telemetry "
        "(`vllm:nixl_num_descriptors`, `vllm:nixl_xfer_time_seconds`, "
        "`vllm:nixl_post_time_seconds`)."
    )
    return md_table(header, body) + note


#: The floor the issue's hand-off target uses: cross-layer KV, blocks scattered on both sides.
SCATTERED_FLOOR_KEY = "cross-layer/scattered"
#: vs vLLM's own push: ours may be at most this fraction of its TTFT p50 where the
#: prefill queue does not dominate (every length at 0.5/s, 2k at every rate), at most
#: its TTFT everywhere, and its connector share (hand-off) at most 0.1x at 8k and 16k.
VS_TTFT_UNQUEUED, VS_TTFT_ALL, VS_HANDOFF, VS_HANDOFF_LENS, VS_FLOOR = (
    0.7,
    1.0,
    0.1,
    (8192, 16384),
    2.0,
)


def baseline_mode(rows: list[dict[str, Any]]) -> str | None:
    """vLLM's own push in this run (``vllm-push-*``, not a variant), if any."""
    names = sorted({r["mode"] for r in rows if r["mode"].startswith("vllm-push-")})
    plain = [m for m in names if "+" not in m and not m.endswith("-tuned")]
    return plain[0] if plain else None


def our_modes(rows: list[dict[str, Any]]) -> list[str]:
    """Our push (``push-0.23``, ``push-0.34``, ...) and its variants in this run, the
    plain modes first."""
    names = [m for m in _known(rows) if M.mode_of(m.split("+", 1)[0]).ours]
    return sorted(names, key=lambda m: ("+" in m, m))


def single_mode(rows: list[dict[str, Any]], like: str) -> str:
    """The one-engine mode on ``like``'s pin (``single-0.34``; its cells are empty where
    the run has none)."""
    pin = M.mode_of(like).pin
    named = [m for m in M.MODES if M.mode_of(m).launch == "single" and M.mode_of(m).pin == pin]
    return next((m for m in _known(rows) if m in named), named[0] if named else M.SINGLE)


def trace_handoff(results: dict[str, Any], mode: str, n: int, load: str) -> float | None:
    """The traced hand-off p50 (seconds) of a mode at a point: P's prefill done -> D's KV
    usable, one clock for every connector (``handoff_trace_ms`` of the point's record)."""
    for p in results.get("points") or []:
        if p.get("mode") == mode and p.get("input_len") == n and p.get("load") == load:
            v = (p.get("handoff_trace_ms") or {}).get("p50")
            if v is not None:
                return float(v) / 1e3
    return None


def _unqueued(n: int, load: str) -> bool:
    """Points where the prefill queue does not dominate TTFT: 0.5/s, and 2k at any rate."""
    return _rate(load) == 0.5 or n == 2048


def vs_vllm_push_table(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Per point: our modes against vLLM's own push and the single engine."""
    base = baseline_mode(rows)
    ours = our_modes(rows)
    if base is None or not ours:
        return ""
    floor = device_floor_by_len(results.get("floor_gpu") or {})
    header = ["input", "load"]
    for m in ours:
        header += [f"TTFT p50 / p90 {m}", "/ vLLM", f"TPOT p50 {m}", "/ vLLM",
                   f"hand-off p50 {m}", "/ vLLM", "/ floor"]  # fmt: skip
    single = single_mode(rows, base)
    header += [f"TTFT p50 / p90 {base}", f"TPOT p50 {base}", f"hand-off p50 {base}",
               f"TTFT p50 / p90 {single}", f"TPOT p50 {single}",
               "floor (cross-layer scattered)"]  # fmt: skip
    body = []
    for n, load in point_order(rows):
        b = row_at(rows, base, n, load) or {}
        bh = trace_handoff(results, base, n, load)
        fl = floor.get(n, {}).get(SCATTERED_FLOOR_KEY)
        cells = [str(n), load]
        for m in ours:
            o = row_at(rows, m, n, load) or {}
            oh = trace_handoff(results, m, n, load)
            cells += [
                f"{fmt_ms(o.get('ttft_p50'))} / {fmt_ms(o.get('ttft_p90'))}",
                _fmt_ratio(ratio_of(o.get("ttft_p50"), b.get("ttft_p50"))),
                fmt_ms(o.get("tpot_p50"), 2),
                _fmt_ratio(ratio_of(o.get("tpot_p50"), b.get("tpot_p50"))),
                fmt_ms(oh, 1), _fmt_ratio(ratio_of(oh, bh)), _fmt_ratio(ratio_of(oh, fl)),
            ]  # fmt: skip
        s = row_at(rows, single, n, load) or {}
        cells += [
            f"{fmt_ms(b.get('ttft_p50'))} / {fmt_ms(b.get('ttft_p90'))}",
            fmt_ms(b.get("tpot_p50"), 2),
            fmt_ms(bh, 1), f"{fmt_ms(s.get('ttft_p50'))} / {fmt_ms(s.get('ttft_p90'))}",
            fmt_ms(s.get("tpot_p50"), 2), fmt_ms(fl, 2),
        ]  # fmt: skip
        body.append(cells)
    note = (
        "\n\nHand-off: P's scheduler finishing the prefill (after the last prompt token) -> "
        "D's worker reporting the KV received, joined by transfer id "
        "(`devkit.bench.handoff_trace`, the same clock for every connector). Floor: NIXL "
        "WRITE post -> notification, cross-layer KV with scattered blocks, this run."
    )
    return md_table(header, body) + note


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"


def handoff_tables(results: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    vs = vs_vllm_push_table(results, rows)
    return (
        "\n**The floor between the two GPUs (ms)**\n\n"
        + floor_table(results)
        + "\n\n**KV hand-off and transfers per point (ms)**\n\n"
        + transfer_table(results, rows)
        + (f"\n\n**Ours vs vLLM's own push and one engine (ms)**\n\n{vs}" if vs else "")
        + stage_tables(results)
    )


#: (column, stage of ``handoff.breakdown``): where a traced hand-off's time goes
TRACE_COLUMNS = [
    ("KV final -> writer", "P KV final -> handed to the writer"),
    ("-> pick-up", "handed -> writer picks it up"),
    ("-> post", "writer: pick-up -> transfer() (match, descriptors, init unless prepared)"),
    ("post -> DONE", "post -> DONE seen by P writer"),
    ("post -> D reads it", "post -> completion notif read on D"),
    ("-> D's step reports it", "D notif read -> D get_finished reports it"),
    ("KV final -> D reports", "P finished -> D get_finished reports it"),
]


def stage_tables(results: dict[str, Any]) -> str:
    """Per traced mode and point: the hand-off's stages (p50, ms), and each WRITE's
    post -> DONE set against whether P computed meanwhile (``write_vs_p_load``)."""
    out = []
    for mode, bd in sorted((results.get("trace") or {}).items()):
        body = []
        load = bd.get("write_vs_p_load") or {}
        for point, st in sorted(bd.get("by_point", {}).items()):
            row = [point, str(int(st.get(TRACE_COLUMNS[0][1], {}).get("n", 0)))]
            row += [f"{st[s]['p50']:.1f}" if s in st else "-" for _, s in TRACE_COLUMNS]
            c = load.get(point) or {}
            for side in ("p_idle", "p_computing"):
                v = c.get(side)
                row.append(f"{v['p50_ms']:.1f} ({v['n']})" if v else "-")
            body.append(row)
        if not body:
            continue
        header = ["point", "n", *(c for c, _ in TRACE_COLUMNS),
                  "post -> DONE, P idle (n)", "P computing (n)"]  # fmt: skip
        out.append(f"\n\n**Where the hand-off goes, {mode} (p50, ms; traced)**\n\n")
        out.append(md_table(header, body))
    return "".join(out)


def vs_vllm_push_targets(
    results: dict[str, Any], rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The targets against vLLM's own push in the same run, for each of our modes."""
    base = baseline_mode(rows)
    if base is None:
        return []
    floor = device_floor_by_len(results.get("floor_gpu") or {})
    points = point_order(rows)
    out: list[dict[str, Any]] = []
    for i, m in enumerate(our_modes(rows)):
        tag = "" if i == 0 else f" [{m}]"

        def add(tid: str, text: str, pairs: list[tuple[str, float | None]], limit: float,
                tag: str = tag, i: int = i) -> None:  # fmt: skip
            got = [(k, r) for k, r in pairs if r is not None]
            ratio = worst_of([r for _, r in got])
            out.append({"id": f"V{tid}" + (f".{i}" if i else ""), "target": text + tag,
                        "ratio": ratio, "limit": limit, "verdict": verdict_of(ratio, limit),
                        "detail": ", ".join(f"{k}: {r:.2f}" for k, r in got)})  # fmt: skip

        def ratio_at(key: str, n: int, load: str, m: str = m) -> float | None:
            o, b = row_at(rows, m, n, load) or {}, row_at(rows, base, n, load) or {}
            return ratio_of(o.get(key), b.get(key))

        add("1", f"TTFT p50 <= {VS_TTFT_UNQUEUED:g}x {base} at 0.5/s and at 2k (worst)",
            [(f"in={n} {ld}", ratio_at("ttft_p50", n, ld)) for n, ld in points
             if _unqueued(n, ld)], VS_TTFT_UNQUEUED)  # fmt: skip
        add(
            "2",
            f"TTFT p50 <= {VS_TTFT_ALL:g}x {base} at every point (worst)",
            [(f"in={n} {ld}", ratio_at("ttft_p50", n, ld)) for n, ld in points],
            VS_TTFT_ALL,
        )
        add("3", f"hand-off p50 <= {VS_HANDOFF:g}x {base}'s at 8k and 16k (traced; worst)",
            [(f"in={n} {ld}", ratio_of(trace_handoff(results, m, n, ld),
                                     trace_handoff(results, base, n, ld)))
             for n, ld in points if n in VS_HANDOFF_LENS], VS_HANDOFF)  # fmt: skip
        add(
            "4",
            f"TPOT p50 <= {base}'s at every point (worst)",
            [(f"in={n} {ld}", ratio_at("tpot_p50", n, ld)) for n, ld in points],
            1.0,
        )
        add("5", f"hand-off p50 <= {VS_FLOOR:g}x the cross-layer scattered floor (traced; worst)",
            [(f"in={n} {ld}", ratio_of(trace_handoff(results, m, n, ld),
                                     floor.get(n, {}).get(SCATTERED_FLOOR_KEY)))
             for n, ld in points], VS_FLOOR)  # fmt: skip
    return out


def targets(results: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPU targets (docs/benchmarks.md, *On GPUs*), each with its measured ratio and verdict."""
    out: list[dict[str, Any]] = []

    def add(tid: str, text: str, ratio: float | None, limit: float, detail: str) -> None:
        out.append({"id": tid, "target": text, "ratio": ratio, "limit": limit,
                    "verdict": verdict_of(ratio, limit), "detail": detail})  # fmt: skip

    points = point_order(rows)
    for tid, key, limit, text in (
        ("G1", "ttft_p50", 0.7, "push TTFT p50 <= 0.7x pull (every point; worst shown)"),
        ("G2", "tpot_p50", 1.0, "push TPOT p50 <= pull (every point; worst shown)"),
    ):
        ratios, details = [], []
        for n, load in points:
            o, p = row_at(rows, M.OURS, n, load) or {}, row_at(rows, M.PULL, n, load) or {}
            rr = ratio_of(o.get(key), p.get(key))
            if rr is not None:
                ratios.append(rr)
                details.append(f"in={n} {load}: {rr:.2f}")
        add(tid, text, worst_of(ratios), limit, ", ".join(details))
    floor = device_floor_by_len(results.get("floor_gpu") or {})
    for tid, rate, limit in (("G3", 2.0, 2.0), ("G4", 8.0, 4.0)):
        ratios, details = [], []
        for n, load in points:
            if _rate(load) != rate:
                continue
            h, kind = _handoff(row_at(rows, M.OURS, n, load))
            f = floor.get(n, {}).get(FLOOR_KEY)
            rr = ratio_of(h, f)
            if rr is not None and h is not None and f is not None:
                ratios.append(rr)
                details.append(f"in={n}: {h * 1e3:.2f} ({kind}) / {f * 1e3:.2f} ms = {rr:.2f}")
        add(tid, f"hand-off p50 <= {limit:g}x floor (one NIXL descriptor) at {rate:g} QPS",
            worst_of(ratios), limit, "; ".join(details))  # fmt: skip
    failed = {m: 0 for m in sorted({r["mode"] for r in rows})}
    for r in rows:
        failed[r["mode"]] += int(r.get("failed") or 0)
    total = sum(failed.values())
    add("G5", "zero failed requests (every mode and point)", float(total) if rows else None, 0.0,
        ", ".join(f"{m}: {v}" for m, v in failed.items()))  # fmt: skip
    return out + vs_vllm_push_targets(results, rows)
