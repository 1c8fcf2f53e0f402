# SPDX-License-Identifier: Apache-2.0
"""One request, one state: the push lifecycle of both sides as explicit state machines.

Pure state objects (no NIXL, no queues): each is owned by one thread, which
drives it through the transition methods below. A transition from a state that
does not allow it raises :class:`IllegalTransition` (a bug, not an input error:
inputs are checked before a transition is tried). Every non-final state has a
deadline and an owner that enforces it; ``docs/design.md`` lists them.

D's receive side, :class:`PushRecv` (engine thread; ``recv.RecvTable``)::

    REGISTERED ──RegSent──► AWAITING ──every producer answered──► DONE | FAILED
        │                      │
        │ RecvFailed           │ cancel (abort, watchdog)          PUSH_HB renews
        ▼                      ▼                                   the watchdog
      FAILED    cancel ──► CANCELLING ──every producer answered──► CANCELLED (abort)
                RegPartly      │        or the answer deadline     | DONE | FAILED
                Sent ─────────►┘

* REGISTERED: handed to the writer; the PUSH_REG may wait for the handshake with P.
  Bounded by D's watchdog (``push_registration_timeout_s``, scheduler process).
* AWAITING: the PUSH_REG reached ``producers`` (each P stage x TP rank that writes
  into this rank). Each answers once: a completion (it wrote) or a PUSH_FAIL.
  Bounded by the watchdog, which P's heartbeats renew while P holds the request.
* CANCELLING: D asked the producers to stand down (PUSH_CANCEL) and keeps the
  blocks until each answered, or until ``deadline`` (``push_cancel_answer_timeout_s``
  after the cancel, or after the last heartbeat of a producer still writing).
* DONE (every producer wrote), FAILED (blocks invalid), CANCELLED (aborted): final.

D's blocks go back to vLLM only when a PushRecv reaches a final state, and it reaches
one only once every producer the PUSH_REG reached is *stopped*: it answered (its
WRITE's completion, or a PUSH_FAIL that P sends only once no WRITE of it runs), or
it can no longer write (``PushRecv.producers_gone``, docs/design.md N-LIV-1: P's
engine answered a new handshake with other agents, i.e. it restarted, or D's send to it
failed and it stayed silent twice the TCP user timeout since). That is the one
place where the invariant of docs/design.md ("Which blocks a WRITE may touch") is
enforced: :meth:`PushRecv._end` refuses anything else.

D's PUSH_REG on the writer thread, :class:`RegOut` (the writer-side twin of the
PushRecv; ``registrations.Registrations``, whose ``RegOuts`` alone moves it)::

    CONNECTING ──handshake with P, sent──► SENT ──cancel──► CANCELLED (PUSH_CANCEL sent)
        │ handshake failed,
        │ reached no producer ──► FAILED
        └──cancel──► CANCELLED (unsent: when its handshake ends, nothing is sent and the
                                engine thread is told RegUnsent)

Only a CONNECTING RegOut is ever sent, and only by the writer thread, which is also
the thread that cancels it: a handshake that completes after the cancel (or after
the request ended) finds it CANCELLED (or gone) and sends nothing.

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
from typing import TYPE_CHECKING, Any

from vllm_ext.nixl_push.messages import FinishedBlocks
from vllm_ext.nixl_push.wire import CANCELLED as CANCELLED_REASON
from vllm_ext.nixl_push.wire import PromptKey, PushRegistration

if TYPE_CHECKING:
    from vllm_ext.nixl_push.metadata import PushRegMeta

#: The failure reason of a request a producer stood down for, or never got.
NO_PUSH_IN_TIME = (
    "no push from P in time (push_registration_timeout_s, or push_heartbeat_timeout_s since P "
    "last renewed the registration)"
)


class IllegalTransition(AssertionError):
    """A lifecycle transition from a state that does not allow it: a bug."""


# -- D: receive side ---------------------------------------------------------------------------


class RecvState(enum.Enum):
    REGISTERED = "registered"
    AWAITING = "awaiting"
    CANCELLING = "cancelling"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in (RecvState.DONE, RecvState.FAILED, RecvState.CANCELLED)


class CancelCause(enum.Enum):
    ABORTED = "aborted"  # the client went away: the request just ends
    EXPIRED = "expired"  # the watchdog: fail the load unless every producer wrote
    SEND_FAILED = "send_failed"  # the PUSH_REG reached only some producers
    #: a producer's WRITE failed and its rest may still land (N-REL-2): fail the load
    WRITE_FAILED = "write_failed"


class Answer(enum.Enum):
    """How a producer's notification was taken."""

    ACCEPTED = "accepted"
    FOREIGN = "foreign"  # not from a producer of this request
    DUPLICATE = "duplicate"  # that producer answered already


