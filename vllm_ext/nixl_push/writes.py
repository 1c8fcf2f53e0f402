# SPDX-License-Identifier: Apache-2.0
"""P's WRITEs on the writer thread: from a request's blocks to the request settled.

:class:`Writes` owns the rendezvous (matching.py) and, through it, every
:class:`~vllm_ext.nixl_push.lifecycle.PushSend` of this rank, and moves them
through their states (lifecycle.py has the diagrams). Per matched registration::

    match ─► handshake with D ─► descriptors + initialize_xfer ─┬─► transfer() ─► DONE
                                                               └─► armed until the KV is final

A WRITE is posted only once the KV is final (``FinishedBlocks.final``): an announced
request's WRITEs are prepared during the forward pass and posted when it ends. A
request is settled (``Settled``) when every WRITE it started ended and it served
every D rank it must, or one failed; only then may the engine thread free its blocks.

Deadlines enforced here: a WRITE ``push_write_timeout`` after its registration
matched and the KV was final (abandoned: released, D told); an abandoned WRITE that
NIXL could not cancel at most that long again; an unmatched PUSH_REG after
0.8 x D's watchdog (or since P last renewed it). The lease of an unmatched request
is the engine thread's (``LeaseClaims``).

Failures release the handle, count, tell D (``PUSH_FAIL``, S-FAIL-4) and never touch
vLLM's failure path on P (S-FAIL-3).
"""

from __future__ import annotations

import functools
import queue
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from vllm_ext.log import get_logger
from vllm_ext.nixl_push.context import WriterContext
from vllm_ext.nixl_push.descriptors import DescriptorError
from vllm_ext.nixl_push.lifecycle import PushSend, SendState, Write, WriteState
from vllm_ext.nixl_push.matching import Match, RegResult, RegWhere, Rendezvous
from vllm_ext.nixl_push.messages import (
    Connected,
    Deferred,
    FinishedBlocks,
    LiveRequests,
    ReplyToD,
    Settled,
    ToEngine,
)
from vllm_ext.nixl_push.wire import CANCELLED as CANCELLED_REASON
from vllm_ext.nixl_push.wire import (
    Completion,
    PushCancel,
    PushFailed,
    PushHeartbeat,
    PushRegistration,
)

logger = get_logger(__name__)

#: P keeps an unmatched PUSH_REG for this fraction of push_registration_timeout, so
#: it gives up before D's watchdog frees the blocks it would write into.
P_REGISTRATION_TTL_FRACTION = 0.8
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


