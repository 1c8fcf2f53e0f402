# SPDX-License-Identifier: Apache-2.0
"""P's side of the push lifecycle: a request's blocks (:class:`PushSend`) and its WRITEs
(:class:`Write`), as explicit state machines owned by the writer thread (D's side and
:class:`~vllm_ext.nixl_push.lifecycle.IllegalTransition`: lifecycle.py).

Pure state objects (no NIXL, no queues). A hand-over of the engine thread
(:data:`~vllm_ext.nixl_push.messages.HandOver`) is decided here, in one place:
:meth:`PushSend.hand_over` moves the request and answers what should happen now
(:class:`HandOverPlan`: which WRITEs to stream, prepare, post or give up, and whether
the request may be settled); the controller, ``writes.Writes``, acts on the answer
(NIXL, ``LeaseClaims``, D). Likewise :meth:`PushSend.settle` answers whether the
request is done, and ``Writes`` reports it (``Settled``).

P's send side, :class:`PushSend` (writer thread; ``writes.Writes``)::

    PREFILLING ──announced──► ANNOUNCED ──KV final──► FINISHED ──a registration matched──► WRITING
        │ stopped, or KV final ──────────────────────────►┘
        │                     ▲  │                                  │
        │ evicted             │  │ evicted (lease ended)            │ every WRITE ended
        ▼                     │  ▼                                  ▼
     EXPIRED                  │ EXPIRED          WRITTEN (all D ranks written) | FAILED
                              └── more D ranks to serve, none failed ───┘

* PREFILLING (``push_progressive``, S-PRG-1): the request's prompt chunks are being
  computed; the full blocks of the chunks computed so far may be written (each
  :class:`Write` is STREAMING), never completed. Ends when its last chunk is announced
  or final, or when it stopped (aborted on P: it then fails, written or not). Bounded
  by P's prefill: the request is running, the engine thread hands over its end.
* ANNOUNCED: the forward pass that completes the prompt runs; WRITEs may be
  prepared (``initialize_xfer``), never posted. Ends with that pass: the engine
  thread hands the KV over as final, or evicts the request.
* FINISHED: the KV is final and no WRITE runs; waiting for (more) registrations.
  Bounded by vLLM's lease (``kv_lease_duration``), which the engine thread owns
  (leases.py): it revokes the request's claim and evicts it.
* WRITING: at least one :class:`Write` has not ended; each has its own deadline.
* WRITTEN / FAILED / EXPIRED: final. WRITTEN and FAILED are reported to the
  engine thread (``Settled``: it frees the blocks); EXPIRED comes from an eviction,
  i.e. the engine thread already freed them.

A request serves every D rank holding a slice of its heads: one :class:`Write` per
matched registration::

    CONNECTING ──handshake──► ARMED ──KV final──► POSTED ──DONE──► DONE
        │ handshake,              ▲ │                   │ deadline
        │ prefilling              │ └── deadline, error ┴─► ABANDONING (NIXL still reads)
        ▼                         │                              │ left PROC, or bound
    STREAMING ── the prompt ends, ┘        FAILED ◄──────────────┘
        │        no chunk in flight          ▲
        └──── error, stopped, deadline ──────┘

A WRITE's deadline is ``push_write_timeout_s`` after both its registration matched
and the KV was final; an ABANDONING WRITE is waited for at most that long again.
A STREAMING WRITE writes the full blocks of finished chunks, one NIXL WRITE without a
notification at a time (``handle``); the last one (ARMED, then POSTED) writes the rest
and completes it, and is posted only once no earlier one runs (D's blocks are whole
when D reads the completion; S-PRG-1).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

from vllm_ext.nixl_push.lifecycle import IllegalTransition
from vllm_ext.nixl_push.messages import Announced, HandOver, KvChunk, KvFinal, Stopped
from vllm_ext.nixl_push.wire import PromptKey, PushRegistration

#: why a request's WRITEs are given up when it stopped (aborted on P, S-PRG-1)
STOPPED_REASON = "P's request ended before its prompt was computed"

RegKey = tuple[str, str, int]  # (D engine id, D request id, D tp rank)


def reg_key(reg: PushRegistration) -> RegKey:
    return (reg.engine_id, reg.request_id, reg.tp_rank)


class WriteState(enum.Enum):
    CONNECTING = "connecting"
    STREAMING = "streaming"
    ARMED = "armed"
    POSTED = "posted"
    ABANDONING = "abandoning"
    DONE = "done"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self in (WriteState.DONE, WriteState.FAILED)


@dataclasses.dataclass(eq=False)
class Write:
    """P's WRITE of one request into one D rank's blocks."""

    registration: PushRegistration
    #: the NIXL agent the PUSH_REG came from (the only one P writes for)
    sender: str
    matched_at: float
    state: WriteState = WriteState.CONNECTING
    #: NIXL transfer handle (None: not prepared, released, or completion-only)
    handle: Any = None
    nbytes: int = 0
    #: time.monotonic() by which it must have ended (set once the KV is final)
    deadline: float | None = None
    failure: str | None = None
    #: the failure was NIXL's (submission, transfer, timeout): a failed transfer (S-FAIL-3)
    failed_transfer: bool = False
    #: D was told the outcome (a PUSH_FAIL goes out at most once per WRITE)
    d_told: bool = False
    #: when D's watchdog was last renewed for it (its PUSH_REG arrived, or a PUSH_HB)
    renewed_at: float = 0.0
    #: P connected D anew for it once (an authenticated PUSH_REG from a new agent)
    reconnected: bool = False
    #: STREAMING: the prompt tokens [0, streamed_tokens) of P are in D's blocks (their
    #: WRITEs ended DONE); the last WRITE writes from there on
    streamed_tokens: int = 0
    #: STREAMING with ``handle``: the chunk WRITE in flight writes up to this token
    streaming_tokens: int = 0
    #: NIXL accepted a transfer of ``handle`` and has not reported it ended (DONE, ERR
    #: or an error status): its bytes may still move, whatever P decided about it
    running: bool = False
    #: the P request whose blocks it reads (``LeaseClaims`` records it running there)
    p_request_id: str = ""
    #: its registration proved it belongs to the P request (the secret, or the transfer
    #: id both legs carried): only such a one may connect D anew (a restarted D)
    proven: bool = False
    #: D's layout as P knew it when it was connected for this WRITE: every WRITE of it
    #: uses this one, whatever a later handshake with D's engine id brings
    remote_layout: Any = None
    #: NIXL reported its transfer failed, but the rest of it may land until then
    #: (time.monotonic(); inf: no bound): ABANDONING without a handle (N-REL-2)
    landing_until: float | None = None

    @property
    def in_flight(self) -> bool:
        """NIXL may be moving bytes of it (a posted or abandoned WRITE, or a chunk)."""
        if self.state is WriteState.STREAMING:
            return self.handle is not None
        return self.state in (WriteState.POSTED, WriteState.ABANDONING)

    @property
    def key(self) -> RegKey:
        return reg_key(self.registration)

    def _move(self, to: WriteState, *sources: WriteState) -> None:
        if self.state not in sources:
            raise IllegalTransition(
                f"WRITE -> {self.registration.request_id}: {self.state.value} -> {to.value}"
            )
        self.state = to

    def start_clock(self, final_at: float, timeout_s: float) -> None:
        if self.deadline is None:
            self.deadline = max(self.matched_at, final_at) + timeout_s

    def stream(self) -> None:
        """Connected while P prefills: chunks may be written."""
        self._move(WriteState.STREAMING, WriteState.CONNECTING)

    def post_chunk(self, handle: Any, until_tokens: int, nbytes: int) -> None:
        if self.state is not WriteState.STREAMING or self.handle is not None:
            raise IllegalTransition(
                f"WRITE -> {self.registration.request_id}: chunk posted in {self.state.value}"
            )
        self.handle, self.streaming_tokens = handle, until_tokens
        self.nbytes += nbytes

    def chunk_done(self, count: bool) -> None:
        """The chunk WRITE in flight ended DONE (its handle released); ``count``: its
        blocks hold what D needs (the request was not preempted meanwhile)."""
        if self.state is not WriteState.STREAMING or self.handle is not None:
            raise IllegalTransition(
                f"WRITE -> {self.registration.request_id}: chunk done in {self.state.value}"
            )
        if count:
            self.streamed_tokens = self.streaming_tokens

    def arm(self, handle: Any, nbytes: int) -> None:
        """Prepared (``handle`` None: D needs no block, only the completion); a
        STREAMING one only once no chunk WRITE of it is in flight."""
        if self.in_flight:
            raise IllegalTransition(
                f"WRITE -> {self.registration.request_id}: armed with a chunk in flight"
            )
        self._move(WriteState.ARMED, WriteState.CONNECTING, WriteState.STREAMING)
        self.handle = handle
        self.nbytes += nbytes

    def post(self) -> None:
        self._move(WriteState.POSTED, WriteState.ARMED)

    def abandon(self, until: float) -> None:
        """Past its deadline (or stopped) while NIXL runs it: it ends when NIXL says so
        (never by a release: docs/design.md, N-REL-1); ``until``: when that is logged
        as stuck."""
        if not self.in_flight:
            raise IllegalTransition(
                f"WRITE -> {self.registration.request_id}: abandoned in {self.state.value}"
            )
        self.state = WriteState.ABANDONING
        self.deadline = until

    def failed_landing(self, reason: str, until: float) -> None:
        """NIXL reported its transfer failed (its handle released since): NIXL no
        longer tracks it, yet the rest of it may still land until ``until``, so it
        counts as in flight until then (N-REL-2); then it fails."""
        running = (WriteState.POSTED, WriteState.ABANDONING, WriteState.STREAMING)
        if self.state not in running or self.handle is not None:
            raise IllegalTransition(
                f"WRITE -> {self.registration.request_id}: failed landing in {self.state.value}"
            )
        self.state = WriteState.ABANDONING
        self.failure = self.failure or reason
        self.deadline = self.landing_until = until

    def done(self) -> None:
        self._move(WriteState.DONE, WriteState.ARMED, WriteState.POSTED)

    def fail(self, reason: str, transfer: bool = False) -> None:
        self._move(
            WriteState.FAILED,
            WriteState.CONNECTING, WriteState.STREAMING, WriteState.ARMED, WriteState.POSTED,
            WriteState.ABANDONING,
        )  # fmt: skip
        self.failure = reason
        self.failed_transfer = transfer


class SendState(enum.Enum):
    PREFILLING = "prefilling"
    ANNOUNCED = "announced"
    FINISHED = "finished"
    WRITING = "writing"
    WRITTEN = "written"
    FAILED = "failed"
    EXPIRED = "expired"

    @property
    def final(self) -> bool:
        return self in (SendState.WRITTEN, SendState.FAILED, SendState.EXPIRED)


@dataclasses.dataclass(frozen=True)
class HandOverPlan:
    """What a hand-over asks of the controller now, in this order (the state moved
    already): give these WRITEs up (``why``), stream a chunk WRITE of these, prepare the
    last WRITE of these, post these prepared ones (the KV is final), then settle the
    request if ``settle``. ``ignored``: the hand-over came too late to matter."""

    give_up: tuple[Write, ...] = ()
    why: str = ""
    stream: tuple[Write, ...] = ()
    arm: tuple[Write, ...] = ()
    post: tuple[Write, ...] = ()
    settle: bool = False
    ignored: bool = False


@dataclasses.dataclass(eq=False)
class PushSend:
    """One P request's blocks and its WRITEs (see the module docstring)."""

    request_id: str
    #: the request's blocks (per KV cache group): so far while PREFILLING, then all
    #: (the engine thread's lists: read only)
    block_ids: Sequence[Sequence[int]]
    state: SendState = SendState.FINISHED
    transfer_id: str | None = None
    #: the P leg's ``transfer_secret``: only a registration carrying it is served
    secret: str | None = dataclasses.field(default=None, repr=False)
    #: only a registration with the same prompt key is served (S-WRT-7; None: any)
    prompt: PromptKey | None = None
    #: PREFILLING: the KV of its first ``kv_tokens`` prompt tokens is final
    kv_tokens: int = 0
    #: preempted after it streamed: its last WRITE writes it whole (S-PRG-1)
    whole: bool = False
    #: what to wait on before reading the blocks (a CUDA event), or None
    ready: Any = None
    #: time.monotonic() when the KV (of the last chunk, or final) was final on P
    finished_at: float = 0.0
    writes: list[Write] = dataclasses.field(default_factory=list)
    #: How many D registrations this P rank must serve; known from the first one.
    expected: int | None = None
    #: D (engine, rank) pairs already matched, and the keys of their registrations
    served: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    served_keys: set[RegKey] = dataclasses.field(default_factory=set)
    #: time.monotonic() when this writer learned the KV is final
    final_at: float | None = None
    #: PREFILLING ended with the request (aborted on P) before its prompt was computed
    stopped: bool = False

    @classmethod
    def of(cls, h: KvChunk | Announced | KvFinal, now: float) -> PushSend:
        """The request's first hand-over."""
        send = cls(h.request_id, h.block_ids, transfer_id=h.transfer_id, secret=h.secret,
                   prompt=h.prompt)  # fmt: skip
        if isinstance(h, KvFinal):
            send.whole, send.ready, send.finished_at, send.final_at = (
                h.whole, h.ready, h.finished_at, now,
            )  # fmt: skip
        elif isinstance(h, KvChunk):
            send.state = SendState.PREFILLING
            send.kv_tokens, send.ready, send.finished_at = h.kv_tokens, h.ready, h.finished_at
        else:
            send.state, send.whole = SendState.ANNOUNCED, h.whole
        return send

    @property
    def prompt_ended(self) -> bool:
        """No more chunks: its blocks are announced or final (or it stopped)."""
        return self.state is not SendState.PREFILLING

    @property
    def complete(self) -> bool:
        """Every D registration this request must serve has been matched."""
        return self.expected is not None and len(self.served) >= self.expected

    @property
    def active(self) -> list[Write]:
        return [w for w in self.writes if not w.state.final]

    @property
    def idle(self) -> bool:
        """Not final, and no WRITE of it is active: its blocks are under the lease."""
        return not self.state.final and not self.active

    @property
    def failed_writes(self) -> int:
        return sum(w.state is WriteState.FAILED for w in self.writes)

    @property
    def failed_transfers(self) -> int:
        return sum(w.failed_transfer for w in self.writes)

    def _move(self, to: SendState, *sources: SendState) -> None:
        if self.state not in sources:
            raise IllegalTransition(f"{self.request_id}: {self.state.value} -> {to.value}")
        self.state = to

    # -- the hand-over: decided here, acted on by writes.Writes ----------------------------
    def hand_over(self, h: HandOver, now: float, timeout_s: float) -> HandOverPlan:
        """A later hand-over of this request (the first one built it: :meth:`of`): move
        to the state it says and answer what the controller must do now."""
        if isinstance(h, Stopped):
            if self.state is not SendState.PREFILLING:
                return HandOverPlan()
            self.stop()
            return HandOverPlan(give_up=tuple(self.active), why=STOPPED_REASON, settle=True)
        if isinstance(h, KvChunk):
            if self.state is not SendState.PREFILLING:
                # its end was announced first (the chunk came through the KV-ready
                # watcher later): the last WRITE writes those blocks
                return HandOverPlan()
            self.add_chunk(h)
            idle = (w for w in self.writes if w.state is WriteState.STREAMING and w.handle is None)
            return HandOverPlan(stream=tuple(idle))
        if self.state is SendState.PREFILLING:  # a streamed request's prompt ends
            if isinstance(h, KvFinal):
                self.finalize(h, now, timeout_s)
            else:
                self.announce(h)
            streaming = [w for w in self.writes if w.state is WriteState.STREAMING]
            if self.whole:
                for w in streaming:
                    w.streamed_tokens = 0  # preempted: its blocks were computed anew
            # one with a chunk in flight is armed when that chunk ends (the last WRITE
            # follows every chunk)
            return HandOverPlan(arm=tuple(w for w in streaming if w.handle is None), settle=True)
        if isinstance(h, KvFinal) and self.state is SendState.ANNOUNCED:
            self.finalize(h, now, timeout_s)  # post what was prepared
            armed = (w for w in self.writes if w.state is WriteState.ARMED)
            return HandOverPlan(post=tuple(armed), settle=True)
        return HandOverPlan(ignored=True)  # handed over already

    # -- transitions -------------------------------------------------------------------
    def serve(self, reg: PushRegistration, expected: int) -> None:
        """A registration matched (rendezvous bookkeeping)."""
        if self.expected is None:
            self.expected = expected
        self.served.add((reg.engine_id, reg.tp_rank))
        self.served_keys.add(reg_key(reg))

    def add_write(self, write: Write, timeout_s: float) -> None:
        if self.state in (SendState.PREFILLING, SendState.ANNOUNCED):
            self.writes.append(write)  # prepared (or streaming) now, completed once final
            return
        self._move(SendState.WRITING, SendState.FINISHED, SendState.WRITING)
        assert self.final_at is not None
        write.start_clock(self.final_at, timeout_s)
        self.writes.append(write)

    def add_chunk(self, chunk: KvChunk) -> None:
        """PREFILLING: one more chunk's KV is final (its block ids are the request's
        so far: chunks only add blocks, unless P preempted it; see ``whole``)."""
        if self.state is not SendState.PREFILLING:
            raise IllegalTransition(f"{self.request_id}: chunk in {self.state.value}")
        self.block_ids, self.kv_tokens = chunk.block_ids, chunk.kv_tokens
        self.ready, self.finished_at = chunk.ready, chunk.finished_at

    def announce(self, end: Announced | KvFinal) -> None:
        """PREFILLING: the pass that completes the prompt runs (``end``: all its blocks)."""
        self._move(SendState.ANNOUNCED, SendState.PREFILLING)
        self.block_ids, self.whole = end.block_ids, end.whole
        self.kv_tokens = 0

    def stop(self) -> None:
        """PREFILLING: the request ended on P before its prompt was computed; nothing
        more is matched or written, and it fails once no WRITE of it runs."""
        self._move(SendState.FINISHED, SendState.PREFILLING)
        self.stopped = True
        self.expected = len(self.served)  # complete: no registration is matched any more
        if self.active:
            self.state = SendState.WRITING

    def finalize(self, final: KvFinal, now: float, timeout_s: float) -> None:
        """The announced (or prefilling) request's KV is final."""
        if self.state is SendState.PREFILLING:
            self.announce(final)
        self._move(SendState.FINISHED, SendState.ANNOUNCED)
        self.finished_at, self.ready = final.finished_at, final.ready
        self.final_at = now
        for w in self.active:
            w.start_clock(now, timeout_s)
        if self.active:
            self.state = SendState.WRITING

    def settle(self) -> bool:
        """After a WRITE ended: True if the request is done (WRITTEN or FAILED)."""
        if self.state.final or self.state in (SendState.PREFILLING, SendState.ANNOUNCED):
            return False
        if self.active:
            return False
        if self.failed_writes or self.stopped:
            self._move(SendState.FAILED, SendState.WRITING, SendState.FINISHED)
        elif self.complete:
            self._move(SendState.WRITTEN, SendState.WRITING, SendState.FINISHED)
        else:
            self.state = SendState.FINISHED  # more D ranks to serve
            return False
        return True

    def expire(self) -> None:
        """Evicted by the engine thread (lease ended, or its KV never became final)."""
        self._move(
            SendState.EXPIRED,
            SendState.PREFILLING, SendState.ANNOUNCED, SendState.FINISHED, SendState.WRITING,
        )  # fmt: skip
