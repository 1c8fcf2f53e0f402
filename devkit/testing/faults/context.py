# SPDX-License-Identifier: Apache-2.0
"""What every fault scenario shares: :class:`Ctx` (the running pair, reference outputs,
warm-up tables, bounds, the end of a fault) and the small helpers the scenarios call.

Every request gets a prompt of its own (a seed per request, :meth:`Ctx.new_seed`):
no two requests share a prompt or a prefix, so KV written into another request's
blocks changes that request's output instead of copying equal bytes. Its reference,
a single engine's greedy output, is computed on D alone when the request is made,
before the fault where the request precedes it."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from devkit.testing.faults import client
from devkit.testing.faults.audit import (
    FaultResult,
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
        res.alive = {r: pair.alive(r) and healthy(pair, r) for r in ROLES}
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
        res.alive[role] = self.pair.alive(role) and healthy(self.pair, role)
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


def healthy(pair: FaultPair, role: str) -> bool:
    from devkit.launch.http import http_alive

    return http_alive(pair.engine_url(role))


def fault_result(ctx: Ctx, fault: str, about: str, expect: str = "error") -> FaultResult:
    return FaultResult(fault, ctx.stack.name, ctx.net, about=about, expect=expect)


def reg_rule(rid: str, action: str, **kw: Any) -> dict[str, Any]:
    return {"id": f"{action}-{rid}", "on": "send", "prefix": "PUSH_REG:", "match": rid,
            "action": action, **kw}  # fmt: skip


def wrote(ctx: Ctx, rid: str, since: float) -> bool:
    return any(e.get("ev") == "xfer_post" and rid in str(e.get("rid"))
               for e in ctx.pair.events("prefill", since))  # fmt: skip


def first_event_t(ctx: Ctx, role: str, rid: str, kind: str) -> float:
    for e in ctx.pair.events(role):
        if e.get("kind") == kind and rid in str(e.get("rid")):
            return float(e["t"])
    return float("nan")


def run_foreign(ctx: Ctx, role: str, args: list[str], timeout: float = 120) -> dict[str, Any]:
    """Run devkit.testing.faults.foreign against ``role``'s side channel."""
    pair = ctx.pair
    spec = pair.specs[role]
    out = pair.cfg.run_dir / f"foreign-{role}-{time.monotonic_ns()}.json"
    argv = [pair.cfg.python, "-m", "devkit.testing.faults.foreign",
            "--host", spec.side_channel_host, "--port", str(spec.side_channel_port),
            "--query", str(ctx.stack.side_channel_query), "--out", str(out), *args]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root()), env.get("PYTHONPATH")) if p)
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


def repo_root() -> Any:
    from devkit.testing.faults.pair import REPO_ROOT

    return REPO_ROOT
