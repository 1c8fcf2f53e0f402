# SPDX-License-Identifier: Apache-2.0
"""Two D engines started with one ``engine_id`` (docs/faults.md, one-flag slips): P
answers every D agent it retired on a restart (S-FLT-1), so no blocks stay quarantined
on the engine P no longer talks to, and once the handshakes prove two live engines P
refuses the other's registrations at once, naming the slip (docs/design.md, "Who may
send what"). The test of a WRITE never landing in the other engine's blocks:
``test_push_untrusted.py::test_two_d_engines_under_one_engine_id_never_get_each_others_kv``.
"""

from __future__ import annotations

import time

import pytest
from push_harness import Engine, PushEnv, assert_kv_pushed, block_pairs, capture_logs
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.wire import PushCancel

WRITES_LOG = "vllm.ext.nixl_push.writes"


def _prompt(seed: int, n: int = 24) -> list[int]:
    return [(seed * 89 + i * 7) % 1000 + 3 for i in range(n)]


def _push(env: PushEnv, p: Engine, d: Engine, i: int) -> RequestStatus:
    """Request ``i`` through ``d`` (its transfer id proves its registration); its
    status at D once it ended (KV checked where it was served)."""
    d_id, p_id = f"cmpl-slip{i}-0-bbbbbbbb", f"cmpl-slip{i}-0-aaaaaaaa"
    d.add_request(d_id, _prompt(i), p.d_leg(f"T{i}"), max_tokens=2)
    p.add_request(p_id, _prompt(i), p.p_leg(f"T{i}"))
    env.run_until(lambda: d_id in d.finished, timeout=30, what=f"request {i} ends on D")
    status = d.finished[d_id].status
    if status != RequestStatus.FINISHED_ERROR:
        fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
        assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    return status


@pytest.mark.timeout(120)
def test_a_second_d_engine_under_one_engine_id_is_refused_at_once(env: PushEnv) -> None:
    """d1, then d2 (taken for a restart of d1), then d1 again: the handshake answers an
    agent P had replaced, so both live. P logs the slip, keeps d1 (it is connected to
    it) and fails d2's next request at once with the slip as the reason, not at D's
    watchdog (480 s here); nothing is left on any engine."""
    p = env.engine("P", "kv_producer")
    d1, d2 = env.engine("D", "kv_consumer"), env.engine("D", "kv_consumer")
    with capture_logs(WRITES_LOG) as logs:
        assert _push(env, p, d1, 0) == RequestStatus.FINISHED_LENGTH_CAPPED
        assert _push(env, p, d2, 1) == RequestStatus.FINISHED_LENGTH_CAPPED  # a "restart"
        assert not p.totals("push_d_engine_ids_shared")
        assert _push(env, p, d1, 2) == RequestStatus.FINISHED_LENGTH_CAPPED  # d1 lives
        assert p.totals("push_d_engine_ids_shared") == 1
        began = time.monotonic()
        assert _push(env, p, d2, 3) == RequestStatus.FINISHED_ERROR
        assert time.monotonic() - began < 20
        assert _push(env, p, d1, 4) == RequestStatus.FINISHED_LENGTH_CAPPED
    errors = [r.getMessage() for r in logs if r.levelname == "ERROR"]
    slip = [m for m in errors if "two D engines use engine_id 'D'" in m]
    assert len(slip) == 1 and "kv_transfer_config.engine_id" in slip[0], errors
    assert d1.agents[0].name in slip[0] and d2.agents[0].name in slip[0]
    assert p.totals("push_regs_engine_id_shared") == 1
    assert d2.totals("push_requests_quarantined") == 0
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(120)
def test_p_answers_the_d_agent_it_retired_so_its_blocks_go_back(env: PushEnv) -> None:
    """d1's registration waits on P for a P leg that never comes; meanwhile d2 (under
    d1's engine id) proves itself and P connects it instead, retiring d1's agent. P's
    expiry answer (and its answer to d1's cancel) still reaches d1: d1 fails the
    request and gets its blocks back into vLLM's free pool. (Before: both were dropped,
    the answer as "no agent", the cancel as foreign, and d1 held the blocks quarantined
    while P lived.)"""
    fast = {"extra_config": {"push_registration_timeout_s": 4}}
    p = env.engine("P", "kv_producer")
    d1, d2 = env.engine("D", "kv_consumer", **fast), env.engine("D", "kv_consumer")
    waiting = "cmpl-slipw-0-bbbbbbbb"
    d1.add_request(waiting, _prompt(50), p.d_leg("Tw"), max_tokens=2)
    env.run_until(lambda: p.totals("push_regs_received") == 1, what="d1's PUSH_REG reaches P")
    assert _push(env, p, d2, 1) == RequestStatus.FINISHED_LENGTH_CAPPED
    env.run_until(lambda: waiting in d1.finished, timeout=30, what="d1's request ends")
    assert d1.finished[waiting].status == RequestStatus.FINISHED_ERROR
    env.settle(timeout=30)
    env.assert_clean()
    assert d1.free_blocks() == d1.initial_free_blocks
    assert p.totals("push_notifs_foreign") == 0


@pytest.mark.timeout(120)
def test_a_forged_cancel_in_a_retired_agents_name_releases_nothing(env: PushEnv) -> None:
    """A PUSH_CANCEL claiming to come from the agent P retired, for a registration the
    engine P serves now made, is foreign: that registration is still served."""
    p = env.engine("P", "kv_producer")
    d1, d2 = env.engine("D", "kv_consumer"), env.engine("D", "kv_consumer")
    assert _push(env, p, d1, 0) == RequestStatus.FINISHED_LENGTH_CAPPED
    d_id, p_id = "cmpl-slipf-0-bbbbbbbb", "cmpl-slipf-0-aaaaaaaa"
    d2.add_request(d_id, _prompt(60), p.d_leg("Tf"), max_tokens=2)
    env.run_until(lambda: p.totals("push_regs_received") == 2, what="d2's PUSH_REG reaches P")
    _push(env, p, d2, 1)  # P retires d1's agent, serves d2
    assert p.totals("push_peers_forgotten") >= 1
    d2_port = d2.workers[0].writer.ctx.identity.port
    forged = PushCancel("D", d_id, 0, 1, "127.0.0.1", d2_port, "wrong-token")
    env.fabric.inject_notif(p.agents[0].name, d1.agents[0].name, forged.encode())
    env.step_all()
    p.add_request(p_id, _prompt(60), p.p_leg("Tf"))
    env.run_until(lambda: d_id in d2.finished, timeout=30, what="d2's request ends")
    assert d2.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.totals("push_notifs_foreign") >= 1
    env.settle()
    env.assert_clean()
