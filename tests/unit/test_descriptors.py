# SPDX-License-Identifier: Apache-2.0
"""Logical->physical expansion, pairing, run merging and TP fan-out (S-WRT-6)."""

from __future__ import annotations

import pytest

from vllm_ext.nixl_push.descriptors import (
    DescriptorError,
    RegionLayout,
    TpSlice,
    build_write_descs,
    d_ranks_for,
    expand_logical,
    merge_runs,
    pair_blocks,
    tp_slice,
)


def layout(base: int, block_len: int, regions: int = 2, blocks: int = 64, bs: int = 16):
    return RegionLayout(
        base_addrs=tuple(base + i * blocks * block_len for i in range(regions)),
        block_lens=(block_len,) * regions, num_blocks=blocks, device_id=0, block_size=bs,
    )  # fmt: skip


def test_expand_logical() -> None:
    assert expand_logical([3, 5], 1) == [3, 5]
    assert expand_logical([3, 5], 2) == [6, 7, 10, 11]
    assert expand_logical([1], 4) == [4, 5, 6, 7]


@pytest.mark.parametrize("ratio", [2, 4])
def test_hetero_block_size_d_logical_to_p_physical(ratio: int) -> None:
    # D's logical block = `ratio` physical blocks of P's size; P: logical == physical.
    p_blocks = list(range(10, 10 + 2 * ratio))  # prompt fills 2 D logical blocks
    d_phys = expand_logical([3, 7], ratio)
    src, dst = pair_blocks(p_blocks, d_phys, prefix_tokens=0, block_size=16)
    assert src == p_blocks
    assert dst == [3 * ratio + i for i in range(ratio)] + [7 * ratio + i for i in range(ratio)]
    P, D = layout(0x1000, 256), layout(0x900000, 256)
    s, d = build_write_descs(P, D, src, dst)
    # P's run is one, D's splits at the logical-block boundary: 2 runs x 2 regions
    assert len(s) == len(d) == 4
    assert s[0] == (0x1000 + 10 * 256, ratio * 256, 0)
    assert d[0] == (0x900000 + 3 * ratio * 256, ratio * 256, 0)
    assert sum(n for _, n, _ in s) == sum(n for _, n, _ in d) == 2 * 2 * ratio * 256


def test_pairing_with_prefix_hit_and_extra_blocks() -> None:
    # D already holds the first 2 blocks (prefix cache) and allocated one block too many.
    src, dst = pair_blocks([0, 1, 2, 3, 4], [20, 21, 22, 23], prefix_tokens=32, block_size=16)
    assert src == [2, 3, 4] and dst == [20, 21, 22]
    with pytest.raises(DescriptorError, match="block"):
        pair_blocks([0, 1], [5], prefix_tokens=8, block_size=16)


def test_a_span_of_tokens_pairs_only_the_blocks_wholly_inside_it() -> None:
    """Chunk-progressive push (S-PRG-1): a chunk WRITE covers the full blocks of the
    tokens final so far; what it left, the next one covers, each block once."""
    p, d = [10, 11, 12, 13, 14], [20, 21, 22, 23]  # D holds the first block (prefix)
    assert pair_blocks(p, d, 16, 16, (0, 40)) == ([11], [20])  # block 2 is half done
    assert pair_blocks(p, d, 16, 16, (32, 80)) == ([12, 13, 14], [21, 22, 23])
    assert pair_blocks(p, d, 16, 16, (32, None)) == ([12, 13, 14], [21, 22, 23])
    assert pair_blocks(p, d, 0, 16, (0, 15)) == ([], [])  # no full block yet
    assert pair_blocks(p, d, 0, 16, (48, None)) == ([13], [23])  # D has 4 blocks
    assert pair_blocks(p, d, 16, 16) == pair_blocks(p, d, 16, 16, (0, None))
    with pytest.raises(DescriptorError, match="start of a 16-token block"):
        pair_blocks(p, d, 0, 16, (8, 40))


def test_contiguous_runs_become_one_descriptor() -> None:
    assert merge_runs([1, 2, 3, 7, 8], [10, 11, 12, 13, 14]) == [(1, 10, 3), (7, 13, 2)]
    P, D = layout(0, 100, regions=3), layout(10**6, 100, regions=3)
    s, d = build_write_descs(P, D, list(range(8)), list(range(20, 28)))
    assert len(s) == 3  # one per region
    assert s[1] == (P.base_addrs[1], 800, 0) and d[1] == (D.base_addrs[1] + 2000, 800, 0)


