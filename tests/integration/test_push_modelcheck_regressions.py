# SPDX-License-Identifier: Apache-2.0
"""The model check's counterexamples (test_push_modelcheck.py), replayed step by step.

Each is a plain, deterministic test of the safety invariant of push_modelcheck.py: a
byte written into a D block belongs to the request that block was registered for,
and only while it is registered. Real vLLM Schedulers and connector workers over the
fake NIXL fabric (push_harness.py).
"""

from __future__ import annotations

import pytest
from push_harness import Engine, HandshakeGate, PushEnv, notifs, pending_regs, wait_until
from push_modelcheck import KvOwnership
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.wire import PUSH_REG_PREFIX


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 41 + i * 7) % 1000 + 3 for i in range(n)]


def _pair(
    env: PushEnv, p_extra: dict[str, float] | None = None, **d_extra: float
) -> tuple[Engine, Engine, KvOwnership]:
    p, d = env.pair(
        p_kw={
            "enable_prefix_caching": False,
            "extra_config": {"kv_lease_duration": 2.0, **(p_extra or {})},
        },
        d_kw={
            "enable_prefix_caching": False,
            "extra_config": {"push_cancel_answer_timeout": 0.2, **d_extra},
        },
    )
    return p, d, KvOwnership(p, d)


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
    p, d, oracle = _pair(env, push_registration_timeout=0.3)  # D's watchdog
    gate = HandshakeGate(d.workers[0])
    prompt, d_id, p_id = _prompt(3), "cmpl-lh-0-d0000000", "cmpl-lh-0-a0000000"
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


@pytest.mark.timeout(60)
def test_a_write_held_past_every_bound_does_not_land_in_blocks_d_let_go(env: PushEnv) -> None:
    """P's WRITE hangs and NIXL cannot cancel it: P abandons it at push_write_timeout
    and frees its blocks at the release bound, but tells D nothing until NIXL released
    it; D's watchdog cancels, and D keeps its blocks meanwhile. The WRITE then
    completes after all: its bytes land only in blocks still registered to it."""
    p, d, oracle = _pair(
        env, p_extra={"push_write_timeout": 0.3}, push_registration_timeout=1.0,
        push_quarantine_s=-1,
    )  # fmt: skip
    env.fabric.fail_next_transfer("hang_uncancellable", initiator=p.agents[0].name)
    prompt, d_id, p_id = _prompt(6), "cmpl-hw-0-d0000000", "cmpl-hw-0-a0000000"
    d.add_request(d_id, prompt, p.d_leg("tid-hw"), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg("tid-hw"))
    _run(env, oracle, lambda: d.totals("push_blocks_quarantined") == 1, "P gave up; D waits")
    assert oracle.landings == 0 and d_id not in d.recv_reports
    assert env.fabric.progress(p.agents[0].name) == 1  # NIXL completes it now
    _run(env, oracle, lambda: d_id in d.recv_reports, "D let go once P told it")
    _assert_safe(oracle)
