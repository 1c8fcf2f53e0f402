# SPDX-License-Identifier: Apache-2.0
"""P hands a request's blocks to the writer at the end of the forward pass that ran its
last prompt token (``push_at_forward_end``), not one engine step later.

Real vLLM Schedulers and connector workers over the fake NIXL fabric: the request is
announced in the metadata of the step that completes its prompt, handed over in that
step's ``wait_for_save``, and its blocks stay allocated until the WRITE is done,
whatever way the request finishes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from push_harness import (
    LAYERS,
    SAMPLED_TOKEN,
    HeldWriter,
    PushEnv,
    assert_kv_pushed,
    block_pairs,
    completion,
    completion_or_none,
    notifs,
    open_push_env,
    pending_regs,
    wait_until,
)
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.messages import Announced
from vllm_ext.nixl_push.wire import PUSH_FAIL_PREFIX, PushFailed, parse_notif
from vllm_ext.nixl_push.writer import WRITER_THREAD_NAME


@pytest.fixture
def env(env_both_ways: PushEnv) -> PushEnv:
    """Every test here runs with vLLM's synchronous and asynchronous scheduling."""
    return env_both_ways


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 11) % 1000 + 3 for i in range(n)]


def _register_d(env: PushEnv, p, d, d_id: str, prompt: list[int], tid: str) -> None:  # type: ignore[no-untyped-def]
    d.add_request(d_id, prompt, p.d_leg(tid), max_tokens=2)
    env.run_until(lambda: pending_regs(p.workers[0]) == 1, what="PUSH_REG waits at P")


def _registered_pair(env: PushEnv, tag: str, seed: int, max_tokens: int = 1, **p_extra: object):  # type: ignore[no-untyped-def]
    """P and D with D's registration waiting at P; P's request (same prompt) added."""
    p, d = env.pair(p_kw={"extra_config": p_extra})
    prompt = _prompt(seed, 40)
    d_id, p_id = f"cmpl-{tag}-0-bbbbbbbb", f"cmpl-{tag}-0-aaaaaaaa"
    _register_d(env, p, d, d_id, prompt, tag)
    wait_until(lambda: p.workers[0].remote_agents_of("D"), what="P connected to D")
    p.add_request(p_id, prompt, p.p_leg(tag), max_tokens=max_tokens)
    return p, d, d_id, p_id


def _assert_pushed_and_clean(env: PushEnv, p, d, p_id: str, d_id: str) -> None:  # type: ignore[no-untyped-def]
    """D's registered blocks hold P's KV, and every table drained."""
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.assert_clean()


def _finish_pushed_and_clean(env: PushEnv, p, d, p_id: str, d_id: str) -> None:  # type: ignore[no-untyped-def]
    """Step until D's request finished, settle, then :func:`_assert_pushed_and_clean`."""
    env.run_until(lambda: d_id in d.finished)
    env.settle()
    _assert_pushed_and_clean(env, p, d, p_id, d_id)


@pytest.mark.timeout(60)
def test_write_is_posted_before_the_prefill_step_returns(env: PushEnv) -> None:
    """``wait_for_save`` blocks the engine thread until the writer posted the WRITE."""
    p, d, d_id, _ = _registered_pair(env, "ho", 6, push_handover_wait_ms=1000)
    p.engine_step()
    assert len(p.agents[0].calls("transfer")) == 1  # posted within the step, not after it
    env.run_until(lambda: d_id in d.finished)
    (xfer,) = env.fabric.transfers()
    assert completion(xfer.notif) == (d_id, 1)
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_hand_over_waits_for_a_pass_and_gives_up_at_its_timeout(env: PushEnv) -> None:
    p, _ = env.pair()
    writer = p.workers[0].writer
    with HeldWriter(p.workers[0]):
        t0 = time.monotonic()
        assert writer.hand_over(0.05) is False  # the writer cannot run a pass
        assert time.monotonic() - t0 >= 0.05
    assert writer.hand_over(10.0) is True
    assert writer.hand_over(0) is False  # no wait at all
    env.settle()


