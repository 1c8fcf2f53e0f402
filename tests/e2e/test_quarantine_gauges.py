# SPDX-License-Identifier: Apache-2.0
"""The push gauges (docs/metrics.md) on real engines while D holds a quarantine.

A push 1P1D (vLLM 0.23.0 CPU engines, real NIXL over UCX, our proxy) built by the
fault harness (devkit.testing.faults.pair.FaultPair, on loopback) with short
deadlines. P hangs (SIGSTOP of its process group) right before it posts the WRITE of
one request (the NIXL shim holds the writer there, so the moment is certain); D stops
waiting (its watchdog), sends PUSH_CANCEL, gets no answer within
``push_cancel_answer_timeout_s`` and quarantines the request's blocks (docs/design.md
S-SAFE-1, N-LIV-1). Then P goes on (SIGCONT), answers, and the quarantine ends.

The gauges are read over HTTP from each engine's ``/metrics`` throughout, and judged
by truths from outside our connector: the prompt's length and vLLM's block size (from
``vllm:cache_config_info``), and vLLM's own count of the blocks in use
(``vllm:kv_cache_usage_perc``). A second test, on the same pair, shows a registration
waiting at P in P's ``push_regs_pending``. Each engine's stats reach ``/metrics`` at its
steps (docs/metrics.md): no request is sent to make them current unless a test says so.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devkit.testing.faults import client
from devkit.testing.faults.pair import (
    FAULT_EXTRA_CONFIG,
    STACKS,
    FaultPair,
    PairConfig,
    metric,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

#: Short deadlines, so that D quarantines within seconds of P's hang: D's watchdog
#: (8 s from the registration, 4 s from P's last PUSH_HB), then 3 s for P's answer to
#: the PUSH_CANCEL. The quarantine itself has no bound (push_quarantine_s -1, the
#: default): only P's answer ends it.
GAUGE_TEST_CONFIG: dict[str, Any] = {
    **FAULT_EXTRA_CONFIG,
    "push_registration_timeout_s": 8,
    "push_heartbeat_timeout_s": 4,
    "push_cancel_answer_timeout_s": 3,
}
#: The request the hang hits: several blocks and a partial last one.
PROMPT_LEN = 3000
#: The NIXL shim holds P's writer this long right before the WRITE (the test stops P
#: meanwhile; the hold has run out by the time P goes on).
WRITER_HOLD_S = 6.0
#: How long P stays stopped once D's gauge showed the quarantine.
QUARANTINE_WATCH_S = 3.0
#: Bounds on each phase (far above what they take; they only keep a failure short).
QUARANTINE_WITHIN_S = 40.0
END_WITHIN_S = 40.0
POLL_S = 0.25
#: A step's stats reach /metrics a moment after its request's answer.
STATS_WITHIN_S = 3.0

D_GAUGES = ("push_blocks_quarantined_now", "push_recvs_pending")
P_GAUGES = ("push_writes_in_flight", "push_regs_pending", "push_leases_held")
#: D's counter of quarantines, read with its gauges
QUARANTINED = "requests_quarantined_total"


def _block_size(m: dict[str, float]) -> int:
    """vLLM's KV block size, from the labels of its ``vllm:cache_config_info``."""
    for key in m:
        if key.startswith("vllm:cache_config_info"):
            found = re.search(r'block_size="(\d+)"', key)
            if found:
                return int(found.group(1))
    raise AssertionError("no block_size label on vllm:cache_config_info")


class Reader:
    """One engine's ``/metrics``: our gauges, and vLLM's own count of blocks in use."""

    def __init__(self, pair: FaultPair, role: str, gauges: tuple[str, ...]) -> None:
        self.pair, self.role, self.gauges = pair, role, gauges
        #: (seconds since ``t0``, values) of every read
        self.samples: list[tuple[float, dict[str, int]]] = []

    def read(self, t0: float) -> dict[str, int]:
        m = self.pair.metrics(self.role)
        out = {g: int(metric(m, f"vllm:ext_{g}")) for g in self.gauges}
        # vLLM's usage counts every block but its null block (BlockPool.get_usage)
        out["blocks_in_use"] = round(
            metric(m, "vllm:kv_cache_usage_perc") * (self.pair.num_blocks[self.role] - 1)
        )
        if self.role == "decode":
            out[QUARANTINED] = int(metric(m, f"vllm:ext_push_{QUARANTINED}"))
        self.samples.append((round(time.monotonic() - t0, 2), out))
        return out

    def until(
        self, ok: Callable[[dict[str, int]], bool], within: float, t0: float, what: str
    ) -> dict[str, int]:
        """Read every POLL_S until ``ok`` holds; fail after ``within`` seconds."""
        deadline = time.monotonic() + within
        while True:
            now = self.read(t0)
            if ok(now):
                return now
            assert time.monotonic() < deadline, (
                f"{self.role}: {what} not seen within {within:g}s; last {now}; "
                f"samples {self.changes()}"
            )
            time.sleep(POLL_S)

    def changes(self) -> list[tuple[float, dict[str, int]]]:
        """The samples at which a value changed (the first one included)."""
        out: list[tuple[float, dict[str, int]]] = []
        for t, values in self.samples:
            if not out or values != out[-1][1]:
                out.append((t, values))
        return out


