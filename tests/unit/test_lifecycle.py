# SPDX-License-Identifier: Apache-2.0
"""The push lifecycle's state machines (lifecycle.py), D's table (recv.py) and P's
leases (leases.py): legal transitions only, a deadline on every waiting state, and
every request reported exactly once."""

from __future__ import annotations

import itertools

import pytest

from vllm_ext.nixl_push.leases import (
    HOLD_S,
    LeaseClaims,
    LeaseKeeper,
    QueuedRenewals,
    heartbeat_name,
)
from vllm_ext.nixl_push.lifecycle import (
    NO_PUSH_IN_TIME,
    Answer,
    CancelCause,
    IllegalTransition,
    PushRecv,
    RecvState,
)
from vllm_ext.nixl_push.messages import Announced, KvChunk, KvFinal, RecvFailed, RegSent
from vllm_ext.nixl_push.recv import RecvTable
from vllm_ext.nixl_push.send_lifecycle import PushSend, SendState, Write, WriteState
from vllm_ext.nixl_push.stats import PushCounters
from vllm_ext.nixl_push.wire import CANCELLED, Completion, PushFailed, PushHeartbeat
from vllm_ext.nixl_push.wire import PushRegistration as Reg

P0, P1, X = "p-agent-0", "p-agent-1", "stranger"
ANSWER_S = 10.0


def recv(*producers: str) -> PushRecv:
    r = PushRecv("d-req", "P", registered_at=0.0)
    if producers:
        r.reg_sent(frozenset(producers))
    return r


# -- D: PushRecv ------------------------------------------------------------------------------


def test_done_once_every_producer_wrote_each_counted_once() -> None:
    r = recv(P0, P1)
    assert r.state is RecvState.AWAITING
    assert r.answer(P0, None) is Answer.ACCEPTED
    assert r.answer(P0, None) is Answer.DUPLICATE  # the bug this guards against
    assert r.answer(X, None) is Answer.FOREIGN
    assert r.state is RecvState.AWAITING
    assert r.answer(P1, None) is Answer.ACCEPTED
    assert r.state is RecvState.DONE and r.failure is None


def test_a_producer_failure_fails_it_once_all_answered() -> None:
    r = recv(P0, P1)
    r.answer(P0, "WRITE ended ERR")
    assert r.state is RecvState.AWAITING  # P1 may still be writing into the blocks
    r.answer(P1, None)
    assert r.state is RecvState.FAILED and "WRITE ended ERR" in (r.failure or "")


@pytest.mark.parametrize(
    "cause,answers,final",
    [
        (CancelCause.ABORTED, [None, CANCELLED], RecvState.CANCELLED),
        (CancelCause.EXPIRED, [None, None], RecvState.DONE),  # both wrote after all
        (CancelCause.EXPIRED, [None, CANCELLED], RecvState.FAILED),  # one stood down
        (CancelCause.EXPIRED, [CANCELLED, CANCELLED], RecvState.FAILED),
    ],
)
def test_cancelling_ends_when_every_producer_answered(
    cause: CancelCause, answers: list[str | None], final: RecvState
) -> None:
    r = recv(P0, P1)
    r.cancel(cause, now=0.0, answer_s=ANSWER_S)
    assert r.state is RecvState.CANCELLING and r.deadline == ANSWER_S
    for agent, failure in zip((P0, P1), answers):
        r.answer(agent, failure)
    assert r.state is final
    if final is RecvState.FAILED:
        assert r.failure == NO_PUSH_IN_TIME


def test_cancelling_has_a_deadline_that_a_writing_producer_extends() -> None:
    r = recv(P0, P1)
    r.cancel(CancelCause.EXPIRED, now=0.0, answer_s=ANSWER_S)
    r.answer(P0, CANCELLED)
    assert r.renew(P1, now=8.0, answer_s=ANSWER_S) is Answer.ACCEPTED  # P1 still writes
    assert r.renew(P0, now=8.0, answer_s=ANSWER_S) is Answer.DUPLICATE  # P0 answered
    assert r.renew(X, now=8.0, answer_s=ANSWER_S) is Answer.FOREIGN
    assert not r.overdue(now=ANSWER_S + 1)  # extended to 18
    assert r.overdue(now=18.0) and r.silent == {P1}
    r.producers_gone(frozenset({P1, X}), answer_s=ANSWER_S)  # X: not a producer
    assert r.state is RecvState.FAILED and "did not answer" in (r.failure or "")
    assert r.gone == {P1}


