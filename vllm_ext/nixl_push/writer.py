# SPDX-License-Identifier: Apache-2.0
"""The ``nixl-push-writer`` thread: one per TP rank, the only push caller of NIXL.

Ownership (S-WRT-1, S-WRT-3)::

    engine thread (worker.py)            writer thread (this loop; D's PUSH_REGs:
                                         registrations.py; P's WRITEs: writes.py)
    -------------------------            -------------------------------------------
    start_load_kv ──► _reg_send_inbox ──► send_notif(PUSH_REG)             [D]
    start_load_kv ──► _cancel_inbox ────► send_notif(PUSH_CANCEL)          [D]
    start_load_kv ──► _live_inbox ──────► live P requests (heartbeats)     [P]
    start_load_kv ──► _finished_blocks_inbox ─┐   (announced, then final)
    wait_for_save ──► _finished_blocks_inbox ─┤
    handshake cb  ──► _deferred_push_inbox ───┼► Rendezvous ─► initialize_xfer +
    handshake cb  ──► _deferred (RegConnected)│                transfer(WRITE, notif) [P]
    get_finished  ──► _evict_finished_inbox ──┘
                                          get_new_notifs ─► PUSH_REG, PUSH_CANCEL ─► dlinks [P]
    get_finished ◄── outbox ◄─ RegSent ..., Settled, Inbound(sender, completion | PUSH_FAIL
                               | PUSH_HB | HB)           check_xfer_state / release [P]

The writer never sees the worker: it gets one
:class:`~vllm_ext.nixl_push.context.WriterContext` and talks back through the typed
messages of messages.py, on one ordered ``outbox``.

Every notification is attributed to the NIXL agent that sent it (``get_new_notifs``
is keyed by it): P checks a PUSH_CANCEL against the agent that registered the
request (dlinks.py), D each completion, PUSH_FAIL and PUSH_HB against the producers
of the request (recv.py).

Wake model (S-WRT-2): the thread blocks on ``_wake`` (an Event). It is set by
``start_load_kv`` only when a step hands over work, by every ``get_finished``
(so inbound notifications are read at least once per engine step) and by
handshake callbacks. While P holds finished blocks that wait for a
registration, or WRITEs are in flight, or D awaits a producer's answer to a
PUSH_REG it sent, it also wakes itself every ``push_writer_poll_interval_ms``.
Otherwise it sleeps: an idle engine costs no CPU here.
At the end of a forward pass that completed prompts, P's engine thread hands their
blocks over with ``hand_over``: it wakes the writer and waits (at most
``push_handover_wait_ms``) until that pass has posted their WRITEs, so the writer
gets the core and the GIL at once instead of after the rest of the engine step
(P only: P's step output is not on the path to a token). D's engine thread never
waits for this thread: its ``get_finished`` takes what this thread read so far (it
self-polls while completions are awaited, so one that arrived during a step is
usually read by the step's end), and the rest is taken by the next step. Only with
``push_recv_idle_wait_ms`` set (off by default) does a D step that runs no request
wait in ``await_notifs`` (bounded) while this thread reads notifications every
``WATCH_POLL_S``.

Handshakes never block this thread (S-WRT-5): ``request_handshake`` starts one on
vLLM's handshake executor and the callback re-queues the operation. A failed
handshake fails (D) or drops (P) the operation; nothing is retried in a loop
(S-FAIL-1/2).

An unexpected error while handling one item is logged and counted
(``push_failed_internal``) and settles the request it concerns (failed), so it is
never left waiting; the thread carries on with the next item.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from vllm_ext.log import get_logger
from vllm_ext.nixl_push.context import WriterContext
from vllm_ext.nixl_push.messages import (
    Announced,
    CancelRecv,
    Connected,
    Deferred,
    HandOver,
    Inbound,
    LiveRequests,
    RegConnected,
    ToEngine,
)
from vllm_ext.nixl_push.metadata import PushRegMeta
from vllm_ext.nixl_push.registrations import Registrations
from vllm_ext.nixl_push.wire import (
    PUSH_REG_PREFIX,
    Heartbeat,
    Malformed,
    PushCancel,
    PushHeartbeat,
    PushRegistration,
    parse_notif,
)
from vllm_ext.nixl_push.writes import Writes

logger = get_logger(__name__)

WRITER_THREAD_NAME = "nixl-push-writer"
#: While the engine thread waits in ``await_notifs``, the writer reads
#: notifications this often (seconds).
WATCH_POLL_S = 50e-6
#: With nothing to poll, the writer still reads notifications this often (seconds):
#: NIXL hands them over only when asked, and an idle engine does not step, so a
#: PUSH_CANCEL to an idle P would wait for its next request (and D, which keeps the
#: blocks until P answers, with it).
IDLE_NOTIF_POLL_S = 0.1
#: How much longer than its deadline the engine thread waits for the writer to end a watch.
WATCH_END_SLACK_S = 0.05

_T = TypeVar("_T")


class _Described:
    """An inbox item named in the writer's error log: formatted only when logged (its
    repr holds its block lists, and the prompt key's digest)."""

    __slots__ = ("item",)

    def __init__(self, item: object) -> None:
        self.item = item

    def __str__(self) -> str:
        return f"{type(self.item).__name__} {self.item}"


