# SPDX-License-Identifier: Apache-2.0
"""Descriptors and bytes for heterogeneous layouts (S-WRT-6): logical -> physical block
expansion, TP fan-out and contiguous-run merging, checked on the KV tensors themselves."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from push_harness import (
    LAYERS,
    NUM_KV_HEADS,
    Engine,
    PushEnv,
    assert_kv_pushed,
    assert_untouched,
    block_pairs,
    capture_logs,
    completion,
    kv_blocks,
    notifs,
    wait_until,
)
from vllm.v1.request import RequestStatus

from vllm_ext import compat_nixl
from vllm_ext.nixl_push.wire import PUSH_REG_PREFIX

#: vLLM 0.32 has no cross-layer KV layout (compat_nixl.CROSS_LAYER_KV).
CROSS_LAYER = pytest.mark.skipif(
    not compat_nixl.CROSS_LAYER_KV, reason="this vLLM has no cross-layer KV layout"
)

#: Bytes of one 16-token block of one layer on an engine with all the KV heads.
BLOCK_BYTES = NUM_KV_HEADS * 16 * 2 * 64 * 2


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 71 + i * 5) % 1000 + 3 for i in range(n)]


def _push(env: PushEnv, p: Engine, d: Engine, n_tokens: int, tag: str = "x") -> tuple:
    d_id, p_id = f"cmpl-{tag}-0-bbbbbbbb", f"cmpl-{tag}-0-aaaaaaaa"
    d.add_request(d_id, _prompt(n_tokens, n_tokens), p.d_leg(), max_tokens=2)
    p.add_request(p_id, _prompt(n_tokens, n_tokens), p.p_leg())
    env.run_until(lambda: d_id in d.finished)
    env.settle()
    assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    return p.finished_meta(p_id), d.reg_meta(d_id)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "p_block,d_block",
    [(16, 32), (16, 64), (32, 16), (32, 64)],
    ids=["D-ratio-2", "D-ratio-4", "P-ratio-2", "P2-D4"],
)
def test_hetero_block_size(env: PushEnv, p_block: int, d_block: int) -> None:
    """Logical blocks of 32/64 tokens over a 16-token kernel block on either side."""
    p, d = env.pair(
        p_kw={"block_size": p_block, "kernel_block_size": 16},
        d_kw={"block_size": d_block, "kernel_block_size": 16},
    )
    d_before = d.snapshot()
    fin, reg = _push(env, p, d, 100)  # 7 kernel blocks of 16 tokens
    # Both sides sent *logical* ids; the PUSH_REG carries D's physical block size.
    assert len(fin.block_ids[0]) == -(-100 // p_block)
    assert len(reg.block_ids[0]) == -(-100 // d_block)
    (raw,) = notifs(env.fabric, PUSH_REG_PREFIX)
    assert b"block_size\x10" in raw.msg  # 16, msgpack positive fixint
    pairs = block_pairs(p, d, fin.block_ids[0], reg.block_ids[0])
    # The physical blocks both sides allocated (the last ones may be empty).
    n = min(-(-100 // p_block) * p_block, -(-100 // d_block) * d_block) // 16
    assert len(pairs) == n >= 7
    assert_kv_pushed(p, d, pairs)
    assert_untouched(d, d_before, [db for _, db in pairs])
    # Fresh caches: both sides' blocks are consecutive, so one run -> one descriptor
    # per layer region, n blocks long.
    (xfer,) = env.fabric.transfers()
    assert xfer.requested_desc_count == len(LAYERS)
    assert xfer.total_bytes == n * len(LAYERS) * BLOCK_BYTES
    env.assert_clean()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1), (2, 2)])
def test_tp_fan_out(env: PushEnv, p_tp: int, d_tp: int) -> None:
    """Every destination rank is served with its heads; D counts one completion per
    producer rank that writes into it."""
    p, d = env.pair(p_kw={"tp": p_tp}, d_kw={"tp": d_tp})
    d_before = d.snapshot()
    fin, reg = _push(env, p, d, 40, tag="tp")  # 3 blocks
    pairs = block_pairs(p, d, fin.block_ids[0], reg.block_ids[0])
    assert len(pairs) == 3
    assert_kv_pushed(p, d, pairs)  # head g of P's block == head g of D's block
    assert_untouched(d, d_before, [db for _, db in pairs])

    regs = notifs(env.fabric, PUSH_REG_PREFIX)
    xfers = env.fabric.transfers()
    # One PUSH_REG per (D rank, P rank it talks to); one WRITE per (P rank, D rank) pair.
    n_links = max(p_tp, d_tp)
    assert len(regs) == n_links and len(xfers) == n_links
    assert {(x.initiator, x.target) for x in xfers} == {
        (p.agents[pr].name, d.agents[dr].name)
        for pr in range(p_tp)
        for dr in range(d_tp)
        if (pr * d_tp) // p_tp == dr or (dr * p_tp) // d_tp == pr
    }
    assert all(completion(x.notif) == ("cmpl-tp-0-bbbbbbbb", p_tp) for x in xfers)
    heads_per_write = NUM_KV_HEADS // n_links
    for x in xfers:
        assert x.total_bytes == 3 * len(LAYERS) * BLOCK_BYTES * heads_per_write // NUM_KV_HEADS
        # A head slice of a block is not contiguous with the next block's: one
        # descriptor per block and layer when TP differs; whole runs otherwise.
        assert x.requested_desc_count == len(LAYERS) * (1 if p_tp == d_tp else 3)
    assert d.totals("push_completions_received") == max(p_tp, d_tp)
    env.assert_clean()


def _connector_push(
    env: PushEnv, p: Engine, d: Engine, p_blocks: Sequence[int], d_blocks: Sequence[int]
) -> None:
    """Drive both scheduler halves by hand with real Requests and KVCacheBlocks."""
    n_tokens = 16 * len(d_blocks)
    prompt = _prompt(9, n_tokens)
    d_req = d.make_request("cmpl-c-0-bbbbbbbb", prompt, p.d_leg())
    n, load_async = d.connector.get_num_new_matched_tokens(d_req, 0)
    assert (n, load_async) == (n_tokens, True)
    d.connector.update_state_after_alloc(d_req, kv_blocks(d_blocks), n)

    p_req = p.make_request("cmpl-c-0-aaaaaaaa", prompt, p.p_leg())
    assert p.connector.get_num_new_matched_tokens(p_req, 0) == (0, False)
    p.connector.update_state_after_alloc(p_req, kv_blocks([]), 0)
    p_req.num_computed_tokens = n_tokens
    p_req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, _ = p.connector.request_finished(p_req, list(p_blocks))
    assert delay
    wait_until(
        lambda: (
            "cmpl-c-0-bbbbbbbb" in d.finished_recving and "cmpl-c-0-aaaaaaaa" in p.finished_sending
        ),
        step=lambda: (p.connector_step(), d.connector_step()),
    )
    wait_until(lambda: p.idle() and d.idle(), step=lambda: (p.connector_step(), d.connector_step()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "p_blocks,d_blocks,runs",
    [
        ([4, 5, 6, 7], [10, 11, 12, 13], 1),
        ([4, 5, 9, 10, 11], [20, 21, 22, 30, 31], 3),  # (4,5->20,21) (9->22) (10,11->30,31)
        ([7, 6, 5], [1, 2, 3], 3),  # P's ids descending: nothing to merge
        ([3], [40], 1),
    ],
)
def test_contiguous_runs_become_one_descriptor(
    env: PushEnv, p_blocks: list[int], d_blocks: list[int], runs: int
) -> None:
    p, d = env.pair()
    d_before = d.snapshot()
    _connector_push(env, p, d, p_blocks, d_blocks)
    (xfer,) = env.fabric.transfers()
    assert xfer.requested_desc_count == runs * len(LAYERS)
    assert xfer.total_bytes == len(p_blocks) * len(LAYERS) * BLOCK_BYTES
    pairs = list(zip(p_blocks, d_blocks))
    assert_kv_pushed(p, d, pairs)
    assert_untouched(d, d_before, d_blocks)
    assert not d.invalid_block_ids


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "p_blocks,d_blocks,runs",
    [
        ([4, 5, 6, 7], [10, 11, 12, 13], 1),
        ([4, 9, 5, 20, 7], [33, 2, 17, 8, 40], 5),  # a loaded engine's scattered free list
    ],
)
@CROSS_LAYER
def test_cross_layer_blocks_need_one_descriptor_per_run(
    env: PushEnv, p_blocks: list[int], d_blocks: list[int], runs: int
) -> None:
    """vLLM's cross-layer layout (the CUDA default): one region whose blocks hold every
    layer, so a WRITE has one descriptor per run of blocks, not one per layer and run,
    however scattered the blocks are; every layer's bytes land in the right block."""
    p, d = env.pair(p_kw={"cross_layer": True}, d_kw={"cross_layer": True})
    for e in (p, d):
        (w,) = e.workers
        assert w.transfer_topo.cross_layers_blocks and w.num_regions == 1
    d_before = d.snapshot()
    _connector_push(env, p, d, p_blocks, d_blocks)
    (xfer,) = env.fabric.transfers()
    assert xfer.requested_desc_count == runs
    assert xfer.total_bytes == len(p_blocks) * len(LAYERS) * BLOCK_BYTES
    pairs = list(zip(p_blocks, d_blocks))
    assert_kv_pushed(p, d, pairs)
    assert_untouched(d, d_before, d_blocks)
    env.assert_clean()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)])
