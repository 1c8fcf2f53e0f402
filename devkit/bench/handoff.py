# SPDX-License-Identifier: Apache-2.0
"""The hand-off stages of each request, from the traces ``trace_push`` writes.

    python -m devkit.bench.handoff runs/bench-X [push-0.23-traced]

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
    for evs in out.values():  # one side's files (worker, scheduler) on one clock
        evs.sort(key=lambda e: e["t"])
    return out


def _scheduled_between(sched: list[dict[str, Any]], a: float, b: float) -> int:
    """Tokens the engine scheduled in the steps it built between ``a`` and ``b`` (with
    asynchronous scheduling the device runs each step a little later)."""
    return sum(e.get("tokens") or 0 for e in sched if a <= e["t"] <= b)


def _first(
    evs: list[dict[str, Any]], ev: str, after: float = float("-inf"), **match: Any
) -> dict[str, Any] | None:
    for e in evs:
        if e["ev"] == ev and e["t"] >= after and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def client_times(raw_dir: Path, run_id: str, mode: str) -> dict[str, tuple[str, float, float]]:
    """``X-Request-Id -> (point slug, sent, first token)`` from ``vllm bench serve``'s
    detailed results (``raw/<mode>-r<R>-<slug>.json``, ids ``<run>-<mode>-r<R>-<slug>-<i>``)."""
    out: dict[str, tuple[str, float, float]] = {}
    for f in sorted(raw_dir.glob(f"{mode}-r*-*.json")):
        res = json.loads(f.read_text())
        slug = f.stem.removeprefix(f"{mode}-").split("-", 1)[1]
        starts, ttfts = res.get("start_times") or [], res.get("ttfts") or []
        for i, (t0, ttft) in enumerate(zip(starts, ttfts)):
            if ttft:
                out[f"{run_id}-{f.stem}-{i}"] = (slug, t0, t0 + ttft)
    return out


def _same_notif(logged: str, notif: str | None) -> bool:
    """The (possibly truncated) logged message is the completion ``notif`` (``<id>:``)."""
    if not notif or not logged:
        return False
    return logged.startswith(notif) or (len(logged) >= 60 and notif.startswith(logged))


def _x_request_id(vllm_request_id: str) -> str:
    """vLLM's internal id ``cmpl-<X-Request-Id>-<n>-<8 hex>`` -> the X-Request-Id."""
    return vllm_request_id.removeprefix("cmpl-").rsplit("-", 2)[0]


def _summary(stages: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        k: {"p50": statistics.median(v), "mean": statistics.fmean(v), "max": max(v), "n": len(v)}
        for k, v in stages.items()
    }