def test_blocks_are_never_freed_while_a_producer_may_still_write() -> None:
    """The invariant (docs/design.md, "Which blocks a WRITE may touch"): a request whose
    PUSH_REG reached producers reaches no final state (its blocks stay with it) until
    each one answered or is known gone; its deadline alone ends nothing."""
    r = recv(P0, P1)
    with pytest.raises(IllegalTransition):
        r.fail("a local failure while P may still write")
    r.cancel(CancelCause.EXPIRED, now=0.0, answer_s=ANSWER_S)
    r.answer(P0, CANCELLED)
    assert r.overdue(now=ANSWER_S)
    r.producers_gone(frozenset(), answer_s=ANSWER_S)  # P1 is not known gone
    assert r.state is RecvState.CANCELLING
    r.postpone(now=ANSWER_S, answer_s=ANSWER_S)
    assert not r.overdue(now=ANSWER_S + 1) and r.overdue(now=2 * ANSWER_S)
    r.answer(P1, None)  # it wrote after all: nothing was lost
    assert r.state is RecvState.FAILED  # P0 stood down


def test_no_deadline_ends_a_registration_that_has_not_gone_out() -> None:
    """While the writer has not said where the PUSH_REG went (its handshake with P may
    complete at any moment), only the writer ends it (RegSent / RegUnsent)."""
    r = recv()
    r.cancel(CancelCause.ABORTED, now=0.0, answer_s=ANSWER_S)
    assert not r.overdue(now=100 * ANSWER_S)
    r.reg_sent(frozenset({P0}))
    assert r.overdue(now=100 * ANSWER_S)


def test_cancelled_before_the_registration_went_out() -> None:
    aborted = recv()
    aborted.cancel(CancelCause.ABORTED, 0.0, ANSWER_S)
    aborted.unsent()
    assert aborted.state is RecvState.CANCELLED
    expired = recv()
    expired.cancel(CancelCause.EXPIRED, 0.0, ANSWER_S)
    expired.unsent()
    assert expired.state is RecvState.FAILED and expired.failure == NO_PUSH_IN_TIME


def test_cancelled_while_the_registration_went_out_waits_for_its_producers() -> None:
    r = recv()
    r.cancel(CancelCause.ABORTED, 0.0, ANSWER_S)
    r.reg_sent(frozenset({P0}))  # the writer had sent it already
    assert r.state is RecvState.CANCELLING
    r.answer(P0, CANCELLED)
    assert r.state is RecvState.CANCELLED


def test_an_abort_wins_over_an_expiry() -> None:
    r = recv(P0)
    r.cancel(CancelCause.EXPIRED, 0.0, ANSWER_S)
    r.cancel(CancelCause.ABORTED, 1.0, ANSWER_S)
    assert r.deadline == ANSWER_S  # not restarted
    r.answer(P0, CANCELLED)
    assert r.state is RecvState.CANCELLED


def test_a_partial_registration_cancels_with_the_producers_it_reached() -> None:
    r = recv()
    r.reg_partly_sent(frozenset({P0}), "P rank 1 unreachable", 0.0, ANSWER_S)
    assert r.state is RecvState.CANCELLING and r.producers == {P0}
    r.answer(P0, None)  # it wrote: still failed, P1's half never came
    assert r.state is RecvState.FAILED and r.failure == "P rank 1 unreachable"


@pytest.mark.parametrize("final", [RecvState.DONE, RecvState.FAILED, RecvState.CANCELLED])
def test_a_final_recv_allows_no_transition(final: RecvState) -> None:
    r = recv() if final is RecvState.FAILED else recv(P0)
    if final is RecvState.DONE:
        r.answer(P0, None)
    elif final is RecvState.FAILED:
        r.fail("boom")  # nothing went out
    else:
        r.cancel(CancelCause.ABORTED, 0.0, ANSWER_S)
        r.answer(P0, CANCELLED)
    assert r.state is final
    for attempt in (
        lambda: r.fail("again"),
        lambda: r.cancel(CancelCause.ABORTED, 0.0, ANSWER_S),
        lambda: r.reg_sent(frozenset({P0})),
        r.unsent,
    ):
        with pytest.raises(IllegalTransition):
            attempt()


def totals_of(counters: PushCounters) -> dict[str, float]:
    return dict(counters.totals())


# -- D: RecvTable -----------------------------------------------------------------------------


