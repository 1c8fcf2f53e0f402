# SPDX-License-Identifier: Apache-2.0
"""The proxy at scale: what our proxy and vllm-router add as concurrent streams grow.

    python -m devkit.bench.scale_proxy --out runs/scale-proxy-<ts> [--quick]

On 127.0.0.1 it starts, each in its own process, a fake P and a fake D
(:mod:`devkit.bench.fake_engines`: P answers at once, D streams ``--tokens``
tokens ``--gap-ms`` apart), our proxy (``python -m vllm_ext.proxy``, push mode,
concurrent legs) and vllm-router (``--vllm-pd-disaggregation``, legs one after the
other) in front of the same two fakes, and the load generator
(:mod:`devkit.bench.scale_loadgen`). For each concurrency, each round sends the
same closed-loop load (the workers' streams spread over a stream's length, not in
step) to three targets in turn (the order reversed every round):

* ``direct``: the fake D itself (the baseline: what the engines and the client take);
* ``ours``: our proxy; ``vllm-router``: the router.

Added latency is a proxy's time to first token (and total time) minus the direct
one, p50 and p99 over every counted request of the level. While a proxy carries a
point its resident memory (its process and any children) is sampled every 20 ms:
the peak above its idle RSS (measured once after a warm-up), divided by the streams
in flight, is its memory per in-flight request. Each point also records the CPU
seconds every process used (a proxy's per request; the load generator's and the
fakes' per wall second, to show they were not the bottleneck) and how busy the
whole machine was.

Results: ``results.json`` (machine, versions, git commit, config, every point, the
summary and the targets' verdicts), ``report.md`` (tables) and PNG plots when
matplotlib is installed (:mod:`devkit.bench.scale_proxy_report`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from devkit.bench import scale_proxy_report as report
from devkit.bench.runner import git_info, machine_info, pin_versions
from devkit.launch.process import ManagedProcess, free_port, wait_http_ready
from devkit.launch.xpyd import vllm_router_binary

REPO = Path(__file__).resolve().parents[2]
TARGETS = ("direct", "ours", "vllm-router")
PROXIES = ("ours", "vllm-router")


@dataclass
class Variant:
    """Another build of our proxy measured beside the others (A/B of a fix in one run):
    ``src``, a source tree put first on its ``PYTHONPATH`` (e.g. ``git archive`` of an
    earlier commit; empty: this tree), and ``args``, flags added to ``ours_args``."""

    name: str
    src: str = ""
    args: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``NAME:SRC:FLAGS`` (``--variant``), e.g. ``asyncio::--event-loop asyncio``."""
        name, _, rest = text.partition(":")
        src, _, flags = rest.partition(":")
        if not name or name in (*TARGETS, "prefill", "decode", "prom"):
            raise ValueError(f"bad variant name in {text!r}")
        return cls(name, src, shlex.split(flags))


RSS_PERIOD_S = 0.02
START_TIMEOUT_S = 60.0


@dataclass
class ScaleConfig:
    """What one run measures (``--help`` shows the defaults)."""

    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 64, 256, 1024])
    tokens: int = 16
    gap_ms: float = 5.0
    prompt_chars: int = 2048
    #: > 0: chat completions whose prompt is split over this many messages
    chat_messages: int = 0
    #: counted requests per target and level at least (the workers share them)
    min_requests: int = 200
    #: counted requests each worker sends at least (after its warm-up request)
    per_worker: int = 4
    rounds: int = 2
    python: str = sys.executable
    router_python: str = str(REPO / ".venvs" / "vllm-0.32.0" / "bin" / "python")
    #: our proxy's flags beyond the engines (no admission or pool limit: the load
    #: is what is measured, not the defaults' 429s)
    ours_args: list[str] = field(
        default_factory=lambda: ["--max-in-flight", "0", "--max-connections", "0"]
    )
    router_args: list[str] = field(default_factory=lambda: ["--policy", "round_robin"])
    variants: list[Variant] = field(default_factory=list)
    quick: bool = False

    @property
    def proxies(self) -> list[str]:
        return [*PROXIES, *(v.name for v in self.variants)]

    @property
    def targets(self) -> list[str]:
        return ["direct", *self.proxies]

    @property
    def stream_s(self) -> float:
        """How long the fake D takes to stream one answer."""
        return (self.tokens - 1) * self.gap_ms / 1000

    def per_worker_at(self, concurrency: int) -> int:
        return max(self.per_worker, math.ceil(self.min_requests / concurrency))


