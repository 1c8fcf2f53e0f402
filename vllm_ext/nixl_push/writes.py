# SPDX-License-Identifier: Apache-2.0
"""P's WRITEs on the writer thread: from a request's blocks to the request settled.

:class:`Writes` owns the rendezvous (matching.py) and, through it, every
:class:`~vllm_ext.nixl_push.send_lifecycle.PushSend` of this rank (send_lifecycle.py
has the diagrams). A hand-over is decided by the request's ``PushSend``
(``hand_over``: what should happen now) and carried out here (NIXL, the claims, D).
Per matched registration::

    match ─► handshake with D ─► descriptors + initialize_xfer ─┬─► transfer() ─► DONE
                                                               └─► armed until the KV is final

A WRITE is posted only once the KV is final (``messages.KvFinal``): an announced
request's WRITEs are prepared during the forward pass and posted when it ends. A
request is settled (``Settled``) when every WRITE it started ended and it served
every D rank it must, or one failed; only then may the engine thread free its blocks.

Chunk-progressive push (``push_progressive``, S-PRG-1): a request whose prompt chunks
are handed over as they are computed (PREFILLING) streams each chunk's full blocks
(one chunk WRITE without a notification in flight per D rank; the next covers every
full block final by then). The last WRITE writes the rest and carries the completion;
it is posted only once no chunk WRITE of the request runs, so D reads the completion
only after every byte before it landed. A request P preempted after streaming is
written whole by its last WRITE (``PushSend.whole``): a chunk WRITE that read
its blocks after they were freed is overwritten.

Deadlines enforced here: a WRITE ``push_write_timeout_s`` after its registration
matched and the KV was final (given up: D told once NIXL no longer runs it); an
unmatched PUSH_REG after 0.8 x D's watchdog (or since P last renewed it). The lease
of an unmatched request is the engine thread's (``LeaseClaims``).

A transfer NIXL accepted ends only when NIXL says so for its handle (DONE, ERR, an
error status): P never releases a running one, since NIXL's UCX backend returns
success for such a release while bytes already handed to the transport still land
(docs/design.md, N-REL-1). A WRITE given up while it runs is ABANDONING until then;
every WRITE posted on a request's blocks is recorded in ``LeaseClaims``
(``start_write`` / ``end_write``), so no lease end frees blocks it may read.

Failures release the handle, count, tell D (``PUSH_FAIL``, S-FAIL-4) and never touch
vLLM's failure path on P (S-FAIL-3).
"""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from vllm_ext.log import event, get_logger
from vllm_ext.nixl_push.context import WriterContext
from vllm_ext.nixl_push.descriptors import DescriptorError
from vllm_ext.nixl_push.dlinks import DLinks
from vllm_ext.nixl_push.matching import Match, Rendezvous
from vllm_ext.nixl_push.messages import (
    Connected,
    Deferred,
    HandOver,
    LiveRequests,
    ReplyToD,
    Settled,
    Stopped,
    ToEngine,
)
from vllm_ext.nixl_push.send_lifecycle import HandOverPlan, PushSend, SendState, Write, WriteState
from vllm_ext.nixl_push.wire import (
    Completion,
    PushRegistration,
)

logger = get_logger(__name__)


