# SPDX-License-Identifier: Apache-2.0
"""A quarantine ends for the right reason (docs/design.md, S-SAFE-1 and N-LIV-1).

D keeps the blocks of a request whose producers have not answered its PUSH_CANCEL
(a WRITE may still land). It gives them back once each producer answered or is known
gone: P's engine has other agents (restarted), or D's send to P failed and P stayed
silent twice the TCP user timeout since. A refused connection alone proves nothing (a
Service without ready endpoints refuses for a P that only hangs). The request itself
ends with an error at D's deadline; only its blocks stay held (vLLM's own block pool
is the truth here).

Real vLLM Schedulers and connector workers over the fake NIXL fabric.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from push_harness import (
    Engine,
    HeldWriter,
    PushEnv,
    assert_untouched,
    join_stopped_listeners,
    live_xfer_handles,
    notifs,
)
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.wire import PUSH_FAIL_PREFIX, PUSH_HB_PREFIX

#: the producers' TCP user timeout in these tests: D gives a silent producer up
#: 2 x this after its send to it failed (N-LIV-1)
TCP_USER_TIMEOUT_S = 1.5
LOST_AFTER_S = 2 * TCP_USER_TIMEOUT_S
REFUSAL_TEST_TCP_USER_TIMEOUT_S = 4.0
ANSWER_S = 0.3
#: slack for a loaded machine on top of a bound
SLACK_S = 5.0


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 59 + i * 17) % 1000 + 3 for i in range(n)]


def _config(tcp_user_timeout_s: float = TCP_USER_TIMEOUT_S, **extra: Any) -> dict[str, Any]:
    return {
        "extra_config": {
            "push_cancel_answer_timeout_s": ANSWER_S,
            "push_quarantine_s": -1,
            "ucx_tcp_user_timeout_s": tcp_user_timeout_s,
            **extra,
        }
    }


def _handshakes_time_out(d: Engine) -> None:
    """D's handshakes with P get no answer (P's host is gone: a timeout, not a
    refusal; P's side channel here still accepts connections)."""

    def no_answer(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)
        raise TimeoutError("no answer from P's side channel (host gone)")

    for w in d.workers:
        w._nixl_handshake = no_answer  # type: ignore[method-assign]


def _start_hung_write(
    env: PushEnv, p: Engine, d: Engine, tag: str, renewed: bool = True
) -> tuple[str, str, Any]:
    """D waits for a push whose WRITE runs and never ends by itself; with ``renewed``,
    once P renewed it while writing (PUSH_HB): D counts on P's TTL only for a
    registration P never renewed (N-LIV-1, test_push_liveness.py)."""
    env.fabric.fail_next_transfer("hang_uncancellable", initiator=p.agents[0].name)
    prompt = _prompt(len(tag))
    d_id, p_id = f"cmpl-{tag}-0-bbbbbbbb", f"cmpl-{tag}-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg())
    (write,) = env.run_until(lambda: env.fabric.pending_transfers(), what="the WRITE runs")
    if renewed:
        env.run_until(lambda: d.totals("push_heartbeats_received") >= 1, what="P renews")
    return d_id, p_id, write


def _steps(env: PushEnv, until: float) -> None:
    while time.monotonic() < until:
        env.step_all()
        time.sleep(0.005)


def _held_blocks(d: Engine, d_id: str) -> list[int]:
    """The blocks vLLM's block table holds for ``d_id`` (finished or not)."""
    (blocks,) = d.scheduler.kv_cache_manager.get_block_ids(d_id)
    return list(blocks)