def test_the_table_reports_each_request_exactly_once() -> None:
    """Whatever arrives (repeats, strangers, heartbeats, deadlines), a request leaves the
    table once, when it reaches a final state."""
    counters = PushCounters()
    table = RecvTable(counters, ANSWER_S)
    ended: list[PushRecv] = []
    for i in range(4):
        table.register(f"r{i}", "P", now=0.0)
        table.on_writer(RegSent(f"r{i}", frozenset({P0, P1})), now=0.0)
    with pytest.raises(IllegalTransition):
        table.register("r0", "P", now=0.0)
    events = [
        (P0, Completion("r0", 2)), (P0, Completion("r0", 2)), (X, Completion("r0", 2)),
        (P1, PushHeartbeat(("r0", "r1", "nobody"))), (X, PushHeartbeat(("r2",))),
    ]  # fmt: skip
    for sender, n in events:
        ended += table.on_notif(sender, n, now=1.0)
    assert table.drain_renewed() == {"r0", "r1"} and table.drain_renewed() == frozenset()
    events = [
        (P1, Completion("r0", 2)), (P1, Completion("r0", 2)),
        (P0, PushFailed("r1", "ERR")), (P1, Completion("r1", 2)),
    ]  # fmt: skip
    for sender, n in events:
        ended += table.on_notif(sender, n, now=1.0)
    table.cancel("r2", CancelCause.ABORTED, now=1.0)
    # a failure while producers may still write: held until they answer or are removed
    assert table.on_writer(RecvFailed("r3", "no P"), now=1.0) is None
    assert table.get("r3") is not None and table.get("r3").state is RecvState.CANCELLING
    asked: list[tuple[str, frozenset[str]]] = []

    def ask_again(rid: str, agents: frozenset[str]) -> None:
        asked.append((rid, agents))

    # r2's and r3's producers never answered the cancel: their requests keep the blocks
    # while P0 and P1 may still write, and ask them again ...
    assert table.check_deadlines(1.0 + ANSWER_S, ask_again, lambda e: frozenset({P0, P1})) == []
    assert sorted(asked) == [("r2", frozenset({P0, P1})), ("r3", frozenset({P0, P1}))]
    assert totals_of(counters)["push_requests_quarantined"] == 2
    # ... until P's engine, connected anew, has other agents (it restarted)
    ended += table.check_deadlines(1.0 + 2 * ANSWER_S, ask_again, lambda e: frozenset({X}))
    assert len(asked) == 2
    assert sorted(r.request_id for r in ended) == ["r0", "r1", "r2", "r3"]
    assert [r.state for r in sorted(ended, key=lambda r: r.request_id)] == [
        RecvState.DONE, RecvState.FAILED, RecvState.CANCELLED, RecvState.FAILED,
    ]  # fmt: skip
    assert len(table) == 0
    totals = counters.totals()
    assert totals["push_notifs_duplicate"] == 1 and totals["push_notifs_foreign"] == 2
    assert totals["push_completions_received"] == 3 and totals["push_failed_remote"] == 1


def test_a_silent_producer_is_gone_only_once_unreachable_for_the_bound() -> None:
    """N-LIV-1 with a clock of our own: a quarantined request ends when D's send to its
    silent producer failed and the producer stayed silent ``lost_after_s`` since; any
    sign of life (a notification, a handshake showing the same agents) starts over. A
    request vLLM still waits for is listed to fail now; an aborted one is not."""
    counters = PushCounters()
    table = RecvTable(counters, ANSWER_S, lost_after_s=60.0)
    for rid in ("r0", "r1"):
        table.register(rid, "P", now=0.0, blocks=3)
        table.on_writer(RegSent(rid, frozenset({P0})), now=0.0)
    table.cancel("r0", CancelCause.EXPIRED, now=0.0)
    table.cancel("r1", CancelCause.ABORTED, now=0.0)

    def check(now: float, agents: frozenset[str] | None = None) -> list[str]:
        ended = table.check_deadlines(now, lambda rid, who: None, lambda e: agents)
        return sorted(r.request_id for r in ended)

    assert check(ANSWER_S) == []
    assert [r.request_id for r in table.drain_fail_now()] == ["r0"]  # r1 is gone in vLLM
    assert table.quarantined_blocks() == 6
    assert counters.totals()["push_requests_quarantined"] == 2
    # no failed send: silence alone (a hung P, whose kernel still acks) never ends it
    assert check(1000.0) == []
    table.producers_unreachable(frozenset({P0}), at=1000.0, why="send failed")
    assert check(1059.0) == []  # (checked each answer period: next due at 1069)
    # a heartbeat from P0: alive after all
    table.on_notif(P0, PushHeartbeat(("r0",)), now=1059.5)
    assert check(1070.0) == []
    table.producers_unreachable(frozenset({P0}), at=1080.0, why="send failed")
    # a handshake answered with the same agents: alive
    assert check(1141.0, frozenset({P0})) == []
    table.producers_unreachable(frozenset({P0}), at=1150.0, why="send failed")
    assert check(1209.0) == []
    assert check(1219.0) == ["r0", "r1"]
    assert counters.totals()["push_producers_lost"] == 2
    assert table.quarantined_blocks() == 0 and len(table) == 0
    assert table.drain_fail_now() == []


