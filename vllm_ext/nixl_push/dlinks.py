# SPDX-License-Identifier: Apache-2.0
"""P's links to the D ranks it writes into, on the writer thread: D's registrations
and cancels arriving, P's answers (``PUSH_FAIL``) and heartbeats (``PUSH_HB``) going
out, and the connections themselves (handshakes, a broken one removed and re-made,
NIXL requests NIXL would not release).

:class:`DLinks` talks to D; :class:`~vllm_ext.nixl_push.writes.Writes` (writes.py)
moves the WRITEs themselves. Two objects: ``Writes`` builds its ``DLinks`` and calls
it to reach D; ``DLinks`` asks of ``Writes`` only what :class:`WriteOwner` names
(start a WRITE that matched, give one up). Who may send what, and the
tombstones of cancelled registrations: docs/design.md ("Who may send what", "Which
blocks a WRITE may touch").
"""

from __future__ import annotations

import functools
import queue
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from vllm_ext import compat
from vllm_ext.log import get_logger
from vllm_ext.nixl_push.config import producer_lost_after_s
from vllm_ext.nixl_push.context import WriterContext
from vllm_ext.nixl_push.d_agents import DAgents
from vllm_ext.nixl_push.matching import Match, RegResult, RegWhere, Rendezvous
from vllm_ext.nixl_push.messages import Deferred, ReplyToD
from vllm_ext.nixl_push.send_lifecycle import PushSend, Write, WriteState, reg_key
from vllm_ext.nixl_push.wire import CANCELLED as CANCELLED_REASON
from vllm_ext.nixl_push.wire import (
    P_REGISTRATION_TTL_FRACTION,
    PushCancel,
    PushFailed,
    PushHeartbeat,
    PushRegistration,
)

logger = get_logger("vllm_ext.nixl_push.writes")

#: With no registration asking for heartbeats, look again this often (seconds).
HEARTBEAT_IDLE_CHECK_S = 1.0
#: A NIXL request NIXL would not release is retried after this, doubling up to the max.
STUCK_RETRY_FIRST_S = 0.01
STUCK_RETRY_MAX_S = 1.0


class DPeer(Protocol):
    """Where a D rank is (a PUSH_REG or a PUSH_CANCEL carries it)."""

    @property
    def engine_id(self) -> str: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def request_id(self) -> str: ...
    @property
    def reply_token(self) -> str | None: ...


class WriteOwner(Protocol):
    """What :class:`DLinks` asks of P's WRITEs (``writes.Writes``): start the WRITE of a
    registration that matched, and give one up (its D connection was lost)."""

    def start(self, m: Match, now: float) -> None: ...

    def give_up(self, send: PushSend, w: Write, reason: str, now: float) -> None: ...


