# SPDX-License-Identifier: Apache-2.0
"""What every fault is judged by, and the record of one fault's run.

After a fault, :func:`audit` checks on the surviving engine(s):

1. every request the fault hit ended within the bound (an HTTP error with the
   proxy's message, or a success), and when; the bound counts from the fault's end
   where it lasts (a partition, a stopped process). Every success, whatever the fault
   expects, must carry a single engine's greedy output (``references``): a wrong
   HTTP 200 is a problem that names the request and its first differing token; a
   success where the fault expects an error is allowed only with the right tokens
   ("served");
2. KV blocks in use return to zero (``vllm:kv_cache_usage_perc``), and when;
3. the connector tables (:mod:`~devkit.testing.faults.introspect`) are back to
   their size at warm-up, once idle and after one more request;
4. the requests in flight that the fault did not touch succeeded with a single
   engine's greedy output;
5. the pair serves a new request, with the single engine's output.

A run that cannot tell (the fault was not injected at its moment, the harness
failed, a check had no truth to compare with) is ``inconclusive``: a verdict of its
own, never "clean".
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from devkit.testing.faults.client import Outcome

#: Table leaves that are caches or counters, not per-request state: they may grow
#: with new peers or traffic without anything leaking.
NOT_PER_REQUEST = (
    "._totals", ".xfer_stats.data", "._malformed_counts", "._remote_agents", "._remote_layouts",
    "._remote_members", ".dst_num_blocks", "._engines", "._engine_last_active",
    "._engine_clock_offset", ".dst_xfer_side_handles", ".tp_mappings", ".push_counters._data",
    ".dst_region", "._engine_by_address", ".attn_backends", "._registered_descs",
    ".src_xfer_handles", ".dst_", ".kv_topo", "._layer_specs", "region_members",
    # ours after the lifecycle rewrite: per peer (layouts, agents), per drop reason, and
    # the recently-evicted memo that tells a late PUSH_REG and the tombstones of cancelled
    # registrations (both bounded in size and age: gone_ttl, RECENTLY_EVICTED_MAX)
    ".layouts._remote", ".layouts._announced", ".peers._agents", ".drops._counts",
    ".rendezvous._gone", ".rendezvous._cancelled", "._unreachable",
    # P-made leg ids by client body, 60 s and MAX_BODIES at most (answer.SequentialLegIds)
    "._made_ids._bodies",
    # per peer address, each entry dropped when its back-off ends or the peer answers
    "._handshake_failed",
    # per D engine that ever sent an authenticated PUSH_REG (S-LEG-3)
    "._secured_engines",
)  # fmt: skip


@dataclasses.dataclass
class FaultResult:
    fault: str
    stack: str
    net: str
    about: str = ""
    #: False: the fault cannot be injected in this setting (``note`` says why)
    applies: bool = True
    note: str = ""
    #: what the affected requests should do: "error" or "ok" (e.g. a duplicate PUSH_REG);
    #: a success where "error" is expected is allowed with a single engine's output
    expect: str = "error"
    #: why this run cannot tell whether the fault is handled (the fault was not injected
    #: at its moment, a harness error, ...); non-empty: the verdict is "inconclusive"
    inconclusive: str = ""
    t_fault: float = 0.0
    #: when the fault ended (link restored, process continued); 0: when it was injected
    t_fault_end: float = 0.0
    #: the fault keeps its partition until the request it hit has ended, so a 504 is
    #: not judged there (D ends such a request at its deadline, N-LIV-1; a fault that
    #: needs D's error asserts it: link-cut-stale-write; link-cut-long shows how soon a
    #: request ends once the link is back)
    outlasts_request: bool = False
    #: seconds from the fault's end to the first request served right (None: not seen)
    recovered_s: float | None = None
    affected: list[Outcome] = dataclasses.field(default_factory=list)
    bystanders: list[Outcome] = dataclasses.field(default_factory=list)
    #: a single engine's greedy output per request id, for every affected request and
    #: bystander that returned tokens (a success without one is a problem)
    references: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    #: wrong outputs a fault found itself, beyond its affected requests and bystanders
    #: (rid: {"first_differing_token": i, ...})
    wrong: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: what a fault saw go wrong beyond the checks here (e.g. a stale WRITE landing in
    #: blocks D gave to another request): each one is a problem
    violations: list[str] = dataclasses.field(default_factory=list)
    #: seconds from the fault until the engine held no block (None: not within the bound)
    freed_s: dict[str, float | None] = dataclasses.field(default_factory=dict)
    #: blocks still in use at the end of the bound
    leaked_blocks: dict[str, int] = dataclasses.field(default_factory=dict)
    #: per-request tables larger than at warm-up: {role: {path: [warm-up, idle, after probe]}}
    tables_grown: dict[str, dict[str, list[int]]] = dataclasses.field(default_factory=dict)
    serves_after: bool | None = None
    restart: dict[str, Any] | None = None
    alive: dict[str, bool] = dataclasses.field(default_factory=dict)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    wall_s: float = 0.0

    # -- judgement ------------------------------------------------------------------------
    def times_to_end(self) -> list[float]:
        return [o.t1 - self.t_fault for o in self.affected if o.t1]

    def wrong_outputs(self) -> dict[str, dict[str, Any]]:
        """Requests whose tokens differ from a single engine's: every success, and the
        tokens an ended stream got before its end (they must start the reference)."""
        out: dict[str, dict[str, Any]] = {}
        for who, outcomes in (("affected", self.affected), ("bystander", self.bystanders)):
            for o in outcomes:
                want = self.references.get(o.rid)
                if want is None or not (o.ok or o.token_ids):
                    continue
                expected = want if o.ok else want[: len(o.token_ids)]
                if o.token_ids != expected:
                    out[o.rid] = {"who": who, "status": o.status, "kind": o.kind,
                                  "first_differing_token": first_difference(o.token_ids, want),
                                  "got": list(o.token_ids), "want": list(want)}  # fmt: skip
        for rid, w in self.wrong.items():
            out.setdefault(rid, {"who": "other", **w})
        return out

    def served_right(self) -> list[Outcome]:
        """Affected requests served with a single engine's output."""
        return [o for o in self.affected
                if o.ok and o.token_ids == self.references.get(o.rid)]  # fmt: skip

    def problems(self, bound_s: float) -> list[str]:
        out: list[str] = []
        # a wrong output is a problem whatever the fault and whether it applies
        out.extend(self.violations)
        for rid, w in self.wrong_outputs().items():
            what = "HTTP 200" if w.get("kind", "ok") == "ok" else f"{w.get('kind')} stream"
            got, want = w.get("got"), w.get("want")
            sizes = f" ({len(got)} tokens, {len(want)} expected)" if got and want else ""
            out.append(f"{w['who']} request {rid}: {what} with tokens differing from a single "
                       f"engine's from token {w.get('first_differing_token')}{sizes}")  # fmt: skip
        if not self.applies:
            return out
        for who, outcomes in (("affected", self.affected), ("bystander", self.bystanders)):
            for o in outcomes:
                if o.ok and o.rid not in self.references:
                    out.append(f"{who} request {o.rid} succeeded, with no reference output to "
                               "compare it with")  # fmt: skip
        for o in self.affected:
            if o.kind == "aborted":
                continue
            took = o.t1 - self.t_fault
            # A fault that lasts (a partition, a stopped process) is judged from its end:
            # under S-SAFE-1 D cannot end a request whose P cannot answer before that.
            after_end = o.t1 - max(self.t_fault, self.t_fault_end)
            if self.expect == "ok" and not o.ok:
                out.append(f"request {o.rid} failed ({o.status}: {o.message[:80]})")
            proxy_bound = o.status == 504 and not self.outlasts_request
            if not o.ok and (proxy_bound or after_end > bound_s):
                out.append(f"request ended only after {took:.0f}s ({o.status})")
        for o in self.bystanders:
            if not o.ok:
                out.append(f"bystander {o.rid} failed ({o.status}: {o.message[:60]})")
        for role, n in self.leaked_blocks.items():
            if n:
                out.append(f"{n} KV blocks leaked on {role}")
        for role, grown in self.tables_grown.items():
            if grown:
                out.append(f"{role} tables not empty: {', '.join(sorted(grown))[:200]}")
        for role, up in self.alive.items():
            if not up:
                out.append(f"{role} engine died")
        if self.serves_after is False:
            out.append("pair does not serve afterwards")
        if self.restart is not None and not self.restart.get("picked_up"):
            out.append(f"restarted {self.restart.get('role')} not picked up")
        return out

    def verdict(self, bound_s: float) -> str:
        """One of FAIL (any problem), n/a (not injectable here), inconclusive (the run
        cannot tell) and clean."""
        if self.problems(bound_s):
            return "FAIL"
        if not self.applies:
            return "n/a"
        return "inconclusive" if self.inconclusive else "clean"

    def summary(self, bound_s: float) -> dict[str, Any]:
        times = self.times_to_end()
        errors = [o for o in self.affected if not o.ok and o.kind != "aborted"]
        return {
            "fault": self.fault,
            "stack": self.stack,
            "net": self.net,
            "applies": self.applies,
            "note": self.note,
            "inconclusive": self.inconclusive,
            "expect": self.expect,
            "affected": len(self.affected),
            "affected_kinds": sorted({o.kind for o in self.affected}),
            "statuses": sorted({o.status for o in self.affected if o.status is not None}),
            "message": errors[0].message[:240] if errors else "",
            "time_to_end_p50": round(statistics.median(times), 2) if times else None,
            "time_to_end_max": round(max(times), 2) if times else None,
            "freed_s": {
                k: (round(v, 1) if v is not None else None) for k, v in self.freed_s.items()
            },  # fmt: skip
            "leaked_blocks": dict(self.leaked_blocks),
            "bystanders_ok": sum(o.ok for o in self.bystanders),
            "bystanders": len(self.bystanders),
            "wrong_outputs": len(self.wrong_outputs()),
            "served_right": len(self.served_right()),
            "serves_after": self.serves_after,
            "recovered_s": self.recovered_s,
            "restart": self.restart,
            "alive": dict(self.alive),
            "problems": self.problems(bound_s),
            "verdict": self.verdict(bound_s),
            "wall_s": round(self.wall_s, 1),
        }


def first_difference(got: list[int], want: list[int]) -> int:
    """Index of the first token where ``got`` departs from ``want`` (the shorter
    one's length if one starts the other)."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return min(len(got), len(want))


def per_request(path: str) -> bool:
    return not any(part in path for part in NOT_PER_REQUEST)


def grown_tables(
    base: dict[str, int], idle: dict[str, int], after: dict[str, int]
) -> dict[str, list[int]]:
    """Per-request tables still larger than at warm-up after the probe request."""
    out = {}
    for path, n in after.items():
        if per_request(path) and n > base.get(path, 0):
            out[path] = [base.get(path, 0), idle.get(path, -1), n]
    return out


def wait_idle(pair: Any, role: str, deadline: float, t_fault: float) -> tuple[float | None, int]:
    """Poll until the engine holds no block and runs nothing; (seconds since the fault
    when that happened or None, blocks in use at the end)."""
    blocks = -1
    while True:
        try:
            u = pair.usage(role)
            blocks = int(u["blocks"])
            if u["usage"] == 0 and not u["running"] and not u["waiting"]:
                return time.monotonic() - t_fault, 0
        except OSError:
            pass
        if time.monotonic() > deadline:
            return None, blocks
        time.sleep(0.5)