def test_without_a_bounded_tcp_user_timeout_a_silent_producer_is_never_given_up() -> None:
    counters = PushCounters()
    table = RecvTable(counters, ANSWER_S)  # lost_after_s -1: UCX's unbounded default
    table.register("r0", "P", now=0.0)
    table.on_writer(RegSent("r0", frozenset({P0})), now=0.0)
    table.cancel("r0", CancelCause.ABORTED, now=0.0)
    table.producers_unreachable(frozenset({P0}), at=0.0, why="send failed")
    assert table.check_deadlines(1e6, lambda rid, who: None, lambda e: None) == []
    assert table.get("r0") is not None and table.get("r0").quarantined


def test_a_failed_write_notice_fails_now_and_holds_the_blocks_until_the_answer() -> None:
    """N-REL-2: P's notice that a WRITE failed while its rest may land fails the
    request in vLLM at once (listed to fail now) but keeps its blocks (quarantined)
    until that producer's answer; a notice from anyone else changes nothing, and the
    failure is counted once."""
    counters = PushCounters()
    table = RecvTable(counters, ANSWER_S)
    table.register("r0", "P", now=0.0, blocks=3)
    table.on_writer(RegSent("r0", frozenset({P0, P1})), now=0.0)
    notice = PushFailed("r0", "WRITE ended ERR", landing=True)
    assert table.on_notif(X, notice, now=1.0) == []
    assert not table.get("r0").quarantined and table.drain_fail_now() == []
    assert table.on_notif(P0, notice, now=1.0) == []
    assert [r.request_id for r in table.drain_fail_now()] == ["r0"]
    assert table.quarantined_blocks() == 3 and table.get("r0").state is RecvState.CANCELLING
    # P1 answers (it wrote); P0 is still silent: its WRITE may land, the blocks stay
    assert table.on_notif(P1, Completion("r0", 2), now=2.0) == []
    assert table.check_deadlines(100.0, lambda rid, who: None, lambda e: None) == []
    assert table.quarantined_blocks() == 3
    (ended,) = table.on_notif(P0, PushFailed("r0", "WRITE ended ERR"), now=120.0)
    assert ended.state is RecvState.FAILED and table.quarantined_blocks() == 0
    totals = counters.totals()
    assert totals["push_failed_remote"] == 1 and totals["push_notifs_foreign"] == 1
    assert totals["push_requests_quarantined"] == 1


# -- P: PushSend and Write ----------------------------------------------------------------------


def reg(rank: int = 0, tp: int = 1) -> Reg:
    return Reg("D", "d-req", ((1, 2),), rank, tp, "h", 1, 16)


def test_a_send_is_written_once_every_d_rank_is_served() -> None:
    send = PushSend.of(KvFinal("p-req", ((7, 8),)), now=5.0)
    assert send.state is SendState.FINISHED
    send.serve(reg(0, 2), expected=2)
    w0 = Write(reg(0, 2), "d0", matched_at=6.0)
    send.add_write(w0, timeout_s=30.0)
    assert send.state is SendState.WRITING and w0.deadline == 36.0
    w0.arm("handle", 64)
    w0.post()
    w0.done()
    assert not send.settle() and send.state is SendState.FINISHED  # D rank 1 to come
    send.serve(reg(1, 2), expected=2)
    w1 = Write(reg(1, 2), "d1", matched_at=7.0)
    send.add_write(w1, timeout_s=30.0)
    w1.arm(None, 0)  # completion only
    w1.done()
    assert send.settle() and send.state is SendState.WRITTEN
    assert not send.settle()  # reported once


