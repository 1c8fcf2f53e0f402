# SPDX-License-Identifier: Apache-2.0
"""Engines for the scale benchmark: a real vLLM ``Scheduler`` and real connector
workers over the fake NIXL fabric, in one process, for our push connector or vLLM's
own (``NixlPushConnector``, vLLM >= 0.32).

Built by the same in-process builder as the push integration harness
(:mod:`devkit.testing.inproc`), used for what a benchmark needs: no recording of what
the metadata carried, no KV content checks, KV tensors left at zero. What is fake: NIXL
(``devkit.testing.fake_nixl``: bytes really move between the tensors, its own cost
is small and the same for both connectors), the TP group (each worker is told its
rank while it is built) and the forward pass (nothing runs; the model runner
samples one token once a prompt is computed).

:class:`HookClock` times the connector's hooks: every call the scheduler and the
model runner make on the connector (the facade, ``KVConnectorBase_V1``), each
timed once even when one hook calls another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal
from unittest import mock

import torch
from vllm.config import (
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

import vllm_ext
from devkit.testing import inproc
from devkit.testing.fake_nixl import FakeNixlFabric
from devkit.testing.inproc import (
    DTYPE,
    LAYERS,
    MAX_MODEL_LEN,
    SAMPLED_TOKEN,
    EngineShape,
    Role,
    build_scheduler,
    build_worker,
    engine_env,
    free_port,
    kv_cache_config,
    kv_cache_shape,
    vllm_config,
)
from vllm_ext import compat

#: which connector an engine runs: ours, or vLLM's own push connector
Connector = Literal["ours", "vllm"]
CONNECTOR_NAMES: dict[str, str] = {"ours": vllm_ext.EXT_CONNECTOR_NAME, "vllm": "NixlPushConnector"}

#: the plugin refuses vLLM's own push connector by name unless told (vllm_ext/__init__.py)
ALLOW_VLLM_PUSH = {"VLLM_EXT_ALLOW_VLLM_PUSH": "1"}

#: scheduler-side hooks (vLLM's Scheduler calls them on the connector)
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "on_new_request",
    "take_events",
    "has_pending_block_frees",
    "has_pending_push_work",
)
#: worker-side hooks (the model runner calls them on each rank's connector)
WORKER_HOOKS = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
    "clear_connector_metadata",
)


class HookClock:
    """Accumulates the time spent inside the hooks it wraps (engine thread only): wall
    time, and the calling thread's CPU time (``CLOCK_THREAD_CPUTIME_ID``: without the
    time it waits, for the GIL or for the writer thread in ``hand_over``)."""

    def __init__(self) -> None:
        self.ns = 0
        self.cpu_ns = 0
        self.by_hook: Counter[str] = Counter()
        self.cpu_by_hook: Counter[str] = Counter()
        self._depth = 0

    def wrap(self, obj: Any, names: Sequence[str]) -> None:
        for name in names:
            fn = getattr(obj, name, None)
            if fn is not None and callable(fn):
                setattr(obj, name, self._timed(name, fn))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # a hook calling another: counted once, by the outer one
                return fn(*args, **kwargs)
            self._depth += 1
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter_ns() - t0
                dc = time.thread_time_ns() - c0
                self._depth -= 1
                self.ns += dt
                self.cpu_ns += dc
                self.by_hook[name] += dt
                self.cpu_by_hook[name] += dc

        return timed

    def take(self) -> tuple[int, int]:
        """(wall, CPU) nanoseconds since the last take."""
        out = (self.ns, self.cpu_ns)
        self.ns = self.cpu_ns = 0
        return out


def thread_cpu_s(threads: Sequence[threading.Thread]) -> float:
    """CPU seconds the given (live) threads have used so far."""
    total = 0.0
    for t in threads:
        if t.ident is not None and t.is_alive():
            with contextlib.suppress(OSError, ProcessLookupError):
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return total


@dataclasses.dataclass
class ScaleEngineSpec:
    engine_id: str
    role: Role
    connector: Connector = "ours"
    tp: int = 1
    block_size: int = 16
    num_blocks: int = 512
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    max_model_len: int = MAX_MODEL_LEN
    extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: more ``SchedulerConfig`` fields (e.g. ``long_prefill_token_threshold``)
    scheduler_extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class ScaleEngine:
    """One engine: vLLM's ``Scheduler`` with its connector, and ``tp`` worker ranks.

    ``sched_clock`` times the scheduler-side hooks, ``worker_clock`` every rank's."""

    def __init__(self, spec: ScaleEngineSpec, fabric: FakeNixlFabric, model_dir: Path) -> None:
        self.spec = spec
        self.engine_id = spec.engine_id
        self.port = free_port()
        with mock.patch.dict(os.environ, ALLOW_VLLM_PUSH):
            self.vllm_config = self._config(model_dir)
        self.kv_cache_config = kv_cache_config(spec.block_size, spec.num_blocks, spec.tp)
        self.sched_clock = HookClock()
        self.worker_clock = HookClock()
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.finished: set[str] = set()
        self._aggregator = KVOutputAggregator(expected_finished_count=spec.tp)
        self.ranks: list[Any] = []
        with engine_env(self.vllm_config, self.port, ALLOW_VLLM_PUSH):
            self.scheduler = build_scheduler(
                self.vllm_config, self.kv_cache_config, spec.block_size, log_stats=False
            )
            for r in range(spec.tp):
                self.ranks.append(self._build_rank(r, fabric))
        meta = {
            (0, r): c.connector_worker.xfer_handshake_metadata for r, c in enumerate(self.ranks)
        }
        self.connector.set_xfer_handshake_metadata_pp_aware(meta)
        self.sched_clock.wrap(self.connector, SCHEDULER_HOOKS)
        for c in self.ranks:
            self.worker_clock.wrap(c, WORKER_HOOKS)

    # -- construction -----------------------------------------------------------------
    def _config(self, model_dir: Path) -> VllmConfig:
        s = self.spec
        extra = {"kv_lease_duration": 3600, **s.extra_config}
        if s.connector == "ours":
            extra.setdefault("push_answer_sequential_legs", False)
        shape = EngineShape(
            s.engine_id, s.role, CONNECTOR_NAMES[s.connector], tp=s.tp, block_size=s.block_size,
            num_blocks=s.num_blocks, max_num_batched_tokens=s.max_num_batched_tokens,
            max_num_seqs=s.max_num_seqs, max_model_len=s.max_model_len,
            enable_prefix_caching=False, extra_config=extra,
            scheduler_extra=s.scheduler_extra,
        )  # fmt: skip
        return vllm_config(shape, model_dir)

    def _build_rank(self, rank: int, fabric: FakeNixlFabric) -> Any:
        connector = build_worker(self.vllm_config, self.kv_cache_config, fabric, rank)
        w = connector.connector_worker
        shape = kv_cache_shape(w.num_blocks, w.block_size, self.spec.tp)
        connector.register_kv_caches({lay: torch.zeros(shape, dtype=DTYPE) for lay in LAYERS})
        return connector

    # -- accessors --------------------------------------------------------------------
    def writer_threads(self) -> list[threading.Thread]:
        """Each rank's writer thread (ours: ``PushWriter``; vLLM's: its push worker's)."""
        out = []
        for c in self.ranks:
            w = c.connector_worker
            t = w.writer._thread if hasattr(w, "writer") else w._push_writer_thread
            if t is not None:
                out.append(t)
        return out

    @property
    def connector(self) -> Any:
        return self.scheduler.get_kv_connector()

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def d_leg(self, transfer_id: str) -> dict[str, Any]:
        """The push D leg pointing at this (P) engine, in the form its connector reads
        (``transfer_id``: the request id, the same on both legs)."""
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "remote_engine_id": self.engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": self.port,
            "tp_size": self.spec.tp,
            "pp_size": 1,
        }
        if self.spec.connector == "ours":
            params["transfer_id"] = transfer_id
        else:  # vLLM's push D leg: P's request id (the bench gives both legs one id)
            params["remote_request_id"] = transfer_id
        return params

    def p_leg(self, transfer_id: str) -> dict[str, Any]:
        params: dict[str, Any] = {"do_remote_decode": True}
        if self.spec.connector == "ours":
            params["transfer_id"] = transfer_id
        return params

    def add_request(self, request_id: str, prompt: Sequence[int], params: dict[str, Any]) -> None:
        sp = SamplingParams(
            max_tokens=1, ignore_eos=True, extra_args={"kv_transfer_params": params}
        )
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
        )
        self.scheduler.add_request(req)

    # -- driving ----------------------------------------------------------------------
    def _rank_step(self, c: Any, meta: Any, finished: set[str]) -> ModelRunnerOutput:
        """The model runner's KV connector part of one step (vLLM's
        ``KVConnectorModelRunnerMixin``), with nothing in the forward pass."""
        out = KVConnectorOutput()
        c.bind_connector_metadata(meta)
        c.start_load_kv(None)
        try:
            c.wait_for_save()
            if hasattr(c, "get_transfer_results"):  # vLLM 0.32
                res = c.get_transfer_results(finished)
                out.finished_sending = res.finished_sending
                out.finished_recving = res.finished_recving
                if hasattr(out, "failed_recving"):
                    out.failed_recving = res.failed_recving
            else:
                out.finished_sending, out.finished_recving = c.get_finished(finished)
            out.invalid_block_ids = c.get_block_ids_with_load_errors()
            out.kv_connector_stats = c.get_kv_connector_stats()
            if hasattr(c, "get_kv_connector_kv_cache_events"):
                out.kv_cache_events = c.get_kv_connector_kv_cache_events()
            if hasattr(c, "build_connector_worker_meta"):
                out.kv_connector_worker_meta = c.build_connector_worker_meta()
        finally:
            c.clear_connector_metadata()
        return compat.model_runner_output([], kv_connector_output=out)

    def step(self) -> None:
        """One ``EngineCore.step``: schedule, every rank's KV step, update_from_output;
        then ``has_pending_push_work`` once (vLLM asks it when it has no request)."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        outs = [self._rank_step(c, meta, out.finished_req_ids) for c in self.ranks]
        agg = self._aggregator.aggregate(outs)  # type: ignore[arg-type]
        assert agg is not None and agg.kv_connector_output is not None
        kv = agg.kv_connector_output
        self.finished_sending |= kv.finished_sending or set()
        self.finished_recving |= kv.finished_recving or set()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            sampled.append([SAMPLED_TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
        mro = compat.model_runner_output(req_ids, sampled_token_ids=sampled, kv_connector_output=kv)
        scheduled = [self.scheduler.requests[rid] for rid in req_ids]
        self.scheduler.update_from_output(out, mro)
        self.finished.update(r.request_id for r in scheduled if r.is_finished())
        if hasattr(self.connector, "has_pending_push_work"):
            self.connector.has_pending_push_work()

    def shutdown(self) -> None:
        for c in self.ranks:
            c.shutdown()
        sched = self.connector.connector_scheduler
        stop = getattr(sched, "_stop_event", None)
        if stop is not None:
            stop.set()


class ScaleFabric:
    """A fake NIXL fabric and the engines on it."""

    def __init__(self, model_dir: Path, complete_after_polls: int = 2) -> None:
        vllm_ext.register()
        self.model_dir = model_dir
        self.fabric = FakeNixlFabric(complete_after_polls=complete_after_polls)
        self.engines: list[ScaleEngine] = []

    def engine(self, engine_id: str, role: Role, **kw: Any) -> ScaleEngine:
        e = ScaleEngine(ScaleEngineSpec(engine_id, role, **kw), self.fabric, self.model_dir)
        self.engines.append(e)
        return e

    def close(self) -> None:
        for e in self.engines:
            e.shutdown()


@contextlib.contextmanager
def open_fabric(model_dir: Path) -> Iterator[ScaleFabric]:
    f = ScaleFabric(model_dir)
    try:
        yield f
    finally:
        f.close()


def wait_until(cond: Callable[[], Any], step: Callable[[], Any], timeout: float, what: str) -> None:
    """:func:`devkit.testing.inproc.wait_until` in the bench's argument order."""
    inproc.wait_until(cond, timeout, step, what)
