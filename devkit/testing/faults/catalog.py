# SPDX-License-Identifier: Apache-2.0
"""The faults: each injects one failure at a chosen moment of a request's life on a
running :class:`~devkit.testing.faults.pair.FaultPair`, then runs the audit.

Moments are read from the NIXL shim's event log (D sent the PUSH_REG, P posted the
WRITE ...) or made by a rule (P kills itself right before the WRITE, D's PUSH_REG
leaves 12 s late ...). Every fault works on both stacks (ours, vLLM 0.32's push)
unless it says why not (``applies=False``).

A fault function takes a :class:`Ctx` and returns a
:class:`~devkit.testing.faults.audit.FaultResult`; :data:`FAULTS` lists them in
the order a run takes them (kills last: they restart an engine). A fault that cannot
tell whether it was handled (its moment never came, ...) says why in
``res.inconclusive``.

Every request gets a prompt of its own (a seed per request, :meth:`Ctx.new_seed`):
no two requests share a prompt or a prefix, so KV written into another request's
blocks changes that request's output instead of copying equal bytes. Its reference,
a single engine's greedy output, is computed on D alone when the request is made,
before the fault where the request precedes it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from devkit.launch.process import free_port
from devkit.testing.faults import client
from devkit.testing.faults.audit import (
    FaultResult,
    first_difference,
    grown_tables,
    wait_idle,
)
from devkit.testing.faults.client import Call
from devkit.testing.faults.pair import ROLES, FaultPair

#: The request a fault hits: 3000 prompt tokens (24 blocks, ~6 MB of KV).
LONG = 3000
#: Bystanders: short requests in flight during the fault (their outputs are checked).
BYSTANDER_LENS = (128, 300, 700)
BYSTANDER_TOKENS = 12


class Ctx:
    """A running pair plus what the faults share: reference outputs, warm-up tables,
    bounds."""

    def __init__(self, pair: FaultPair, say: Callable[[str], None], bound_s: float = 40.0,
                 settle_s: float = 75.0) -> None:  # fmt: skip
        self.pair = pair
        self.stack = pair.cfg.stack
        self.net = pair.cfg.net
        self.say = say
        #: longest acceptable time from a fault to the end of the requests it hit
        self.bound_s = bound_s
        #: how long after the requests ended the engines may take to free every block
        #: (a WRITE NIXL failed holds them 2 x the TCP user timeout, 60 s by default,
        #: after its error: N-REL-2)
        self.settle_s = settle_s
        self._refs: dict[tuple[int, int, int], list[int]] = {}
        self.base_tables: dict[str, dict[str, int]] = {}
        self._seeds = itertools.count(1)
        self._seed_lock = threading.Lock()

    # -- references and prompts --------------------------------------------------------------
    @staticmethod
    def prompt(n: int, seed: int) -> list[int]:
        return client.make_prompt(n, 1000 + seed)

    def new_seed(self) -> int:
        """A prompt seed no other request of this run has."""
        with self._seed_lock:
            return next(self._seeds)

    def ref(self, n: int, seed: int, max_tokens: int) -> list[int]:
        """A single engine's greedy output: D asked directly, without disaggregation."""
        key = (n, seed, max_tokens)
        if key not in self._refs:
            call = client.plain(self.pair.engine_url("decode"), self.prompt(n, seed), max_tokens)
            o = call.start().result()
            if not o.ok:
                raise RuntimeError(f"reference request failed: {o.brief()}")
            self._refs[key] = o.token_ids
        return self._refs[key]

    def ref_of(self, call: Call) -> list[int]:
        """The reference of a request made by :meth:`request` or :meth:`direct_legs`."""
        assert call.key is not None, call.rid
        return self.ref(*call.key)

    def remember_ref(self, key: tuple[int, int, int], tokens: list[int]) -> None:
        """A reference computed by the fault itself (the same request run alone on D)."""
        self._refs[key] = list(tokens)

    def warm_up(self) -> None:
        """Handshakes done, the pair's outputs checked, tables recorded at idle."""
        for n in (LONG, 300):
            call = self.request(n, "warm")
            o = call.start().result()
            if not o.ok or o.token_ids != self.ref_of(call):
                raise RuntimeError(f"warm-up request not served right: {o.brief()}")
        self.rebase()

    def rebase(self, roles: tuple[str, ...] = ROLES) -> None:
        for role in roles:
            wait_idle(self.pair, role, time.monotonic() + 30, time.monotonic())
            self.base_tables[role] = self.pair.tables(role)

    # -- requests ---------------------------------------------------------------------------
    def request(self, n: int = LONG, tag: str = "", max_tokens: int = BYSTANDER_TOKENS,
                stream: bool = False, url: str | None = None,
                reference: bool = True) -> Call:  # fmt: skip
        """A request through the proxy (not started) with a prompt of its own; its
        reference is computed now unless ``reference`` is False (then at the audit,
        if the request returned tokens)."""
        seed = self.new_seed()
        call = client.via_proxy(url or self.pair.url, self.prompt(n, seed), max_tokens,
                                client.new_rid(tag), stream=stream)  # fmt: skip
        call.key = (n, seed, max_tokens)
        if reference:
            self.ref_of(call)
        return call

    def bystanders(self, lens: tuple[int, ...] = BYSTANDER_LENS) -> list[Call]:
        calls = [self.request(n, "by") for n in lens]  # references first, with D idle
        return [c.start() for c in calls]

    def reference(self, call: Call) -> list[int] | None:
        """The single engine's output ``call`` is judged by (None: it returned no
        tokens, or it is no request of ours). For a stream that ended early, what
        it got must start the reference; one that long is enough."""
        o = call.outcome
        if call.key is None or not (o.ok or o.token_ids):
            return None
        n, seed, max_tokens = call.key
        if o.ok or (n, seed, max_tokens) in self._refs:
            return self.ref(n, seed, max_tokens)
        return self.ref(n, seed, min(max_tokens, len(o.token_ids)))

    def direct_legs(
        self, n: int, tag: str, max_tokens: int = BYSTANDER_TOKENS
    ) -> tuple[Call, Call]:
        extra = {"remote_request_id": "x"} if self.stack.d_leg_remote_request_id else None
        seed = self.new_seed()
        p, d = client.direct_legs(
            self.pair.engine_url("prefill"), self.pair.engine_url("decode"), self.pair.coords(),
            self.prompt(n, seed), max_tokens, client.new_rid(tag), d_extra=extra,
        )  # fmt: skip
        for c in (p, d):
            c.key = (n, seed, max_tokens)
        self.ref(n, seed, max_tokens)
        return p, d

    def d_rid(self, rid: str, timeout: float = 30, since: float = 0.0) -> str | None:
        """D's engine request id of the client request ``rid`` (from D's PUSH_REG)."""
        ev = self.pair.wait_event("decode", lambda e: e.get("kind") == "PUSH_REG"
                                  and rid in str(e.get("rid")), timeout, since)  # fmt: skip
        return ev["rid"] if ev else None

    # -- the audit ----------------------------------------------------------------------------
    def finish(
        self,
        res: FaultResult,
        affected: list[Call],
        bystanders: list[Call] = (),  # type: ignore[assignment]
        survivors: tuple[str, ...] = ROLES,
        others: list[Call] = (),  # type: ignore[assignment]
    ) -> FaultResult:
        """Wait for every request (``others``: awaited, not judged), then audit the
        survivors (see audit.py). Every affected request and bystander that returned
        tokens is judged by its reference."""
        pair = self.pair
        if res.applies and res.recovered_s is None and res.restart is None:
            self.measure_recovery(res)
        for call in [*affected, *bystanders, *others]:
            call.result()
        res.affected = [c.outcome for c in affected]
        res.bystanders = [c.outcome for c in bystanders]
        for call in [*affected, *bystanders]:
            want = self.reference(call)
            if want is not None:
                res.references[call.rid] = want
        ends = [c.outcome.t1 for c in [*affected, *bystanders, *others] if c.outcome.t1]
        deadline = max([*ends, time.monotonic()]) + self.settle_s
        for role in survivors:
            if pair.alive(role):
                res.freed_s[role], res.leaked_blocks[role] = wait_idle(
                    pair, role, deadline, res.t_fault
                )
        idle = {r: self._tables(r) for r in survivors if pair.alive(r)}
        res.alive = {r: pair.alive(r) and _healthy(pair, r) for r in ROLES}
        if all(res.alive.values()):
            call = self.request(300, "probe")
            probe = call.start().result()
            res.serves_after = probe.ok and probe.token_ids == self.ref_of(call)
            res.details["probe"] = probe.brief()
        self._tables_drained(res, [r for r in survivors if r in idle], idle)
        return res

    def measure_recovery(self, res: FaultResult, window_s: float = 120.0) -> None:
        """Time to recovery: a request every second from the fault's end (or its
        injection) until one is served right, while the fault's own requests may still
        be pending; ``res.recovered_s`` stays None if none is within ``window_s`` or an
        engine is down."""
        start = res.t_fault_end or res.t_fault or time.monotonic()
        deadline = time.monotonic() + window_s
        tries = 0
        while time.monotonic() < deadline and all(self.pair.alive(r) for r in ROLES):
            try:
                call = self.request(300, "rc")
            except RuntimeError as e:  # D alone did not answer: not recovered yet
                res.details["recovery_reference_error"] = str(e)[:200]
                time.sleep(1.0)
                continue
            call.timeout = max(5.0, min(60.0, deadline - time.monotonic()))
            o = call.start().result()
            tries += 1
            if o.ok and o.token_ids == self.ref_of(call):
                res.recovered_s = round(max(0.0, o.t1 - start), 1)
                break
            time.sleep(1.0)
        res.details["recovery_tries"] = tries

    def _tables_drained(self, res: FaultResult, roles: list[str], idle: dict) -> None:
        """Per-request tables back to their warm-up size: polled for up to
        ``settle_s`` (a request every 10 s, as a table may drain only when the engine
        steps); what is still there then is reported."""
        t0 = time.monotonic()
        last_probe = t0
        while True:
            time.sleep(2)
            grown = {r: grown_tables(self.base_tables.get(r, {}), idle[r], self._tables(r))
                     for r in roles if self.pair.alive(r)}  # fmt: skip
            if not any(grown.values()) or time.monotonic() - t0 > self.settle_s:
                break
            if time.monotonic() - last_probe > 10 and all(self.pair.alive(r) for r in ROLES):
                self.request(128, "drain", reference=False).start().result()
                last_probe = time.monotonic()
        res.tables_grown = grown
        had = {r: sorted(grown_tables(self.base_tables.get(r, {}), idle[r], idle[r]))
               for r in roles}  # fmt: skip
        if any(had.values()):
            res.details["tables_at_idle"] = {r: v for r, v in had.items() if v}
            res.details["tables_drained_after_s"] = (
                None if any(grown.values()) else round(time.monotonic() - t0, 1)
            )

    def _tables(self, role: str) -> dict[str, int]:
        try:
            return self.pair.tables(role)
        except Exception as e:
            self.say(f"tables of {role} not readable: {e}")
            return {}

    def restart_and_probe(self, res: FaultResult, role: str, window_s: float = 100.0) -> None:
        """Restart ``role`` (same engine id, ports, address); the other engine keeps
        running. Then a request every few seconds until one is served right or
        ``window_s`` passed: is the restarted peer picked up?"""
        self.say(f"restarting {role}")
        took = self.pair.restart(role)
        t0 = time.monotonic()
        attempts: list[str] = []
        picked = None
        while time.monotonic() - t0 < window_s and len(attempts) < 8:
            call = self.request(300, "rs")
            call.timeout = 60.0
            o = call.start().result()
            attempts.append(f"+{o.t0 - t0:.0f}s: {o.brief()}")
            if o.ok and o.token_ids == self.ref_of(call):
                picked = time.monotonic() - t0
                break
            time.sleep(5)
        if picked is not None:  # from the moment the restart was asked for
            res.recovered_s = round(took + picked, 1)
        res.restart = {"role": role, "restart_s": round(took, 1), "picked_up": picked is not None,
                       "after_s": round(picked, 1) if picked is not None else None,
                       "attempts": attempts}  # fmt: skip
        res.alive[role] = self.pair.alive(role) and _healthy(self.pair, role)
        if picked is not None:
            self.rebase((role,))
            return
        # The survivor does not take the restarted peer back. Each side caches the
        # other's NIXL agent by engine id once they talked, so only restarting both
        # gives the faults after this one a working pair.
        self.say(f"restarted {role} not picked up; restarting both engines")
        self.pair.restart_all()
        res.restart["both_restarted"] = True
        res.restart["after_both_restarted"] = (
            self.request(300, "rs2", reference=False).start().result().brief()
        )
        self.rebase()