def test_an_announced_send_prepares_and_posts_when_the_kv_is_final() -> None:
    send = PushSend.of(Announced("p-req", ((7, 8),)), now=0.0)
    assert send.state is SendState.ANNOUNCED
    w = Write(reg(), "d0", matched_at=1.0)
    send.add_write(w, timeout_s=30.0)
    w.arm("handle", 64)
    assert w.deadline is None and not send.settle()  # no clock before the KV is final
    send.finalize(KvFinal("p-req", ((7, 8),), finished_at=2.0), now=3.0, timeout_s=30.0)
    assert send.state is SendState.WRITING and w.deadline == 33.0
    with pytest.raises(IllegalTransition):
        send.finalize(KvFinal("p-req", ((7, 8),)), now=4.0, timeout_s=30.0)


def test_a_streamed_send_completes_only_after_its_prompt_ended() -> None:
    """S-PRG-1: chunks are written while the prompt is computed; the request is settled
    only once its last WRITE (after every chunk) is done."""
    chunk = KvChunk("p-req", ((7,),), kv_tokens=20)
    send = PushSend.of(chunk, now=0.0)
    assert send.state is SendState.PREFILLING and not send.prompt_ended
    send.serve(reg(), expected=1)
    w = Write(reg(), "d0", matched_at=1.0)
    send.add_write(w, timeout_s=30.0)
    w.stream()
    w.post_chunk("h1", until_tokens=16, nbytes=64)
    assert w.in_flight and w.deadline is None  # no clock before the KV is final
    with pytest.raises(IllegalTransition):
        w.post_chunk("h2", until_tokens=32, nbytes=64)  # one chunk WRITE at a time
    with pytest.raises(IllegalTransition):
        w.arm("last", 128)  # the last WRITE follows every chunk WRITE
    send.add_chunk(KvChunk("p-req", ((7, 8),), kv_tokens=40))
    w.handle = None
    w.chunk_done(count=True)
    assert w.streamed_tokens == 16 and not w.in_flight and not send.settle()
    send.finalize(KvFinal("p-req", ((7, 8, 9),), finished_at=2.0), now=3.0, timeout_s=30.0)
    assert send.state is SendState.WRITING and w.deadline == 33.0
    w.arm("last", 128)
    assert w.nbytes == 192
    w.post()
    w.done()
    assert send.settle() and send.state is SendState.WRITTEN


def test_a_streamed_send_that_stopped_fails_even_if_nothing_was_matched() -> None:
    send = PushSend.of(KvChunk("p-req", ((7,),), kv_tokens=20), now=0.0)
    send.stop()
    assert send.stopped and send.complete  # nothing is matched any more
    assert send.settle() and send.state is SendState.FAILED


def test_a_chunk_done_after_a_preemption_does_not_count() -> None:
    w = Write(reg(), "d0", matched_at=0.0)
    w.stream()
    w.post_chunk("h1", until_tokens=32, nbytes=64)
    w.handle = None
    w.chunk_done(count=False)  # it may have read blocks freed meanwhile
    assert w.streamed_tokens == 0


def test_a_failed_write_fails_the_send_and_counts_transfers() -> None:
    send = PushSend.of(KvFinal("p-req", ((7, 8),)), now=0.0)
    send.serve(reg(), expected=1)
    w = Write(reg(), "d0", matched_at=0.0)
    send.add_write(w, timeout_s=1.0)
    w.arm("handle", 64)
    w.post()
    w.abandon(until=2.0)  # past its deadline; NIXL could not cancel it
    assert not send.settle()  # NIXL still reads the blocks
    w.fail("WRITE not done within 1s", transfer=True)
    assert send.settle() and send.state is SendState.FAILED and send.failed_transfers == 1


def test_write_transitions_are_checked() -> None:
    w = Write(reg(), "d0", matched_at=0.0)
    for illegal in (w.post, w.done, lambda: w.abandon(1.0)):
        with pytest.raises(IllegalTransition):
            illegal()
    w.fail("handshake failed")
    assert w.state is WriteState.FAILED
    with pytest.raises(IllegalTransition):
        w.fail("again")


