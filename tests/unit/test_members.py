# SPDX-License-Identifier: Apache-2.0
"""Member routing (S-PP-1, S-PP-2): layouts from synthetic ``region_members``.

The model has 4 layers. D (PP=1) registers all of them; P's pipeline stage 0
owns layers 0-1 and stage 1 layers 2-3. Every check goes down to the WRITE
descriptors: which bytes of which P region land where in which D region.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_ext.nixl_push.descriptors import DescriptorError, TpSlice, build_write_descs
from vllm_ext.nixl_push.members import (
    MemberLayout,
    MemberRoutingError,
    Region,
    derive_member_layout,
    natural_key,
    needs_member_routing,
    producer_rank,
    producer_stage,
    regions_from_metadata,
    route_remote,
    stage_ranks,
)

L = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
BLOCK = 1024  # bytes per block
BS = 16  # tokens per block


def region(addr: int, *members: str, cap: int = 64, block_len: int = BLOCK) -> Region:
    return Region(addr=addr, block_len=block_len, stride=block_len, capacity=cap, members=members)


def d_regions(order: Sequence[int] = (0, 1, 2, 3), cap: int = 64) -> list[Region]:
    """D: one region per layer at 0xD0000 + layer * 0x10000, advertised in ``order``."""
    return [region(0xD0000 + i * 0x10000, L[i], cap=cap) for i in order]


def p_stage(stage: int, cap: int = 64) -> MemberLayout:
    """P stage ``stage`` of 2: its two layers, one region each, at 0xA0000 + layer * 0x10000."""
    layers = (0, 1) if stage == 0 else (2, 3)
    regions = [region(0xA0000 + i * 0x10000, L[i], cap=cap) for i in layers]
    return derive_member_layout(regions, device_id=0, block_size=BS, why=f"stage {stage}")


def layer_of(addr: int, base: int) -> int:
    return (addr - base) // 0x10000


def written(local: MemberLayout, remote: Sequence[Region], blocks: Sequence[int]) -> dict:
    """{P layer: (D layer, [(P block, D block)])} the WRITE descriptors imply."""
    route = route_remote(local, remote, device_id=0, block_size=BS, peer="D")
    src, dst = build_write_descs(local.region_layout(), route.layout, blocks, blocks)
    out: dict[int, tuple[int, list[tuple[int, int]]]] = {}
    for (sa, sn, _), (da, dn, _) in zip(src, dst):
        assert sn == dn
        p_layer, d_layer = layer_of(sa, 0xA0000), layer_of(da, 0xD0000)
        p_off, d_off = (sa - 0xA0000) % 0x10000, (da - 0xD0000) % 0x10000
        prev = out.setdefault(p_layer, (d_layer, []))
        assert prev[0] == d_layer
        for k in range(sn // BLOCK):
            prev[1].append((p_off // BLOCK + k, d_off // BLOCK + k))
    return out


# -- PP stages -------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1])
def test_pp_stage_writes_only_its_layers_into_ds(stage: int) -> None:
    local = p_stage(stage)
    got = written(local, d_regions(), [3, 4, 9])
    layers = (0, 1) if stage == 0 else (2, 3)
    assert got == {i: (i, [(3, 3), (4, 4), (9, 9)]) for i in layers}
    route = route_remote(local, d_regions(), 0, BS)
    assert route.remote_indices == layers  # exactly the regions this stage owns


def test_stages_together_write_every_layer_once() -> None:
    d = d_regions()
    dst_layers = [d_layer for s in (0, 1) for d_layer, _ in written(p_stage(s), d, [0]).values()]
    assert sorted(dst_layers) == [0, 1, 2, 3]


@pytest.mark.parametrize("seed", range(5))
def test_shuffled_remote_region_order(seed: int) -> None:
    order = list(range(4))
    random.Random(seed).shuffle(order)
    d = d_regions(order)
    for stage in (0, 1):
        layers = (0, 1) if stage == 0 else (2, 3)
        assert written(p_stage(stage), d, [5]) == {i: (i, [(5, 5)]) for i in layers}
        route = route_remote(p_stage(stage), d, 0, BS)
        assert route.remote_indices == tuple(order.index(i) for i in layers)


def test_remote_only_members_are_ignored() -> None:
    # D also lists layers that belong to the other stage (and one no stage has).
    d = [*d_regions(), region(0xF0000, "model.layers.99.other")]
    route = route_remote(p_stage(1), d, 0, BS)
    assert route.layout.num_regions == 2
    assert route.layout.base_addrs == (0xD0000 + 2 * 0x10000, 0xD0000 + 3 * 0x10000)


def test_one_local_source_list_for_every_remote() -> None:
    """The member order is local: the source descriptors are the same for any remote;
    only the destination side changes with the remote's region order."""
    local = p_stage(0)
    srcs, dsts = [], []
    for order in ((0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2)):
        route = route_remote(local, d_regions(order), 0, BS)
        s, d = build_write_descs(local.region_layout(), route.layout, [1, 2], [7, 8])
        srcs.append(s)
        dsts.append(d)
    assert srcs[0] == srcs[1] == srcs[2]
    assert dsts[0] == dsts[1] == dsts[2]  # same D layers, whatever the advertised order


