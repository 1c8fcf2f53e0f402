# SPDX-License-Identifier: Apache-2.0
"""KV layouts: which local regions a WRITE reads and which remote regions it fills,
per remote engine and rank (S-WRT-6, S-PP-1, S-PP-2).

:class:`KvLayouts` is built by the worker and used from three threads:

* the engine thread sets the local (source) layout once, after vLLM registered
  the KV caches (:meth:`KvLayouts.set_local`): member-major when a PP stage or
  pooled regions need routing by layer name (members.py);
* vLLM's handshake thread records each peer's layout when it connects
  (:meth:`KvLayouts.connect`, from the worker's ``add_remote_agent``); an
  incompatible peer fails the handshake;
* the writer reads them to build a WRITE's descriptors (:meth:`KvLayouts.write_descs`).

The remote tables are guarded by a lock; the local layout is set before the
writer starts and never changes.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_ext.compat import FULL_ATTENTION_KINDS, NULL_BLOCK_ID
from vllm_ext.log import get_logger
from vllm_ext.nixl_push.descriptors import (
    Desc,
    DescriptorError,
    RegionLayout,
    build_write_descs,
    expand_logical,
    pair_blocks,
    tp_slice,
)
from vllm_ext.nixl_push.members import (
    MemberLayout,
    Region,
    derive_member_layout,
    needs_member_routing,
    regions_from_metadata,
    route_remote,
)

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

    from vllm_ext.nixl_push.metadata import PushRegMeta
    from vllm_ext.nixl_push.wire import PeerLayout, PushRegistration

logger = get_logger(__name__)

#: ``compat.kv_groups``: per KV cache group its kind, sliding window and layers
KvGroups = tuple[tuple[str, int, tuple[str, ...]], ...]


@dataclasses.dataclass(frozen=True)
class LocalKv:
    """This rank's registered KV regions, as vLLM's worker registered them."""

    base_addrs: Sequence[int]
    block_lens: Sequence[int]
    num_blocks: int
    #: layer names behind each region (patch 0002's ``region_members``; may be empty)
    region_members: Sequence[Sequence[str]]
    device_id: int
    block_size: int
    physical_per_logical: int


class KvLayouts:
    """Local and remote KV layouts of one rank (see the module docstring)."""

    def __init__(
        self,
        *,
        tp_rank: int,
        tp_size: int,
        pp_size: int,
        producer: bool,
        replicated_kv: bool,
        total_kv_heads: int,
        backend_name: str = "this attention backend",
        kv_groups: KvGroups = (),
    ) -> None:
        #: this engine's KV cache groups (``compat.kv_groups``), as its layout announces
        self.kv_groups = kv_groups
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.producer = producer
        #: MLA: every rank holds all of the KV (a WRITE sends whole blocks)
        self.replicated_kv = replicated_kv
        self.total_kv_heads = total_kv_heads
        self.backend_name = backend_name
        self.local: RegionLayout | None = None
        self.member_layout: MemberLayout | None = None
        self._local_regions: tuple[Region, ...] = ()
        self._lock = threading.Lock()
        self._remote: dict[tuple[str, int], RegionLayout] = {}
        # Layer names each remote rank advertised (region_members), by (engine, rank).
        self._remote_members: dict[tuple[str, int], frozenset[str]] = {}
        # Each connected engine's layout, as its side channel announced it (S-LEG-5).
        self._announced: dict[str, PeerLayout] = {}

    # -- local ---------------------------------------------------------------------------
    def set_local(self, kv: LocalKv) -> RegionLayout:
        """This rank's source layout, derived once."""
        self._local_regions = regions_from_metadata(
            kv.base_addrs, kv.block_lens, kv.num_blocks, kv.region_members, "this engine"
        )
        # Only a producer routes its regions by member; a consumer checks each P rank's
        # members against its own at the handshake (``_remote_layout``): a PP stage of P
        # holds some of D's layers only, pooled (hybrid) regions or not.
        why = needs_member_routing(self.pp_size, kv.region_members) if self.producer else None
        if why is not None:
            # Member-major layout, derived once: one source layout for every remote.
            self.member_layout = derive_member_layout(
                regions_from_metadata(
                    kv.base_addrs, kv.block_lens, kv.num_blocks, kv.region_members, "local"
                ),
                device_id=kv.device_id,
                block_size=kv.block_size,
                physical_per_logical=kv.physical_per_logical,
                why=why,
            )
            self.local = self.member_layout.region_layout()
            logger.info(
                "push: routing KV by layer (%s): %d members in %d regions",
                why, len(self.member_layout.members), len(self.member_layout.regions),
            )  # fmt: skip
        else:
            self.local = RegionLayout(
                base_addrs=tuple(kv.base_addrs),
                block_lens=tuple(kv.block_lens),
                num_blocks=kv.num_blocks,
                device_id=kv.device_id,
                block_size=kv.block_size,
                physical_per_logical=kv.physical_per_logical,
            )
        return self.local

    @property
    def local_members(self) -> frozenset[str]:
        return frozenset(name for r in self._local_regions for name in r.members)

    # -- remote (handshake thread) -------------------------------------------------------------
    def connect(
        self, meta: NixlAgentMetadata, remote_rank: int, remote_tp_size: int, split_kv: bool
    ) -> RegionLayout:
        """Record a peer rank's layout; raise if it cannot exchange KV with this rank.

        ``split_kv``: this rank's blocks interleave K and V (vLLM's
        ``virtually_split_kv_in_blocks``), so heterogeneous TP cannot slice them.
        """
        remote, by_member = self._remote_layout(meta, remote_rank)
        self._check_compatible(meta.engine_id, remote, remote_tp_size, by_member, split_kv)
        with self._lock:
            self._remote[(meta.engine_id, remote_rank)] = remote
        logger.info(
            "push: connected %s rank %d/%d (%d regions, %d blocks of %d tokens)",
            meta.engine_id, remote_rank, remote_tp_size, remote.num_regions,
            remote.num_blocks, remote.block_size,
        )  # fmt: skip
        return remote

    def announce(self, layout: PeerLayout) -> None:
        """A peer's handshake succeeded: its layout as its side channel announced it."""
        with self._lock:
            self._announced[layout.engine_id] = layout

    def announced(self, engine_id: str) -> PeerLayout | None:
        with self._lock:
            return self._announced.get(engine_id)

    def forget(self, engine_id: str) -> None:
        """Drop every rank of ``engine_id`` (a peer that restarts is connected anew)."""
        with self._lock:
            self._announced.pop(engine_id, None)
            for key in [k for k in self._remote if k[0] == engine_id]:
                del self._remote[key]
            for key in [k for k in self._remote_members if k[0] == engine_id]:
                del self._remote_members[key]

    def remote(self, engine_id: str, rank: int) -> RegionLayout | None:
        with self._lock:
            return self._remote.get((engine_id, rank))

    def members_of(self, engine_id: str, rank: int) -> frozenset[str]:
        with self._lock:
            return self._remote_members.get((engine_id, rank), frozenset())

    def _remote_layout(
        self, meta: NixlAgentMetadata, remote_rank: int
    ) -> tuple[RegionLayout, bool]:
        """The remote rank's regions, and whether they pair with ours by layer name.

        A producer with a member layout selects and reorders the remote regions
        holding its members, paired index-by-index with the local layout (S-PP-1/2).
        A consumer checks, by name, that it holds each layer the producer rank
        advertises exactly once (a PP stage holds only some), so a mismatch fails
        D's handshake instead of the WRITE.
        """
        peer = f"{meta.engine_id} rank {remote_rank}"
        regions = regions_from_metadata(
            meta.kv_caches_base_addr, meta.block_lens, meta.num_blocks,
            getattr(meta, "region_members", None), peer,
        )  # fmt: skip
        with self._lock:
            self._remote_members[(meta.engine_id, remote_rank)] = frozenset(
                name for r in regions for name in r.members
            )
        ppl = meta.physical_blocks_per_logical_kv_block
        if self.member_layout is not None:
            route = route_remote(
                self.member_layout, regions, meta.device_id, meta.block_size, ppl, peer
            )
            return route.layout, True
        assert self.local is not None
        if (
            not self.producer
            and any(r.members for r in regions)
            and any(r.members for r in self._local_regions)
        ):
            stage = derive_member_layout(regions, meta.device_id, meta.block_size, ppl, who=peer)
            route_remote(
                stage, self._local_regions, self.local.device_id, self.local.block_size,
                peer="this engine (D)",
            )  # fmt: skip
            return stage.region_layout(), True
        layout = RegionLayout(
            base_addrs=tuple(meta.kv_caches_base_addr),
            block_lens=tuple(meta.block_lens),
            num_blocks=meta.num_blocks,
            device_id=meta.device_id,
            block_size=meta.block_size,
            physical_per_logical=ppl,
        )
        return layout, False

    def _check_compatible(
        self,
        engine_id: str,
        remote: RegionLayout,
        remote_tp: int,
        by_member: bool,
        split_kv: bool,
    ) -> None:
        local = self.local
        assert local is not None
        if remote.num_regions != local.num_regions and not by_member:
            raise RuntimeError(
                f"push: {engine_id} registers {remote.num_regions} KV regions, this engine "
                f"{local.num_regions}: different models, layouts or pipeline stages"
            )
        if remote.block_size != local.block_size:
            raise RuntimeError(
                f"push: {engine_id} has {remote.block_size}-token physical blocks, this engine "
                f"{local.block_size}; use the same kernel block size on P and D"
            )
        if remote_tp != self.tp_size and split_kv:
            raise RuntimeError(
                "push: heterogeneous TP needs a heads-outermost block layout (HND); "
                f"{self.backend_name} interleaves K and V within a block"
            )

    # -- a WRITE (writer thread) ---------------------------------------------------------------
    def write_descs(
        self,
        block_ids: Sequence[Sequence[int]],
        reg: PushRegistration,
        tokens: tuple[int, int | None] = (0, None),
        remote: RegionLayout | None = None,
    ) -> tuple[list[Desc], list[Desc]]:
        """Source and destination descriptors for writing P's ``block_ids`` (logical,
        per KV cache group) into the blocks ``reg`` registered: the physical blocks
        that lie wholly inside the prompt tokens ``tokens`` (``[start, end)``, end
        None: to the last block; start on a block boundary), into D's layout ``remote``
        (None: the one P has now for D's engine and rank). Raises DescriptorError."""
        local = self.local
        remote = remote or self.remote(reg.engine_id, reg.tp_rank)
        assert local is not None
        if remote is None:
            raise DescriptorError(f"no layout for D {reg.engine_id} rank {reg.tp_rank}")
        announced = self.announced(reg.engine_id)
        if announced is None or announced.tp_size != reg.tp_size:  # S-LEG-5
            raise DescriptorError(
                f"the PUSH_REG says tp_size={reg.tp_size}, D {reg.engine_id} announces "
                f"{announced.tp_size if announced else 'no layout'}"
            )
        if reg.block_size != local.block_size:
            raise DescriptorError(
                f"D's physical block is {reg.block_size} tokens, P's {local.block_size}"
            )
        staged = self.pp_size > 1  # this worker holds its stage's layers
        if (problem := groups_mismatch(self.kv_groups, announced.kv_groups, staged)) is not None:
            raise DescriptorError(problem)  # S-HYB-1: from the handshake, not the leg
        if len(reg.block_ids) != len(block_ids) and reg.num_blocks:
            raise DescriptorError(
                f"D sent {len(reg.block_ids)} KV cache groups, P has {len(block_ids)}"
            )
        src: list[int] = []
        dst: list[int] = []
        for g, (p_group, d_group) in enumerate(zip(block_ids, reg.block_ids)):
            s, d = pair_blocks(
                expand_logical(p_group, local.physical_per_logical),
                expand_logical(d_group, remote.physical_per_logical),
                reg.start_of(g),
                local.block_size,
                tokens,
            )
            # S-SAFE-1 for groups: the null block stands for a position a group does not
            # hold (a sliding window's freed block on P, a skipped one on D); a WRITE
            # never reads nor fills it, and a block D needs that P freed fails the request.
            if any(b // local.physical_per_logical == NULL_BLOCK_ID for b in s):
                raise DescriptorError(
                    f"KV cache group {g}: P no longer holds a block D needs (the null "
                    f"block at a position from token {reg.start_of(g)} on)"
                )
            if any(b // remote.physical_per_logical == NULL_BLOCK_ID for b in d):
                raise DescriptorError(f"KV cache group {g}: D registered the null block")
            src += s
            dst += d
        replicated = self.replicated_kv or max(self.tp_size, reg.tp_size) > self.total_kv_heads
        tp = tp_slice(self.tp_rank, self.tp_size, reg.tp_rank, reg.tp_size, replicated)
        return build_write_descs(local, remote, src, dst, tp)


def groups_mismatch(local: KvGroups, announced: KvGroups, staged: bool = False) -> str | None:
    """The KV cache groups of this engine against those a peer announced in its
    handshake (S-HYB-1): P writes group ``g`` of each layer into D's blocks of group
    ``g``, so both must have the same groups (kind, window, layers) in the same order.
    A peer that announces none (an older vllm-ext) pairs only with one group of full
    attention. ``staged``: one side is pipeline-parallel, whose groups list the layers
    of one stage only (a stage worker's, or its engine's, which vLLM's scheduler takes
    from the first stage): there one side's layers of a group must be among the other's.
    The problem, or None."""
    if local == announced:
        return None
    if staged and _same_groups_staged(local, announced):
        return None
    if not announced and len(local) <= 1 and all(k in FULL_ATTENTION_KINDS for k, _, _ in local):
        return None
    if not announced:
        return (
            f"this engine has {len(local)} KV cache group(s) ({_kinds(local)}) and the peer "
            "announces none (an older vllm-ext): run the same vllm-ext release on P and D"
        )
    return (
        f"KV cache groups differ: this engine has {_kinds(local)}, the peer {_kinds(announced)} "
        "(same model, same --disable-hybrid-kv-cache-manager setting on P and D)"
    )


def _same_groups_staged(local: KvGroups, announced: KvGroups) -> bool:
    """Same kinds and windows in the same order, each group's layers on one side among
    the other side's (a pipeline stage holds some of the model's layers)."""
    if len(local) != len(announced):
        return False
    for (kind, window, layers), (p_kind, p_window, p_layers) in zip(local, announced):
        mine, theirs = set(layers), set(p_layers)
        if (kind, window) != (p_kind, p_window) or not (mine <= theirs or theirs <= mine):
            return False
    return True


def _kinds(groups: KvGroups) -> str:
    return ", ".join(f"{k}({w})[{len(layers)} layers]" if w else f"{k}[{len(layers)} layers]"
                     for k, w, layers in groups) or "none"  # fmt: skip


def leg_mismatch(
    meta: PushRegMeta, announced: PeerLayout | None, local_groups: KvGroups = ()
) -> str | None:
    """D: the D leg's ``tp_size`` and ``pp_size`` against the layout P announced in its
    handshake (S-LEG-5), and this engine's KV cache groups against P's (S-HYB-1: a
    registration with ``group_starts`` goes only to a P that reads it); the problem,
    or None if they agree."""
    if announced is None:
        return f"P {meta.p_engine_id} is not connected"
    staged = announced.pp_size > 1
    if (problem := groups_mismatch(local_groups, announced.kv_groups, staged)) is not None:
        return f"P {meta.p_engine_id}: {problem}"
    if meta.p_tp_size != announced.tp_size:
        return (
            f"the D leg's kv_transfer_params say tp_size={meta.p_tp_size}, but P "
            f"{meta.p_engine_id} announces tensor parallel size {announced.tp_size} "
            "(tell the proxy P's TP size: --p-tp-size)"
        )
    if meta.p_pp_size != announced.pp_size:
        return (
            f"kv_transfer_params pp_size={meta.p_pp_size}, but P {meta.p_engine_id} has "
            f"{announced.pp_size} pipeline stage(s)"
        )
    return None
