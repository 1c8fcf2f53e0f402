# SPDX-License-Identifier: Apache-2.0
"""Real push connector workers over the fake NIXL fabric, in one process.

What is real: vLLM 0.23.0's ``VllmConfig`` on the tiny local model, the
``NixlPushConnector`` facade in both roles, ``NixlPushConnectorScheduler`` and
``NixlPushConnectorWorker`` (and their vLLM base classes), the
``nixl-push-writer`` threads, the ZMQ side channel (each engine's scheduler
half runs vLLM's handshake listener on a free 127.0.0.1 port, and workers run
vLLM's ``_nixl_handshake`` against it), the CPU KV cache tensors (4-D
``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` bf16 per layer,
registered with ``register_kv_caches``), ``Request`` objects, the KV cache
manager and vLLM's ``Scheduler`` (with the connector it builds itself).

What is fake: NIXL (``devkit.testing.fake_nixl``: bytes really move
between the tensors), the tensor-parallel group (each worker is told its
rank/size while it is built) and the forward pass (the fake model runner
samples :data:`SAMPLED_TOKEN`; KV tensors start as seeded random data).

Two ways to drive an :class:`Engine`:

* engine level: :meth:`Engine.add_request` + :meth:`Engine.engine_step`, i.e.
  ``Scheduler.schedule`` -> every rank's model-runner KV step (bind metadata,
  ``start_load_kv``, ``get_finished``, load errors, stats) -> the executor's
  ``KVOutputAggregator`` -> ``Scheduler.update_from_output``;
* connector level: call the scheduler half (:attr:`Engine.sched`) yourself
  with real ``Request`` objects and ``KVCacheBlocks`` of chosen ids, then
  :meth:`Engine.connector_step` (``build_connector_meta`` -> ranks ->
  ``update_connector_output``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from push_checks import GarbageSideChannel as GarbageSideChannel
from push_checks import assert_kv_pushed as assert_kv_pushed
from push_checks import assert_untouched as assert_untouched
from push_checks import block_pairs as block_pairs
from push_checks import capture_logs as capture_logs
from push_checks import kv_blocks as kv_blocks
from vllm import envs
from vllm.config import (
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import vllm_ext
from devkit.testing.fake_nixl import (
    FakeNixlAgent,
    FakeNixlFabric,
    FakeXferHandle,
)
from devkit.testing.faults.audit import grown_tables
from devkit.testing.faults.introspect import connector_tables
from devkit.testing.inproc import (  # the builder the scale bench shares
    DTYPE,
    LAYERS,
    SAMPLED_TOKEN,
    EngineShape,
    Role,
    build_worker,
    engine_env,
    free_port,
    kv_cache_config,
    kv_cache_shape,
    stage_layers,
    vllm_config,
    wait_until,
)
from devkit.testing.inproc import HEAD_SIZE as HEAD_SIZE  # (tests import it from here)
from devkit.testing.inproc import HYBRID_SHARING as HYBRID_SHARING
from devkit.testing.inproc import NUM_KV_HEADS as NUM_KV_HEADS
from vllm_ext import compat, compat_nixl
from vllm_ext.nixl_push.connector import NixlPushConnector
from vllm_ext.nixl_push.metadata import PushConnectorMetadata, PushFinishedMeta, PushRegMeta
from vllm_ext.nixl_push.scheduler import NixlPushConnectorScheduler
from vllm_ext.nixl_push.wire import (
    HEARTBEAT_PREFIX,
    PUSH_REG_PREFIX,
    Completion,
    PushRegistration,
    parse_notif,
)
from vllm_ext.nixl_push.worker import NixlPushConnectorWorker
from vllm_ext.nixl_push.writer import IDLE_NOTIF_POLL_S, WRITER_THREAD_NAME

#: P's TCP user timeout in the harness (the default's 2 x 30 s hold of a WRITE NIXL
#: reported failed would outlast tests; N-REL-2) and its push_write_timeout_s, which P
#: requires below 2 x that timeout. A test that sets a write timeout of 2 x this or more
#: (it holds a WRITE or a handshake that long) gets a timeout that keeps the rule
#: (:func:`harness_p_timeouts`); a test that sets the TCP user timeout sets both.
HARNESS_P_TCP_USER_TIMEOUT_S = 1.0
HARNESS_P_WRITE_TIMEOUT_S = 1.5


def harness_p_timeouts(extra: dict[str, Any]) -> dict[str, float]:
    """P's TCP user timeout and write timeout in the harness, for a test's extra config
    ``extra``: what it sets, the rest the harness's, or, for a write timeout at 2 x the
    harness's TCP user timeout or more, a TCP user timeout of 3/4 of it."""
    write_s = float(extra.get("push_write_timeout_s", HARNESS_P_WRITE_TIMEOUT_S))
    tcp_s = HARNESS_P_TCP_USER_TIMEOUT_S
    if write_s >= 2 * tcp_s:
        tcp_s = 0.75 * write_s
    return {"ucx_tcp_user_timeout_s": tcp_s, "push_write_timeout_s": write_s}


#: NIXL calls that push makes and that only the writer thread may make (S-WRT-1);
#: ``send_notif`` of vLLM's ``HB:`` heartbeats is the one allowed exception.
WRITER_ONLY_CALLS = (
    "get_new_notifs",
    "send_notif",
    "initialize_xfer",
    "make_prepped_xfer",
    "transfer",
    "check_xfer_state",
)


_hashing_ready = False


