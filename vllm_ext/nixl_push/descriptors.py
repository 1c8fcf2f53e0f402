# SPDX-License-Identifier: Apache-2.0
"""From block ids to NIXL WRITE descriptors (S-WRT-6). Pure functions, no NIXL calls.

Steps, in order (hybrid KV first picks, per KV cache group, the blocks D receives:
:func:`blocks_to_receive`):

1. :func:`expand_logical` - scheduler block ids are logical; each logical block
   is ``physical_per_logical`` kernel blocks (P and D may differ).
2. :func:`pair_blocks` - align P's physical blocks with D's by token position:
   D's first block starts at ``prefix_tokens`` (what D already had cached).
3. :func:`merge_runs` - consecutive ids on both sides collapse into one run.
4. :func:`tp_slice` - which byte slice of a block this P rank sends to which D
   rank when the two TP sizes differ (heads are outermost within a block).
5. :func:`build_write_descs` - one (addr, len, dev) per region per run, in
   region-major, address-ascending order, for both sides.

The layouts compared here come from the handshake (``NixlAgentMetadata``) on
the remote side and from KV registration on the local side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

Desc = tuple[int, int, int]  # (address, length in bytes, device id)


class DescriptorError(ValueError):
    """The two sides' layouts or block lists cannot be paired; names what differs."""


@dataclasses.dataclass(frozen=True)
class RegionLayout:
    """One engine rank's registered KV regions, as NIXL sees them.

    ``block_lens[i]`` is the byte length of one *physical* block in region ``i``
    (blocks are laid out at ``base + id * block_len``); ``num_blocks`` is the
    number of physical blocks each region holds.
    """

    base_addrs: tuple[int, ...]
    block_lens: tuple[int, ...]
    num_blocks: int
    device_id: int
    block_size: int  # tokens per physical block
    physical_per_logical: int = 1

    def __post_init__(self) -> None:
        if len(self.base_addrs) != len(self.block_lens):
            raise DescriptorError(
                f"{len(self.base_addrs)} region addresses but {len(self.block_lens)} block lengths"
            )
        if self.physical_per_logical < 1 or self.block_size < 1:
            raise DescriptorError("block_size and physical_per_logical must be >= 1")

    @property
    def num_regions(self) -> int:
        return len(self.base_addrs)


def blocks_to_receive(
    groups: Sequence[Sequence[Any]], block_sizes: Sequence[int]
) -> tuple[list[list[int]], tuple[int, ...]]:
    """D, hybrid KV (S-HYB-1): per KV cache group, the blocks P must write and the
    prompt token the first of them begins at. ``groups`` are vLLM's blocks of one
    request (``KVCacheBlocks.blocks``: one entry per block position; ``block_id``,
    ``block_hash``, ``is_null``): cached blocks (a local prefix hit) and the null block
    (positions outside a window, which vLLM never allocated) come first, then the blocks
    it allocated for the pushed KV, which are returned. Raises DescriptorError if those
    are not one run."""
    ids: list[list[int]] = []
    starts: list[int] = []
    for group, block_size in zip(groups, block_sizes, strict=True):
        first = next(
            (i for i, b in enumerate(group) if not b.is_null and b.block_hash is None),
            len(group),
        )
        tail = group[first:]
        if any(b.is_null or b.block_hash is not None for b in tail):
            raise DescriptorError(
                "a KV cache group's blocks to receive are not one run after its cached "
                f"and skipped blocks: {[b.block_id for b in group]}"
            )
        ids.append([b.block_id for b in tail])
        starts.append(first * block_size)
    return ids, tuple(starts)


def expand_logical(block_ids: Sequence[int], physical_per_logical: int) -> list[int]:
    """Logical block ``b`` -> physical ``b*r .. b*r + r-1`` (r = physical_per_logical)."""
    r = physical_per_logical
    if r == 1:
        return list(block_ids)
    return [b * r + i for b in block_ids for i in range(r)]