class Writes:
    """P's sends of one rank; every method runs on the writer thread."""

    def __init__(
        self,
        ctx: WriterContext,
        post: Callable[[ToEngine], None],
        deferred: queue.SimpleQueue[Deferred],
        wake: Callable[[], None],
    ) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.rendezvous = Rendezvous(ctx.identity.tp_size, gone_ttl=cfg.push_registration_timeout)
        self._post_to_engine = post
        self._deferred = deferred
        self._wake = wake
        self._write_s = cfg.push_write_timeout
        self._release_s = cfg.write_release_bound
        self._ttl_s = cfg.push_registration_timeout * P_REGISTRATION_TTL_FRACTION
        self._next_heartbeat = 0.0
        #: NIXL requests given up on that NIXL would not release yet, retried with a
        #: back-off (never in a tight loop): handle -> (next try, current back-off)
        self._stuck: dict[Any, tuple[float, float]] = {}
        #: D engines a WRITE failed to (a NIXL/UCX error): their agents are removed from
        #: NIXL once no WRITE to them is in flight, so the next request connects anew
        self._suspect: dict[str, str] = {}
        #: D engines whose registrations carried the secret of a P request's leg: from
        #: then on only such a registration may rebind the engine to a new agent
        self._secured_engines: set[str] = set()

    @property
    def busy(self) -> bool:
        """Self-poll (S-WRT-2): finished blocks wait for a registration, or NIXL moves bytes."""
        return self.rendezvous.has_unmatched_finished or any(
            w.state in (WriteState.POSTED, WriteState.ABANDONING)
            for s in self.rendezvous.sends()
            for w in s.writes
        )

    # -- from the engine thread ------------------------------------------------------------
    def on_finished(self, blocks: FinishedBlocks) -> None:
        """P's blocks of a request: announced (KV not final yet) or final."""
        now = time.monotonic()
        send = self.rendezvous.finished(blocks.request_id)
        if send is not None:
            if blocks.final and send.state is SendState.ANNOUNCED:
                send.finalize(blocks, now, self._write_s)  # post what was prepared
                self._post_armed(send)
                self._settle(send)
            else:
                logger.debug("push: %s already handed over; ignored", blocks.request_id)
            return
        send = PushSend.of(blocks, now)
        for m in self.rendezvous.add_finished(send):
            self._start(m, now)
        self._settle(send)

    def on_live(self, live: LiveRequests) -> None:
        for rid, tid in live.started.items():
            self.rendezvous.add_live(rid, tid)
        for rid in live.ended:
            self.rendezvous.drop_live(rid)

    def evict(self, request_id: str) -> None:
        """The engine thread is done with the request (reported sent, or its lease
        ended): no WRITE may read its blocks from now on."""
        now = time.monotonic()
        send = self.rendezvous.evict(request_id, now)
        self.ctx.claims.discard(request_id)
        if send is None or send.state.final:
            return
        for w in send.active:
            if send.state is SendState.ANNOUNCED:
                reason = "P's KV was never final"  # the engine gave up on the request
            else:
                # the engine thread's hard cap on the lease (the writer was stuck)
                reason = "P's lease on the blocks expired"
                self.ctx.counters.inc("push_failed_lease_expired")
                logger.error(
                    "push: lease of %s ended before its WRITE -> %s was done (%s)",
                    request_id, w.registration.request_id, w.state.value,
                )  # fmt: skip
            transfer = w.state in (WriteState.POSTED, WriteState.ABANDONING)
            if w.handle is not None and not self._release(w):
                logger.error(
                    "push: %s: NIXL still runs the WRITE -> %s into blocks already freed",
                    request_id, w.registration.request_id,
                )  # fmt: skip
                self._let_go(w)
            w.fail(reason, transfer=transfer)
            self._tell_d(w, reason)
        send.expire()

    # -- from D ---------------------------------------------------------------------------
    def on_registration(self, reg: PushRegistration, sender: str) -> None:
        counters = self.ctx.counters
        counters.inc("push_regs_received")
        known = self.ctx.peers.agent(reg.engine_id, reg.tp_rank)
        if (
            known is not None
            and known != sender
            and reg.secret is None
            and reg.engine_id not in self._secured_engines
        ):
            # D restarted: same engine id, a new NIXL agent. Connect the new one (the
            # handshake below); WRITEs already bound to the old agent fail on their own.
            # (Only for a D whose legs never carried a transfer_secret: otherwise only a
            # registration that matched the P request with the same secret may rebind
            # it, see _prepare, so a PUSH_REG can never make P forget a peer (S-LEG-3).)
            self.ctx.forget_peer(reg.engine_id, f"PUSH_REG from a new agent {sender} (was {known})")
        now = time.monotonic()
        out = self.rendezvous.add_registration(reg, sender, now)
        if out.result is RegResult.MATCHED:
            assert out.match is not None
            self._start(out.match, now)
        elif out.result is RegResult.STORED:
            # Connect to D now, while P is still prefilling: the WRITE then fires
            # the moment the blocks are finished instead of after a handshake.
            self._handshake(reg)
            if reg.heartbeat_s is not None:
                self._next_heartbeat = min(self._next_heartbeat, now + reg.heartbeat_s / 2)
        elif out.result is RegResult.DUPLICATE:
            counters.inc("push_regs_duplicate")
        elif out.result is RegResult.CANCELLED:
            counters.inc("push_regs_after_cancel")
            logger.warning(
                "push: PUSH_REG for %s rank %d arrived after D cancelled it; dropped",
                reg.request_id, reg.tp_rank,
            )  # fmt: skip
        elif out.result is RegResult.UNAUTHORIZED:
            counters.inc("push_regs_unauthorized")
            logger.warning(
                "push: PUSH_REG for %s rank %d from agent %s lacks its transfer's secret; "
                "dropped", reg.request_id, reg.tp_rank, sender,
            )  # fmt: skip
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
            self._reply(reg, sender, PushFailed(reg.request_id, "P released the KV first"), "late")

    def on_cancel(self, c: PushCancel, sender: str) -> None:
        """D aborted a request. Drop its registration unless a WRITE already started
        (that WRITE's completion or PUSH_FAIL answers); accepted only from the agent
        that registered it (or, for one P no longer knows, D's agent of that rank)."""
        key = (c.engine_id, c.request_id, c.tp_rank)
        where, registered_by = self.rendezvous.find_registration(key)
        owner = registered_by or self.ctx.peers.agent(c.engine_id, c.tp_rank)
        if owner is not None and owner != sender:
            self.ctx.counters.inc("push_notifs_foreign")
            logger.warning(
                "push: PUSH_CANCEL for %s rank %d from agent %s dropped (registered by %s)",
                c.request_id, c.tp_rank, sender, owner,
            )  # fmt: skip
            return
        # A tombstone: a duplicated or reordered PUSH_REG of it arriving later (its
        # blocks are D's to reuse) is never stored nor served.
        self.rendezvous.remember_cancelled(key, sender, time.monotonic())
        if owner is None:
            # Neither its PUSH_REG nor D's agent is known here yet (the cancel overtook
            # the registration): nobody to answer; the tombstone refuses the PUSH_REG.
            self.ctx.counters.inc("push_cancels_before_registration")
            return
        self.ctx.counters.inc("push_cancels_received")
        if where is RegWhere.PENDING:
            self.rendezvous.drop_registration(key)
        if where is not RegWhere.SERVED:
            self._reply(c, sender, PushFailed(c.request_id, CANCELLED_REASON), "cancel answer")

    # -- from handshake callbacks -------------------------------------------------------------
    def on_deferred(self, item: Connected | ReplyToD) -> None:
        if isinstance(item, ReplyToD):
            self._send_to_d(item.engine_id, item.tp_rank, item.sender, item.notif, item.what)
            return
        w = item.write
        send = self.rendezvous.finished(item.request_id)
        if w.state is WriteState.FAILED:
            # Given up while connecting (lease ended, deadline): now D can be told.
            self._tell_d(w, w.failure or "P gave up")
            return
        if send is None or w.state is not WriteState.CONNECTING:
            return
        if item.error is not None:
            # S-FAIL-2: drop, never retry; nobody to tell (no agent for D).
            self.ctx.counters.inc("push_failed_handshake")
            logger.error(
                "push_handshake_failed: P request %s -> D %s: %s",
                item.request_id, w.registration.engine_id, item.error,
            )  # fmt: skip
            w.fail(f"handshake with D failed: {item.error}")
            self._settle(send)
            return
        self._prepare(send, w)

    # -- periodic (every writer pass) ------------------------------------------------------
    def poll(self) -> None:
        """Settle the WRITEs NIXL finished; release the handles NIXL let go of since."""
        if self._stuck:
            self._retry_stuck(time.monotonic())
        for send in self.rendezvous.sends():
            for w in send.writes:
                if w.state not in (WriteState.POSTED, WriteState.ABANDONING):
                    continue
                try:
                    state = self.ctx.nixl.check_xfer_state(w.handle)
                except Exception as e:
                    # NIXL did not say: the transfer may still run. It has ended only
                    # if NIXL lets us release it (it refuses while it runs); else ask
                    # again next pass (its deadline bounds the wait).
                    self.ctx.counters.inc("push_xfer_state_errors")
                    if not self._try_release(w.handle):
                        continue
                    w.handle = None
                    state = f"exception: {e}"
                if state != "PROC":
                    self._write_ended(send, w, state)

    def check_deadlines(self, now: float) -> None:
        for send in self.rendezvous.sends():
            for w in send.active:
                if w.deadline is not None and now >= w.deadline:
                    self._deadline_passed(send, w, now)
        for p in self.rendezvous.expire(now, self._ttl_of):
            self.ctx.counters.inc("push_regs_expired")
            logger.warning(
                "push: PUSH_REG for %s from %s waited %.0fs for its blocks; dropped",
                p.registration.request_id, p.registration.engine_id,
                self._ttl_of(p.registration),
            )  # fmt: skip
            # Tell D now (S-FAIL-4) rather than leaving it to its watchdog.
            reason = "P has no request for this registration"
            self._reply(p.registration, p.sender, PushFailed(p.registration.request_id, reason),
                        "expiry answer")  # fmt: skip
        self._heal_suspects()

    def heartbeat(self, now: float) -> None:
        """Renew D's watchdog for the registrations P will serve: those a live P request
        (queued, prefilling) awaits, and those being written, each at most every
        ``heartbeat_s`` (D's ask). Never for a registration P merely holds: its P leg
        may be lost, and D's watchdog must end it."""
        if now < self._next_heartbeat:
            return
        period = HEARTBEAT_IDLE_CHECK_S
        due: dict[str, list[str]] = defaultdict(list)

        def consider(reg: PushRegistration, sender: str, renewed_at: float) -> bool:
            nonlocal period
            if reg.heartbeat_s is None:
                return False  # an older D: it would drop PUSH_HB as malformed
            period = min(period, reg.heartbeat_s / 2)
            if now - renewed_at < reg.heartbeat_s:
                return False
            if self.ctx.peers.agent(reg.engine_id, reg.tp_rank) != sender:
                return False  # not connected yet (P connects on arrival)
            due[sender].append(reg.request_id)
            return True

        for p in self.rendezvous.awaited():
            if consider(p.registration, p.sender, p.since):
                p.since = now  # awaited: kept past P's TTL too
        for send in self.rendezvous.sends():
            for w in send.active:
                if consider(w.registration, w.sender, w.renewed_at):
                    w.renewed_at = now
        for agent, ids in due.items():
            try:
                self.ctx.nixl.send_notif(agent, notif_msg=PushHeartbeat(tuple(ids)).encode())
                self.ctx.counters.inc("push_heartbeats_sent")
            except Exception as e:
                logger.debug("push: PUSH_HB to %s not sent: %s", agent, e)
        self._next_heartbeat = now + period

    # -- shutdown and the writer's catch-all -------------------------------------------------
    def release_all(self) -> None:
        for send in self.rendezvous.sends():
            for w in send.writes:
                if w.handle is not None:
                    self._release(w)
        self._stuck = {h: t for h, t in self._stuck.items() if not self._try_release(h)}

    def give_up_request(self, request_id: str, reason: str) -> None:
        """Fail what ``request_id`` still has in flight and settle it (after an
        unexpected error while working on it)."""
        send = self.rendezvous.finished(request_id)
        if send is None or send.state.final:
            return
        now = time.monotonic()
        for w in send.active:
            self._give_up(send, w, reason, now, settle=False)
        self._settle(send)

    # -- a WRITE ---------------------------------------------------------------------------
    def _start(self, m: Match, now: float) -> None:
        self.ctx.counters.inc(f"push_match_{m.rule}")
        send, reg = m.send, m.registration
        if send.secret is not None:
            self._secured_engines.add(reg.engine_id)
        w = Write(reg, m.sender, matched_at=now, renewed_at=m.since)
        send.add_write(w, self._write_s)
        if not self.ctx.claims.protect(send.request_id):
            # vLLM's lease on the blocks ended (or is ending) before the registration.
            self.ctx.counters.inc("push_failed_lease_expired")
            logger.error(
                "push: lease of %s ended before its WRITE -> %s could start; not written",
                send.request_id, reg.request_id,
            )  # fmt: skip
            self._give_up(send, w, "P's lease on the blocks expired", now)
            return
        fut = self._handshake(reg)
        if fut is not None:
            fut.add_done_callback(functools.partial(self._after_connect, send.request_id, w))
            return
        self._prepare(send, w)

    def _after_connect(self, request_id: str, w: Write, fut: Future) -> None:
        # Handshake executor thread: hand the outcome to the writer, touch nothing.
        self._deferred.put(Connected(request_id, w, fut.exception()))
        self._wake()

    def _prepare(self, send: PushSend, w: Write) -> None:
        """Descriptors and the NIXL request; posted at once if the KV is final."""
        reg = w.registration
        ident = self.ctx.identity
        agent = self.ctx.peers.agent(reg.engine_id, reg.tp_rank)
        if (
            agent is not None
            and agent != w.sender
            and send.secret is not None
            and not w.reconnected
        ):
            # The registration carries the secret of this P request's leg: it comes from
            # the D the request was sent to, which has a new agent (it restarted under
            # the same engine id). Connect it anew, then prepare again.
            w.reconnected = True
            self.ctx.forget_peer(
                reg.engine_id, f"an authenticated PUSH_REG from new agent {w.sender}"
            )
            fut = self._handshake(reg)
            if fut is not None:
                fut.add_done_callback(functools.partial(self._after_connect, send.request_id, w))
                return
            agent = self.ctx.peers.agent(reg.engine_id, reg.tp_rank)
        if agent is not None and agent != w.sender:
            self.ctx.counters.inc("push_notifs_foreign")
            logger.warning(
                "push: PUSH_REG for %s rank %d came from agent %s, not from D's agent %s; "
                "not written", reg.request_id, reg.tp_rank, w.sender, agent,
            )  # fmt: skip
            w.d_told = True  # the D rank never asked: nothing to tell it
            w.fail("registered by a foreign agent")
            self._settle(send)
            return
        try:
            if agent is None:
                raise DescriptorError(
                    f"P rank {ident.tp_rank}/{ident.tp_size} has no agent for D rank "
                    f"{reg.tp_rank}/{reg.tp_size}"
                )
            src, dst = self.ctx.layouts.write_descs(send.blocks.block_ids, reg)
        except (DescriptorError, KeyError) as e:
            self.ctx.counters.inc("push_failed_descriptors")
            logger.error("push: cannot write %s into D %s: %s", send.request_id, reg.request_id, e)
            self._fail(send, w, str(e))
            return
        if not src:  # D needs nothing (prefix hit): the completion only, once the KV is final
            w.arm(None, 0)
        else:
            nixl, mem = self.ctx.nixl, self.ctx.memory_type
            try:
                handle = nixl.initialize_xfer(
                    "WRITE",
                    nixl.get_xfer_descs(src, mem),
                    nixl.get_xfer_descs(dst, mem),
                    agent,
                    Completion(reg.request_id, ident.tp_size).encode(),
                )
            except Exception as e:
                self._submit_failed(send, w, e)
                return
            w.arm(handle, sum(n for _, n, _ in src))
        if send.state is not SendState.ANNOUNCED:
            self._post(send, w, self._kv_ready(send.blocks))

    def _post_armed(self, send: PushSend) -> None:
        """The announced request's KV is final: post its prepared WRITEs."""
        armed = [w for w in send.writes if w.state is WriteState.ARMED]
        if armed:
            ready = self._kv_ready(send.blocks)
            for w in armed:
                self._post(send, w, ready)

    def _post(self, send: PushSend, w: Write, kv_ready: bool) -> None:
        if w.handle is None:
            self._send_completion(send, w)
            return
        if not kv_ready:
            self._submit_failed(send, w, RuntimeError("KV not readable"))
            return
        try:
            state = self.ctx.nixl.transfer(w.handle)
            if state == "ERR":
                raise RuntimeError("transfer() returned ERR")
        except Exception as e:
            self._submit_failed(send, w, e)
            return
        w.post()
        self.ctx.counters.inc("push_writes")
        self.ctx.counters.inc("push_bytes", w.nbytes)
        if state == "DONE":  # done within the call (UCX copies same-host WRITEs inline)
            self._write_ended(send, w, state)

    def _send_completion(self, send: PushSend, w: Write) -> None:
        """The completion alone: D needs none of the blocks (it holds the prefix)."""
        reg = w.registration
        notif = Completion(reg.request_id, self.ctx.identity.tp_size).encode()
        try:
            self.ctx.nixl.send_notif(w.sender, notif_msg=notif)
        except Exception as e:
            self.ctx.counters.inc("push_failed_send_notif")
            logger.error("push: completion for %s not sent: %s", reg.request_id, e)
            w.fail(f"completion not sent: {e}")
        else:
            w.done()
        self._settle(send)

    def _kv_ready(self, blocks: FinishedBlocks) -> bool:
        """Wait for the forward pass that wrote the KV (a CUDA event; nothing on CPU)."""
        if blocks.ready is None:
            return True
        try:
            blocks.ready.synchronize()
        except Exception:
            logger.exception("push: waiting for the KV of %s failed", blocks.request_id)
            return False
        return True

    def _submit_failed(self, send: PushSend, w: Write, e: Exception) -> None:
        # S-FAIL-3: release, count; never _handle_failed_transfer on P.
        self.ctx.counters.inc("push_failed_write_submit")
        logger.error(
            "push: WRITE of %s -> %s not submitted: %s",
            send.request_id, w.registration.request_id, e,
        )  # fmt: skip
        self._fail(send, w, f"WRITE submission failed: {e}", transfer=True)
        self._suspect.setdefault(w.registration.engine_id, f"a WRITE was not submitted: {e}")

    def _write_ended(self, send: PushSend, w: Write, state: str) -> None:
        """A posted WRITE is no longer in flight (``state``: DONE, ERR, an exception)."""
        reg = w.registration
        if w.state is WriteState.ABANDONING:  # timed out; NIXL has let go of it now
            self._fail(send, w, f"WRITE not done within {self._write_s:g}s", transfer=True)
            return
        if state != "DONE":
            self.ctx.counters.inc("push_failed_write_state")
            logger.error("push: WRITE of %s -> %s ended %s", send.request_id, reg.request_id, state)
            self._fail(send, w, f"WRITE ended {state}", transfer=True)
            self._suspect.setdefault(reg.engine_id, f"a WRITE ended {state}")
            return
        w.done()
        self._settle(send)  # first: it ends the hand-off clock
        self._record_telemetry(w.handle)
        self._release(w)

    def _deadline_passed(self, send: PushSend, w: Write, now: float) -> None:
        reg = w.registration
        if w.state is WriteState.ABANDONING:
            logger.error(
                "push: WRITE of %s -> %s still in flight %gs after it was abandoned and "
                "NIXL could not cancel it; freeing its blocks anyway (NIXL may still read "
                "them)", send.request_id, reg.request_id, self._release_s,
            )  # fmt: skip
            self.ctx.counters.inc("push_failed_write_stuck")
            self._let_go(w)  # released once NIXL allows
            self._fail(send, w, "WRITE stuck in NIXL", transfer=True)
            return
        self.ctx.counters.inc("push_failed_write_timeout")
        logger.error(
            "push: WRITE of %s -> %s not done within push_write_timeout=%gs (%s); abandoned",
            send.request_id, reg.request_id, self._write_s, w.state.value,
        )  # fmt: skip
        self._give_up(send, w, f"WRITE not done within {self._write_s:g}s", now)

    def _give_up(
        self, send: PushSend, w: Write, reason: str, now: float, settle: bool = True
    ) -> None:
        """End ``w`` now, unless NIXL cannot cancel it: then wait for it (bounded)."""
        transfer = w.state in (WriteState.POSTED, WriteState.ABANDONING)
        if not self._release(w):
            if w.state is WriteState.POSTED:
                w.abandon(now + self._release_s)  # D is told when it leaves PROC, or at the bound
                return
            self._let_go(w)
        w.fail(reason, transfer=transfer)
        self._tell_d(w, reason)
        if settle:
            self._settle(send)

    def _fail(self, send: PushSend, w: Write, reason: str, transfer: bool = False) -> None:
        if not self._release(w):
            self._let_go(w)
        w.fail(reason, transfer=transfer)
        self._tell_d(w, reason)
        self._settle(send)

    def _settle(self, send: PushSend) -> None:
        """Report ``send`` settled once every WRITE it started ended and it is complete
        (or failed); else, with nothing in flight, its blocks are under the lease again."""
        if not send.settle():
            if not send.active and not send.state.final:
                self.ctx.claims.unprotect(send.request_id)
            return
        if send.state is SendState.WRITTEN:
            self.ctx.counters.observe(
                "push_handoff_seconds", time.monotonic() - send.blocks.finished_at
            )
        self.rendezvous.evict(send.request_id, time.monotonic())
        self.ctx.claims.unprotect(send.request_id)
        self._post_to_engine(Settled(send.request_id, send.failed_transfers))

    # -- NIXL helpers ----------------------------------------------------------------------
    def _record_telemetry(self, handle: Any) -> None:
        try:
            t = self.ctx.nixl.get_xfer_telemetry(handle)
        except Exception:
            return
        c = self.ctx.counters
        c.observe("transfer_duration", t.xferDuration / 1e6)
        c.observe("post_duration", t.postDuration / 1e6)
        c.observe("bytes_transferred", t.totalBytes)
        c.observe("num_descriptors", t.descCount)

    def _release(self, w: Write) -> bool:
        """Release ``w``'s NIXL request; False if NIXL refused because the transfer still
        runs (the caller decides). A request that is not in flight is retried later."""
        if w.handle is None:
            return True
        if self._try_release(w.handle):
            w.handle = None
            return True
        if w.state not in (WriteState.POSTED, WriteState.ABANDONING):
            logger.warning("push: NIXL refused to release a WRITE handle; retrying later")
            self._let_go(w)
        return False

    def _try_release(self, handle: Any) -> bool:
        try:
            self.ctx.nixl.release_xfer_handle(handle)
        except Exception as e:
            logger.debug("push: releasing a WRITE handle failed: %s", e)
            return False
        return True

    def _let_go(self, w: Write) -> None:
        """Stop waiting for ``w``'s NIXL request; release it as soon as NIXL allows.

        A WRITE that NIXL may still be running is cut off first: D's agents are removed
        from NIXL (``forget_peer(remove=True)``), so nothing more of it reaches D's
        blocks, and D is not told it ended (no agent to tell): D frees the blocks only
        after its own removal of this producer (docs/design.md, "Which blocks a WRITE
        may touch")."""
        if w.handle is None:
            return
        if w.state in (WriteState.POSTED, WriteState.ABANDONING):
            reg = w.registration
            self.ctx.counters.inc("push_writes_cut_off")
            self.ctx.forget_peer(
                reg.engine_id, f"a WRITE to {reg.request_id} NIXL would not end", True
            )
        self._stuck[w.handle] = (0.0, STUCK_RETRY_FIRST_S)
        w.handle = None

    def _retry_stuck(self, now: float) -> None:
        """Release the NIXL requests given up on, each retried with a doubling back-off."""
        for handle, (due, backoff) in list(self._stuck.items()):
            if now < due:
                continue
            if self._try_release(handle):
                del self._stuck[handle]
            else:
                self._stuck[handle] = (now + backoff, min(2 * backoff, STUCK_RETRY_MAX_S))

    def _heal_suspects(self) -> None:
        """A D a WRITE failed to is removed from NIXL once no WRITE to it is in flight:
        its broken endpoints go with it, and the next request to it handshakes anew."""
        if not self._suspect:
            return
        busy = {
            w.registration.engine_id
            for s in self.rendezvous.sends()
            for w in s.active
            if w.state in (WriteState.POSTED, WriteState.ABANDONING)
        }
        for engine_id in [e for e in self._suspect if e not in busy]:
            why = self._suspect.pop(engine_id)
            if self.ctx.forget_peer(engine_id, why, True):
                self.ctx.counters.inc("push_peers_healed")

    def _tell_d(self, w: Write, reason: str) -> None:
        """S-FAIL-4: let D fail the request now instead of waiting out its watchdog."""
        if w.d_told:
            return
        reg = w.registration
        if self.ctx.peers.agent(reg.engine_id, reg.tp_rank) != w.sender:
            return  # not connected (yet): told once connected, see on_deferred
        w.d_told = True
        self._send_to_d(
            reg.engine_id, reg.tp_rank, w.sender,
            PushFailed(reg.request_id, reason).encode(), "PUSH_FAIL",
        )  # fmt: skip

    def _reply(self, peer: DPeer, sender: str, msg: PushFailed, what: str) -> None:
        """Answer a D rank, after a handshake with it if there was none."""
        item = ReplyToD(peer.engine_id, peer.tp_rank, sender, msg.encode(), what)
        if self.ctx.peers.agent(peer.engine_id, peer.tp_rank) is None:
            fut = self._handshake(peer)
            if fut is not None:
                fut.add_done_callback(functools.partial(self._after_reply_handshake, item))
                return
        self._send_to_d(item.engine_id, item.tp_rank, item.sender, item.notif, item.what)

    def _after_reply_handshake(self, item: ReplyToD, fut: Future) -> None:
        if fut.exception() is None:
            self._deferred.put(item)
            self._wake()

    def _send_to_d(self, engine_id: str, rank: int, sender: str, notif: bytes, what: str) -> None:
        """To the agent ``sender`` only, and only if it is D's agent of that rank."""
        agent = self.ctx.peers.agent(engine_id, rank)
        if agent is None or agent != sender:
            logger.warning("push: %s for %s rank %d not sent: no agent", what, engine_id, rank)
            return
        try:
            self.ctx.nixl.send_notif(agent, notif_msg=notif)
        except Exception:
            logger.warning("push: %s to %s rank %d not sent", what, engine_id, rank, exc_info=True)

    def _handshake(self, peer: DPeer) -> Future | None:
        """Non-blocking: None when connected, else the pending handshake's future."""
        try:
            return self.ctx.request_handshake(peer.engine_id, peer.host, peer.port, peer.tp_size)
        except Exception as e:  # e.g. an invalid tp_size in a peer's PUSH_REG
            f: Future = Future()
            f.set_exception(e)
            return f

    def _ttl_of(self, reg: PushRegistration) -> float:
        """P keeps an unmatched PUSH_REG for a fraction of D's watchdog (ours if D did
        not say), so it gives up before D stops waiting."""
        timeout = reg.timeout_s or self.ctx.config.push_registration_timeout
        return min(self._ttl_s, timeout * P_REGISTRATION_TTL_FRACTION)