def test_descriptor_order_is_region_major_and_ascending() -> None:
    P, D = layout(0, 100), layout(10**6, 100)
    s, d = build_write_descs(P, D, [5, 1, 2], [0, 10, 11])
    assert s == [(100, 200, 0), (500, 100, 0), (6500, 200, 0), (6900, 100, 0)]
    assert d == [(10**6 + 1000, 200, 0), (10**6, 100, 0), (10**6 + 7400, 200, 0),
                 (10**6 + 6400, 100, 0)]  # fmt: skip


def test_tp1_to_tp2_fan_out() -> None:
    assert d_ranks_for(0, 1, 2) == [0, 1]
    P = layout(0, 512)  # P holds all heads: 512 bytes per block
    D = layout(10**6, 256)  # each D rank holds half the heads
    descs = {}
    for d_rank in (0, 1):
        sl = tp_slice(0, 1, d_rank, 2)
        assert sl == TpSlice(d_rank, 0, 2, 1)
        descs[d_rank] = build_write_descs(P, D, [4, 5], [8, 9], sl)
    s0, d0 = descs[0]
    s1, d1 = descs[1]
    assert len(s0) == 4  # sliced blocks are not contiguous: one per block per region
    assert s0[0] == (4 * 512, 256, 0) and s1[0] == (4 * 512 + 256, 256, 0)
    assert d0[0] == d1[0] == (10**6 + 8 * 256, 256, 0)


def test_tp2_to_tp1_writes_into_slots() -> None:
    assert d_ranks_for(1, 2, 1) == [0]
    P, D = layout(0, 256), layout(10**6, 512)
    s, d = build_write_descs(P, D, [1], [3], tp_slice(1, 2, 0, 1))
    assert s[0] == (256, 256, 0) and d[0] == (10**6 + 3 * 512 + 256, 256, 0)


def test_layout_mismatches_name_the_problem() -> None:
    with pytest.raises(DescriptorError, match="KV regions"):
        build_write_descs(layout(0, 100, regions=2), layout(0, 100, regions=3), [1], [1])
    with pytest.raises(DescriptorError, match="bytes per block"):
        build_write_descs(layout(0, 100), layout(0, 200), [1], [1])
    with pytest.raises(DescriptorError, match="out of range"):
        build_write_descs(layout(0, 100), layout(0, 100), [1], [64])
    with pytest.raises(DescriptorError, match="does not serve"):
        tp_slice(0, 2, 2, 4)


def test_kv_cache_groups_must_match_from_the_handshake() -> None:
    """S-HYB-1: P writes group g into D's blocks of group g: same kinds, windows and
    layers, in the same order; a peer that announces none (older) pairs only with one
    group of full attention."""
    from vllm_ext.nixl_push.layouts import groups_mismatch

    full = ("FullAttentionSpec", 0, ("l.0", "l.1"))
    hybrid = (("FullAttentionSpec", 0, ("l.1",)), ("SlidingWindowSpec", 64, ("l.0",)))
    assert groups_mismatch((full,), (full,)) is None
    assert groups_mismatch((full,), ()) is None
    assert groups_mismatch(hybrid, hybrid) is None
    assert "announces none" in (groups_mismatch(hybrid, ()) or "")
    other_window = (hybrid[0], ("SlidingWindowSpec", 128, ("l.0",)))
    assert "differ" in (groups_mismatch(hybrid, other_window) or "")
    assert "differ" in (groups_mismatch(hybrid, hybrid[::-1]) or "")


def test_blocks_to_receive_start_after_cached_and_skipped_blocks() -> None:
    """S-HYB-1: a sliding-window group holds vLLM's null block outside its window and
    cached blocks before a local prefix hit; D registers the run after them and the
    token it starts at."""
    from types import SimpleNamespace

    from vllm_ext.nixl_push.descriptors import DescriptorError, blocks_to_receive

    def blk(i: int, hashed: bool = False) -> SimpleNamespace:
        return SimpleNamespace(block_id=i, is_null=i == 0, block_hash=b"h" if hashed else None)

    full = [blk(4, True), blk(5), blk(6), blk(7)]
    window = [blk(0), blk(0), blk(9), blk(10)]
    ids, starts = blocks_to_receive([full, window], [16, 16])
    assert ids == [[5, 6, 7], [9, 10]] and starts == (16, 32)
    with pytest.raises(DescriptorError, match="not one run"):
        blocks_to_receive([[blk(5), blk(0), blk(6)]], [16])
