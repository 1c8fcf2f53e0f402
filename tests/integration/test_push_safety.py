# SPDX-License-Identifier: Apache-2.0
"""No KV in the wrong blocks: each path by which a WRITE could land in a D block that
is not (or no longer) registered for the request it carries (docs/design.md, "Which
blocks a WRITE may touch"; S-WRT-4, S-LEG-3).

Real vLLM Schedulers and connector workers over the fake NIXL fabric, which holds
handshakes (``HandshakeGate``), WRITEs (``fail_next_transfer("hang...")``) and writer
threads (``HeldWriter``) as long as a test needs. As with UCX, a target removing the
initiator's agent (``remove_remote_agent``) does not stop a WRITE already posted.
"""

from __future__ import annotations

import time

import pytest
from push_harness import (
    HandshakeGate,
    HeldWriter,
    PushEnv,
    assert_kv_pushed,
    assert_untouched,
    block_pairs,
    live_xfer_handles,
    notifs,
    pending_regs,
    wait_until,
)
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.matching import UNVERIFIED_CANCELS_MAX
from vllm_ext.nixl_push.wire import (
    PUSH_FAIL_PREFIX,
    PUSH_REG_PREFIX,
    PushCancel,
    PushRegistration,
)

SECRET = "s3cr3t-of-this-transfer-0123456789"


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 37 + i * 11) % 1000 + 3 for i in range(n)]


