# SPDX-License-Identifier: Apache-2.0
"""Non-blocking handshakes, the failure table and the timers (S-WRT-2, S-WRT-5, S-FAIL-1..4,
S-TMO-1), with real workers, real side channels and the fake NIXL fabric."""

from __future__ import annotations

import time
from unittest import mock

import pytest
from push_harness import (
    P_HOLDS_ITS_WRITE,
    Engine,
    HandshakeGate,
    PushEnv,
    assert_kv_pushed,
    assert_nixl_calls_on_writer,
    assert_self_polls,
    assert_writer_sleeps,
    block_pairs,
    capture_logs,
    held_finished,
    live_xfer_handles,
    notifs,
    pending_regs,
    wait_until,
)
from vllm.v1.request import RequestStatus

from vllm_ext import compat_nixl
from vllm_ext.nixl_push.wire import PUSH_FAIL_PREFIX, PUSH_REG_PREFIX, PushFailed, parse_notif

WRITER_LOG = "vllm.ext.nixl_push.writer"
WRITES_LOG = "vllm.ext.nixl_push.writes"


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 53 + i * 11) % 1000 + 3 for i in range(n)]


def _writer_responsive(env: PushEnv, engine, n: int = 3) -> None:  # type: ignore[no-untyped-def]
    """The engine's writer still reads notifications (it is not blocked on a handshake)."""
    w = engine.workers[0]
    before = w.push_counters.totals().get("push_notifs_malformed", 0)
    for _ in range(n):
        env.fabric.inject_notif(engine.agents[0].name, "someone", b"")
    wait_until(
        lambda: w.push_counters.totals().get("push_notifs_malformed", 0) == before + n,
        step=env.step_all,
        what="writer reads notifications while a handshake is pending",
    )


# -- S-WRT-5: handshakes are deferred, never awaited ---------------------------------------