def test_tp_slices_use_the_member_order() -> None:
    # D with TP 2 behind a P with TP 1: P sends half of each block to each D rank.
    local = p_stage(1)
    half = [region(r.addr, *r.members, block_len=BLOCK // 2) for r in d_regions((3, 2, 1, 0))]
    route = route_remote(local, half, 0, BS)
    src, dst = build_write_descs(local.region_layout(), route.layout, [4], [6], TpSlice(1, 0, 2, 1))
    assert src == [
        (0xA0000 + 2 * 0x10000 + 4 * BLOCK + BLOCK // 2, BLOCK // 2, 0),
        (0xA0000 + 3 * 0x10000 + 4 * BLOCK + BLOCK // 2, BLOCK // 2, 0),
    ]
    assert dst == [
        (0xD0000 + 2 * 0x10000 + 6 * (BLOCK // 2), BLOCK // 2, 0),
        (0xD0000 + 3 * 0x10000 + 6 * (BLOCK // 2), BLOCK // 2, 0),
    ]


# -- the member-major layout -------------------------------------------------------------


def test_member_order_is_canonical_and_views_follow_it() -> None:
    names = [f"model.layers.{i}.attn" for i in (10, 2, 9, 0)]
    regions = [region(0x1000 * (k + 1), n, cap=10 + k) for k, n in enumerate(names)]
    m = derive_member_layout(regions, 0, BS)
    assert [n for n, _ in m.members] == sorted(names, key=natural_key)
    assert m.members[0][0].endswith(".0.attn") and m.members[-1][0].endswith(".10.attn")
    assert m.addrs == (0x4000, 0x2000, 0x3000, 0x1000)
    assert m.capacities == (13, 11, 12, 10)
    assert m.block_lens == m.strides == (BLOCK,) * 4
    assert m.region_layout().base_addrs == m.addrs  # one allocation per member here


def test_shared_allocation_is_registered_and_described_once() -> None:
    # HMA pooling: layers 0 and 2 share one tensor, 1 and 3 another. Given per
    # layer (as a kv_caches dict would), the shared allocation is merged.
    per_layer = [
        region(0xA0000, L[0]),
        region(0xB0000, L[1]),
        region(0xA0000, L[2]),
        region(0xB0000, L[3]),
    ]
    m = derive_member_layout(per_layer, 0, BS)
    assert len(m.members) == 4 and len(m.regions) == 2
    assert m.addrs == (0xA0000, 0xB0000, 0xA0000, 0xB0000)  # per member, member order
    assert m.region_layout().base_addrs == (0xA0000, 0xB0000)
    d = [region(0xD0000, L[0], L[2]), region(0xE0000, L[1], L[3])]
    route = route_remote(m, d, 0, BS)
    src, dst = build_write_descs(m.region_layout(), route.layout, [2, 3], [5, 6])
    # one descriptor per allocation (not per member) for the one run
    assert src == [(0xA0000 + 2 * BLOCK, 2 * BLOCK, 0), (0xB0000 + 2 * BLOCK, 2 * BLOCK, 0)]
    assert dst == [(0xD0000 + 5 * BLOCK, 2 * BLOCK, 0), (0xE0000 + 5 * BLOCK, 2 * BLOCK, 0)]


def test_hma_representative_layer_differs_between_p_and_d() -> None:
    # vLLM names a pooled region after the first layer it registered there: P saw
    # layer 0 first, D layer 2 (and D registered the other pool first).
    p = derive_member_layout(
        [region(0xA0000, L[0], L[2]), region(0xB0000, L[1], L[3])], 0, BS, why="pooled"
    )
    d = [region(0xE0000, L[3], L[1]), region(0xD0000, L[2], L[0])]
    route = route_remote(p, d, 0, BS)
    assert route.remote_indices == (1, 0)
    assert route.layout.base_addrs == (0xD0000, 0xE0000)
    src, dst = build_write_descs(p.region_layout(), route.layout, [1], [4])
    assert list(zip(src, dst)) == [
        ((0xA0000 + BLOCK, BLOCK, 0), (0xD0000 + 4 * BLOCK, BLOCK, 0)),
        ((0xB0000 + BLOCK, BLOCK, 0), (0xE0000 + 4 * BLOCK, BLOCK, 0)),
    ]


def test_split_k_and_v_regions_pair_part_by_part() -> None:
    # FlashAttention-like registration: each layer has a K and a V region.
    def kv(base: int, layers: Sequence[int]) -> list[Region]:
        return [region(base + i * 0x20000 + kvi * 0x10000, L[i]) for i in layers for kvi in (0, 1)]

    p = derive_member_layout(kv(0xA00000, (2, 3)), 0, BS)
    assert p.members == ((L[2], 0), (L[2], 1), (L[3], 0), (L[3], 1))
    route = route_remote(p, kv(0xD00000, (0, 1, 2, 3)), 0, BS)
    assert route.layout.base_addrs == tuple(
        0xD00000 + i * 0x20000 + kvi * 0x10000 for i in (2, 3) for kvi in (0, 1)
    )
    # A remote with joint K/V regions for these layers does not pair.
    with pytest.raises(MemberRoutingError, match=r"model.layers.2.self_attn.attn.*exactly 2"):
        route_remote(p, d_regions(), 0, BS)


# -- capacities -------------------------------------------------------------------------


def test_p_and_d_allocate_different_block_counts() -> None:
    p = p_stage(0, cap=16)
    d = d_regions(cap=256)
    route = route_remote(p, d, 0, BS)
    assert route.layout.num_blocks == 256 and p.region_layout().num_blocks == 16
    # D block ids beyond P's capacity are fine; offsets use each side's own region.
    src, dst = build_write_descs(p.region_layout(), route.layout, [15], [200])
    assert src[0] == (0xA0000 + 15 * BLOCK, BLOCK, 0)
    assert dst[0] == (0xD0000 + 200 * BLOCK, BLOCK, 0)
    with pytest.raises(DescriptorError, match="P block id out of range 0..15"):
        build_write_descs(p.region_layout(), route.layout, [16], [0])
    with pytest.raises(DescriptorError, match="D block id out of range 0..255"):
        build_write_descs(p.region_layout(), route.layout, [0], [256])


def test_each_region_bounded_by_its_own_capacity() -> None:
    # D's layer-1 region is smaller than its others: ids are bounded by the smallest
    # region this stage writes, not by D's first region.
    d = [region(0xD0000, L[0], cap=64), region(0xE0000, L[1], cap=8), *d_regions(cap=64)[2:]]
    route = route_remote(p_stage(0), d, 0, BS)
    assert route.layout.num_blocks == 8
    assert route_remote(p_stage(1), d, 0, BS).layout.num_blocks == 64
    with pytest.raises(DescriptorError, match="D block id out of range 0..7"):
        build_write_descs(p_stage(0).region_layout(), route.layout, [0], [8])


# -- invariants (S-PP-2) ----------------------------------------------------------------


def test_missing_member_fails_naming_it() -> None:
    d = [r for r in d_regions() if L[3] not in r.members]
    with pytest.raises(MemberRoutingError) as e:
        route_remote(p_stage(1), d, 0, BS, peer="decode-1 rank 0")
    assert str(e.value) == (
        f"member {L[3]!r} is advertised 0 times by decode-1 rank 0, expected exactly once"
    )


def test_member_advertised_twice_fails_naming_it() -> None:
    d = [*d_regions(), region(0xF0000, L[1])]
    with pytest.raises(MemberRoutingError, match=rf"member '{L[1]}' is advertised 2 times"):
        route_remote(p_stage(0), d, 0, BS)
    # twice within one region counts as well
    d = [region(0xD0000, L[0], L[0]), *d_regions()[1:]]
    with pytest.raises(MemberRoutingError, match=rf"member '{L[0]}' is advertised 2 times"):
        route_remote(p_stage(0), d, 0, BS)


def test_remote_without_member_metadata_fails_no_index_fallback() -> None:
    # A peer without patch 0002: same number of regions, but no names.
    d = regions_from_metadata([0xD0000, 0xE0000], [BLOCK, BLOCK], 64, [])
    with pytest.raises(MemberRoutingError) as e:
        route_remote(p_stage(0), d, 0, BS, peer="decode-1 rank 0")
    msg = str(e.value)
    assert "decode-1 rank 0 sent no region_members" in msg
    assert L[0] in msg and "stage 0" in msg and "no fallback to index routing" in msg


def test_pooling_that_differs_fails_naming_the_members() -> None:
    p = derive_member_layout([region(0xA0000, L[0], L[2]), region(0xB0000, L[1], L[3])], 0, BS)
    with pytest.raises(MemberRoutingError, match=rf"'{L[0]}' and '{L[2]}' share one region here"):
        route_remote(p, d_regions(), 0, BS)
    # ... and the other way round: D pools what P keeps apart.
    d = [region(0xD0000, L[0], L[1]), region(0xE0000, L[2]), region(0xF0000, L[3])]
    with pytest.raises(MemberRoutingError, match=rf"keeps members '{L[0]}' and '{L[1]}' in one"):
        route_remote(p_stage(0), d, 0, BS)


def test_malformed_metadata_fails() -> None:
    with pytest.raises(MemberRoutingError, match="region_members lists 1 regions"):
        regions_from_metadata([1, 2], [BLOCK, BLOCK], 4, [[L[0]]])
    with pytest.raises(MemberRoutingError, match="has no region_members"):
        derive_member_layout([region(0xA0000, L[0]), region(0xB0000)], 0, BS)
    with pytest.raises(MemberRoutingError, match="share the allocation"):
        derive_member_layout([region(0xA0000, L[0]), region(0xA0000, L[1], cap=3)], 0, BS)


# -- when, and PP stage addressing ------------------------------------------------------


def test_needs_member_routing() -> None:
    assert needs_member_routing(1, [[L[0]], [L[1]]]) is None
    assert needs_member_routing(1, [[L[0], L[0]]]) is None
    assert "2 stages" in (needs_member_routing(2, [[L[0]]]) or "")
    assert L[2] in (needs_member_routing(1, [[L[0]], [L[0], L[2]]]) or "")


def test_producer_ranks() -> None:
    assert [producer_rank(s, r, 2) for s in (0, 1) for r in (0, 1)] == [0, 1, 2, 3]
    assert producer_stage(3, 2) == (1, 1) and producer_stage(1, 1) == (1, 0)
    assert stage_ranks([1], tp_size=2, pp_size=3) == [1, 3, 5]
    with pytest.raises(ValueError):
        producer_rank(0, 2, 2)


# -- startup checks (S-PP-3) ---------------------------------------------------------------


def _config(pp: int, role: str, hybrid: bool = False) -> Any:
    from vllm.config import KVTransferConfig

    return SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlPushConnector",
            kv_role=role,
            engine_id="e",  # type: ignore[arg-type]
        ),
        model_config=SimpleNamespace(model="tiny", is_hybrid=hybrid),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
    )


def _kv_cache_config(mamba: bool) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    spec: Any = (
        MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float32,))
        if mamba
        else FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    )
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_decode_side_pp_is_refused(role: str) -> None:
    from vllm_ext.nixl_push.connector import check_parallel_support

    with pytest.raises(ValueError, match="decode-side pipeline parallelism is not implemented"):
        check_parallel_support(_config(2, role), _kv_cache_config(False))
    check_parallel_support(_config(1, role), _kv_cache_config(False))


def test_mamba_under_pp_is_refused() -> None:
    from vllm_ext.nixl_push.connector import check_parallel_support

    for cfg, kv in (
        (_config(2, "kv_producer"), _kv_cache_config(True)),
        (_config(2, "kv_producer", hybrid=True), _kv_cache_config(False)),
    ):
        with pytest.raises(ValueError, match="Mamba/SSM hybrid model.*pipeline_parallel_size=2"):
            check_parallel_support(cfg, kv)
    check_parallel_support(_config(2, "kv_producer"), _kv_cache_config(False))  # PP producer: ok


def _hybrid_kv_cache_config() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=64
    )
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=full), SimpleNamespace(kv_cache_spec=window)]
    )


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_a_hybrid_attention_decoder_starts_where_vllm_reports_failed_loads(role: str) -> None:
    """On vLLM 0.23 a failed load can be reported only as invalid block ids of one KV
    cache group: a hybrid push D would decode on KV never written, so it is refused
    with the ways out named. 0.32 and later report a failed load per request
    (``failed_recving``): the hybrid D starts. A producer, and a D with the hybrid
    manager disabled, start everywhere."""
    from vllm_ext import compat_nixl
    from vllm_ext.nixl_push.connector import check_hybrid_support

    if compat_nixl.HYBRID_RECV:
        check_hybrid_support(_config(1, role), _hybrid_kv_cache_config())
    else:
        with pytest.raises(ValueError, match="vLLM 0.32 or later.*disable-hybrid-kv-cache"):
            check_hybrid_support(_config(1, role), _hybrid_kv_cache_config())
    check_hybrid_support(_config(1, "kv_producer"), _hybrid_kv_cache_config())
    check_hybrid_support(_config(1, role), _kv_cache_config(False))
    cfg = _config(1, role)
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = True
    check_hybrid_support(cfg, _hybrid_kv_cache_config())


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_mamba_state_is_refused_with_what_to_do(role: str) -> None:
    """Mamba/SSM state is not one block per token position: push cannot pair it, on
    either side; the refusal names the ways to serve such a model."""
    from vllm_ext.nixl_push.connector import check_hybrid_support

    with pytest.raises(ValueError, match="MambaSpec.*pull-mode NixlConnector"):
        check_hybrid_support(_config(1, role), _kv_cache_config(True))