def _init_hashing() -> None:
    """What the engine core does once per process before hashing blocks."""
    global _hashing_ready
    if not _hashing_ready:
        init_none_hash(sha256)
        _hashing_ready = True


@dataclasses.dataclass
class EngineSpec:
    engine_id: str
    role: Role
    tp: int = 1
    #: Pipeline stages: stage ``s`` has ``tp`` ranks holding its layers only
    #: (``inproc.stage_layers``); the engine core serves them as ``(s, tp_rank)``.
    pp: int = 1
    #: Scheduler (logical) block size in tokens.
    block_size: int = 16
    #: Attention kernel (physical) block size; smaller than block_size splits blocks.
    kernel_block_size: int | None = None
    #: Logical blocks in the KV cache.
    num_blocks: int = 48
    extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: "real": vLLM's handshake listener; "garbage": a side channel that answers
    #: junk (every handshake with this engine fails at once); "none": nothing.
    listener: Literal["real", "garbage", "none"] = "real"
    enable_prefix_caching: bool = True
    #: Tokens per step: smaller than a prompt splits its prefill into chunks.
    max_num_batched_tokens: int = 4096
    #: One KV tensor for all layers, blocks then heads outermost (vLLM's cross-layer
    #: layout with HND, as the model runner allocates it on CUDA when the connector
    #: prefers cross-layer blocks), registered with ``register_cross_layers_kv_cache``;
    #: per-layer views for the model.
    cross_layer: bool = False
    #: vLLM's asynchronous scheduling (its default on GPU engines): the engine's
    #: ``AsyncScheduler``, and each step's schedule runs before the previous step's
    #: output is processed (:meth:`Engine.engine_step`).
    async_scheduling: bool = False
    #: Hybrid KV: the even layers attend within this many tokens (vLLM's
    #: ``SlidingWindowSpec``), the odd ones to everything: two KV cache groups under
    #: vLLM's hybrid KV cache manager, each KV tensor shared by one layer of each
    #: group (:data:`HYBRID_SHARING`). None: one group of full attention.
    sliding_window: int | None = None

    @property
    def physical_per_logical(self) -> int:
        return self.block_size // (self.kernel_block_size or self.block_size)


@dataclasses.dataclass(frozen=True)
class VllmBlocks:
    """vLLM's own account of one request's blocks (the KV checks' truth, never the
    connector's metadata): its KV cache manager's block table, or in connector-level
    tests the blocks the test handed the connector in vLLM's place."""

    #: logical block ids of the request's first KV cache group, in token order
    ids: tuple[int, ...]
    #: D: prompt tokens D computed itself (local prefix cache hits): not pushed
    local_tokens: int = 0
    #: every KV cache group's block ids, in token order (the null block, 0, where a
    #: sliding window holds none)
    groups: tuple[tuple[int, ...], ...] = ()


class Rank:
    """One TP rank of an engine: the worker half of the connector and its KV tensors."""

    def __init__(
        self, engine: Engine, rank: int, connector: NixlPushConnector, stage: int = 0
    ) -> None:
        self.engine = engine
        self.rank = rank
        #: the pipeline stage (0 without PP)
        self.stage = stage
        self.connector = connector
        self.caches: dict[str, torch.Tensor] = {}
        #: Every metadata object this rank's start_load_kv was given.
        self.metas: list[PushConnectorMetadata] = []
        self.stats: list[Any] = []

    @property
    def worker(self) -> NixlPushConnectorWorker:
        w = self.connector.connector_worker
        assert w is not None
        return w

    @property
    def agent(self) -> FakeNixlAgent:
        a = self.worker.nixl_wrapper
        assert isinstance(a, FakeNixlAgent)
        return a

    def step(
        self,
        meta: PushConnectorMetadata,
        finished_req_ids: set[str],
        forward: Callable[[Rank], Any] | None = None,
    ) -> ModelRunnerOutput:
        """The model runner's KV connector part of one forward pass (see
        ``KVConnectorModelRunnerMixin._get_kv_connector_output``); ``forward(rank)``
        stands for the pass itself, between ``start_load_kv`` and ``wait_for_save``."""
        self.metas.append(meta)
        c = self.connector
        c.bind_connector_metadata(meta)
        c.start_load_kv(None)
        out = KVConnectorOutput()
        try:
            if forward is not None:
                forward(self)
            c.wait_for_save()
            sending, recving, failed = compat.connector_transfer_results(c, finished_req_ids)
            out.finished_sending, out.finished_recving = sending, recving
            if failed:  # (vLLM 0.32 and later: failures per request)
                out.failed_recving = failed
            out.invalid_block_ids = c.get_block_ids_with_load_errors()
            out.kv_connector_stats = c.get_kv_connector_stats()
            if out.kv_connector_stats is not None:
                self.stats.append(out.kv_connector_stats)
            out.kv_connector_worker_meta = c.build_connector_worker_meta()
        finally:
            c.clear_connector_metadata()
        return compat.model_runner_output([], kv_connector_output=out)