@pytest.mark.timeout(60)
def test_d_to_p_handshake_deferral(env: PushEnv) -> None:
    """D's PUSH_REG waits for D->P's handshake; the callback replays it."""
    p, d = env.pair()
    gate = HandshakeGate(d.workers[0])
    prompt = _prompt(1)
    p.add_request("cmpl-h-0-aaaaaaaa", prompt, p.p_leg())
    d.add_request("cmpl-h-0-bbbbbbbb", prompt, p.d_leg())
    env.run_until(lambda: gate.started == 1, what="D starts the handshake")
    for _ in range(20):
        env.step_all()
    # Still waiting: nothing sent, nothing lost, the writer is not blocked.
    assert not notifs(env.fabric, PUSH_REG_PREFIX)
    assert d.workers[0].writer._reg_send_inbox.empty()
    assert d.totals("push_regs_sent") == 0
    _writer_responsive(env, d)
    assert d.scheduler.requests["cmpl-h-0-bbbbbbbb"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    gate.open()
    env.run_until(lambda: "cmpl-h-0-bbbbbbbb" in d.finished)
    env.settle()
    assert gate.started == 1 and len(notifs(env.fabric, PUSH_REG_PREFIX)) == 1
    fin, reg = p.finished_meta("cmpl-h-0-aaaaaaaa"), d.reg_meta("cmpl-h-0-bbbbbbbb")
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.assert_clean()
    assert_nixl_calls_on_writer(env.fabric)  # the replayed PUSH_REG too (S-WRT-1, S-WRT-5)


@pytest.mark.timeout(60)
def test_p_to_d_handshake_deferral(env: PushEnv) -> None:
    """P's matched WRITE waits for P->D's handshake; the callback replays it."""
    p, d = env.pair(p_kw={"extra_config": P_HOLDS_ITS_WRITE})
    gate = HandshakeGate(p.workers[0])
    prompt = _prompt(2)
    d.add_request("cmpl-h-0-bbbbbbbb", prompt, p.d_leg())
    p.add_request("cmpl-h-0-aaaaaaaa", prompt, p.p_leg())
    env.run_until(lambda: gate.started == 1, what="P starts the handshake")
    for _ in range(20):
        env.step_all()
    assert p.totals("push_match_base_id") == 1  # matched ...
    assert not env.fabric.transfers() and p.totals("push_writes") == 0  # ... but not written
    assert held_finished(p.workers[0]) == 1 and pending_regs(p.workers[0]) == 0
    _writer_responsive(env, p)
    gate.open()
    env.run_until(lambda: "cmpl-h-0-bbbbbbbb" in d.finished)
    env.settle()
    assert gate.started == 1 and p.totals("push_writes") == 1
    fin, reg = p.finished_meta("cmpl-h-0-aaaaaaaa"), d.reg_meta("cmpl-h-0-bbbbbbbb")
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.assert_clean()
    assert_nixl_calls_on_writer(env.fabric)  # the replayed WRITE too (S-WRT-1, S-WRT-5)


# -- S-FAIL-1: D cannot reach P ----------------------------------------------------------


@pytest.mark.timeout(60)
def test_d_handshake_failure_fails_the_request(env: PushEnv) -> None:
    """The request is reported as a failed recv with its blocks invalid; no retry."""
    p = env.engine("P", "kv_producer", listener="garbage")
    d = env.engine("D", "kv_consumer")
    d_id = "cmpl-hf-0-bbbbbbbb"
    d.add_request(d_id, _prompt(3), p.d_leg(), max_tokens=2)
    env.run_until(lambda: d_id in d.finished, what="D request failed")
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    reg = d.reg_meta(d_id)
    assert d.invalid_block_ids == set(reg.block_ids[0])
    assert d_id in d.finished_recving  # reported as a (failed) recv
    assert d.totals("push_failed_handshake") == 1
    assert not notifs(env.fabric, PUSH_REG_PREFIX)
    for _ in range(50):
        env.step_all()
    assert p._garbage is not None and p._garbage.queries == 1  # no retry loop
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_d_send_notif_failure_fails_the_request(env: PushEnv) -> None:
    """P's agent is gone after the handshake: D's PUSH_REG send fails, D connects anew
    once and sends again (to the same dead agent, which P's side channel still names):
    it fails again -> failed recv."""
    p, d = env.pair()
    prompt = _prompt(4, 20)
    d.add_request("cmpl-sn-0-bbbbbbbb", prompt, p.d_leg())
    p.add_request("cmpl-sn-0-aaaaaaaa", prompt, p.p_leg())
    env.run_until(lambda: "cmpl-sn-0-bbbbbbbb" in d.finished)
    p.agents[0].close()  # P's NIXL agent leaves the fabric
    d.add_request("cmpl-sn-1-bbbbbbbb", _prompt(5, 20), p.d_leg(), max_tokens=2)
    wait_until(lambda: "cmpl-sn-1-bbbbbbbb" in d.finished, step=d.engine_step)
    assert d.finished["cmpl-sn-1-bbbbbbbb"].status == RequestStatus.FINISHED_ERROR
    assert d.totals("push_failed_send_notif") == 2 and d.totals("push_regs_resent") == 1
    assert set(d.reg_meta("cmpl-sn-1-bbbbbbbb").block_ids[0]) <= d.invalid_block_ids
    wait_until(d.idle, step=d.engine_step)


@pytest.mark.timeout(60)
def test_d_partial_push_reg_send_cancels_before_freeing(env: PushEnv) -> None:
    """P tp 2 -> D tp 1: D's PUSH_REG reaches P rank 0 but not P rank 1. Rank 0 may
    write, so D cancels with it (the only rank the PUSH_REG reached) and fails the
    request once it answered, without waiting for the rank that never heard of it."""
    p, d = env.pair(p_kw={"tp": 2}, d_kw={"extra_config": {"push_cancel_answer_timeout_s": 30}})
    prompt = _prompt(4, 20)
    d.add_request("cmpl-ps-0-bbbbbbbb", prompt, p.d_leg(tp_size=2))
    p.add_request("cmpl-ps-0-aaaaaaaa", prompt, p.p_leg())
    env.run_until(lambda: "cmpl-ps-0-bbbbbbbb" in d.finished)  # both ranks connected
    p.agents[1].close()  # P rank 1's NIXL agent leaves the fabric
    d.add_request("cmpl-ps-1-bbbbbbbb", _prompt(5, 20), p.d_leg(tp_size=2), max_tokens=2)
    t0 = time.monotonic()
    env.run_until(lambda: "cmpl-ps-1-bbbbbbbb" in d.finished, timeout=20)
    assert time.monotonic() - t0 < 20  # not at the 30 s cancel-answer deadline
    assert d.finished["cmpl-ps-1-bbbbbbbb"].status == RequestStatus.FINISHED_ERROR
    # the PUSH_REG to the gone rank failed; the request ended through the cancel
    # (rank 0 answered), not by an early free
    assert d.totals("push_failed_send_notif") == 1
    assert d.totals("push_cancels_sent") == 1
    assert p.totals("push_cancels_received") == 1  # rank 0 heard it
    (answer,) = [n for n in notifs(env.fabric, PUSH_FAIL_PREFIX) if n.receiver == d.agents[0].name]
    assert answer.sender == p.agents[0].name


# -- S-FAIL-2: P cannot reach D ----------------------------------------------------------


def p_cannot_reach_d(env: PushEnv) -> tuple[Engine, Engine]:
    """P, and a D whose side channel answers garbage: P's handshake with D fails."""
    p = env.engine("P", "kv_producer")
    d = env.engine(
        "D",
        "kv_consumer",
        listener="garbage",
        # P cannot reach D, so it never answers D's cancel: D's blocks stay quarantined
        # until push_quarantine_s (S-SAFE-1)
        extra_config={
            "push_registration_timeout_s": 0.5,
            "push_cancel_answer_timeout_s": 0.3,
            "push_quarantine_s": 0.5,
        },
    )
    return p, d


@pytest.mark.timeout(60)
def test_p_handshake_failure_drops_without_retry(env: PushEnv) -> None:
    p, d = p_cannot_reach_d(env)
    prompt = _prompt(6)
    with capture_logs(WRITER_LOG, WRITES_LOG) as logs:
        d.add_request("cmpl-pf-0-bbbbbbbb", prompt, p.d_leg())
        p.add_request("cmpl-pf-0-aaaaaaaa", prompt, p.p_leg())
        env.run_until(lambda: p.totals("push_failed_handshake") == 1, what="P's handshake fails")
        for _ in range(50):
            env.step_all()
    assert any(r.getMessage().startswith("push_handshake_failed") for r in logs)
    # Dropped, not retried: P may try once when the PUSH_REG arrives and once for the
    # WRITE, never again however long the engines keep stepping.
    assert d._garbage is not None
    attempts = d._garbage.queries
    assert 1 <= attempts <= 2
    for _ in range(50):
        env.step_all()
    assert d._garbage.queries == attempts
    assert not env.fabric.transfers() and p.totals("push_writes") == 0
    assert not notifs(env.fabric, PUSH_FAIL_PREFIX)  # P has no agent for D to tell
    # Never _handle_failed_transfer on P.
    assert not p.invalid_block_ids and p.workers[0]._failed_recv_reqs.empty()
    # P's blocks come back; D's registration goes through its watchdog: the request
    # fails at the answer deadline, its blocks come back at push_quarantine_s.
    env.run_until(lambda: "cmpl-pf-0-bbbbbbbb" in d.finished, what="D's watchdog")
    assert d.finished["cmpl-pf-0-bbbbbbbb"].status == RequestStatus.FINISHED_ERROR
    env.run_until(lambda: "cmpl-pf-0-bbbbbbbb" in d.finished_recving, what="quarantine_s")
    assert d.totals("push_quarantine_expired") == 1
    env.settle()
    assert "cmpl-pf-0-aaaaaaaa" in p.finished_sending
    env.assert_clean()


# -- S-FAIL-3 / S-FAIL-4: the WRITE fails --------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "kind,counter",
    [
        ("post", "push_failed_write_submit"),
        ("post_raise", "push_failed_write_submit"),
        ("state", "push_failed_write_state"),
        ("state_raise", "push_failed_write_state"),
    ],
)
def test_write_failure(env: PushEnv, kind: str, counter: str) -> None:
    p, d = env.pair()  # D keeps vLLM's 480 s watchdog: it must not need it
    env.fabric.fail_next_transfer(kind, initiator=p.agents[0].name)  # type: ignore[arg-type]
    handle_failed = mock.patch.object(
        p.workers[0], "_handle_failed_transfer", wraps=p.workers[0]._handle_failed_transfer
    )
    prompt = _prompt(7)
    with handle_failed as spy:
        d.add_request("cmpl-wf-0-bbbbbbbb", prompt, p.d_leg(), max_tokens=2)
        p.add_request("cmpl-wf-0-aaaaaaaa", prompt, p.p_leg())
        env.run_until(lambda: "cmpl-wf-0-bbbbbbbb" in d.finished, what="D fails fast")
        env.settle()
    # P: handle released, failure counted, no _handle_failed_transfer.
    assert p.totals(counter) == 1 and p.totals("push_writes") == (kind.startswith("state"))
    assert spy.call_count == 0 and not p.invalid_block_ids
    stats = [s.data for r in p.ranks for s in r.stats]
    assert sum(len(s.get("num_failed_transfers", [])) for s in stats) == 1
    (record,) = env.fabric.transfers()
    assert record.state == "ERR" and not live_xfer_handles(env.fabric)
    # D: told through PUSH_FAIL, failed at once (not through the watchdog): a notice at
    # once, the answer once the rest of the WRITE can no longer land (N-REL-2).
    notice, told = notifs(env.fabric, PUSH_FAIL_PREFIX)
    assert [parse_notif(n.msg).landing for n in (notice, told)] == [True, False]  # type: ignore[union-attr]
    assert (told.sender, told.receiver) == (p.agents[0].name, d.agents[0].name)
    assert d.totals("push_failed_remote") == 1
    assert d.finished["cmpl-wf-0-bbbbbbbb"].status == RequestStatus.FINISHED_ERROR
    assert set(d.reg_meta("cmpl-wf-0-bbbbbbbb").block_ids[0]) <= d.invalid_block_ids
    assert "cmpl-wf-0-aaaaaaaa" in p.finished_sending  # P's blocks returned
    env.assert_clean()
    assert_nixl_calls_on_writer(env.fabric)  # failure paths too (S-WRT-1)


