# SPDX-License-Identifier: Apache-2.0
"""D's receive side on the engine thread: the :class:`~vllm_ext.nixl_push.lifecycle.PushRecv`
of every request in flight, and what moves them.

The writer reports what happened to each PUSH_REG (``RegSent`` ...), and hands over
every notification with the NIXL agent it came from. A notification counts only if
that agent is one of the request's producers (each P stage x TP rank writing into
this rank, learned from the handshake with P: the agents the PUSH_REG went to), and
only once per producer (S-WRT-6). Others are counted (``push_notifs_foreign``,
``push_notifs_duplicate``) and dropped, so a stray or repeated completion can never
end a wait before every producer's KV arrived.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Callable, Iterator

from vllm_ext.log import event, get_logger
from vllm_ext.nixl_push.lifecycle import (
    Answer,
    CancelCause,
    IllegalTransition,
    PushRecv,
    RecvState,
)
from vllm_ext.nixl_push.messages import RecvFailed, RegPartlySent, RegSent, RegUnsent
from vllm_ext.nixl_push.stats import PushCounters
from vllm_ext.nixl_push.wire import CANCELLED as CANCELLED_REASON
from vllm_ext.nixl_push.wire import Completion, PushFailed, PushHeartbeat

logger = get_logger(__name__)

#: Asks a request's silent producers once more to stand down (request id, producers).
AskAgain = Callable[[str, frozenset[str]], None]
#: The agents an engine has now (after a new handshake), or None if not connected.
AgentsOf = Callable[[str], frozenset[str] | None]


class ReplyTokens:
    """D's reply tokens (S-WIR-3): 16 random bytes each, as hex, from the system's
    CSPRNG (``secrets``), read ``BATCH`` tokens at a time, so that the engine thread
    makes one system call (which also lets other threads take the GIL) per ``BATCH``
    registrations instead of one per registration. Each token is used once. One
    thread only (the engine thread)."""

    BATCH = 256
    SIZE = 16

    def __init__(self) -> None:
        self._buf = b""
        self._at = 0

    def take(self) -> str:
        at = self._at
        if at >= len(self._buf):
            self._buf, at = secrets.token_bytes(self.SIZE * self.BATCH), 0
        self._at = at + self.SIZE
        return self._buf[at : at + self.SIZE].hex()


class RecvTable:
    """The engine thread's :class:`PushRecv` of every D request in flight.

    The CANCELLING ones (the only ones with an answer deadline, or quarantined) are
    indexed apart: a step's deadline check and the quarantine gauge look at those,
    not at every request that waits for its KV."""

    def __init__(
        self,
        counters: PushCounters,
        answer_s: float,
        quarantine_s: float = -1.0,
        lost_after_s: float = -1.0,
        unrenewed_hold_s: float = 0.0,
    ) -> None:
        self._counters = counters
        self._answer_s = answer_s
        self._quarantine_s = quarantine_s
        #: a producer D's transport to failed, silent since, is gone this much later
        #: (``PushConfig.producer_lost_after_s``, N-LIV-1; negative: never)
        self._lost_after_s = lost_after_s
        #: how long after a PUSH_REG went out a producer may still hold it without
        #: renewing it (its TCP user timeout to deliver it, then P's TTL: N-LIV-1)
        self._unrenewed_hold_s = unrenewed_hold_s
        self._recvs: dict[str, PushRecv] = {}
        #: the CANCELLING requests of _recvs (answers due, or quarantined)
        self._cancelling: dict[str, PushRecv] = {}
        #: requests whose watchdog a producer renewed since the last drain
        self._renewed: set[str] = set()
        #: the reply token of each request's PUSH_REG (S-WIR-3)
        self._reply_tokens: dict[str, str] = {}
        #: quarantined requests vLLM still waits for: fail them now, keep their blocks
        self._fail_now: list[PushRecv] = []
        #: producer agents D's send to failed (UCX's error on the endpoint) -> when,
        #: with no sign of life from them since (N-LIV-1)
        self._unreachable: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._recvs)

    def awaiting_kv(self) -> int:
        """Requests whose KV may still arrive for vLLM (not cancelled or quarantined)."""
        return len(self._recvs) - len(self._cancelling)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._recvs

    def __iter__(self) -> Iterator[PushRecv]:
        return iter(list(self._recvs.values()))

    def get(self, request_id: str) -> PushRecv | None:
        return self._recvs.get(request_id)

    def register(
        self,
        request_id: str,
        p_engine_id: str,
        now: float,
        blocks: int = 0,
        reply_token: str | None = None,
    ) -> PushRecv:
        if request_id in self._recvs:
            raise IllegalTransition(f"{request_id} registered twice")
        recv = self._recvs[request_id] = PushRecv(request_id, p_engine_id, now, blocks=blocks)
        if reply_token is not None:
            self._reply_tokens[request_id] = reply_token
        return recv

    def _forged(self, request_id: str, token: str | None, sender: str, what: str) -> bool:
        """S-WIR-3: a notification about ``request_id`` without the token its PUSH_REG
        carried is not from the P it reached, whatever sender name it gives."""
        expected = self._reply_tokens.get(request_id)
        if expected is None or (token is not None and hmac.compare_digest(token, expected)):
            return False
        self._counters.inc("push_notifs_forged")
        logger.warning(
            "push: dropped %s for %s from agent %s: it lacks the registration's token",
            what, request_id, sender,
            extra=event("push_notif_forged", request_id, sender=sender, what=what),
        )  # fmt: skip
        return True

    def pop_final(self, recv: PushRecv) -> PushRecv | None:
        """Remove ``recv`` once final; the caller reports it (exactly once)."""
        if not recv.state.final or self._recvs.get(recv.request_id) is not recv:
            return None
        del self._recvs[recv.request_id]
        self._cancelling.pop(recv.request_id, None)
        self._renewed.discard(recv.request_id)
        self._reply_tokens.pop(recv.request_id, None)
        return recv

    def drain_renewed(self) -> frozenset[str]:
        out, self._renewed = frozenset(self._renewed), set()
        return out

    def drain_fail_now(self) -> list[PushRecv]:
        """Requests quarantined since the last drain that vLLM still waits for: the
        caller fails them in vLLM now (an error at D's deadline) and keeps their blocks
        until they end (S-SAFE-1)."""
        out, self._fail_now = self._fail_now, []
        return out

    def quarantined_blocks(self) -> int:
        """Blocks held now for quarantined requests (``push_blocks_quarantined_now``)."""
        return sum(r.blocks for r in self._cancelling.values() if r.quarantined)

    def _note_state(self, recv: PushRecv) -> None:
        """After a transition that may have cancelled ``recv``: index it if it did."""
        if recv.state is RecvState.CANCELLING:
            self._cancelling[recv.request_id] = recv

    # -- events ----------------------------------------------------------------------------
    def on_writer(
        self, msg: RegSent | RegPartlySent | RegUnsent | RecvFailed, now: float
    ) -> PushRecv | None:
        """What the writer did with the PUSH_REG; returns the request if it ended."""
        recv = self._recvs.get(msg.request_id)
        if recv is None:
            return None
        if isinstance(msg, (RegSent, RegPartlySent)):
            recv.unrenewed_held_until = now + self._unrenewed_hold_s
        if isinstance(msg, RegSent):
            recv.reg_sent(msg.agents)
        elif isinstance(msg, RegPartlySent):
            recv.reg_partly_sent(msg.agents, msg.reason, now, self._answer_s)
        elif isinstance(msg, RegUnsent):
            recv.unsent()
        elif recv.silent:
            # The writer fails only what reached no producer; should one have been
            # reached after all, its blocks wait for its answer (or its removal).
            logger.error("push: %s failed (%s) while producers %s may still write",
                         recv.request_id, msg.reason, sorted(recv.silent),
                         extra=event("push_send_failed", recv.request_id))  # fmt: skip
            recv.failure = recv.failure or msg.reason
            recv.cancel(CancelCause.SEND_FAILED, now, self._answer_s)
        else:
            recv.fail(msg.reason)
        self._note_state(recv)
        return self.pop_final(recv)

    def fail(self, request_id: str, reason: str) -> PushRecv | None:
        """Fail a request now (e.g. bad ``kv_transfer_params``); returns it, ended."""
        recv = self._recvs.get(request_id)
        if recv is None:
            return None
        recv.fail(reason)
        return self.pop_final(recv)

    def cancel(self, request_id: str, cause: CancelCause, now: float) -> PushRecv | None:
        recv = self._recvs.get(request_id)
        if recv is not None:
            recv.cancel(cause, now, self._answer_s)
            self._note_state(recv)
        return recv

    def on_notif(
        self, sender: str, n: Completion | PushFailed | PushHeartbeat, now: float
    ) -> list[PushRecv]:
        """A producer's notification; returns the requests it ended. Only one that
        carries its request's reply token is a sign of life of ``sender`` (N-LIV-1):
        the name is the message's own word."""
        if isinstance(n, PushHeartbeat):
            for rid, token in n.token_of().items():
                if not self._forged(rid, token, sender, "PUSH_HB"):
                    self._unreachable.pop(sender, None)
                    self._on_heartbeat(sender, rid, now)
            return []
        recv = self._recvs.get(n.request_id)
        if recv is None:
            return []
        failure = n.reason if isinstance(n, PushFailed) else None
        if isinstance(n, PushFailed) and n.landing:
            if not self._forged(n.request_id, n.token, sender, "a PUSH_FAIL"):
                self._unreachable.pop(sender, None)
                self._on_landing(recv, sender, n.reason, now)
            return []
        if self._forged(
            n.request_id, n.token, sender, "a completion" if failure is None else "a PUSH_FAIL"
        ):
            return []
        self._unreachable.pop(sender, None)
        how = recv.answer(sender, failure)
        self._count(how, sender, recv, "completion" if failure is None else "PUSH_FAIL")
        if how is Answer.ACCEPTED:
            if isinstance(n, Completion):
                self._counters.inc("push_completions_received")
            elif failure != CANCELLED_REASON and not recv.write_failed_landing:
                self._counters.inc("push_failed_remote")  # (else counted at P's notice)
        ended = self.pop_final(recv)
        return [ended] if ended is not None else []

    def _on_landing(self, recv: PushRecv, sender: str, reason: str, now: float) -> None:
        """A producer's WRITE failed and the rest of it may still land (N-REL-2): the
        request fails now (vLLM is told, as for a quarantine), its blocks stay held
        until that producer answers, which it does once nothing of the WRITE can land
        any more (or it is gone, N-LIV-1)."""
        how = recv.renew(sender, now, self._answer_s)  # one of its silent producers?
        self._count(how, sender, recv, "PUSH_FAIL (landing)")
        if how is not Answer.ACCEPTED:
            return
        if not recv.write_failed_landing:
            self._counters.inc("push_failed_remote")
        recv.write_failed_landing = True
        recv.failure = recv.failure or f"P reported: {reason}"
        recv.cancel(CancelCause.WRITE_FAILED, now, self._answer_s)
        self._note_state(recv)
        if not recv.quarantined:
            self._quarantine(recv, now, f"{sorted(recv.silent)}: a WRITE failed and may land")

    def _on_heartbeat(self, sender: str, request_id: str, now: float) -> None:
        recv = self._recvs.get(request_id)
        if recv is None:
            return  # ended meanwhile: heartbeats race with the completion
        how = recv.renew(sender, now, self._answer_s)
        self._count(how, sender, recv, "PUSH_HB")
        if how is Answer.ACCEPTED:
            recv.renewed_by.add(sender)
            self._counters.inc("push_heartbeats_received")
            if recv.state in (RecvState.REGISTERED, RecvState.AWAITING):
                self._renewed.add(request_id)

    def producers_unreachable(self, agents: frozenset[str], at: float, why: str) -> None:
        """D's send to these producer agents failed at ``at`` (UCX's error on the
        endpoint: its TCP connection was declared dead, and the agents were removed
        from NIXL). Silent from then on for ``lost_after_s``, they are gone (N-LIV-1)."""
        new = agents - self._unreachable.keys()
        if new:
            logger.warning("push: producers %s unreachable: %s", sorted(new), why)
        for agent in new:
            self._unreachable[agent] = at

    def check_deadlines(
        self, now: float, ask_again: AskAgain, agents_of: AgentsOf
    ) -> list[PushRecv]:
        """CANCELLING requests whose producers' answers are overdue keep their blocks
        (quarantined, ``push_requests_quarantined``): nothing D can do stops a WRITE
        already on its way (removing the agent from NIXL does not; UCX delivers what a
        partitioned TCP link held once it returns). They end once each silent producer
        answered (asked again each answer period: ``ask_again``, since an answer sent
        while the link was down is lost) or is known gone (N-LIV-1): its engine,
        connected anew, has other agents now (it restarted), or D's send to it failed
        and it stayed silent ``lost_after_s`` since. A refused connection proves
        nothing (a Service without ready endpoints refuses for a P that only hangs).
        Ends and returns the requests that may end; a request quarantined here that
        vLLM still waits for is listed for :meth:`drain_fail_now`."""
        ended = []
        for recv in list(self._cancelling.values()):
            if recv.state is not RecvState.CANCELLING:  # ended (popped) or not yet
                self._cancelling.pop(recv.request_id, None)
                continue
            if not recv.overdue(now):
                continue
            now_agents = agents_of(recv.p_engine_id)
            if now_agents:  # connected anew: those it has are alive, the others gone
                for agent in recv.silent & now_agents:
                    self._unreachable.pop(agent, None)
                recv.producers_gone(recv.silent - now_agents, self._answer_s)
            if lost := self._lost(recv, now):
                self._counters.inc("push_producers_lost")
                logger.warning(
                    "push: %s: producers %s silent %gs since D's send to them failed "
                    "(past their own TCP user timeout): gone", recv.request_id,
                    sorted(lost), self._lost_after_s,
                    extra=event("push_producers_lost", recv.request_id, producers=sorted(lost)),
                )  # fmt: skip
                recv.producers_gone(lost, self._answer_s)
            if (
                recv.silent
                and self._quarantine_s >= 0
                and now - (recv.quarantined_at or now) >= self._quarantine_s
            ):
                self._counters.inc("push_quarantine_expired")
                logger.error(
                    "push: %s: producers %s never answered within push_quarantine_s=%gs; "
                    "freeing its blocks (a WRITE still on its way would land in reused "
                    "blocks)", recv.request_id, sorted(recv.silent), self._quarantine_s,
                    extra=event("push_quarantine_expired", recv.request_id,
                                producers=sorted(recv.silent)),
                )  # fmt: skip
                recv.quarantine_expired(f"no answer from P within {self._quarantine_s:g}s")
            if recv.silent:
                if not recv.quarantined:
                    self._quarantine(recv, now)
                ask_again(recv.request_id, recv.silent)
                recv.postpone(now, self._answer_s)
            elif (done := self.pop_final(recv)) is not None:
                ended.append(done)
        if self._unreachable:  # (rare: a send to a producer failed)
            live = {a for r in self._recvs.values() for a in r.silent}
            for agent in self._unreachable.keys() - live:  # no request waits for it
                del self._unreachable[agent]
        return ended

    def _lost(self, recv: PushRecv, now: float) -> frozenset[str]:
        """``recv``'s silent producers known gone by the transport's own failure
        detection, once none of them can still hold its registration unrenewed: P
        keeps one it never renewed for its TTL whether D can reach it or not, and
        would serve it after the link returns (one it renewed it keeps only while it
        sends, and a failed send ends it: ``DLinks._end_unwritten``)."""
        if self._lost_after_s < 0:
            return frozenset()
        return frozenset(
            a for a in recv.silent
            if (t := self._unreachable.get(a)) is not None
            and now - t >= self._lost_after_s
            and (a in recv.renewed_by or now >= recv.unrenewed_held_until)
        )  # fmt: skip

    def _quarantine(self, recv: PushRecv, now: float, why: str | None = None) -> None:
        recv.quarantined, recv.quarantined_at = True, now
        self._counters.inc("push_requests_quarantined")
        why = why or (
            f"no answer to PUSH_CANCEL from {sorted(recv.silent)} within {self._answer_s:g}s"
        )
        logger.warning(
            "push: %s: %s; its blocks stay held until they answer or are gone (a WRITE "
            "may still land)", recv.request_id, why,
            extra=event("push_quarantined", recv.request_id, producers=sorted(recv.silent)),
        )  # fmt: skip
        if recv.cause is not CancelCause.ABORTED:
            self._fail_now.append(recv)

    def _count(self, how: Answer, sender: str, recv: PushRecv, what: str) -> None:
        if how is Answer.ACCEPTED:
            return
        self._counters.inc(f"push_notifs_{how.value}")
        level = logging.WARNING if how is Answer.FOREIGN else logging.DEBUG
        logger.log(
            level,
            "push: dropped %s %s for %s from agent %s (producers: %s)",
            how.value, what, recv.request_id, sender, sorted(recv.producers or ()),
        )  # fmt: skip
