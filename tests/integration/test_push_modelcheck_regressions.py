# SPDX-License-Identifier: Apache-2.0
"""The model check's counterexamples (test_push_modelcheck.py), replayed step by step.

Each is a plain, deterministic test of the safety invariant of push_modelcheck.py: a
byte written into a D block belongs to the request that block was registered for,
and only while it is registered, and D serves only its request's KV. Real vLLM
Schedulers and connector workers over the fake NIXL fabric (push_harness.py), which
is as pessimistic as UCX (a WRITE released in flight may still land: fake_nixl/faults.py).

The tests marked ``xfail(strict=True)`` are gaps of the connector that the model check
found; the default model check leaves out exactly their fault kinds (its class flags
name these tests), the long one keeps them.
"""

from __future__ import annotations

import time

import pytest
from push_harness import (
    Engine,
    HandshakeGate,
    PushEnv,
    completion_or_none,
    notifs,
    pending_regs,
    wait_until,
)
from push_modelcheck import FREED, OTHER_REQUEST, POOL_FREE, KvOwnership
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.wire import PUSH_FAIL_PREFIX, PUSH_REG_PREFIX, PushFailed


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 41 + i * 7) % 1000 + 3 for i in range(n)]


def _pair(
    env: PushEnv,
    p_extra: dict[str, float] | None = None,
    *,
    p_blocks: int = 48,
    d_blocks: int = 48,
    **d_extra: float,
) -> tuple[Engine, Engine, KvOwnership]:
    """P and D; ``p_blocks`` / ``d_blocks`` of 4 leave room for one 40-token request
    (3 blocks), so the next request gets the blocks the last one freed."""
    p, d = env.pair(
        p_kw={
            "enable_prefix_caching": False,
            "num_blocks": p_blocks,
            "extra_config": {"kv_lease_duration": 2.0, **(p_extra or {})},
        },
        d_kw={
            "enable_prefix_caching": False,
            "num_blocks": d_blocks,
            "extra_config": {"push_cancel_answer_timeout_s": 0.2, **d_extra},
        },
    )
    return p, d, KvOwnership(p, d)


def _legs(
    oracle: KvOwnership, x: str, prompt: list[int], tid: str | None = None
) -> tuple[str, str]:
    """Both legs of one single-prompt body ``x``, paired for the oracle: (D id, P id)."""
    p, d = oracle.p, oracle.d
    d_id, p_id = f"cmpl-{x}-0-d0000000", f"cmpl-{x}-0-a0000000"
    oracle.pair(p_id, d_id)
    d.add_request(d_id, prompt, p.d_leg(tid), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg(tid))
    return d_id, p_id


def _landed_in_foreign_blocks(oracle: KvOwnership) -> list[tuple[str, str]]:
    return [v for v in oracle.violations if v[0] in (FREED, OTHER_REQUEST, POOL_FREE)]


def _run(env: PushEnv, oracle: KvOwnership, cond, what: str = "") -> None:  # type: ignore[no-untyped-def]
    p, d = oracle.p, oracle.d

    def step() -> None:
        p.engine_step(forward=oracle.fill)
        d.engine_step()

    wait_until(cond, timeout=20, step=step, what=what)


def _assert_safe(oracle: KvOwnership) -> None:
    assert oracle.landings > 0, "no WRITE landed: the scenario did not run"
    assert not oracle.violations, "push wrote into D blocks it must not:\n" + oracle.report()


