# SPDX-License-Identifier: Apache-2.0
"""An in-process engine's shape and its TP ranks (the harness's :class:`~push_engine.Engine`
is built of them): :class:`EngineSpec`, P's timeouts in the harness, vLLM's account of a
request's blocks (:class:`VllmBlocks`) and one rank's model-runner KV step (:class:`Rank`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from devkit.testing.fake_nixl import FakeNixlAgent
from devkit.testing.inproc import Role
from vllm_ext import compat
from vllm_ext.nixl_push.connector import NixlPushConnector
from vllm_ext.nixl_push.metadata import PushConnectorMetadata
from vllm_ext.nixl_push.worker import NixlPushConnectorWorker

if TYPE_CHECKING:
    from push_engine import Engine

#: P's TCP user timeout in the harness (the default's 2 x 30 s hold of a WRITE NIXL
#: reported failed would outlast tests; N-REL-2) and its push_write_timeout_s, which P
#: requires below 2 x that timeout. A test that sets a write timeout of 2 x this or more
#: (it holds a WRITE or a handshake that long) gets a timeout that keeps the rule
#: (:func:`harness_p_timeouts`); a test that sets the TCP user timeout sets both.
HARNESS_P_TCP_USER_TIMEOUT_S = 1.0
HARNESS_P_WRITE_TIMEOUT_S = 1.5
#: P's extra config for a test that holds P's WRITE behind a closed handshake gate and
#: then expects it to be written: the harness's 1.5 s write timeout counts from the
#: match, and a loaded machine's engine steps (the test's hold is timed in steps) can
#: outlast it, so P would give the WRITE up (N-REL-2) and the test fail on timing alone.
#: Its TCP user timeout follows (3/4 of this); no WRITE of such a test fails.
P_HOLDS_ITS_WRITE = {"push_write_timeout_s": 20.0}


def harness_p_timeouts(extra: dict[str, Any]) -> dict[str, float]:
    """P's TCP user timeout and write timeout in the harness, for a test's extra config
    ``extra``: what it sets, the rest the harness's, or, for a write timeout at 2 x the
    harness's TCP user timeout or more, a TCP user timeout of 3/4 of it."""
    write_s = float(extra.get("push_write_timeout_s", HARNESS_P_WRITE_TIMEOUT_S))
    tcp_s = HARNESS_P_TCP_USER_TIMEOUT_S
    if write_s >= 2 * tcp_s:
        tcp_s = 0.75 * write_s
    return {"ucx_tcp_user_timeout_s": tcp_s, "push_write_timeout_s": write_s}


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


def worker_idle(w: NixlPushConnectorWorker) -> bool:
    """Every push table of a worker and of its writer is empty."""
    st = w.debug_state()
    return (
        all(n == 0 for k, n in st.items() if k != "writer_idle")
        and st["writer_idle"]
        and w.writer.outbox.empty()
        and not w.consumer_notification_counts_by_req
    )
