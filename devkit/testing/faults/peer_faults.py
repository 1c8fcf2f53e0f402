# SPDX-License-Identifier: Apache-2.0
"""Faults of a peer: P killed right before its WRITE, D killed mid-WRITE, P stopped
(SIGSTOP) in the middle of a WRITE."""

from __future__ import annotations

import os
import signal
import time

from devkit.testing.faults.audit import (
    FaultResult,
    wait_idle,
)
from devkit.testing.faults.context import (
    LONG,
    Ctx,
    fault_result,
)

# -- peers dying ----------------------------------------------------------------------------------


def kill_p_before_write(ctx: Ctx) -> FaultResult:
    res = fault_result(
        ctx,
        "kill-p-before-write",
        "P is SIGKILLed after the prefill, right before its WRITE; then restarted",
    )
    long_by = ctx.request(300, "kpb", max_tokens=600, stream=True)
    call = ctx.request(LONG, "kp")
    long_by.start().first_token.wait(60)  # decoding on D: its KV arrived; P's death must not matter
    ctx.pair.rules("prefill", [{"id": call.rid, "on": "transfer", "match": call.rid,
                                "action": "kill", "pid": 0, "when": "before"}])  # fmt: skip
    t = time.monotonic()
    call.start()
    ev = ctx.pair.wait_event("prefill", lambda e: e.get("ev") == "kill", 60, t)
    res.t_fault = ev["t"] if ev else time.monotonic()
    if ev is None:
        res.inconclusive = "P never reached the WRITE (the kill rule did not fire)"
    ctx.pair.kill("prefill")  # the rest of its process group, if anything survived
    ctx.finish(res, [call], [long_by], survivors=("decode",))
    ctx.restart_and_probe(res, "prefill")
    if res.restart and res.restart["picked_up"]:
        res.freed_s["prefill"], res.leaked_blocks["prefill"] = wait_idle(
            ctx.pair, "prefill", time.monotonic() + 20, time.monotonic()
        )
    return res


def p_hangs_mid_write(ctx: Ctx, stop_s: float = 30.0) -> FaultResult:
    """P hangs (SIGSTOP: a GC pause, a stuck driver, a frozen VM) with its WRITE in
    flight, past D's heartbeat timeout (10 s after P's last PUSH_HB) and the answer
    deadline of its cancel (10 s more), then goes on (SIGCONT). D must keep the
    request's blocks while P is silent (its WRITE may still land); once P runs again
    it answers (or its WRITE completes) and the request ends, right or with an error,
    and the blocks come back."""
    res = fault_result(ctx, "p-hangs-mid-write",
                  f"P is stopped (SIGSTOP) with its WRITE in flight for {stop_s:.0f}s, "
                  "then continued")  # fmt: skip
    topo = ctx.pair.topology
    if topo is not None:
        topo.throttle("50mbit")  # ~1 s for the request's 6 MB: the WRITE is in flight
    call = ctx.request(LONG, "hp")
    t = time.monotonic()
    call.start()
    post = ctx.pair.wait_event("prefill", lambda e: e.get("ev") == "xfer_post"
                               and call.rid in str(e.get("rid")), 60, t)  # fmt: skip
    pgid = ctx.pair.pgid("prefill")
    os.killpg(pgid, signal.SIGSTOP)
    res.t_fault = time.monotonic()
    res.details["write_state_at_stop"] = post.get("state") if post else None
    if post is None:
        res.inconclusive = "P's WRITE was not seen posted within 60s: P was not stopped mid-write"
    try:
        time.sleep(stop_s)
    finally:
        os.killpg(pgid, signal.SIGCONT)
        res.t_fault_end = time.monotonic()
        if topo is not None:
            topo.unthrottle()
    res.details["continued_after_s"] = round(time.monotonic() - res.t_fault, 1)
    return ctx.finish(res, [call])


def kill_d_mid_write(ctx: Ctx) -> FaultResult:
    res = fault_result(
        ctx,
        "kill-d-mid-write",
        "D is SIGKILLed while P's WRITE into it is in flight; then restarted",
    )
    topo = ctx.pair.topology
    if topo is not None:
        topo.throttle("50mbit")  # ~1 s for the request's 6 MB: the WRITE is in flight
    call = ctx.request(LONG, "kd")
    ctx.pair.rules("prefill", [{"id": call.rid, "on": "transfer", "match": call.rid,
                                "action": "kill", "pid": ctx.pair.pgid("decode"),
                                "when": "after"}])  # fmt: skip
    t = time.monotonic()
    call.start()
    ev = ctx.pair.wait_event("prefill", lambda e: e.get("ev") == "kill", 60, t)
    res.t_fault = ev["t"] if ev else time.monotonic()
    post = ctx.pair.wait_event("prefill", lambda e: e.get("ev") == "xfer_post"
                               and call.rid in str(e.get("rid")), 5, t)  # fmt: skip
    res.details["write_state_at_kill"] = post.get("state") if post else None
    if ev is None:
        res.inconclusive = "P never reached the WRITE (the kill rule did not fire)"
    ctx.pair.kill("decode")
    ctx.finish(res, [call], [], survivors=("prefill",))
    end = ctx.pair.wait_event("prefill", lambda e: e.get("ev") == "xfer_end"
                              and call.rid in str(e.get("rid")), 1, t)  # fmt: skip
    res.details["write_end"] = (
        {"state": end["state"], "after_kill_s": round(end["t"] - res.t_fault, 2)} if end else None
    )
    if topo is not None:
        topo.unthrottle()
    ctx.restart_and_probe(res, "decode")
    return res