@pytest.mark.timeout(60)
def test_multi_prompt_sub_requests_get_their_own_kv(
    env: PushEnv,
) -> None:
    """One client body with prompts [a, b]: vLLM splits it into sub-requests
    ``cmpl-X-0-<8hex>`` and ``cmpl-X-1-<8hex>`` on each side (other random suffixes on
    P and D), all with the body's one transfer_id. P's sub-request 1 finishes first:
    its KV (prompt b) must go to D's sub-request 1, not to D's sub-request 0."""
    p, d, oracle = _pair(env)
    a, b = _prompt(1), _prompt(2)
    oracle.pair("cmpl-mp-0-a0000000", "cmpl-mp-0-d0000000")
    oracle.pair("cmpl-mp-1-a0000001", "cmpl-mp-1-d0000001")
    d.add_request("cmpl-mp-0-d0000000", a, p.d_leg("tid-mp"), max_tokens=2)
    d.add_request("cmpl-mp-1-d0000001", b, p.d_leg("tid-mp"), max_tokens=2)
    _run(env, oracle, lambda: pending_regs(p.workers[0]) == 2, "both registered")
    p.add_request("cmpl-mp-1-a0000001", b, p.p_leg("tid-mp"))
    _run(env, oracle, lambda: oracle.landings >= 1, "P sub-request 1 written")
    p.add_request("cmpl-mp-0-a0000000", a, p.p_leg("tid-mp"))
    _run(env, oracle, lambda: len(d.finished) == 2, "both D sub-requests done")
    _assert_safe(oracle)


@pytest.mark.timeout(60)
def test_a_late_handshake_does_not_replay_a_registration_d_let_go(
    env: PushEnv,
) -> None:
    """D's handshake with P is slow; D's watchdog expires meanwhile (the PUSH_REG never
    went out). Before, the cancel deadline ended the request and D let its blocks go,
    and the handshake, completing at last, sent the PUSH_REG for them. Now the request
    ends when the handshake does, and nothing is sent."""
    p, d, oracle = _pair(env, push_registration_timeout_s=0.3)  # D's watchdog
    gate = HandshakeGate(d.workers[0])
    prompt, d_id, p_id = _prompt(3), "cmpl-lh-0-d0000000", "cmpl-lh-0-a0000000"
    oracle.pair(p_id, d_id)
    d.add_request(d_id, prompt, p.d_leg("tid-lh"), max_tokens=2)
    _run(env, oracle, lambda: gate.started == 1, "D's handshake with P started")
    _run(env, oracle, lambda: d.totals("push_watchdog_expired") == 1, "D's watchdog")
    p.add_request(p_id, prompt, p.p_leg("tid-lh"))
    _run(env, oracle, lambda: p_id in p.finished, "P prefilled, waits for the PUSH_REG")
    assert d_id not in d.recv_reports  # held while the PUSH_REG may still go out
    gate.open()
    _run(env, oracle, lambda: d_id in d.recv_reports, "ended once the handshake did")
    _run(env, oracle, lambda: p_id in p.finished_sending, "P settles its request")
    assert d.totals("push_regs_not_replayed") == 1
    assert not oracle.violations, "push wrote into D blocks it must not:\n" + oracle.report()


@pytest.mark.timeout(60)
def test_an_abort_before_the_handshake_with_p_does_not_crash_d(
    env: PushEnv,
) -> None:
    """Found by the model check on the way: the client aborts a D request whose
    handshake with P has not completed; the cancel deadline ends it, and D's
    get_finished must report it without knowing P's layout (vLLM's post-processing
    looked P up and raised KeyError, failing D's engine step)."""
    p, d, oracle = _pair(env)
    gate = HandshakeGate(d.workers[0])
    d_id = "cmpl-ab-0-d0000000"
    d.add_request(d_id, _prompt(5), p.d_leg("tid-ab"), max_tokens=2)
    _run(env, oracle, lambda: gate.started == 1, "D's handshake with P started")
    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    gate.open()
    _run(env, oracle, lambda: d_id in d.recv_reports, "ends once the handshake did")
    env.settle()
    assert d.finished[d_id].status == RequestStatus.FINISHED_ABORTED


