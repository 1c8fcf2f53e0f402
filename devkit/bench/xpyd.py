# SPDX-License-Identifier: Apache-2.0
"""2P2D push: TTFT behind our proxy and behind ``vllm-router``, on the same engines.

``python -m devkit.bench.xpyd --out DIR`` starts two P and two D engines of the
tiny model (P on core 0, D on core 1; our connector as configured by default,
whose P answers a P leg without ``transfer_id`` with the push D leg, so that the
router, which runs the legs one after the other, drives push as well), then in
front of them

* ``proxy``: our proxy, legs concurrent (least-loaded P and D);
* ``proxy-sequential``: our proxy with ``--push-legs sequential`` (what push
  loses when the D leg waits for P's answer, without any other router difference);
* ``vllm-router``: vLLM's router, unmodified (``--policy round_robin``).

Every load point runs against each of them in turn (A B C, C B A, ...), through
vLLM's own ``vllm bench serve`` (:func:`devkit.bench.client.run_point`): random
prompts seeded per point, streaming, ``ignore_eos``. The result is ``xpyd.json``
(every request) and ``xpyd.md`` (TTFT p50/p99, TPOT p50, errors per router and point).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from devkit.bench import client
from devkit.bench.probes import delta, scrape
from devkit.bench.report import percentile
from devkit.bench.workload import Point, point_seed
from devkit.launch.xpyd import XPyDConfig, XPyDDeployment

ROUTERS = ("proxy", "proxy-sequential", "vllm-router")
SETTLE_S = 1.0


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| point | router | ok | errors | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) "
        "| push WRITEs | TTFT p50 per round (ms) |"
    )
    out = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rounds = " ".join(_ms(x) for x in r["ttft_p50_rounds"])
        out.append(
            f"| {r['point']} | {r['router']} | {r['ok']} | {r['errors']} | {_ms(r['ttft_p50'])} "
            f"| {_ms(r['ttft_p99'])} | {_ms(r['tpot_p50'])} | {r['writes']:.0f} | {rounds} |"
        )
    return "\n".join(out)


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key in results["points"]:
        for router in results["routers"]:
            recs = [r for r in results["requests"] if r["point"] == key and r["mode"] == router]
            ok = [r for r in recs if not r["error"] and r["ttft"] is not None]
            writes = sum(
                m.get("vllm:ext_push_writes_total", 0.0)
                for p in results["metrics"]
                if p["point"] == key and p["router"] == router
                for m in p["delta"].values()
            )
            rows.append({
                "point": key, "router": router, "ok": len(ok), "errors": len(recs) - len(ok),
                "ttft_p50": percentile([r["ttft"] for r in ok], 50),
                "ttft_p99": percentile([r["ttft"] for r in ok], 99),
                "tpot_p50": percentile([r["tpot"] for r in ok if r["tpot"] is not None], 50),
                "writes": writes,
                "ttft_p50_rounds": [
                    percentile([r["ttft"] for r in ok if r["round"] == n], 50)
                    for n in sorted({r["round"] for r in recs})
                ],
                "error_samples": sorted({r["error"] for r in recs if r["error"]})[:3],
            })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.bench.xpyd", description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", help="model directory (default: the tiny model, built if needed)")
    ap.add_argument("--input-len", type=int, nargs="+", default=[512])
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    model = args.model
    if model is None:
        from devkit.testing.tiny_model import build_tiny_model

        model = str(build_tiny_model())
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    points = [
        Point(n, args.output_len, args.num_requests, concurrency=c)
        for n in args.input_len
        for c in args.concurrency
    ]
    cfg = XPyDConfig(
        model=model,
        run_dir=out / "logs",
        routers=tuple(args.routers),
    )
    results: dict[str, Any] = {
        "routers": args.routers, "points": [p.key for p in points], "requests": [],
        "metrics": [], "config": {**vars(args), "out": str(out), "model": model},
        "layout": "P0,P1 on core 0; D0,D1 on core 1; one OMP thread, 1 GiB KV cache each",
    }  # fmt: skip
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f}s] {msg}", flush=True)

    with XPyDDeployment(cfg, progress=say) as dep:
        results["startup_s"] = dep.startup_s
        order = list(args.routers)
        for rnd in range(args.rounds):
            for p in points:
                for router in order:
                    before = {e.spec.name: scrape(e.url) for e in dep.engines}
                    result = asyncio.run(
                        client.run_point(
                            dep.url(router), model, p, point_seed(args.seed, p),
                            f"xpyd-{router}-r{rnd}-{p.slug}-", out / "raw",
                            f"{router}-r{rnd}-{p.slug}.json", out / "bench-serve.log",
                        )
                    )  # fmt: skip
                    recs = client.records_from_result(result, router, rnd, p)
                    time.sleep(SETTLE_S)
                    after = {e.spec.name: scrape(e.url) for e in dep.engines}
                    results["requests"].extend(dataclasses.asdict(r) for r in recs)
                    results["metrics"].append({
                        "router": router, "round": rnd, "point": p.key,
                        "delta": {n: delta(before[n], after[n]) for n in before},
                    })  # fmt: skip
                    ok = [r.ttft for r in recs if r.ok and r.ttft is not None]
                    say(
                        f"round {rnd + 1} {p.key} {router}: {len(ok)}/{len(recs)} ok, "
                        f"TTFT p50 {_ms(percentile(ok, 50))} ms"
                    )
            order.reverse()
    rows = summarize(results)
    results["summary"] = rows
    (out / "xpyd.json").write_text(json.dumps(results, indent=1))
    (out / "xpyd.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
