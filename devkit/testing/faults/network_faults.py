# SPDX-License-Identifier: Apache-2.0
"""Faults of the P-D network: the link cut briefly, cut longer than D's patience, and cut
while P's WRITE is in flight so that it lands late (the stale-write check)."""

from __future__ import annotations

import time
from typing import Any

from devkit.testing.faults import client
from devkit.testing.faults.audit import (
    FaultResult,
    first_difference,
)
from devkit.testing.faults.client import Call
from devkit.testing.faults.context import (
    LONG,
    Ctx,
    fault_result,
    reg_rule,
)

# -- the network ----------------------------------------------------------------------------------


def _link_cut(ctx: Ctx, name: str, cut_s: float, expect: str) -> FaultResult:
    res = fault_result(ctx, name,
                  f"the P-D link drops every packet for {cut_s:.0f}s, starting while P's WRITE "
                  "is in flight", expect=expect)  # fmt: skip
    topo = ctx.pair.topology
    if topo is None:
        res.applies = False
        res.note = "needs network namespaces (--net netns)"
        return res
    long_by = ctx.request(300, "lcb", max_tokens=600, stream=True)
    call = ctx.request(LONG, "cut")
    long_by.start().first_token.wait(60)
    topo.throttle("50mbit")
    t = time.monotonic()
    call.start()
    post = ctx.pair.wait_event("prefill", lambda e: e.get("ev") == "xfer_post"
                               and call.rid in str(e.get("rid")), 60, t)  # fmt: skip
    topo.cut()
    res.t_fault = time.monotonic()
    res.details["write_state_at_cut"] = post.get("state") if post else None
    if post is None:
        res.inconclusive = "P's WRITE was not seen posted within 60s: the cut did not hit a WRITE"
    try:
        while time.monotonic() - res.t_fault < cut_s:
            time.sleep(0.2)
    finally:
        topo.restore()
        res.t_fault_end = time.monotonic()
        topo.unthrottle()
    res.details["restored_after_s"] = round(time.monotonic() - res.t_fault, 1)
    ctx.finish(res, [call], [long_by])
    end = ctx.pair.wait_event("prefill", lambda e: e.get("ev") == "xfer_end"
                              and call.rid in str(e.get("rid")), 1, t)  # fmt: skip
    res.details["write_end"] = (
        {"state": end["state"], "after_cut_s": round(end["t"] - res.t_fault, 1)} if end else None
    )
    late = [e for e in ctx.pair.events("decode", t) if e.get("ev") == "recv"
            and e.get("kind") == "completion" and call.rid in str(e.get("rid"))]  # fmt: skip
    o = call.outcome
    if late and not o.ok and late[0]["t"] > o.t1:
        res.details["stale_write_landed_after_request_ended_s"] = round(late[0]["t"] - o.t1, 1)
    return res


def link_cut_short(ctx: Ctx) -> FaultResult:
    return _link_cut(ctx, "link-cut-short", 5.0, expect="ok")


def link_cut_long(ctx: Ctx) -> FaultResult:
    return _link_cut(ctx, "link-cut-long", 45.0, expect="error")