@pytest.mark.timeout(60)
def test_a_replayed_registration_after_a_cancel_is_not_written(
    env: PushEnv,
) -> None:
    """D registers, then cancels (client abort); P drops the registration and answers,
    and D frees the blocks. The network then delivers D's PUSH_REG again (a duplicate):
    P must not write into the blocks D let go of when its request finishes."""
    p, d, oracle = _pair(env)
    prompt, d_id, p_id = _prompt(4), "cmpl-rr-0-d0000000", "cmpl-rr-0-a0000000"
    oracle.pair(p_id, d_id)
    d.add_request(d_id, prompt, p.d_leg("tid-rr"), max_tokens=2)
    _run(env, oracle, lambda: pending_regs(p.workers[0]) == 1, "registered with P")
    wait_until(lambda: p.workers[0].remote_agents_of("D"), what="P connected to D")
    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    _run(env, oracle, lambda: d_id in d.recv_reports, "P answered the cancel; D let go")
    assert p.totals("push_cancels_received") == 1
    (reg,) = notifs(env.fabric, PUSH_REG_PREFIX)
    env.fabric.inject_notif(p.agents[0].name, reg.sender, reg.msg)
    p.add_request(p_id, prompt, p.p_leg("tid-rr"))
    _run(env, oracle, lambda: p_id in p.finished_sending, "P settles its request")
    assert not oracle.violations, "push wrote into D blocks it must not:\n" + oracle.report()


