# SPDX-License-Identifier: Apache-2.0
"""Faults in a request's life: the client or the proxy aborts a leg, D runs out of KV
blocks."""

from __future__ import annotations

import time

from devkit.testing.faults import client
from devkit.testing.faults.audit import (
    FaultResult,
)
from devkit.testing.faults.context import (
    LONG,
    Ctx,
    fault_result,
    first_event_t,
    wrote,
)

# -- aborts ---------------------------------------------------------------------------------------


def client_abort_prefill(ctx: Ctx) -> FaultResult:
    res = fault_result(
        ctx, "client-abort-prefill", "the client goes away while P prefills and D waits for the KV"
    )
    call = ctx.request(LONG, "abp")
    by = ctx.bystanders()
    t = time.monotonic()
    call.start()
    if ctx.d_rid(call.rid, since=t) is None:
        res.inconclusive = "D never registered the request: the abort came before its moment"
    call.abort()
    res.t_fault = time.monotonic()
    res.details["p_wrote_before_abort"] = wrote(ctx, call.rid, t)
    return ctx.finish(res, [call], by)


def client_abort_decode(ctx: Ctx) -> FaultResult:
    res = fault_result(ctx, "client-abort-decode", "the client goes away while D streams tokens")
    call = ctx.request(300, "abdec", max_tokens=1500, stream=True, reference=False)
    by = ctx.bystanders()
    call.start()
    call.first_token.wait(60)
    time.sleep(0.3)
    call.abort()
    res.t_fault = time.monotonic()
    return ctx.finish(res, [call], by)


def abort_p_leg(ctx: Ctx) -> FaultResult:
    res = fault_result(
        ctx,
        "abort-p-leg",
        "the P leg alone is cancelled while P prefills (a router that lost P's "
        "connection); the D leg waits for KV that will not come",
    )
    p, d = ctx.direct_legs(4000, "abpleg")
    t = time.monotonic()
    d.start()
    p.start()
    ctx.d_rid(d.rid, since=t)
    p.abort()
    res.t_fault = time.monotonic()
    res.details["p_wrote_before_abort"] = wrote(ctx, d.rid, t)
    ctx.finish(res, [d], [], others=[p])
    res.details["p_leg"] = p.outcome.brief()
    return res


def abort_d_leg(ctx: Ctx) -> FaultResult:
    res = fault_result(
        ctx, "abort-d-leg", "the D leg alone is cancelled while D waits for the KV; P prefills on"
    )
    p, d = ctx.direct_legs(4000, "abdleg")
    t = time.monotonic()
    d.start()
    p.start()
    ctx.d_rid(d.rid, since=t)
    d.abort()
    res.t_fault = time.monotonic()
    res.details["p_wrote_before_abort"] = wrote(ctx, d.rid, t)
    ctx.finish(res, [d], [], others=[p])
    res.details["p_leg"] = p.outcome.brief()
    return res


# -- resources ------------------------------------------------------------------------------------


def d_out_of_blocks(ctx: Ctx, fillers: int = 3, filler_prompt: int = 2000,
                    hold_s: float = 15.0) -> FaultResult:  # fmt: skip
    """D's blocks are taken by its own long requests when the P/D request arrives: it
    waits in D's queue; the fillers are ended (client gone) ``hold_s`` later, past P's
    lease, and only then does D register the request with P. Times count from that
    registration (the fault's moment), not from the request's arrival."""
    total = ctx.pair.num_blocks.get("decode", 0)
    res = fault_result(ctx, "d-out-of-blocks",
                  f"D's {total} KV blocks are taken by long local requests when the request "
                  f"arrives; it waits {hold_s:.0f}s in D's queue, past P's lease")  # fmt: skip
    d_url = ctx.pair.engine_url("decode")
    call = ctx.request(LONG, "oob")  # its reference while D is idle
    fill = [client.plain(d_url, ctx.prompt(filler_prompt, ctx.new_seed()),
                         4096 - filler_prompt - 8, timeout=240)
            for _ in range(fillers)]  # fmt: skip
    for c in fill:
        c.start()
    need = -(-LONG // 128) + 1
    t0 = time.monotonic()
    while time.monotonic() - t0 < 180:
        if ctx.pair.usage("decode")["blocks"] > total - need:
            break
        time.sleep(0.2)
    res.details["d_blocks_when_sent"] = ctx.pair.usage("decode")["blocks"]
    t = time.monotonic()
    call.start()
    time.sleep(hold_s)
    res.details["waiting_on_d_after_hold"] = ctx.pair.usage("decode")["waiting"]
    t_fill_end = time.monotonic()
    for c in fill:
        c.abort()
    reg = ctx.d_rid(call.rid, timeout=60, since=t)
    res.t_fault = first_event_t(ctx, "decode", call.rid, "PUSH_REG") if reg else time.monotonic()
    res.details["push_reg_sent_after_s"] = round(res.t_fault - t, 1) if reg else None
    if reg is None:
        res.inconclusive = "D never registered the request"
    elif res.t_fault < t_fill_end:
        res.inconclusive = (f"D registered the request {res.t_fault - t:.1f}s after it arrived, "
                            "before the fillers ended: it did not wait for blocks")  # fmt: skip
    ctx.finish(res, [call], others=fill)
    return res
