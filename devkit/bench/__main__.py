# SPDX-License-Identifier: Apache-2.0
"""Benchmark P/D modes on this machine: push vs pull vs vLLM's own push, with the floor.

    python -m devkit.bench                       # the default sweep (see --help)
    python -m devkit.bench --modes push-0.23 pull-0.23 --input-lens 1024 \\
        --concurrency 1 --num-requests 4 --rounds 1   # a quick one
    python -m devkit.bench --report runs/bench-X/results.json   # rebuild tables/plots
    python -m devkit.bench.gpu --out DIR --budget-s 780          # on two GPUs

``python3 tools/bench.py ...`` builds the pinned envs first and runs this in the
primary env. Modes on another pin run their engines with that pin's python.
Results: ``runs/bench-<timestamp>/`` (results.json, report.md, *.png, logs/, raw/).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from devkit.bench import modes as M
from devkit.bench import report

REPO = Path(__file__).resolve().parents[2]


def _python_for(pin: str, given: dict[str, str]) -> str:
    if pin in given:
        return given[pin]
    from vllm_ext import compat

    if compat.installed_vllm_version() == pin:
        return sys.executable
    envs = REPO / "tools" / "envs.py"
    out = subprocess.run(
        [sys.executable, str(envs), "python", pin], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def _parse_pythons(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        pin, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"--python {item!r}: expected PIN=PATH")
        out[pin] = path
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m devkit.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--modes",
        nargs="+",
        default=M.DEFAULT_MODES,
        help=f"default: {' '.join(M.DEFAULT_MODES)}; known: {', '.join(M.MODES)}",
    )
    ap.add_argument("--input-lens", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        default=[1, 4],
        help="closed-loop levels (default 1 4)",
    )
    ap.add_argument(
        "--rates",
        type=float,
        nargs="*",
        default=[],
        help="Poisson request rates per second (open loop; default none)",
    )
    ap.add_argument("--num-requests", type=int, default=16, help="per point and round")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="A B C then C B A ... (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured requests per length")
    ap.add_argument("--idle-seconds", type=float, default=10.0, help="0: skip idle CPU")
    ap.add_argument("--floor-repeats", type=int, default=20, help="0: skip the floor")
    ap.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="PIN=PATH",
        help="interpreter of a pin's env (default: tools/envs.py python PIN)",
    )
    ap.add_argument("--out", type=Path, help="run folder (default runs/bench-<timestamp>)")
    ap.add_argument(
        "--budget-s", type=float, help="the whole run, seconds: points that would not fit are "
        "skipped, each deployment gets a share (default: no limit)",
    )  # fmt: skip
    ap.add_argument(
        "--order", nargs="*", default=[], help="points to run first, in this order "
        "(e.g. in2048-c4 in1024-r2)",
    )  # fmt: skip
    ap.add_argument(
        "--handoff-trace", action="store_true",
        help="push modes: time each hand-off and record D's steps (batch, wait in the "
        "connector's hooks) the same way for every push connector",
    )  # fmt: skip
    ap.add_argument("--slo-ttft-ms", type=float, help="goodput: a request's TTFT at most this")
    ap.add_argument("--slo-tpot-ms", type=float, help="goodput: and its TPOT at most this")
    ap.add_argument(
        "--report",
        type=Path,
        metavar="RESULTS_JSON",
        help="only rebuild report.md and the plots from a saved run",
    )
    args = ap.parse_args(argv)  # fmt: skip

    if args.report:
        results = json.loads(args.report.read_text())
        paths = report.write(results, args.report.parent)
        print(paths["md"].read_text())
        print("\n".join(str(p) for p in paths.values()))
        return 0

    M.resolve(args.modes)
    if not args.concurrency and not args.rates:
        ap.error("need at least one --concurrency level or --rate")
    from devkit.bench.runner import RunConfig, Runner
    from devkit.testing.tiny_model import build_tiny_model

    given = _parse_pythons(args.python)
    pins = M.pins_of(M.resolve(args.modes))
    pythons = {pin: _python_for(pin, given) for pin in pins}
    out = args.out or REPO / "runs" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = RunConfig(
        modes=args.modes, input_lens=args.input_lens, concurrencies=args.concurrency,
        rates=args.rates, num_requests=args.num_requests, output_len=args.output_len,
        rounds=args.rounds, seed=args.seed, warmup=args.warmup, idle_seconds=args.idle_seconds,
        floor_repeats=args.floor_repeats, pythons=pythons, out_dir=out,
        model=str(build_tiny_model()),
        command=shlex.join(["python", "-m", "devkit.bench", *(argv or sys.argv[1:])]),
        budget_s=args.budget_s, point_order=args.order, handoff_trace=args.handoff_trace,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
    )  # fmt: skip
    try:
        results = Runner(cfg).run()
    except KeyboardInterrupt:
        print(f"\ninterrupted; partial results in {out}", flush=True)
        return 130
    print()
    print((out / "report.md").read_text())
    failed = [d for d in results["deployments"] if d.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