@dataclasses.dataclass(eq=False)
class PushRecv:
    request_id: str
    p_engine_id: str
    registered_at: float
    state: RecvState = RecvState.REGISTERED
    #: NIXL agents the PUSH_REG reached (None until the writer says)
    producers: frozenset[str] | None = None
    answered: set[str] = dataclasses.field(default_factory=set)
    #: producers known gone without their answer (their process was replaced)
    gone: set[str] = dataclasses.field(default_factory=set)
    #: the first failure reported (by a producer, or locally)
    failure: str | None = None
    #: a producer answered a cancel without writing
    stood_down: bool = False
    cause: CancelCause | None = None
    #: CANCELLING: the producers' answers are due by then (time.monotonic())
    deadline: float | None = None
    #: its answers are overdue: its blocks are held until every producer answered or
    #: is gone (S-SAFE-1)
    quarantined: bool = False
    #: when it was quarantined (time.monotonic())
    quarantined_at: float | None = None
    #: blocks registered for the push (``push_blocks_quarantined_now`` while quarantined)
    blocks: int = 0
    #: vLLM was told the request failed while its blocks stay held (quarantined)
    failed_in_vllm: bool = False
    #: a producer told D that its WRITE failed while its rest may land (N-REL-2)
    write_failed_landing: bool = False
    #: a producer that has not renewed the registration (PUSH_HB) may keep it, and
    #: serve it, until then (N-LIV-1: its TTL from the PUSH_REG's arrival)
    unrenewed_held_until: float = 0.0
    #: producers that renewed the registration: they keep it only while they send
    renewed_by: set[str] = dataclasses.field(default_factory=set)

    # -- transitions -------------------------------------------------------------------
    def _move(self, to: RecvState, *sources: RecvState) -> None:
        if self.state not in sources:
            raise IllegalTransition(f"{self.request_id}: {self.state.value} -> {to.value}")
        self.state = to

    def reg_sent(self, agents: frozenset[str]) -> None:
        """The PUSH_REG reached ``agents``."""
        if self.state is RecvState.CANCELLING:  # cancelled while the PUSH_REG went out
            self.producers = agents
            return
        self._move(RecvState.AWAITING, RecvState.REGISTERED)
        self.producers = agents

    def reg_partly_sent(
        self, agents: frozenset[str], reason: str, now: float, answer_s: float
    ) -> None:
        """Only ``agents`` got the PUSH_REG: they may write, so cancel with them first."""
        self.failure = self.failure or reason
        if self.state is RecvState.REGISTERED:
            self.cancel(CancelCause.SEND_FAILED, now, answer_s)
        self.producers = agents

    def cancel(self, cause: CancelCause, now: float, answer_s: float) -> None:
        """Ask the producers to stand down; answers are due within ``answer_s``."""
        if self.state is RecvState.CANCELLING:
            if cause is CancelCause.ABORTED:
                self.cause = cause  # the request is gone: nothing is to be loaded
            return
        self._move(RecvState.CANCELLING, RecvState.REGISTERED, RecvState.AWAITING)
        self.cause = cause
        self.deadline = now + answer_s

    def unsent(self) -> None:
        """Cancelled before the PUSH_REG went out: no producer will write."""
        if self.state is not RecvState.CANCELLING:
            raise IllegalTransition(f"{self.request_id}: unsent while {self.state.value}")
        self.producers = frozenset()
        self.stood_down = True
        self._end()

    def fail(self, reason: str) -> None:
        """Nothing was (or can be) written: fail now (just end, if aborted)."""
        self._require_stopped("fail")
        self.failure = self.failure or reason
        to = RecvState.CANCELLED if self.cause is CancelCause.ABORTED else RecvState.FAILED
        self._move(to, RecvState.REGISTERED, RecvState.AWAITING, RecvState.CANCELLING)

    def answer(self, sender: str, failure: str | None) -> Answer:
        """A producer wrote (``failure`` None) or will not write (the reason)."""
        if self.producers is None or sender not in self.producers:
            return Answer.FOREIGN
        if sender in self.answered:
            return Answer.DUPLICATE
        if self.state not in (RecvState.AWAITING, RecvState.CANCELLING):
            raise IllegalTransition(f"{self.request_id}: answer while {self.state.value}")
        self.answered.add(sender)
        if failure == CANCELLED_REASON:
            self.stood_down = True
        elif failure is not None:
            self.failure = self.failure or f"P reported: {failure}"
        if self.answered >= self.producers:
            self._end()
        return Answer.ACCEPTED

    def renew(self, sender: str, now: float, answer_s: float) -> Answer:
        """A producer's heartbeat: it still holds the request. While AWAITING the
        caller renews the watchdog; while CANCELLING a producer that has not answered
        yet may still be writing into the blocks, so its answer is waited for longer."""
        if self.producers is None or sender not in self.producers:
            return Answer.FOREIGN
        if sender in self.answered:
            return Answer.DUPLICATE
        if self.state is RecvState.CANCELLING and self.deadline is not None:
            self.deadline = max(self.deadline, now + answer_s)
        return Answer.ACCEPTED

    @property
    def silent(self) -> frozenset[str]:
        """Producers that may still write: neither answered nor gone."""
        return frozenset(self.producers or ()) - self.answered - self.gone

    def overdue(self, now: float) -> bool:
        """CANCELLING past its answer deadline with producers still silent. While the
        PUSH_REG has not gone out (``producers`` None) the writer answers for it
        (RegSent / RegUnsent), never a deadline: it may be going out right now."""
        return (
            self.state is RecvState.CANCELLING
            and self.deadline is not None
            and self.producers is not None
            and now >= self.deadline
            and bool(self.silent)
        )

    def producers_gone(self, agents: frozenset[str], answer_s: float) -> None:
        """These silent producers' processes are gone (P restarted: its engine answers
        with other agents now): nothing they posted can land any more. Ends the request
        once no producer is silent. Removing an agent from NIXL is not enough: a WRITE
        already on its way (a partitioned TCP link, a same-host copy) still lands."""
        if self.state is not RecvState.CANCELLING:
            raise IllegalTransition(f"{self.request_id}: producers gone while {self.state.value}")
        self.gone |= agents & self.silent
        if not self.silent:
            self.failure = self.failure or f"P did not answer PUSH_CANCEL within {answer_s:g}s"
            self._end()

    def quarantine_expired(self, why: str) -> None:
        """The quarantine's bound (``push_quarantine_s``) passed: give the silent
        producers up as if gone (the one place liveness wins, configured)."""
        self.failure = self.failure or why
        self.producers_gone(self.silent, 0.0)

    def postpone(self, now: float, answer_s: float) -> None:
        """A silent producer may still write: keep the blocks, look again later."""
        self.deadline = now + answer_s

    def _require_stopped(self, what: str) -> None:
        """The invariant: no final state while a producer may still write."""
        if self.silent:
            raise IllegalTransition(
                f"{self.request_id}: {what} while producers {sorted(self.silent)} may still write"
            )

    def _end(self) -> None:
        """Every producer answered (or is gone): pick the final state."""
        self._require_stopped("end")
        sources = (RecvState.AWAITING, RecvState.CANCELLING)
        if self.cause is CancelCause.ABORTED:
            self._move(RecvState.CANCELLED, *sources)  # the request is gone anyway
        elif self.failure is None and not self.stood_down:
            self._move(RecvState.DONE, *sources)  # every producer wrote its part
        else:
            # a producer failed, or stood down: its part of the KV was never written
            self.failure = self.failure or NO_PUSH_IN_TIME
            self._move(RecvState.FAILED, *sources)


