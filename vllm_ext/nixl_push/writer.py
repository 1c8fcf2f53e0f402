# SPDX-License-Identifier: Apache-2.0
"""The ``nixl-push-writer`` thread: one per TP rank, the only push caller of NIXL.

Ownership (S-WRT-1, S-WRT-3)::

    engine thread (worker.py)            writer thread (this file; P's WRITEs: writes.py)
    -------------------------            -------------------------------------------
    start_load_kv ──► _reg_send_inbox ──► send_notif(PUSH_REG)             [D]
    start_load_kv ──► _finished_blocks_inbox ─┐   (announced, then final)
    wait_for_save ──► _finished_blocks_inbox ─┤
    handshake cb  ──► _deferred_push_inbox ───┼► Rendezvous ─► initialize_xfer +
    handshake cb  ──► _reg_send_inbox (replay)│                transfer(WRITE, notif) [P]
    get_finished  ──► _evict_finished_inbox ──┘
                                          get_new_notifs ─► PUSH_REG ─► Rendezvous [P]
    get_finished ◄── _pending_completion_notifs ◄─ completions, PUSH_FAIL, HB  [D/P]
    get_finished ◄── _results ◄─ "sent" / "write failed" / "recv failed"
                                          check_xfer_state / release_xfer_handle [P]

Wake model (S-WRT-2): the thread blocks on ``_wake`` (an Event). It is set by
``start_load_kv`` only when a step hands over work, by every ``get_finished``
(so inbound notifications are read at least once per engine step) and by
handshake callbacks. While P holds finished blocks that wait for a
registration, or WRITEs are in flight, it also wakes itself every
``push_writer_poll_interval_ms``. Otherwise it sleeps: an idle engine costs no CPU here.
At the end of a forward pass that completed prompts, P's engine thread hands their
blocks over with ``hand_over``: it wakes the writer and waits (at most
``push_handover_wait_ms``) until that pass has posted their WRITEs, so the writer
gets the core and the GIL at once instead of after the rest of the engine step.
D's ``get_finished`` does the same while completions are awaited, so a completion
that arrived during a step is read and reported by that step. In a D step that runs
no request, ``await_notifs`` instead keeps the engine thread (bounded by
``push_recv_idle_wait_ms``) while this thread reads notifications every
``WATCH_POLL_S``: D learns of a completion within ~0.1 ms rather than at its next
empty engine step.

Handshakes never block this thread (S-WRT-5): ``_ensure_handshake`` starts
one on the base worker's handshake executor and the callback re-queues the
operation. A failed handshake fails (D) or drops (P) the operation; nothing is
retried in a loop (S-FAIL-1/2).
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from vllm_ext.log import get_logger
from vllm_ext.nixl_push.matching import FinishedBlocks, Match, Rendezvous
from vllm_ext.nixl_push.metadata import PushRegMeta
from vllm_ext.nixl_push.wire import CANCELLED as CANCELLED_REASON
from vllm_ext.nixl_push.wire import (
    Completion,
    Heartbeat,
    Malformed,
    PushCancel,
    PushFailed,
    PushRegistration,
    parse_notif,
)
from vllm_ext.nixl_push.writes import Abandoned, InflightPush, PushWritesMixin

if TYPE_CHECKING:
    from vllm_ext.nixl_push.worker import NixlPushConnectorWorker

logger = get_logger(__name__)

WRITER_THREAD_NAME = "nixl-push-writer"
#: P keeps an unmatched PUSH_REG for this fraction of push_registration_timeout, so
#: it gives up before D's watchdog frees the blocks it would write into.
P_REGISTRATION_TTL_FRACTION = 0.8
#: While the engine thread waits in ``await_notifs``, the writer reads
#: notifications this often (seconds).
WATCH_POLL_S = 50e-6
#: How much longer than its deadline the engine thread waits for the writer to end a watch.
WATCH_END_SLACK_S = 0.05


# Results handed to the engine thread.
RECV_FAILED = "recv_failed"  # (RECV_FAILED, d_request_id, reason)
CANCELLED = "cancelled"  # (CANCELLED, d_request_id): cancelled before PUSH_REG was sent
SEND_FAILED = "send_failed"  # (SEND_FAILED, d_request_id, reason): PUSH_REG reached some ranks


@dataclasses.dataclass(frozen=True)
class _ReplyCancelled:
    """P: answer a PUSH_CANCEL once the handshake to D is done."""

    cancel: PushCancel


class PushWriter(PushWritesMixin):
    """State and loop of the writer thread. Built by the worker; ``start()`` after KV
    registration; ``stop()`` at shutdown."""

    def __init__(self, worker: NixlPushConnectorWorker) -> None:
        self.worker = worker
        self.nixl = worker.nixl_wrapper
        self.counters = worker.push_counters
        cfg = worker.push_config
        self._poll_s = cfg.push_writer_poll_interval_ms / 1e3
        self._p_reg_ttl_s = cfg.push_registration_timeout * P_REGISTRATION_TTL_FRACTION
        self._wake = threading.Event()
        self._stop = False
        # Hand-over sequence: bumped by the engine thread after it enqueued work
        # (handed_seq), recorded by this thread when a pass that drained it ends.
        self._handed_seq = 0
        self._drained_seq = 0
        self._drained = threading.Condition()
        #: monotonic deadline of an engine thread waiting in await_notifs; 0: none
        self._watch_until = 0.0
        self._thread: threading.Thread | None = None
        # Inboxes: many producers, one consumer (this thread).
        self._reg_send_inbox: queue.SimpleQueue[PushRegMeta] = queue.SimpleQueue()
        self._finished_blocks_inbox: queue.SimpleQueue[FinishedBlocks] = queue.SimpleQueue()
        self._deferred_push_inbox: queue.SimpleQueue[Match | Abandoned | _ReplyCancelled] = (
            queue.SimpleQueue()
        )
        self._evict_finished_inbox: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._cancel_inbox: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        # Outboxes, drained by the engine thread in get_finished.
        self.pending_completion_notifs: queue.SimpleQueue[Completion | PushFailed | Heartbeat] = (
            queue.SimpleQueue()
        )
        self.results: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        # Writer-local state.
        self.rendezvous = Rendezvous(p_tp_size=worker.world_size)
        self._inflight: dict[str, InflightPush] = {}
        #: P request ids whose blocks a WRITE may still read: handed over and not yet
        #: found unmatched, or matched / in flight. The engine thread adds an id when
        #: it hands the blocks over, this thread removes it; the engine thread reads
        #: it (set operations are atomic) to keep those leases alive.
        self.busy_ids: set[str] = set()
        # D: requests whose PUSH_REG went out, and requests cancelled before it did.
        self._d_sent: dict[str, str] = {}  # D request id -> P engine id
        self._d_cancelled: set[str] = set()

    # -- engine-thread API -------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=WRITER_THREAD_NAME, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        with self._drained:  # release an engine thread waiting in hand_over
            self._drained_seq = self._handed_seq
            self._drained.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._release_all()

    def wake(self) -> None:
        self._wake.set()

    def hand_over(self, timeout: float) -> bool:
        """Wake this thread and block the engine thread, up to ``timeout`` seconds,
        until a pass has taken everything enqueued so far (P: the WRITEs of blocks
        just handed over are posted). The writer shares its core with the engine
        thread: a bare ``wake`` leaves it waiting for the CPU and the GIL while the
        engine thread finishes its step; blocking here yields both at once. True if
        the pass ended in time."""
        return self._wait_for_pass(timeout, watch=False)

    def await_notifs(self, timeout: float) -> bool:
        """D, in an engine step that runs no request: block the engine thread up to
        ``timeout`` seconds while this thread reads notifications every
        ``WATCH_POLL_S``; return as soon as something for the engine thread arrived
        (a completion, a PUSH_FAIL, a result). True if something did."""
        self._wait_for_pass(timeout, watch=True)
        return self._has_news()

    def _wait_for_pass(self, timeout: float, watch: bool) -> bool:
        """Block until this thread ended a pass over everything enqueued so far (with
        ``watch``, its passes go on until news arrives or ``timeout`` passes)."""
        with self._drained:
            self._handed_seq += 1
            seq = self._handed_seq
            if watch:
                self._watch_until = time.monotonic() + timeout
                timeout += WATCH_END_SLACK_S  # let the writer end the watch itself
            self._wake.set()
            if timeout <= 0:
                return False
            return self._drained.wait_for(lambda: self._drained_seq >= seq, timeout)

    def _has_news(self) -> bool:
        return not (self.pending_completion_notifs.empty() and self.results.empty())

    def send_registration(self, reg: PushRegMeta) -> None:
        self._reg_send_inbox.put(reg)

    def add_finished(self, finished: FinishedBlocks) -> None:
        self.busy_ids.add(finished.request_id)
        self._finished_blocks_inbox.put(finished)

    def mark_busy(self, request_id: str) -> None:
        """Engine thread: a WRITE may read this request's blocks soon (lease held)."""
        self.busy_ids.add(request_id)

    def deliver_final(self, finished: FinishedBlocks) -> None:
        """KV-ready watcher thread: the request's KV is final now; post its WRITEs."""
        self.add_finished(finished)
        self._wake.set()

    def announce(self, finished: FinishedBlocks) -> None:
        """P: the forward pass now running completes this prompt (``finished.final``
        is False). The writer matches it and prepares its WRITEs (descriptors,
        ``initialize_xfer``) meanwhile; ``add_finished`` with the same request id
        once the KV is final posts them."""
        self.add_finished(finished)

    def evict(self, request_id: str) -> None:
        """The engine thread is done with a request (P: sent or expired; D: received)."""
        self._evict_finished_inbox.put(request_id)

    def cancel(self, d_request_id: str, p_engine_id: str) -> None:
        """D: the request was aborted before its KV arrived."""
        self._cancel_inbox.put((d_request_id, p_engine_id))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def idle(self) -> bool:
        """No push state at all (tests and shutdown checks; racy by nature)."""
        return (
            self.rendezvous.is_empty()
            and not self._inflight
            and self._reg_send_inbox.empty()
            and self._finished_blocks_inbox.empty()
            and self._deferred_push_inbox.empty()
            and not self._d_sent
            and not self._d_cancelled
        )

    # -- the loop ----------------------------------------------------------------------
    def _run(self) -> None:
        logger.debug("push writer started (rank %d)", self.worker.tp_rank)
        while not self._stop:
            if self._watch_until:  # the engine thread waits for news: poll fast
                timeout: float | None = WATCH_POLL_S
            else:
                busy = self.rendezvous.has_unmatched_finished or any(
                    i.handles for i in self._inflight.values()
                )
                timeout = self._poll_s if busy else None
            self._wake.wait(timeout)
            self._wake.clear()
            if self._stop:
                break
            seq = self._handed_seq  # everything enqueued up to here is drained below
            try:
                self.step()
            except Exception:  # never let the thread die: log, count, carry on
                logger.exception("push writer: unexpected error (continuing)")
                self.counters.inc("push_failed_internal")
            if self._watch_until:
                if not self._has_news() and time.monotonic() < self._watch_until:
                    continue  # keep the engine thread waiting; poll again
                self._watch_until = 0.0
            if seq != self._drained_seq:
                with self._drained:
                    self._drained_seq = seq
                    self._drained.notify_all()

    def step(self) -> None:
        """One pass over every inbox and NIXL. Runs on the writer thread only."""
        # Cancels before evictions: a D request cancelled in the step its push
        # completed is still known (_d_sent) when its cancel is handled.
        self._drain(self._cancel_inbox, self._on_local_cancel)
        self._drain(self._evict_finished_inbox, self._evict)
        self._drain(self._reg_send_inbox, self._send_registration)
        self._drain(self._finished_blocks_inbox, self._on_finished)
        self._drain(self._deferred_push_inbox, self._on_deferred)
        self._read_notifs()
        self._poll_writes()
        for reg in self.rendezvous.expire_registrations(time.monotonic(), self._ttl_of):
            self.counters.inc("push_regs_expired")
            logger.warning(
                "push: PUSH_REG for %s from %s waited %.0fs for its blocks; dropped",
                reg.request_id, reg.engine_id, self._p_reg_ttl_s,
            )  # fmt: skip

    def _ttl_of(self, reg: PushRegistration) -> float:
        """P keeps an unmatched PUSH_REG for a fraction of D's watchdog (ours if D did
        not say), so it gives up before D stops waiting."""
        timeout = reg.timeout_s or self.worker.push_config.push_registration_timeout
        return min(self._p_reg_ttl_s, timeout * P_REGISTRATION_TTL_FRACTION)

    @staticmethod
    def _drain(q: queue.SimpleQueue, fn: Callable[[Any], None]) -> None:
        if q.empty():  # the common case, without raising queue.Empty
            return
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            fn(item)

    # -- D: registrations --------------------------------------------------------------
    def _send_registration(self, meta: PushRegMeta) -> None:
        w = self.worker
        if meta.request_id in self._d_cancelled:
            self._d_cancelled.discard(meta.request_id)
            self.counters.inc("push_cancels_unsent")
            self.results.put((CANCELLED, meta.request_id))
            return
        fut = self._handshake(meta.p_engine_id, meta.p_host, meta.p_port, meta.p_tp_size)
        if fut is not None:
            fut.add_done_callback(functools.partial(self._after_d_handshake, meta=meta))
            return
        agents = w.remote_agents_of(meta.p_engine_id)
        problem = w.stage_mismatch(meta, agents)
        if problem is not None:  # the D leg's pp_size is wrong: fail this request only
            self._recv_failed(meta.request_id, problem)
            return
        reg = w.make_registration(meta).encode()
        for n, (p_rank, agent) in enumerate(sorted(agents.items())):
            try:
                self.nixl.send_notif(agent, notif_msg=reg)
            except Exception as e:
                self.counters.inc("push_failed_send_notif")
                reason = f"sending PUSH_REG to P rank {p_rank}: {e}"
                if n == 0:  # reached no P rank: nothing can be written
                    self._recv_failed(meta.request_id, reason)
                else:  # some ranks may write: cancel with them before freeing
                    self._d_sent[meta.request_id] = meta.p_engine_id
                    logger.error("push: request %s fails: %s", meta.request_id, reason)
                    self.results.put((SEND_FAILED, meta.request_id, reason))
                return
        self._d_sent[meta.request_id] = meta.p_engine_id
        self.counters.inc("push_regs_sent")

    def _on_local_cancel(self, item: tuple[str, str]) -> None:
        """D: ask every P rank we registered with to stand down (they answer)."""
        rid, p_engine = item
        if rid not in self._d_sent:
            self._d_cancelled.add(rid)  # not sent yet: _send_registration reports it
            return
        w = self.worker
        msg = PushCancel(
            engine_id=w.engine_id, request_id=rid, tp_rank=w.tp_rank, tp_size=w.world_size,
            host=w.side_channel_host, port=w.side_channel_port,
        ).encode()  # fmt: skip
        for p_rank, agent in sorted(w.remote_agents_of(p_engine).items()):
            try:
                self.nixl.send_notif(agent, notif_msg=msg)
            except Exception as e:
                # An unreachable rank cannot answer; the engine thread's cancel
                # deadline ends the request (failing early could free blocks that
                # a rank we could not reach is still writing).
                self.counters.inc("push_failed_send_notif")
                logger.warning("push: PUSH_CANCEL for %s to P rank %d: %s", rid, p_rank, e)
        self.counters.inc("push_cancels_sent")

    def _after_d_handshake(self, fut: Future, meta: PushRegMeta) -> None:
        # Handshake executor thread: re-queue or fail, never touch NIXL here.
        try:
            fut.result()
        except Exception as e:
            self.counters.inc("push_failed_handshake")
            self._recv_failed(meta.request_id, f"handshake with P {meta.p_engine_id} failed: {e}")
            return
        self._reg_send_inbox.put(meta)
        self._wake.set()

    def _recv_failed(self, d_request_id: str, reason: str) -> None:
        logger.error("push: request %s fails: %s", d_request_id, reason)
        self.results.put((RECV_FAILED, d_request_id, reason))

    # -- P: rendezvous -----------------------------------------------------------------
    def _on_finished(self, finished: FinishedBlocks) -> None:
        known = self.rendezvous.finished(finished.request_id)
        if finished.final and known is not None and not known.final:
            # The announced request's KV is final now: post what was prepared.
            known.finished_at, known.ready, known.final = (
                finished.finished_at, finished.ready, True,
            )  # fmt: skip
            self._post_armed(known)
            self._settle_if_done(known.request_id)  # e.g. its preparation failed
            if known.request_id not in self._inflight:
                self.busy_ids.discard(known.request_id)
            return
        matches = self.rendezvous.add_finished(finished)
        if matches is False:
            logger.debug("push: %s already finished; ignored", finished.request_id)
        for m in matches if isinstance(matches, list) else ():
            self._start_push(m)
        if finished.request_id not in self._inflight:
            self.busy_ids.discard(finished.request_id)  # unmatched: the lease applies

    def _on_registration(self, reg: PushRegistration) -> None:
        self.counters.inc("push_regs_received")
        res = self.rendezvous.add_registration(reg, time.monotonic())
        if res is False:
            self.counters.inc("push_regs_duplicate")
        elif isinstance(res, Match):
            self._start_push(res)
        else:
            # Connect to D now, while P is still prefilling: the WRITE then fires
            # the moment the blocks are finished instead of after a handshake.
            self._handshake(reg.engine_id, reg.host, reg.port, reg.tp_size)

    def _on_remote_cancel(self, c: PushCancel) -> None:
        """P: D aborted a request. Drop its registration unless a WRITE already started."""
        self.counters.inc("push_cancels_received")
        state = self.rendezvous.cancel_registration((c.engine_id, c.request_id, c.tp_rank))
        if state != "served":  # a started WRITE answers with its completion
            self._reply_cancelled(_ReplyCancelled(c))

    def _reply_cancelled(self, item: _ReplyCancelled) -> None:
        c = item.cancel
        agent = self.worker.remote_agents_of(c.engine_id).get(c.tp_rank)
        if agent is None:
            fut = self._handshake(c.engine_id, c.host, c.port, c.tp_size)
            if fut is not None:
                fut.add_done_callback(functools.partial(self._after_cancel_handshake, item=item))
                return
            agent = self.worker.remote_agents_of(c.engine_id).get(c.tp_rank)
        if agent is None:
            logger.warning("push: cannot answer PUSH_CANCEL for %s: no agent", c.request_id)
            return
        try:
            self.nixl.send_notif(
                agent, notif_msg=PushFailed(c.request_id, CANCELLED_REASON).encode()
            )
        except Exception:
            logger.warning(
                "push: answer to PUSH_CANCEL for %s not sent", c.request_id, exc_info=True
            )

    def _after_cancel_handshake(self, fut: Future, item: _ReplyCancelled) -> None:
        if fut.exception() is None:
            self._deferred_push_inbox.put(item)
            self._wake.set()

    def _start_push(self, match: Match) -> None:
        self.counters.inc(f"push_match_{match.rule}")
        fin = match.finished
        self._inflight.setdefault(fin.request_id, InflightPush(fin)).pending += 1
        self.busy_ids.add(fin.request_id)
        reg = match.registration
        fut = self._handshake(reg.engine_id, reg.host, reg.port, reg.tp_size)
        if fut is not None:
            fut.add_done_callback(functools.partial(self._after_p_handshake, match=match))
            return
        self._write(match)

    def _on_deferred(self, item: Match | Abandoned | _ReplyCancelled) -> None:
        """An operation re-queued by a handshake callback."""
        if isinstance(item, _ReplyCancelled):
            self._reply_cancelled(item)
        else:
            self._write(item)

    def _after_p_handshake(self, fut: Future, match: Match) -> None:
        try:
            fut.result()
        except Exception as e:
            # S-FAIL-2: drop; P's blocks return via the lease, D's via its watchdog.
            self.counters.inc("push_failed_handshake")
            logger.error(
                "push_handshake_failed: P request %s -> D %s: %s",
                match.finished.request_id, match.registration.engine_id, e,
            )  # fmt: skip
            self._deferred_push_inbox.put(Abandoned(match))
            self._wake.set()
            return
        self._deferred_push_inbox.put(match)
        self._wake.set()

    def _evict(self, p_request_id: str) -> None:
        """The engine thread is done with a request (P: sent or lease expired; D: received)."""
        self._d_sent.pop(p_request_id, None)
        self._d_cancelled.discard(p_request_id)
        self.rendezvous.evict(p_request_id)
        inflight = self._inflight.get(p_request_id)
        if inflight is not None and inflight.armed:
            # Announced, but its KV never became final (the engine gave up on it):
            # nothing may be written; D hears it now instead of at its watchdog.
            for handle, reg, _ in inflight.armed:
                if handle is not None:
                    self._release(handle)
                self._tell_d_failed(reg, "P's KV was never final")
            inflight.armed = []
        if inflight is not None and not inflight.handles:
            del self._inflight[p_request_id]
            self.busy_ids.discard(p_request_id)

    # -- inbound notifications ---------------------------------------------------------
    def _read_notifs(self) -> None:
        try:
            notifs = self.nixl.get_new_notifs()
        except Exception:
            logger.exception("push: get_new_notifs failed")
            return
        for sender, msgs in notifs.items():
            for raw in msgs:
                n = parse_notif(raw)
                if isinstance(n, PushRegistration):
                    self._on_registration(n)
                elif isinstance(n, PushCancel):
                    self._on_remote_cancel(n)
                elif isinstance(n, Malformed):
                    self.counters.inc("push_notifs_malformed")
                    if raw.startswith(b"PUSH_REG:"):
                        self.counters.inc("push_regs_rejected")
                    self.worker.log_malformed(sender, n)
                else:
                    self.pending_completion_notifs.put(n)

    # -- helpers -----------------------------------------------------------------------
    def _handshake(self, engine_id: str, host: str, port: int, tp_size: int) -> Future | None:
        """Non-blocking: None when connected, else the pending handshake's future."""
        try:
            return self.worker._ensure_handshake(engine_id, host, port, tp_size)
        except Exception as e:  # e.g. an invalid tp_size in a peer's PUSH_REG
            f: Future = Future()
            f.set_exception(e)
            return f