def test_a_write_nixl_failed_stays_in_flight_until_its_rest_cannot_land() -> None:
    """N-REL-2: once NIXL reported the transfer failed (and its handle was released)
    the WRITE still counts as in flight, with a deadline, then fails; only a posted
    (or streaming, or abandoned) one can be in that state."""
    w = Write(reg(), "d0", matched_at=0.0)
    with pytest.raises(IllegalTransition):
        w.failed_landing("ERR", 5.0)  # never posted
    w.arm(handle=None, nbytes=0)
    w.post()
    w.failed_landing("WRITE ended ERR", 5.0)
    assert w.state is WriteState.ABANDONING and w.in_flight
    assert (w.deadline, w.landing_until, w.failure) == (5.0, 5.0, "WRITE ended ERR")
    w.fail("WRITE ended ERR", transfer=True)
    assert w.state is WriteState.FAILED and not w.in_flight


def test_an_evicted_send_expires_once() -> None:
    send = PushSend.of(KvFinal("p-req", ((7, 8),)), now=0.0)
    send.expire()
    assert send.state is SendState.EXPIRED and send.state.final
    with pytest.raises(IllegalTransition):
        send.expire()


# -- P: leases ---------------------------------------------------------------------------------


def test_claims_a_revoked_lease_cannot_be_protected_again() -> None:
    claims = LeaseClaims()
    assert not claims.protect("r")  # never handed over
    claims.hand("r")
    assert claims.protects("r") and not claims.reap("r")  # a WRITE may read them
    claims.unprotect("r")
    assert claims.reap("r")  # the lease applies: revoked
    assert not claims.protect("r")  # a late registration gets no WRITE
    claims.hand("r")
    assert not claims.protects("r")
    claims.discard("r")
    assert len(claims) == 0


def test_claims_a_preempted_request_gets_no_write_whatever_its_lease() -> None:
    """vLLM preempted the announced request: no WRITE starts on its blocks from then on,
    and the engine thread learns whether one already posted still runs."""
    claims = LeaseClaims()
    claims.hand("r")
    assert claims.start_write("r")  # posted before the preemption
    assert claims.preempt("r")  # it still runs: the engine thread waits
    assert not claims.start_write("r") and not claims.protect("r")
    assert claims.preempted("r") and claims.writing("r")
    claims.end_write("r")
    assert not claims.writing("r")
    claims.hand("r")  # a later hand-over does not undo it
    assert claims.reap("r") and claims.force_reap("r")  # nothing protects it
    assert claims.preempted("r") and not claims.start_write("r")
    assert not claims.preempt("q")  # never posted: nothing to wait for
    claims.discard("r")
    assert not claims.preempted("r")


def test_the_keeper_reaps_at_the_lease_end_holds_protected_and_caps() -> None:
    claims = LeaseClaims()
    keeper = LeaseKeeper(claims, overrun_s=4.0)
    for rid in ("free", "busy", "other"):
        claims.hand(rid)
    claims.unprotect("free")
    leases = {"free": 10.0, "busy": 10.0, "other": 100.0}
    # Before the end: held from vLLM's reaper, not reaped.
    assert keeper.decide(leases, now=9.5) == ([], [], [])
    assert leases["free"] == leases["busy"] == 9.5 + HOLD_S and leases["other"] == 100.0
    assert list(leases)[-2:] == ["free", "busy"]  # vLLM's reaper walks them in order
    # At the end: the unprotected one goes, the protected one is extended.
    assert keeper.decide(leases, now=10.1) == (["free"], [], [])
    assert "free" not in leases and leases["busy"] == 10.1 + HOLD_S
    # Extended no further than the cap (the lease end + overrun).
    for now in itertools.takewhile(lambda t: t < 14.0, itertools.count(10.5, 0.5)):
        assert keeper.decide(leases, now=now) == ([], [], [])
        assert leases["busy"] <= 14.0
    assert keeper.decide(leases, now=14.0) == ([], ["busy"], [])
    assert not claims.protects("busy")
    assert list(leases) == ["other"] and len(keeper) == 0


def test_the_keeper_follows_a_lease_vllm_extended() -> None:
    """vLLM's pull-mode heartbeats move a lease: its new expiry is its end."""
    keeper = LeaseKeeper(LeaseClaims(), overrun_s=4.0)
    leases = {"r": 10.0}
    keeper.decide(leases, now=9.5)  # held to 10.5
    leases["r"] = 20.0  # vLLM's _handle_heartbeat
    assert keeper.decide(leases, now=12.0) == ([], [], []) and leases["r"] == 20.0
    assert keeper.decide(leases, now=20.0) == (["r"], [], [])


