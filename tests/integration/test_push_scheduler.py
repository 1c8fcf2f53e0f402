# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.23.0's real Scheduler drives the push scheduler half (S-SCH-1..4, S-PAT-1 use):
allocation (update_state_after_alloc with blocks from the real KV cache manager), finish
(request_finished) and connector output (update_connector_output), with real Requests."""

from __future__ import annotations

import pytest
from push_harness import (
    P_HOLDS_ITS_WRITE,
    SAMPLED_TOKEN,
    HandshakeGate,
    HeldWriter,
    PushEnv,
    assert_kv_pushed,
    block_pairs,
    held_finished,
    pending_regs,
    wait_until,
)
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.config import DEFAULT_DECODER_KV_BLOCKS_TTL
from vllm_ext.nixl_push.metadata import PushConnectorMetadata
from vllm_ext.nixl_push.scheduler import RecvTicketState, SendTicketState


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 29 + i * 17) % 1000 + 3 for i in range(n)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("early", [True, False], ids=["forward_end", "next_step"])
def test_real_scheduler_drives_the_push_scheduler(env: PushEnv, early: bool) -> None:
    p, d = env.pair(p_kw={"extra_config": {"push_at_forward_end": early}})
    prompt = _prompt(1, 50)  # 4 blocks
    d_id, p_id = "cmpl-rs-0-bbbbbbbb", "cmpl-rs-0-aaaaaaaa"

    # -- D: allocation -> registration + watchdog (S-SCH-1) ---------------------------
    assert not d.scheduler.has_requests()
    d.add_request(d_id, prompt, p.d_leg("T"), max_tokens=3)
    d.engine_step()
    d_req = d.scheduler.requests[d_id]
    assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d_blocks = d.scheduler.kv_cache_manager.get_block_ids(d_id)
    meta = d.ranks[0].metas[-1]
    assert isinstance(meta, PushConnectorMetadata)
    reg = meta.push_registrations[d_id]
    assert [list(g) for g in reg.block_ids] == [list(g) for g in d_blocks]
    assert (reg.p_engine_id, reg.p_port, reg.p_tp_size, reg.transfer_id) == ("P", p.port, 1, "T")
    ticket = d.sched.recv_ticket(d_id)  # the watchdog is armed
    assert ticket is not None and ticket.state is RecvTicketState.AWAITING
    assert d.sched.has_pending_push_work() and d.scheduler.has_requests()
    # Only one transfer per request: later steps do not register again.
    d.engine_step()
    assert d_id not in d.ranks[0].metas[-1].push_registrations

    # -- P: prefill, finish -> finished blocks + lease (S-SCH-2) ------------------------
    p.add_request(p_id, prompt, p.p_leg("T"))
    p.engine_step()  # prefill + sampled token: finished, blocks held
    p_req = p.finished[p_id]
    assert p_req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert p_id in p.scheduler.requests  # delay_free_blocks=True
    p_blocks = p.scheduler.kv_cache_manager.get_block_ids(p_id)
    assert p.free_blocks() == p.initial_free_blocks - len(p_blocks[0])
    held = p.sched.send_ticket(p_id)
    assert held is not None and held.state is SendTicketState.HELD
    # Nothing left to schedule, but the engine keeps stepping (patch 0001).
    assert p.scheduler.get_num_unfinished_requests() == 0
    assert p.sched.has_pending_push_work() and p.scheduler.has_requests()
    prefill_meta = p.ranks[0].metas[-1]
    if early:
        # Announced in the step that ran the prompt; handed over when its forward ended.
        fin = prefill_meta.push_prefill_done[p_id]
        p.engine_step()
        assert p_id not in p.ranks[0].metas[-1].push_finished_blocks
    else:
        assert not prefill_meta.push_prefill_done
        p.engine_step()  # hands the finished blocks to the workers
        fin = p.ranks[0].metas[-1].push_finished_blocks[p_id]
    assert [list(g) for g in fin.block_ids] == [list(g) for g in p_blocks]
    assert p_id in p.ranks[0].metas[-1].reqs_to_send  # vLLM's lease (S-TMO-1)
    assert all(p_id not in m.push_finished_blocks for m in p.ranks[0].metas) == early

    # -- connector output (S-SCH-4) ----------------------------------------------------
    env.run_until(lambda: d_id in d.finished_recving and p_id in p.finished_sending)
    assert d.sched.recv_ticket(d_id) is None
    assert p.sched.send_ticket(p_id) is None
    assert p_id not in p.scheduler.requests and p.free_blocks() == p.initial_free_blocks
    assert not p.sched.has_pending_push_work() and not p.scheduler.has_requests()
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))

    # -- D decodes from the pushed KV ----------------------------------------------------
    env.run_until(lambda: d_id in d.finished)
    assert list(d.finished[d_id].output_token_ids) == [SAMPLED_TOKEN] * 3
    env.settle()
    assert not d.sched.has_pending_push_work() and not d.scheduler.has_requests()
    env.assert_clean()


def test_the_watchdog_default_is_vllms_decoder_kv_blocks_ttl(env: PushEnv) -> None:
    _, d = env.pair()
    assert d.sched.decoder_kv_blocks_ttl == DEFAULT_DECODER_KV_BLOCKS_TTL  # vLLM's default
    assert d.sched.push_config.push_registration_timeout_s == DEFAULT_DECODER_KV_BLOCKS_TTL


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["before_push_reg", "registered", "write_started"])
def test_d_abort_while_waiting(env: PushEnv, when: str) -> None:
    """A D request aborted in WAITING_FOR_REMOTE_KVS: vLLM keeps its blocks until the
    connector reports it received; push must report it once no WRITE can touch them."""
    p, d = env.pair(p_kw={"extra_config": {"kv_lease_duration": 0.5, **P_HOLDS_ITS_WRITE}})
    prompt = _prompt(2, 40)
    d_id, p_id = "cmpl-ab-0-bbbbbbbb", "cmpl-ab-0-aaaaaaaa"
    d_gate = HandshakeGate(d.workers[0], closed=when == "before_push_reg")
    p_gate = HandshakeGate(p.workers[0], closed=when == "write_started")
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    if when == "before_push_reg":
        env.run_until(lambda: d_gate.started == 1)  # PUSH_REG waits for the handshake
    else:
        env.run_until(lambda: pending_regs(p.workers[0]) == 1)
    if when == "write_started":
        p.add_request(p_id, prompt, p.p_leg())
        env.run_until(lambda: p.totals("push_match_base_id") == 1)  # WRITE waits for P->D
    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    assert d_id in d.scheduler.requests  # blocks kept: P may still write into them
    assert d.free_blocks() < d.initial_free_blocks
    if when == "write_started":
        env.run_until(lambda: p.totals("push_cancels_received") == 1)
        for _ in range(10):
            env.step_all()
        assert d_id in d.scheduler.requests  # a WRITE is pending: still kept
        p_gate.open()
    d_gate.open()
    env.run_until(lambda: d_id in d.finished_recving, what="D reports the request received")
    env.run_until(lambda: d_id not in d.scheduler.requests)
    assert d.finished[d_id].status == RequestStatus.FINISHED_ABORTED
    if when != "write_started":
        # Then P's blocks arrive: nothing to write, they go back with the lease.
        p.add_request(p_id, prompt, p.p_leg())
    env.run_until(lambda: p_id in p.finished_sending)
    env.settle()
    written = len(env.fabric.transfers())
    assert written == (1 if when == "write_started" else 0)
    if written:  # the WRITE went into blocks D still held
        fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
        assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    assert d.free_blocks() == d.initial_free_blocks
    assert not d.invalid_block_ids and d.totals("push_failed_remote") == 0
    env.assert_clean()


@pytest.mark.timeout(60)
def test_d_abort_in_the_step_its_push_completes(env: PushEnv) -> None:
    """D aborts the request in the very step in which P's completion is consumed: the
    cancel and the request's eviction reach D's writer together. Nothing may be left."""
    p, d = env.pair()
    prompt = _prompt(5, 40)
    d_id, p_id = "cmpl-ac-0-bbbbbbbb", "cmpl-ac-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    env.run_until(lambda: pending_regs(p.workers[0]) == 1)
    p.add_request(p_id, prompt, p.p_leg())
    d_w = d.workers[0]
    # P writes; D's writer reads the completion, D's engine has not seen it yet.
    wait_until(
        lambda: not d_w.writer.outbox.empty(),
        step=lambda: (p.engine_step(), d_w.writer.wake()),
    )
    d.scheduler.finish_requests(d_id, RequestStatus.FINISHED_ABORTED)
    with HeldWriter(d_w):
        d.engine_step()  # start_load_kv: cancel; get_finished: received -> evict
    assert d_id in d.finished_recving
    # 8 s: room for a loaded machine (3 s failed once with 4 test workers on 2 cores),
    # still under D's wait for P's answer to its cancel (push_cancel_answer_timeout_s,
    # 10 s), so what is left is let go by the answers, not by that timer
    env.settle(timeout=8)
    env.assert_clean()


@pytest.mark.timeout(60)
def test_p_abort_before_finish_pushes_nothing(env: PushEnv) -> None:
    # D waits 3 s, so its PUSH_REG reaches P on a loaded machine too; P holds it 0.8 x
    # that (2.4 s), expires it and answers, and D fails the request on that answer.
    p, d = env.pair(
        p_kw={"extra_config": {"push_registration_timeout_s": 0.4}},
        d_kw={"extra_config": {"push_registration_timeout_s": 3.0}},
    )
    prompt = _prompt(3, 40)
    p_req = p.add_request("cmpl-pa-0-aaaaaaaa", prompt, p.p_leg(), max_tokens=5)
    p.scheduler.finish_requests(p_req.request_id, RequestStatus.FINISHED_ABORTED)
    d.add_request("cmpl-pa-0-bbbbbbbb", prompt, p.d_leg(), max_tokens=2)
    env.run_until(lambda: p.totals("push_regs_expired") == 1, what="P drops the registration")
    env.run_until(lambda: "cmpl-pa-0-bbbbbbbb" in d.finished, what="D fails the request")
    env.settle()
    assert held_finished(p.workers[0]) == 0 and not env.fabric.transfers()
    assert d.finished["cmpl-pa-0-bbbbbbbb"].status == RequestStatus.FINISHED_ERROR
    env.assert_clean()


@pytest.mark.timeout(60)
def test_recompute_policy_recomputes_on_d(env: PushEnv) -> None:
    """With kv_load_failure_policy=recompute a failed push is recomputed by D, not failed."""
    p = env.engine("P", "kv_producer", listener="garbage")
    d = env.engine("D", "kv_consumer")
    d.vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"  # type: ignore[union-attr]
    d.scheduler.recompute_kv_load_failures = True
    d.add_request("cmpl-rc-0-bbbbbbbb", _prompt(4, 40), p.d_leg(), max_tokens=2)
    wait_until(lambda: "cmpl-rc-0-bbbbbbbb" in d.finished, step=d.engine_step)
    req = d.finished["cmpl-rc-0-bbbbbbbb"]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert list(req.output_token_ids) == [SAMPLED_TOKEN] * 2
    wait_until(d.idle, step=d.engine_step)