class RegOutState(enum.Enum):
    CONNECTING = "connecting"
    SENT = "sent"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclasses.dataclass(eq=False)
class RegOut:
    """D's PUSH_REG of one request, on the writer thread (see the module docstring)."""

    request_id: str
    #: what to send (None: the cancel overtook it in the writer's inboxes)
    meta: PushRegMeta | None
    state: RegOutState = RegOutState.CONNECTING
    #: the producer agents the PUSH_REG reached
    agents: frozenset[str] = frozenset()
    #: its send failed once on a connection D then dropped, and it was tried again
    #: over a new one (a restarted P; once only)
    resent: bool = False

    def _move(self, to: RegOutState, *sources: RegOutState) -> None:
        if self.state not in sources:
            raise IllegalTransition(f"PUSH_REG {self.request_id}: {self.state.value} -> {to.value}")
        self.state = to

    @property
    def sendable(self) -> bool:
        return self.state is RegOutState.CONNECTING and self.meta is not None

    def sent(self, agents: frozenset[str]) -> None:
        """It reached ``agents`` (all of P's, or only some: then cancel at once)."""
        self._move(RegOutState.SENT, RegOutState.CONNECTING)
        self.agents = agents

    def cancel(self) -> frozenset[str]:
        """D cancels: the agents to ask to stand down (none if it never went out)."""
        if self.state in (RegOutState.CANCELLED, RegOutState.FAILED):
            return frozenset()
        self._move(RegOutState.CANCELLED, RegOutState.CONNECTING, RegOutState.SENT)
        return self.agents

    def fail(self) -> None:
        """It reached no producer (the handshake or every send failed)."""
        self._move(RegOutState.FAILED, RegOutState.CONNECTING)