def _healthy(pair: FaultPair, role: str) -> bool:
    from devkit.testing.faults.pair import http_alive

    return http_alive(pair.engine_url(role))


def _result(ctx: Ctx, fault: str, about: str, expect: str = "error") -> FaultResult:
    return FaultResult(fault, ctx.stack.name, ctx.net, about=about, expect=expect)


def _reg_rule(rid: str, action: str, **kw: Any) -> dict[str, Any]:
    return {"id": f"{action}-{rid}", "on": "send", "prefix": "PUSH_REG:", "match": rid,
            "action": action, **kw}  # fmt: skip


# -- PUSH_REG faults ------------------------------------------------------------------------------


def push_reg_dropped(ctx: Ctx) -> FaultResult:
    res = _result(ctx, "push-reg-dropped", "D's PUSH_REG never reaches P (lost notification)")
    call = ctx.request(LONG, "drop")
    ctx.pair.rules("decode", [_reg_rule(call.rid, "drop")])
    by = ctx.bystanders()
    call.start()
    res.t_fault = call.outcome.t0
    return ctx.finish(res, [call], by)


def push_reg_after_lease(ctx: Ctx) -> FaultResult:
    lease = float(ctx.pair.cfg.extra_config.get("kv_lease_duration", 30))
    delay = lease + 4
    res = _result(ctx, "push-reg-after-lease",
                  f"D's PUSH_REG reaches P {delay:.0f}s late, after P's lease ({lease:.0f}s) "
                  "freed the prefilled blocks")  # fmt: skip
    call = ctx.request(LONG, "late")
    ctx.pair.rules("decode", [_reg_rule(call.rid, "delay", delay_s=delay)])
    by = ctx.bystanders()
    call.start()
    res.t_fault = call.outcome.t0
    return ctx.finish(res, [call], by)