@pytest.mark.timeout(60)
def test_push_fail_from_one_producer_rank_waits_for_the_others(env: PushEnv) -> None:
    """P tp 2 -> D tp 1: both P ranks write into each D block. P rank 0's WRITE fails
    while rank 1's is still pending: D may fail the request, but must not hand its
    blocks back before rank 1 is done with them."""
    p, d = env.pair(p_kw={"tp": 2})
    gate = HandshakeGate(p.workers[1])  # rank 1's WRITE waits for its handshake
    env.fabric.fail_next_transfer("post", initiator=p.agents[0].name)
    prompt = _prompt(12)
    d_id = "cmpl-pf2-0-bbbbbbbb"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    p.add_request("cmpl-pf2-0-aaaaaaaa", prompt, p.p_leg())
    env.run_until(lambda: d.totals("push_failed_remote") == 1 and gate.started >= 1)
    for _ in range(20):
        env.step_all()
        time.sleep(0.001)
    freed_early = d_id not in d.scheduler.requests  # D's blocks back in its pool
    gate.open()
    env.run_until(lambda: d_id in d.finished and d_id not in d.scheduler.requests)
    env.settle()
    written = [t for t in env.fabric.transfers() if t.state == "DONE"]
    assert not (freed_early and written), "P rank 1 wrote into blocks D had already freed"
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    env.assert_clean()


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    compat_nixl.SPLIT_NIXL,
    reason="patch 0004 is applied to the primary pin only (vLLM 0.32's env stays as released;"
    " a mixed pair is refused at the handshake, see test_push_compat)",
)
def test_push_fail_is_dropped_by_vllms_own_notification_parser(env: PushEnv) -> None:
    """S-FAIL-4: PUSH_FAIL is a distinct notification that a D without push support drops.

    vLLM 0.23.0's own NIXL worker (with patch 0004) parses it as a malformed
    notification: counted and dropped, no exception.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

    p, d = env.pair()
    w = d.workers[0]
    # D's writer sleeps until D steps, so the notification waits in D's agent.
    env.fabric.inject_notif(
        d.agents[0].name, p.agents[0].name, PushFailed("cmpl-x-0-bbbbbbbb", "boom").encode()
    )
    assert NixlConnectorWorker._get_new_notifs(w) == set()
    assert sum(w.num_dropped_notifs.values()) == 1


# -- S-TMO-1 / S-SCH-1: the registration watchdog ----------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("knob", ["push_registration_timeout_s", "decoder_kv_blocks_ttl"])
def test_watchdog_expiry_drops_the_registration(env: PushEnv, knob: str) -> None:
    """The watchdog is push_registration_timeout_s, by default vLLM's decoder_kv_blocks_ttl.

    It is 2 s, not less: D's PUSH_REG goes out after D's handshake with P, and reaches P
    only if that takes less than the watchdog, which a loaded machine's steps may not."""
    p, d = env.pair(
        p_kw={"extra_config": {knob: 2.0}},
        d_kw={"extra_config": {knob: 2.0}},
    )
    d_id = "cmpl-wd-0-bbbbbbbb"
    with capture_logs("vllm.ext.nixl_push.scheduler", WRITER_LOG) as logs:
        d.add_request(d_id, _prompt(8), p.d_leg(), max_tokens=2)
        d.engine_step()
        assert d.sched.recv_ticket(d_id) is not None  # the watchdog is armed at allocation
        assert d.sched.has_pending_push_work()
        # (P holds it 1.6 s only: a loaded machine's steps may outlast that, so the test
        # counts its arrival rather than looking for it in P's table)
        env.run_until(lambda: p.totals("push_regs_received") == 1, what="PUSH_REG at P")
        env.run_until(lambda: d_id in d.finished, what="watchdog fires")
        # P keeps it for 0.8 x D's watchdog, then drops it and tells D (PUSH_FAIL); on a
        # loaded host D's own watchdog may fire first, and D's PUSH_CANCEL drops it, or
        # fire before P's PUSH_FAIL came, and P answers that cancel too.
        env.run_until(
            lambda: p.totals("push_regs_expired") + p.totals("push_cancels_received") >= 1,
            what="P drops it too",
        )
        assert p.totals("push_regs_expired") <= 1 and p.totals("push_cancels_received") <= 1
    assert d.sched.recv_ticket(d_id) is None
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    by_watchdog = any("expired" in r.getMessage() and r.name.endswith("scheduler") for r in logs)
    assert by_watchdog or d.totals("push_failed_remote") == 1
    if p.totals("push_cancels_received"):
        assert by_watchdog  # D cancels only after its watchdog fired
    assert pending_regs(p.workers[0]) == 0
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_watchdog_expiry_while_the_write_is_pending(env: PushEnv) -> None:
    """D's watchdog fires while P's matched WRITE waits for its handshake: D must keep
    the blocks (PUSH_CANCEL, then wait for P's answer) so the WRITE never lands in
    freed blocks; P's late WRITE answers the cancel and the request is served."""
    p, d = env.pair(
        p_kw={"extra_config": P_HOLDS_ITS_WRITE},
        d_kw={"extra_config": {"push_registration_timeout_s": 0.5}},
    )
    gate = HandshakeGate(p.workers[0])  # P's WRITE waits for P->D's handshake
    prompt = _prompt(13)
    d_id = "cmpl-wp-0-bbbbbbbb"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    p.add_request("cmpl-wp-0-aaaaaaaa", prompt, p.p_leg())
    env.run_until(lambda: p.totals("push_match_base_id") == 1)
    env.run_until(lambda: d.totals("push_watchdog_expired") == 1, what="D's watchdog fires")
    env.run_until(lambda: p.totals("push_cancels_received") == 1, what="P hears the cancel")
    for _ in range(5):
        env.step_all()
    assert d_id in d.scheduler.requests and d_id not in d.finished, "D freed its blocks early"
    gate.open()
    env.run_until(lambda: d_id in d.finished, what="D ends the request")
    env.settle()
    written = [t for t in env.fabric.transfers() if t.state == "DONE"]
    assert len(written) == 1
    # every rank wrote after all: the KV is valid and the request is served
    assert d.finished[d_id].status != RequestStatus.FINISHED_ERROR
    env.assert_clean()