def link_cut_stale_write(
    ctx: Ctx, victim_prompt: int = 3600, victim_tokens: int = 450
) -> FaultResult:
    """The partition outlasts D's patience: D gives the request up, then a new request
    of D's may take its blocks, then the link comes back and P's WRITE, in flight all
    along, lands. The WRITE must never land in blocks D gave to another request
    (S-SAFE-1).

    To steer D's allocator: freed blocks go to the tail of vLLM's free queue, so
    "parked" P/D requests (their PUSH_REG dropped: they hold blocks, wait for KV and
    do not run) first take every other free block; the victim, a plain request to D
    alone in its batch (so its output is deterministic), then gets the freed ones, if
    D freed them. While the victim runs (the link still cut), the test reads which
    request holds each block the WRITE targets (D's PUSH_REG names them); the victim's
    output is compared with the same request run alone before the fault, and the
    moment the WRITE landed (D's completion event) with who held its blocks then.
    TCP keeps the kernel's back-off, so the WRITE resumes at its next retransmission
    after the restore: the victim is long enough to be running then.
    :func:`judge_stale_write` gives the verdict."""
    res = fault_result(ctx, "link-cut-stale-write",
                  "the link is cut during a WRITE until the request ended (D gave it up, or "
                  "the proxy's bound); a new request on D may take the freed blocks; then the "
                  "link comes back")  # fmt: skip
    res.outlasts_request = True
    topo = ctx.pair.topology
    if topo is None:
        res.applies = False
        res.note = "needs network namespaces (--net netns)"
        return res
    d_url = ctx.pair.engine_url("decode")
    vkey = (victim_prompt, ctx.new_seed(), victim_tokens)

    def victim() -> Call:
        c = client.plain(d_url, ctx.prompt(victim_prompt, vkey[1]), victim_tokens, timeout=240)
        c.body["stream"] = True
        c.key = vkey
        return c.start()

    runs = [victim().result() for _ in range(2)]
    baseline = [o.token_ids if o.ok else None for o in runs]
    deterministic = baseline[0] is not None and baseline[0] == baseline[1]
    res.details["victim_deterministic"] = deterministic
    if deterministic:  # the single engine's output for exactly this request
        ctx.remember_ref(vkey, baseline[0])  # type: ignore[arg-type]
    total = ctx.pair.num_blocks.get("decode", 0) - 1  # block 0 is vLLM's null block
    blocks = -(-LONG // 128)
    victim_blocks = -(-victim_prompt // 128)
    call = ctx.request(LONG, "stale")
    topo.throttle("50mbit")
    parked: list[Call] = []
    try:
        t = time.monotonic()
        call.start()
        ctx.pair.wait_event("prefill", lambda e: e.get("ev") == "xfer_post"
                            and call.rid in str(e.get("rid")), 60, t)  # fmt: skip
        topo.cut()
        res.t_fault = time.monotonic()
        call.result(timeout=90)
        res.details["request_ended_after_s"] = round(time.monotonic() - res.t_fault, 1)
        res.details["request_status"] = call.outcome.status  # D's error, or the proxy's 504
        res.details["d_blocks_after_it_ended"] = ctx.pair.usage("decode")["blocks"]
        # park: leave exactly victim_blocks free, the freed ones last in the queue
        to_park = total - victim_blocks - ctx.pair.usage("decode")["blocks"]
        rules = []
        while to_park > 0:
            n = int(min(to_park, blocks)) * 128 - 64
            c = ctx.request(max(n, 64), "park", reference=False)  # never served
            rules.append(reg_rule(c.rid, "drop", times=10))
            parked.append(c)
            to_park -= min(to_park, blocks)
        ctx.pair.rules("decode", rules)
        for c in parked:
            c.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if ctx.pair.usage("decode")["blocks"] >= total - victim_blocks:
                break
            time.sleep(0.2)
        res.details["d_blocks_parked"] = ctx.pair.usage("decode")["blocks"]
        v = victim()
        v.first_token.wait(120)
        # which of D's blocks the stale WRITE targets, and who holds them now
        reg = ctx.pair.wait_event("decode", lambda e: e.get("kind") == "PUSH_REG"
                                  and call.rid in str(e.get("rid")), 1, t)  # fmt: skip
        target = list(reg.get("blocks", [])) if reg else []
        holders = ctx.pair.request_blocks("decode")
        res.details["victim_blocks"] = sum(len(b) for r, b in holders.items() if v.rid in r)
        res.details["victim_blocks_the_write_targets"] = sum(
            len(set(b) & set(target)) for r, b in holders.items() if v.rid in r
        )
        topo.restore()
        topo.unthrottle()
        restored = res.t_fault_end = time.monotonic()
        res.details["restored_after_s"] = round(restored - res.t_fault, 1)
    finally:
        topo.restore()
        topo.unthrottle()
    if deterministic:
        ctx.finish(res, [call], [v], others=parked)
    else:
        ctx.finish(res, [call], others=[v, *parked])
    landed = [e for e in ctx.pair.events("decode", t) if e.get("ev") == "recv"
              and e.get("kind") == "completion" and call.rid in str(e.get("rid"))]  # fmt: skip
    landed_t = landed[0]["t"] if landed else None
    if landed_t is not None:
        res.details["stale_write_landed_after_restore_s"] = round(landed_t - restored, 2)
        res.details["victim_running_at_landing"] = v.outcome.t1 > landed_t
    res.details["victim"] = v.outcome.brief()
    got = v.outcome.token_ids
    if deterministic and v.outcome.ok and got != baseline[0]:
        first = first_difference(got, baseline[0])  # type: ignore[arg-type]
        times = v.outcome.token_times
        if first < len(times):  # when the output went wrong, against the restore and landing
            div = res.details["victim_diverged"] = {
                "at_token": first, "after_restore_s": round(times[first] - restored, 2)
            }  # fmt: skip
            if landed_t is not None:
                div["after_landing_s"] = round(times[first] - landed_t, 2)
                div["tokens_before_landing"] = sum(x < landed_t for x in times)
    ends = {r: c.outcome.t1 for r in holders for c in [v, *parked] if c.rid in r}
    judge_stale_write(res, {
        "baseline": baseline, "stale_rid": call.rid, "stale_outcome": call.outcome,
        "victim_rid": v.rid,
        "target": target, "holders": holders, "ends": ends, "restored": restored,
        "landed": landed_t,
    })  # fmt: skip
    return res


def judge_stale_write(res: FaultResult, obs: dict[str, Any]) -> None:
    """link-cut-stale-write's own verdict, from what the run observed (``obs``):
    ``baseline`` (the victim's two fault-free outputs, None for a failed run),
    ``stale_rid`` and ``stale_outcome`` (the request the cut hit), ``victim_rid``,
    ``target`` (the blocks its WRITE targets), ``holders`` (D's request -> blocks
    while the victim ran and the link was still cut), ``ends`` (when each holder's
    request ended), ``restored`` and ``landed`` (when the link came back and the WRITE's completion
    reached D; None: not seen).

    A problem: the WRITE landed while a request D had given its target blocks to was
    still running. Clean: D still held every target block for the request the cut hit
    (its quarantine) while the victim ran. Anything else cannot tell and is
    inconclusive, with the reason; the victim's own output is judged by the audit
    (it is a bystander where its baseline is deterministic)."""
    d = res.details
    base = obs["baseline"]
    if base[0] is None or base[0] != base[1]:
        res.inconclusive = ("the victim's output differs between two fault-free runs (or one "
                            "failed): there is no truth to compare it with")  # fmt: skip
        return
    if obs["stale_outcome"].ok:
        res.inconclusive = "the request the cut hit was served: its WRITE never went stale"
        return
    target = set(obs["target"])
    if not target:
        res.inconclusive = ("D's PUSH_REG of the request the cut hit was not seen: the WRITE's "
                            "target blocks are unknown")  # fmt: skip
        return
    landed, restored = obs["landed"], obs["restored"]
    if landed is not None and landed < restored:
        res.inconclusive = "the WRITE's completion reached D while the link was cut"
        return
    stale = obs["stale_rid"]
    holders: dict[str, list[int]] = obs["holders"]
    if not any(obs["victim_rid"] in r for r in holders):
        res.inconclusive = ("D's blocks per request were read without the running "
                            "victim's: who held the WRITE's target blocks is unknown")  # fmt: skip
        return
    kept = target & {b for r, bl in holders.items() if stale in r for b in bl}
    given = {r: sorted(target & set(bl)) for r, bl in holders.items()
             if stale not in r and target & set(bl)}  # fmt: skip
    d["write_target_blocks"] = len(target)
    d["target_blocks_kept"] = len(kept)
    d["target_blocks_given_to"] = {r: len(b) for r, b in given.items()}
    if given:
        names = ", ".join(f"{r} ({len(b)})" for r, b in given.items())
        if landed is None:
            res.inconclusive = (f"D gave target blocks of the in-flight WRITE to {names} while "
                                "the link was cut, but the WRITE was not seen landing")  # fmt: skip
            return
        hit = [r for r in given if obs["ends"].get(r, float("inf")) > landed]
        if hit:
            res.violations.append(
                f"the stale WRITE landed {landed - restored:.1f}s after the restore in blocks "
                f"D had given to {', '.join(f'{r} ({len(given[r])})' for r in hit)}"
            )
            return
        res.inconclusive = (f"D gave target blocks of the in-flight WRITE to {names}, but each "
                            "had ended before the WRITE landed")  # fmt: skip
        return
    if kept != target:
        res.inconclusive = (f"{len(target - kept)} of the WRITE's {len(target)} target blocks "
                            "were free while the link was cut (D gave them up before P "
                            "answered), but no request took them")  # fmt: skip
        return
    d["note"] = "D kept every block the WRITE targets while the victim ran (quarantine)"
