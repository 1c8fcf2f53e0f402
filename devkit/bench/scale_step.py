# SPDX-License-Identifier: Apache-2.0
"""Per-step connector cost versus tracked requests (the scale benchmark, part a).

One P and one D engine (real vLLM ``Scheduler``, real connector workers, fake NIXL;
``scale_engines.py``), both running our connector or both vLLM's own push
connector. Each engine first tracks ``tracked`` idle requests:

* D: ``tracked`` push D legs whose P leg never comes: blocks allocated, PUSH_REG sent
  to P (which keeps it waiting for its request), waiting for KV;
* P: ``tracked`` push P legs whose D leg never comes: prefilled, finished, blocks
  held under the lease (one hour here) for a registration that never arrives.

Then every step ``changed`` new requests arrive on both (the same id, P leg and D
leg), and each step of P and of D is timed: the connector's hooks of that step
(scheduler side and every rank's worker side, ``HookClock``), and the whole step
(vLLM's scheduler and the fake model runner included, for scale). The requests in
flight (registered, prefilled, written, received) are the ones that change.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from vllm.v1.request import RequestStatus

from devkit.bench.scale_engines import (
    Connector,
    ScaleEngine,
    open_fabric,
    thread_cpu_s,
    wait_until,
)

#: prompt of one block (16 tokens): each idle request holds one block on P and on D
PROMPT_TOKENS = 16
#: the prompt lengths the bench offers for the requests that change each step (16: one
#: block; longer prompts cost the connector more per request, e.g. the prompt key's digest)
PROMPT_CHOICES = (16, 2048, 16384)
#: steps' worth of changed requests the KV cache has room for beyond the idle ones
IN_FLIGHT_STEPS = 8


@dataclasses.dataclass
class StepConfig:
    tracked: int
    changed: int = 4
    warmup_steps: int = 30
    steps: int = 300
    connector: Connector = "ours"
    #: tokens in the prompt of each request that changes (the idle ones keep 16, so
    #: the KV cache of thousands of idle requests fits in memory; only the changed
    #: requests' hooks are measured)
    prompt_tokens: int = PROMPT_TOKENS

    @property
    def blocks_per_request(self) -> int:
        return -(-(self.prompt_tokens + 1) // 16)

    @property
    def max_model_len(self) -> int:
        return max(1024, self.prompt_tokens + 16)

    @property
    def max_num_batched_tokens(self) -> int:
        # every changed request's prompt fits in one step: P keeps up with the arrivals
        return max(8192, self.changed * self.prompt_tokens)


@dataclasses.dataclass
class StepPoint:
    """One (connector, tracked) point. Each dict is keyed by side, "P" or "D"."""

    connector: str
    tracked: int
    changed: int
    steps: int
    #: tokens in each changed request's prompt
    prompt_tokens: int
    #: the engine thread's CPU time in the connector's hooks per step (us): median,
    #: p99, mean. The cost the targets are judged by.
    cpu_us: dict[str, dict[str, float]]
    #: wall time in the hooks per step (us): also the time the engine thread waits
    #: there (for the GIL; ours on P: for the writer's pass in hand_over)
    wall_us: dict[str, dict[str, float]]
    #: CPU per step (mean us): scheduler-side hooks, worker-side hooks
    split_cpu_us: dict[str, dict[str, float]]
    #: the whole engine step, wall (vLLM's scheduler, the fake model runner, the hooks)
    step_wall_us: dict[str, dict[str, float]]
    #: CPU per step (mean us) of each hook
    by_hook_cpu_us: dict[str, dict[str, float]]
    #: CPU of the engine's writer thread(s) per step (mean us): the connector's work
    #: off the engine thread (it polls every millisecond while busy, so this grows
    #: with the step's length too: vLLM's own scheduler takes longer with more requests)
    writer_cpu_us: dict[str, float]
    #: the same as a share of one core over the measured steps (%)
    writer_core_pct: dict[str, float]
    #: wall seconds of the measured steps (both engines)
    measured_s: float
    #: wall time of Python's garbage collections per measured step (mean us; the
    #: whole process: it lands in whatever code allocated, hooks or not)
    gc_us: float
    #: requests D received in the measured steps (sanity: about changed per step)
    completed: int
    #: requests sent to P and D in the measured steps (changed x steps)
    asked: int
    setup_s: float


def _stats(values_ns: list[int]) -> dict[str, float]:
    us = sorted(v / 1e3 for v in values_ns)
    p99 = us[min(len(us) - 1, int(round(0.99 * (len(us) - 1))))]
    return {"median": statistics.median(us), "p99": p99, "mean": statistics.fmean(us)}


def step_prompt(i: int, tokens: int = PROMPT_TOKENS) -> list[int]:
    """A prompt of its own per request (token ids of the tiny model's vocabulary)."""
    return [10 + (i * 7 + j) % 900 for j in range(tokens)]


def _waiting_for_kv(e: ScaleEngine) -> int:
    return sum(
        1 for r in e.scheduler.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    )


def blocks_needed(cfg: StepConfig) -> int:
    in_flight = max(64, IN_FLIGHT_STEPS * cfg.blocks_per_request) * cfg.changed
    return 2 * cfg.tracked + in_flight + 256


def fill_idle(p: ScaleEngine, d: ScaleEngine, n: int) -> None:
    """``n`` idle requests tracked on each side (see the module docstring)."""
    for i in range(n):
        rid = f"idle-d-{i}"
        d.add_request(rid, step_prompt(i), p.d_leg(rid))
    for i in range(n):
        rid = f"idle-p-{i}"
        p.add_request(rid, step_prompt(100_000 + i), p.p_leg(rid))

    def both() -> None:
        p.step()
        d.step()

    wait_until(
        lambda: _waiting_for_kv(d) >= n and len(p.finished) >= n,
        both, 300, f"{n} idle requests on P and D",
    )  # fmt: skip
    # let P's writers read the registrations (they read notifications every 0.1 s idle)
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        both()
        time.sleep(0.01)


class _GcClock:
    """Wall time spent in Python's garbage collector while installed."""

    def __init__(self) -> None:
        self.ns = 0
        self._t0 = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        elif self._t0:
            self.ns += time.perf_counter_ns() - self._t0
            self._t0 = 0


def run_point(model_dir: Path, cfg: StepConfig) -> StepPoint:
    t_setup = time.monotonic()
    blocks = blocks_needed(cfg)
    sides = ("P", "D")
    with open_fabric(model_dir) as f:
        kw = {
            "connector": cfg.connector, "num_blocks": blocks,
            "max_model_len": cfg.max_model_len,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
        }  # fmt: skip
        p = f.engine("P", "kv_producer", **kw)
        d = f.engine("D", "kv_consumer", **kw)
        engines = {"P": p, "D": d}
        fill_idle(p, d, cfg.tracked)
        setup_s = time.monotonic() - t_setup
        wall: dict[str, list[int]] = {s: [] for s in sides}
        cpu: dict[str, list[int]] = {s: [] for s in sides}
        sched_cpu: dict[str, list[int]] = {s: [] for s in sides}
        whole: dict[str, list[int]] = {s: [] for s in sides}
        hooks0: dict[str, Counter[str]] = {}
        writer0: dict[str, float] = {}
        done0 = 0
        gc.collect()
        gc_clock = _GcClock()
        for step in range(cfg.warmup_steps + cfg.steps):
            measured = step >= cfg.warmup_steps
            if step == cfg.warmup_steps:
                gc.callbacks.append(gc_clock)
                t_measured = time.monotonic()
                for side, e in engines.items():
                    hooks0[side] = e.sched_clock.cpu_by_hook + e.worker_clock.cpu_by_hook
                    writer0[side] = thread_cpu_s(e.writer_threads())
                done0 = len(d.finished_recving)
            for j in range(cfg.changed):
                rid = f"c-{step}-{j}"
                prompt = step_prompt(1_000_000 + step * cfg.changed + j, cfg.prompt_tokens)
                d.add_request(rid, prompt, p.d_leg(rid))
                p.add_request(rid, prompt, p.p_leg(rid))
            for side, e in engines.items():
                e.sched_clock.take()
                e.worker_clock.take()
                t0 = time.perf_counter_ns()
                e.step()
                dt = time.perf_counter_ns() - t0
                (s_wall, s_cpu), (w_wall, w_cpu) = e.sched_clock.take(), e.worker_clock.take()
                if measured:
                    wall[side].append(s_wall + w_wall)
                    cpu[side].append(s_cpu + w_cpu)
                    sched_cpu[side].append(s_cpu)
                    whole[side].append(dt)
        measured_s = time.monotonic() - t_measured
        gc.callbacks.remove(gc_clock)
        completed = len(d.finished_recving) - done0
        by_hook: dict[str, dict[str, float]] = {}
        writer_cpu: dict[str, float] = {}
        for side, e in engines.items():
            grown = (e.sched_clock.cpu_by_hook + e.worker_clock.cpu_by_hook) - hooks0[side]
            by_hook[side] = {h: ns / cfg.steps / 1e3 for h, ns in sorted(grown.items())}
            writer_cpu[side] = (thread_cpu_s(e.writer_threads()) - writer0[side]) / cfg.steps * 1e6
    return StepPoint(
        connector=cfg.connector,
        tracked=cfg.tracked,
        changed=cfg.changed,
        steps=cfg.steps,
        prompt_tokens=cfg.prompt_tokens,
        cpu_us={s: _stats(cpu[s]) for s in sides},
        wall_us={s: _stats(wall[s]) for s in sides},
        split_cpu_us={
            s: {
                "scheduler": statistics.fmean(sched_cpu[s]) / 1e3,
                "worker": statistics.fmean(c - x for c, x in zip(cpu[s], sched_cpu[s])) / 1e3,
            }
            for s in sides
        },
        step_wall_us={s: _stats(whole[s]) for s in sides},
        by_hook_cpu_us=by_hook,
        writer_cpu_us=writer_cpu,
        writer_core_pct={s: writer_cpu[s] * cfg.steps / 1e4 / measured_s for s in sides},
        measured_s=round(measured_s, 3),
        gc_us=gc_clock.ns / cfg.steps / 1e3,
        completed=completed,
        asked=cfg.changed * cfg.steps,
        setup_s=round(setup_s, 2),
    )


def as_dict(point: StepPoint) -> dict[str, Any]:
    return dataclasses.asdict(point)
