# SPDX-License-Identifier: Apache-2.0
"""Chunk-progressive push (``push_progressive``, S-PRG-1): the full blocks of each
computed prompt chunk are written while the next chunks compute, and only the last
WRITE carries the completion.

Real vLLM Schedulers and connector workers over the fake NIXL fabric (asynchronous
completion). P's forward pass writes each computed token's KV into its slot, a value
of its own per (prompt, position); the slots of tokens not computed yet hold a marker.
A WRITE that sent a block before its tokens were all computed, and that no later
WRITE repaired, leaves the marker (or another prompt's values) in D's block, which
``assert_kv_pushed`` (D's blocks equal P's, byte for byte) catches.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from unittest import mock

import pytest
from push_harness import (
    DTYPE,
    HEAD_SIZE,
    LAYERS,
    NUM_KV_HEADS,
    SAMPLED_TOKEN,
    Engine,
    HeldWriter,
    PushEnv,
    Rank,
    assert_kv_pushed,
    assert_untouched,
    block_pairs,
    completion,
    completions,
    notifs,
    pending_regs,
    wait_until,
)
from vllm.v1.request import RequestStatus

from devkit.testing.fake_nixl import FakeXferHandle
from vllm_ext import compat_nixl
from vllm_ext.nixl_push.scheduler import unstreamable
from vllm_ext.nixl_push.wire import PUSH_FAIL_PREFIX, PushFailed, parse_notif

#: What a token slot holds before P's forward pass computed it.
NOT_COMPUTED = -1.0
BLOCK = 16


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 11) % 1000 + 3 for i in range(n)]


class ChunkedForward:
    """P's forward pass: writes the KV of the tokens each step computes, and only those."""

    def __init__(self, p: Engine) -> None:
        self.p = p
        for rank in p.ranks:
            for layer in LAYERS:
                rank.caches[layer].fill_(NOT_COMPUTED)

    def __call__(self, rank: Rank) -> None:
        sched = self.p.scheduler
        for req in list(sched.running):
            # The scheduler advanced num_computed_tokens past this step's tokens when it
            # scheduled them; the tokens before were computed by earlier passes (their
            # values are rewritten unchanged).
            (ids,) = sched.kv_cache_manager.get_block_ids(req.request_id)
            seed = sum(req.prompt_token_ids or ()) % 97
            upto = min(req.num_computed_tokens, req.num_prompt_tokens, len(ids) * BLOCK)
            for pos in range(upto):
                block = self.p.physical([ids[pos // BLOCK]])[0]
                value = float((seed * 5 + pos) % 200 + 1)
                for layer in LAYERS:
                    rank.caches[layer][block, :, pos % BLOCK, :] = value


def _pair(env: PushEnv, d_kw: dict | None = None, **p_kw: object) -> tuple[Engine, Engine]:
    """P streams prompts of more than 32 tokens in chunks of 32."""
    extra = {"push_progressive": True, "push_handover_wait_ms": 1000}
    p_kw.setdefault("max_num_batched_tokens", 32)
    return env.pair(p_kw={"extra_config": extra, **p_kw}, d_kw=d_kw)


def _register(env: PushEnv, p: Engine, d: Engine, d_id: str, prompt: Sequence[int], tid: str):  # type: ignore[no-untyped-def]
    """D's registration waits at P (P's engine does not step meanwhile)."""
    d.add_request(d_id, prompt, p.d_leg(tid), max_tokens=2)
    wait_until(
        lambda: pending_regs(p.workers[0]) == 1, step=d.engine_step, what="PUSH_REG waits at P"
    )
    wait_until(lambda: p.workers[0].remote_agents_of("D"), what="P connected to D")


def _started(env: PushEnv, tag: str, seed: int, n: int):  # type: ignore[no-untyped-def]
    """A streaming pair: D's registration waits at P, and P has the request (``n``
    prompt tokens) queued; returns ``(p, d, forward, d_id, p_id)``."""
    p, d = _pair(env)
    forward = ChunkedForward(p)
    prompt = _prompt(seed, n)
    d_id, p_id = f"cmpl-{tag.lower()}-0-bbbbbbbb", f"cmpl-{tag.lower()}-0-aaaaaaaa"
    _register(env, p, d, d_id, prompt, tag)
    p.add_request(p_id, prompt, p.p_leg(tag))
    return p, d, forward, d_id, p_id


def _push_fails_to(env: PushEnv, d_id: str) -> int:
    """How many PUSH_FAILs for ``d_id`` went out (answers: notices of a failed WRITE
    whose rest may land, N-REL-2, not counted)."""
    return sum(
        isinstance(m := parse_notif(n.msg), PushFailed) and m.request_id == d_id
        and not m.landing
        for n in notifs(env.fabric, PUSH_FAIL_PREFIX)
    )  # fmt: skip


def _writes_to_d(env: PushEnv) -> list:  # type: ignore[type-arg]
    """P's finished WRITEs, in the order they ended."""
    return [t for t in env.fabric.transfers() if t.op == "WRITE"]


def _finish_and_check(env: PushEnv, p: Engine, d: Engine, p_id: str, d_id: str) -> None:
    env.run_until(lambda: d_id in d.finished)
    env.settle()
    assert list(d.finished[d_id].output_token_ids) == [SAMPLED_TOKEN] * 2
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.assert_clean()


@pytest.mark.timeout(60)
def test_each_chunks_full_blocks_are_written_while_the_prompt_computes(env: PushEnv) -> None:
    """100 tokens in chunks of 32: after each chunk's pass, its full blocks are in D
    (a block half computed waits for the next chunk); the last WRITE writes the rest
    and is the only one D is told of."""
    p, d, forward, d_id, p_id = _started(env, "PR", 1, 100)
    written_blocks = []
    for expect_blocks in (2, 4, 6):
        p.engine_step(forward=forward)
        assert p_id in p.ranks[0].metas[-1].push_chunks
        wait_until(lambda: len(_writes_to_d(env)) == len(written_blocks) + 1, what="a chunk")
        (ids,) = p.scheduler.kv_cache_manager.get_block_ids(p_id)
        reg = d.reg_meta(d_id)
        # the chunk's full blocks, and no more, are in D already
        assert_kv_pushed(p, d, block_pairs(p, d, ids[:expect_blocks], reg.block_ids[0]))
        written_blocks.append(expect_blocks)
        assert not completions(env.fabric, d_id)  # D is told nothing yet
        assert d_id not in d.finished
    p.engine_step(forward=forward)  # the last chunk (4 tokens): the prompt ends
    _finish_and_check(env, p, d, p_id, d_id)
    writes = _writes_to_d(env)
    assert [completion(t.notif) for t in writes] == [None, None, None, (d_id, 1)]
    per_block = writes[0].total_bytes // 2
    assert [t.total_bytes // per_block for t in writes] == [2, 2, 2, 1]
    assert p.totals("push_chunk_writes") == 3


@pytest.mark.timeout(60)
def test_the_last_write_waits_for_a_chunk_write_still_in_flight(env: PushEnv) -> None:
    """D must read the completion only once every byte before it landed: the WRITE
    that completes the request is posted after the chunk WRITE ended, never beside it,
    also when the prompt ends while the chunk WRITE runs. One WRITE per D rank is in
    flight at a time, so the two can never complete out of order."""
    p, d, forward, d_id, p_id = _started(env, "LW", 2, 48)  # chunks of 32 and 16 tokens
    agent = p.agents[0]
    in_flight_at_post: list[int] = []  # P's WRITEs in flight when P posts one
    post = agent.transfer

    def counted_post(handle: FakeXferHandle, *args: object, **kwargs: object) -> str:
        in_flight_at_post.append(len(env.fabric.pending_transfers()))
        return post(handle, *args, **kwargs)  # type: ignore[arg-type]

    writer = HeldWriter(p.workers[0])  # never held here: it counts the writer's passes
    d_before = d.snapshot()
    env.fabric.fail_next_transfer("hang", initiator=agent.name)  # the chunk WRITE waits
    with mock.patch.object(agent, "transfer", counted_post):
        p.engine_step(forward=forward)  # chunk 1: 32 tokens, 2 full blocks
        (chunk,) = wait_until(env.fabric.pending_transfers, what="the chunk WRITE posted")
        p.engine_step(forward=forward)  # the last 16 tokens: the prompt ends
        assert p_id in p.ranks[0].metas[-1].push_prefill_done
        # Two whole writer passes after the hand-over: the first to start after it saw it.
        seen = writer.passes
        wait_until(lambda: writer.passes >= seen + 2, what="the writer handled the prompt end")
        assert len(agent.calls("transfer")) == 1, "the last WRITE was posted beside the chunk's"
        assert env.fabric.pending_transfers() == [chunk] and not chunk.notif
        assert not completions(env.fabric, d_id) and d_id not in d.finished_recving
        (p_blocks,) = p.scheduler.kv_cache_manager.get_block_ids(p_id)  # both requests live
        (d_blocks,) = d.scheduler.kv_cache_manager.get_block_ids(d_id)
        assert_untouched(d, d_before, ())  # nothing landed yet
        env.fabric.fail_next_transfer("hang", initiator=agent.name)  # the last WRITE waits too
        assert env.fabric.complete(chunk)  # the chunk WRITE lands
        assert_kv_pushed(p, d, block_pairs(p, d, p_blocks[:2], d_blocks))
        assert_untouched(d, d_before, d.physical(d_blocks[:2]))  # the rest is not in yet
        (last,) = wait_until(env.fabric.pending_transfers, what="the last WRITE posted")
        assert completion(last.notif) == (d_id, 1)
        assert not completions(env.fabric, d_id), "D told before the last block"

        def kv_in_place_when_told(recved: set[str]) -> None:
            if d_id in recved:  # D's blocks are still its request's
                (now,) = d.scheduler.kv_cache_manager.get_block_ids(d_id)
                assert list(now) == list(d_blocks)
                assert_kv_pushed(p, d, block_pairs(p, d, p_blocks, d_blocks))

        d.on_recved.append(kv_in_place_when_told)
        assert env.fabric.complete(last)
        _finish_and_check(env, p, d, p_id, d_id)
    assert d.recv_reports[d_id] == 1  # kv_in_place_when_told ran
    assert in_flight_at_post == [0, 0]  # never two WRITEs in flight
    writes = _writes_to_d(env)
    assert [completion(t.notif) for t in writes] == [None, (d_id, 1)]
    per_block = writes[0].total_bytes // 2
    assert [t.total_bytes // per_block for t in writes] == [2, 1]


@pytest.mark.timeout(60)
def test_a_registration_arriving_mid_prompt_gets_the_chunks_done_so_far_at_once(
    env: PushEnv,
) -> None:
    """D registers after two chunks were computed: its first WRITE carries both chunks'
    blocks, later ones only what follows."""
    p, d = _pair(env)
    forward = ChunkedForward(p)
    prompt = _prompt(3, 100)
    d_id, p_id = "cmpl-mid-0-bbbbbbbb", "cmpl-mid-0-aaaaaaaa"
    p.add_request(p_id, prompt, p.p_leg("MID"))
    p.engine_step(forward=forward)
    p.engine_step(forward=forward)  # 64 tokens computed: 4 full blocks
    assert not _writes_to_d(env)
    d.add_request(d_id, prompt, p.d_leg("MID"), max_tokens=2)
    wait_until(
        lambda: len(_writes_to_d(env)) == 1, step=d.engine_step, what="the chunks so far written"
    )
    first = _writes_to_d(env)[0]
    assert first.notif is None
    per_block = first.total_bytes // 4
    p.engine_step(forward=forward)
    p.engine_step(forward=forward)
    _finish_and_check(env, p, d, p_id, d_id)
    writes = _writes_to_d(env)
    assert sum(t.total_bytes for t in writes) == 7 * per_block  # each block once
    assert completion(writes[-1].notif) == (d_id, 1)


@pytest.mark.timeout(60)
def test_a_failed_chunk_write_fails_the_request_once(env: PushEnv) -> None:
    """A chunk WRITE ends in error: D is told once (PUSH_FAIL), gets no completion, and
    P frees the blocks once its prompt ended."""
    p, d, forward, d_id, p_id = _started(env, "CF", 4, 80)
    env.fabric.fail_next_transfer("state")
    p.engine_step(forward=forward)
    env.run_until(lambda: d_id in d.finished, what="D fails the request")
    env.run_until(lambda: p_id in p.finished_sending, what="P frees the blocks")
    env.settle()
    assert _push_fails_to(env, d_id) == 1
    assert not completions(env.fabric, d_id)
    assert len(p.agents[0].calls("transfer")) == 1  # nothing after the failed chunk
    assert p.finished[p_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_request_aborted_mid_prompt_stops_its_writes_and_frees_its_blocks(
    env: PushEnv,
) -> None:
    """Aborted on P while a chunk WRITE that NIXL cannot cancel is in flight: P keeps the
    blocks until that WRITE ended (they may still be read), tells D (PUSH_FAIL), never
    sends a completion, and frees them."""
    p, d, forward, d_id, p_id = _started(env, "AB", 5, 100)
    env.fabric.fail_next_transfer("hang_uncancellable")
    p.engine_step(forward=forward)
    wait_until(lambda: env.fabric.pending_transfers(), what="the chunk WRITE posted")
    p.scheduler.finish_requests(p_id, RequestStatus.FINISHED_ABORTED)
    # However long P steps meanwhile: the WRITE's release bound (push_write_timeout_s,
    # 30 s) is the only other way out.
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        p.engine_step()
        time.sleep(0.01)
    assert p.free_blocks() < p.initial_free_blocks  # held: NIXL may still read them
    assert p_id not in p.finished_sending
    env.fabric.progress()
    env.run_until(lambda: p_id in p.finished_sending, what="P frees the blocks")
    env.run_until(lambda: d_id in d.finished, what="D ends the request")
    env.settle()
    assert not completions(env.fabric, d_id)
    assert _push_fails_to(env, d_id) == 1
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_request_aborted_mid_prompt_does_not_release_its_chunk_write(env: PushEnv) -> None:
    """Aborted on P while a chunk WRITE is in flight that NIXL would let P release: P
    does not release it (a release does not stop a UCX WRITE, which would then read
    blocks P freed: N-REL-1). The blocks stay held until NIXL ends the WRITE, which
    reads them while held; then P frees them, tells D (PUSH_FAIL) and sends no
    completion. (Before, P released it and freed the blocks at once.)"""
    p, d, forward, d_id, p_id = _started(env, "AC", 6, 100)
    env.fabric.fail_next_transfer("hang", initiator=p.agents[0].name)
    held_at_landing: list[bool] = []
    env.fabric.observe_writes(lambda _: held_at_landing.append(p_id in p.scheduler.requests))
    p.engine_step(forward=forward)
    (chunk,) = wait_until(env.fabric.pending_transfers, what="the chunk WRITE posted")
    (p_blocks,) = p.scheduler.kv_cache_manager.get_block_ids(p_id)
    writer = HeldWriter(p.workers[0])  # never held here: it counts the writer's passes
    p.scheduler.finish_requests(p_id, RequestStatus.FINISHED_ABORTED)
    p.engine_step()  # the stop reaches the writer
    seen = writer.passes
    wait_until(lambda: writer.passes >= seen + 2, what="the writer handled the stop")
    p.engine_step()
    assert p_id not in p.finished_sending and p_id in p.scheduler.requests
    (still,) = p.scheduler.kv_cache_manager.get_block_ids(p_id)
    assert list(still) == list(p_blocks)
    assert p.free_blocks() == p.initial_free_blocks - len(p_blocks)
    assert not _writes_to_d(env), "released in flight (recorded CANCELLED)"
    assert chunk.state == "PROC" and _push_fails_to(env, d_id) == 0
    assert env.fabric.complete(chunk)  # NIXL ends it: it read P's blocks while held
    assert held_at_landing == [True]
    env.run_until(lambda: p_id in p.finished_sending, what="P frees the blocks")
    env.run_until(lambda: d_id in d.finished, what="D ends the request")
    env.settle()
    assert [t.state for t in _writes_to_d(env)] == ["DONE"]
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    assert not completions(env.fabric, d_id)
    assert _push_fails_to(env, d_id) == 1
    env.assert_clean()


def _preempted_while_streaming(env: PushEnv, tag: str, seed: int):  # type: ignore[no-untyped-def]
    """P runs out of blocks while a streamed request prefills and preempts it, 2 chunks
    in, while chunk 2's WRITE is in flight; returns ``(p, d, forward, d_id, p_id,
    chunk 2's handle)``."""
    p, d = _pair(env, num_blocks=8, enable_prefix_caching=False)  # 7 blocks to use
    forward = ChunkedForward(p)
    # A local request of 2 blocks decodes on P and needs a 3rd block two steps after the
    # streamed request (5 blocks) started: P preempts the latter, 2 chunks in.
    p.add_request("local-0", _prompt(9, 17), None, max_tokens=30)
    for _ in range(14):
        p.engine_step(forward=forward)
    prompt = _prompt(seed, 80)
    d_id, p_id = f"cmpl-{tag.lower()}-0-bbbbbbbb", f"cmpl-{tag.lower()}-0-aaaaaaaa"
    _register(env, p, d, d_id, prompt, tag)
    p.add_request(p_id, prompt, p.p_leg(tag))
    p.engine_step(forward=forward)  # chunk 1: 31 tokens, one full block written
    wait_until(lambda: len(_writes_to_d(env)) == 1, what="chunk 1 written")
    env.fabric.fail_next_transfer("hang")
    p.engine_step(forward=forward)  # chunk 2: its WRITE stays in flight
    (chunk,) = wait_until(env.fabric.pending_transfers, what="chunk 2 posted")
    p.engine_step(forward=forward)  # P preempts it in this step's schedule
    assert p.sched.send_ticket(p_id).whole
    return p, d, forward, d_id, p_id, chunk


@pytest.mark.timeout(90)
def test_a_request_preempted_after_streaming_is_written_whole(env: PushEnv) -> None:
    """P runs out of blocks while the streamed request prefills and preempts it; its
    blocks are freed and reused while a chunk WRITE still reads them, so that WRITE
    lands another request's bytes in D. The last WRITE, posted after it, writes every
    block from the first: D ends with the KV of the recomputed prompt."""
    p, d, forward, d_id, p_id, _ = _preempted_while_streaming(env, "PE", 6)
    _scribble_free_blocks(p)  # another request's forward pass writes them
    env.fabric.progress()  # the chunk WRITE lands now: what those blocks hold now
    for _ in range(200):
        p.engine_step(forward=forward)
        d.engine_step()
        if p_id in p.ranks[0].metas[-1].push_prefill_done:
            assert p.ranks[0].metas[-1].push_prefill_done[p_id].whole
            break
    assert p.totals("push_chunk_writes") == 2
    _finish_and_check(env, p, d, p_id, d_id)
    writes = _writes_to_d(env)
    per_block = writes[0].total_bytes
    assert [t.total_bytes // per_block for t in writes] == [1, 2, 5]  # the last: all 5
    assert completion(writes[-1].notif) == (d_id, 1)


def _scribble_free_blocks(p: Engine) -> None:
    held = {
        b
        for req in p.scheduler.running
        for b in p.physical(p.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0])
    }
    for rank in p.ranks:
        for layer in LAYERS:
            cache = rank.caches[layer]
            for b in range(cache.shape[0]):
                if b not in held:
                    cache[b] = -7.0


@pytest.mark.timeout(60)
def test_off_by_default_and_for_engines_whose_kv_it_cannot_stream(env: PushEnv) -> None:
    """Without the key, a chunked prompt is written once, whole, as before."""
    p, d = env.pair(p_kw={"max_num_batched_tokens": 32})
    forward = ChunkedForward(p)
    prompt = _prompt(7, 80)
    d_id, p_id = "cmpl-off-0-bbbbbbbb", "cmpl-off-0-aaaaaaaa"
    _register(env, p, d, d_id, prompt, "OFF")
    p.add_request(p_id, prompt, p.p_leg("OFF"))
    for _ in range(3):
        p.engine_step(forward=forward)
    assert not any(m.push_chunks for m in p.ranks[0].metas)
    _finish_and_check(env, p, d, p_id, d_id)
    assert [completion(t.notif) for t in _writes_to_d(env)] == [(d_id, 1)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "p_kw,d_kw,pairs",
    [
        ({"tp": 1}, {"tp": 2}, 2),  # one P rank writes a slice of each block to two D ranks
        ({"tp": 2}, {"tp": 1}, 2),  # two P ranks write their heads into one D rank
        pytest.param(
            {"cross_layer": True},
            {"cross_layer": True},
            1,  # one region, every layer
            marks=pytest.mark.skipif(
                not compat_nixl.CROSS_LAYER_KV, reason="this vLLM has no cross-layer KV layout"
            ),
        ),
    ],
    ids=["tp1-to-tp2", "tp2-to-tp1", "cross-layer"],
)
def test_chunks_are_streamed_across_tp_sizes_and_layouts(
    env: PushEnv, p_kw: dict, d_kw: dict, pairs: int
) -> None:
    p, d = _pair(env, d_kw, **p_kw)
    forward = ChunkedForward(p)
    prompt = _prompt(8, 100)
    d_id, p_id = "cmpl-tp-0-bbbbbbbb", "cmpl-tp-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg("TP"), max_tokens=2)
    wait_until(
        lambda: pending_regs(p.workers[0]) == d.spec.tp // min(d.spec.tp, p.spec.tp),
        step=d.engine_step, what="the PUSH_REGs wait at P",
    )  # fmt: skip
    wait_until(lambda: all(w.remote_agents_of("D") for w in p.workers), what="P connected to D")
    p.add_request(p_id, prompt, p.p_leg("TP"))
    for _ in range(4):
        p.engine_step(forward=forward)
    _finish_and_check(env, p, d, p_id, d_id)
    writes = _writes_to_d(env)
    # (a chunk that ends while the previous chunk's WRITE runs joins the next WRITE)
    assert sum(t.notif is None for t in writes) >= pairs
    assert sum(t.notif is not None for t in writes) == pairs  # one completion per pair
    block_bytes = len(LAYERS) * NUM_KV_HEADS * BLOCK * 2 * HEAD_SIZE * DTYPE.itemsize
    assert sum(t.total_bytes for t in writes) == 7 * block_bytes  # every block once


def test_only_one_group_of_full_attention_is_streamed() -> None:
    """A sliding window frees the blocks that leave it while the prompt is computed,
    and several groups are not streamed: those engines write whole requests."""
    from types import SimpleNamespace

    from vllm.v1 import kv_cache_interface as kv

    def config(*specs: type) -> SimpleNamespace:
        groups = [SimpleNamespace(kv_cache_spec=object.__new__(s)) for s in specs]
        return SimpleNamespace(kv_cache_groups=groups)

    assert unstreamable(config(kv.FullAttentionSpec)) is None
    assert unstreamable(config(kv.MLAAttentionSpec)) is None
    assert "SlidingWindowSpec" in (unstreamable(config(kv.SlidingWindowSpec)) or "")
    assert "2 KV cache groups" in (
        unstreamable(config(kv.FullAttentionSpec, kv.SlidingWindowSpec)) or ""
    )


@pytest.mark.timeout(60)
def test_on_a_gpu_the_announcement_follows_the_chunk_the_device_still_runs(
    env: PushEnv,
) -> None:
    """With async scheduling the engine thread runs a step ahead of the GPU: the step
    that completes the prompt announces it while the device still runs the previous
    chunk, whose hand-over waits for it (KV-ready watcher). The announcement must not
    overtake that chunk, else the chunk is never written early (the last WRITE then
    carries the whole prompt, as on the H200 before this was fixed)."""
    import threading

    from vllm_ext.nixl_push.kv_ready import KvReadyWatcher

    class Gate:  # a CUDA event the test completes
        def __init__(self) -> None:
            self.done = threading.Event()

        def synchronize(self) -> None:
            assert self.done.wait(30)

    p, d, forward, d_id, p_id = _started(env, "GPU", 9, 64)  # two chunks of 32
    w = p.workers[0]
    gates: list[Gate] = []

    def marker() -> Gate:
        gates.append(Gate())
        return gates[-1]

    w._kv_written_marker = marker  # type: ignore[method-assign]
    w._kv_watcher = KvReadyWatcher(w.writer.deliver_final)
    p.engine_step(forward=forward)  # chunk 1: its event is still pending on the device
    p.engine_step(forward=forward)  # the last chunk, announced at its start
    assert p_id in p.ranks[0].metas[-1].push_prefill_done
    for g in gates:
        g.done.set()
    _finish_and_check(env, p, d, p_id, d_id)
    assert p.totals("push_chunk_writes") == 1
    assert [t.notif is None for t in _writes_to_d(env)] == [True, False]


@pytest.mark.timeout(60)
def test_a_peer_is_not_healed_while_a_chunk_write_to_it_runs(env: PushEnv) -> None:
    """P's PUSH_HB to D fails (the link is cut) while a chunk WRITE to D is in flight:
    P removes D's agents to connect anew (S-FLT-2) only once that WRITE ended. Removed
    while it runs, it would go on landing while NIXL answers ``check_xfer_state`` for
    its handle with NIXL_ERR_NOT_FOUND (measured, N-REL-2): P could no longer tell when
    it ends."""
    p, d = _pair(env, d_kw={"extra_config": {"push_cancel_answer_timeout_s": 0.4}})
    forward = ChunkedForward(p)
    prompt = _prompt(8, 100)
    d_id, p_id = "cmpl-hl-0-bbbbbbbb", "cmpl-hl-0-aaaaaaaa"
    _register(env, p, d, d_id, prompt, "HL")
    p.add_request(p_id, prompt, p.p_leg("HL"))
    pa, da = p.agents[0].name, d.agents[0].name
    env.fabric.fail_next_transfer("hang", initiator=pa)
    p.engine_step(forward=forward)
    (chunk,) = wait_until(env.fabric.pending_transfers, what="the chunk WRITE posted")
    env.fabric.cut_link(pa, da)
    wait_until(lambda: p.totals("push_failed_send_notif") >= 1, what="a PUSH_HB to D failed")
    writer = HeldWriter(p.workers[0])  # never held here: it counts the writer's passes
    seen = writer.passes
    wait_until(lambda: writer.passes >= seen + 3, what="writer passes")
    assert p.totals("push_peers_healed") == 0 and da in p.agents[0].remote_agents()
    assert chunk.state == "PROC"
    env.fabric.restore_link(pa, da)
    assert env.fabric.complete(chunk)
    wait_until(lambda: p.totals("push_peers_healed") == 1, what="D removed once the WRITE ended")
    assert da not in p.agents[0].remote_agents()


@pytest.mark.timeout(90)
def test_a_chunk_write_that_ends_after_the_recomputed_prompt_counts_for_nothing(
    env: PushEnv,
) -> None:
    """As above, but chunk 2's WRITE still runs when the recomputed prompt ends, and
    ends only then, with what the reused blocks hold now. It must not count toward the
    request: D is told nothing before the last WRITE, which rewrites every block from
    the first, so D ends with the recomputed prompt's KV (P's blocks, byte for byte)."""
    p, d, forward, d_id, p_id, stale = _preempted_while_streaming(env, "SC", 7)
    for _ in range(200):  # the prompt is computed anew while chunk 2's WRITE runs
        p.engine_step(forward=forward)
        d.engine_step()
        if p_id in p.ranks[0].metas[-1].push_prefill_done:
            break
    assert p_id in p.ranks[0].metas[-1].push_prefill_done, "the prompt never ended"
    time.sleep(0.2)  # the writer saw the prompt end
    assert stale.state == "PROC" and len(_writes_to_d(env)) == 1
    _scribble_free_blocks(p)  # vLLM gave chunk 2's old blocks to others: they changed
    env.fabric.fail_next_transfer("hang")  # the last WRITE waits until D is checked
    assert env.fabric.complete(stale)  # it lands now, late: what those blocks hold now
    (last,) = wait_until(env.fabric.pending_transfers, what="the last WRITE posted")
    assert not completions(env.fabric, d_id), "D was told before the last WRITE ended"
    assert env.fabric.complete(last)
    _finish_and_check(env, p, d, p_id, d_id)
    per_block = _writes_to_d(env)[0].total_bytes
    assert [t.total_bytes // per_block for t in _writes_to_d(env)] == [1, 2, 5]
