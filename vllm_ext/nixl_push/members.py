# SPDX-License-Identifier: Apache-2.0
"""Member routing: pair KV regions by layer identity instead of by index (S-PP-1, S-PP-2).

Pure functions and small dataclasses, no NIXL calls. Index routing (region ``i``
on P writes region ``i`` on D) breaks when

* P is pipeline-parallel: a stage registers only its own layers, D all of them;
* the hybrid allocator pools several layers in one tensor (HMA): a region has
  several *members*, and which one vLLM saw first (and which order the regions
  were registered in) may differ between P and D.

Every worker advertises the layer names behind each region
(``NixlAgentMetadata.region_members``, patch 0002). A producer that needs member
routing derives a member-major :class:`MemberLayout` once, at KV registration:
its members in a canonical order (natural sort of the layer name, then the
part: K before V where K and V are separate regions), each member's address,
block length, stride and region capacity in that order, and the distinct
physical allocations behind them (an allocation shared by several members
appears, and is described, once). :meth:`MemberLayout.region_layout` is the
one local source layout used for every remote engine and rank.

At each handshake :func:`route_remote` selects, from the remote's advertised
regions, exactly the ones that hold this stage's members and orders them like
the local regions; remote-only members (other PP stages) are ignored. The
result is a :class:`~vllm_ext.nixl_push.descriptors.RegionLayout` paired
index-by-index with the local one, so :func:`build_write_descs` needs no
change. Descriptors are addresses (``base + block * stride`` of the member's own
region) and each side's block ids are bounded by its own regions' capacities,
so P and D need not allocate the same number of blocks.

Invariants, raised as :class:`MemberRoutingError` (the handshake fails, the
message names the member): a locally owned member that the remote does not
advertise exactly once (exactly as many times as here when K and V are separate
regions); a remote without member metadata when member routing is needed (no
fallback to index routing); members that share one allocation on one side but
not on the other (the KV pooling differs: a whole-region WRITE would put one
layer's KV into another's blocks).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict
from collections.abc import Sequence

from vllm_ext.nixl_push.descriptors import DescriptorError, RegionLayout

#: ``(layer name, part)``. ``part`` is the layer's occurrence among the regions
#: that list it, in registration order: 0 for the single region of a joint K/V
#: layout; 0 (K) and 1 (V) where K and V are registered as separate regions.
MemberKey = tuple[str, int]


class MemberRoutingError(DescriptorError):
    """The two sides' ``region_members`` cannot be paired; fails the handshake."""


@dataclasses.dataclass(frozen=True)
class Region:
    """One registered NIXL region: a physical allocation and the layers it holds."""

    addr: int
    block_len: int  # bytes of one block (what a WRITE moves per block)
    stride: int  # bytes from one block to the next
    capacity: int  # blocks in this region
    members: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.block_len <= 0 or self.stride < self.block_len or self.capacity < 0:
            raise MemberRoutingError(
                f"region at {self.addr:#x}: block_len={self.block_len} stride={self.stride} "
                f"capacity={self.capacity} is not a valid block layout"
            )


def regions_from_metadata(
    base_addrs: Sequence[int],
    block_lens: Sequence[int],
    capacity: int | Sequence[int],
    region_members: Sequence[Sequence[str]] | None,
    who: str = "remote",
) -> tuple[Region, ...]:
    """Regions as a worker registers / advertises them (``NixlAgentMetadata`` fields).

    ``region_members`` may be empty (a peer without patch 0002): the regions then
    have no members and cannot be routed to.
    """
    n = len(base_addrs)
    if len(block_lens) != n:
        raise MemberRoutingError(f"{who}: {n} region addresses but {len(block_lens)} block lengths")
    caps = (capacity,) * n if isinstance(capacity, int) else tuple(capacity)
    if len(caps) != n:
        raise MemberRoutingError(f"{who}: {n} region addresses but {len(caps)} capacities")
    members: Sequence[Sequence[str]] = region_members or [()] * n
    if len(members) != n:
        raise MemberRoutingError(
            f"{who}: region_members lists {len(members)} regions, kv_caches_base_addr {n}"
        )
    return tuple(
        Region(addr=a, block_len=bl, stride=bl, capacity=c, members=tuple(m))
        for a, bl, c, m in zip(base_addrs, block_lens, caps, members)
    )