# -- P: send side ----------------------------------------------------------------------------

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


@dataclasses.dataclass(eq=False)
class PushSend:
    """One P request's blocks and its WRITEs (see the module docstring)."""

    blocks: FinishedBlocks
    state: SendState = SendState.FINISHED
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
    def of(cls, blocks: FinishedBlocks, now: float) -> PushSend:
        if blocks.final:
            return cls(blocks, SendState.FINISHED, final_at=now)
        if blocks.chunk:
            return cls(blocks, SendState.PREFILLING)
        return cls(blocks, SendState.ANNOUNCED)

    @property
    def prompt_ended(self) -> bool:
        """No more chunks: its blocks are announced or final (or it stopped)."""
        return self.state is not SendState.PREFILLING

    @property
    def request_id(self) -> str:
        return self.blocks.request_id

    @property
    def transfer_id(self) -> str | None:
        return self.blocks.transfer_id

    @property
    def secret(self) -> str | None:
        return self.blocks.secret

    @property
    def prompt(self) -> PromptKey | None:
        return self.blocks.prompt

    @property
    def complete(self) -> bool:
        """Every D registration this request must serve has been matched."""
        return self.expected is not None and len(self.served) >= self.expected

    @property
    def active(self) -> list[Write]:
        return [w for w in self.writes if not w.state.final]

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

    def add_chunk(self, blocks: FinishedBlocks) -> None:
        """PREFILLING: one more chunk's KV is final (its block ids are the request's
        so far: chunks only add blocks, unless P preempted it; see ``whole``)."""
        if self.state is not SendState.PREFILLING:
            raise IllegalTransition(f"{self.request_id}: chunk in {self.state.value}")
        self.blocks.block_ids, self.blocks.kv_tokens = blocks.block_ids, blocks.kv_tokens
        self.blocks.ready, self.blocks.finished_at = blocks.ready, blocks.finished_at

    def announce(self, blocks: FinishedBlocks) -> None:
        """PREFILLING: the pass that completes the prompt runs (``blocks``: all of them)."""
        self._move(SendState.ANNOUNCED, SendState.PREFILLING)
        self.blocks.block_ids, self.blocks.whole = blocks.block_ids, blocks.whole
        self.blocks.kv_tokens = 0

    def stop(self) -> None:
        """PREFILLING: the request ended on P before its prompt was computed; nothing
        more is matched or written, and it fails once no WRITE of it runs."""
        self._move(SendState.FINISHED, SendState.PREFILLING)
        self.stopped = True
        self.expected = len(self.served)  # complete: no registration is matched any more
        if self.active:
            self.state = SendState.WRITING

    def finalize(self, blocks: FinishedBlocks, now: float, timeout_s: float) -> None:
        """The announced (or prefilling) request's KV is final (``blocks`` is the final
        hand-over)."""
        if self.state is SendState.PREFILLING:
            self.announce(blocks)
        self._move(SendState.FINISHED, SendState.ANNOUNCED)
        self.blocks.finished_at, self.blocks.ready, self.blocks.final = (
            blocks.finished_at, blocks.ready, True,
        )  # fmt: skip
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
