# SPDX-License-Identifier: Apache-2.0
"""vLLM's ``Scheduler.schedule()`` with N requests waiting for remote KV (the walk).

One D engine as the scale benchmark builds it (``scale_engines.ScaleEngine``: real
``Scheduler``, the connector's scheduler side, worker ranks on the fake NIXL fabric)
gets ``N`` push D legs whose KV never arrives: after their first step all ``N`` are
in ``WAITING_FOR_REMOTE_KVS``. Then each step is ``schedule()`` and
``update_from_output()`` with an empty model output (no worker step: only vLLM's
scheduler and the connector's scheduler hooks run), and ``schedule()`` is timed.
vLLM 0.34.0 visits every waiting request on every step (pops it from
``kv_holding_waiting``, finds its KV has not arrived, puts it back); with
patches/vllm-0.34.0/0004 it does not.

    python -m devkit.bench.sched_walk [--n 100 1000 4000] [--steps 200] [--connector vllm]

Prints one JSON line per N. Run it once per vLLM tree (e.g. the patched one first on
``PYTHONPATH``) and compare.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

from vllm.v1.request import RequestStatus

from devkit.bench.scale_engines import open_fabric
from devkit.bench.scale_step import step_prompt
from devkit.testing.tiny_model import build_tiny_model
from vllm_ext import compat


def _waiting_for_kv(sched: Any) -> int:
    return sum(
        1 for r in sched.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    )


def measure(n: int, steps: int, connector: str) -> dict[str, Any]:
    with open_fabric(build_tiny_model()) as fab:
        p = fab.engine("p", "kv_producer", connector=connector, num_blocks=64)
        d = fab.engine(
            "d", "kv_consumer", connector=connector, num_blocks=2 * n + 256,
            max_num_seqs=max(1024, n),
        )  # fmt: skip
        sched = d.scheduler
        for i in range(n):
            rid = f"wait-{i}"
            d.add_request(rid, step_prompt(i), p.d_leg(rid))

        def step() -> int:
            t0 = time.perf_counter_ns()
            out = sched.schedule()
            dt = time.perf_counter_ns() - t0
            ids = list(out.num_scheduled_tokens)
            sampled = [[1] if sched.requests[r].num_computed_tokens >= 15 else [] for r in ids]
            mro = compat.model_runner_output(ids, sampled_token_ids=sampled)
            sched.update_from_output(out, mro)
            return dt

        for _ in range(3):
            step()
        assert _waiting_for_kv(sched) == n, (_waiting_for_kv(sched), n)
        gc.collect()
        times = [step() for _ in range(steps)]
        assert _waiting_for_kv(sched) == n
        us = sorted(t / 1e3 for t in times)
        return {
            "n_waiting_for_kv": n,
            "steps": steps,
            "connector": connector,
            "schedule_us_median": round(statistics.median(us), 1),
            "schedule_us_p90": round(us[int(0.9 * (len(us) - 1))], 1),
            "schedule_us_mean": round(statistics.fmean(us), 1),
            "remote_kv_kept_out": hasattr(sched, "remote_kv_waiting"),
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[100, 1000, 4000])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--connector", choices=["vllm", "ours"], default="vllm")
    args = ap.parse_args(argv)
    for n in args.n:
        print(json.dumps(measure(n, args.steps, args.connector)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
