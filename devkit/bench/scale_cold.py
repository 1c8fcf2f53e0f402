# SPDX-License-Identifier: Apache-2.0
"""How much of D's hook cost is cold caches: the scale bench's step part at one point,
with and without a sweep of the CPU caches before each D step.

    PYTHONPATH=$PWD .venvs/vllm-0.32.0/bin/python -m devkit.bench.scale_cold --tracked 100

The same engines as ``scale_step.py`` (P and D on the fake NIXL fabric, ``tracked`` idle
requests each, 4 new requests a step). Each D step is timed as there (the connector's
hooks, engine-thread CPU) in four blocks of ``--steps`` steps: without, with, without,
with a copy of ``--sweep-mb`` MiB made just before D's step, which evicts what the hooks
had in the caches, as vLLM's scheduler does when it walks thousands of requests
waiting for KV (vLLM 0.32: every one, every step). No hook makes more calls with the
sweep; what it adds is the cost of the same calls on cold caches.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

from devkit.bench import scale_step
from devkit.bench.scale_engines import open_fabric


def run(tracked: int, steps: int, sweep_mb: int, connector: str) -> dict[str, list[float]]:
    from devkit.testing.tiny_model import build_tiny_model

    cfg = scale_step.StepConfig(tracked=tracked)
    buf = bytearray(sweep_mb << 20)
    out: dict[str, list[float]] = {"warm": [], "swept": []}
    with open_fabric(build_tiny_model()) as f:
        kw = {
            "connector": connector, "num_blocks": scale_step.blocks_needed(cfg),
            "max_model_len": cfg.max_model_len,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
        }  # fmt: skip
        p = f.engine("P", "kv_producer", **kw)
        d = f.engine("D", "kv_consumer", **kw)
        scale_step.fill_idle(p, d, tracked)
        gc.collect()
        n = 0
        for sweep in (False, True, False, True):
            cpu = []
            for s in range(cfg.warmup_steps + steps):
                for j in range(cfg.changed):
                    rid = f"c-{n}-{j}"
                    prompt = scale_step.step_prompt(1_000_000 + n * cfg.changed + j)
                    d.add_request(rid, prompt, p.d_leg(rid))
                    p.add_request(rid, prompt, p.p_leg(rid))
                n += 1
                p.step()
                if sweep:
                    bytes(buf)  # a copy: read and write every line of it
                d.sched_clock.take()
                d.worker_clock.take()
                d.step()
                (_, s_cpu), (_, w_cpu) = d.sched_clock.take(), d.worker_clock.take()
                if s >= cfg.warmup_steps:
                    cpu.append((s_cpu + w_cpu) / 1e3)
            out["swept" if sweep else "warm"].append(round(statistics.median(cpu), 1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.bench.scale_cold", description=__doc__)
    ap.add_argument("--tracked", type=int, default=100)
    ap.add_argument("--steps", type=int, default=150, help="measured steps per block")
    ap.add_argument("--sweep-mb", type=int, default=48)
    ap.add_argument("--connector", choices=("ours", "vllm"), default="ours")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    res = run(args.tracked, args.steps, args.sweep_mb, args.connector)
    print(
        f"{args.connector}, {args.tracked} tracked: D's hooks, engine-thread CPU per step, "
        f"median (us): warm {res['warm']}, caches swept {res['swept']}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