# -- S-TMO-1: the lease ----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_lease_expiry_evicts_and_stops_the_self_poll(env: PushEnv) -> None:
    p, _ = env.pair(p_kw={"extra_config": {"kv_lease_duration": 0.6}})
    p_id = "cmpl-le-0-aaaaaaaa"
    p.add_request(p_id, _prompt(9), p.p_leg())
    env.run_until(lambda: held_finished(p.workers[0]) == 1)
    # Unmatched finished blocks: the writer polls by itself (1 ms), no engine step needed.
    assert_self_polls(p, n=10)
    env.run_until(lambda: p_id in p.finished_sending, what="the lease expires")
    wait_until(lambda: held_finished(p.workers[0]) == 0, what="the writer evicts")
    # Now it blocks: no notification reads without a step.
    assert_writer_sleeps(p)
    assert p.free_blocks() == p.initial_free_blocks
    stats = [s.data for r in p.ranks for s in r.stats]
    assert sum(len(s.get("num_kv_expired_reqs", [])) for s in stats) == 1
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_lease_is_kept_while_the_write_waits_for_its_handshake(env: PushEnv) -> None:
    """P's lease would end while the matched WRITE waits for P->D's handshake; the
    blocks are kept (a WRITE may still read them) until the WRITE is done."""
    p, d = env.pair(
        p_kw={"extra_config": {"kv_lease_duration": 0.3, **P_HOLDS_ITS_WRITE}},
        d_kw={"extra_config": {"push_registration_timeout_s": 30}},
    )
    gate = HandshakeGate(p.workers[0])
    prompt = _prompt(10)
    d.add_request("cmpl-lh-0-bbbbbbbb", prompt, p.d_leg())
    p.add_request("cmpl-lh-0-aaaaaaaa", prompt, p.p_leg())
    env.run_until(lambda: gate.started == 1)
    deadline = time.monotonic() + 1.0  # > 3 leases
    while time.monotonic() < deadline:
        env.step_all()
    assert "cmpl-lh-0-aaaaaaaa" not in p.finished_sending, "lease reaped under a pending WRITE"
    gate.open()
    env.run_until(lambda: "cmpl-lh-0-aaaaaaaa" in p.finished_sending, what="P done")
    env.run_until(lambda: "cmpl-lh-0-bbbbbbbb" in d.finished, what="D served")
    env.settle()
    assert [t.state for t in env.fabric.transfers()] == ["DONE"]
    assert p.totals("push_failed_lease_expired") == 0
    assert d.finished["cmpl-lh-0-bbbbbbbb"].status != RequestStatus.FINISHED_ERROR
    env.assert_clean()