def push_reg_duplicate(ctx: Ctx) -> FaultResult:
    res = _result(ctx, "push-reg-duplicate", "D's PUSH_REG arrives twice", expect="ok")
    call = ctx.request(LONG, "dup")
    ctx.pair.rules("decode", [_reg_rule(call.rid, "dup")])
    by = ctx.bystanders()
    call.start()
    res.t_fault = call.outcome.t0
    return ctx.finish(res, [call], by)


def push_reg_duplicate_late(ctx: Ctx) -> FaultResult:
    res = _result(ctx, "push-reg-duplicate-late",
                  "a copy of D's PUSH_REG arrives 3s late, after the WRITE completed",
                  expect="ok")  # fmt: skip
    call = ctx.request(LONG, "dupl")
    ctx.pair.rules("decode", [_reg_rule(call.rid, "dup", delay_s=3.0)])
    by = ctx.bystanders()
    call.start()
    res.t_fault = call.outcome.t0
    return ctx.finish(res, [call], by)


# -- handshakes -----------------------------------------------------------------------------------


def handshake_refused_d_to_p(ctx: Ctx) -> FaultResult:
    res = _result(
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
    res = _result(
        ctx,
        "handshake-refused-p-to-d",
        "P's handshake with D fails (D's PUSH_REG names an engine P cannot reach)",
    )
    call = ctx.request(LONG, "hsp")
    changes = {ctx.stack.reg_engine_key: f"D-unreachable-{call.rid[-6:]}",
               ctx.stack.reg_port_key: free_port()}  # fmt: skip
    ctx.pair.rules("decode", [_reg_rule(call.rid, "rewrite", set=changes)])
    by = ctx.bystanders()
    call.start()
    res.t_fault = call.outcome.t0
    return ctx.finish(res, [call], by)


# -- aborts ---------------------------------------------------------------------------------------


def client_abort_prefill(ctx: Ctx) -> FaultResult:
    res = _result(
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
    res.details["p_wrote_before_abort"] = _wrote(ctx, call.rid, t)
    return ctx.finish(res, [call], by)


def client_abort_decode(ctx: Ctx) -> FaultResult:
    res = _result(ctx, "client-abort-decode", "the client goes away while D streams tokens")
    call = ctx.request(300, "abdec", max_tokens=1500, stream=True, reference=False)
    by = ctx.bystanders()
    call.start()
    call.first_token.wait(60)
    time.sleep(0.3)
    call.abort()
    res.t_fault = time.monotonic()
    return ctx.finish(res, [call], by)


def abort_p_leg(ctx: Ctx) -> FaultResult:
    res = _result(
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
    res.details["p_wrote_before_abort"] = _wrote(ctx, d.rid, t)
    ctx.finish(res, [d], [], others=[p])
    res.details["p_leg"] = p.outcome.brief()
    return res


def abort_d_leg(ctx: Ctx) -> FaultResult:
    res = _result(
        ctx, "abort-d-leg", "the D leg alone is cancelled while D waits for the KV; P prefills on"
    )
    p, d = ctx.direct_legs(4000, "abdleg")
    t = time.monotonic()
    d.start()
    p.start()
    ctx.d_rid(d.rid, since=t)
    d.abort()
    res.t_fault = time.monotonic()
    res.details["p_wrote_before_abort"] = _wrote(ctx, d.rid, t)
    ctx.finish(res, [d], [], others=[p])
    res.details["p_leg"] = p.outcome.brief()
    return res


def _wrote(ctx: Ctx, rid: str, since: float) -> bool:
    return any(e.get("ev") == "xfer_post" and rid in str(e.get("rid"))
               for e in ctx.pair.events("prefill", since))  # fmt: skip


# -- resources ------------------------------------------------------------------------------------


def d_out_of_blocks(ctx: Ctx, fillers: int = 3, filler_prompt: int = 2000,
                    hold_s: float = 15.0) -> FaultResult:  # fmt: skip
    """D's blocks are taken by its own long requests when the P/D request arrives: it
    waits in D's queue; the fillers are ended (client gone) ``hold_s`` later, past P's
    lease, and only then does D register the request with P. Times count from that
    registration (the fault's moment), not from the request's arrival."""
    total = ctx.pair.num_blocks.get("decode", 0)
    res = _result(ctx, "d-out-of-blocks",
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
    res.t_fault = _first_t(ctx, "decode", call.rid, "PUSH_REG") if reg else time.monotonic()
    res.details["push_reg_sent_after_s"] = round(res.t_fault - t, 1) if reg else None
    if reg is None:
        res.inconclusive = "D never registered the request"
    elif res.t_fault < t_fill_end:
        res.inconclusive = (f"D registered the request {res.t_fault - t:.1f}s after it arrived, "
                            "before the fillers ended: it did not wait for blocks")  # fmt: skip
    ctx.finish(res, [call], others=fill)
    return res


def _first_t(ctx: Ctx, role: str, rid: str, kind: str) -> float:
    for e in ctx.pair.events(role):
        if e.get("kind") == kind and rid in str(e.get("rid")):
            return float(e["t"])
    return float("nan")


# -- peers dying ----------------------------------------------------------------------------------


def kill_p_before_write(ctx: Ctx) -> FaultResult:
    res = _result(
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
    res = _result(ctx, "p-hangs-mid-write",
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
    res = _result(
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


# -- the network ----------------------------------------------------------------------------------


def _link_cut(ctx: Ctx, name: str, cut_s: float, expect: str) -> FaultResult:
    res = _result(ctx, name,
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
    res = _result(ctx, "link-cut-stale-write",
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
            rules.append(_reg_rule(c.rid, "drop", times=10))
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


# -- a foreign agent ------------------------------------------------------------------------------


def _foreign(ctx: Ctx, role: str, args: list[str], timeout: float = 120) -> dict[str, Any]:
    """Run devkit.testing.faults.foreign against ``role``'s side channel."""
    pair = ctx.pair
    spec = pair.specs[role]
    out = pair.cfg.run_dir / f"foreign-{role}-{time.monotonic_ns()}.json"
    argv = [pair.cfg.python, "-m", "devkit.testing.faults.foreign",
            "--host", spec.side_channel_host, "--port", str(spec.side_channel_port),
            "--query", str(ctx.stack.side_channel_query), "--out", str(out), *args]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_repo_root()), env.get("PYTHONPATH")) if p)
    if pair.topology is not None:  # a process on D's host, talking over the P-D link
        argv = pair.topology.wrapper("decode") + argv
        env.update(pair.topology.engine_env("decode"))
    log = pair.cfg.run_dir / "foreign.log"
    with log.open("ab") as f:
        try:
            subprocess.run(argv, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                           check=False, start_new_session=True)  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout}s"}
    try:
        return json.loads(out.read_text())
    except (OSError, ValueError):
        return {"ok": False, "error": f"no result (see {log})"}


def _repo_root() -> Any:
    from devkit.testing.faults.pair import REPO_ROOT

    return REPO_ROOT


def notif_flood(ctx: Ctx) -> FaultResult:
    res = _result(ctx, "notif-flood",
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

    import threading

    th = threading.Thread(target=traffic, daemon=True)
    th.start()
    res.t_fault = time.monotonic()
    sizes = ["--malformed", "2000", "--wellformed", "500", "--engines", "8"]
    res.details["foreign_p"] = _foreign(ctx, "prefill", sizes)
    if ctx.pair.alive("decode"):
        res.details["foreign_d"] = _foreign(ctx, "decode", sizes)
    failed = [r for r in ("foreign_p", "foreign_d") if not res.details.get(r, {}).get("ok")]
    if failed:
        res.inconclusive = "the foreign agent failed: " + "; ".join(
            f"{r}: {res.details.get(r, {}).get('error')}" for r in failed
        )
    stop = True
    th.join(300)
    return ctx.finish(res, [], by)


def forged_completion(ctx: Ctx) -> FaultResult:
    res = _result(ctx, "forged-completion",
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
        res.details["foreign"] = _foreign(ctx, "decode", ["--mode", "forge", "--rid", d_rid])
        if not res.details["foreign"].get("ok"):
            res.inconclusive = f"the foreign agent failed: {res.details['foreign'].get('error')}"
    ctx.finish(res, [call], [])
    if call.outcome.ok and call.rid not in res.wrong_outputs():
        res.details["note"] = "served with the right output (the forged completion was ignored)"
    return res


#: name -> fault, in run order (the destructive ones last)
FAULTS: dict[str, Callable[[Ctx], FaultResult]] = {
    "push-reg-duplicate": push_reg_duplicate,
    "push-reg-duplicate-late": push_reg_duplicate_late,
    "push-reg-dropped": push_reg_dropped,
    "push-reg-after-lease": push_reg_after_lease,
    "handshake-refused-d-to-p": handshake_refused_d_to_p,
    "handshake-refused-p-to-d": handshake_refused_p_to_d,
    "client-abort-prefill": client_abort_prefill,
    "client-abort-decode": client_abort_decode,
    "abort-p-leg": abort_p_leg,
    "abort-d-leg": abort_d_leg,
    "d-out-of-blocks": d_out_of_blocks,
    "link-cut-short": link_cut_short,
    "link-cut-long": link_cut_long,
    "link-cut-stale-write": link_cut_stale_write,
    "forged-completion": forged_completion,
    "notif-flood": notif_flood,
    "kill-p-before-write": kill_p_before_write,
    "kill-d-mid-write": kill_d_mid_write,
    "p-hangs-mid-write": p_hangs_mid_write,
}


def run_fault(ctx: Ctx, name: str) -> FaultResult:
    """One fault, with the pair put back in order afterwards: rules cleared, a dead
    engine restarted, an engine that kept blocks restarted (so that the next fault
    starts clean)."""
    t0 = time.monotonic()
    ctx.say(f"fault {name}")
    try:
        res = FAULTS[name](ctx)
    except Exception as e:
        res = FaultResult(name, ctx.stack.name, ctx.net)
        res.details["harness_error"] = f"{type(e).__name__}: {e}"
        res.inconclusive = f"harness error: {type(e).__name__}: {e}"
        ctx.say(f"fault {name}: harness error {e!r}")
    res.wall_s = time.monotonic() - t0
    ctx.pair.clear_rules()
    with contextlib.suppress(Exception):
        if ctx.pair.topology is not None:
            ctx.pair.topology.restore()
            ctx.pair.topology.unthrottle()
    broken = res.serves_after is False and not (res.restart or {}).get("both_restarted")
    if broken:
        # e.g. a NIXL connection that failed is never made again: only restarting both
        # engines gives the next fault a working pair
        ctx.say("the pair does not serve any more: restarting both engines")
        res.details.setdefault("reset", []).append("both engines (pair did not serve)")
        ctx.pair.restart_all()
        ctx.rebase()
    for role in ROLES:
        dead = not ctx.pair.alive(role) or not _healthy(ctx.pair, role)
        leaking = bool(res.leaked_blocks.get(role)) and not broken
        if dead or leaking:
            why = "died" if dead else f"kept {res.leaked_blocks[role]} blocks"
            ctx.say(f"{role} {why}: restarting it before the next fault")
            res.details.setdefault("reset", []).append(f"{role} {why}")
            ctx.pair.restart(role)
            ctx.rebase((role,))
    summary = res.summary(ctx.bound_s)
    ctx.say(f"fault {name}: {summary['verdict']} {summary['problems']}")
    sys.stdout.flush()
    return res