def _steps(env: PushEnv, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        env.step_all()
        time.sleep(0.005)


def _writes(env: PushEnv) -> list[object]:
    return [t for t in env.fabric.transfers() if t.op == "WRITE"]


@pytest.mark.timeout(60)
def test_a_handshake_that_ends_after_the_cancel_sends_no_registration(env: PushEnv) -> None:
    """D cancels a request while its handshake with P runs, long enough for its cancel
    deadline to pass. Before: the deadline ended the request (its blocks went back to
    vLLM), and the handshake, ending later, sent its PUSH_REG with those block ids.
    Now: nothing is sent, and the request ends once the handshake did."""
    answer_s = 0.3
    p, d = env.pair(
        p_kw={"extra_config": {"kv_lease_duration": 0.5}},
        d_kw={"extra_config": {"push_cancel_answer_timeout_s": answer_s}},
    )
    gate = HandshakeGate(d.workers[0])
    prompt = _prompt(1)
    d_id = "cmpl-lh-0-bbbbbbbb"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    env.run_until(lambda: gate.started == 1, what="D's handshake with P runs")
    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    _steps(env, 5 * answer_s)  # far past the cancel deadline
    gate.open()
    env.run_until(lambda: d_id in d.finished_recving, what="D ends the request")
    _steps(env, 0.3)
    assert not notifs(env.fabric, PUSH_REG_PREFIX), "a PUSH_REG went out after the cancel"
    assert pending_regs(p.workers[0]) == 0
    # P's request for the same prompt has nobody to write to: its blocks go back by lease.
    p.add_request("cmpl-lh-0-aaaaaaaa", prompt, p.p_leg())
    env.run_until(lambda: "cmpl-lh-0-aaaaaaaa" in p.finished_sending)
    env.settle()
    assert not _writes(env)
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_write_whose_state_nixl_cannot_tell_is_waited_for(env: PushEnv) -> None:
    """``check_xfer_state`` raises while the WRITE still runs. Before: taken as its end;
    P freed its blocks and told D (PUSH_FAIL), D freed its blocks, and the transfer
    then landed in them. Now: it has ended only if NIXL lets it be released; until
    then P asks again, and here it completes and the request is served."""
    p, d = env.pair()
    env.fabric.fail_next_transfer("hang_state_raise", initiator=p.agents[0].name)
    prompt = _prompt(2)
    d_id, p_id = "cmpl-sr-0-bbbbbbbb", "cmpl-sr-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg())
    env.run_until(lambda: len(p.agents[0].calls("check_xfer_state")) >= 5, what="polled")
    assert not notifs(env.fabric, PUSH_FAIL_PREFIX), "D told while the WRITE runs"
    assert d_id not in d.finished and p_id not in p.finished_sending
    env.fabric.progress(p.agents[0].name)  # the WRITE completes after all
    env.run_until(lambda: d_id in d.finished, what="served")
    env.settle()
    assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.assert_clean()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cancels_between", [0, UNVERIFIED_CANCELS_MAX + 1])
def test_a_registration_replayed_after_its_cancel_is_never_served(
    env: PushEnv, cancels_between: int
) -> None:
    """D's PUSH_REG is duplicated or delayed by the network and arrives again after D
    cancelled it (and freed its blocks). Before: P stored it and wrote the next
    matching request's KV into those blocks. Now: P keeps a tombstone of the cancel.
    With more cancels from D between the cancel and the replay than P keeps of
    unverified senders (a busy D aborting requests), P kept at most 4,096 tombstones
    before, forgot this one and served the replay; D's own cancels are now kept for the
    whole TTL."""
    p, d = env.pair(p_kw={"extra_config": {"kv_lease_duration": 0.5}})
    prompt = _prompt(3)
    d_id, p_id = "cmpl-rc-0-bbbbbbbb", "cmpl-rc-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    env.run_until(lambda: pending_regs(p.workers[0]) == 1)
    (sent,) = notifs(env.fabric, PUSH_REG_PREFIX)
    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    env.run_until(lambda: d_id in d.finished_recving, what="P answered the cancel")
    assert pending_regs(p.workers[0]) == 0
    reg = PushRegistration.decode(sent.msg[len(PUSH_REG_PREFIX) :])
    for i in range(cancels_between):  # D's agent cancels other requests (their answers go to D)
        other = PushCancel(
            reg.engine_id, f"cmpl-other-{i}", reg.tp_rank, reg.tp_size, reg.host, reg.port
        )
        env.fabric.inject_notif(p.agents[0].name, sent.sender, other.encode())
    if cancels_between:
        env.run_until(
            lambda: p.totals("push_cancels_received") >= cancels_between, what="the cancels"
        )
    before = d.snapshot()
    env.fabric.inject_notif(p.agents[0].name, sent.sender, sent.msg)  # the replay
    _steps(env, 0.2)
    assert pending_regs(p.workers[0]) == 0, "the replayed PUSH_REG was stored"
    assert p.totals("push_regs_after_cancel") == 1
    p.add_request(p_id, prompt, p.p_leg())
    env.run_until(lambda: p_id in p.finished_sending)
    env.settle()
    assert not _writes(env)
    assert_untouched(d, before, written=())
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_silent_producer_keeps_the_blocks_until_it_answers(env: PushEnv) -> None:
    """P's WRITE runs (NIXL cannot cancel it) and P stops answering (its writer is
    stuck): D's cancel gets no answer. Before: at the answer deadline D freed the
    blocks, and the WRITE landed in them later. Now D keeps the blocks and asks P again
    each answer period: nothing D can do stops a WRITE already on its way (UCX over a
    partitioned TCP link delivers it when the link returns). The request ends once P
    answered."""
    answer_s = 0.3
    p, d = env.pair(
        d_kw={"extra_config": {"push_cancel_answer_timeout_s": answer_s, "push_quarantine_s": -1}}
    )
    env.fabric.fail_next_transfer("hang_uncancellable", initiator=p.agents[0].name)
    prompt = _prompt(4)
    d_id, p_id = "cmpl-sp-0-bbbbbbbb", "cmpl-sp-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg())
    env.run_until(lambda: env.fabric.pending_transfers(), what="the WRITE runs")
    with HeldWriter(p.workers[0]):  # P: no answer, no heartbeat from now on
        d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
        env.run_until(lambda: d.totals("push_requests_quarantined") == 1, what="overdue")
        _steps(env, 4 * answer_s)
        assert d.totals("push_cancels_resent") >= 1
        assert d_id not in d.finished_recving, "D let the blocks go while P may write"
        env.fabric.progress(p.agents[0].name)  # the WRITE lands only now ...
        (write,) = _writes(env)
        assert write.state == "DONE"
        assert d_id not in d.finished_recving  # ... in blocks the request still holds
    env.run_until(lambda: d_id in d.finished_recving, what="P's completion answered")
    env.run_until(lambda: p_id in p.finished_sending)
    wait_until(lambda: not live_xfer_handles(env.fabric), step=env.step_all)
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_registration_without_the_transfer_secret_is_not_served(env: PushEnv) -> None:
    """Another agent registers its own blocks under the victim's transfer id (and a
    matching request id) before the real D. Before: it got the victim's KV. Now P's leg
    carries the transfer's secret and P serves only the registration carrying it; a
    PUSH_REG naming the real D from another agent does not make P forget D either."""
    p, d = env.pair()
    stranger = env.engine("A", "kv_consumer")  # its key sorts before D's
    prompt = _prompt(5)
    d_id, p_id = "cmpl-ts-0-bbbbbbbb", "cmpl-ts-0-aaaaaaaa"
    # An earlier request binds D as a D that uses secrets.
    d.add_request("cmpl-ts0-0-bbbbbbbb", _prompt(6), p.d_leg("T0", transfer_secret=SECRET))
    p.add_request("cmpl-ts0-0-aaaaaaaa", _prompt(6), p.p_leg("T0", transfer_secret=SECRET))
    env.run_until(lambda: "cmpl-ts0-0-bbbbbbbb" in d.finished)
    forged = PushRegistration(
        engine_id="A", request_id="cmpl-ts-0-cccccccc", transfer_id="T", block_ids=((1, 2, 3),),
        tp_rank=0, tp_size=1, host="127.0.0.1", port=stranger.port, block_size=16,
    )  # fmt: skip
    env.fabric.inject_notif(p.agents[0].name, stranger.agents[0].name, forged.encode())
    rebind = PushRegistration(
        engine_id="D", request_id="cmpl-zz-0-cccccccc", transfer_id="Z", block_ids=((1,),),
        tp_rank=0, tp_size=1, host="127.0.0.1", port=stranger.port, block_size=16,
    )  # fmt: skip
    env.fabric.inject_notif(p.agents[0].name, stranger.agents[0].name, rebind.encode())
    env.run_until(lambda: pending_regs(p.workers[0]) == 2, what="the forged ones wait")
    d_agent = p.workers[0].remote_agents_of("D")
    assert d_agent == {0: d.agents[0].name}, "a PUSH_REG made P forget or redirect D"
    before_x = stranger.snapshot()
    d.add_request(d_id, prompt, p.d_leg("T", transfer_secret=SECRET), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg("T", transfer_secret=SECRET))
    env.run_until(lambda: d_id in d.finished, what="the real D is served")
    assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    assert_untouched(stranger, before_x, written=())
    assert all(w.target != stranger.agents[0].name for w in _writes(env))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["prompts", "n"])
