# SPDX-License-Identifier: Apache-2.0
"""Prefix-hit rate of the proxy's ``--routing`` policies, measured with fake engines.

The real proxy runs in front of fake P and D engines (``tests/unit/proxy_fakes.py``:
loopback aiohttp servers, each P answering after ``--p-delay-ms``); a client sends
prompts that share a prefix within groups, ``--concurrency`` at a time, in a seeded
random order. A request is a *hit* when its P had already received a prompt of the
same group (its prefix cache could hold it); the best possible rate is
``1 - groups / requests``. ``p_per_prefix``: on how many P each prefix landed, on
average (the copies the P engines' prefix caches must hold). No real engine runs:
these are routing numbers, not prefill times. ``python3 tools/proxy_prefix_hits.py``
(the pinned env's python, repo root on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "unit"))

from proxy_fakes import xpyd_harness  # noqa: E402

from vllm_ext.proxy.config import ROUTINGS  # noqa: E402


def workload(groups: int, requests: int, hot_share: float, seed: int) -> list[tuple[int, str]]:
    """``(group, prompt)`` per request; group 0 takes ``hot_share`` of them (skew)."""
    rng = random.Random(seed)
    out = []
    for i in range(requests):
        group = 0 if rng.random() < hot_share else rng.randrange(groups)
        prefix = f"You are assistant number {group:04d}. Follow these rules carefully. " * 8
        out.append((group, prefix + f"Question {i}: {rng.random():.6f}?"))
    return out


async def measure(routing: str, args: argparse.Namespace) -> dict[str, object]:
    reqs = workload(args.groups, args.requests, args.hot_share, args.seed)
    group_of = {f"req-{i}": g for i, (g, _) in enumerate(reqs)}
    async with xpyd_harness(args.prefills, args.decodes, routing=routing) as h:
        for e in h.prefills:
            e.delay = args.p_delay_ms / 1000
        gate = asyncio.Semaphore(args.concurrency)

        async def one(i: int, prompt: str) -> None:
            async with gate:
                status, out, _ = await h.post(
                    "/v1/completions", {"prompt": prompt}, {"X-Request-Id": f"req-{i}"}
                )
                assert status == 200, out

        started = time.monotonic()
        await asyncio.gather(*(one(i, p) for i, (_, p) in enumerate(reqs)))
        elapsed = time.monotonic() - started
        hits, copies, per_p = 0, 0, {}
        for e in h.prefills:
            seen: set[int] = set()
            for r in sorted(e.received, key=lambda r: r.at):
                group = group_of[r.headers["X-Request-Id"]]
                hits += group in seen
                seen.add(group)
            per_p[e.name] = len(e.received)
            copies += len(seen)
    distinct = len({g for g, _ in reqs})
    return {
        "routing": routing,
        "prefix_hit_rate": round(hits / len(reqs), 3),
        "best_possible": round(1 - distinct / len(reqs), 3),
        "p_per_prefix": round(copies / distinct, 2),
        "requests_per_p": per_p,
        "seconds": round(elapsed, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefills", type=int, default=4)
    p.add_argument("--decodes", type=int, default=2)
    p.add_argument("--groups", type=int, default=16, help="distinct shared prefixes")
    p.add_argument("--requests", type=int, default=320)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--hot-share", type=float, default=0.0, help="share of group 0 (skew)")
    p.add_argument("--p-delay-ms", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing", choices=ROUTINGS, action="append")
    args = p.parse_args()
    for routing in args.routing or ROUTINGS:
        print(json.dumps(asyncio.run(measure(routing, args))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