def _steps(oracle: KvOwnership, seconds: float) -> None:
    """Both engines step for ``seconds`` (deadlines pass)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        oracle.p.engine_step(forward=oracle.fill)
        oracle.d.engine_step()
        time.sleep(0.005)


def _delivered(env: PushEnv, receiver: str, prefix: bytes | None, d_id: str) -> list[int]:
    """Positions, in the fabric's delivery order, of the notifications to ``receiver``
    that start with ``prefix`` (None: completions) and name ``d_id``."""
    return [
        i
        for i, n in enumerate(env.fabric.notifications())
        if n.receiver == receiver
        and (completion_or_none(n.msg) if prefix is None else n.msg.startswith(prefix))
        and d_id.encode() in n.msg
    ]


@pytest.mark.timeout(60)
def test_a_write_held_past_every_bound_does_not_land_in_blocks_d_let_go(env: PushEnv) -> None:
    """P's WRITE hangs and NIXL cannot cancel it; P gives it up at push_write_timeout_s,
    its old release bound passes, D's watchdog cancels. A local request on P (P has room
    for one request) waits for blocks. Only then does NIXL complete the WRITE. Whatever
    the connector does meanwhile: P's blocks are not freed (so not reused) while NIXL
    may read them, D's are not freed while it may write them, the bytes land only in
    D's blocks of the request, and D serves the request only if they are its KV.
    (With the abandon bound, P freed its blocks at the bound, the local request's KV
    was in them when the WRITE completed, and D served that: S-SAFE-1, N-REL-1.)"""
    p, d, oracle = _pair(
        env, p_extra={"push_write_timeout_s": 0.3}, p_blocks=4, push_registration_timeout_s=1.0,
        push_quarantine_s=-1,
    )  # fmt: skip
    pa, da = p.agents[0].name, d.agents[0].name
    env.fabric.fail_next_transfer("hang_uncancellable", initiator=pa)
    d_id, p_id = _legs(oracle, "hw", _prompt(6), "tid-hw")
    _run(env, oracle, lambda: p.totals("push_failed_write_timeout") == 1, "P gave up")
    _steps(oracle, 1.5)  # past P's release bound (0.6 s) and D's watchdog (1.0 s)
    p.add_request("local-hw", _prompt(7), None)  # no push: P's next blocks are these
    _steps(oracle, 0.5)
    assert oracle.landings == 0
    # Who freed what while NIXL still ran the WRITE: neither side its blocks.
    held_p = p_id not in p.send_reports and "local-hw" not in p.finished
    held_d = d_id not in d.recv_reports
    assert env.fabric.progress(pa) == 1  # NIXL completes the WRITE now
    _run(env, oracle, lambda: d_id in d.finished and "local-hw" in p.finished, "both end")
    env.settle()
    # Which bytes landed where: once, whole, in D's blocks of the request only.
    (landed,) = oracle.landed
    assert landed.for_request == d_id and landed.whole
    assert landed.blocks == oracle.regs[d_id].blocks and set(landed.owners) == {d_id}
    assert not _landed_in_foreign_blocks(oracle), oracle.report()
    code = oracle.code[d_id]
    its_kv = landed.holds == tuple((code, i) for i in range(len(landed.blocks)))
    status = d.finished[d_id].status
    # D's final status: served only with its KV (else its load failed).
    assert status == (
        RequestStatus.FINISHED_LENGTH_CAPPED if its_kv else RequestStatus.FINISHED_ERROR
    ), (
        f"D ended {d_id} {status.name}; the WRITE carried {landed.holds} (its KV: "
        f"{its_kv}); P held its blocks while NIXL ran it: {held_p}; D: {held_d}\n" + oracle.report()
    )
    # No completion accepted after a PUSH_FAIL, none counted twice.
    fails = _delivered(env, da, PUSH_FAIL_PREFIX, d_id)
    completions = _delivered(env, da, None, d_id)
    accepted = d.totals("push_completions_received")
    if fails and (not completions or fails[0] < completions[0]):
        assert accepted == 0, "D accepted a completion after P's PUSH_FAIL"
    assert accepted == (status == RequestStatus.FINISHED_LENGTH_CAPPED)
    assert held_p and held_d, f"P held its blocks: {held_p}; D held its blocks: {held_d}"
    assert p.send_reports[p_id] == 1 and d.recv_reports[d_id] == 1
    _assert_safe(oracle)


#: the TCP user timeout of the test below: the rest of a failed WRITE may land within
#: twice that after its ERR (N-REL-2), and the fake NIXL drops what is left then
FAILED_TCP_USER_TIMEOUT_S = 1.0


@pytest.mark.parametrize("ends", ["released", "failed"])
@pytest.mark.timeout(60)
def test_a_write_p_stopped_watching_does_not_land_in_the_next_requests_blocks(
    env: PushEnv, ends: str
) -> None:
    """P's WRITE does not end normally: it hangs past push_write_timeout_s (``released``:
    a WRITE P releases goes on, N-REL-1; P released it at its deadline and told D
    before P waited for NIXL), or NIXL reports it ERR with part of it still on the way
    (``failed``). Then D's next request comes (D has room for one: it gets the blocks
    if D let them go), and whatever NIXL still had of the old WRITE lands. It must not
    land in the next request's blocks, and D serves the next request its own KV."""
    tcp_s = FAILED_TCP_USER_TIMEOUT_S
    p_extra = {"push_write_timeout_s": 0.3, "ucx_tcp_user_timeout_s": tcp_s}
    p, d, oracle = _pair(env, p_extra=p_extra, d_blocks=4, ucx_tcp_user_timeout_s=tcp_s)
    pa = p.agents[0].name
    if ends == "released":
        env.fabric.fail_next_transfer("hang", initiator=pa)
    else:
        env.fabric.failed_writes_land(0.5, later=True, within_s=2 * tcp_s)
        env.fabric.fail_next_transfer("state", initiator=pa)
    env.fabric.detached_fate("keep")
    d0, _ = _legs(oracle, "rw", _prompt(8), "tid-rw")
    _run(env, oracle, lambda: p.agents[0].calls("transfer"), "the WRITE was posted")
    _steps(oracle, 1.0)  # past P's deadline and release bound
    if ends == "failed":  # the client is not kept waiting: D failed the request at once
        assert d.finished[d0].status == RequestStatus.FINISHED_ERROR
        assert d.totals("push_requests_quarantined") == 1
    d1 = "cmpl-rx-0-d0000000"
    oracle.pair("cmpl-rx-0-a0000000", d1)
    d.add_request(d1, _prompt(9), p.d_leg("tid-rx"), max_tokens=2)
    _steps(oracle, 0.3)
    while env.fabric.detached():  # the old WRITE's bytes arrive now
        env.fabric.land_detached(0)
    env.fabric.progress(pa)
    p.add_request("cmpl-rx-0-a0000000", _prompt(9), p.p_leg("tid-rx"))
    _run(env, oracle, lambda: {d0, d1} <= set(d.finished), "both D requests end")
    assert d.finished[d1].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not oracle.violations, "push wrote into D blocks it must not:\n" + oracle.report()


