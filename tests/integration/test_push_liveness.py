# SPDX-License-Identifier: Apache-2.0
"""Dead, slow and broken peers cost a bounded time, and a broken connection heals
(docs/design.md, "Failures"; S-WRT-5, S-FAIL-4, S-FLT-1).

Real vLLM Schedulers and connector workers over the fake NIXL fabric; a side channel
that answers junk (``listener="garbage"``) stands for a peer whose handshake fails.
"""

from __future__ import annotations

import threading
import time

import pytest
from push_harness import (
    HandshakeGate,
    PushEnv,
    notifs,
    pending_regs,
    wait_until,
)
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.wire import PUSH_FAIL_PREFIX


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 53 + i * 13) % 1000 + 3 for i in range(n)]


@pytest.mark.timeout(60)
def test_a_failed_handshake_is_remembered_for_a_short_back_off(env: PushEnv) -> None:
    """Before: every request to a peer whose handshake fails ran (and waited for) a
    handshake of its own. Now the failure is remembered for push_handshake_backoff_s:
    the next requests to it fail at once, and after the back-off it is tried again.

    The back-off is the default (5 s), not shorter: the next two requests must come
    within it, and each takes a few engine steps, which a loaded machine makes slow."""
    p = env.engine("P", "kv_producer", listener="garbage")
    d = env.engine("D", "kv_consumer")
    backoff_s = d.workers[0].push_config.push_handshake_backoff_s
    for i in range(3):
        d.add_request(f"cmpl-bo{i}-0-bbbbbbbb", _prompt(i), p.d_leg(), max_tokens=2)
        env.run_until(lambda i=i: f"cmpl-bo{i}-0-bbbbbbbb" in d.finished)
        if i == 0:  # the handshake failed (and its back-off began) before this
            backoff_ends = time.monotonic() + backoff_s
    assert p._garbage is not None and p._garbage.queries == 1, "a handshake per request"
    assert d.totals("push_handshakes_backed_off") == 2
    time.sleep(max(0.0, backoff_ends - time.monotonic()) + 0.05)  # the peer is tried again
    d.add_request("cmpl-bo9-0-bbbbbbbb", _prompt(9), p.d_leg(), max_tokens=2)
    env.run_until(lambda: "cmpl-bo9-0-bbbbbbbb" in d.finished)
    assert p._garbage.queries == 2
    assert all(r.status == RequestStatus.FINISHED_ERROR for r in d.finished.values())