def pair_blocks(
    p_physical: Sequence[int],
    d_physical: Sequence[int],
    prefix_tokens: int,
    block_size: int,
    tokens: tuple[int, int | None] = (0, None),
) -> tuple[list[int], list[int]]:
    """Pair P's and D's physical blocks that hold the same tokens.

    P's blocks cover the prompt from token 0; D's cover it from
    ``prefix_tokens``. D may have allocated more blocks than the prompt fills
    (a larger logical block), P may hold one more for the sampled token: only
    the overlap is paired. ``tokens`` (``[start, end)``; end None: no end) keeps
    the pairs whose block lies wholly inside that span of P's tokens (a chunk's
    full blocks, S-PRG-1); ``start`` must be a block boundary.
    """
    if prefix_tokens % block_size:
        raise DescriptorError(
            f"D's prefix of {prefix_tokens} tokens does not end on a {block_size}-token block"
        )
    start, end = tokens
    if start % block_size or start < 0:
        raise DescriptorError(f"token {start} is not the start of a {block_size}-token block")
    first = max(prefix_tokens, start) // block_size  # P's first block position to pair
    last = len(p_physical) if end is None else min(len(p_physical), end // block_size)
    skip = prefix_tokens // block_size  # D's block i holds P's block skip + i
    n = max(0, min(last, skip + len(d_physical)) - first)
    return list(p_physical[first : first + n]), list(d_physical[first - skip : first - skip + n])


def merge_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs where both id lists advance by one."""
    if len(src) != len(dst):
        raise DescriptorError(f"{len(src)} source blocks vs {len(dst)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


@dataclasses.dataclass(frozen=True)
class TpSlice:
    """Per block: P sends ``[src_offset, src_offset+length)`` to D's ``[dst_offset, ...)``.

    Offsets are in units of 1/``parts`` of the respective side's block length.
    """

    src_part: int
    dst_part: int
    src_parts: int
    dst_parts: int


def d_ranks_for(p_rank: int, p_tp: int, d_tp: int) -> list[int]:
    """The D TP ranks that receive (part of) P rank ``p_rank``'s heads."""
    if d_tp >= p_tp:
        if d_tp % p_tp:
            raise DescriptorError(f"D tp {d_tp} is not a multiple of P tp {p_tp}")
        r = d_tp // p_tp
        return [p_rank * r + i for i in range(r)]
    if p_tp % d_tp:
        raise DescriptorError(f"P tp {p_tp} is not a multiple of D tp {d_tp}")
    return [p_rank // (p_tp // d_tp)]


def tp_slice(p_rank: int, p_tp: int, d_rank: int, d_tp: int, replicated: bool = False) -> TpSlice:
    """Which slice of each block P rank ``p_rank`` writes into D rank ``d_rank``.

    D tp > P tp: P's block holds the heads of several D ranks; send the
    ``d_rank``-th slice whole. D tp < P tp: D's block holds several P ranks'
    heads; write the whole P block into its slot. ``replicated`` (MLA, or more
    ranks than KV heads) sends whole blocks.
    """
    if d_rank not in d_ranks_for(p_rank, p_tp, d_tp):
        raise DescriptorError(f"P rank {p_rank}/{p_tp} does not serve D rank {d_rank}/{d_tp}")
    if replicated or d_tp == p_tp:
        return TpSlice(0, 0, 1, 1)
    if d_tp > p_tp:
        r = d_tp // p_tp
        return TpSlice(d_rank % r, 0, r, 1)
    r = p_tp // d_tp
    return TpSlice(0, p_rank % r, 1, r)


def build_write_descs(
    local: RegionLayout,
    remote: RegionLayout,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    tp: TpSlice = TpSlice(0, 0, 1, 1),
) -> tuple[list[Desc], list[Desc]]:
    """Local (source) and remote (destination) descriptors for one WRITE.

    Region ``i`` on P pairs with region ``i`` on D. When whole blocks move on
    both sides a run of ``n`` consecutive blocks is one descriptor of ``n``
    blocks; a TP slice of a block is not contiguous with the next block's, so
    it gets one descriptor per block.
    """
    if local.num_regions != remote.num_regions:
        raise DescriptorError(
            f"P has {local.num_regions} KV regions, D has {remote.num_regions}: "
            "the models or KV layouts differ"
        )
    for name, layout, blocks in (("P", local, src_blocks), ("D", remote, dst_blocks)):
        if blocks and (min(blocks) < 0 or max(blocks) >= layout.num_blocks):
            raise DescriptorError(
                f"{name} block id out of range 0..{layout.num_blocks - 1}: "
                f"{min(blocks)}..{max(blocks)}"
            )
    # Source-address order: the reads on P stream through memory.
    runs = sorted(merge_runs(src_blocks, dst_blocks))
    whole = tp.src_parts == 1 and tp.dst_parts == 1
    src: list[Desc] = []
    dst: list[Desc] = []
    for i in range(local.num_regions):
        s_len, d_len = local.block_lens[i], remote.block_lens[i]
        if s_len % tp.src_parts or d_len % tp.dst_parts:
            raise DescriptorError(f"region {i}: block not divisible into TP slices")
        chunk = s_len // tp.src_parts
        if chunk != d_len // tp.dst_parts:
            raise DescriptorError(
                f"region {i}: P sends {chunk} bytes per block but D's slot is "
                f"{d_len // tp.dst_parts} bytes (block sizes, dtypes or head counts differ)"
            )
        s_off, d_off = tp.src_part * chunk, tp.dst_part * chunk
        s_base, d_base = local.base_addrs[i], remote.base_addrs[i]
        for s0, d0, n in runs:
            if whole:
                src.append((s_base + s0 * s_len, n * s_len, local.device_id))
                dst.append((d_base + d0 * d_len, n * d_len, remote.device_id))
                continue
            for k in range(n):
                src.append((s_base + (s0 + k) * s_len + s_off, chunk, local.device_id))
                dst.append((d_base + (d0 + k) * d_len + d_off, chunk, remote.device_id))
    return src, dst