QUICK = {"concurrency": [1, 16, 64], "min_requests": 40, "per_worker": 2, "rounds": 1}


def _rss(proc: psutil.Process) -> int:
    """Resident bytes of ``proc`` and its children (0 once gone)."""
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def _cpu_s(proc: psutil.Process) -> float:
    """CPU seconds (user + system, all threads) ``proc`` and its children (a proxy's
    workers, ``--workers``) used so far."""
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


class RssSampler:
    """The peak RSS of one process tree while a point runs (a background thread)."""

    def __init__(self, proc: psutil.Process | None) -> None:
        self.proc = proc
        self.peak = 0
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.proc is not None:
                rss = _rss(self.proc)
                self.samples.append(rss)
                self.peak = max(self.peak, rss)
            self._stop.wait(RSS_PERIOD_S)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


class LoadGen:
    """The load generator's process (:mod:`devkit.bench.scale_loadgen`)."""

    def __init__(self, python: str, log: Path) -> None:
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [python, "-m", "devkit.bench.scale_loadgen"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            cwd=REPO, start_new_session=True,
        )  # fmt: skip
        self.ps = psutil.Process(self.proc.pid)
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"load generator did not start (log {log})")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"load generator exited ({self.proc.poll()})")
        return dict(json.loads(line))

    def run(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


class Harness:
    """The fakes, the two proxies and the load generator of one run."""

    def __init__(self, cfg: ScaleConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.procs: dict[str, ManagedProcess] = {}
        self.urls: dict[str, str] = {}
        self.loadgen: LoadGen | None = None

    def _start(self, name: str, argv: list[str], src: str = "") -> str:
        env = None
        if src:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(REPO)])}
        proc = ManagedProcess(name, argv, self.run_dir / f"{name}.log", env=env, cwd=REPO)
        self.procs[name] = proc
        return name

    def __enter__(self) -> Harness:
        try:
            self._start_all()
        except BaseException:
            self.close()
            raise
        return self

    def _start_all(self) -> None:
        cfg, py = self.cfg, self.cfg.python
        ports = {n: free_port() for n in ("prefill", "decode", "prom", *cfg.proxies)}
        for role in ("prefill", "decode"):
            self._start(role, [
                py, "-m", "devkit.bench.fake_engines", "--role", role,
                "--port", str(ports[role]), "--tokens", str(cfg.tokens),
                "--gap-ms", str(cfg.gap_ms),
            ])  # fmt: skip
        p_url, d_url = (f"http://127.0.0.1:{ports[r]}" for r in ("prefill", "decode"))
        for v in [Variant("ours"), *cfg.variants]:
            self._start(v.name, [
                py, "-m", "vllm_ext.proxy", "--mode", "push",
                "--prefill", f"{p_url},engine_id=fake-prefill,side_channel_port=5600",
                "--decode", d_url, "--host", "127.0.0.1", "--port", str(ports[v.name]),
                *cfg.ours_args, *v.args,
            ], v.src)  # fmt: skip
        router = vllm_router_binary(cfg.router_python)
        if router is None:
            raise FileNotFoundError(f"no vllm-router beside {cfg.router_python}")
        self._start("vllm-router", [
            router, "--vllm-pd-disaggregation", "--prefill", p_url, "--decode", d_url,
            "--host", "127.0.0.1", "--port", str(ports["vllm-router"]),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports["prom"]),
            *cfg.router_args,
        ])  # fmt: skip
        self.urls = {
            "prefill": p_url,
            "decode": d_url,
            "direct": d_url,
            **{n: f"http://127.0.0.1:{ports[n]}" for n in cfg.proxies},
        }
        for name, proc in self.procs.items():
            wait_http_ready(f"{self.urls[name]}/health", START_TIMEOUT_S, proc)
        self.loadgen = LoadGen(self.cfg.python, self.run_dir / "loadgen.log")

    def ps(self, name: str) -> psutil.Process:
        return psutil.Process(self.procs[name].pid)

    def close(self) -> None:
        if self.loadgen is not None:
            self.loadgen.close()
        for proc in self.procs.values():
            proc.stop()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def _body(cfg: ScaleConfig) -> dict[str, Any]:
    prompt = ("The proxy at scale. " * (cfg.prompt_chars // 20 + 1))[: cfg.prompt_chars]
    body: dict[str, Any] = {
        "model": "fake-model", "max_tokens": cfg.tokens, "stream": True, "temperature": 0.0,
    }  # fmt: skip
    n = cfg.chat_messages
    if n <= 0:
        return {**body, "prompt": prompt}
    size = math.ceil(len(prompt) / n)
    messages = [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": prompt[i * size : (i + 1) * size],
        }
        for i in range(n)
    ]
    return {**body, "messages": messages}


def _path(cfg: ScaleConfig) -> str:
    return "/v1/chat/completions" if cfg.chat_messages > 0 else "/v1/completions"


def _machine_busy(before: Any, after: Any) -> float | None:
    """The share of all cores busy between two ``psutil.cpu_times()``."""

    def busy(t: Any) -> float:
        return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))

    total = sum(after) - sum(before)
    return (busy(after) - busy(before)) / total if total > 0 else None