@pytest.mark.timeout(60)
def test_a_slow_peer_does_not_hold_back_handshakes_with_others(env: PushEnv) -> None:
    """D's handshake with P1 hangs (held here); a request to P2 is served meanwhile.
    Before: vLLM runs one handshake at a time, so P2's waited behind P1's."""
    p1 = env.engine("P1", "kv_producer")
    p2 = env.engine("P2", "kv_producer")
    d = env.engine("D", "kv_consumer")
    release, started = threading.Event(), []
    handshake = d.workers[0]._nixl_handshake

    def slow_p1(host, port, tp, engine_id, *rest):  # type: ignore[no-untyped-def]
        if engine_id == "P1":  # P1 answers only once released
            started.append(engine_id)
            assert release.wait(20), "never released"
        return handshake(host, port, tp, engine_id, *rest)

    d.workers[0]._nixl_handshake = slow_p1  # type: ignore[method-assign]
    d.add_request("cmpl-s1-0-bbbbbbbb", _prompt(1), p1.d_leg(), max_tokens=2)
    env.run_until(lambda: started == ["P1"], what="D -> P1 handshake held")
    prompt = _prompt(2)
    d.add_request("cmpl-s2-0-bbbbbbbb", prompt, p2.d_leg(), max_tokens=2)
    p2.add_request("cmpl-s2-0-aaaaaaaa", prompt, p2.p_leg())
    env.run_until(lambda: "cmpl-s2-0-bbbbbbbb" in d.finished, what="P2 served while P1 hangs")
    assert d.finished["cmpl-s2-0-bbbbbbbb"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    release.set()
    p1.add_request("cmpl-s1-0-aaaaaaaa", _prompt(1), p1.p_leg())
    env.run_until(lambda: "cmpl-s1-0-bbbbbbbb" in d.finished)
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_an_unmatched_registration_is_answered_when_p_drops_it(env: PushEnv) -> None:
    """P never gets the request a PUSH_REG waits for (the proxy lost the P leg): when P
    drops it (0.8 x D's watchdog) it tells D, which fails it then. Before: D waited for
    its own watchdog."""
    p, d = env.pair(d_kw={"extra_config": {"push_registration_timeout_s": 4.0}})
    d_id = "cmpl-ua-0-bbbbbbbb"
    d.add_request(d_id, _prompt(3), p.d_leg(), max_tokens=2)
    env.run_until(lambda: pending_regs(p.workers[0]) == 1)
    env.run_until(lambda: d_id in d.finished, what="D fails it")
    assert p.totals("push_regs_expired") == 1
    (told,) = notifs(env.fabric, PUSH_FAIL_PREFIX)
    assert told.receiver == d.agents[0].name
    # (D fails it by that answer, or by its own watchdog if a loaded host delays it)
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_write_error_removes_the_peer_and_the_next_request_connects_anew(
    env: PushEnv,
) -> None:
    """A WRITE ends in a NIXL error (a broken connection, say): once no WRITE to that D
    is in flight, P removes D's agent from NIXL (its endpoints go with it) and the next
    request handshakes anew and is served. Before: P kept the agent and its endpoints
    for good (after a long partition the pair never served again)."""
    p, d = env.pair()
    gate = HandshakeGate(p.workers[0], closed=False)  # counts P -> D handshakes
    env.fabric.fail_next_transfer("state", initiator=p.agents[0].name)
    prompt = _prompt(4)
    d.add_request("cmpl-we-0-bbbbbbbb", prompt, p.d_leg(), max_tokens=2)
    p.add_request("cmpl-we-0-aaaaaaaa", prompt, p.p_leg())
    env.run_until(lambda: "cmpl-we-0-bbbbbbbb" in d.finished)
    env.run_until(lambda: p.totals("push_peers_healed") == 1, what="D removed from P's NIXL")
    assert not p.workers[0].remote_agents_of("D")
    assert d.agents[0].name not in p.agents[0].remote_agents()
    started = gate.started
    prompt = _prompt(5)
    d.add_request("cmpl-we-1-bbbbbbbb", prompt, p.d_leg(), max_tokens=2)
    p.add_request("cmpl-we-1-aaaaaaaa", prompt, p.p_leg())
    env.run_until(lambda: "cmpl-we-1-bbbbbbbb" in d.finished)
    assert d.finished["cmpl-we-1-bbbbbbbb"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert gate.started == started + 1, "P did not connect to D anew"
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_after_a_partition_the_held_blocks_come_back_and_the_pair_serves_again(
    env: PushEnv,
) -> None:
    """A partition outlasts UCX's keepalive while P's WRITE runs (strict quarantine):
    every endpoint between the two fails, and stays failed after the link returns.
    D's cancel and its re-asks fail to send; D keeps the blocks (S-SAFE-1). Once the
    link is back, D's re-ask connects anew, P's answer (over a failed endpoint too)
    makes P remove D and answer over a new connection, and the request ends. P's
    heartbeats to D failed during the cut too, so P has connected anew already: the
    first request after the link is back is served. Before: both kept their failed
    endpoints, D held the blocks for good and the pair never served again
    (link-cut-long); then P found its failed endpoint only with the next WRITE, which
    failed that request."""
    answer_s = 0.3
    p, d = env.pair(
        d_kw={"extra_config": {"push_cancel_answer_timeout_s": answer_s, "push_quarantine_s": -1}}
    )
    pa, da = p.agents[0].name, d.agents[0].name
    env.fabric.fail_next_transfer("hang_uncancellable", initiator=pa)
    prompt = _prompt(6)
    d_id, p_id = "cmpl-pt-0-bbbbbbbb", "cmpl-pt-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg())
    env.run_until(lambda: env.fabric.pending_transfers(), what="the WRITE runs")
    env.fabric.cut_link(pa, da)
    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    env.run_until(lambda: d.totals("push_requests_quarantined") == 1, what="overdue")
    end = time.monotonic() + 4 * answer_s
    # re-asks during the cut: none gets through; and the cut lasts until a heartbeat of
    # P's failed too (it waited P's TCP user timeout)
    while time.monotonic() < end or not p.totals("push_failed_send_notif"):
        assert time.monotonic() < end + 20, "P's heartbeat never failed"
        env.step_all()
        time.sleep(0.005)
    assert d.totals("push_failed_send_notif") >= 2
    assert d_id not in d.finished_recving, "D let the blocks go while P may write"
    env.fabric.restore_link(pa, da)
    env.fabric.progress(pa)  # the WRITE posted before the cut lands now, in held blocks
    env.run_until(lambda: d_id in d.finished_recving, what="P's answer over new endpoints")
    env.run_until(lambda: p_id in p.finished_sending)
    # The requests after the partition are served, the first one included.
    for i in (1, 2):
        prompt = _prompt(7 + i)
        d.add_request(f"cmpl-pt-{i}-bbbbbbbb", prompt, p.d_leg(), max_tokens=2)
        p.add_request(f"cmpl-pt-{i}-aaaaaaaa", prompt, p.p_leg())
        env.run_until(lambda i=i: f"cmpl-pt-{i}-bbbbbbbb" in d.finished)
        got = d.finished[f"cmpl-pt-{i}-bbbbbbbb"].status
        assert got == RequestStatus.FINISHED_LENGTH_CAPPED, f"request {i} after the cut: {got}"
    assert p.totals("push_peers_healed") == 1
    assert d.totals("push_watchdog_expired") == 0
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_an_idle_producer_answers_a_cancel_without_a_request_of_its_own(env: PushEnv) -> None:
    """D's PUSH_REG is lost; D's watchdog cancels (strict quarantine, D keeps the blocks
    until P answers). P runs nothing, so its engine does not step: its writer still
    reads the PUSH_CANCEL and answers. Before: NIXL held the cancel until P's next
    request woke the writer (the real-engine fault push-reg-dropped: 86 s, and D's
    blocks with it)."""
    p, d = env.pair(
        d_kw={"extra_config": {"push_registration_timeout_s": 1.0, "push_quarantine_s": -1}}
    )
    wait_until(lambda: d.workers[0].writer.alive and p.workers[0].writer.alive)
    env.fabric.hold_notifs(lambda n: n.msg.startswith(b"PUSH_REG:"))
    d_id = "cmpl-ip-0-bbbbbbbb"
    d.add_request(d_id, _prompt(12), p.d_leg(), max_tokens=2)
    wait_until(lambda: env.fabric.held_notifs(), step=d.engine_step, what="PUSH_REG sent")
    env.fabric.drop_held()
    env.fabric.hold_notifs(None)
    # Only D steps from here on: P is idle.
    wait_until(lambda: d_id in d.finished, step=d.engine_step, timeout=20, what="P answered")
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    assert d.totals("push_requests_quarantined") == 0, "the answer came within the deadline"
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_producer_that_stops_renewing_is_noticed_at_the_heartbeat_timeout(
    env: PushEnv,
) -> None:
    """P's request is queued (P renews D's registration with PUSH_HB), then the link
    between them is cut: the heartbeats stop. D stops waiting push_heartbeat_timeout_s
    after the last one, not at its watchdog (60 s here, 480 s by default), and keeps
    the blocks until P answers (strict quarantine); once the link is back P answers
    over a new connection and the request ends with an error. Before: D waited out its
    watchdog for a P that hung, was cut off or died."""
    p, d = env.pair(
        d_kw={
            "extra_config": {
                "push_registration_timeout_s": 60.0,
                "push_cancel_answer_timeout_s": 0.4,  # heartbeats every 0.1 s
                "push_heartbeat_timeout_s": 1.0,
                "push_quarantine_s": -1,
            }
        }
    )
    pa, da = p.agents[0].name, d.agents[0].name
    prompt = _prompt(13)
    d_id, p_id = "cmpl-sl-0-bbbbbbbb", "cmpl-sl-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg("sl"), max_tokens=2)
    env.run_until(lambda: pending_regs(p.workers[0]) == 1)
    p.add_request(p_id, prompt, p.p_leg("sl"))  # live: queued in P's scheduler

    def d_steps_while_p_holds_its_request() -> None:
        p.connector_step()  # P's engine loop, with nothing scheduled
        d.engine_step()

    wait_until(lambda: d.totals("push_heartbeats_received") >= 2,
               step=d_steps_while_p_holds_its_request, what="P renews")  # fmt: skip
    env.fabric.cut_link(pa, da)
    cut_at = time.monotonic()
    wait_until(lambda: d.totals("push_watchdog_expired") == 1,
               step=d_steps_while_p_holds_its_request, timeout=30, what="D notices")  # fmt: skip
    noticed_after = time.monotonic() - cut_at
    assert noticed_after < 20, f"D noticed the silent P only after {noticed_after:.1f}s"
    assert d_id not in d.finished, "D let the blocks go while P may still write"
    env.fabric.restore_link(pa, da)
    p.scheduler.finish_requests(p_id, RequestStatus.FINISHED_ABORTED)  # the proxy gave up
    env.run_until(lambda: d_id in d.finished, what="P's answer over a new connection")
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_registration_p_holds_across_a_partition_is_answered_never_written(
    env: PushEnv,
) -> None:
    """P holds D's registration while its own request prefills, and a partition cuts
    them off: P's heartbeats to D fail and P drops D's failed connection (a heal). D may
    count P gone by then (N-LIV-1) and give the blocks to another request, so P ends the
    registrations of D it held and answers them over a new connection: nothing is
    written once the link is back. Before, P kept the registration, reconnected when
    its request finished and wrote into D's blocks."""
    d_cfg = {"push_cancel_answer_timeout_s": 1.0}  # D asks for a heartbeat every 0.25 s
    p_kw = {"max_num_batched_tokens": 16, "extra_config": {"kv_lease_duration": 1}}
    p, d = env.pair(p_kw=p_kw, d_kw={"extra_config": d_cfg})
    pa, da = p.agents[0].name, d.agents[0].name
    prompt = _prompt(31, 160)  # ten prefill steps of 16 tokens
    d_id, p_id = "cmpl-hp-0-bbbbbbbb", "cmpl-hp-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg("T-hp"), max_tokens=2)
    wait_until(lambda: pending_regs(p.workers[0]) == 1, step=d.engine_step, what="PUSH_REG at P")
    p.add_request(p_id, prompt, p.p_leg("T-hp"))
    p.engine_step()  # P's request is live: P renews D's registration (PUSH_HB)
    wait_until(lambda: p.totals("push_heartbeats_sent") >= 1, what="a heartbeat")
    env.fabric.cut_link(pa, da)
    wait_until(lambda: p.totals("push_peers_healed") >= 1, what="P drops D's connection")
    env.fabric.restore_link(pa, da)
    env.run_until(lambda: p_id in p.finished and d_id in d.finished, what="both end")
    assert not [t for t in env.fabric.transfers() if t.op == "WRITE"], "P wrote after the heal"
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    assert p.totals("push_regs_ended_on_heal") == 1
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_renewed_registration_ends_with_the_p_request_that_awaited_it(env: PushEnv) -> None:
    """P renews D's registration (PUSH_HB) while its request is queued, then that P
    request ends without its KV (the proxy gave up on it). P drops the registration
    and answers D at once: a registration P renewed is kept only while a live P
    request awaits it, so D never has to count on P's TTL for it (N-LIV-1). Before,
    P kept it for its TTL and D waited for its watchdog to cancel."""
    d_cfg = {
        "push_registration_timeout_s": 60.0,
        "push_cancel_answer_timeout_s": 0.4,  # heartbeats every 0.1 s
        "push_heartbeat_timeout_s": 20.0,
    }
    p, d = env.pair(d_kw={"extra_config": d_cfg})
    prompt = _prompt(41)
    d_id, p_id = "cmpl-rw-0-bbbbbbbb", "cmpl-rw-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg("T-rw"), max_tokens=2)
    env.run_until(lambda: pending_regs(p.workers[0]) == 1, what="PUSH_REG at P")
    p.add_request(p_id, prompt, p.p_leg("T-rw"))

    def d_steps_while_p_holds_its_request() -> None:
        p.connector_step()  # P's engine loop, its request queued
        d.engine_step()

    wait_until(lambda: d.totals("push_heartbeats_received") >= 1,
               step=d_steps_while_p_holds_its_request, what="P renews")  # fmt: skip
    p.scheduler.finish_requests(p_id, RequestStatus.FINISHED_ABORTED)
    env.run_until(lambda: d_id in d.finished, timeout=10, what="P's answer")
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    assert p.totals("push_regs_expired") == 1
    assert d.totals("push_watchdog_expired") == 0, "D's watchdog, not P's answer, ended it"
    assert not [t for t in env.fabric.transfers() if t.op == "WRITE"]
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_d_keeps_the_blocks_while_p_may_hold_a_registration_it_never_renewed(
    env: PushEnv,
) -> None:
    """D registers while P has no request for it (P holds the PUSH_REG for its TTL,
    0.8 x D's registration timeout from its arrival, never renewed), and the link is cut
    (as UCX over TCP: nothing fails until a send waited T). D's client goes away: D's
    cancel cannot be sent, and 2 x T later D would count P gone (N-LIV-1). But P still
    holds the registration and serves it once the link is back and its P leg comes, so
    D keeps the blocks until P's TTL is over (T + 0.8 x the timeout after the PUSH_REG
    went out). Before, D let them go 2 x T after its failed send, and P's WRITE landed
    in blocks vLLM had given back."""
    tcp_s = 0.25
    d_cfg = {
        "push_registration_timeout_s": 4.0,  # P keeps the PUSH_REG 3.2 s
        "push_cancel_answer_timeout_s": 0.2,
        "push_quarantine_s": -1,
        "ucx_tcp_user_timeout_s": tcp_s,
    }
    # (P's timeout no longer than D's, or D refuses it; its WRITE below 2 x that)
    p_cfg = {"ucx_tcp_user_timeout_s": tcp_s, "push_write_timeout_s": 0.45}
    p, d = env.pair(p_kw={"extra_config": p_cfg}, d_kw={"extra_config": d_cfg})
    env.fabric.ucx_partitions()
    pa, da = p.agents[0].name, d.agents[0].name
    prompt = _prompt(43)
    d_id, p_id = "cmpl-ur-0-bbbbbbbb", "cmpl-ur-0-aaaaaaaa"
    free_before = d.free_blocks()
    d.add_request(d_id, prompt, p.d_leg("T-ur"), max_tokens=2)
    env.run_until(lambda: pending_regs(p.workers[0]) == 1, what="PUSH_REG at P")
    sent_at = time.monotonic()
    env.fabric.cut_link(pa, da)
    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)  # the client left
    # D's cancel fails T after it was sent, and 2 x T later D would count P gone; P's
    # TTL ends 3.2 s after the PUSH_REG arrived.
    wait_until(lambda: time.monotonic() - sent_at > 2.2, step=d.engine_step, timeout=5)
    assert (
        d.totals("push_peers_healed") >= 1
        or d.totals("push_failed_send_notif") >= 1
        or (d.totals("push_requests_quarantined") >= 1)
    ), "D's cancel did not fail: the cut did not hold"
    assert d.totals("push_producers_lost") == 0, "D counted P gone while P holds the PUSH_REG"
    assert d.free_blocks() < free_before, "D let the registered blocks go"
    env.fabric.restore_link(pa, da)
    p.add_request(p_id, prompt, p.p_leg("T-ur"))  # P's leg, late: P serves the PUSH_REG
    env.run_until(lambda: p_id in p.finished, what="P serves the registration")
    env.settle()
    env.assert_clean()