class Engine:
    """One vLLM engine (P or D): a real ``Scheduler`` and ``tp`` real connector workers."""

    def __init__(self, spec: EngineSpec, fabric: FakeNixlFabric, model_dir: Path) -> None:
        self.spec = spec
        self.fabric = fabric
        self.engine_id = spec.engine_id
        self.port = free_port()
        self.ranks: list[Rank] = []
        self._garbage: GarbageSideChannel | None = None
        self.vllm_config = self._config(model_dir)
        self.kv_cache_config = self._kv_cache_config()
        #: Requests that finished (any status), by id.
        self.finished: dict[str, Request] = {}
        #: Aggregated KVConnectorOutput of every step, in order.
        self.outputs: list[KVConnectorOutput] = []
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        #: How often each request was reported done sending / recving (must be once:
        #: vLLM frees its blocks then).
        self.send_reports: Counter[str] = Counter()
        self.recv_reports: Counter[str] = Counter()
        self.invalid_block_ids: set[int] = set()
        #: The ``kv_transfer_params`` each finished request answered (what the API
        #: server puts in its response), by id.
        self.answers: dict[str, dict[str, Any] | None] = {}
        #: The connector stats of each step as vLLM's stat loggers get them (every
        #: rank's, aggregated; ``SchedulerStats.kv_connector_stats``).
        self.connector_stats: list[dict[str, Any]] = []
        #: Called with the ids finished receiving in a step, before the scheduler
        #: sees them (their blocks are still allocated and hold what arrived).
        self.on_recved: list[Callable[[set[str]], None]] = []
        #: vLLM's blocks of each request the connector's metadata named, recorded when
        #: the metadata was handed to the workers (``reg_meta`` / ``finished_meta``
        #: check the connector's block ids against them).
        self.vllm_blocks: dict[str, VllmBlocks] = {}
        # (the executor waits for every worker of every stage, as vLLM's does)
        self._aggregator = KVOutputAggregator(expected_finished_count=spec.tp * spec.pp)
        self._closed = False
        #: async scheduling: the step whose output is not processed yet
        self._in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        with self._env():
            scheduler_cls = AsyncScheduler if spec.async_scheduling else Scheduler
            self.scheduler = scheduler_cls(
                vllm_config=self.vllm_config,
                kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=spec.block_size,
                log_stats=True,
            )
            for stage in range(spec.pp):
                for r in range(spec.tp):
                    self.ranks.append(self._build_rank(r, stage))
        self.initial_free_blocks = self.free_blocks()
        self._watch_connector_inputs()
        self._start_side_channel()
        #: per-request containers of the connector halves, as the fault audit sees them,
        #: once the engine serves its side channel (vLLM 0.34 keeps the payloads it
        #: serves per rank in the scheduler half)
        self.initial_tables = self.tables()

    # -- construction -------------------------------------------------------------------
    def _config(self, model_dir: Path) -> VllmConfig:
        s = self.spec
        shape = EngineShape(
            s.engine_id, s.role, vllm_ext.EXT_CONNECTOR_NAME, tp=s.tp, pp=s.pp,
            block_size=s.block_size,
            num_blocks=s.num_blocks, max_num_batched_tokens=s.max_num_batched_tokens,
            enable_prefix_caching=s.enable_prefix_caching, async_scheduling=s.async_scheduling,
            extra_config=self._extra_config(),
        )  # fmt: skip
        return vllm_config(shape, model_dir)

    def _extra_config(self) -> dict[str, Any]:
        # Most tests send both legs at once, many without ids: such a client needs P's
        # answer for sequential legs off (S-LEG-4); the tests of that answer turn it on.
        extra: dict[str, Any] = {"push_answer_sequential_legs": False}
        if self.spec.role == "kv_producer":
            # P holds a WRITE NIXL failed 2 x its TCP user timeout (N-REL-2); the
            # fabric's failed WRITEs land nothing later unless a test says so. D keeps
            # its default: its bound of N-LIV-1 needs the fabric to end P's WRITEs
            # when D's sends fail.
            extra.update(harness_p_timeouts(self.spec.extra_config))
        return {**extra, **self.spec.extra_config}

    def _kv_cache_config(self) -> KVCacheConfig:
        """The scheduler's: with PP, vLLM's engine core gives it the first stage's."""
        s = self.spec
        if s.pp > 1:
            return generate_scheduler_kv_cache_config([self._stage_kv_cache_config(0)])
        return kv_cache_config(s.block_size, s.num_blocks, s.tp, s.sliding_window)

    def _stage_kv_cache_config(self, stage: int) -> KVCacheConfig:
        """A pipeline stage's workers' (vLLM projects the groups onto its layers)."""
        assert not (self.spec.cross_layer or self.spec.sliding_window)
        layers = stage_layers(stage, self.spec.pp)
        return kv_cache_config(
            self.spec.block_size, self.spec.num_blocks, self.spec.tp, layers=layers
        )

    @contextlib.contextmanager
    def _env(self) -> Iterator[None]:
        # Both halves read the side channel from vLLM's envs when they are built.
        assert not envs._is_envs_cache_enabled(), "vLLM's env cache would pin the side channel"
        with engine_env(self.vllm_config, self.port):
            yield

    def _build_rank(self, rank: int, stage: int = 0) -> Rank:
        layers, kv_config = LAYERS, self.kv_cache_config
        parallel = self.vllm_config.parallel_config
        if self.spec.pp > 1:  # a stage's worker gets its own layers' KV cache config
            kv_config = self._stage_kv_cache_config(stage)
            layers = stage_layers(stage, self.spec.pp)
        parallel.rank = stage * self.spec.tp + rank  # vLLM finds a worker's stage by it
        try:
            connector = build_worker(
                self.vllm_config, kv_config, self.fabric, rank,
                connector_cls=NixlPushConnector, kernel_block_size=self.spec.kernel_block_size,
            )  # fmt: skip
        finally:
            parallel.rank = 0
        r = Rank(self, rank, connector, stage)
        w = r.worker
        assert (w.tp_rank, w.world_size) == (rank, self.spec.tp)
        assert w._physical_blocks_per_logical_kv_block == self.spec.physical_per_logical
        # The CPU attention backend's layout, with the kernel block size, as the
        # model runner allocates it.
        shape = kv_cache_shape(w.num_blocks, w.block_size, self.spec.tp)
        assert len(shape) == 4 and shape[0] == self.spec.num_blocks * self.spec.physical_per_logical
        seed = sum(map(ord, self.engine_id)) * 1000 + 100 * stage + rank
        gen = torch.Generator().manual_seed(seed)
        if self.spec.cross_layer:
            # (num_blocks, heads, num_layers, block_size, 2 * head_size): a block holds
            # every layer, heads outermost (vLLM's HND cross-layer order on CUDA).
            n, heads, *rest = shape
            whole = torch.randn((n, heads, len(LAYERS), *rest), generator=gen).to(DTYPE)
            r.caches = {layer: whole[:, :, i] for i, layer in enumerate(LAYERS)}
            connector.register_cross_layers_kv_cache(whole, CPUAttentionBackend)
        else:
            r.caches = {layer: torch.randn(shape, generator=gen).to(DTYPE) for layer in layers}
            if self.spec.sliding_window is not None and compat_nixl.SPLIT_NIXL:  # shared
                for full, sliding in HYBRID_SHARING:
                    r.caches[sliding] = r.caches[full]
            connector.register_kv_caches(r.caches)
        assert w.writer.alive
        return r

    def _start_side_channel(self) -> None:
        if self.spec.listener == "real":
            # What the engine core does with the handshake metadata of every rank.
            meta = {(r.stage, r.rank): r.worker.xfer_handshake_metadata for r in self.ranks}
            self.connector.set_xfer_handshake_metadata_pp_aware(meta)  # type: ignore[arg-type]
        elif self.spec.listener == "garbage":
            self._garbage = GarbageSideChannel(self.port)

    def _watch_connector_inputs(self) -> None:
        """Connector-level tests hand the scheduler half blocks in vLLM's place: record
        what they handed (requests vLLM's Scheduler owns are read from its block table
        instead, :meth:`_record_vllm_blocks`)."""
        sched = self.sched
        after_alloc, finished = sched.update_state_after_alloc, sched.request_finished

        def update_state_after_alloc(request: Request, blocks: Any, n: int) -> Any:
            rid = request.request_id
            if rid not in self.scheduler.requests and n > 0:
                ids = blocks.get_block_ids()
                self.vllm_blocks[rid] = VllmBlocks(
                    tuple(ids[0]), self._local_tokens(blocks), tuple(map(tuple, ids))
                )
            return after_alloc(request, blocks, n)

        def request_finished(request: Request, block_ids: Any) -> Any:
            rid = request.request_id
            if rid not in self.scheduler.requests and block_ids:
                self.vllm_blocks[rid] = VllmBlocks(
                    tuple(block_ids[0]), groups=tuple(map(tuple, block_ids))
                )
            return finished(request, block_ids)

        sched.update_state_after_alloc = update_state_after_alloc  # type: ignore[method-assign]
        sched.request_finished = request_finished  # type: ignore[method-assign]

    def _record_vllm_blocks(self, meta: PushConnectorMetadata) -> None:
        """Read vLLM's block table for every request the step's push metadata names."""
        mgr = self.scheduler.kv_cache_manager
        handed = (
            meta.push_registrations, meta.push_finished_blocks, meta.push_prefill_done,
            meta.push_chunks,
        )  # fmt: skip
        for rid in itertools.chain.from_iterable(handed):
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            blocks = mgr.get_blocks(rid)
            ids = blocks.get_block_ids()
            local = self._local_tokens(blocks) if rid in meta.push_registrations else 0
            self.vllm_blocks[rid] = VllmBlocks(tuple(ids[0]), local, tuple(map(tuple, ids)))

    def _local_tokens(self, blocks: KVCacheBlocks) -> int:
        """Tokens of a D request's leading blocks that vLLM's prefix cache holds (the
        blocks vLLM found cached carry their hash; the ones it allocated new do not)."""
        hashed = itertools.takewhile(lambda b: b.block_hash is not None, blocks.blocks[0])
        return sum(1 for _ in hashed) * self.spec.block_size

    # -- accessors --------------------------------------------------------------------
    @property
    def connector(self) -> NixlPushConnector:
        c = self.scheduler.get_kv_connector()
        assert isinstance(c, NixlPushConnector)
        return c

    @property
    def sched(self) -> NixlPushConnectorScheduler:
        """The push scheduler half, inside the vLLM Scheduler's connector."""
        s = self.connector.connector_scheduler
        assert s is not None
        return s

    @property
    def workers(self) -> list[NixlPushConnectorWorker]:
        return [r.worker for r in self.ranks]

    def tables(self) -> dict[str, int]:
        """Sizes of every container reachable from the connector's halves (the fault
        audit's walk, ``introspect.connector_tables``)."""
        out = {}
        for rank, w in enumerate(self.workers):
            for path, n in connector_tables([w]).items():
                out[f"rank{rank}:{path}"] = n
        out.update(connector_tables([self.connector]))
        # the fake NIXL is the test's instrument (a real agent is never walked); the
        # queues between the writer and the engine thread hold messages in transit,
        # drained at the next pass or step (the fault audit waits for those)
        return {
            path: n
            for path, n in out.items()
            if ".nixl." not in path and not path.endswith(("outbox", "_inbox"))
        }

    @property
    def agents(self) -> list[FakeNixlAgent]:
        return [r.agent for r in self.ranks]

    def totals(self, key: str) -> float:
        """A push counter summed over the ranks (lifetime)."""
        return sum(w.push_counters.totals().get(key, 0) for w in self.workers)

    def reg_token(self, d_request_id: str) -> str:
        """D: the reply token its PUSH_REG of ``d_request_id`` carried (S-WIR-3)."""
        return _reg_token(self.fabric, d_request_id)

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def d_leg(self, transfer_id: str | None = None, **override: Any) -> dict[str, Any]:
        """A D leg's ``kv_transfer_params`` pointing at this (P) engine (S-LEG-1)."""
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": self.port,
            "tp_size": self.spec.tp,
            "pp_size": self.spec.pp,
        }
        if transfer_id is not None:
            params["transfer_id"] = transfer_id
        params.update(override)
        return params

    @staticmethod
    def p_leg(transfer_id: str | None = None, **override: Any) -> dict[str, Any]:
        """A P leg's ``kv_transfer_params`` (S-LEG-1)."""
        params: dict[str, Any] = {"do_remote_decode": True}
        if transfer_id is not None:
            params["transfer_id"] = transfer_id
        params.update(override)
        return params

    # -- requests -----------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: dict[str, Any] | None,
        max_tokens: int = 1,
    ) -> Request:
        _init_hashing()
        sp = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params} if params is not None else None,
        )
        hasher = (
            get_request_block_hasher(self.spec.block_size, sha256)
            if self.spec.enable_prefix_caching
            else None
        )
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=hasher,
        )

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: dict[str, Any] | None,
        max_tokens: int = 1,
    ) -> Request:
        req = self.make_request(request_id, prompt, params, max_tokens)
        self.scheduler.add_request(req)
        return req

    # -- driving ------------------------------------------------------------------------
    def run_workers(
        self,
        meta: PushConnectorMetadata,
        finished: set[str],
        forward: Callable[[Rank], Any] | None = None,
    ) -> KVConnectorOutput:
        """Every rank's model-runner KV step, aggregated as the executor does."""
        outs = [r.step(meta, finished, forward) for r in self.ranks]
        agg = self._aggregator.aggregate(outs)  # type: ignore[arg-type]
        assert agg is not None and agg.kv_connector_output is not None
        kv = agg.kv_connector_output
        self.outputs.append(kv)
        self.finished_sending |= kv.finished_sending or set()
        self.finished_recving |= kv.finished_recving or set()
        self.send_reports.update(kv.finished_sending or ())
        self.recv_reports.update(kv.finished_recving or ())
        self.invalid_block_ids |= kv.invalid_block_ids
        if kv.finished_recving:
            for hook in self.on_recved:
                hook(set(kv.finished_recving))
        return kv

    def connector_step(self) -> KVConnectorOutput:
        """Connector level: scheduler half -> workers -> scheduler half (no vLLM Scheduler)."""
        meta = self.sched.build_connector_meta(SchedulerOutput.make_empty())
        assert isinstance(meta, PushConnectorMetadata)
        kv = self.run_workers(meta, set())
        self.sched.update_connector_output(kv)
        return kv

    def engine_step(
        self,
        before_update: Callable[[], Any] | None = None,
        forward: Callable[[Rank], Any] | None = None,
    ) -> KVConnectorOutput:
        """One ``EngineCore.step``; the model runner samples SAMPLED_TOKEN once a
        request's prompt is computed. ``forward(rank)`` runs as each rank's forward
        pass; ``before_update`` between the forward pass and ``update_from_output``
        (where an abort lands under async scheduling).

        With async scheduling (``EngineSpec.async_scheduling``) the engine keeps one
        step in flight, as vLLM's batch queue does: this step is scheduled and run
        before the previous step's output is processed, which happens here after it
        (a step that schedules nothing is processed at once)."""
        out, mro = self.schedule_and_run(forward)
        if before_update is not None:
            before_update()
        if not self.spec.async_scheduling:
            self.process_output(out, mro)
            return mro.kv_connector_output  # type: ignore[return-value]
        previous, self._in_flight = self._in_flight, (out, mro)
        if previous is not None:
            self.process_output(*previous)
        if out.total_num_scheduled_tokens == 0:
            self._in_flight = None
            self.process_output(out, mro)
        return mro.kv_connector_output  # type: ignore[return-value]

    def process_in_flight(self) -> None:
        """Async scheduling: process the output of the step in flight now (the engine
        would, after it scheduled the next one); nothing otherwise."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self.process_output(*previous)

    def schedule_and_run(
        self, forward: Callable[[Rank], Any] | None = None
    ) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """``Scheduler.schedule`` and the workers' step; the output is processed by
        :meth:`process_output` (an async engine schedules its next step first)."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, PushConnectorMetadata)
        self._record_vllm_blocks(meta)
        kv = self.run_workers(meta, out.finished_req_ids, forward)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            sampled.append([SAMPLED_TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        mro = compat.model_runner_output(req_ids, sampled_token_ids=sampled, kv_connector_output=kv)
        return out, mro

    def process_output(self, out: SchedulerOutput, mro: ModelRunnerOutput) -> None:
        """``Scheduler.update_from_output`` of a step :meth:`schedule_and_run` ran."""
        live = dict(self.scheduler.requests)
        for outputs in self.scheduler.update_from_output(out, mro).values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.connector_stats.append(stats.kv_connector_stats)
            for o in outputs.outputs:
                if o.finished:
                    self.answers[o.request_id] = o.kv_transfer_params
        for rid, req in live.items():
            if req.is_finished():
                self.finished.setdefault(rid, req)

    def idle(self) -> bool:
        """Nothing in flight anywhere: scheduler, push scheduler half, workers, writers."""
        return (
            self._in_flight is None
            and not self.scheduler.has_requests()
            and not self.sched.has_pending_push_work()
            and all(worker_idle(w) for w in self.workers)
        )

    def describe(self) -> str:
        """Every push table of this engine (for failure messages)."""
        s = self.sched
        lines = [
            f"{self.engine_id}: requests={list(self.scheduler.requests)} "
            f"has_requests={self.scheduler.has_requests()} "
            f"pending_push_work={s.has_pending_push_work()} "
            f"recv_tickets={ {r: t.state.value for r, t in s._recvs.items()} } "
            f"send_tickets={ {r: t.state.value for r, t in s._sends.items()} }"
        ]
        for w in self.workers:
            rv = w.writer.writes.rendezvous
            lines.append(
                f"  rank {w.tp_rank}: {w.debug_state()} "
                f"recvs={ {r.request_id: r.state.value for r in w.recvs} } "
                f"recving={list(w._recving_metadata)} to_send={list(w._reqs_to_send)} "
                f"to_process={sorted(w._reqs_to_process)} "
                f"regs={list(rv._pending_d_registrations)} "
                f"sends={ {x.request_id: x.state.value for x in rv.sends()} } "
                f"outgoing={w.writer._outgoing}"
            )
        return "\n".join(lines)

    # -- what the metadata carried ------------------------------------------------------
    def reg_meta(self, request_id: str) -> PushRegMeta:
        """D: the registration the scheduler handed to the workers for ``request_id``;
        its block ids are checked against vLLM's (:meth:`pushed_blocks`)."""
        for m in self.ranks[0].metas:
            if request_id in m.push_registrations:
                reg = m.push_registrations[request_id]
                if reg.block_ids and reg.block_ids[0]:
                    want = self.pushed_blocks(request_id)
                    got = tuple(reg.block_ids[0])
                    assert got == want[: len(got)] and got, (
                        f"D registered blocks {got} for {request_id}; vLLM allocated "
                        f"{self.vllm_blocks[request_id]}, so P must write into {want}"
                    )
                return reg
        raise KeyError(request_id)

    def finished_meta(self, request_id: str) -> PushFinishedMeta:
        """P: the finished blocks the scheduler handed to the workers for ``request_id``;
        its block ids are checked against vLLM's."""
        for m in self.ranks[0].metas:
            for handed in (m.push_prefill_done, m.push_finished_blocks):
                if request_id in handed:
                    fin = handed[request_id]
                    got = tuple(fin.block_ids[0]) if fin.block_ids else ()
                    want = self.truth(request_id).ids
                    assert got == want[: len(got)], (
                        f"P handed blocks {got} of {request_id} to the writer; vLLM's are {want}"
                    )
                    return fin
        raise KeyError(request_id)

    def truth(self, request_id: str) -> VllmBlocks:
        """vLLM's blocks of ``request_id`` when the connector's metadata named it."""
        assert request_id in self.vllm_blocks, f"vLLM's blocks of {request_id} were never seen"
        return self.vllm_blocks[request_id]

    def pushed_blocks(self, request_id: str) -> tuple[int, ...]:
        """D: the logical blocks of ``request_id`` that P's KV must land in, by vLLM's
        account: every block after the ones D computed from its own prefix cache."""
        t = self.truth(request_id)
        return t.ids[t.local_tokens // self.spec.block_size :]

    def physical(self, logical_ids: Iterable[int]) -> list[int]:
        r = self.spec.physical_per_logical
        return [b * r + i for b in logical_ids for i in range(r)]

    def snapshot(self) -> list[dict[str, torch.Tensor]]:
        return [{k: v.clone() for k, v in r.caches.items()} for r in self.ranks]

    # -- teardown -----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop writers and handshake executors, release NIXL state, stop the side channel."""
        if self._closed:
            return
        self._closed = True
        for r in self.ranks:
            r.connector.shutdown()
        s = self.connector.connector_scheduler
        if s is not None and s._nixl_handshake_listener_t is not None:
            # vLLM's listener checks its stop event once a second: do not wait here.
            s._stop_event.set()
            _STOPPING_LISTENERS.append(s._nixl_handshake_listener_t)
            s._nixl_handshake_listener_t = None
        if self._garbage is not None:
            self._garbage.stop()


_STOPPING_LISTENERS: list[threading.Thread] = []


def join_stopped_listeners(timeout: float = 3.0) -> None:
    """Join the handshake listeners of engines shut down so far."""
    deadline = time.monotonic() + timeout
    while _STOPPING_LISTENERS:
        _STOPPING_LISTENERS.pop().join(max(0.0, deadline - time.monotonic()))


def worker_idle(w: NixlPushConnectorWorker) -> bool:
    """Every push table of a worker and of its writer is empty."""
    st = w.debug_state()
    return (
        all(n == 0 for k, n in st.items() if k != "writer_idle")
        and st["writer_idle"]
        and w.writer.outbox.empty()
        and not w.consumer_notification_counts_by_req
    )


def live_xfer_handles(fabric: FakeNixlFabric) -> list[Any]:
    """Unreleased transfer handles (prepped dlists are held for the worker's lifetime)."""
    return [h for h in fabric.live_handles() if isinstance(h, FakeXferHandle)]


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WRITER_THREAD_NAME]


# -- the fixture ---------------------------------------------------------------------------


class PushEnv:
    """A fake NIXL fabric and the engines built on it; ``close()`` shuts everything down."""

    def __init__(
        self, model_dir: Path, complete_after_polls: int = 2, async_scheduling: bool = False
    ) -> None:
        vllm_ext.register()
        self.model_dir = model_dir
        #: the engines' default (``EngineSpec.async_scheduling``)
        self.async_scheduling = async_scheduling
        self.fabric = FakeNixlFabric(complete_after_polls=complete_after_polls)
        self.engines: list[Engine] = []

    def engine(self, engine_id: str, role: Role, **kw: Any) -> Engine:
        kw.setdefault("async_scheduling", self.async_scheduling)
        e = Engine(EngineSpec(engine_id, role, **kw), self.fabric, self.model_dir)
        self.engines.append(e)
        return e

    def pair(self, p_kw: dict | None = None, d_kw: dict | None = None) -> tuple[Engine, Engine]:
        return self.engine("P", "kv_producer", **(p_kw or {})), self.engine(
            "D", "kv_consumer", **(d_kw or {})
        )

    def step_all(self) -> None:
        for e in self.engines:
            e.engine_step()

    def run_until(self, cond: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
        return wait_until(cond, timeout=timeout, step=self.step_all, what=what)

    def settle(self, timeout: float = 20.0) -> None:
        """Step every engine until all are idle."""
        try:
            self.run_until(lambda: all(e.idle() for e in self.engines), timeout)
        except AssertionError:
            raise AssertionError(
                "engines not idle:\n" + "\n".join(e.describe() for e in self.engines)
            ) from None

    def assert_clean(self) -> None:
        """Every table empty and every transfer handle released."""
        for e in self.engines:
            assert e.idle(), f"{e.engine_id} not idle: {[w.debug_state() for w in e.workers]}"
            assert e.free_blocks() == e.initial_free_blocks, f"{e.engine_id} leaks KV blocks"
            assert not e.sched._sends and not e.sched._recvs, f"{e.engine_id} keeps tickets"
            # (the writer thread may not have taken its last inbox message yet)
            until = time.monotonic() + 2.0
            while grown := grown_tables(e.initial_tables, e.initial_tables, e.tables()):
                if time.monotonic() > until:
                    break
                time.sleep(0.01)
            assert not grown, f"{e.engine_id}: per-request containers not empty: {grown}"
            twice = {r: n for r, n in (e.send_reports + e.recv_reports).items() if n != 1}
            assert not twice, f"{e.engine_id} reported requests more than once: {twice}"
        assert not live_xfer_handles(self.fabric), live_xfer_handles(self.fabric)

    def close(self) -> None:
        for e in self.engines:
            e.shutdown()
        for t in writer_threads():
            t.join(2)
        assert not writer_threads(), "a nixl-push-writer thread survived shutdown"
        self.fabric.assert_no_leaks(include_memory=True)


@contextlib.contextmanager
def open_push_env(
    model_dir: Path, complete_after_polls: int = 2, async_scheduling: bool = False
) -> Iterator[PushEnv]:
    """A :class:`PushEnv` for one test (use in a fixture); closes it afterwards."""
    env = PushEnv(model_dir, complete_after_polls, async_scheduling)
    try:
        yield env
    finally:
        env.close()


# -- probes ------------------------------------------------------------------------------


def _reg_token(fabric: FakeNixlFabric, d_request_id: str) -> str:
    """The reply token (S-WIR-3) of the PUSH_REG D sent for ``d_request_id``."""
    for n in notifs(fabric, PUSH_REG_PREFIX):
        reg = parse_notif(n.msg)
        if isinstance(reg, PushRegistration) and reg.request_id == d_request_id:
            assert reg.reply_token is not None
            return reg.reply_token
    raise AssertionError(f"no PUSH_REG of {d_request_id}")


#: One 16-token block of one layer on an engine with every KV head: heads x tokens x
#: (K+V) x head_size x bf16.
BLOCK_BYTES = NUM_KV_HEADS * 16 * 2 * HEAD_SIZE * DTYPE.itemsize


def prompt_tokens(seed: int, n: int) -> list[int]:
    """``n`` prompt token ids, the same for the same seed."""
    return [(seed * 131 + i * 7) % 1000 + 3 for i in range(n)]


def push_one(
    env: PushEnv, p: Engine, d: Engine, prompt: Sequence[int], tag: str, max_tokens: int = 2
) -> Request:
    """One request through P and D (D's leg first), run until D finished it and every
    engine is idle again; D's finished request (``d-<tag>``, ``p-<tag>`` on P)."""
    d_id = f"d-{tag}"
    d.add_request(d_id, prompt, p.d_leg(f"T-{tag}"), max_tokens=max_tokens)
    p.add_request(f"p-{tag}", prompt, p.p_leg(f"T-{tag}"))
    env.run_until(lambda: d_id in d.finished, what=f"D request {d_id} finished")
    env.settle()
    return d.finished[d_id]


def completion(notif: bytes | None) -> tuple[str, int] | None:
    """(D request id, P tp size) of the completion a WRITE carries (None: none)."""
    if not notif:
        return None
    n = parse_notif(notif)
    assert isinstance(n, Completion), f"not a completion: {notif!r}"
    return n.request_id, n.tp_size


def pending_regs(w: NixlPushConnectorWorker) -> int:
    """P: registrations waiting for their blocks in the writer's rendezvous."""
    return len(w.writer.writes.rendezvous._pending_d_registrations)


def held_finished(w: NixlPushConnectorWorker) -> int:
    """P: finished requests held in the writer's rendezvous."""
    return len(w.writer.writes.rendezvous._push_finished_blocks)


def notifs(fabric: FakeNixlFabric, prefix: bytes = b"", via: str | None = None) -> list[Any]:
    """Delivered notifications starting with ``prefix`` (and sent ``via``, if given)."""
    return [
        n
        for n in fabric.notifications()
        if n.msg.startswith(prefix) and (via is None or n.via == via)
    ]


def completions(fabric: FakeNixlFabric, d_request_id: str, via: str | None = None) -> list[Any]:
    """Delivered completions of ``d_request_id`` (and sent ``via``, if given)."""
    return [
        n
        for n in notifs(fabric, via=via)
        if (completion_or_none(n.msg) or ("",))[0] == d_request_id
    ]


def completion_or_none(msg: bytes | None) -> tuple[str, int] | None:
    n = parse_notif(msg) if msg else None
    return (n.request_id, n.tp_size) if isinstance(n, Completion) else None


class HandshakeGate:
    """Hold a worker's handshakes (vLLM's ``_nixl_handshake``) until :meth:`open`.

    Counts the handshakes started, so tests can check nothing is retried.
    """

    def __init__(self, worker: NixlPushConnectorWorker, closed: bool = True) -> None:
        self.worker = worker
        self.started = 0
        self.finished = 0
        self._open = threading.Event()
        if not closed:
            self._open.set()
        original = worker._nixl_handshake

        def gated(*args: Any, **kwargs: Any) -> Any:
            self.started += 1
            try:
                if not self._open.wait(10):
                    raise TimeoutError("handshake gate never opened")
                return original(*args, **kwargs)
            finally:
                self.finished += 1

        worker._nixl_handshake = gated  # type: ignore[method-assign]

    def open(self) -> None:
        self._open.set()


def assert_nixl_calls_on_writer(fabric: FakeNixlFabric) -> dict[str, int]:
    """S-WRT-1: every push NIXL call (WRITER_ONLY_CALLS) of every agent ran on the writer
    thread, except ``send_notif`` of vLLM's ``HB:`` heartbeats, which stay on the engine's
    main thread. Returns the number of calls checked per method."""
    checked: dict[str, int] = {}
    for agent in fabric.agents():
        heartbeats = sum(
            1
            for n in fabric.notifications()
            if n.sender == agent.name
            and n.via == "send_notif"
            and n.msg.startswith(HEARTBEAT_PREFIX)
        )
        for method in WRITER_ONLY_CALLS:
            calls = agent.calls(method)
            checked[method] = checked.get(method, 0) + len(calls)
            off = [c.thread for c in calls if c.thread != WRITER_THREAD_NAME]
            if method == "send_notif":
                # (the engine thread is the test's thread: it runs every engine step)
                assert set(off) <= {threading.current_thread().name}, (agent.name, off)
                assert len(off) == heartbeats, (
                    f"{agent.name}: {len(off)} send_notif off the writer, "
                    f"{heartbeats} of them heartbeats"
                )
            else:
                assert not off, f"{agent.name}.{method} called on {sorted(set(off))}"
    return checked


class HeldWriter:
    """Hold a writer thread between passes: while held, a woken writer waits before its
    next pass, so everything the engine thread enqueues meanwhile lands in one pass."""

    def __init__(self, worker: NixlPushConnectorWorker) -> None:
        self._lock = threading.Lock()
        self.passes = 0
        writer = worker.writer
        original = writer.step

        def held_step() -> None:
            with self._lock:
                self.passes += 1
                original()

        writer.step = held_step  # type: ignore[method-assign]

    def __enter__(self) -> HeldWriter:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def notif_reads(engine: Engine) -> int:
    """``get_new_notifs`` calls made so far on the engine's agents (by its writers)."""
    return sum(len(a.calls("get_new_notifs")) for a in engine.agents)


def assert_self_polls(engine: Engine, n: int = 3, timeout: float = 10.0) -> None:
    """The engine's writer reads notifications again and again with no engine step."""
    before = notif_reads(engine)
    wait_until(lambda: notif_reads(engine) >= before + n, timeout, what="writer self-polls")


def assert_writer_sleeps(engine: Engine, window: float = 0.5, timeout: float = 10.0) -> None:
    """The engine's writer does not self-poll: without a step it reads notifications
    only at its idle period (``IDLE_NOTIF_POLL_S``), not at the busy one (1 ms), once a
    pass that was already running has had time to end."""
    idle_reads = window / IDLE_NOTIF_POLL_S + 2

    def quiet(seconds: float) -> bool:
        before = notif_reads(engine)
        time.sleep(seconds)
        return notif_reads(engine) - before <= seconds / IDLE_NOTIF_POLL_S + 2

    wait_until(lambda: quiet(0.1), timeout, what="writer goes back to sleep")
    before = notif_reads(engine)
    time.sleep(window)
    reads = notif_reads(engine) - before
    assert reads <= idle_reads, f"the writer still polls by itself ({reads} reads in {window}s)"