def test_the_cap_never_frees_blocks_a_running_write_reads() -> None:
    """S-SAFE-1 on P: past the hard cap a request is freed only if no WRITE posted on
    its blocks still runs; one that does pins them (reported once) until NIXL ends it,
    and no WRITE can be posted on a revoked request."""
    claims = LeaseClaims()
    keeper = LeaseKeeper(claims, overrun_s=4.0)
    claims.hand("r")
    assert claims.start_write("r") and claims.writing("r")
    claims.unprotect("r")  # the writer's settle must not unprotect a running WRITE
    leases = {"r": 10.0}
    assert keeper.decide(leases, now=10.1) == ([], [], [])
    assert keeper.decide(leases, now=14.0) == ([], [], ["r"])  # pinned, reported once
    assert keeper.decide(leases, now=30.0) == ([], [], []) and "r" in leases
    assert leases["r"] >= 30.0  # vLLM's reaper does not take it meanwhile
    claims.end_write("r")  # NIXL reported it ended
    assert not claims.writing("r")
    assert keeper.decide(leases, now=30.5) == ([], ["r"], [])
    assert not claims.start_write("r")  # revoked: nothing more is posted on its blocks


def test_a_queued_d_renews_a_lease_by_transfer_id_up_to_the_cap() -> None:
    """S-TMO-2: a waiting push D leg's heartbeat names its transfer id; P moves that
    request's lease like vLLM's own heartbeat would, never past the cap, and an id it
    does not hold (another P's, or a request already gone) changes nothing."""
    renewals = QueuedRenewals(cap_s=30.0)
    renewals.hold("r", "t-r", now=0.0)
    renewals.hold("s", None, now=0.0)  # no transfer id: a pull P leg, not ours to renew
    leases = {"r": 10.0, "q": 12.0}
    assert renewals.renew(leases, ["t-r", "t-x", ""], now=5.0, extension=20.0) == (["r"], 0)
    assert leases == {"q": 12.0, "r": 25.0} and list(leases) == ["q", "r"]
    assert renewals.renew(leases, ["t-r"], now=5.0, extension=20.0) == ([], 0)  # no later
    assert renewals.renew(leases, ["t-r"], now=25.0, extension=20.0) == (["r"], 0)
    assert leases["r"] == 30.0, "renewed past the cap"
    assert renewals.renew(leases, ["t-r"], now=29.0, extension=20.0) == ([], 0)
    renewals.forget("r")
    renewals.forget("s")
    assert len(renewals) == 0
    leases["r"] = 1.0
    assert renewals.renew(leases, ["t-r"], now=0.5, extension=20.0) == ([], 0)
    assert leases["r"] == 1.0


def test_a_queued_d_renews_every_sub_request_of_its_body() -> None:
    """The sub-requests of one client body (several prompts, ``n > 1``) share a transfer
    id: one heartbeat naming it renews all of their leases (before, only the request
    held last was renewed, and the others lost P's blocks at their lease's end)."""
    renewals = QueuedRenewals(cap_s=30.0)
    for rid in ("cmpl-b-0", "cmpl-b-1", "cmpl-b-2"):
        renewals.hold(rid, "t-b", now=0.0)
    leases = {"cmpl-b-0": 10.0, "cmpl-b-1": 10.0, "cmpl-b-2": 10.0}
    assert renewals.renew(leases, ["t-b"], now=5.0, extension=20.0) == (
        ["cmpl-b-0", "cmpl-b-1", "cmpl-b-2"], 0,
    )  # fmt: skip
    assert leases == dict.fromkeys(leases, 25.0)
    renewals.forget("cmpl-b-1")
    assert renewals.renew(leases, ["t-b"], now=8.0, extension=20.0) == (["cmpl-b-0", "cmpl-b-2"], 0)
    renewals.forget("cmpl-b-0")
    renewals.forget("cmpl-b-2")
    assert len(renewals) == 0 and renewals.renew(leases, ["t-b"], 9.0, 20.0) == ([], 0)