def test_the_sub_requests_of_one_body_each_get_their_own_kv(env: PushEnv, kind: str) -> None:
    """vLLM splits a completion with several prompts (``-0``, ``-1``, ...) or ``n > 1``
    (``0_``, ``1_``, ...) into sub-requests that all carry the body's transfer id.
    Before: P's sub-request 0 could meet D's sub-request 1 (another prompt's KV, and
    HTTP 200) and D's sub-request 0 was then dropped as a duplicate. Now each
    sub-request meets its own twin."""
    p, d = env.pair()
    if kind == "prompts":
        ids = [f"cmpl-mp-{i}" for i in range(3)]
        prompts = [_prompt(10 + i) for i in range(3)]
    else:  # n > 1: one prompt, but the children must still pair up one to one
        ids = [f"{i}_cmpl-mp-0" for i in range(3)]
        prompts = [_prompt(10)] * 3
    d_ids = [f"{r}-bbbbbbbb" for r in ids]
    p_ids = [f"{r}-aaaaaaaa" for r in ids]
    for rid, prompt in reversed(list(zip(d_ids, prompts))):
        d.add_request(rid, prompt, p.d_leg("T"), max_tokens=2)
    env.run_until(lambda: pending_regs(p.workers[0]) == 3)
    for rid, prompt in reversed(list(zip(p_ids, prompts))):  # P finishes 2, 1, 0
        p.add_request(rid, prompt, p.p_leg("T"))
    env.run_until(lambda: all(r in d.finished for r in d_ids), what="every sub-request served")
    env.settle()
    for p_id, d_id in zip(p_ids, d_ids):
        assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
        fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
        assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    assert p.totals("push_match_transfer_id") == 3 and p.totals("push_regs_duplicate") == 0
    env.assert_clean()