class Writes:
    """P's sends of one rank; every method runs on the writer thread. ``links`` (its
    :class:`~vllm_ext.nixl_push.dlinks.DLinks`) talks to D; this is its ``WriteOwner``."""

    def __init__(
        self,
        ctx: WriterContext,
        post: Callable[[ToEngine], None],
        deferred: queue.SimpleQueue[Deferred],
        wake: Callable[[], None],
    ) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.rendezvous = Rendezvous(ctx.identity.tp_size, gone_ttl=cfg.push_registration_timeout_s)
        self._post_to_engine = post
        self._deferred = deferred
        self._wake = wake
        self._write_s = cfg.push_write_timeout_s
        self._release_s = cfg.write_release_bound
        self.links = DLinks(ctx, self.rendezvous, self, deferred, wake)

    @property
    def busy(self) -> bool:
        """Self-poll (S-WRT-2): finished blocks wait for a registration, or NIXL moves bytes."""
        return self.rendezvous.has_unmatched_finished or any(
            w.in_flight for s in self.rendezvous.serving() for w in s.writes
        )

    # -- from the engine thread ------------------------------------------------------------
    def on_finished(self, h: HandOver) -> None:
        """P's hand-over of a request's blocks: a chunk (push_progressive), announced (KV
        not final yet), final, or stopped (it ended before its prompt was computed). The
        request's :class:`PushSend` decides what happens (``hand_over``); this acts."""
        now = time.monotonic()
        send = self.rendezvous.finished(h.request_id)
        if send is not None:
            self._act(send, send.hand_over(h, now, self._write_s), now)
        elif not isinstance(h, Stopped):
            self._first_hand_over(PushSend.of(h, now), now)

    def _first_hand_over(self, send: PushSend, now: float) -> None:
        for m in self.rendezvous.add_finished(send):
            self.start(m, now)
        for pending in self.rendezvous.take_refused():
            self.links.refuse_prompt(pending.registration, pending.sender, send)
        self._settle(send)

    def _act(self, send: PushSend, plan: HandOverPlan, now: float) -> None:
        """Carry out what a hand-over of ``send`` asked for (``PushSend.hand_over``)."""
        if plan.ignored:
            logger.debug("push: %s already handed over; ignored", send.request_id)
        for w in plan.give_up:
            self.give_up(send, w, plan.why, now, settle=False)
        for w in plan.stream:
            self._stream(send, w)
        for w in plan.arm:
            self._arm_last(send, w)
        if plan.post:
            ready = self._kv_ready(send)
            for w in plan.post:
                self._post(send, w, ready)
        if plan.settle:
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
            if send.state in (SendState.PREFILLING, SendState.ANNOUNCED):
                reason = "P's KV was never final"  # the engine gave up on the request
            else:
                # the engine thread's hard cap on the lease (the writer was stuck)
                reason = "P's lease on the blocks expired"
                self.ctx.counters.inc("push_failed_lease_expired")
                logger.error(
                    "push: lease of %s ended before its WRITE -> %s was done (%s)",
                    request_id, w.registration.request_id, w.state.value,
                )  # fmt: skip
            transfer = w.in_flight
            if w.handle is not None and not self.links.release(w):
                logger.error(
                    "push: %s: NIXL still runs the WRITE -> %s into blocks already freed",
                    request_id, w.registration.request_id,
                )  # fmt: skip
                self.links.let_go(w)
            w.fail(reason, transfer=transfer)
            self.links.tell_d(w, reason)
        send.expire()

    # -- from handshake callbacks -------------------------------------------------------------
    def on_deferred(self, item: Connected | ReplyToD) -> None:
        if isinstance(item, ReplyToD):
            self.links.send_to_d(item)
            return
        w = item.write
        send = self.rendezvous.finished(item.request_id)
        if w.state is WriteState.FAILED:
            # Given up while connecting (lease ended, deadline): now D can be told.
            self.links.tell_d(w, w.failure or "P gave up")
            return
        if send is None or w.state is not WriteState.CONNECTING:
            return
        if item.error is not None:
            # S-FAIL-2: drop, never retry; nobody to tell (no agent for D).
            self.ctx.counters.inc("push_failed_handshake")
            logger.error(
                "push_handshake_failed: P request %s -> D %s: %s",
                item.request_id, w.registration.engine_id, item.error,
                extra=event("push_handshake_failed", item.request_id),
            )  # fmt: skip
            w.fail(f"handshake with D failed: {item.error}")
            self._settle(send)
            return
        self._prepare(send, w)

    # -- periodic (every writer pass) ------------------------------------------------------
    def poll(self) -> None:
        """Settle the WRITEs NIXL finished; release the handles NIXL let go of since."""
        self.links.retry_stuck(time.monotonic())
        for send in self.rendezvous.serving():
            for w in send.writes:
                if not w.in_flight or w.handle is None:  # None: a failed one landing
                    continue
                try:
                    state = self.ctx.nixl.check_xfer_state(w.handle)
                except Exception as e:
                    # NIXL did not say: the transfer may still run. NIXL tracks it no
                    # more only if it lets us release it (it refuses while it runs);
                    # else ask again next pass. Released, it failed: its rest may
                    # still land (NIXL raises so for a WRITE whose D agent was removed
                    # while the WRITE goes on, N-REL-2).
                    self.ctx.counters.inc("push_xfer_state_errors")
                    if not self.links.try_release(w.handle):
                        continue
                    w.handle = None
                    self.ctx.counters.inc("push_failed_write_state")
                    self.links.transfer_failed(send.request_id, w, f"check_xfer_state raised {e}")
                    continue
                if state == "PROC":
                    continue
                if w.state is WriteState.STREAMING:
                    self._chunk_ended(send, w, state)
                else:
                    self._write_ended(send, w, state)

    def check_deadlines(self, now: float) -> None:
        for send in self.rendezvous.serving():
            for w in send.active:
                if w.deadline is not None and now >= w.deadline:
                    self._deadline_passed(send, w, now)
        self.links.expire_registrations(now)
        self.links.heal_suspects()

    # -- shutdown and the writer's catch-all -------------------------------------------------
    def release_all(self) -> None:
        for send in self.rendezvous.sends():
            for w in send.writes:
                if w.handle is not None:
                    self.links.release(w)
        self.links.release_stuck()

    def give_up_request(self, request_id: str, reason: str) -> None:
        """Fail what ``request_id`` still has in flight and settle it (after an
        unexpected error while working on it)."""
        send = self.rendezvous.finished(request_id)
        if send is None or send.state.final:
            return
        now = time.monotonic()
        for w in send.active:
            self.give_up(send, w, reason, now, settle=False)
        self._settle(send)

    # -- a WRITE ---------------------------------------------------------------------------
    def start(self, m: Match, now: float) -> None:
        self.ctx.counters.inc(f"push_match_{m.rule}")
        send, reg = m.send, m.registration
        # proof that the registration belongs to this request (S-LEG-3): the secret, or
        # the transfer id that only the two legs carried (matching rule 1)
        proven = send.secret is not None or m.rule == "transfer_id"
        if proven:
            self.links.secure(reg.engine_id)
        w = Write(reg, m.sender, matched_at=now, renewed_at=m.since, p_request_id=send.request_id)
        w.proven = proven
        send.add_write(w, self._write_s)
        if not self.ctx.claims.protect(send.request_id):
            # vLLM's lease on the blocks ended (or is ending) before the registration.
            self._refused(send, w, "start", now)
            return
        fut = self.links.handshake(reg)
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
        agent = self.links.current(reg.engine_id, reg.tp_rank)
        if (
            agent is not None
            and agent != w.sender
            and (shared := self.links.agents.shared(reg.engine_id, reg.tp_rank, w.sender))
        ):
            # another D engine under the engine id P serves (d_agents.py): refused
            self.ctx.counters.inc("push_regs_engine_id_shared")
            logger.warning("push: PUSH_REG for %s refused: %s", reg.request_id, shared.reason())
            self._fail(send, w, shared.reason())
            return
        if agent is not None and agent != w.sender and w.proven and not w.reconnected:
            # The registration proved it belongs to this P request: it comes from the D
            # the request was sent to, which has a new agent (it restarted under the same
            # engine id). Connect it anew, then prepare again.
            w.reconnected = True
            self.links.retire(reg.engine_id, f"an authenticated PUSH_REG from new agent {w.sender}")
            fut = self.links.handshake(reg)
            if fut is not None:
                fut.add_done_callback(functools.partial(self._after_connect, send.request_id, w))
                return
            agent = self.links.current(reg.engine_id, reg.tp_rank)
        if agent is not None and agent != w.sender:
            self.ctx.counters.inc("push_notifs_foreign")
            logger.warning(
                "push: PUSH_REG for %s rank %d came from agent %s, not from D's agent %s; "
                "not written", reg.request_id, reg.tp_rank, w.sender, agent,
            )  # fmt: skip
            # a D agent P retired is answered (its blocks go back); any other never asked
            w.d_told = not self.links.agents.reachable(reg.engine_id, reg.tp_rank, w.sender)
            w.fail("registered by a foreign agent")
            self.links.tell_d(w, "registered by an agent P no longer serves for this engine id")
            if not self.links.secured(reg.engine_id):
                # legs without ids or secret: a D restarted under its engine id looks
                # the same; it is connected anew once nothing is in flight to it
                self.links.suspect(reg.engine_id, f"a PUSH_REG from new agent {w.sender}")
            self._settle(send)
            return
        if agent is None:
            self._descriptors_failed(
                send, w,
                DescriptorError(
                    f"P rank {ident.tp_rank}/{ident.tp_size} has no agent for D rank "
                    f"{reg.tp_rank}/{reg.tp_size}"
                ),
            )  # fmt: skip
            return
        # D's layout is pinned to the WRITE now: a later handshake under D's engine id
        # (a restart, a peer claiming it) cannot move where its chunks land.
        w.remote_layout = self.ctx.layouts.remote(reg.engine_id, reg.tp_rank)
        if send.state is SendState.PREFILLING:
            w.stream()  # its prompt is still computed: chunks first (S-PRG-1)
            self._stream(send, w)
        else:
            self._arm_last(send, w)

    def _arm_last(self, send: PushSend, w: Write) -> None:
        """The WRITE that completes ``w`` (from the first token no chunk WRITE of it
        wrote to the end, with the completion): prepared, and posted at once if the
        KV is final. Connected, and no chunk WRITE of it in flight."""
        reg = w.registration
        try:
            src, dst = self.ctx.layouts.write_descs(
                send.block_ids, reg, (w.streamed_tokens, None), w.remote_layout
            )
        except (DescriptorError, KeyError) as e:
            self._descriptors_failed(send, w, e)
            return
        if not src:  # D needs nothing (prefix hit): the completion only, once the KV is final
            w.arm(None, 0)
        else:
            handle = self._initialize(send, w, src, dst, last=True)
            if handle is None:
                return
            w.arm(handle, sum(n for _, n, _ in src))
        if send.state is not SendState.ANNOUNCED:
            self._post(send, w, self._kv_ready(send))

    def _initialize(
        self, send: PushSend, w: Write, src: list[Any], dst: list[Any], last: bool
    ) -> Any:
        """NIXL's request for a WRITE of ``w`` (the last one carries the completion);
        None: it failed (``w`` failed, D told)."""
        reg, nixl, mem = w.registration, self.ctx.nixl, self.ctx.memory_type
        notif = self._completion(reg) if last else b""
        try:
            return nixl.initialize_xfer(
                "WRITE", nixl.get_xfer_descs(src, mem), nixl.get_xfer_descs(dst, mem),
                w.sender, notif,
            )  # fmt: skip
        except Exception as e:
            self._submit_failed(send, w, e)
            return None

    def _completion(self, reg: PushRegistration) -> bytes:
        """The completion that ends ``reg``'s push, with its reply token (S-WIR-3): the
        one way P builds it, whether a WRITE carries it or it goes alone."""
        return Completion(reg.request_id, self.ctx.identity.tp_size, reg.reply_token).encode()

    def _descriptors_failed(self, send: PushSend, w: Write, e: Exception) -> None:
        self.ctx.counters.inc("push_failed_descriptors")
        logger.error(
            "push: cannot write %s into D %s: %s", send.request_id, w.registration.request_id, e
        )
        self._fail(send, w, str(e))

    # -- chunk-progressive push (S-PRG-1) --------------------------------------------------
    def _stream(self, send: PushSend, w: Write) -> None:
        """Post a chunk WRITE of ``w``: the full blocks final since its last one."""
        local = self.ctx.layouts.local
        if len(send.block_ids) != 1 or local is None:
            return  # several KV cache groups: written whole (the scheduler streams none)
        until = send.kv_tokens // local.block_size * local.block_size
        if until <= w.streamed_tokens:
            return
        try:
            src, dst = self.ctx.layouts.write_descs(
                send.block_ids, w.registration, (w.streamed_tokens, until), w.remote_layout
            )
        except (DescriptorError, KeyError) as e:
            self._descriptors_failed(send, w, e)
            return
        if not src:  # D holds these tokens (its prefix)
            w.streamed_tokens = until
            return
        if not self._kv_ready(send):
            self._submit_failed(send, w, RuntimeError("KV not readable"))
            return
        handle = self._initialize(send, w, src, dst, last=False)
        if handle is None:
            return
        w.post_chunk(handle, until, sum(n for _, n, _ in src))
        state = self._transfer(send, w, handle)
        if state is None:
            return
        self.ctx.counters.inc("push_chunk_writes")
        self.ctx.counters.inc("push_bytes", sum(n for _, n, _ in src))
        if state == "DONE":
            self._chunk_ended(send, w, state)

    def _chunk_ended(self, send: PushSend, w: Write, state: str) -> None:
        """A chunk WRITE is no longer in flight: stream the next, or complete ``w``."""
        if state != "DONE":
            self.ctx.counters.inc("push_failed_write_state")
            self.links.transfer_failed(send.request_id, w, f"chunk WRITE ended {state}")
            return
        self.links.transfer_ended(w)
        self._record_telemetry(w.handle)
        if not self.links.release(w):
            self._fail(send, w, "NIXL kept a finished chunk WRITE", transfer=True)
            return
        w.chunk_done(count=not send.whole)
        if send.prompt_ended:
            self._arm_last(send, w)
        else:
            self._stream(send, w)

    def _post(self, send: PushSend, w: Write, kv_ready: bool) -> None:
        if w.handle is None:
            self._send_completion(send, w)
            return
        if not kv_ready:
            self._submit_failed(send, w, RuntimeError("KV not readable"))
            return
        state = self._transfer(send, w, w.handle)
        if state is None:
            return
        w.post()
        self.ctx.counters.inc("push_writes")
        self.ctx.counters.inc("push_bytes", w.nbytes)
        if state == "DONE":  # done within the call (UCX copies same-host WRITEs inline)
            self._write_ended(send, w, state)

    def _send_completion(self, send: PushSend, w: Write) -> None:
        """The completion alone: D needs none of the blocks (it holds the prefix)."""
        reg = w.registration
        notif = self._completion(reg)
        try:
            self.ctx.nixl.send_notif(w.sender, notif_msg=notif)
        except Exception as e:
            self.ctx.counters.inc("push_failed_send_notif")
            logger.error("push: completion for %s not sent: %s", reg.request_id, e)
            w.fail(f"completion not sent: {e}")
        else:
            w.done()
        self._settle(send)

    def _kv_ready(self, send: PushSend) -> bool:
        """Wait for the forward pass that wrote the KV (a CUDA event; nothing on CPU)."""
        if send.ready is None:
            return True
        try:
            send.ready.synchronize()
        except Exception:
            logger.exception("push: waiting for the KV of %s failed", send.request_id)
            return False
        return True

    def _transfer(self, send: PushSend, w: Write, handle: Any) -> str | None:
        """Post ``handle`` (a WRITE of ``w``); its state, or None if NIXL did not take
        it (``w`` failed). Recorded in ``LeaseClaims`` first: a request whose lease
        ended gets no WRITE, and one running keeps the blocks from any lease end."""
        if not self.ctx.claims.start_write(send.request_id):
            self._refused(send, w, "be posted", time.monotonic())
            return None
        w.running = True
        try:
            state = self.ctx.nixl.transfer(handle)
            if state == "ERR":
                raise RuntimeError("transfer() returned ERR")
        except Exception as e:
            # NIXL took the handle: what it posted before it failed may still land
            if w.state is WriteState.ARMED:
                w.post()
            self.ctx.counters.inc("push_failed_write_submit")
            self.links.transfer_failed(send.request_id, w, f"WRITE submission failed: {e}")
            return None
        return state

    def _refused(self, send: PushSend, w: Write, what: str, now: float) -> None:
        """``LeaseClaims`` refused a WRITE of ``send``: its blocks are no longer the
        request's (its lease ended, or vLLM preempted it after it was announced).
        Nothing is written; D is told."""
        rid, d_rid = send.request_id, w.registration.request_id
        if self.ctx.claims.preempted(rid):
            self.ctx.counters.inc("push_failed_preempted")
            logger.error(
                "push: %s was preempted after its prompt was announced (its blocks went "
                "back to vLLM) before its WRITE -> %s could %s; not written", rid, d_rid, what,
            )  # fmt: skip
            self.give_up(send, w, "P preempted the request after announcing it", now)
            return
        self.ctx.counters.inc("push_failed_lease_expired")
        logger.error(
            "push: lease of %s ended before its WRITE -> %s could %s; not written",
            rid, d_rid, what,
        )  # fmt: skip
        self.give_up(send, w, "P's lease on the blocks expired", now)

    def _submit_failed(self, send: PushSend, w: Write, e: Exception) -> None:
        # S-FAIL-3: release, count; never _handle_failed_transfer on P.
        self.ctx.counters.inc("push_failed_write_submit")
        logger.error(
            "push: WRITE of %s -> %s not submitted: %s",
            send.request_id, w.registration.request_id, e,
        )  # fmt: skip
        self._fail(send, w, f"WRITE submission failed: {e}", transfer=True)
        self.links.suspect(w.registration.engine_id, f"a WRITE was not submitted: {e}")

    def _write_ended(self, send: PushSend, w: Write, state: str) -> None:
        """A posted WRITE is no longer in flight (``state``: DONE or ERR)."""
        if state != "DONE":
            self.ctx.counters.inc("push_failed_write_state")
            what = f"WRITE ended {state}"
            if w.state is WriteState.ABANDONING:
                what = f"WRITE not done within {self._write_s:g}s, then ended {state}"
            self.links.transfer_failed(send.request_id, w, what)
            return
        self.links.transfer_ended(w)
        if w.state is WriteState.ABANDONING:  # given up on; NIXL has ended it now
            self._fail(send, w, f"WRITE not done within {self._write_s:g}s", transfer=True)
            return
        w.done()
        self._settle(send)  # first: it ends the hand-off clock
        self._record_telemetry(w.handle)
        self.links.release(w)

    def _deadline_passed(self, send: PushSend, w: Write, now: float) -> None:
        reg = w.registration
        if w.landing_until is not None:  # NIXL failed it; nothing of it can land now
            self.links.transfer_ended(w)
            self._fail(send, w, w.failure or "WRITE failed", transfer=True)
            return
        if w.state is WriteState.ABANDONING:
            # No bound of ours ends it: NIXL still runs it, so it may read P's blocks and
            # write D's. Both stay held until NIXL reports it ended (a dead peer: an
            # error once the transport's failure detection gives up, N-REL-1).
            logger.error(
                "push: WRITE of %s -> %s still in flight %gs after it was given up; its "
                "blocks stay held on P and D until NIXL ends it",
                send.request_id, reg.request_id, self._release_s,
                extra=event("push_write_stuck", send.request_id, d_request_id=reg.request_id),
            )  # fmt: skip
            self.ctx.counters.inc("push_failed_write_stuck")
            w.deadline = None
            return
        self.ctx.counters.inc("push_failed_write_timeout")
        logger.error(
            "push: WRITE of %s -> %s not done within push_write_timeout_s=%gs (%s); abandoned",
            send.request_id, reg.request_id, self._write_s, w.state.value,
            extra=event("push_write_timeout", send.request_id, d_request_id=reg.request_id),
        )  # fmt: skip
        self.give_up(send, w, f"WRITE not done within {self._write_s:g}s", now)

    def give_up(
        self, send: PushSend, w: Write, reason: str, now: float, settle: bool = True
    ) -> None:
        """End ``w`` now, unless NIXL cannot cancel it: then wait for it (bounded)."""
        if w.landing_until is not None:
            return  # failed already: it ends when its rest can no longer land
        transfer = w.in_flight
        if not self.links.release(w):
            if w.in_flight and w.state is not WriteState.ABANDONING:
                w.abandon(now + self._release_s)  # D is told when it leaves PROC, or at the bound
                return
            self.links.let_go(w)
        w.fail(reason, transfer=transfer)
        self.links.tell_d(w, reason)
        if settle:
            self._settle(send)

    def _fail(self, send: PushSend, w: Write, reason: str, transfer: bool = False) -> None:
        if not self.links.release(w):
            self.links.let_go(w)
        w.fail(reason, transfer=transfer)
        self.links.tell_d(w, reason)
        self._settle(send)

    def _settle(self, send: PushSend) -> None:
        """Report ``send`` settled once every WRITE it started ended and it is complete
        (or failed); else, with nothing in flight, its blocks are under the lease again."""
        if not send.settle():
            if send.idle:
                self.ctx.claims.unprotect(send.request_id)
            return
        if send.state is SendState.WRITTEN:
            self.ctx.counters.observe("push_handoff_seconds", time.monotonic() - send.finished_at)
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