@CROSS_LAYER
def test_cross_layer_blocks_serve_tp_fan_out(env: PushEnv, p_tp: int, d_tp: int) -> None:
    """Heads are outermost in a cross-layer block too, so heterogeneous TP slices it."""
    kw = {"cross_layer": True}
    p, d = env.pair(p_kw={"tp": p_tp, **kw}, d_kw={"tp": d_tp, **kw})
    d_before = d.snapshot()
    fin, reg = _push(env, p, d, 40, tag="xl")  # 3 blocks
    pairs = block_pairs(p, d, fin.block_ids[0], reg.block_ids[0])
    assert_kv_pushed(p, d, pairs)
    assert_untouched(d, d_before, [db for _, db in pairs])
    for x in env.fabric.transfers():
        assert x.requested_desc_count == 3  # one per block: a head slice per block
    env.assert_clean()


def test_asking_for_cross_layer_blocks_says_what_vllm_did(env: PushEnv) -> None:
    """A worker that asked for cross-layer blocks and got per-layer tensors says so,
    and why; on vLLM 0.32 and later, that no such layout exists (none to port)."""
    with capture_logs("vllm.ext.nixl_push.connector") as logs:
        p = env.engine("P", "kv_producer", extra_config={"enable_cross_layers_blocks": True})
    text = "\n".join(r.getMessage() for r in logs)
    assert f"kept {len(LAYERS)} per-layer KV tensors" in text, text
    no_layout = "this vLLM has no cross-layer KV layout on any device"
    assert (no_layout in text) == (not compat_nixl.CROSS_LAYER_KV), text
    assert len(p.ranks[0].caches) == len(LAYERS)
