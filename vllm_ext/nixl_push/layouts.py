# SPDX-License-Identifier: Apache-2.0
"""Worker side of KV layouts: which local regions a WRITE reads and which remote
regions it fills, per remote engine and rank, and the handshakes that learn them.

``PushLayoutsMixin`` is a base of ``NixlPushConnectorWorker`` (worker.py):

* ``_init_local_layout`` (after vLLM registered the KV caches): this rank's
  source layout, member-major when a PP stage or pooled regions need routing by
  layer name (members.py, S-PP-1/2);
* ``add_remote_agent`` (handshake thread): connect a peer and record its layout
  instead of preparing pull READ lists; incompatible peers fail the handshake;
* ``_nixl_handshake`` (D): connect every pipeline stage of a producer, which
  serves stage ``s`` rank ``r`` as side-channel rank ``s * tp + r``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.utils import EngineTransferInfo

from vllm_ext.log import get_logger
from vllm_ext.nixl_push.descriptors import RegionLayout
from vllm_ext.nixl_push.members import (
    MemberLayout,
    Region,
    derive_member_layout,
    natural_key,
    needs_member_routing,
    producer_stage,
    regions_from_metadata,
    route_remote,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

    from vllm_ext.nixl_push.metadata import PushRegMeta

    _WorkerBase = NixlConnectorWorker  # what the mixin is mixed into, for the type checker
else:
    _WorkerBase = object

logger = get_logger(__name__)


class PushLayoutsMixin(_WorkerBase):
    """Layouts and handshakes of a push worker; mixed into a ``NixlConnectorWorker``."""

    def _init_layouts(self, vllm_config: VllmConfig) -> None:
        self.local_layout: RegionLayout | None = None
        self._remote_layouts: dict[tuple[str, int], RegionLayout] = {}
        # PP / hybrid KV (members.py): set when this producer routes by layer name.
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.member_layout: MemberLayout | None = None
        # Layer names each remote rank advertised (region_members), by (engine, rank).
        self._remote_members: dict[tuple[str, int], frozenset[str]] = {}
        # The PP stage vLLM's _nixl_handshake is querying (handshake thread).
        self._handshake_stage = threading.local()

    def _init_local_layout(self) -> None:
        """After vLLM registered the KV caches: this rank's source layout, once."""
        assert self.transfer_topo is not None
        self._stage_aware_handshake_targets()
        base_addrs = self.kv_caches_base_addr[self.engine_id][self.tp_rank]
        region_members: list[list[str]] = getattr(self, "region_members", [])  # patch 0002
        why = needs_member_routing(self.pp_size, region_members)
        if why is not None:
            # Member-major layout, derived once: one source layout for every remote.
            self.member_layout = derive_member_layout(
                regions_from_metadata(
                    base_addrs, self.block_len_per_layer, self.num_blocks, region_members, "local"
                ),
                device_id=self.device_id,
                block_size=self.block_size,
                physical_per_logical=self._physical_blocks_per_logical_kv_block,
                why=why,
            )
            self.local_layout = self.member_layout.region_layout()
            logger.info(
                "push: routing KV by layer (%s): %d members in %d regions",
                why, len(self.member_layout.members), len(self.member_layout.regions),
            )  # fmt: skip
        else:
            self.local_layout = RegionLayout(
                base_addrs=tuple(base_addrs),
                block_lens=tuple(self.block_len_per_layer),
                num_blocks=self.num_blocks,
                device_id=self.device_id,
                block_size=self.block_size,
                physical_per_logical=self._physical_blocks_per_logical_kv_block,
            )

    def add_remote_agent(
        self, nixl_agent_meta: NixlAgentMetadata, remote_tp_rank: int = 0, remote_tp_size: int = 1
    ) -> str:
        """Handshake thread: connect the peer and record its layout (no READ lists)."""
        engine_id = nixl_agent_meta.engine_id
        if remote_tp_rank in self._remote_agents.get(engine_id, {}):
            return self._remote_agents[engine_id][remote_tp_rank]
        assert self.transfer_topo is not None and self.local_layout is not None
        remote, by_member = self._remote_layout(nixl_agent_meta, remote_tp_rank)
        self._check_compatible(engine_id, remote, remote_tp_size, by_member)
        self.transfer_topo.register_remote_engine(
            engine_id,
            EngineTransferInfo(
                remote_tp_size=remote_tp_size,
                remote_block_size=nixl_agent_meta.block_size,
                remote_block_len=nixl_agent_meta.block_lens[0],
                remote_physical_blocks_per_logical=remote.physical_per_logical,
                remote_pp_rank=producer_stage(remote_tp_rank, remote_tp_size)[0],
            ),
        )
        name = self.nixl_wrapper.add_remote_agent(nixl_agent_meta.agent_metadata)
        self.dst_num_blocks.setdefault(engine_id, nixl_agent_meta.num_blocks)
        self.kv_caches_base_addr[engine_id][remote_tp_rank] = list(remote.base_addrs)
        self._remote_layouts[(engine_id, remote_tp_rank)] = remote
        logger.info(
            "push: connected %s rank %d/%d (%d regions, %d blocks of %d tokens)",
            engine_id, remote_tp_rank, remote_tp_size, remote.num_regions,
            remote.num_blocks, remote.block_size,
        )  # fmt: skip
        return name

    # -- PP and hybrid KV (members.py) ----------------------------------------------------
    def _local_regions(self) -> tuple[Region, ...]:
        return regions_from_metadata(
            self.kv_caches_base_addr[self.engine_id][self.tp_rank],
            self.block_len_per_layer, self.num_blocks,
            getattr(self, "region_members", None), "this engine",
        )  # fmt: skip

    def _remote_layout(
        self, meta: NixlAgentMetadata, remote_rank: int
    ) -> tuple[RegionLayout, bool]:
        """The remote rank's regions, and whether they pair with ours by layer name.

        A producer with a member layout selects and reorders the remote regions
        holding its members, paired index-by-index with ``self.local_layout``
        (S-PP-1/2). A consumer checks, by name, that it holds each layer the
        producer rank advertises exactly once (a PP stage holds only some), so a
        mismatch fails D's handshake instead of the WRITE.
        """
        peer = f"{meta.engine_id} rank {remote_rank}"
        regions = regions_from_metadata(
            meta.kv_caches_base_addr, meta.block_lens, meta.num_blocks,
            getattr(meta, "region_members", None), peer,
        )  # fmt: skip
        self._remote_members[(meta.engine_id, remote_rank)] = frozenset(
            name for r in regions for name in r.members
        )
        ppl = meta.physical_blocks_per_logical_kv_block
        if self.member_layout is not None:
            route = route_remote(
                self.member_layout, regions, meta.device_id, meta.block_size, ppl, peer
            )
            return route.layout, True
        local = self._local_regions()
        if (
            not self.kv_transfer_config.is_kv_producer
            and any(r.members for r in regions)
            and any(r.members for r in local)
        ):
            stage = derive_member_layout(regions, meta.device_id, meta.block_size, ppl, who=peer)
            route_remote(stage, local, self.device_id, self.block_size, peer="this engine (D)")
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

    def _stage_aware_handshake_targets(self) -> None:
        """Let vLLM's ``_nixl_handshake`` query one PP stage of a producer at a time.

        A push producer's side channel serves stage ``s`` rank ``r`` as rank
        ``s * tp_size + r`` (``members.producer_rank``). vLLM's handshake asks for
        the ranks ``transfer_topo.handshake_target_ranks`` names; while
        :meth:`_nixl_handshake` queries stage ``s`` (a thread-local of the
        handshake thread) they are offset into that stage.
        """
        topo = self.transfer_topo
        assert topo is not None
        targets = topo.handshake_target_ranks
        local = self._handshake_stage

        def stage_targets(remote_tp_size: int) -> list[int]:
            offset = getattr(local, "stage", 0) * remote_tp_size
            return [offset + r for r in targets(remote_tp_size)]

        topo.handshake_target_ranks = stage_targets  # type: ignore[method-assign]

    def _nixl_handshake(
        self, host: str, port: int, remote_tp_size: int, expected_engine_id: str
    ) -> dict[int, str]:
        """D: connect every pipeline stage of the producer (agents by side-channel rank).

        D learns P's stages from P itself, not from the request: it walks stage
        0, 1, ... until the stages together advertise every layer D holds. A D
        leg's ``pp_size`` is checked against that (``stage_mismatch``), so a
        wrong one fails only its own request. Without member metadata on either
        side there is one stage, as before.
        """
        if self.kv_transfer_config.is_kv_producer:
            return super()._nixl_handshake(host, port, remote_tp_size, expected_engine_id)
        missing = {n for m in getattr(self, "region_members", []) for n in m}
        seen: set[str] = set()
        agents: dict[int, str] = {}
        stage = 0
        while True:
            self._handshake_stage.stage = stage
            try:
                got = super()._nixl_handshake(host, port, remote_tp_size, expected_engine_id)
            except Exception as e:
                if stage == 0:
                    raise
                raise RuntimeError(
                    f"push: P {expected_engine_id}'s pipeline stages 0..{stage - 1} hold no KV "
                    f"for {sorted(missing, key=natural_key)[:4]}, and stage {stage} did not "
                    f"answer the handshake: {e}"
                ) from e
            finally:
                self._handshake_stage.stage = 0
            agents.update(got)
            held = set().union(
                *(self._remote_members.get((expected_engine_id, r), ()) for r in got)
            )
            if held & seen:
                raise RuntimeError(
                    f"push: stage {stage} of P {expected_engine_id} holds layers an earlier "
                    f"stage holds too: {sorted(held & seen, key=natural_key)[:4]}"
                )
            seen |= held
            missing -= held
            if not held or not missing:
                return agents
            stage += 1

    def stage_mismatch(self, meta: PushRegMeta, agents: dict[int, str]) -> str | None:
        """D (writer thread): the D leg's ``pp_size`` against the stages P really has."""
        stages = {producer_stage(r, meta.p_tp_size)[0] for r in agents}
        if len(stages) == meta.p_pp_size:
            return None
        return (
            f"kv_transfer_params pp_size={meta.p_pp_size}, but P {meta.p_engine_id} has "
            f"{len(stages)} pipeline stage(s)"
        )

    def _check_compatible(
        self, engine_id: str, remote: RegionLayout, remote_tp: int, by_member: bool = False
    ) -> None:
        local = self.local_layout
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
        if remote_tp != self.world_size and self.transfer_topo.virtually_split_kv_in_blocks:  # type: ignore[union-attr]
            raise RuntimeError(
                "push: heterogeneous TP needs a heads-outermost block layout (HND); "
                f"{self.backend_name} interleaves K and V within a block"
            )