# -- S-FLT-1: a restarted peer keeps its engine id and gets a new NIXL agent ---------------


def _restart(env: PushEnv, old, role: str, **kw):  # type: ignore[no-untyped-def]
    """Kill ``old`` (its agent leaves the fabric unannounced) and start an engine with
    the same id."""
    for a in old.agents:
        a.close()
    old.shutdown()
    env.engines.remove(old)
    return env.engine(old.engine_id, role, **kw)


@pytest.mark.timeout(90)
def test_restarted_p_is_connected_anew(env: PushEnv) -> None:
    """D keeps P's old agent until a send to it fails; then it forgets P, handshakes with
    the restarted P once and sends the PUSH_REG again: the first request after P's
    restart is served (before, it failed)."""
    p, d = env.pair()
    d.add_request("cmpl-rp-0-bbbbbbbb", _prompt(20), p.d_leg())
    p.add_request("cmpl-rp-0-aaaaaaaa", _prompt(20), p.p_leg())
    env.run_until(lambda: "cmpl-rp-0-bbbbbbbb" in d.finished)
    old_agent = d.workers[0].remote_agents_of("P")[0]
    p = _restart(env, p, "kv_producer")
    for n in (1, 2):
        d_id, p_id = f"cmpl-rp-{n}-bbbbbbbb", f"cmpl-rp-{n}-aaaaaaaa"
        d.add_request(d_id, _prompt(20 + n), p.d_leg(), max_tokens=2)
        p.add_request(p_id, _prompt(20 + n), p.p_leg())
        env.run_until(lambda: d_id in d.finished)  # noqa: B023
        assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
        fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
        assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    assert d.totals("push_peers_forgotten") == 1 and d.totals("push_regs_resent") == 1
    assert d.workers[0].remote_agents_of("P")[0] not in (None, old_agent)
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("legs", ["transfer_id", "no_ids"])
def test_restarted_d_is_connected_anew(env: PushEnv, legs: str) -> None:
    """P learns of D's restart from a PUSH_REG sent by a new agent under D's engine id.
    One that proves it belongs to its request (the transfer id both legs carried) makes
    P forget the old agent and WRITE to the new one, on the first request. Without ids
    any peer could send it, so it connects nothing: that request fails at D's watchdog
    (the WRITE is refused), and P connects D anew once nothing is in flight to it."""
    ids = legs == "transfer_id"
    d_cfg = {"push_registration_timeout_s": 1.0}
    p, d = env.pair(d_kw={"extra_config": d_cfg})
    tid = "T-rd0" if ids else None
    d.add_request("cmpl-rd-0-bbbbbbbb", _prompt(30), p.d_leg(tid))
    p.add_request("cmpl-rd-0-aaaaaaaa", _prompt(30), p.p_leg(tid))
    env.run_until(lambda: "cmpl-rd-0-bbbbbbbb" in d.finished)
    old_agent = p.workers[0].remote_agents_of("D")[0]
    d = _restart(env, d, "kv_consumer", extra_config=d_cfg)
    first, last = (1, 1) if ids else (1, 2)
    for i in range(first, last + 1):
        tid = f"T-rd{i}" if ids else None
        d.add_request(f"cmpl-rd-{i}-bbbbbbbb", _prompt(30 + i), p.d_leg(tid))
        p.add_request(f"cmpl-rd-{i}-aaaaaaaa", _prompt(30 + i), p.p_leg(tid))
        env.run_until(lambda i=i: f"cmpl-rd-{i}-bbbbbbbb" in d.finished)
    if not ids:
        assert d.finished["cmpl-rd-1-bbbbbbbb"].status == RequestStatus.FINISHED_ERROR
        assert p.totals("push_notifs_foreign") >= 1
    assert d.finished[f"cmpl-rd-{last}-bbbbbbbb"].status != RequestStatus.FINISHED_ERROR
    assert p.workers[0].remote_agents_of("D")[0] != old_agent
    env.settle()
    fin = p.finished_meta(f"cmpl-rd-{last}-aaaaaaaa")
    reg = d.reg_meta(f"cmpl-rd-{last}-bbbbbbbb")
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.assert_clean()