@pytest.mark.timeout(60)
def test_write_starts_in_the_prefill_step_without_another_engine_step(env: PushEnv) -> None:
    p, d, d_id, p_id = _registered_pair(env, "fe", 1, push_handover_wait_ms=0)
    t0 = time.monotonic()
    p.engine_step()  # the one step that runs the prompt
    p.process_in_flight()  # (async scheduling: its output)
    assert p.finished[p_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    # No further P step: the writer already has the blocks and writes them.
    wait_until(lambda: env.fabric.transfers(), what="the WRITE, with P's engine stopped")
    (xfer,) = env.fabric.transfers()
    assert completion(xfer.notif) == (d_id, 1) and xfer.post_thread == WRITER_THREAD_NAME
    # The hand-off clock starts when the forward pass ended, inside that step.
    stats = [s for s in p.ranks[0].stats if s is not None]
    env.run_until(lambda: d_id in d.finished)
    env.settle()
    fin = p.finished_meta(p_id)
    assert fin.finished_at == 0.0  # the scheduler cannot know it; the worker stamps it
    handoffs = [
        v for s in [*stats, *p.ranks[0].stats] for v in (s.data.get("push_handoff_seconds") or [])
    ]
    assert handoffs and all(0 <= v < time.monotonic() - t0 for v in handoffs)
    # D timed its wait for the KV: registration handed over -> every rank's KV in.
    waits = [v for s in d.ranks[0].stats for v in (s.data.get("push_recv_wait_seconds") or [])]
    assert len(waits) == 1 and 0 < waits[0] < time.monotonic() - t0 + 30
    assert list(d.finished[d_id].output_token_ids) == [SAMPLED_TOKEN] * 2
    _assert_pushed_and_clean(env, p, d, p_id, d_id)


@pytest.mark.timeout(60)
def test_chunked_prefill_is_announced_with_all_its_blocks(env: PushEnv) -> None:
    """A prompt prefilled in three chunks: announced only in the last chunk's step, with
    the blocks of every chunk (collected from the scheduler outputs)."""
    p, d = env.pair(p_kw={"max_num_batched_tokens": 32})
    prompt = _prompt(2, 80)  # 5 blocks of 16; chunks of 32, 32, 16 tokens
    d_id, p_id = "cmpl-ch-0-bbbbbbbb", "cmpl-ch-0-aaaaaaaa"
    _register_d(env, p, d, d_id, prompt, "C")
    p.add_request(p_id, prompt, p.p_leg("C"))
    announced = []
    for _ in range(3):
        p.engine_step()
        announced.append(p_id in p.ranks[0].metas[-1].push_prefill_done)
    assert announced == [False, False, True]
    p.process_in_flight()
    assert p.finished[p_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    fin = p.ranks[0].metas[-1].push_prefill_done[p_id]
    # vLLM's blocks as its block table held them in the announcing step: read now, they
    # may be gone already (the WRITE ended within that step, and P reported the request
    # sent in the output that finished it)
    assert [list(g) for g in fin.block_ids] == [list(p.truth(p_id).ids)]
    assert len(fin.block_ids[0]) == 5
    _finish_pushed_and_clean(env, p, d, p_id, d_id)


@pytest.mark.timeout(60)
def test_abort_after_the_forward_pass_keeps_blocks_until_the_write_is_done(
    env: PushEnv,
) -> None:
    """Aborted between its forward pass and the step's output (async scheduling, PP):
    vLLM would free an aborted request's blocks at once, but the writer has them."""
    p, d, d_id, p_id = _registered_pair(env, "ab", 3)
    with HeldWriter(p.workers[0]):  # the WRITE cannot start yet
        p.engine_step(
            before_update=lambda: p.scheduler.finish_requests(p_id, RequestStatus.FINISHED_ABORTED)
        )
        p.process_in_flight()
        assert p.finished[p_id].status == RequestStatus.FINISHED_ABORTED
        for _ in range(5):
            p.engine_step()
        assert p_id in p.scheduler.requests  # blocks kept for the writer
        assert p.free_blocks() < p.initial_free_blocks
        assert p.sched.has_pending_push_work() and not env.fabric.transfers()
    env.run_until(lambda: p_id in p.finished_sending, what="P reports the WRITE done")
    assert len(env.fabric.transfers()) == 1
    _finish_pushed_and_clean(env, p, d, p_id, d_id)


@pytest.mark.timeout(60)
def test_a_p_request_that_decodes_on_is_pushed_when_it_finishes(env: PushEnv) -> None:
    """A P leg with max_tokens > 1 is not announced at its forward pass (it may run on,
    or be preempted); it is pushed from request_finished as before."""
    p, d, d_id, p_id = _registered_pair(env, "mt", 4, max_tokens=3)
    env.run_until(lambda: p_id in p.finished)
    assert not any(p_id in m.push_prefill_done for m in p.ranks[0].metas)
    assert p.sched.send_ticket(p_id) is None or not p.sched.send_ticket(p_id).at_forward_end
    env.run_until(lambda: d_id in d.finished)
    env.settle()
    assert any(p_id in m.push_finished_blocks for m in p.ranks[0].metas)
    _assert_pushed_and_clean(env, p, d, p_id, d_id)


@pytest.mark.timeout(60)
def test_a_request_aborted_before_its_last_chunk_is_forgotten(env: PushEnv) -> None:
    """Tracked while its prompt runs in chunks, then aborted: nothing is announced, nothing
    is held, and the tracking entry goes with the request."""
    p, _ = env.pair(p_kw={"max_num_batched_tokens": 32})
    p_id = "cmpl-ac-0-aaaaaaaa"
    p.add_request(p_id, _prompt(5, 80), p.p_leg())
    p.engine_step()
    ticket = p.sched.send_ticket(p_id)
    assert ticket is not None and ticket.at_forward_end
    p.scheduler.finish_requests(p_id, RequestStatus.FINISHED_ABORTED)
    assert p.sched.send_ticket(p_id) is None
    env.settle()
    assert not any(p_id in m.push_prefill_done for m in p.ranks[0].metas)
    assert not env.fabric.transfers()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_write_is_prepared_during_the_forward_pass_and_posted_at_its_end(env: PushEnv) -> None:
    """``push_prepare_at_announce``: while the pass that completes the prompt runs, the
    writer matches the registration and builds the NIXL request; it posts it only when
    the pass is over, so D gets the KV that pass wrote."""
    p, d, d_id, p_id = _registered_pair(env, "pa", 7, push_handover_wait_ms=1000)
    agent = p.agents[0]

    def forward(rank) -> None:  # type: ignore[no-untyped-def]
        wait_until(lambda: agent.calls("initialize_xfer"), what="the WRITE prepared")
        assert not agent.calls("transfer")  # the KV is not final: nothing posted
        for layer in LAYERS:  # the pass writes the prompt's KV only now
            rank.caches[layer].normal_()

    p.engine_step(forward=forward)
    assert len(agent.calls("initialize_xfer")) == 1
    assert len(agent.calls("transfer")) == 1  # posted within the step, once
    _finish_pushed_and_clean(env, p, d, p_id, d_id)


@pytest.mark.timeout(60)
def test_without_prepare_at_announce_nothing_is_built_during_the_forward_pass(
    env: PushEnv,
) -> None:
    p, d, d_id, p_id = _registered_pair(env, "np", 8, push_prepare_at_announce=False)
    writer = p.workers[0].writer

    def forward(rank) -> None:  # type: ignore[no-untyped-def]
        assert writer.hand_over(10.0)  # a full writer pass during the forward pass
        assert not p.agents[0].calls("initialize_xfer")

    p.engine_step(forward=forward)
    env.run_until(lambda: d_id in d.finished)
    env.settle()
    assert len(p.agents[0].calls("transfer")) == 1
    _assert_pushed_and_clean(env, p, d, p_id, d_id)


@pytest.mark.timeout(60)
def test_a_prepared_write_whose_kv_never_becomes_final_is_released_and_d_told(
    env: PushEnv,
) -> None:
    """Announced and prepared, then evicted without the KV ever being final: nothing is
    posted, the NIXL request is released and D fails the request at once."""
    p, d = env.pair()
    prompt = _prompt(9, 40)
    d_id, p_id = "cmpl-ev-0-bbbbbbbb", "cmpl-ev-0-aaaaaaaa"
    _register_d(env, p, d, d_id, prompt, "ev")
    wait_until(lambda: p.workers[0].remote_agents_of("D"), what="P connected to D")
    writer = p.workers[0].writer
    writer.announce(Announced(p_id, ((1, 2, 3),), "ev"))
    assert writer.hand_over(10.0)
    assert len(p.agents[0].calls("initialize_xfer")) == 1
    claims = p.workers[0].claims
    assert claims.protects(p_id)  # its blocks may still be read: the lease holds
    writer.evict(p_id)
    assert writer.hand_over(10.0)
    assert not p.agents[0].calls("transfer")
    assert not claims.protects(p_id) and len(claims) == 0
    (told,) = notifs(env.fabric, PUSH_FAIL_PREFIX)
    fail = parse_notif(told.msg)
    assert isinstance(fail, PushFailed) and (fail.request_id, fail.reason) == (
        d_id, "P's KV was never final",
    )  # fmt: skip
    assert fail.token == d.reg_token(d_id)  # S-WIR-3
    env.run_until(lambda: d.totals("push_failed_remote") == 1, what="D fails it at once")
    assert set(d.reg_meta(d_id).block_ids[0]) <= d.invalid_block_ids
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_write_done_within_transfer_is_settled_without_a_state_poll(tiny_model: Path) -> None:
    """Same-host UCX copies inside ``transfer()``, which then returns DONE: the request
    is reported sent from that call, with no ``check_xfer_state`` round."""
    with open_push_env(tiny_model, complete_after_polls=0) as env:
        p, d, d_id, p_id = _registered_pair(env, "in", 10, push_handover_wait_ms=1000)
        p.engine_step()
        lifecycle = ("initialize_xfer", "transfer", "check_xfer_state", "release_xfer_handle")
        calls = [c.method for c in p.agents[0].calls() if c.method in lifecycle]
        assert calls == ["initialize_xfer", "transfer", "release_xfer_handle"]
        env.run_until(lambda: p_id in p.finished_sending and d_id in d.finished)
        env.settle()
        assert p.totals("push_writes") == 1
        _assert_pushed_and_clean(env, p, d, p_id, d_id)


@pytest.mark.timeout(60)
def test_an_idle_d_step_waits_for_the_completion_and_reports_it(env: PushEnv) -> None:
    """``push_recv_idle_wait_ms``: a D step that runs nothing but awaits KV waits in
    get_finished for the completion (the writer polls notifications meanwhile) and
    reports the request in that same step, instead of at a later empty step."""
    p, d = env.pair(d_kw={"extra_config": {"push_recv_idle_wait_ms": 1000}})
    prompt = _prompt(11, 40)
    d_id, p_id = "cmpl-iw-0-bbbbbbbb", "cmpl-iw-0-aaaaaaaa"
    _register_d(env, p, d, d_id, prompt, "iw")
    wait_until(lambda: p.workers[0].remote_agents_of("D"), what="P connected to D")
    p.add_request(p_id, prompt, p.p_leg("iw"))
    writer = d.workers[0].writer
    in_wait = threading.Event()
    real_await = writer.await_notifs

    def await_notifs(timeout: float) -> bool:
        in_wait.set()
        return real_await(timeout)

    writer.await_notifs = await_notifs  # type: ignore[method-assign]
    p_step = threading.Thread(target=lambda: in_wait.wait(10) and p.engine_step())
    p_step.start()
    t0 = time.monotonic()
    kv = d.engine_step()  # idle: the request waits for its KV
    waited = time.monotonic() - t0
    p_step.join(10)
    assert d.ranks[0].metas[-1].push_step_idle
    assert kv.finished_recving == {d_id}  # reported by the step that waited
    assert waited < 1.0  # it returned on the completion, not at the end of its budget
    _finish_pushed_and_clean(env, p, d, p_id, d_id)


@pytest.mark.timeout(60)
def test_a_d_step_that_runs_requests_does_not_wait(env: PushEnv) -> None:
    """While D decodes other requests its steps are not idle: get_finished only lets the
    writer read notifications (hand_over) and never waits out the idle budget."""
    p, d = env.pair(d_kw={"extra_config": {"push_recv_idle_wait_ms": 1000}})
    prompt = _prompt(12, 40)
    d_id, p_id = "cmpl-nw-0-bbbbbbbb", "cmpl-nw-0-aaaaaaaa"
    _register_d(env, p, d, d_id, prompt, "nw")
    # Added after the registration (whose wait steps D any number of times): its
    # prefill and next three decode steps all run it, whatever the machine's speed.
    d.add_request("cmpl-local-0-cccccccc", _prompt(13, 40), None, max_tokens=8)
    waits: list[float] = []
    writer = d.workers[0].writer
    writer.await_notifs = waits.append  # type: ignore[assignment,method-assign]
    for _ in range(4):  # the local request runs; d_id waits for its KV
        d.engine_step()
        assert not d.ranks[0].metas[-1].push_step_idle
    assert not waits and d_id not in d.finished_recving
    p.add_request(p_id, prompt, p.p_leg("nw"))
    _finish_pushed_and_clean(env, p, d, p_id, d_id)


def _spy_on_waits(engine) -> list[tuple[float, bool]]:  # type: ignore[no-untyped-def]
    """Every wait of ``engine``'s engine thread for its writer (``hand_over``,
    ``await_notifs``): (timeout, watch) per call."""
    writer = engine.workers[0].writer
    real, waits = writer._wait_for_pass, []

    def spy(timeout: float, watch: bool) -> bool:
        waits.append((timeout, watch))
        return real(timeout, watch)  # type: ignore[no-any-return]

    writer._wait_for_pass = spy
    return waits


@pytest.mark.timeout(60)
@pytest.mark.parametrize("busy", [True, False], ids=["busy", "idle"])
def test_d_never_waits_for_a_write_and_takes_it_at_the_next_step(env: PushEnv, busy: bool) -> None:
    """D's engine thread never waits for its writer or for a WRITE, whatever
    ``push_handover_wait_ms`` says (a P-only knob) and with the defaults in a step that
    runs nothing: a completion that lands after a step's get_finished returned is read
    by D's writer on its own and taken by the next step."""
    tag = f"nb{int(busy)}"
    p, d = env.pair(d_kw={"extra_config": {"push_handover_wait_ms": 1000}})
    prompt = _prompt(14, 40)
    d_id, p_id = f"cmpl-{tag}-0-bbbbbbbb", f"cmpl-{tag}-0-aaaaaaaa"
    _register_d(env, p, d, d_id, prompt, tag)
    wait_until(lambda: p.workers[0].remote_agents_of("D"), what="P connected to D")
    if busy:  # D decodes a request of its own: every step below runs it
        d.add_request("cmpl-local-0-dddddddd", _prompt(15, 40), None, max_tokens=8)
        d.engine_step()
    waits = _spy_on_waits(d)
    # P writes; its completion stays in the network until D's step below returned.
    env.fabric.hold_notifs(lambda n: (completion_or_none(n.msg) or ("",))[0] == d_id)
    p.add_request(p_id, prompt, p.p_leg(tag))
    wait_until(lambda: env.fabric.held_notifs(), step=p.engine_step, what="the completion sent")
    kv = d.engine_step()
    assert d.ranks[0].metas[-1].push_step_idle is not busy
    assert d_id not in (kv.finished_recving or ())  # nothing arrived, nothing waited for
    writer = d.workers[0].writer
    news = writer._news
    env.fabric.hold_notifs(None)
    env.fabric.release_held()  # it lands after that step's hooks returned
    wait_until(lambda: writer._news > news, what="D's writer read the completion by itself")
    kv = d.engine_step()
    assert kv.finished_recving == {d_id}  # taken by the next step
    assert waits == [], f"D's engine thread waited for its writer: {waits}"
    _finish_pushed_and_clean(env, p, d, p_id, d_id)
