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

The catalog is data: one :class:`Fault` row per fault (its name, the scenario that runs
it, what it breaks); the scenarios live beside it by what they break
(``protocol_faults``, ``request_faults``, ``peer_faults``, ``network_faults``) and
share :mod:`~devkit.testing.faults.context`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable

from devkit.testing.faults import network_faults as net
from devkit.testing.faults import peer_faults as peer
from devkit.testing.faults import protocol_faults as proto
from devkit.testing.faults import request_faults as req
from devkit.testing.faults.audit import (
    FaultResult,
)
from devkit.testing.faults.context import Ctx, healthy
from devkit.testing.faults.pair import ROLES


@dataclasses.dataclass(frozen=True)
class Fault:
    """One row of the catalog."""

    name: str
    #: the scenario: injects the failure on ``ctx.pair``, runs the audit
    run: Callable[[Ctx], FaultResult]
    #: what it breaks: ``messages``, ``requests``, ``network`` or ``peers``
    breaks: str


#: every fault, in run order (the destructive ones last: they restart an engine)
CATALOG: tuple[Fault, ...] = (
    Fault("push-reg-duplicate", proto.push_reg_duplicate, "messages"),
    Fault("push-reg-duplicate-late", proto.push_reg_duplicate_late, "messages"),
    Fault("push-reg-dropped", proto.push_reg_dropped, "messages"),
    Fault("push-reg-after-lease", proto.push_reg_after_lease, "messages"),
    Fault("handshake-refused-d-to-p", proto.handshake_refused_d_to_p, "messages"),
    Fault("handshake-refused-p-to-d", proto.handshake_refused_p_to_d, "messages"),
    Fault("client-abort-prefill", req.client_abort_prefill, "requests"),
    Fault("client-abort-decode", req.client_abort_decode, "requests"),
    Fault("abort-p-leg", req.abort_p_leg, "requests"),
    Fault("abort-d-leg", req.abort_d_leg, "requests"),
    Fault("d-out-of-blocks", req.d_out_of_blocks, "requests"),
    Fault("link-cut-short", net.link_cut_short, "network"),
    Fault("link-cut-long", net.link_cut_long, "network"),
    Fault("link-cut-stale-write", net.link_cut_stale_write, "network"),
    Fault("forged-completion", proto.forged_completion, "messages"),
    Fault("notif-flood", proto.notif_flood, "messages"),
    Fault("kill-p-before-write", peer.kill_p_before_write, "peers"),
    Fault("kill-d-mid-write", peer.kill_d_mid_write, "peers"),
    Fault("p-hangs-mid-write", peer.p_hangs_mid_write, "peers"),
)
#: name -> scenario, in run order
FAULTS: dict[str, Callable[[Ctx], FaultResult]] = {f.name: f.run for f in CATALOG}


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
        dead = not ctx.pair.alive(role) or not healthy(ctx.pair, role)
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