def test_the_keeper_decides_leases_set_in_a_step_and_leases_it_did_not_see_set() -> None:
    """The keeper looks only at leases near their end: those vLLM set from a step's
    metadata (``track``), and any other it finds by their number."""
    claims = LeaseClaims()
    keeper = LeaseKeeper(claims, overrun_s=4.0)
    for rid in ("a", "b", "c"):
        claims.hand(rid)
        claims.unprotect(rid)
    leases = {"a": 100.0}
    assert keeper.decide(leases, now=0.0) == ([], [], [])
    leases["b"] = 5.0  # set behind the keeper's back: one lease more than it knows
    assert keeper.decide(leases, now=4.5) == ([], [], [])
    assert leases["b"] == 4.5 + HOLD_S  # held from vLLM's reaper
    del leases["a"]  # as many leases as before: only ``track`` tells the keeper
    leases["c"] = 7.0
    keeper.track(leases, ["c"])
    assert keeper.decide(leases, now=5.1) == (["b"], [], [])
    assert keeper.decide(leases, now=7.0) == (["c"], [], [])
    assert leases == {} and len(keeper) == 0


def test_no_lease_the_keeper_knows_expires_before_its_next_expiry() -> None:
    """vLLM 0.32's reaper walks the leases only from the keeper's next expiry on."""
    claims = LeaseClaims()
    keeper = LeaseKeeper(claims, overrun_s=4.0)
    assert keeper.next_expiry() is None
    leases = {"a": 10.0, "b": 30.0, "c": 20.0}
    for rid in leases:
        claims.hand(rid)
    keeper.decide(leases, now=0.0)
    assert keeper.next_expiry() == 10.0
    keeper.decide(leases, now=9.5)  # "a" held from vLLM's reaper until 10.5
    first = keeper.next_expiry()
    assert first is not None and 9.5 < first <= min(leases.values())
    leases["a"] = 25.0  # vLLM moved it later: the keeper's bound stays a bound
    assert first <= min(leases.values())


def test_a_held_request_with_a_secret_is_renewed_only_with_its_proof() -> None:
    """S-TMO-2 with S-LEG-3: anyone who saw a transfer id could keep P's blocks (up to
    the cap) by naming it in a lease heartbeat; a request whose legs carry a secret is
    renewed only by the name D builds from that secret, the secret itself not in it."""
    secret = "s" * 32
    renewals = QueuedRenewals(cap_s=30.0)
    renewals.hold("r", "t~1", now=0.0, secret=secret)  # a "~" in a client's id
    renewals.hold("open", "t-open", now=0.0)  # no secret: the transfer id is the proof
    leases = {"r": 10.0, "open": 10.0}
    forged = ["t~1", "t~1~" + "0" * 32, heartbeat_name("t~1", "x" * 32)]
    assert renewals.renew(leases, forged, now=5.0, extension=20.0) == ([], 3)
    assert leases == {"r": 10.0, "open": 10.0}
    name = heartbeat_name("t~1", secret)
    assert secret not in name and "," not in name
    assert renewals.renew(leases, [name, "t-open"], now=5.0, extension=20.0) == (["r", "open"], 0)
    assert leases == {"r": 25.0, "open": 25.0}


def test_only_a_notification_with_its_token_is_a_sign_of_life() -> None:
    """N-LIV-1 counts a notification as a sign of life only once it proved it comes from
    the producer (the registration's reply token, S-WIR-3): any peer can put P's agent
    name on a PUSH_HB, and before, a forged one kept a partitioned P from ever being
    given up (its quarantined blocks held for good)."""
    counters = PushCounters()
    table = RecvTable(counters, ANSWER_S, lost_after_s=60.0)
    table.register("r0", "P", now=0.0, blocks=3, reply_token="the-token")
    table.on_writer(RegSent("r0", frozenset({P0})), now=0.0)
    table.cancel("r0", CancelCause.ABORTED, now=0.0)
    table.producers_unreachable(frozenset({P0}), at=10.0, why="send failed")
    for forged in (PushHeartbeat(("r0",), ("not-the-token",)), Completion("r0", 1, "nope")):
        table.on_notif(P0, forged, now=40.0)
    assert counters.totals()["push_notifs_forged"] == 2
    ended = table.check_deadlines(71.0, lambda rid, who: None, lambda e: None)
    assert [r.request_id for r in ended] == ["r0"]


def test_reply_tokens_are_unguessable_and_never_repeat() -> None:
    """S-WIR-3: each registration's reply token is 16 random bytes (hex), read from the
    system's CSPRNG in batches; none repeats, across batches too."""
    from vllm_ext.nixl_push.recv import ReplyTokens

    tokens = ReplyTokens()
    taken = [tokens.take() for _ in range(3 * ReplyTokens.BATCH + 5)]
    assert all(len(t) == 32 and int(t, 16) >= 0 for t in taken)
    assert len(set(taken)) == len(taken)
