# SPDX-License-Identifier: Apache-2.0
"""The sweep: load points, their prompt seeds, Poisson arrivals, and the order of runs.

Prompts are vLLM's ``random`` benchmark dataset (``vllm bench serve``), seeded per
point, so every mode and every round sees the same prompts for a point. Modes run
in rounds, forward then reversed (A B C, C B A, A B C, ...), so slow drift of the
machine affects every mode alike and cancels in the ratios.
"""

from __future__ import annotations

import dataclasses
import random
import zlib


@dataclasses.dataclass(frozen=True)
class Point:
    """One load point: a prompt length and either a closed-loop concurrency or a rate."""

    input_len: int
    output_len: int
    num_requests: int
    concurrency: int | None = None  # closed loop: at most this many in flight
    rate: float | None = None  # open loop: Poisson arrivals, requests per second

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("a point has either a concurrency or a rate")

    @property
    def load(self) -> str:
        """The load level label (one plot panel per load level)."""
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        return f"rate={self.rate:g}/s"

    @property
    def key(self) -> str:
        return f"in{self.input_len}-{self.load}"

    @property
    def slug(self) -> str:
        """The key as a file name / request id part (``in256-c4``, ``in256-r2.5``)."""
        load = f"c{self.concurrency}" if self.concurrency is not None else f"r{self.rate:g}"
        return f"in{self.input_len}-{load}"


def sweep(
    input_lens: list[int],
    concurrencies: list[int],
    rates: list[float],
    num_requests: int,
    output_len: int,
) -> list[Point]:
    """Every input length x every load level; closed-loop levels first."""
    points = []
    for n in input_lens:
        for c in concurrencies:
            points.append(Point(n, output_len, num_requests, concurrency=c))
        for r in rates:
            points.append(Point(n, output_len, num_requests, rate=r))
    return points


def point_seed(base_seed: int, point: Point) -> int:
    """The prompt seed of a point: stable across modes, rounds, processes and runs."""
    return (base_seed * 1_000_003 + zlib.crc32(point.key.encode())) % (2**31 - 1)


def poisson_offsets(rate: float, n: int, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of ``n`` Poisson arrivals at ``rate``/s.

    The load generator draws its own (``vllm bench serve --request-rate``); this is
    the same process, used for run-time estimates.
    """
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def round_plan(modes: list[str], rounds: int) -> list[tuple[int, str]]:
    """``(round, mode)`` in run order: odd rounds forward, even rounds reversed."""
    plan: list[tuple[int, str]] = []
    for r in range(rounds):
        order = modes if r % 2 == 0 else list(reversed(modes))
        plan.extend((r, m) for m in order)
    return plan


@dataclasses.dataclass
class Deployment:
    """One start of a mode's engines; serves one or more consecutive rounds."""

    mode: str
    rounds: list[int]


def deployments(plan: list[tuple[int, str]]) -> list[Deployment]:
    """Group the plan into engine starts: the same mode twice in a row (at a round's
    turn) reuses the running engines instead of restarting them."""
    out: list[Deployment] = []
    for r, m in plan:
        if out and out[-1].mode == m:
            out[-1].rounds.append(r)
        else:
            out.append(Deployment(m, [r]))
    return out


def expected_point_seconds(point: Point, per_request_s: float) -> float:
    """A rough duration of a point, for the ETA before anything was measured."""
    if point.rate is not None:
        return max(point.num_requests / point.rate, per_request_s) + per_request_s
    return point.num_requests * per_request_s / max(point.concurrency or 1, 1) + per_request_s