def _idle(values: dict[str, int]) -> bool:
    """No gauge up and no block in use."""
    return all(v == 0 for k, v in values.items() if k != QUARANTINED)


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory) -> Iterator[FaultPair]:
    """The pair, warmed up (the NIXL handshake done) and idle; stopped by PID after."""
    cfg = PairConfig(STACKS["ours"], str(tiny_model), tmp_path_factory.mktemp("gauges"),
                     extra_config=GAUGE_TEST_CONFIG)  # fmt: skip
    with FaultPair(cfg, progress=print) as started:
        assert "vllm-ext: registered" in started.log_path("prefill").read_text()
        warm = client.via_proxy(started.url, client.make_prompt(PROMPT_LEN, 1), 4, timeout=120)
        assert warm.start().result().ok, warm.outcome.brief()
        yield started


def test_quarantine_shows_in_the_gauges_and_ends(pair: FaultPair) -> None:
    t_start = time.monotonic()
    d, p = Reader(pair, "decode", D_GAUGES), Reader(pair, "prefill", P_GAUGES)
    block_size = _block_size(pair.metrics("decode"))
    blocks = math.ceil(PROMPT_LEN / block_size)  # the request's blocks on D
    # Both engines idle: nothing held.
    d_base = d.until(_idle, END_WITHIN_S, t_start, "idle after the warm-up")
    p.until(_idle, END_WITHIN_S, t_start, "idle after the warm-up")
    d.samples.clear()
    p.samples.clear()

    # P's writer is held right before the request's WRITE ...
    rid = client.new_rid("gauges")
    rule = f"hold-{rid}"

    def posted(e: dict[str, Any]) -> bool:
        return e.get("ev") == "xfer_post" and rid in str(e.get("rid"))

    pair.rules("prefill", [{"id": rule, "on": "transfer", "match": rid,
                            "action": "stall", "delay_s": WRITER_HOLD_S}])  # fmt: skip
    t0 = time.monotonic()
    call = client.via_proxy(pair.url, client.make_prompt(PROMPT_LEN, 2), 4, rid, timeout=120)
    call.start()
    held = pair.wait_event(
        "prefill", lambda e: e.get("ev") == "rule" and e.get("rule") == rule, 60, t0
    )
    assert held is not None, "P's writer never reached the request's WRITE"
    # ... its WRITE claimed (NIXL may run it from now on) and its blocks leased for D
    p_held = p.until(
        lambda v: v["push_writes_in_flight"] == 1 and v["push_leases_held"] == 1,
        WRITER_HOLD_S - 2, t0, "the held WRITE",
    )  # fmt: skip
    assert p_held["push_regs_pending"] == 0, p_held  # matched: it waits for nothing

    # ... and P hangs there.
    pgid = pair.pgid("prefill")
    os.killpg(pgid, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        assert pair.wait_event("prefill", posted, 0, t0) is None, "P posted the WRITE"
        # D holds the request's blocks for its KV: waiting, not quarantined (yet)
        waiting = d.read(t0)
        during = d.until(lambda v: v["push_blocks_quarantined_now"] > 0,
                         QUARANTINE_WITHIN_S, t0, "a quarantine")  # fmt: skip
        t_quarantined = time.monotonic()
        watched = [during]
        while time.monotonic() - t_quarantined < QUARANTINE_WATCH_S:
            time.sleep(POLL_S)
            watched.append(d.read(t0))
        # D failed the request at its deadline (the client has D's error) while P
        # is still stopped; only its blocks stay held.
        outcome = call.result(END_WITHIN_S)
        watched.append(d.read(t0))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGCONT)
    t_cont = time.monotonic()

    assert waiting["push_blocks_quarantined_now"] == 0, waiting
    assert waiting["push_recvs_pending"] == 1, waiting
    assert waiting["blocks_in_use"] - d_base["blocks_in_use"] == blocks, (waiting, d_base)
    assert waiting[QUARANTINED] == d_base[QUARANTINED], waiting
    # During: the request's blocks, and no other, held for it while P is silent.
    for v in watched:
        assert v["push_blocks_quarantined_now"] == blocks, (v, blocks)
        assert v["blocks_in_use"] - d_base["blocks_in_use"] == blocks, (v, d_base)
        assert v["push_recvs_pending"] == 1, v
        assert v[QUARANTINED] == d_base[QUARANTINED] + 1, v
    assert call.done and not outcome.ok, outcome.brief()

    # After: P answered; the gauges are back to 0 and every block is free again,
    # with no other request to step either engine.
    d_after = d.until(
        lambda v: _idle(v) and v["blocks_in_use"] == d_base["blocks_in_use"],
        END_WITHIN_S, t0, "the quarantine's end",
    )  # fmt: skip
    t_ended = time.monotonic()
    assert d_after[QUARANTINED] == d_base[QUARANTINED] + 1, d_after
    p_after = p.until(_idle, END_WITHIN_S, t0, "P idle after it went on")
    late = pair.wait_event("prefill", posted, 0, t0)

    print(f"block size {block_size}, request blocks {blocks}, D blocks in use before "
          f"{d_base['blocks_in_use']}, P held {p_held}")  # fmt: skip
    print(f"P stopped at +{t_stop - t0:.1f}s, quarantine seen at +{t_quarantined - t0:.1f}s, "
          f"P continued at +{t_cont - t0:.1f}s, gauges 0 at +{t_ended - t0:.1f}s; "
          f"request: {outcome.brief()} at +{outcome.t1 - t0:.1f}s; "
          f"P's WRITE posted after all: {late is not None}")  # fmt: skip
    print(f"D: {d.changes()}")
    print(f"P: {p.changes()}")
    print(
        f"after: D {d_after}, P {p_after}; test ran {time.monotonic() - t_start:.0f}s "
        "(the pair started before)"
    )


