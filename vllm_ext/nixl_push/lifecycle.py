# SPDX-License-Identifier: Apache-2.0
"""One request, one state: the push lifecycle as explicit state machines; D's side here,
P's side (:class:`~vllm_ext.nixl_push.send_lifecycle.PushSend`, ``Write``) in
send_lifecycle.py.

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

"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from vllm_ext.nixl_push.wire import CANCELLED as CANCELLED_REASON

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
    #: this rank's reply token for the request (S-WIR-3), set with ``meta``
    reply_token: str | None = dataclasses.field(default=None, repr=False)

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
