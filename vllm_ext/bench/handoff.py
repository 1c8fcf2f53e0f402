# SPDX-License-Identifier: Apache-2.0
"""The hand-off stages of each request, from the traces ``trace_push`` writes.

    python -m vllm_ext.bench.handoff runs/bench-X/logs/NN-push-0.23-traced/trace

Pairs P's and D's events per request (P's request id, D's request id from the
match, the completion notification ``<D request id>:<tp>``) and reports each
stage's p50 / mean / max in milliseconds.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

#: where the traced engines write (set by the runner for ``trace`` modes)
TRACE_ENV = "VLLM_EXT_TRACE_DIR"


def _load(trace_dir: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for f in sorted(trace_dir.glob("trace-*.jsonl")):
        evs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        side = "P" if f.name.startswith("trace-prefill") else "D"
        out.setdefault(side, []).extend(evs)
    return out


def _first(evs: list[dict[str, Any]], ev: str, **match: Any) -> dict[str, Any] | None:
    for e in evs:
        if e["ev"] == ev and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def breakdown(trace_dir: Path) -> dict[str, Any]:
    """Per-request stages (ms) of the push hand-off from P's and D's traces."""
    tr = _load(trace_dir)
    p, d = tr.get("P", []), tr.get("D", [])
    stages: dict[str, list[float]] = {}
    n = 0
    for e in p:
        if e["ev"] != "meta_fin":
            continue
        rid = e["rid"]
        w_fin = _first(p, "w_fin", rid=rid)
        w_write = _first(p, "w_write", p_rid=rid)
        d_rid = w_write and w_write.get("d_rid")
        notif = f"{d_rid}:" if d_rid else None
        init = next((x for x in p if x["ev"] == "init_xfer"
                     and (x.get("notif") or "").startswith(notif or "\0")), None)  # fmt: skip
        xfer = next((x for x in p if x["ev"] == "transfer"
                     and (x.get("notif") or "").startswith(notif or "\0")), None)  # fmt: skip
        done = next((x for x in p if x["ev"] == "xfer_done"
                     and (x.get("notif") or "").startswith(notif or "\0")), None)  # fmt: skip
        settle = _first(p, "settle", rid=rid)
        d_in = next((x for x in d if x["ev"] == "notif_in"
                     and (x.get("msg") or "").startswith(notif or "\0")), None)  # fmt: skip
        d_got = _first(d, "got_recv", rid=d_rid) if d_rid else None
        if not (w_fin and init and xfer and done and settle):
            continue
        n += 1
        seq = [
            ("scheduler finished -> worker step (meta)", e["finished_at"], e["t"]),
            ("worker -> writer picks it up", e["t"], w_fin["t"]),
            ("writer: match + descriptors", w_fin["t"], init["t0"]),
            ("initialize_xfer", init["t0"], init["t"]),
            ("transfer() post", xfer["t0"], xfer["t"]),
            ("post -> DONE seen by P writer", xfer["t"], done["t"]),
            ("DONE -> settled (hand-off end)", done["t"], settle["t"]),
            ("hand-off total (P finished -> settled)", e["finished_at"], settle["t"]),
        ]
        if d_in:
            seq.append(("post -> completion notif read on D", xfer["t"], d_in["t"]))
        if d_in and d_got:
            seq.append(("D notif read -> D get_finished reports it", d_in["t"], d_got["t"]))
            seq.append(("P finished -> D get_finished reports it", e["finished_at"], d_got["t"]))
        for name, a, b in seq:
            stages.setdefault(name, []).append((b - a) * 1e3)
    return {
        "requests": n,
        "stages_ms": {
            k: {"p50": statistics.median(v), "mean": statistics.fmean(v), "max": max(v)}
            for k, v in stages.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    res = breakdown(Path(args[0]))
    print(f"{res['requests']} requests")
    for k, v in res["stages_ms"].items():
        print(f"  {k:45s} p50 {v['p50']:8.3f}  mean {v['mean']:8.3f}  max {v['max']:8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