def run_point(h: Harness, target: str, concurrency: int, rnd: int) -> dict[str, Any]:
    """One closed-loop point against ``target``; what every process used meanwhile."""
    cfg = h.cfg
    assert h.loadgen is not None
    watched = {n: h.ps(n) for n in ("prefill", "decode", *cfg.proxies)}
    watched["loadgen"] = h.loadgen.ps
    cpu0 = {n: _cpu_s(p) for n, p in watched.items()}
    sys0 = psutil.cpu_times()
    proxy = watched[target] if target in cfg.proxies else None
    with RssSampler(proxy) as rss:
        res = h.loadgen.run(
            url=h.urls[target], concurrency=concurrency,
            per_worker=cfg.per_worker_at(concurrency), body=_body(cfg),
            expect_tokens=cfg.tokens, path=_path(cfg), stagger_s=cfg.stream_s,
        )  # fmt: skip
    cpu = {n: _cpu_s(p) - cpu0[n] for n, p in watched.items()}
    wall = res["wall_s"]
    n_req = concurrency * (cfg.per_worker_at(concurrency) + 1)  # warm-ups included
    return {
        "target": target,
        "concurrency": concurrency,
        "round": rnd,
        **res,
        "requests_sent": n_req,
        "cpu_s": cpu,
        "cpu_per_wall": {n: (s / wall if wall > 0 else None) for n, s in cpu.items()},
        "proxy_cpu_ms_per_request": (cpu[target] / n_req * 1e3) if proxy else None,
        "machine_busy": _machine_busy(sys0, psutil.cpu_times()),
        "loadavg": list(psutil.getloadavg()),
        "rss_peak_bytes": rss.peak if proxy else None,
        "rss_samples": len(rss.samples),
    }


