# SPDX-License-Identifier: Apache-2.0
"""The benchmark on two GPUs: push vs pull vs one engine, with the GPU floor, in a time budget.

    python -m devkit.bench.gpu --out DIR --budget-s 780      # the issue-17 sweep
    python -m devkit.bench.gpu --out DIR --dry-run           # what would run (no GPU)
    python -m devkit.bench.gpu --collect DIR --to OUT        # copy the small files

The same harness as ``tools/bench.py`` (runner, workload, ``vllm bench serve``,
metrics, report) with the GPU settings of docs/benchmarks.md (*On GPUs*): Qwen3-8B shapes with
``--load-format dummy`` (a weightless model directory built here), P on GPU 0 and D
on GPU 1 (the single engine on GPU 0), ``--max-model-len 20000``, prefix caching off,
input 2k / 8k / 16k tokens x Poisson 0.5 / 2 / 8 requests/s, 24 requests per point,
64 output tokens, one round. Modes: ``push-0.23`` (ours, ``NixlPushConnector``),
``pull-0.23`` (vLLM's ``NixlConnector``) and ``single-0.23``, one after the other
(each mode's engines start once and serve all its points).

The budget (``--budget-s``) bounds the whole run: the GPU floor first, then each mode
gets an equal share of the time left when it starts; inside it the points run in
the priority order (``--order``; default: the loads where push lost or failed first,
0.5/s last) and a point that would not fit is skipped. ``results.json`` (small: floats
rounded to the µs, < 1 MB), ``report.md`` and the plots are rewritten after every
point, so a run cut short keeps everything it measured.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from devkit.bench import modes as M
from devkit.bench.workload import sweep
from devkit.launch.gpu import GpuOptions

DEFAULT_MODES = ["push-0.23", "pull-0.23", "single-0.23"]
#: The default modes where the installed vLLM is another pin: a bundle of that release
#: (one install on the host, no ``--python``) runs its like-for-like comparison.
DEFAULT_MODES_BY_PIN = {
    "0.34.0": ["push-0.34", "vllm-push-0.34", "single-0.34"],
}
INPUT_LENS = [2048, 8192, 16384]
RATES = [0.5, 2.0, 8.0]
#: Priority: where the first GPU run saw push lose (8k / 8 QPS) or fail (16k), then
#: the rest of 8 and 2 QPS; 0.5/s last (48 s a point, the least load).
ORDER = [
    "in8192-r8", "in16384-r2", "in16384-r8", "in2048-r8", "in8192-r2", "in2048-r2",
    "in16384-r0.5", "in8192-r0.5", "in2048-r0.5",
]  # fmt: skip
MAX_MODEL_LEN = 20000
#: Before anything is measured: an engine start with compilation, seconds per request.
EST_STARTUP_S = 110.0
EST_REQUEST_S = 0.25
#: Files ``--collect`` copies (the device returns at most 8 files).
COLLECT = ("results.json", "report.md", "ttft.png", "tpot.png", "overhead.png", "progress.log")
LOG_TAIL_LINES = 80
LOG_TAIL_BYTES = 2_000_000


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m devkit.bench.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, help="run folder")
    ap.add_argument(
        "--modes", nargs="+",
        help=f"default: {' '.join(DEFAULT_MODES)}, or for the installed vLLM "
        f"{', '.join(f'{k}: {chr(32).join(v)}' for k, v in DEFAULT_MODES_BY_PIN.items())}",
    )  # fmt: skip
    ap.add_argument("--input-lens", type=int, nargs="+", default=INPUT_LENS)
    ap.add_argument("--rates", type=float, nargs="*", default=RATES, help="Poisson, requests/s")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[], help="closed-loop levels")
    ap.add_argument("--num-requests", type=int, default=24, help="per point")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--order", nargs="*", default=ORDER, help="points first, in this order")
    ap.add_argument("--budget-s", type=float, help="the whole run, seconds (default: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured requests per length")
    ap.add_argument(
        "--no-handoff-trace", dest="handoff_trace", action="store_false",
        help="push modes: do not time each hand-off (P's prefill done -> D's KV usable)",
    )  # fmt: skip
    ap.add_argument("--slo-ttft-ms", type=float, help="goodput: a request's TTFT at most this")
    ap.add_argument("--slo-tpot-ms", type=float, help="goodput: and its TPOT at most this")
    g = ap.add_argument_group("engines")
    g.add_argument("--model", help="a model directory (default: Qwen3-8B shapes, weightless)")
    g.add_argument("--load-format", default="dummy", help="'auto' for real weights")
    g.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    g.add_argument("--memory-utilization", type=float, default=0.85)
    g.add_argument(
        "--kv-cache-gib", type=float,
        help="a fixed KV cache per engine (GiB; vLLM skips its memory profiling): P and D "
        "sharing a GPU then start together instead of D after P",
    )  # fmt: skip
    g.add_argument(
        "--max-num-batched-tokens", type=int,
        help="P's and the single engine's prefill chunk (default: vLLM's, 8192 on an H200; "
        "a 16k prompt is then 2 chunks, which leaves push_progressive little to overlap)",
    )  # fmt: skip
    g.add_argument("--enforce-eager", action="store_true", help="no compilation / CUDA graphs")
    g.add_argument("--gpus", default="0,1", help="CUDA_VISIBLE_DEVICES of P and of D")
    g.add_argument("--cache-root", type=Path, help="compile cache (default: next to --out)")
    f = ap.add_argument_group("floor")
    f.add_argument("--floor-repeats", type=int, default=10, help="0: no floor")
    f.add_argument("--floor-layouts", nargs="+", default=None, help="default: all")
    f.add_argument(
        "--floor-visible", choices=["own", "both"], default="own",
        help="GPUs each floor process sees (own: as P and D; both: a fallback)",
    )  # fmt: skip
    ap.add_argument(
        "--python", action="append", default=[], metavar="PIN=EXE",
        help="the python whose vLLM is PIN (default: this one, for the vLLM installed here); "
        "e.g. a wrapper that puts another pin's install on PYTHONPATH",
    )  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    ap.add_argument("--collect", type=Path, metavar="RUN_DIR", help="copy a run's small files")
    ap.add_argument("--to", type=Path, help="where --collect copies to")
    ap.add_argument("--only", nargs="+", help="--collect: only these files (no log tails)")
    return ap


def make_config(args: argparse.Namespace, command: str) -> Any:
    """The runner's config of these arguments (builds the model directory if needed)."""
    from devkit.bench import floor
    from devkit.bench.runner import RunConfig
    from devkit.testing.shaped_model import QWEN3_8B, build_shaped_model

    modes = M.resolve(args.modes or default_modes())
    if args.out is None:
        raise SystemExit("--out is required")
    p_gpu, _, d_gpu = args.gpus.partition(",")
    if not p_gpu or not d_gpu:
        raise SystemExit("--gpus: P's and D's GPU, e.g. 0,1")
    model = args.model or str(build_shaped_model(QWEN3_8B))
    gpu = GpuOptions(
        p_devices=p_gpu, d_devices=d_gpu, single_devices=p_gpu,
        memory_utilization=args.memory_utilization,
        load_format=None if args.load_format == "auto" else args.load_format,
        enforce_eager=args.enforce_eager,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cache_root=args.cache_root or args.out.parent / "vllm-cache",
    )  # fmt: skip
    geometry = floor.KvGeometry.of_shape(QWEN3_8B)
    floor_cfg = floor.DeviceFloorConfig(
        device="cuda", input_lens=list(args.input_lens), geometry=geometry,
        layouts=args.floor_layouts or list(floor.LAYOUTS), repeats=max(args.floor_repeats, 1),
        gpus=(p_gpu, d_gpu), visible=args.floor_visible,
        mt_mutex=floor.connector_mt_mutex("cuda"),
    )  # fmt: skip
    known = {p.slug for p in sweep(args.input_lens, args.concurrency, args.rates, 1, 1)}
    order = [o for o in args.order if o in known]  # the default order names every point
    return RunConfig(
        modes=[m.name for m in modes], input_lens=args.input_lens,
        concurrencies=args.concurrency, rates=args.rates, num_requests=args.num_requests,
        output_len=args.output_len, rounds=1, seed=args.seed, warmup=args.warmup,
        idle_seconds=0.0, floor_repeats=args.floor_repeats,
        pythons=_pythons(modes, args.python), out_dir=args.out, model=model, command=command,
        device="cuda", gpu=gpu, max_model_len=args.max_model_len, budget_s=args.budget_s,
        point_order=order if args.order == ORDER else list(args.order), small_json=True,
        floor_device=floor_cfg, est_startup_s=EST_STARTUP_S, est_request_s=EST_REQUEST_S,
        model_name=Path(model).name, handoff_trace=args.handoff_trace,
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
    )  # fmt: skip


