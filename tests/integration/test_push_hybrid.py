# SPDX-License-Identifier: Apache-2.0
"""Hybrid KV (S-HYB-1): sliding-window and full-attention layers, two KV cache groups
under vLLM's hybrid KV cache manager, pushed group by group.

Real vLLM Schedulers (their hybrid KV cache coordinator decides which blocks each
group holds: the null block where a window left a position) drive real push
workers over the fake NIXL; the KV bytes land in D's CPU KV tensors, each shared by
one layer of each group as vLLM lays them out. The truth for which D block must hold
which P block is vLLM's own block tables, position by position.
"""

from __future__ import annotations

import pytest
import torch
from push_harness import (
    DTYPE,
    HEAD_SIZE,
    HYBRID_SHARING,
    NUM_KV_HEADS,
    SAMPLED_TOKEN,
    PushEnv,
    assert_untouched,
    notifs,
)
from vllm.v1.request import RequestStatus

from vllm_ext import compat, compat_nixl
from vllm_ext.nixl_push.wire import PUSH_REG_PREFIX, PushRegistration, parse_notif

BLOCK = 16
WINDOW = 40  # tokens: a 100-token prompt leaves its first blocks outside the window
NULL = compat.NULL_BLOCK_ID
FULL_LAYERS = [full for full, _ in HYBRID_SHARING]
SLIDING_LAYERS = [sw for _, sw in HYBRID_SHARING]

needs_hybrid_recv = pytest.mark.skipif(
    not compat_nixl.HYBRID_RECV, reason="vLLM 0.23 refuses a hybrid decode engine (tested below)"
)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 7) % 1000 + 3 for i in range(n)]


def _pair(env: PushEnv, p_window: int = WINDOW, d_window: int = WINDOW):  # type: ignore[no-untyped-def]
    return env.pair(
        {"sliding_window": p_window, "block_size": BLOCK},
        {"sliding_window": d_window, "block_size": BLOCK},
    )


def _same_block(p, d, p_block: int, d_block: int, layers: list[str]) -> bool:  # type: ignore[no-untyped-def]
    return all(
        bool((p.ranks[0].caches[layer][p_block] == d.ranks[0].caches[layer][d_block]).all())
        for layer in layers
    )


@needs_hybrid_recv
@pytest.mark.timeout(60)
def test_hybrid_kv_is_written_group_by_group_into_the_blocks_vllm_holds(env: PushEnv) -> None:
    p, d = _pair(env)
    d_before = d.snapshot()
    prompt = _prompt(1, 100)  # 7 blocks of 16, the last one partial
    d_id, p_id = "cmpl-hyb-0-1111aaaa", "cmpl-hyb-0-2222bbbb"
    d.add_request(d_id, prompt, p.d_leg("T-H"), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg("T-H"))
    env.run_until(lambda: d_id in d.finished, what="D request finished")
    env.settle()
    req = d.finished[d_id]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert list(req.output_token_ids) == [SAMPLED_TOKEN] * 2

    # vLLM's block tables when the connector was handed the request: D's sliding
    # group holds the null block at the positions outside the window.
    d_groups = d.truth(d_id).groups
    p_groups = p.finished_meta(p_id).block_ids
    assert len(d_groups) == len(p_groups) == 2
    d_full, d_sw = d_groups
    p_full, p_sw = p_groups
    first_sw = next(i for i, b in enumerate(d_sw) if b != NULL)
    assert first_sw >= 2 and all(b == NULL for b in d_sw[:first_sw])

    # The PUSH_REG names, per group, D's blocks from the first one it holds on.
    (n,) = notifs(env.fabric, PUSH_REG_PREFIX)
    reg = parse_notif(n.msg)
    assert isinstance(reg, PushRegistration)
    assert reg.group_starts == (0, first_sw * BLOCK)
    assert reg.block_ids == (tuple(d_full), tuple(d_sw[first_sw:]))
    assert NULL not in reg.block_ids[0] + reg.block_ids[1]

    # The bytes: each group's layers, position by position; never the null block.
    positions = range(7)
    written = set()
    for pos in positions:
        assert _same_block(p, d, p_full[pos], d_full[pos], FULL_LAYERS), f"full, block {pos}"
        written.add(d_full[pos])
    for pos in positions[first_sw:]:
        assert p_sw[pos] != NULL, "P freed a block inside D's window"
        assert _same_block(p, d, p_sw[pos], d_sw[pos], SLIDING_LAYERS), f"window, block {pos}"
        written.add(d_sw[pos])
    assert NULL not in written
    assert_untouched(d, d_before, written)  # the null block and every other block too
    # one WRITE: each shared tensor (one per full/sliding pair) gets both groups' blocks
    (xfer,) = env.fabric.transfers()
    block_bytes = NUM_KV_HEADS * BLOCK * 2 * HEAD_SIZE * DTYPE.itemsize
    assert xfer.total_bytes == (7 + 7 - first_sw) * len(HYBRID_SHARING) * block_bytes
    env.assert_clean()