def idle_rss(h: Harness, seconds: float = 1.0) -> dict[str, int]:
    """Each proxy's RSS at rest after a warm-up (the median of samples over ``seconds``)."""
    out = {}
    for name in h.cfg.proxies:
        proc = h.ps(name)
        samples = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            samples.append(_rss(proc))
            time.sleep(RSS_PERIOD_S * 5)
        out[name] = sorted(samples)[len(samples) // 2]
    return out


def run(cfg: ScaleConfig, out: Path, say: Any = print) -> dict[str, Any]:
    """The whole run (see the module docstring); writes nothing but the logs."""
    results: dict[str, Any] = {
        "benchmark": "scale-proxy",
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "versions": {
            "ours": pin_versions(cfg.python),
            "vllm-router": {**pin_versions(cfg.router_python), **_router_version(cfg)},
        },
        "git": git_info(),
        "config": asdict(cfg),
        "targets_measured": cfg.targets,
        "proxies": cfg.proxies,
        "points": [],
    }
    with Harness(cfg, out / "logs") as h:
        results["argv"] = {n: h.procs[n].argv for n in h.procs}
        say("warm-up")
        for target in cfg.targets:  # pools, connections, lazy imports; not recorded
            assert h.loadgen is not None
            h.loadgen.run(
                url=h.urls[target], concurrency=4, per_worker=4, body=_body(cfg),
                expect_tokens=cfg.tokens, path=_path(cfg),
            )  # fmt: skip
        time.sleep(1.0)
        results["idle_rss_bytes"] = idle_rss(h)
        order = cfg.targets
        for c in cfg.concurrency:
            for rnd in range(cfg.rounds):
                for target in order:
                    point = run_point(h, target, c, rnd)
                    results["points"].append(point)
                    say(report.point_line(point))
                order.reverse()
        results["fake_stats"] = {r: _get_json(f"{h.urls[r]}/stats") for r in ("prefill", "decode")}
    results["machine"]["loadavg_end"] = list(psutil.getloadavg())
    results["finished"] = dt.datetime.now().isoformat(timespec="seconds")
    report.finish(results)
    return results


def _router_version(cfg: ScaleConfig) -> dict[str, str]:
    script = "from importlib.metadata import version; print(version('vllm-router'))"
    try:
        out = subprocess.run(
            [cfg.router_python, "-c", script], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"vllm-router": out.stdout.strip()} if out.returncode == 0 else {}


def build_parser() -> argparse.ArgumentParser:
    d = ScaleConfig()
    ap = argparse.ArgumentParser(
        prog="python -m devkit.bench.scale_proxy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, help="run folder (default: runs/scale-proxy-<ts>)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"a short run (< 2 min): {QUICK}, unless given explicitly",
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        help=f"concurrent streams per level (default: {d.concurrency})",
    )
    ap.add_argument(
        "--tokens",
        type=int,
        default=d.tokens,
        help=f"tokens the fake D streams per request (default: {d.tokens})",
    )
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=d.gap_ms,
        help=f"milliseconds between two of D's tokens (default: {d.gap_ms})",
    )
    ap.add_argument(
        "--prompt-chars",
        type=int,
        default=d.prompt_chars,
        help=f"characters of the request's prompt (default: {d.prompt_chars})",
    )
    ap.add_argument(
        "--chat-messages",
        type=int,
        default=d.chat_messages,
        help="send chat completions, the prompt split over this many messages; 0: "
        f"completions (default: {d.chat_messages})",
    )
    ap.add_argument(
        "--min-requests",
        type=int,
        help=f"counted requests per target and level, at least (default: {d.min_requests})",
    )
    ap.add_argument(
        "--per-worker",
        type=int,
        help=f"counted requests per worker, at least (default: {d.per_worker})",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        help=f"rounds per level, the target order reversed each round (default: {d.rounds})",
    )
    ap.add_argument(
        "--router-python",
        default=d.router_python,
        help="python of the env whose vllm-router runs (default: %(default)s)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:SRC:FLAGS",
        help="also measure our proxy from source tree SRC (empty: this one) "
        "with FLAGS added, as target NAME, e.g. 'asyncio::--event-loop "
        "asyncio' (repeatable; default: none)",
    )
    ap.add_argument("--no-plots", action="store_true", help="tables only")
    return ap


def config_from_args(args: argparse.Namespace) -> ScaleConfig:
    cfg = ScaleConfig(
        tokens=args.tokens, gap_ms=args.gap_ms, prompt_chars=args.prompt_chars,
        chat_messages=args.chat_messages,
        router_python=args.router_python, quick=args.quick,
        variants=[Variant.parse(v) for v in args.variant],
    )  # fmt: skip
    if args.quick:
        for name, value in QUICK.items():
            setattr(cfg, name, value)
    for name in ("concurrency", "min_requests", "per_worker", "rounds"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    out: Path = args.out or REPO / "runs" / f"scale-proxy-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    results = run(cfg, out, say)
    paths = report.write(results, out, plots=not args.no_plots)
    say(f"wrote {', '.join(str(p) for p in paths.values())}")
    print(report.targets_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