def _nothing(item: object) -> None:
    """Nothing to settle after an error (the item concerns no single request)."""


class PushWriter:
    """State and loop of the writer thread. Built by the worker; ``start()`` after KV
    registration; ``stop()`` at shutdown."""

    def __init__(self, ctx: WriterContext) -> None:
        self.ctx = ctx
        self._poll_s = ctx.config.push_writer_poll_interval_ms / 1e3
        self._wake = threading.Event()
        self._stop = False
        # Hand-over sequence: bumped by the engine thread after it enqueued work
        # (handed_seq), recorded by this thread when a pass that drained it ends.
        self._handed_seq = 0
        self._drained_seq = 0
        self._drained = threading.Condition()
        #: monotonic deadline of an engine thread waiting in await_notifs; 0: none
        self._watch_until = 0.0
        self._watch_news = 0
        self._thread: threading.Thread | None = None
        # Inboxes: many producers, one consumer (this thread).
        self._reg_send_inbox: queue.SimpleQueue[tuple[PushRegMeta, str]] = queue.SimpleQueue()
        self._finished_blocks_inbox: queue.SimpleQueue[HandOver] = queue.SimpleQueue()
        self._deferred_push_inbox: queue.SimpleQueue[Deferred] = queue.SimpleQueue()
        self._evict_finished_inbox: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._cancel_inbox: queue.SimpleQueue[CancelRecv] = queue.SimpleQueue()
        self._live_inbox: queue.SimpleQueue[LiveRequests] = queue.SimpleQueue()
        #: everything for the engine thread, in order (drained in get_finished)
        self.outbox: queue.SimpleQueue[ToEngine] = queue.SimpleQueue()
        #: messages posted that may end a request (all but heartbeats): await_notifs
        #: returns on those only
        self._news = 0
        # P: the sends of this rank.
        self.writes = Writes(ctx, self._post, self._deferred_push_inbox, self._wake.set)
        # D: each request's PUSH_REG (lifecycle.RegOut), until the engine thread evicts it.
        self.registrations = Registrations(
            ctx, self._post, self._deferred_push_inbox, self._cancel_inbox, self._wake.set
        )

    @property
    def nixl(self) -> Any:
        return self.ctx.nixl

    @nixl.setter
    def nixl(self, value: Any) -> None:  # e.g. a tracing wrapper (devkit.bench)
        self.ctx.nixl = value

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
        self.writes.release_all()

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
        ``WATCH_POLL_S``; return as soon as something for the engine thread arrived.
        True if something did."""
        news = self._news
        self._wait_for_pass(timeout, watch=True)
        return self._news != news

    def _wait_for_pass(self, timeout: float, watch: bool) -> bool:
        """Block until this thread ended a pass over everything enqueued so far (with
        ``watch``, its passes go on until news arrives or ``timeout`` passes)."""
        with self._drained:
            self._handed_seq += 1
            seq = self._handed_seq
            if watch:
                self._watch_news = self._news
                self._watch_until = time.monotonic() + timeout
                timeout += WATCH_END_SLACK_S  # let the writer end the watch itself
            self._wake.set()
            if timeout <= 0:
                return False
            return self._drained.wait_for(lambda: self._drained_seq >= seq, timeout)

    def send_registration(self, reg: PushRegMeta, reply_token: str) -> None:
        """D: send this PUSH_REG with this rank's ``reply_token`` (S-WIR-3; ``reg`` is
        the scheduler's, shared by the ranks of one process: this thread makes the
        rank's copy)."""
        self._reg_send_inbox.put((reg, reply_token))

    def add_finished(self, finished: HandOver) -> None:
        """P: a hand-over of a request's blocks (a ``KvFinal``: its KV is final). Its
        lease is protected from now until this thread decides (``LeaseClaims``)."""
        self.ctx.claims.hand(finished.request_id)
        self._finished_blocks_inbox.put(finished)

    def announce(self, finished: Announced) -> None:
        """P: the forward pass now running completes this prompt. The writer matches
        it and prepares its WRITEs (descriptors, ``initialize_xfer``) meanwhile;
        ``add_finished`` of its ``KvFinal`` once the KV is final posts them."""
        self.add_finished(finished)

    def deliver_final(self, finished: HandOver) -> None:
        """KV-ready watcher thread: the request's KV is final now; post its WRITEs."""
        self._finished_blocks_inbox.put(finished)
        self._wake.set()

    def set_live(self, live: LiveRequests) -> None:
        """P: requests P's scheduler started or dropped (see ``LiveRequests``)."""
        self._live_inbox.put(live)

    def evict(self, request_id: str) -> None:
        """The engine thread is done with a request (P: sent or expired; D: received)."""
        self._evict_finished_inbox.put(request_id)

    def cancel(self, request_id: str) -> None:
        """D: ask the producers of a request to stand down."""
        self._cancel_inbox.put(CancelRecv(request_id))

    def cancel_again(self, request_id: str, producers: frozenset[str]) -> None:
        """D: ask these producers (their answers are overdue) to stand down once more."""
        self._cancel_inbox.put(CancelRecv(request_id, producers))
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def idle(self) -> bool:
        """No push state at all (tests and shutdown checks; racy by nature)."""
        return (
            self.writes.rendezvous.is_empty()
            and self._reg_send_inbox.empty()
            and self._finished_blocks_inbox.empty()
            and self._deferred_push_inbox.empty()
            and self._cancel_inbox.empty()
            and self._live_inbox.empty()
            and not len(self.registrations.table)
        )

    # -- the loop ----------------------------------------------------------------------
    def _run(self) -> None:
        logger.debug("push writer started (rank %d)", self.ctx.identity.tp_rank)
        while not self._stop:
            if self._watch_until:  # the engine thread waits for news: poll fast
                timeout: float | None = WATCH_POLL_S
            else:
                busy = self.writes.busy or self._awaiting_completion()
                timeout = self._poll_s if busy else IDLE_NOTIF_POLL_S
            self._wake.wait(timeout)
            self._wake.clear()
            if self._stop:
                break
            seq = self._handed_seq  # everything enqueued up to here is drained below
            self._guarded(self.step, "a writer pass")
            if self._watch_until:
                if self._news == self._watch_news and time.monotonic() < self._watch_until:
                    continue  # keep the engine thread waiting; poll again
                self._watch_until = 0.0
            if seq != self._drained_seq:
                with self._drained:
                    self._drained_seq = seq
                    self._drained.notify_all()

    def _awaiting_completion(self) -> bool:
        """D: a PUSH_REG went out and its producers' answers may come: read
        notifications at the busy period, so that ``get_finished`` (which never waits
        for this thread) finds a completion that arrived during an engine step."""
        return self.registrations.awaiting_answers

    def step(self) -> None:
        """One pass over every inbox and NIXL. Runs on the writer thread only."""
        w, regs = self.writes, self.registrations
        # Cancels before evictions: a D request cancelled in the step its push
        # completed is still known (its RegOut) when its cancel is handled.
        self._drain(self._cancel_inbox, regs.cancel, _nothing)
        self._drain(self._evict_finished_inbox, self._evict, _nothing)
        self._drain(self._live_inbox, w.on_live, _nothing)
        self._drain(self._reg_send_inbox, regs.send, regs.fail_after_error)
        self._drain(self._finished_blocks_inbox, w.on_finished, self._fail_send)
        self._drain(self._deferred_push_inbox, self._on_deferred, self._fail_deferred)
        self._read_notifs()
        now = time.monotonic()
        self._guarded(w.poll, "polling WRITEs")
        self._guarded(functools.partial(w.check_deadlines, now), "checking deadlines")
        self._guarded(functools.partial(w.links.heartbeat, now), "sending heartbeats")

    def _drain(
        self,
        q: queue.SimpleQueue[_T],
        fn: Callable[[_T], None],
        settle: Callable[[_T], None],
    ) -> None:
        if q.empty():  # the common case, without raising queue.Empty
            return
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            if not self._guarded(functools.partial(fn, item), _Described(item)):
                self._guarded(functools.partial(settle, item), "settling after an error")

    def _guarded(self, fn: Callable[[], None], what: str | _Described) -> bool:
        """Run ``fn``; an unexpected error is logged and counted, never raised (this
        thread must not die). False if it raised. (``what`` is formatted only then.)"""
        try:
            fn()
            return True
        except Exception:
            logger.exception("push writer: unexpected error in %s", what)
            self.ctx.counters.inc("push_failed_internal")
            return False

    def _post(self, msg: ToEngine) -> None:
        """To the engine thread (this thread only)."""
        self.outbox.put(msg)
        if not (isinstance(msg, Inbound) and isinstance(msg.notif, (Heartbeat, PushHeartbeat))):
            self._news += 1

    # -- the catch-all: settle what an item concerned ------------------------------------
    def _fail_send(self, blocks: HandOver) -> None:
        self.writes.give_up_request(blocks.request_id, "internal error in the push writer")

    def _fail_deferred(self, item: Deferred) -> None:
        if isinstance(item, Connected):
            self.writes.give_up_request(item.request_id, "internal error in the push writer")
        elif isinstance(item, RegConnected):
            self.registrations.fail_connected_after_error(item)

    def _on_deferred(self, item: Deferred) -> None:
        if isinstance(item, RegConnected):
            self.registrations.on_connected(item)
        else:
            self.writes.on_deferred(item)

    def _evict(self, request_id: str) -> None:
        """The engine thread is done with a request (P: sent or lease expired; D: received)."""
        self.registrations.evict(request_id)
        self.writes.evict(request_id)

    # -- inbound notifications ---------------------------------------------------------
    def _read_notifs(self) -> None:
        try:
            notifs = self.ctx.nixl.get_new_notifs()
        except Exception:
            logger.exception("push: get_new_notifs failed")
            return
        for sender, msgs in notifs.items():
            for raw in msgs:
                self._guarded(functools.partial(self._on_notif, str(sender), raw), "a notification")

    def _on_notif(self, sender: str, raw: bytes) -> None:
        n = parse_notif(raw)
        if isinstance(n, PushRegistration):
            self.writes.links.on_registration(n, sender)
        elif isinstance(n, PushCancel):
            self.writes.links.on_cancel(n, sender)
        elif isinstance(n, Malformed):
            if raw.startswith(PUSH_REG_PREFIX):
                self.ctx.counters.inc("push_regs_rejected")
            self.ctx.drops.drop(sender, n)
        else:
            self._post(Inbound(sender, n))