def breakdown(
    trace_dir: Path, clients: dict[str, tuple[str, float, float]] | None = None
) -> dict[str, Any]:
    """Per-request stages (ms) of the push hand-off from P's and D's traces; with
    ``clients`` (:func:`client_times`) also per point and with the client's ends."""
    tr = _load(trace_dir)
    p, d = tr.get("P", []), tr.get("D", [])
    stages: dict[str, list[float]] = {}
    by_point: dict[str, dict[str, list[float]]] = {}
    p_sched = [e for e in p if e["ev"] == "sched"]
    #: per WRITE (the one with the completion): (its post -> DONE in ms, the tokens P
    #: scheduled meanwhile): is a slow WRITE one that ran beside P's next prefill?
    contention: dict[str, list[tuple[float, int]]] = {}
    n = prepared = 0
    for e in p:
        if e["ev"] != "handed":
            continue
        rid = e["rid"]
        # With push_prepare_at_announce the writer saw the request (and prepared its
        # WRITE) before the KV was final: the pick-up is its first pass after "handed".
        w_fin = _first(p, "w_fin", after=e["t"], rid=rid)
        w_write = _first(p, "w_write", p_rid=rid)
        d_rid = w_write and w_write.get("d_rid")
        notif = f"{d_rid}:" if d_rid else None
        init = next((x for x in p if x["ev"] == "init_xfer"
                     and (x.get("notif") or "").startswith(notif or "\0")), None)  # fmt: skip
        xfer = next((x for x in p if x["ev"] == "transfer"
                     and (x.get("notif") or "").startswith(notif or "\0")), None)  # fmt: skip
        done = next((x for x in p if x["ev"] == "xfer_done"
                     and (x.get("notif") or "").startswith(notif or "\0")), None)  # fmt: skip
        if xfer is not None and xfer.get("state") == "DONE":
            done = xfer  # done within transfer(): no check_xfer_state call
        settle = _first(p, "settle", rid=rid)
        d_in = next((x for x in d if x["ev"] == "notif_in"
                     and _same_notif(x.get("msg") or "", notif)), None)  # fmt: skip
        d_got = _first(d, "got_recv", rid=d_rid) if d_rid else None
        if not (w_fin and init and xfer and done and settle):
            continue
        n += 1
        prepared += init["t"] <= e["t"]
        seq = [
            ("P KV final -> handed to the writer", e["finished_at"], e["t"]),
            ("handed -> writer picks it up", e["t"], w_fin["t"]),
            (
                "writer: pick-up -> transfer() (match, descriptors, init unless prepared)",
                w_fin["t"],
                xfer["t0"],
            ),
            ("initialize_xfer", init["t0"], init["t"]),
            ("transfer() post", xfer["t0"], xfer["t"]),
            ("post -> DONE seen by P writer", xfer["t"], done["t"]),
            ("DONE -> settled (hand-off end)", done["t"], settle["t"]),
            ("hand-off total (P finished -> settled)", e["finished_at"], settle["t"]),
        ]
        if d_in:
            seq.append(("post -> completion notif read on D", xfer["t"], d_in["t"]))
            ready = "P KV final -> completion read on D (D ready)"
            seq.append((ready, e["finished_at"], d_in["t"]))
        if d_in and d_got:
            seq.append(("D notif read -> D get_finished reports it", d_in["t"], d_got["t"]))
            seq.append(("P finished -> D get_finished reports it", e["finished_at"], d_got["t"]))
        client = (clients or {}).get(_x_request_id(d_rid)) if d_rid else None
        if client is not None:
            _, sent, first = client
            seq.insert(0, ("client sent -> P KV final (prefill)", sent, e["finished_at"]))
            if d_got:
                seq.append(("D get_finished -> first token at client", d_got["t"], first))
            seq.append(("client sent -> first token (TTFT)", sent, first))
        group = client[0] if client is not None else "warm-up"
        for name, a, b in seq:
            stages.setdefault(name, []).append((b - a) * 1e3)
            by_point.setdefault(group, {}).setdefault(name, []).append((b - a) * 1e3)
        if p_sched:
            busy = _scheduled_between(p_sched, xfer["t0"], done["t"])
            row = ((done["t"] - xfer["t"]) * 1e3, busy)
            contention.setdefault("all", []).append(row)
            contention.setdefault(group, []).append(row)
    return {
        "requests": n,
        "prepared_before_kv_final": prepared,
        "stages_ms": _summary(stages),
        "by_point": {k: _summary(v) for k, v in by_point.items()},
        "write_vs_p_load": {k: _contention(v) for k, v in contention.items()},
    }


def _contention(rows: list[tuple[float, int]]) -> dict[str, Any]:
    """The WRITEs (post -> DONE) that ran while P scheduled no tokens against those that
    ran beside P's next forward passes."""
    alone = [ms for ms, tokens in rows if tokens == 0]
    beside = [ms for ms, tokens in rows if tokens > 0]
    out: dict[str, Any] = {"n": len(rows)}
    for name, xs in (("p_idle", alone), ("p_computing", beside)):
        if xs:
            out[name] = {"n": len(xs), "p50_ms": statistics.median(xs), "max_ms": max(xs)}
    if len(rows) >= 3 and len({t for _, t in rows}) > 1 and len({ms for ms, _ in rows}) > 1:
        out["pearson_ms_tokens"] = statistics.correlation(
            [ms for ms, _ in rows], [float(t) for _, t in rows]
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m devkit.bench.handoff RUN_DIR [MODE]`` (default mode push-0.23-traced)."""
    args = argv if argv is not None else sys.argv[1:]
    run = Path(args[0])
    mode = args[1] if len(args) > 1 else "push-0.23-traced"
    traces = sorted(run.glob(f"logs/*-{mode}*/trace"))
    if not traces:
        print(f"no traces of {mode} under {run}/logs")
        return 1
    clients = client_times(run / "raw", run.name, mode)
    res = breakdown(traces[-1], clients)
    print(
        f"{res['requests']} requests ({mode}, {traces[-1]}); WRITE prepared before the KV"
        f" was final: {res['prepared_before_kv_final']}"
    )
    for group, st in [("all", res["stages_ms"]), *sorted(res["by_point"].items())]:
        print(f"-- {group}")
        for k, v in st.items():
            print(f"  {k:48s} p50 {v['p50']:8.2f}  mean {v['mean']:8.2f}  max {v['max']:8.2f} ms")
    print("-- WRITE (post -> DONE) vs the tokens P scheduled meanwhile")
    for group, c in sorted(res["write_vs_p_load"].items()):
        print(f"  {group}: {c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
