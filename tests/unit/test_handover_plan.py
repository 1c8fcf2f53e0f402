# SPDX-License-Identifier: Apache-2.0
"""``PushSend.hand_over``: each typed hand-over of the engine thread moves the request and
answers what the controller (``writes.Writes``) must do now, in one place (S-PRG-1 for
the chunks; docs/design.md, "Lifecycle: one request, one state")."""

from __future__ import annotations

from vllm_ext.nixl_push.messages import Announced, KvChunk, KvFinal, Stopped
from vllm_ext.nixl_push.send_lifecycle import (
    STOPPED_REASON,
    HandOverPlan,
    PushSend,
    SendState,
    Write,
    WriteState,
)
from vllm_ext.nixl_push.wire import PushRegistration as Reg


def _write(send: PushSend, rank: int = 0, tp: int = 1) -> Write:
    reg = Reg("D", "d-req", ((1, 2),), rank, tp, "h", 1, 16)
    send.serve(reg, expected=tp)
    w = Write(reg, f"d{rank}", matched_at=1.0)
    send.add_write(w, timeout_s=30.0)
    return w


def test_a_chunk_streams_the_idle_streaming_writes_only() -> None:
    send = PushSend.of(KvChunk("p", ((7,),), kv_tokens=16), now=0.0)
    idle, busy = _write(send, 0, 2), _write(send, 1, 2)
    idle.stream()
    busy.stream()
    busy.post_chunk("h1", until_tokens=16, nbytes=64)
    plan = send.hand_over(KvChunk("p", ((7, 8),), kv_tokens=32, ready="ev"), 2.0, 30.0)
    assert plan == HandOverPlan(stream=(idle,))
    assert (send.block_ids, send.kv_tokens, send.ready) == (((7, 8),), 32, "ev")
    assert send.state is SendState.PREFILLING


def test_a_chunk_after_the_prompt_ended_changes_nothing() -> None:
    send = PushSend.of(Announced("p", ((7, 8),)), now=0.0)
    assert send.hand_over(KvChunk("p", ((7,),), kv_tokens=16), 1.0, 30.0) == HandOverPlan()
    assert send.state is SendState.ANNOUNCED and send.block_ids == ((7, 8),)


def test_the_end_of_a_streamed_prompt_arms_the_idle_writes_and_settles() -> None:
    send = PushSend.of(KvChunk("p", ((7,),), kv_tokens=16), now=0.0)
    idle, busy = _write(send, 0, 2), _write(send, 1, 2)
    for w in (idle, busy):
        w.stream()
        w.streamed_tokens = 16
    busy.post_chunk("h1", until_tokens=32, nbytes=64)
    plan = send.hand_over(Announced("p", ((7, 8, 9),), whole=True), 1.0, 30.0)
    # the busy one is armed when its chunk ends; preempted (whole): written from token 0
    assert plan == HandOverPlan(arm=(idle,), settle=True)
    assert send.state is SendState.ANNOUNCED and send.whole and send.block_ids == ((7, 8, 9),)
    assert idle.streamed_tokens == busy.streamed_tokens == 0


def test_a_final_kv_while_prefilling_ends_the_prompt_and_starts_the_clocks() -> None:
    send = PushSend.of(KvChunk("p", ((7,),), kv_tokens=16), now=0.0)
    w = _write(send)
    w.stream()
    plan = send.hand_over(KvFinal("p", ((7, 8),), finished_at=2.0), 3.0, 30.0)
    assert plan == HandOverPlan(arm=(w,), settle=True)
    assert send.state is SendState.WRITING and w.deadline == 33.0 and send.finished_at == 2.0


def test_a_final_kv_after_the_announcement_posts_the_armed_writes() -> None:
    send = PushSend.of(Announced("p", ((7, 8),)), now=0.0)
    armed, connecting = _write(send, 0, 2), _write(send, 1, 2)
    armed.arm("handle", 64)
    plan = send.hand_over(KvFinal("p", ((7, 8),), finished_at=2.0, ready="ev"), 3.0, 30.0)
    assert plan == HandOverPlan(post=(armed,), settle=True)
    assert send.state is SendState.WRITING and send.ready == "ev"
    assert armed.deadline == connecting.deadline == 33.0
    assert connecting.state is WriteState.CONNECTING


def test_a_second_final_kv_is_ignored() -> None:
    send = PushSend.of(KvFinal("p", ((7, 8),)), now=0.0)
    assert send.hand_over(KvFinal("p", ((7, 8),)), 1.0, 30.0) == HandOverPlan(ignored=True)
    assert send.state is SendState.FINISHED


def test_a_stop_while_prefilling_gives_up_every_active_write() -> None:
    send = PushSend.of(KvChunk("p", ((7,),), kv_tokens=16), now=0.0)
    w = _write(send)
    w.stream()
    plan = send.hand_over(Stopped("p"), 1.0, 30.0)
    assert plan == HandOverPlan(give_up=(w,), why=STOPPED_REASON, settle=True)
    assert send.stopped and send.state is SendState.WRITING and send.complete


def test_a_stop_after_the_prompt_ended_changes_nothing() -> None:
    send = PushSend.of(Announced("p", ((7, 8),)), now=0.0)
    assert send.hand_over(Stopped("p"), 1.0, 30.0) == HandOverPlan()
    assert send.state is SendState.ANNOUNCED and not send.stopped