def default_modes(installed: str | None = None) -> list[str]:
    """The modes run without ``--modes``: those of the installed vLLM's pin where the
    table has a comparison for it, else ours, pull and one engine on 0.23.0."""
    if installed is None:
        from vllm_ext import compat

        installed = compat.installed_vllm_version()
    return list(DEFAULT_MODES_BY_PIN.get(installed or "", DEFAULT_MODES))


def _pythons(modes: list[M.Mode], given: list[str] | None = None) -> dict[str, str]:
    """The python of each pin: ``--python PIN=EXE``, else this one for the vLLM
    installed here (side-by-side installs of other pins need their own python)."""
    from vllm_ext import compat

    named = {}
    for item in given or []:
        pin, sep, exe = item.partition("=")
        if not sep or not pin or not exe:
            raise SystemExit(f"--python {item!r}: expected PIN=EXE")
        named[pin] = exe
    have = compat.installed_vllm_version()
    other = sorted({m.pin for m in modes} - {have or ""} - set(named))
    if other:
        raise SystemExit(f"modes need vLLM {other}; this python has vLLM {have} (--python PIN=EXE)")
    return {pin: named.get(pin, sys.executable) for pin in M.pins_of(modes)}


def dry_run(cfg: Any) -> dict[str, Any]:
    """What the run would do: points in order, and each engine's argv and environment."""
    from devkit.bench import floor
    from devkit.bench.runner import deployment_of
    from devkit.launch.pd import PDConfig

    engines: dict[str, Any] = {}
    for name in cfg.modes:
        mode = M.mode_of(name)
        pd_cfg = PDConfig(
            mode=mode.launch, model=cfg.model, run_dir=cfg.out_dir / "logs" / name,
            python=cfg.pythons[mode.pin], connector=mode.connector,
            extra_config=dict(mode.extra_config), enable_prefix_caching=False,
            max_model_len=cfg.max_model_len, gpu=cfg.gpu,
        )  # fmt: skip
        dep = deployment_of(pd_cfg, mode)
        connector = mode.connector or "none"
        roles = (
            [("single", None)]
            if mode.launch == "single"
            else [("prefill", "kv_producer"), ("decode", "kv_consumer")]
        )
        engines[name] = {}
        for role, kv_role in roles:
            kv = None if kv_role is None else dep._kv(connector, kv_role, f"{role}-id")
            spec = dep._spec(role, kv, None)
            env = spec.env(cfg.out_dir)
            engines[name][role] = {
                "argv": spec.argv(),
                "env": {k: v for k, v in env.items() if k.startswith(_ENV_SHOWN)},
            }
    cases = floor.plan(cfg.floor_device) if cfg.floor_device and cfg.floor_repeats else []
    return {
        "points": [p.key for p in cfg.points()],
        "modes": cfg.modes,
        "budget_s": cfg.budget_s,
        "engines": engines,
        "floor_cases": [c.key for c in cases],
        "floor_env": {s: cfg.floor_device.env(s) for s in ("initiator", "target", "copy")}
        if cfg.floor_device
        else {},
    }