@pytest.mark.parametrize("forged", ["completion", "PUSH_FAIL"])
@pytest.mark.timeout(60)
def test_a_notification_forged_in_ps_name_does_not_end_ds_wait(env: PushEnv, forged: str) -> None:
    """D registered; P's WRITE runs (hung). A notification that names P's agent as its
    sender arrives from elsewhere: D must neither serve blocks P has not written nor
    free blocks P's WRITE may still land in (D's next request takes them)."""
    p, d, oracle = _pair(env, d_blocks=4)
    env.fabric.fail_next_transfer("hang", initiator=p.agents[0].name)
    d0, _ = _legs(oracle, "fg", _prompt(10), "tid-fg")
    _run(env, oracle, lambda: env.fabric.pending_transfers(), "P's WRITE runs")
    msg = f"{d0}:1".encode() if forged == "completion" else PushFailed(d0, "forged").encode()
    env.fabric.inject_notif(d.agents[0].name, p.agents[0].name, msg)
    _run(env, oracle, lambda: d0 in d.recv_reports or d.totals("push_notifs_forged"), "D read it")
    assert d.totals("push_notifs_forged") == 1  # dropped: it lacks the PUSH_REG's token
    d1 = "cmpl-fx-0-d0000000"
    oracle.pair("cmpl-fx-0-a0000000", d1)
    d.add_request(d1, _prompt(11), p.d_leg("tid-fx"), max_tokens=2)
    env.fabric.progress(p.agents[0].name)  # P's WRITE lands now
    p.add_request("cmpl-fx-0-a0000000", _prompt(11), p.p_leg("tid-fx"))
    _run(env, oracle, lambda: {d0, d1} <= set(d.finished), "both D requests end")
    assert not oracle.violations, "push wrote into D blocks it must not:\n" + oracle.report()


@pytest.mark.timeout(60)
def test_a_replayed_registration_after_ps_expiry_answer_is_not_written(env: PushEnv) -> None:
    """D registers, and no P leg comes within P's hold of the registration (0.8 x D's
    watchdog): P drops it and answers (PUSH_FAIL), D fails the request and frees its
    blocks. The network then delivers D's PUSH_REG again (a duplicate), and the P leg
    comes: P must not store the duplicate and write into the blocks D let go of.
    (Found by the model check, ProgressivePrompts, with its steps slowed down: the P
    leg came after P's hold, the duplicate after P's answer.)"""
    p, d, oracle = _pair(env, push_registration_timeout_s=3.0)  # P holds it 2.4 s
    prompt, d_id, p_id = _prompt(12), "cmpl-xr-0-d0000000", "cmpl-xr-0-a0000000"
    oracle.pair(p_id, d_id)
    d.add_request(d_id, prompt, p.d_leg("tid-xr"), max_tokens=2)
    _run(env, oracle, lambda: pending_regs(p.workers[0]) == 1, "registered with P")
    wait_until(lambda: p.workers[0].remote_agents_of("D"), what="P connected to D")
    # Only P steps until its hold ends: D's own watchdog, due 0.6 s later, would
    # otherwise end the request first on a slow host (D's cancel: another path).
    wait_until(lambda: p.totals("push_regs_expired") == 1, timeout=20,
               step=lambda: p.engine_step(forward=oracle.fill), what="P's hold ended")  # fmt: skip
    _run(env, oracle, lambda: d_id in d.recv_reports, "D let go")
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    (reg,) = notifs(env.fabric, PUSH_REG_PREFIX)
    env.fabric.inject_notif(p.agents[0].name, reg.sender, reg.msg)
    p.add_request(p_id, prompt, p.p_leg("tid-xr"))
    _run(env, oracle, lambda: p_id in p.finished, "P prefilled its request")
    _steps(oracle, 0.3)  # the writer had the duplicate and the P request for a while
    assert not oracle.violations, "push wrote into D blocks it must not:\n" + oracle.report()
    assert oracle.landings == 0