@pytest.mark.timeout(90)
def test_a_producer_gone_for_good_frees_the_blocks_within_the_bound(env: PushEnv) -> None:
    """P's host is removed while its WRITE runs: the link is cut for good and D's
    handshakes with P time out (no refusal: nothing answers at all). D's cancel fails to
    send; twice the TCP user timeout later, with no sign of life from P, P is gone (its
    own UCX ended any WRITE it still sent) and the blocks come back. Before: only a
    refusal or a new incarnation ended the quarantine, so D held them for good
    (link-cut-stale-write: 24 blocks still held 300 s after the cut)."""
    p, d = env.pair(d_kw=_config())
    pa, da = p.agents[0].name, d.agents[0].name
    d_id, _, write = _start_hung_write(env, p, d, "gone")
    held = _held_blocks(d, d_id)
    d_before = d.snapshot()
    _handshakes_time_out(d)
    env.fabric.cut_link(pa, da)
    cut_at = time.monotonic()
    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    env.run_until(lambda: d.totals("push_requests_quarantined") == 1, what="P silent")
    assert _held_blocks(d, d_id) == held and d_id not in d.finished_recving
    env.run_until(lambda: d_id in d.finished_recving, what="P known gone", timeout=30)
    freed_after = time.monotonic() - cut_at
    # not before the bound (D's send failed after the cut) ...
    assert freed_after >= LOST_AFTER_S, f"freed {freed_after:.2f}s after the cut"
    # ... and within it: the answer deadline, the bound, one more answer period
    assert freed_after <= 2 * ANSWER_S + LOST_AFTER_S + SLACK_S, freed_after
    assert d.totals("push_producers_lost") == 1 and d.totals("push_producers_refused") == 0
    assert d.recv_reports[d_id] == 1
    assert d.free_blocks() == d.initial_free_blocks  # vLLM's pool has them back
    assert_untouched(d, d_before, ())  # nothing landed while D held them
    # P's own UCX ended the WRITE (its TCP user timeout): an error, nothing lands
    env.fabric.complete(write, ok=False)
    env.settle()
    assert_untouched(d, d_before, ())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("producer", ["hung", "dead"])
def test_a_refused_connection_alone_does_not_end_the_quarantine(
    env: PushEnv, producer: str
) -> None:
    """P's side channel refuses connections while D's blocks are quarantined: a
    ClusterIP Service without ready endpoints REJECTs for a P that only hangs ("hung":
    P's writer is stuck, its agent still takes D's notifications), as a host does where
    P's process died ("dead"). D's cancel failed to send once (a partition), so D
    connects anew and meets the refusal. The refusal is counted, not believed: D keeps
    the blocks until P stayed silent twice the TCP user timeout since D's failed send
    (measured on real agents, N-LIV-1: once D's endpoint failed, a WRITE of a P that
    hung meanwhile ends in an error when P resumes; nothing lands). Before: the refusal
    ended the quarantine at once."""
    # a bound past the refusal (vLLM's handshake gives up after about 5 s)
    lost_after_s = 2 * REFUSAL_TEST_TCP_USER_TIMEOUT_S
    p, d = env.pair(d_kw=_config(REFUSAL_TEST_TCP_USER_TIMEOUT_S))
    pa, da = p.agents[0].name, d.agents[0].name
    d_id, _, write = _start_hung_write(env, p, d, f"rf{producer}")
    held = _held_blocks(d, d_id)
    d_before = d.snapshot()
    stuck = HeldWriter(p.workers[0])
    stuck.__enter__()  # P: no answer, no heartbeat from now on
    try:
        env.engines.remove(p)
        p.shutdown()  # its side channel stops: connections are refused
        join_stopped_listeners()
        if producer == "dead":
            p.agents[0].close()  # its agent leaves the fabric: every send fails
            cut_at = time.monotonic()
        else:  # a partition makes D's sends fail until D removes P, then ends
            env.fabric.cut_link(pa, da)
            cut_at = time.monotonic()
        d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
        env.run_until(lambda: d.totals("push_failed_send_notif") >= 1, what="cancel not sent")
        env.fabric.restore_link(pa, da)
        # D connects anew and is refused
        env.run_until(
            lambda: d.totals("push_producers_refused") >= 1 or d_id in d.finished_recving,
            what="refused", timeout=lost_after_s,
        )  # fmt: skip
        assert d_id not in d.finished_recving, "a refusal freed the blocks"
        assert _held_blocks(d, d_id) == held
        assert time.monotonic() - cut_at < lost_after_s, "refused only after the bound"
        env.run_until(lambda: d_id in d.finished_recving, what="P known gone", timeout=30)
        freed_after = time.monotonic() - cut_at
        assert freed_after >= lost_after_s, f"freed {freed_after:.2f}s after the cut"
        assert d.totals("push_producers_lost") == 1
        assert d.finished[d_id].status == RequestStatus.FINISHED_ABORTED
        assert not notifs(env.fabric, f"{d_id}:".encode())
        assert not notifs(env.fabric, PUSH_FAIL_PREFIX)
        env.settle()
        assert d.free_blocks() == d.initial_free_blocks
        assert_untouched(d, d_before, ())
        # What P left behind ends in an error (measured: NIXL_ERR_REMOTE_DISCONNECT when
        # a hung P resumes after D's endpoint failed; a dead one moves nothing).
        assert write.state == "PROC" and live_xfer_handles(env.fabric) == [write]
        env.fabric.complete(write, ok=False)
        assert write.state == "ERR"
        write.release()
        assert_untouched(d, d_before, ())
    finally:
        stuck.__exit__()


