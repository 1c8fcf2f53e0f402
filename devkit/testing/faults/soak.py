# SPDX-License-Identifier: Apache-2.0
"""The soak: many requests through a running pair, some aborted by their client, some
hit by an injected fault, bounded in time; then the audit (no block in use, every
connector table back to its warm-up size) and a summary per kind of trouble.

Kinds (drawn per request, weights in :data:`KINDS`):

* ``none``: a plain request; must succeed with the single engine's output;
* ``abort``: the client goes away at a random moment (0-1.5 s in);
* ``drop-reg``: D's PUSH_REG is lost;
* ``dup-reg``: D's PUSH_REG arrives twice (must succeed);
* ``late-reg``: D's PUSH_REG leaves 2 s late, within P's lease (must succeed);
* ``stall-write``: P's writer stalls 1.5 s before posting the WRITE (must succeed).

Every request has a prompt of its own (no two share a prefix), so KV that lands in
another request's blocks changes that request's output; every success is compared
with a single engine's output for its prompt, computed on D alone before the soak.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from devkit.testing.faults import client
from devkit.testing.faults.audit import first_difference, grown_tables, wait_idle
from devkit.testing.faults.context import Ctx
from devkit.testing.faults.pair import ROLES

KINDS: dict[str, float] = {
    "none": 0.65,
    "abort": 0.1,
    "drop-reg": 0.05,
    "dup-reg": 0.07,
    "late-reg": 0.06,
    "stall-write": 0.07,
}
#: kinds whose requests must succeed
MUST_SUCCEED = ("none", "dup-reg", "late-reg", "stall-write")
PROMPT_LENS = (1, 100, 128, 300, 700, 1300, 2000, 3000)
MAX_TOKENS = 10


class _Rules:
    """The soak's live rules per engine (one file each, rewritten on every change)."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        self._rules: dict[str, dict[str, dict[str, Any]]] = {r: {} for r in ROLES}

    def add(self, role: str, rule: dict[str, Any]) -> None:
        with self._lock:
            self._rules[role][rule["id"]] = rule
            self.ctx.pair.rules(role, list(self._rules[role].values()))

    def remove(self, role: str, rule_id: str) -> None:
        with self._lock:
            if self._rules[role].pop(rule_id, None) is not None:
                self.ctx.pair.rules(role, list(self._rules[role].values()))


def _rule_for(kind: str, rid: str) -> tuple[str, dict[str, Any]] | None:
    reg = {"on": "send", "prefix": "PUSH_REG:", "match": rid, "id": f"{kind}-{rid}"}
    if kind == "drop-reg":
        return "decode", {**reg, "action": "drop"}
    if kind == "dup-reg":
        return "decode", {**reg, "action": "dup"}
    if kind == "late-reg":
        return "decode", {**reg, "action": "delay", "delay_s": 2.0}
    if kind == "stall-write":
        return "prefill", {"id": f"{kind}-{rid}", "on": "transfer", "match": rid,
                           "action": "stall", "delay_s": 1.5}  # fmt: skip
    return None


def soak(
    ctx: Ctx,
    n: int,
    concurrency: int = 3,
    seed: int = 0,
    time_bound_s: float = 3600.0,
    kinds: dict[str, float] | None = None,
) -> dict[str, Any]:
    kinds = kinds or KINDS
    rng = random.Random(seed)
    # the plan, and each request's reference (D alone, before any fault of the soak)
    plan = []
    t_refs = time.monotonic()
    for _ in range(n):
        kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
        length = rng.choice(PROMPT_LENS)
        abort_after = rng.uniform(0.0, 1.5)
        prompt_seed = ctx.new_seed()
        plan.append((kind, length, abort_after, prompt_seed,
                     ctx.ref(length, prompt_seed, MAX_TOKENS)))  # fmt: skip
    probe_seed = ctx.new_seed()
    probe_ref = ctx.ref(300, probe_seed, MAX_TOKENS)
    refs_s = time.monotonic() - t_refs
    rules = _Rules(ctx)
    records: list[dict[str, Any]] = []
    t_start = time.monotonic()
    deadline = t_start + time_bound_s

    def one(i: int) -> None:
        if time.monotonic() > deadline:
            return
        kind, length, abort_after, prompt_seed, want = plan[i]
        rid = client.new_rid(f"s{i}")
        call = client.via_proxy(ctx.pair.url, ctx.prompt(length, prompt_seed), MAX_TOKENS, rid)
        rule = _rule_for(kind, rid)
        if rule is not None:
            rules.add(*rule)
        call.start()
        if kind == "abort" and not call.first_token.wait(abort_after) and not call.done:
            call.abort()
        o = call.result()
        if rule is not None:
            rules.remove(rule[0], rule[1]["id"])
        wrong = o.ok and o.token_ids != want
        records.append({
            "i": i, "kind": kind, "len": length, "outcome": o.kind, "status": o.status,
            "elapsed": o.elapsed, "message": o.message[:200], "wrong": wrong, "rid": rid,
            **({"got": o.token_ids, "want": want,
                "first_differing_token": first_difference(o.token_ids, want)} if wrong else {}),
        })  # fmt: skip

    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(one, range(n)))
    issued_s = time.monotonic() - t_start
    settle_deadline = time.monotonic() + ctx.settle_s
    freed = {}
    leaked = {}
    for role in ROLES:
        t0 = time.monotonic()
        took, blocks = wait_idle(ctx.pair, role, settle_deadline, t0)
        freed[role], leaked[role] = took, blocks
    idle = {r: ctx.pair.tables(r) for r in ROLES}
    probe = client.via_proxy(ctx.pair.url, ctx.prompt(300, probe_seed), MAX_TOKENS).start()
    probe_ok = probe.result().ok and probe.outcome.token_ids == probe_ref
    time.sleep(2)
    grown = {
        r: grown_tables(ctx.base_tables.get(r, {}), idle[r], ctx.pair.tables(r)) for r in ROLES
    }
    return {
        "requests": len(records),
        "asked": n,
        "concurrency": concurrency,
        "wall_s": round(issued_s, 1),
        "references_s": round(refs_s, 1),
        "rows": summarize(records),
        "leaked_blocks": leaked,
        "settle_s": {r: (round(v, 1) if v is not None else None) for r, v in freed.items()},
        "tables_grown": grown,
        "serves_after": probe_ok,
        "failures": [r for r in records if _bad(r)][:20],
        "clean": not any(leaked.values())
        and not any(grown.values())
        and probe_ok
        and not any(_bad(r) for r in records),
    }


def _bad(r: dict[str, Any]) -> bool:
    if r["wrong"]:
        return True
    return r["kind"] in MUST_SUCCEED and r["outcome"] != "ok"


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for kind in sorted({r["kind"] for r in records}):
        mine = [r for r in records if r["kind"] == kind]
        errors = [r for r in mine if r["outcome"] in ("error", "exception")]
        times = [r["elapsed"] for r in errors]
        rows.append({
            "kind": kind,
            "requests": len(mine),
            "ok": sum(r["outcome"] == "ok" for r in mine),
            "errors": len(errors),
            "aborted": sum(r["outcome"] == "aborted" for r in mine),
            "wrong": sum(r["wrong"] for r in mine),
            "time_to_error_p50": round(statistics.median(times), 1) if times else None,
            "time_to_error_max": round(max(times), 1) if times else None,
            "statuses": sorted({r["status"] for r in errors if r["status"]}),
        })  # fmt: skip
    return rows