def natural_key(name: str) -> tuple[str | int, ...]:
    """``model.layers.10.x`` sorts after ``model.layers.9.x``."""
    return tuple(int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", name)))


def member_sort_key(key: MemberKey) -> tuple[tuple[str | int, ...], int]:
    return natural_key(key[0]), key[1]


def needs_member_routing(pp_size: int, region_members: Sequence[Sequence[str]]) -> str | None:
    """Why this producer must route by member (None: index routing is exact)."""
    if pp_size > 1:
        return f"pipeline-parallel producer ({pp_size} stages)"
    pooled = [m for m in region_members if len(set(m)) > 1]
    if pooled:
        return f"KV regions shared by several layers (e.g. {list(pooled[0])})"
    return None


@dataclasses.dataclass(frozen=True)
class MemberLayout:
    """One rank's regions in member-major order. Derived once, at KV registration."""

    #: Members in canonical order.
    members: tuple[MemberKey, ...]
    #: For each member (same order): index into :attr:`regions`.
    member_region: tuple[int, ...]
    #: Distinct physical allocations, in order of their first member.
    regions: tuple[Region, ...]
    device_id: int
    block_size: int
    physical_per_logical: int = 1
    #: Why member routing is used (for messages).
    why: str = ""

    # Per-member views, in member order.
    @property
    def addrs(self) -> tuple[int, ...]:
        return tuple(self.regions[i].addr for i in self.member_region)

    @property
    def block_lens(self) -> tuple[int, ...]:
        return tuple(self.regions[i].block_len for i in self.member_region)

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(self.regions[i].stride for i in self.member_region)

    @property
    def capacities(self) -> tuple[int, ...]:
        return tuple(self.regions[i].capacity for i in self.member_region)

    def parts(self) -> dict[str, int]:
        """Layer name -> number of regions holding it here (1, or 2 for split K/V)."""
        return dict(Counter(name for name, _ in self.members))

    def region_layout(self) -> RegionLayout:
        """The local source layout: one entry per distinct allocation, in member order."""
        return _as_region_layout(
            self.regions, self.device_id, self.block_size, self.physical_per_logical
        )


def _as_region_layout(
    regions: Sequence[Region], device_id: int, block_size: int, physical_per_logical: int
) -> RegionLayout:
    for r in regions:
        if r.stride != r.block_len:
            # build_write_descs addresses block b at base + b * block_len.
            raise MemberRoutingError(
                f"region of {list(r.members)}: blocks are {r.block_len} bytes every {r.stride}; "
                "only contiguous blocks are supported"
            )
    return RegionLayout(
        base_addrs=tuple(r.addr for r in regions),
        block_lens=tuple(r.block_len for r in regions),
        # Every block id goes to every region: bounded by the smallest region.
        num_blocks=min((r.capacity for r in regions), default=0),
        device_id=device_id,
        block_size=block_size,
        physical_per_logical=physical_per_logical,
    )


def _merge_shared(regions: Sequence[Region], who: str) -> tuple[list[Region], list[int]]:
    """Merge entries that are the same allocation; returns the regions and, per
    input entry, its merged index."""
    merged: list[Region] = []
    by_addr: dict[int, int] = {}
    index: list[int] = []
    for r in regions:
        j = by_addr.get(r.addr)
        if j is None:
            by_addr[r.addr] = len(merged)
            index.append(len(merged))
            merged.append(r)
            continue
        m = merged[j]
        if (m.block_len, m.stride, m.capacity) != (r.block_len, r.stride, r.capacity):
            raise MemberRoutingError(
                f"{who}: members {list(m.members)} and {list(r.members)} share the allocation "
                f"at {r.addr:#x} with different block lengths, strides or capacities"
            )
        extra = tuple(n for n in r.members if n not in m.members)
        merged[j] = dataclasses.replace(m, members=m.members + extra)
        index.append(j)
    return merged, index


def _occurrences(regions: Sequence[Region]) -> dict[str, list[int]]:
    """Layer name -> indices of the regions listing it, in registration order."""
    occ: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(regions):
        for name in r.members:
            occ[name].append(i)
    return occ


def derive_member_layout(
    regions: Sequence[Region],
    device_id: int,
    block_size: int,
    physical_per_logical: int = 1,
    why: str = "",
    who: str = "local",
) -> MemberLayout:
    """The member-major layout of registered ``regions`` (done once, at registration)."""
    merged, _ = _merge_shared(regions, who)
    for r in merged:
        if not r.members:
            raise MemberRoutingError(
                f"{who}: region at {r.addr:#x} has no region_members; member routing needs "
                "the layer names behind every region (vLLM patch 0002)"
            )
    keyed: list[tuple[MemberKey, int]] = []
    for name, idxs in _occurrences(merged).items():
        keyed += [((name, part), i) for part, i in enumerate(idxs)]
    keyed.sort(key=lambda kv: member_sort_key(kv[0]))
    # Distinct allocations in order of their first member.
    order: dict[int, int] = {}
    for _, i in keyed:
        order.setdefault(i, len(order))
    return MemberLayout(
        members=tuple(k for k, _ in keyed),
        member_region=tuple(order[i] for _, i in keyed),
        regions=tuple(merged[i] for i in sorted(order, key=order.__getitem__)),
        device_id=device_id,
        block_size=block_size,
        physical_per_logical=physical_per_logical,
        why=why,
    )


@dataclasses.dataclass(frozen=True)
class RemoteRoute:
    """A remote rank's regions selected and ordered to pair with the local layout."""

    #: Paired index-by-index with ``local.region_layout()``.
    layout: RegionLayout
    #: For each local allocation: the index of the remote region (as advertised).
    remote_indices: tuple[int, ...]


def route_remote(
    local: MemberLayout,
    remote_regions: Sequence[Region],
    device_id: int,
    block_size: int,
    physical_per_logical: int = 1,
    peer: str = "the remote",
) -> RemoteRoute:
    """Select and reorder the remote regions holding the local members (S-PP-1/2).

    Raises :class:`MemberRoutingError` naming the member when the invariants do
    not hold. Remote regions holding only remote-only members are skipped.
    """
    if not any(r.members for r in remote_regions):
        first = local.members[0][0] if local.members else "?"
        raise MemberRoutingError(
            f"{peer} sent no region_members, but this engine routes KV by layer "
            f"({local.why or 'member routing'}) and cannot place member {first!r}; "
            "there is no fallback to index routing: run both sides with vLLM patch 0002"
        )
    merged, _ = _merge_shared(remote_regions, peer)
    occ = _occurrences(merged)
    for name, parts in local.parts().items():
        found = len(occ.get(name, ()))
        if found != parts:
            expected = "exactly once" if parts == 1 else f"exactly {parts} times (K and V)"
            raise MemberRoutingError(
                f"member {name!r} is advertised {found} times by {peer}, expected {expected}"
            )
    # Local allocation -> remote region, checked both ways.
    chosen: dict[int, int] = {}
    by_remote: dict[int, tuple[int, str]] = {}
    for (name, part), li in zip(local.members, local.member_region):
        ri = occ[name][part]
        prev = chosen.setdefault(li, ri)
        if prev != ri:
            other = next(n for (n, _), j in zip(local.members, local.member_region) if j == li)
            raise MemberRoutingError(
                f"members {other!r} and {name!r} share one region here, but {peer} keeps them "
                f"in different regions ({prev} and {ri}): the KV pooling differs"
            )
        owner = by_remote.setdefault(ri, (li, name))
        if owner[0] != li:
            raise MemberRoutingError(
                f"{peer} keeps members {owner[1]!r} and {name!r} in one region ({ri}), but they "
                "are separate regions here: the KV pooling differs"
            )
    indices = tuple(chosen[li] for li in range(len(local.regions)))
    return RemoteRoute(
        layout=_as_region_layout(
            [merged[i] for i in indices], device_id, block_size, physical_per_logical
        ),
        remote_indices=indices,
    )


# -- PP stage addressing -----------------------------------------------------------------
# vLLM's engine core collects handshake metadata per (pp_rank, tp_rank); its side
# channel serves one metadata blob per integer rank. A push producer serves stage
# ``s`` rank ``r`` as ``s * tp_size + r`` (== ``r`` when pp_size is 1).


def producer_rank(pp_rank: int, tp_rank: int, tp_size: int) -> int:
    """The side-channel rank of PP stage ``pp_rank``, TP rank ``tp_rank``."""
    if not (0 <= tp_rank < tp_size and pp_rank >= 0):
        raise ValueError(f"pp_rank={pp_rank} tp_rank={tp_rank} tp_size={tp_size}")
    return pp_rank * tp_size + tp_rank


def producer_stage(rank: int, tp_size: int) -> tuple[int, int]:
    """Side-channel rank -> (pp stage, tp rank)."""
    return divmod(rank, tp_size)


def stage_ranks(tp_ranks: Sequence[int], tp_size: int, pp_size: int) -> list[int]:
    """The side-channel ranks of ``tp_ranks`` in every stage, stage-major."""
    return [producer_rank(s, r, tp_size) for s in range(pp_size) for r in tp_ranks]