_ENV_SHOWN = ("CUDA_", "NCCL_", "TORCH_", "NVSHMEM_", "VLLM_")


def collect(run_dir: Path, dest: Path, only: list[str] | None = None) -> list[Path]:
    """Copy the run's small files to ``dest`` (at most 8: the device's limit), plus the
    tail of every log in one file (``only``: just those files)."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in only or COLLECT:
        src = run_dir / name
        if src.is_file():
            target = dest / name
            if name.endswith(".log"):
                _tail_to(src, target, 400)
            else:
                shutil.copyfile(src, target)
            copied.append(target)
    tails = []
    for log in [] if only else sorted((run_dir / "logs").glob("**/*.log")):
        tails.append(f"===== {log.relative_to(run_dir)} (last {LOG_TAIL_LINES} lines)\n")
        tails.append(_tail(log, LOG_TAIL_LINES))
    if tails:
        target = dest / "logs-tail.txt"
        target.write_text("".join(tails)[-LOG_TAIL_BYTES:])
        copied.append(target)
    return copied


def _tail(path: Path, lines: int) -> str:
    with path.open("rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(size - 256 * 1024, 0))
        data = f.read().decode(errors="replace")
    return "\n".join(data.splitlines()[-lines:]) + "\n"


def _tail_to(src: Path, dest: Path, lines: int) -> None:
    dest.write_text(_tail(src, lines))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.collect:
        if not args.to:
            raise SystemExit("--collect needs --to")
        for p in collect(args.collect, args.to, args.only):
            print(p)
        return 0
    command = shlex.join(["python", "-m", "devkit.bench.gpu", *(argv or sys.argv[1:])])
    cfg = make_config(args, command)
    if args.dry_run:
        print(json.dumps(dry_run(cfg), indent=1, default=str))
        return 0
    from devkit.bench.runner import Runner

    t0 = time.monotonic()
    try:
        results = Runner(cfg).run()
    except KeyboardInterrupt:
        print(f"\ninterrupted; partial results in {cfg.out_dir}", flush=True)
        return 130
    print()
    print((cfg.out_dir / "report.md").read_text())
    print(f"[bench-gpu] {time.monotonic() - t0:.0f}s; results in {cfg.out_dir}", flush=True)
    failed = [d for d in results["deployments"] if d.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