def test_a_registration_waiting_at_p_shows_in_its_gauge(pair: FaultPair) -> None:
    """D registers a request whose P leg never comes (the D leg sent alone): P keeps
    the registration (``push_regs_pending`` 1 at P's next step), drops it after 0.8 ×
    D's timeout and tells D; at P's next step the gauge is 0 again. P's shim sees the
    PUSH_REG arrive and P's PUSH_FAIL leave (the truth). The requests that make P
    step are plain ones, straight to P: they register nothing."""
    t0 = time.monotonic()
    p = Reader(pair, "prefill", P_GAUGES)
    p.until(_idle, END_WITHIN_S, t0, "idle")

    def step_p(seed: int) -> None:
        o = client.plain(pair.engine_url("prefill"), client.make_prompt(16, seed), 2, timeout=60)
        assert o.start().result().ok, o.outcome.brief()

    _, d_leg = client.direct_legs(
        pair.engine_url("prefill"), pair.engine_url("decode"), pair.coords(),
        client.make_prompt(300, 3), 4, client.new_rid("regwait"), timeout=60,
    )  # fmt: skip
    rid = d_leg.rid

    def about(kind: str, how: str) -> Callable[[dict[str, Any]], bool]:
        return lambda e: e.get("ev") == how and e.get("kind") == kind and rid in str(e.get("rid"))

    d_leg.start()
    arrived = pair.wait_event("prefill", about("PUSH_REG", "recv"), 30, t0)
    assert arrived is not None, "P never received the PUSH_REG"
    step_p(4)
    # (the step's stats reach /metrics a moment after its request's answer)
    waiting = p.until(lambda v: v["push_regs_pending"] == 1, STATS_WITHIN_S, t0, "the wait")
    assert waiting["push_writes_in_flight"] == waiting["push_leases_held"] == 0, waiting

    dropped = pair.wait_event("prefill", about("PUSH_FAIL", "sent"), 30, t0)
    assert dropped is not None, "P never told D it dropped the registration"
    outcome = d_leg.result()
    assert not outcome.ok, outcome.brief()
    step_p(5)
    p.until(_idle, STATS_WITHIN_S, t0, "the registration gone")
    print(
        f"PUSH_REG at P +{arrived['t'] - t0:.1f}s, P told D +{dropped['t'] - t0:.1f}s "
        f"(registration timeout {GAUGE_TEST_CONFIG['push_registration_timeout_s']}s); "
        f"D leg: {outcome.brief()}; P: {p.changes()}"
    )
