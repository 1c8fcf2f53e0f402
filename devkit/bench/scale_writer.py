# SPDX-License-Identifier: Apache-2.0
"""The writer's throughput (the scale benchmark, part b): our connector only.

One P engine (``tp`` ranks) and ``d_peers`` D engines (``tp`` ranks each) on the
fake NIXL fabric, whose transfers cost next to nothing, so what is measured is our
Python on P's writer threads. After one warm-up request per D peer (the
handshakes), D's registrations for ``requests`` requests are sent first and wait
at P, spread over the D peers; then P gets the requests (short prompts: one WRITE
per request and rank, ``whole``; or long prompts computed in chunks with
``push_progressive``: chunk WRITEs while the prompt computes, ``progressive``) and
the run ends once D received them all.

Measured on P's writer threads: the WRITEs posted (NIXL ``transfer`` calls), the
CPU time of the writer passes (``CLOCK_THREAD_CPUTIME_ID`` of the thread: what one
core spends), and the time spent preparing the WRITEs: descriptors
(``KvLayouts.write_descs``) and NIXL's request (``initialize_xfer`` with its
descriptor lists), per request and per WRITE.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from pathlib import Path
from typing import Any, Literal

from vllm.v1.request import RequestStatus

from devkit.bench.scale_engines import ScaleEngine, open_fabric, wait_until

Mode = Literal["whole", "progressive"]
#: whole: a one-block prompt; progressive: 512 tokens computed 64 a step (8 chunks)
PROMPT_TOKENS: dict[str, int] = {"whole": 16, "progressive": 512}
CHUNK_TOKENS = 64
BLOCK = 16


@dataclasses.dataclass
class WriterConfig:
    mode: Mode
    requests: int
    d_peers: int
    tp: int = 1


@dataclasses.dataclass
class WriterPoint:
    mode: str
    requests: int
    d_peers: int
    tp: int
    #: WRITEs P's writers posted (all ranks; chunk WRITEs included)
    writes: int
    #: CPU seconds of P's writer passes (all ranks)
    writer_cpu_s: float
    #: CPU seconds of those spent inside the fake NIXL's calls
    nixl_cpu_s: float
    #: WRITEs posted per CPU second of one writer thread: the rate one core sustains
    writes_per_cpu_s: float
    #: the same without the fake NIXL's own time: our Python alone
    writes_per_cpu_s_ours: float
    #: preparing a request's WRITEs, per request and rank (us, CPU): descriptors, their
    #: NIXL lists and the NIXL request (``get_xfer_descs``, ``initialize_xfer``)
    prep_us_per_request: float
    #: the same per WRITE (us, CPU)
    prep_us_per_write: float
    #: of which our Python (without the fake NIXL's calls), per WRITE (us, CPU)
    prep_ours_us_per_write: float
    #: our descriptors alone (``KvLayouts.write_descs``) per WRITE (us, CPU)
    descs_us_per_write: float
    #: wall seconds from P's first step until D received every request
    wall_s: float
    #: requests D received
    received: int


#: the NIXL calls of P's writer (their CPU time is the fake's, not ours)
NIXL_CALLS = (
    "get_xfer_descs", "initialize_xfer", "transfer", "check_xfer_state", "release_xfer_handle",
    "get_new_notifs", "send_notif", "get_xfer_telemetry",
)  # fmt: skip


class _WriterMeter:
    """Wraps one P rank's writer: its passes' CPU time, the preparation calls, and the
    time spent in the fake NIXL on the writer thread."""

    def __init__(self, worker: Any) -> None:
        self.pass_cpu_ns = 0
        self.prep_cpu_ns = 0
        self.prep_nixl_ns = 0
        self.descs_cpu_ns = 0
        self.nixl_cpu_ns = 0
        self.prepared = 0
        self._preparing = False
        self._writer_thread: Any = None
        self._wrap_nixl(worker.nixl_wrapper)
        writer = worker.writer
        writes = writer.writes
        step, descs, init = writer.step, writes.ctx.layouts.write_descs, writes._initialize

        def timed_step() -> None:
            self._writer_thread = threading.current_thread()
            t0 = time.thread_time_ns()
            try:
                step()
            finally:
                self.pass_cpu_ns += time.thread_time_ns() - t0

        def timed_descs(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time_ns()
            try:
                return descs(*args, **kwargs)
            finally:
                dt = time.thread_time_ns() - t0
                self.descs_cpu_ns += dt
                self.prep_cpu_ns += dt

        def timed_init(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time_ns()
            self._preparing = True
            try:
                return init(*args, **kwargs)
            finally:
                self._preparing = False
                self.prep_cpu_ns += time.thread_time_ns() - t0
                self.prepared += 1

        writer.step = timed_step
        writes.ctx.layouts.write_descs = timed_descs
        writes._initialize = timed_init

    def _wrap_nixl(self, agent: Any) -> None:
        for name in NIXL_CALLS:
            fn = getattr(agent, name)

            def timed(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
                if threading.current_thread() is not self._writer_thread:
                    return _fn(*args, **kwargs)
                t0 = time.thread_time_ns()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    dt = time.thread_time_ns() - t0
                    self.nixl_cpu_ns += dt
                    if self._preparing:
                        self.prep_nixl_ns += dt

            setattr(agent, name, timed)

    def reset(self) -> None:
        self.pass_cpu_ns = self.prep_cpu_ns = self.descs_cpu_ns = self.prepared = 0
        self.nixl_cpu_ns = self.prep_nixl_ns = 0


def _prompt(i: int, n: int) -> list[int]:
    return [10 + (i * 13 + j) % 900 for j in range(n)]


def _waiting(e: ScaleEngine) -> int:
    return sum(
        1 for r in e.scheduler.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    )


def _posted(p: ScaleEngine) -> int:
    return sum(len(c.connector_worker.nixl_wrapper.calls("transfer")) for c in p.ranks)


def run_point(model_dir: Path, cfg: WriterConfig) -> WriterPoint:
    tokens = PROMPT_TOKENS[cfg.mode]
    per_req = math.ceil((tokens + 1) / BLOCK)
    p_extra: dict[str, Any] = {}
    sched_extra: dict[str, Any] = {}
    if cfg.mode == "progressive":
        p_extra = {"push_progressive": True, "push_at_forward_end": True}
        sched_extra = {"long_prefill_token_threshold": CHUNK_TOKENS}
    share = math.ceil(cfg.requests / cfg.d_peers)
    with open_fabric(model_dir) as f:
        p = f.engine(
            "P", "kv_producer", tp=cfg.tp, num_blocks=(cfg.requests + 2 * cfg.d_peers) * per_req
            + 64, extra_config=p_extra, scheduler_extra=sched_extra,
        )  # fmt: skip
        ds = [
            f.engine(f"D{i}", "kv_consumer", tp=cfg.tp, num_blocks=(share + 2) * per_req + 64)
            for i in range(cfg.d_peers)
        ]
        everyone = [p, *ds]

        def step_all() -> None:
            for e in everyone:
                e.step()

        # warm-up: one request per D peer, both handshakes done
        for i, d in enumerate(ds):
            rid = f"warm-{i}"
            d.add_request(rid, _prompt(10_000 + i, tokens), p.d_leg(rid))
            p.add_request(rid, _prompt(10_000 + i, tokens), p.p_leg(rid))
        wait_until(
            lambda: all(f"warm-{i}" in d.finished_recving for i, d in enumerate(ds)),
            step_all, 120, "warm-up requests",
        )  # fmt: skip
        meters = [_WriterMeter(c.connector_worker) for c in p.ranks]
        # D's registrations first, all waiting at P
        for i in range(cfg.requests):
            rid = f"r-{i}"
            ds[i % cfg.d_peers].add_request(rid, _prompt(i, tokens), p.d_leg(rid))

        def regs_at_p() -> int:
            return min(c.connector_worker.writer.writes.rendezvous.pending_count() for c in p.ranks)

        def d_steps() -> None:
            for d in ds:
                d.step()
            time.sleep(0.005)

        wait_until(
            lambda: sum(map(_waiting, ds)) >= cfg.requests and regs_at_p() >= cfg.requests,
            d_steps, 300, f"{cfg.requests} registrations at P",
        )  # fmt: skip
        for m in meters:
            m.reset()
        posted0 = _posted(p)
        t0 = time.monotonic()
        for i in range(cfg.requests):
            p.add_request(f"r-{i}", _prompt(i, tokens), p.p_leg(f"r-{i}"))
        wait_until(
            lambda: sum(len(d.finished_recving) for d in ds) >= cfg.requests + cfg.d_peers,
            step_all, 600, f"{cfg.requests} requests received",
        )  # fmt: skip
        wall = time.monotonic() - t0
        writes = _posted(p) - posted0
        received = sum(len(d.finished_recving) for d in ds) - cfg.d_peers
    cpu_s = sum(m.pass_cpu_ns for m in meters) / 1e9
    nixl_s = sum(m.nixl_cpu_ns for m in meters) / 1e9
    prep_ns = sum(m.prep_cpu_ns for m in meters)
    prep_nixl_ns = sum(m.prep_nixl_ns for m in meters)
    prepared = max(1, sum(m.prepared for m in meters))
    return WriterPoint(
        mode=cfg.mode,
        requests=cfg.requests,
        d_peers=cfg.d_peers,
        tp=cfg.tp,
        writes=writes,
        writer_cpu_s=round(cpu_s, 4),
        nixl_cpu_s=round(nixl_s, 4),
        writes_per_cpu_s=writes / cpu_s if cpu_s > 0 else 0.0,
        writes_per_cpu_s_ours=writes / (cpu_s - nixl_s) if cpu_s > nixl_s else 0.0,
        prep_us_per_request=prep_ns / (cfg.requests * cfg.tp) / 1e3,
        prep_us_per_write=prep_ns / prepared / 1e3,
        prep_ours_us_per_write=(prep_ns - prep_nixl_ns) / prepared / 1e3,
        descs_us_per_write=sum(m.descs_cpu_ns for m in meters) / prepared / 1e3,
        wall_s=round(wall, 3),
        received=received,
    )


def as_dict(point: WriterPoint) -> dict[str, Any]:
    return dataclasses.asdict(point)