def _assert_pushed_by_position(p, d, p_id: str, d_id: str, n_blocks: int) -> set[int]:  # type: ignore[no-untyped-def]
    """Every block D holds for the pushed KV (vLLM's block table, not the connector's
    metadata) holds P's block of the same group and position; returns D's written ids."""
    reg = d.reg_meta(d_id)
    written: set[int] = set()
    for g, layers in enumerate((FULL_LAYERS, SLIDING_LAYERS)):
        d_ids, p_ids = d.truth(d_id).groups[g], p.finished_meta(p_id).block_ids[g]
        start = reg.group_starts[g] // BLOCK  # before it: D's cached or null blocks
        assert all(b == NULL for b in d_ids[d.truth(d_id).local_tokens // BLOCK : start])
        for pos in range(start, n_blocks):
            assert d_ids[pos] != NULL and p_ids[pos] != NULL, (g, pos)
            assert _same_block(p, d, p_ids[pos], d_ids[pos], layers), f"group {g} block {pos}"
            written.add(d_ids[pos])
    return written


@needs_hybrid_recv
@pytest.mark.timeout(60)
def test_a_local_prefix_hit_on_d_is_not_written(env: PushEnv) -> None:
    """D holds the first blocks of the second prompt in its prefix cache (vLLM's hybrid
    coordinator decides how many, for every group): P writes each group from there on."""
    p, d = _pair(env)
    first = _prompt(3, 100)
    second = first[:96] + _prompt(4, 36)  # 6 blocks D holds (both groups), 3 to push
    for i, prompt in enumerate((first, second)):
        d_id, p_id = f"cmpl-hyp-{i}-1111aaaa", f"cmpl-hyp-{i}-2222bbbb"
        before = d.snapshot()
        d.add_request(d_id, prompt, p.d_leg(f"T-P{i}"), max_tokens=2)
        p.add_request(p_id, prompt, p.p_leg(f"T-P{i}"))
        env.run_until(lambda d_id=d_id: d_id in d.finished, what="D request finished")
        env.settle()
        assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
        written = _assert_pushed_by_position(p, d, p_id, d_id, -(-len(prompt) // BLOCK))
        assert_untouched(d, before, written)
    assert d.reg_meta("cmpl-hyp-1-1111aaaa").prefix_tokens == 96  # the hit was used
    env.assert_clean()


def _p_rank_of(p, layer: str, tp_rank: int):  # type: ignore[no-untyped-def]
    """P's rank with TP rank ``tp_rank`` (of the pipeline stage holding ``layer``)."""
    return next(r for r in p.ranks if layer in r.caches and r.rank == tp_rank)


def _same_heads(p, d, p_block: int, d_block: int, layers: list[str]) -> bool:  # type: ignore[no-untyped-def]
    """P's block and D's hold the same bytes head for head, across both sides' TP ranks
    (on P, of the stage holding each layer)."""
    p_heads, d_heads = NUM_KV_HEADS // p.spec.tp, NUM_KV_HEADS // d.spec.tp
    return all(
        torch.equal(
            _p_rank_of(p, layer, h // p_heads).caches[layer][p_block, h % p_heads],
            d.ranks[h // d_heads].caches[layer][d_block, h % d_heads],
        )
        for layer in layers
        for h in range(NUM_KV_HEADS)
    )


def _push_by_heads(env: PushEnv, p, d, seed: int, tag: str) -> None:  # type: ignore[no-untyped-def]
    """Push one 100-token prompt (7 blocks of 16) from ``p`` to ``d``; every block D holds
    for it from each group's start holds P's block of the same group and position, head
    for head (vLLM's block tables), and nothing else on D changed."""
    d_before = d.snapshot()
    prompt = _prompt(seed, 100)
    d_id, p_id = f"cmpl-{tag}-0-1111aaaa", f"cmpl-{tag}-0-2222bbbb"
    d.add_request(d_id, prompt, p.d_leg(f"T-{tag}"), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg(f"T-{tag}"))
    env.run_until(lambda: d_id in d.finished, what="D request finished")
    env.settle()
    assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    reg = d.reg_meta(d_id)
    written: set[int] = set()
    for g, layers in enumerate((FULL_LAYERS, SLIDING_LAYERS)):
        d_ids, p_ids = d.truth(d_id).groups[g], p.finished_meta(p_id).block_ids[g]
        for pos in range(reg.group_starts[g] // BLOCK, 7):
            assert d_ids[pos] != NULL and p_ids[pos] != NULL, (g, pos)
            assert _same_heads(p, d, p_ids[pos], d_ids[pos], layers), f"group {g} block {pos}"
            written.add(d_ids[pos])
    assert reg.group_starts[1] > 0  # the window left D's first sliding blocks unwritten
    assert_untouched(d, d_before, written)


@needs_hybrid_recv
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_hybrid_kv_fans_out_across_heterogeneous_tp(env: PushEnv, p_tp: int, d_tp: int) -> None:
    """Each KV cache group of each layer is split by heads like a one-group cache: every
    P rank writes its heads of every group into the D rank(s) holding them, position by
    position as vLLM's block tables say, and nothing else on D changes."""
    p, d = env.pair(
        {"sliding_window": WINDOW, "block_size": BLOCK, "tp": p_tp},
        {"sliding_window": WINDOW, "block_size": BLOCK, "tp": d_tp},
    )
    _push_by_heads(env, p, d, seed=6, tag="hyt")
    assert d.totals("push_completions_received") == max(p_tp, d_tp)
    env.assert_clean()


@needs_hybrid_recv
@pytest.mark.timeout(90)
@pytest.mark.parametrize("p_tp", [1, 2])
def test_hybrid_kv_from_a_pipeline_parallel_producer(env: PushEnv, p_tp: int) -> None:
    """P in two pipeline stages, each holding one full and one sliding-window layer (both
    KV cache groups on every stage): each stage writes its own layers of each group into
    the D blocks vLLM's block tables name, position by position, and nothing else."""
    p, d = env.pair(
        {"sliding_window": WINDOW, "block_size": BLOCK, "pp": 2, "tp": p_tp},
        {"sliding_window": WINDOW, "block_size": BLOCK},
    )
    assert sorted({r.stage for r in p.ranks}) == [0, 1]
    _push_by_heads(env, p, d, seed=7, tag="hpp")
    # one completion per P rank: each stage's ranks finish their own layers
    assert d.totals("push_completions_received") == 2 * p_tp
    env.assert_clean()


@needs_hybrid_recv
@pytest.mark.timeout(60)
def test_a_producer_with_other_kv_cache_groups_is_never_registered_with(env: PushEnv) -> None:
    """D checks P's KV cache groups from P's handshake (not from the leg) before its
    PUSH_REG goes out: another window would pair D's blocks with the wrong tokens."""
    p, d = _pair(env, p_window=WINDOW, d_window=2 * WINDOW)
    prompt = _prompt(2, 100)
    d_id = "cmpl-hyb-1-1111aaaa"
    d.add_request(d_id, prompt, p.d_leg("T-M"), max_tokens=2)
    p.add_request("cmpl-hyb-1-2222bbbb", prompt, p.p_leg("T-M"))
    env.run_until(lambda: d_id in d.finished, what="D request finished")
    env.run_until(d.idle, what="D idle")
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    assert d.free_blocks() == d.initial_free_blocks
    # (P holds its prompt's blocks for a registration until its lease ends)
    assert not notifs(env.fabric, PUSH_REG_PREFIX) and not env.fabric.transfers()


@pytest.mark.timeout(60)
def test_a_hybrid_decode_engine_is_refused_where_vllm_cannot_report_its_failures(
    env: PushEnv,
) -> None:
    """vLLM 0.23 reports a failed load only as block ids of one group: a hybrid D would
    decode KV that never arrived, so it does not start; 0.32 and later report failures
    per request, and it does."""
    if compat_nixl.HYBRID_RECV:
        d = env.engine("D", "kv_consumer", sliding_window=WINDOW, block_size=BLOCK)
        assert len(d.kv_cache_config.kv_cache_groups) == 2
        return
    with pytest.raises(ValueError, match="mixes attention kinds"):
        env.engine("D", "kv_consumer", sliding_window=WINDOW, block_size=BLOCK)


@needs_hybrid_recv
@pytest.mark.timeout(90)
def test_a_silent_producer_keeps_a_hybrid_requests_blocks_until_it_answers(
    env: PushEnv,
) -> None:
    """S-SAFE-1 with several KV cache groups: vLLM takes a failed hybrid load only per
    request, together with the request's release, so D cannot fail the request at its
    cancel-answer deadline and keep the blocks (as it does with one group). It keeps the
    request waiting, every group's blocks held, until P answers; then the request fails
    and only then do the blocks go back to vLLM's pool."""
    extra = {
        "push_cancel_answer_timeout_s": 0.3,
        "push_quarantine_s": -1,
        "push_registration_timeout_s": 60.0,
        "push_heartbeat_timeout_s": 1.0,
        "ucx_tcp_user_timeout_s": 30.0,
    }
    p, d = env.pair(
        {"sliding_window": WINDOW, "block_size": BLOCK},
        {"sliding_window": WINDOW, "block_size": BLOCK, "extra_config": extra},
    )
    pa, da = p.agents[0].name, d.agents[0].name
    env.fabric.fail_next_transfer("hang_uncancellable", initiator=pa)
    prompt = _prompt(5, 100)
    d_id, p_id = "cmpl-hyq-0-1111aaaa", "cmpl-hyq-0-2222bbbb"
    d.add_request(d_id, prompt, p.d_leg("T-Q"), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg("T-Q"))
    (write,) = env.run_until(lambda: env.fabric.pending_transfers(), what="the WRITE runs")
    held = d.scheduler.kv_cache_manager.get_block_ids(d_id)
    free_while_waiting = d.free_blocks()
    env.run_until(lambda: d.totals("push_heartbeats_received") >= 1, what="P renews")
    env.fabric.cut_link(pa, da)
    env.run_until(lambda: d.totals("push_requests_quarantined") == 1, what="P silent", timeout=20)
    for _ in range(50):  # well past the answer deadline: still waiting, blocks held
        env.step_all()
    assert d_id not in d.finished and d_id not in d.finished_recving
    assert d.scheduler.requests[d_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d.scheduler.kv_cache_manager.get_block_ids(d_id) == held
    assert d.free_blocks() == free_while_waiting
    # The link returns; P's WRITE ends in an error, P answers, the request fails.
    env.fabric.restore_link(pa, da)
    env.fabric.complete(write, ok=False)
    env.run_until(lambda: d_id in d.finished, what="P answered", timeout=30)
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    assert d.recv_reports[d_id] == 1
    env.run_until(lambda: p_id in p.finished_sending)
    env.settle()
    assert d.free_blocks() == d.initial_free_blocks
    env.assert_clean()
