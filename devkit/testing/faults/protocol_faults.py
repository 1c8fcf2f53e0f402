# SPDX-License-Identifier: Apache-2.0
"""Faults in the connector's messages: a PUSH_REG dropped, late or repeated, a handshake
refused, and a foreign NIXL agent that floods or forges notifications."""

from __future__ import annotations

import threading
import time

from devkit.launch.process import free_port
from devkit.testing.faults.audit import (
    FaultResult,
)
from devkit.testing.faults.client import Call
from devkit.testing.faults.context import (
    BYSTANDER_LENS,
    LONG,
    Ctx,
    fault_result,
    reg_rule,
    run_foreign,
)

# -- PUSH_REG faults ------------------------------------------------------------------------------


def push_reg_dropped(ctx: Ctx) -> FaultResult:
    res = fault_result(ctx, "push-reg-dropped", "D's PUSH_REG never reaches P (lost notification)")
    call = ctx.request(LONG, "drop")
    ctx.pair.rules("decode", [reg_rule(call.rid, "drop")])
    by = ctx.bystanders()
    call.start()
    res.t_fault = call.outcome.t0
    return ctx.finish(res, [call], by)


def push_reg_after_lease(ctx: Ctx) -> FaultResult:
    lease = float(ctx.pair.cfg.extra_config.get("kv_lease_duration", 30))
    delay = lease + 4
    res = fault_result(ctx, "push-reg-after-lease",
                  f"D's PUSH_REG reaches P {delay:.0f}s late, after P's lease ({lease:.0f}s) "
                  "freed the prefilled blocks")  # fmt: skip
    call = ctx.request(LONG, "late")
    ctx.pair.rules("decode", [reg_rule(call.rid, "delay", delay_s=delay)])
    by = ctx.bystanders()
    call.start()
    res.t_fault = call.outcome.t0
    return ctx.finish(res, [call], by)


def push_reg_duplicate(ctx: Ctx) -> FaultResult:
    res = fault_result(ctx, "push-reg-duplicate", "D's PUSH_REG arrives twice", expect="ok")
    call = ctx.request(LONG, "dup")
    ctx.pair.rules("decode", [reg_rule(call.rid, "dup")])
    by = ctx.bystanders()
    call.start()
    res.t_fault = call.outcome.t0
    return ctx.finish(res, [call], by)


def push_reg_duplicate_late(ctx: Ctx) -> FaultResult:
    res = fault_result(ctx, "push-reg-duplicate-late",
                  "a copy of D's PUSH_REG arrives 3s late, after the WRITE completed",
                  expect="ok")  # fmt: skip
    call = ctx.request(LONG, "dupl")
    ctx.pair.rules("decode", [reg_rule(call.rid, "dup", delay_s=3.0)])
    by = ctx.bystanders()
    call.start()
    res.t_fault = call.outcome.t0
    return ctx.finish(res, [call], by)


# -- handshakes -----------------------------------------------------------------------------------


def handshake_refused_d_to_p(ctx: Ctx) -> FaultResult:
    res = fault_result(
        ctx,
        "handshake-refused-d-to-p",
        "D's first handshake with a P fails (nothing answers on its side channel)",
    )
    # D knows P already (warm-up); a P engine id it has never seen forces a handshake,
    # to a port where nothing listens.
    with ctx.pair.extra_proxy(p_side_channel_port=free_port(), p_engine_id="P-unreachable") as url:
        call = ctx.request(LONG, "hsd", url=url)
        by = ctx.bystanders()
        call.start()
        res.t_fault = call.outcome.t0
        return ctx.finish(res, [call], by)


def handshake_refused_p_to_d(ctx: Ctx) -> FaultResult:
    res = fault_result(
        ctx,
        "handshake-refused-p-to-d",
        "P's handshake with D fails (D's PUSH_REG names an engine P cannot reach)",
    )
    call = ctx.request(LONG, "hsp")
    changes = {ctx.stack.reg_engine_key: f"D-unreachable-{call.rid[-6:]}",
               ctx.stack.reg_port_key: free_port()}  # fmt: skip
    ctx.pair.rules("decode", [reg_rule(call.rid, "rewrite", set=changes)])
    by = ctx.bystanders()
    call.start()
    res.t_fault = call.outcome.t0
    return ctx.finish(res, [call], by)


# -- a foreign agent ------------------------------------------------------------------------------


def notif_flood(ctx: Ctx) -> FaultResult:
    res = fault_result(ctx, "notif-flood",
                  "a foreign NIXL agent handshakes through the side channel and sends P and D "
                  "thousands of malformed and well-formed notifications while requests run",
                  expect="ok")  # fmt: skip
    planned = [ctx.request(BYSTANDER_LENS[i % 3], "fl") for i in range(40)]
    by: list[Call] = []
    stop = False

    def traffic() -> None:
        for c in planned:
            if stop:
                break
            by.append(c.start())
            c.result()

    th = threading.Thread(target=traffic, daemon=True)
    th.start()
    res.t_fault = time.monotonic()
    sizes = ["--malformed", "2000", "--wellformed", "500", "--engines", "8"]
    res.details["foreign_p"] = run_foreign(ctx, "prefill", sizes)
    if ctx.pair.alive("decode"):
        res.details["foreign_d"] = run_foreign(ctx, "decode", sizes)
    failed = [r for r in ("foreign_p", "foreign_d") if not res.details.get(r, {}).get("ok")]
    if failed:
        res.inconclusive = "the foreign agent failed: " + "; ".join(
            f"{r}: {res.details.get(r, {}).get('error')}" for r in failed
        )
    stop = True
    th.join(300)
    return ctx.finish(res, [], by)


def forged_completion(ctx: Ctx) -> FaultResult:
    res = fault_result(ctx, "forged-completion",
                  "a foreign agent sends D the completion notification of a request whose "
                  "KV P has not written yet", expect="error")  # fmt: skip
    call = ctx.request(LONG, "forge")
    ctx.pair.rules("prefill", [{"id": call.rid, "on": "transfer", "match": call.rid,
                                "action": "stall", "delay_s": 4.0}])  # fmt: skip
    t = time.monotonic()
    call.start()
    d_rid = ctx.d_rid(call.rid, since=t)
    res.t_fault = time.monotonic()
    if d_rid is None:
        res.inconclusive = "D never registered the request: no completion was forged"
    else:
        res.details["foreign"] = run_foreign(ctx, "decode", ["--mode", "forge", "--rid", d_rid])
        if not res.details["foreign"].get("ok"):
            res.inconclusive = f"the foreign agent failed: {res.details['foreign'].get('error')}"
    ctx.finish(res, [call], [])
    if call.outcome.ok and call.rid not in res.wrong_outputs():
        res.details["note"] = "served with the right output (the forged completion was ignored)"
    return res