@pytest.mark.timeout(90)
def test_d_fails_the_request_at_its_deadline_and_keeps_only_its_blocks(env: PushEnv) -> None:
    """P's WRITE runs when the link is cut: P's heartbeats stop, D's watchdog expires
    (push_heartbeat_timeout_s) and its cancel gets no answer. At the answer deadline D
    fails the request in vLLM (the client gets D's error) while vLLM keeps its blocks,
    quarantined, until P answers over a new connection once the link is back. Before:
    the request stayed waiting for its KV until the quarantine ended (the client got
    the proxy's 504 after 59.5 s in link-cut-stale-write)."""
    p, d = env.pair(
        d_kw=_config(
            push_registration_timeout_s=60.0,
            push_heartbeat_timeout_s=1.0,
            ucx_tcp_user_timeout_s=30.0,  # the bound stays out of this test
        )
    )
    pa, da = p.agents[0].name, d.agents[0].name
    d_id, p_id, write = _start_hung_write(env, p, d, "dl")
    held = _held_blocks(d, d_id)
    free_while_waiting = d.free_blocks()
    env.run_until(lambda: d.totals("push_heartbeats_received") >= 1, what="P renews")
    env.fabric.cut_link(pa, da)
    env.run_until(lambda: d.totals("push_watchdog_expired") == 1, what="D's deadline")
    env.run_until(lambda: d_id in d.finished, what="the request fails", timeout=10)
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    # only the blocks stay: vLLM's pool has not got them back, the block table holds them
    assert d_id not in d.finished_recving and d.recv_reports.get(d_id, 0) == 0
    assert _held_blocks(d, d_id) == held
    assert d.free_blocks() == free_while_waiting
    assert d.totals("push_requests_quarantined") == 1
    assert d.workers[0].push_gauges.levels()["push_blocks_quarantined_now"] == len(held)
    # The link returns; P's WRITE ends in an error (its connection broke), P answers
    # over a new connection, and the blocks come back.
    env.fabric.restore_link(pa, da)
    env.fabric.complete(write, ok=False)
    env.run_until(lambda: d_id in d.finished_recving, what="P answered", timeout=30)
    assert d.recv_reports[d_id] == 1
    assert d.workers[0].push_gauges.levels()["push_blocks_quarantined_now"] == 0
    env.run_until(lambda: p_id in p.finished_sending)
    env.settle()
    assert d.free_blocks() == d.initial_free_blocks
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_quarantine_alone_does_not_keep_ds_writer_polling_fast(env: PushEnv) -> None:
    """While D holds only quarantined requests (no KV on its way to anything vLLM waits
    for), an idle step does not have the writer read notifications every 50 us for it
    (``await_notifs``, what a step waiting for a completion does): a hung P could keep
    that up for good. Their answers are still read (the writer's own pace).

    P's heartbeats are lost on the way: P renews the WRITE it runs (past its own
    write timeout too), and each renewal defers D's answer deadline, so on a slow
    host they would keep the request from quarantine."""
    p, d = env.pair(d_kw=_config(push_recv_idle_wait_ms=1))  # the opt-in idle wait
    env.fabric.hold_notifs(lambda n: n.msg.startswith(PUSH_HB_PREFIX))
    d_id, _, write = _start_hung_write(env, p, d, "slow", renewed=False)
    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    env.run_until(lambda: d.totals("push_requests_quarantined") == 1, what="P silent")
    writer = d.workers[0].writer
    watches: list[float] = []
    real = writer.await_notifs
    writer.await_notifs = lambda s: watches.append(s) or real(s)  # type: ignore[method-assign,func-returns-value]
    for _ in range(20):
        d.engine_step()
    assert watches == [], f"{len(watches)} fast-polling waits for a quarantined request"
    env.fabric.hold_notifs(None)
    while env.fabric.held_notifs():
        env.fabric.drop_held()
    env.fabric.complete(write, ok=True)  # P's WRITE ends: P answers, the blocks come back
    env.run_until(lambda: d_id in d.finished_recving, what="the quarantine ends")
    env.settle()
