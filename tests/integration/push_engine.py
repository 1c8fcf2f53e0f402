# SPDX-License-Identifier: Apache-2.0
"""One in-process vLLM engine of the harness (:class:`Engine`): a real ``Scheduler`` and
its real connector worker ranks over the fake NIXL fabric, driven at engine or connector
level (``push_harness`` describes what is real and what is fake)."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from push_checks import GarbageSideChannel
from push_probes import push_reg_token
from push_rank import EngineSpec, Rank, VllmBlocks, harness_p_timeouts, worker_idle
from vllm import envs
from vllm.config import VllmConfig
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
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

import vllm_ext
from devkit.testing.fake_nixl import FakeNixlAgent, FakeNixlFabric
from devkit.testing.faults.introspect import connector_tables
from devkit.testing.inproc import (  # the builder the scale bench shares
    DTYPE,
    HYBRID_SHARING,
    LAYERS,
    SAMPLED_TOKEN,
    EngineShape,
    build_scheduler,
    build_worker,
    engine_env,
    free_port,
    kv_cache_config,
    kv_cache_shape,
    stage_layers,
    vllm_config,
)
from vllm_ext import compat, compat_nixl
from vllm_ext.nixl_push.connector import NixlPushConnector
from vllm_ext.nixl_push.metadata import PushConnectorMetadata, PushFinishedMeta, PushRegMeta
from vllm_ext.nixl_push.scheduler import NixlPushConnectorScheduler
from vllm_ext.nixl_push.worker import NixlPushConnectorWorker

_hashing_ready = False


def _init_hashing() -> None:
    """What the engine core does once per process before hashing blocks."""
    global _hashing_ready
    if not _hashing_ready:
        init_none_hash(sha256)
        _hashing_ready = True


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
            self.scheduler = build_scheduler(
                self.vllm_config, self.kv_cache_config, spec.block_size,
                async_scheduling=spec.async_scheduling,
            )  # fmt: skip
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
        assert not self.spec.cross_layer
        layers = stage_layers(stage, self.spec.pp)
        s = self.spec
        return kv_cache_config(s.block_size, s.num_blocks, s.tp, s.sliding_window, layers)

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
                    if full in r.caches:  # a pipeline stage holds some pairs only
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
        return push_reg_token(self.fabric, d_request_id)

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
                f"outgoing={w.writer.registrations.table}"
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