class DLinks:
    """P's side of its links to D ranks (see the module docstring), beside
    :class:`~vllm_ext.nixl_push.writes.Writes`, which builds it and is its
    :class:`WriteOwner`. Every method runs on the writer thread."""

    def __init__(
        self,
        ctx: WriterContext,
        rendezvous: Rendezvous,
        writes: WriteOwner,
        deferred: queue.SimpleQueue[Deferred],
        wake: Callable[[], None],
    ) -> None:
        self.ctx = ctx
        self.rendezvous = rendezvous
        self._writes = writes
        self._deferred = deferred
        self._wake = wake
        self._ttl_s = ctx.config.push_registration_timeout_s * P_REGISTRATION_TTL_FRACTION
        self._next_heartbeat = 0.0
        #: NIXL requests given up on that NIXL would not release yet, retried with a
        #: back-off (never in a tight loop): handle -> (next try, current back-off, the
        #: WRITE whose D is told once it is released, if any)
        self._stuck: dict[Any, tuple[float, float, Write | None]] = {}
        #: D engines a WRITE or a notification (answer, PUSH_HB) failed to (a NIXL/UCX
        #: error): their agents are removed from NIXL once no WRITE to them is in flight,
        #: so the next request connects anew
        self._suspect: dict[str, str] = {}
        #: answers to D that failed to send, by D engine: sent once more after the heal
        self._undelivered: dict[str, list[tuple[DPeer, ReplyToD]]] = {}
        #: D engines a registration of which proved it belongs to its request (the leg's
        #: secret or transfer id): a registration from another agent never marks them for
        #: a reconnect (only a proven one reconnects them, writes._prepare)
        self._secured_engines: set[str] = set()
        #: D engines P connected to only to answer a PUSH_CANCEL it had no registration of
        self._answer_only: set[str] = set()
        #: the agents P connected for each D engine id and rank (d_agents.py)
        self.agents = DAgents()
        #: how long the rest of a WRITE NIXL reported failed may still land (N-REL-2)
        self.failed_lands_s = producer_lost_after_s(
            compat.effective_tcp_user_timeout_s(ctx.config.ucx_tcp_user_timeout_s)
        )

    # -- for Writes ------------------------------------------------------------------------
    def secure(self, engine_id: str) -> None:
        """A registration of ``engine_id`` proved it belongs to its request (S-LEG-3)."""
        self._secured_engines.add(engine_id)

    def secured(self, engine_id: str) -> bool:
        return engine_id in self._secured_engines

    def current(self, engine_id: str, tp_rank: int) -> str | None:
        """D's agent of that engine and rank P is connected to now; logs the proof that
        two D engines share the engine id the first time P sees it (d_agents.py)."""
        agent = self.ctx.peers.agent(engine_id, tp_rank)
        shared = self.agents.observe(engine_id, tp_rank, agent)
        if shared is not None:
            self.ctx.counters.inc("push_d_engine_ids_shared")
            logger.error("push: %s", shared.reason())
        return agent

    def reaches(self, engine_id: str, tp_rank: int, agent: str) -> bool:
        """``agent`` is D's agent of that engine and rank as P's handshakes learned it:
        the one P is connected to, or one P retired on a restart (still in NIXL)."""
        return self.current(engine_id, tp_rank) == agent or self.agents.reachable(
            engine_id, tp_rank, agent
        )

    def retire(self, engine_id: str, why: str) -> None:
        """Connect ``engine_id`` anew (a restart, S-FLT-1); its agents stay in NIXL (a
        WRITE of theirs may still run), and P still answers them (``reaches``)."""
        agents = self.ctx.peers.of(engine_id)
        if self.ctx.forget_peer(engine_id, why):
            self.agents.retire(engine_id, agents)

    def suspect(self, engine_id: str, why: str) -> None:
        """Something to ``engine_id`` failed: connect anew once nothing is in flight to it."""
        self._suspect.setdefault(engine_id, why)

    def _hold(self, handle: Any, w: Write | None) -> None:
        """NIXL would not release ``handle`` yet: retried with a back-off; ``w``'s D is
        told once NIXL did (``retry_stuck``)."""
        self._stuck[handle] = (0.0, STUCK_RETRY_FIRST_S, w)

    def release_stuck(self) -> None:
        """Shutdown: release what NIXL lets go of now."""
        self._stuck = {h: t for h, t in self._stuck.items() if not self.try_release(h)}

    def try_release(self, handle: Any) -> bool:
        try:
            self.ctx.nixl.release_xfer_handle(handle)
        except Exception as e:
            logger.debug("push: releasing a WRITE handle failed: %s", e)
            return False
        return True

    def ttl_of(self, reg: PushRegistration) -> float:
        """P keeps an unmatched PUSH_REG for a fraction of D's watchdog (ours if D did
        not say), so it gives up before D stops waiting."""
        timeout = reg.timeout_s or self.ctx.config.push_registration_timeout_s
        return min(self._ttl_s, timeout * P_REGISTRATION_TTL_FRACTION)

    # -- a WRITE's NIXL request that NIXL may not let go of -------------------------------
    def release(self, w: Write) -> bool:
        """Release ``w``'s NIXL request; False while NIXL runs its transfer (never
        released then: N-REL-1) or if NIXL refused (the caller decides). A request that
        is not in flight is retried later."""
        if w.handle is None:
            return True
        if w.running:
            return False
        if self.try_release(w.handle):
            w.handle = None
            return True
        if not w.in_flight:
            logger.warning("push: NIXL refused to release a WRITE handle; retrying later")
            self.let_go(w)
        return False

    def let_go(self, w: Write) -> None:
        """Stop waiting for ``w``'s NIXL request; release it as soon as NIXL allows.

        D is told that a WRITE NIXL may still be running has ended (PUSH_FAIL) only once
        NIXL reported it ended and released it (``retry_stuck``): until then D keeps
        its blocks, since the WRITE may still land in them (docs/design.md, "Which
        blocks a WRITE may touch"); P's stay held too (``LeaseClaims``)."""
        if w.handle is None:
            return
        in_flight = w.in_flight
        if in_flight:
            self.ctx.counters.inc("push_writes_unreleased")
            w.d_told = True  # held back: told once NIXL released it
        self._hold(w.handle, w if in_flight else None)
        w.handle = None

    def transfer_failed(self, p_request_id: str, w: Write, what: str) -> None:
        """NIXL reported a transfer of ``w`` failed (an ERR, at post or later, or an
        error status raised). That ends NIXL's record of it, not its bytes: NIXL's UCX
        backend reports a transfer's first failed request and leaves the others, on
        other workers' connections, running (N-REL-2). So it counts as in flight for
        ``failed_lands_s`` more (``Write.landing_until``): P's blocks stay claimed and
        D keeps its blocks (told at once that the request failed, with ``landing``; P's
        answer, the PUSH_FAIL, comes when that time is up)."""
        reg = w.registration
        self.suspect(reg.engine_id, f"a WRITE failed: {what}")
        if w.handle is not None and self.try_release(w.handle):  # NIXL ended it
            w.handle = None
        if w.handle is not None:  # NIXL kept it: released when it lets us
            self._hold(w.handle, None)
            w.handle = None
        lands_s = self.failed_lands_s if self.failed_lands_s >= 0 else float("inf")
        logger.error(
            "push: %s of %s -> %s; P and D keep its blocks %gs more (its rest may still "
            "land)", what, p_request_id, reg.request_id, lands_s,
        )  # fmt: skip
        w.failed_landing(what, time.monotonic() + lands_s)
        self.notify_landing(w, what)

    def expire_registrations(self, now: float) -> None:
        """Drop the PUSH_REGs no P request came for in time (``ttl_of``), and tell D."""
        for p in self.rendezvous.expire(now, self.ttl_of):
            self.ctx.counters.inc("push_regs_expired")
            why = (
                "the P request that awaited it ended without its KV" if p.renewed
                else f"it waited {self.ttl_of(p.registration):.0f}s for its blocks"
            )  # fmt: skip
            logger.warning(
                "push: PUSH_REG for %s from %s dropped: %s",
                p.registration.request_id, p.registration.engine_id, why,
            )  # fmt: skip
            # Tell D now (S-FAIL-4) rather than leaving it to its watchdog.
            reason = "P has no request for this registration"
            self.reply(p.registration, p.sender, reason, "expiry answer")

    # -- from D ---------------------------------------------------------------------------
    def on_registration(self, reg: PushRegistration, sender: str) -> None:
        counters = self.ctx.counters
        counters.inc("push_regs_received")
        # A PUSH_REG from an agent other than the one P knows for that D engine and rank
        # makes P forget nothing here: only a registration that proves it belongs to the
        # P request it matched may connect the engine anew (_prepare, S-LEG-3).
        now = time.monotonic()
        out = self.rendezvous.add_registration(reg, sender, now, self.ttl_of(reg))
        if out.result is RegResult.MATCHED:
            assert out.match is not None
            self._writes.start(out.match, now)
        elif out.result is RegResult.STORED:
            # Connect to D now, while P is still prefilling: the WRITE then fires
            # the moment the blocks are finished instead of after a handshake.
            self.handshake(reg)
            if reg.heartbeat_s is not None:
                self._next_heartbeat = min(self._next_heartbeat, now + reg.heartbeat_s / 2)
        elif out.result is RegResult.DUPLICATE:
            counters.inc("push_regs_duplicate")
        elif out.result is RegResult.TAKEN:
            counters.inc("push_regs_taken")
            logger.warning(
                "push: PUSH_REG for %s rank %d met a P request that serves another request "
                "of D %s rank %d; refused", reg.request_id, reg.tp_rank, reg.engine_id,
                reg.tp_rank,
            )  # fmt: skip
            self.reply(reg, sender, "P serves another request of this D rank under these ids",
                        "taken")  # fmt: skip
        elif out.result is RegResult.CANCELLED:
            counters.inc("push_regs_after_cancel")
            logger.warning(
                "push: PUSH_REG for %s rank %d arrived after D cancelled it (or P "
                "answered it); dropped",
                reg.request_id, reg.tp_rank,
            )  # fmt: skip
        elif out.result is RegResult.UNAUTHORIZED:
            counters.inc("push_regs_unauthorized")
            logger.warning(
                "push: PUSH_REG for %s rank %d from agent %s lacks its transfer's secret; "
                "dropped", reg.request_id, reg.tp_rank, sender,
            )  # fmt: skip
        elif out.result is RegResult.MISMATCHED:
            self.refuse_prompt(reg, sender, None)
        elif out.result is RegResult.FOREIGN:
            counters.inc("push_notifs_foreign")
            logger.warning(
                "push: PUSH_REG for %s rank %d from agent %s dropped: another agent "
                "registered it", reg.request_id, reg.tp_rank, sender,
            )  # fmt: skip
        else:  # LATE: P released the blocks it would have written
            counters.inc("push_regs_late")
            logger.warning(
                "push: PUSH_REG for %s arrived after P released its KV; telling D",
                reg.request_id,
            )
            self.reply(reg, sender, "P released the KV first", "late")

    def refuse_prompt(self, reg: PushRegistration, sender: str, send: PushSend | None) -> None:
        """S-WRT-7: the P request ``reg`` met by its ids holds another prompt (ids that
        collide, or P and D tokenize differently): never written; D is told."""
        self.ctx.counters.inc("push_regs_prompt_mismatch")
        theirs = f"{send.prompt.tokens} tokens" if send is not None and send.prompt else "?"
        logger.warning(
            "push: PUSH_REG for %s (transfer %s) met a P request with another prompt "
            "(D: %s tokens, P: %s); refused", reg.request_id, reg.transfer_id,
            reg.prompt.tokens if reg.prompt else "?", theirs,
        )  # fmt: skip
        why = (
            "P holds another prompt under this request's ids (if both legs came from one "
            "body: P and D rendered or tokenized it differently, e.g. another --tokenizer, "
            "or a chat template that renders the date in different time zones)"
        )
        self.reply(reg, sender, why, "mismatch")

    def on_cancel(self, c: PushCancel, sender: str) -> None:
        """D aborted a request. Drop its registration unless a WRITE already started
        (that WRITE's completion or PUSH_FAIL answers); accepted only from the agent
        that registered it (or, for one P no longer knows, D's agent of that rank)."""
        key = (c.engine_id, c.request_id, c.tp_rank)
        where, registered_by = self.rendezvous.find_registration(key)
        owner = registered_by or self.current(c.engine_id, c.tp_rank)
        if registered_by is None and self.agents.reachable(c.engine_id, c.tp_rank, sender):
            # an agent of that engine and rank P retired on a restart (or another engine
            # under its engine id): its handshake proved it is D's, and it is answered
            owner = sender
        if owner is not None and owner != sender:
            self.ctx.counters.inc("push_notifs_foreign")
            logger.warning(
                "push: PUSH_CANCEL for %s rank %d from agent %s dropped (registered by %s)",
                c.request_id, c.tp_rank, sender, owner,
            )  # fmt: skip
            return
        # A tombstone: a duplicated or reordered PUSH_REG of it arriving later (its
        # blocks are D's to reuse) is never stored nor served. Verified when the sender
        # is the agent that registered it or D's agent of that rank (owner == sender).
        self.rendezvous.remember_cancelled(key, sender, time.monotonic(), owner is not None)
        if any(w is not None and w.key == key for _, _, w in self._stuck.values()):
            # its WRITE was given up on but NIXL has not released it: D hears of it
            # (PUSH_FAIL) once NIXL did, not now (the WRITE may still land)
            self.ctx.counters.inc("push_cancels_received")
            return
        if owner is None:
            # Neither its PUSH_REG nor D's agent is known here (the cancel overtook the
            # registration, or it never came): the tombstone refuses the PUSH_REG; D is
            # answered after a handshake with the address it gave (only if the sender
            # is that D's agent, send_to_d), since it keeps the blocks until answered.
            # That connection serves the answer only: any peer may send a cancel naming
            # any engine and address, so P forgets it once answered (send_to_d) unless
            # a registration of that engine came meanwhile.
            self.ctx.counters.inc("push_cancels_before_registration")
            self._answer_only.add(c.engine_id)
            self.reply(
                c,
                sender,
                CANCELLED_REASON,
                "cancel answer",
            )
            return
        self.ctx.counters.inc("push_cancels_received")
        if where is RegWhere.PENDING:
            self.rendezvous.drop_registration(key)
        if where is not RegWhere.SERVED:
            self.reply(
                c,
                sender,
                CANCELLED_REASON,
                "cancel answer",
            )

    def heartbeat(self, now: float) -> None:
        """Renew D's watchdog for the registrations P will serve: those a live P request
        (queued, prefilling) awaits, and those being written, each at most every
        ``heartbeat_s`` (D's ask). Never for a registration P merely holds: its P leg
        may be lost, and D's watchdog must end it."""
        if now < self._next_heartbeat:
            return
        period = HEARTBEAT_IDLE_CHECK_S
        # (agent, engine): [(D request id, its reply token, what it renews)]
        due: dict[tuple[str, str], list[tuple[str, str, Any]]] = defaultdict(list)

        def consider(reg: PushRegistration, sender: str, renewed_at: float, renews: Any) -> None:
            nonlocal period
            if reg.heartbeat_s is None:
                return  # an older D: it would drop PUSH_HB as malformed
            period = min(period, reg.heartbeat_s / 2)
            if now - renewed_at < reg.heartbeat_s:
                return
            if self.ctx.peers.agent(reg.engine_id, reg.tp_rank) != sender:
                return  # not connected yet (P connects on arrival)
            item = (reg.request_id, reg.reply_token or "", renews)
            due[(sender, reg.engine_id)].append(item)

        for p in self.rendezvous.awaited():
            consider(p.registration, p.sender, p.since, p)  # awaited: kept past P's TTL too
        for send in self.rendezvous.serving():
            for w in send.active:
                consider(w.registration, w.sender, w.renewed_at, w)
        for (agent, engine_id), items in due.items():
            try:
                rids, tokens, renewed = zip(*items)
                self.ctx.nixl.send_notif(agent, notif_msg=PushHeartbeat(rids, tokens).encode())
                self.ctx.counters.inc("push_heartbeats_sent")
                # renewed only once the heartbeat went out: a registration P keeps
                # while D cannot hear of it would outlive what D counts on
                for r in renewed:
                    if isinstance(r, Write):
                        r.renewed_at = now
                    else:
                        r.since, r.renewed = now, True
            except Exception as e:
                # The endpoint may have failed for good (a partition): connect anew once
                # no WRITE to that D runs, so the first request after the link is back
                # is served (S-FLT-2), not failed by the old endpoint.
                self.ctx.counters.inc("push_failed_send_notif")
                logger.debug("push: PUSH_HB to %s not sent: %s", agent, e)
                self._suspect.setdefault(engine_id, f"PUSH_HB not sent: {e}")
        self._next_heartbeat = now + period

    def retry_stuck(self, now: float) -> None:
        """Release the NIXL requests given up on, each retried with a doubling back-off;
        one NIXL may still run only once it reported it ended (never by a release:
        N-REL-1)."""
        if not self._stuck:
            return
        for handle, (due, backoff, w) in list(self._stuck.items()):
            if now < due:
                continue
            if w is not None and w.running:
                if self._still_running(handle):
                    self._stuck[handle] = (now + backoff, min(2 * backoff, STUCK_RETRY_MAX_S), w)
                    continue
                self.transfer_ended(w)
            if self.try_release(handle):
                del self._stuck[handle]
                if w is not None:  # NIXL no longer runs it: now D may let its blocks go
                    w.d_told = False
                    self.tell_d(w, w.failure or "WRITE abandoned")
            else:
                self._stuck[handle] = (now + backoff, min(2 * backoff, STUCK_RETRY_MAX_S), w)

    def transfer_ended(self, w: Write) -> None:
        """NIXL reported the transfer of ``w.handle`` ended: P's blocks are no longer
        read by it (``LeaseClaims``)."""
        if w.running:
            w.running = False
            self.ctx.claims.end_write(w.p_request_id)

    def _still_running(self, handle: Any) -> bool:
        """NIXL reports the transfer of ``handle`` in progress (an error status, raised
        or returned, is its end)."""
        try:
            return bool(self.ctx.nixl.check_xfer_state(handle) == "PROC")
        except Exception:
            return False

    def _in_use(self, engine_id: str) -> bool:
        """A registration of ``engine_id`` waits, or a WRITE to it is not over."""
        return any(
            r.engine_id == engine_id for r in self.rendezvous.pending_registrations()
        ) or any(
            w.registration.engine_id == engine_id
            for s in self.rendezvous.serving()
            for w in s.writes
            if not w.state.final
        )

    def heal_suspects(self) -> None:
        """A D a WRITE failed to is removed from NIXL once no WRITE to it is in flight:
        its broken endpoints go with it, and the next request to it handshakes anew."""
        if not self._suspect:
            return
        busy = {  # (a failed WRITE whose rest may land has no handle: removing D's
            # agents neither stops it nor touches it, N-REL-2)
            w.registration.engine_id
            for s in self.rendezvous.serving()
            for w in s.active
            if (w.in_flight or w.running) and w.landing_until is None
        }
        # a WRITE NIXL has not released yet: its D is told once it is (needs the agent)
        busy |= {w.registration.engine_id for _, _, w in self._stuck.values() if w is not None}
        for engine_id in [e for e in self._suspect if e not in busy]:
            why = self._suspect.pop(engine_id)
            if self.ctx.forget_peer(engine_id, why, True):
                self.ctx.counters.inc("push_peers_healed")
            self._end_unwritten(engine_id, why)
            for peer, item in self._undelivered.pop(engine_id, ()):
                fut = self.handshake(peer)  # once; a second failure is only counted
                if fut is None:
                    self.send_to_d(item)
                else:
                    fut.add_done_callback(functools.partial(self._after_reply_handshake, item))

    def _end_unwritten(self, engine_id: str, why: str) -> None:
        """P dropped its connection to D ``engine_id`` (UCX declared it failed): D may
        have counted P gone meanwhile (N-LIV-1) and reused the blocks it registered, so
        nothing not yet posted to it is written. Its waiting registrations end and are
        answered (over a new connection, D keeps the blocks until answered or P is
        gone); its WRITEs not posted yet are given up (D told once connected)."""
        reason = f"P lost its connection to D ({why})"
        for key in self.rendezvous.pending_keys_of(engine_id):
            pending = self.rendezvous.drop_registration(key)
            if pending is not None:
                self.ctx.counters.inc("push_regs_ended_on_heal")
                self.reply(pending.registration, pending.sender, reason, "PUSH_FAIL (heal)")
        now = time.monotonic()
        for send in self.rendezvous.serving():
            for w in list(send.active):
                unposted = w.state in (WriteState.CONNECTING, WriteState.ARMED)
                if w.registration.engine_id == engine_id and unposted:
                    self.ctx.counters.inc("push_regs_ended_on_heal")
                    self._writes.give_up(send, w, reason, now)

    def tell_d(self, w: Write, reason: str) -> None:
        """S-FAIL-4: let D fail the request now instead of waiting out its watchdog."""
        if w.d_told:
            return
        reg = w.registration
        agent = self.current(reg.engine_id, reg.tp_rank)
        if w.landing_until is not None and agent is None:
            # D was healed away while the rest of its failed WRITE could land: connect
            # anew to answer (D keeps the blocks until then)
            w.d_told = True
            self.reply(reg, w.sender, reason, "PUSH_FAIL")
            return
        if not self.reaches(reg.engine_id, reg.tp_rank, w.sender):
            return  # not connected (yet): told once connected, see on_deferred
        w.d_told = True
        notif = PushFailed(reg.request_id, reason, reg.reply_token).encode()
        self.send_to_d(ReplyToD(reg.engine_id, reg.tp_rank, w.sender, notif, "PUSH_FAIL"), reg)

    def notify_landing(self, w: Write, reason: str) -> None:
        """Tell D that ``w`` failed while its rest may still land (N-REL-2): D fails
        the request now and keeps its blocks until P's answer (``tell_d``)."""
        reg = w.registration
        if not self.reaches(reg.engine_id, reg.tp_rank, w.sender):
            return  # not connected: D learns it from P's answer
        notif = PushFailed(reg.request_id, reason, reg.reply_token, landing=True).encode()
        item = ReplyToD(reg.engine_id, reg.tp_rank, w.sender, notif, "PUSH_FAIL notice")
        self.send_to_d(item)

    def reply(self, peer: DPeer, sender: str, reason: str, what: str) -> None:
        """Answer a D rank's registration or cancel ``peer`` with a PUSH_FAIL carrying its
        reply token (S-WIR-3), after a handshake with it if there was none."""
        msg = PushFailed(peer.request_id, reason, peer.reply_token)
        item = ReplyToD(peer.engine_id, peer.tp_rank, sender, msg.encode(), what)
        if isinstance(peer, PushRegistration):
            # D lets the blocks go on this answer: a duplicate of the PUSH_REG the
            # network delivers later is never stored nor served (a P leg that came
            # after P's expiry answer wrote into blocks D had freed: the model check)
            verified = self.reaches(peer.engine_id, peer.tp_rank, sender)
            self.rendezvous.remember_answered(reg_key(peer), sender, time.monotonic(), verified)
        if self.current(peer.engine_id, peer.tp_rank) is None and not self.agents.reachable(
            peer.engine_id, peer.tp_rank, sender
        ):
            fut = self.handshake(peer)
            if fut is not None:
                fut.add_done_callback(functools.partial(self._after_reply_handshake, item))
                return
        self.send_to_d(item, peer)

    def _after_reply_handshake(self, item: ReplyToD, fut: Future) -> None:
        # (a failed handshake too: the writer then finds no agent, drops the answer and
        # forgets that the connection was for an answer only)
        self._deferred.put(item)
        self._wake()

    def send_to_d(self, item: ReplyToD, peer: DPeer | None = None) -> None:
        """To the agent ``item.sender`` only, and only if it is D's agent of that rank.
        If the send fails, D's endpoint may have failed for good (a partition): D is
        removed from NIXL once nothing is in flight to it (S-FLT-2), and an answer to a
        known ``peer`` is sent once more over the new connection, so that D need not
        wait for its watchdog."""
        answer_only = item.engine_id in self._answer_only
        self._answer_only.discard(item.engine_id)  # whatever comes of this answer
        agent = self.current(item.engine_id, item.tp_rank)
        retired = agent != item.sender and self.agents.reachable(
            item.engine_id, item.tp_rank, item.sender
        )
        if agent != item.sender and not retired:
            logger.warning("push: %s for %s rank %d not sent: no agent",
                           item.what, item.engine_id, item.tp_rank)  # fmt: skip
            return
        try:
            self.ctx.nixl.send_notif(item.sender, notif_msg=item.notif)
            if answer_only and not retired and not self._in_use(item.engine_id):
                self.ctx.forget_peer(item.engine_id, "connected only to answer a cancel", True)
        except Exception as e:
            if retired:  # (P's connection to the engine it serves is not in question)
                self.ctx.counters.inc("push_failed_send_notif")
                logger.warning("push: %s to retired agent %s of %s not sent: %s",
                               item.what, item.sender, item.engine_id, e)  # fmt: skip
                return
            self.ctx.counters.inc("push_failed_send_notif")
            self._suspect.setdefault(item.engine_id, f"{item.what} not sent: {e}")
            if peer is not None:
                self._undelivered.setdefault(item.engine_id, []).append((peer, item))
            logger.warning("push: %s to %s rank %d not sent: %s",
                           item.what, item.engine_id, item.tp_rank, e)  # fmt: skip

    def handshake(self, peer: DPeer) -> Future | None:
        """Non-blocking: None when connected, else the pending handshake's future. A
        host outside ``push_peer_hosts`` is never connected to."""
        if not self.ctx.config.allows_peer_host(peer.host):
            self.ctx.counters.inc("push_peer_hosts_refused")
            refused: Future = Future()
            refused.set_exception(
                RuntimeError(f"D host {peer.host!r} is not among push_peer_hosts; not connected")
            )
            return refused
        try:
            return self.ctx.request_handshake(peer.engine_id, peer.host, peer.port, peer.tp_size)
        except Exception as e:  # e.g. an invalid tp_size in a peer's PUSH_REG
            f: Future = Future()
            f.set_exception(e)
            return f