@pytest.mark.timeout(120)
def test_pull_style_d_leg_fails_alone(env: PushEnv) -> None:
    """S-LEG-2: a pull-mode D leg (``remote_block_ids``, as vllm-router sends after P's
    answer) fails that request with a clear error; D keeps serving push requests (before,
    vLLM's READ path raised KeyError on a push worker's tables and killed the engine)."""
    p, d = env.pair()
    pull_leg = p.d_leg(remote_block_ids=[[1, 2]], remote_request_id="cmpl-pl-0-aaaaaaaa")
    with capture_logs("vllm.ext.nixl_push.scheduler") as logs:
        d.add_request("cmpl-pl-0-bbbbbbbb", _prompt(40), pull_leg, max_tokens=2)
        env.run_until(lambda: "cmpl-pl-0-bbbbbbbb" in d.finished)
    assert d.finished["cmpl-pl-0-bbbbbbbb"].status == RequestStatus.FINISHED_ERROR
    assert any("pull-mode D leg" in r.getMessage() for r in logs)
    d.add_request("cmpl-pl-1-bbbbbbbb", _prompt(41), p.d_leg())
    p.add_request("cmpl-pl-1-aaaaaaaa", _prompt(41), p.p_leg())
    env.run_until(lambda: "cmpl-pl-1-bbbbbbbb" in d.finished)
    assert d.finished["cmpl-pl-1-bbbbbbbb"].status != RequestStatus.FINISHED_ERROR
    env.settle()
    env.assert_clean()
