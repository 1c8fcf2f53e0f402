# SPDX-License-Identifier: Apache-2.0
"""Engines for the scale benchmark: a real vLLM ``Scheduler`` and real connector
workers over the fake NIXL fabric, in one process, for our push connector or vLLM's
own (``NixlPushConnector``, vLLM >= 0.32).

The same construction as the push integration harness (tests/integration/
push_harness.py), cut to what a benchmark needs: no recording of what the metadata
carried, no KV content checks, KV tensors left at zero. What is fake: NIXL
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
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal
from unittest import mock

import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import vllm_ext
from devkit.testing.fake_nixl import FakeNixlFabric, fake_nixl_wrapper_cls
from vllm_ext import compat, compat_nixl

#: which connector an engine runs: ours, or vLLM's own push connector
Connector = Literal["ours", "vllm"]
Role = Literal["kv_producer", "kv_consumer"]
CONNECTOR_NAMES: dict[str, str] = {"ours": vllm_ext.EXT_CONNECTOR_NAME, "vllm": "NixlPushConnector"}

#: the tiny model (devkit.testing.tiny_model): 4 layers, 2 KV heads of 64, bf16
LAYERS = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))
NUM_KV_HEADS = 2
HEAD_SIZE = 64
DTYPE = torch.bfloat16
SAMPLED_TOKEN = 7
#: the plugin refuses vLLM's own push connector by name unless told (vllm_ext/__init__.py)
ALLOW_VLLM_PUSH = {"VLLM_EXT_ALLOW_VLLM_PUSH": "1"}
MAX_MODEL_LEN = 1024

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kv_cache_tensor(num_blocks: int, page: int, layer: str) -> KVCacheTensor:
    fields = {f.name for f in dataclasses.fields(KVCacheTensor)}
    if "shared_by" in fields:
        return KVCacheTensor(size=num_blocks * page, shared_by=[layer])  # type: ignore[call-arg]
    return KVCacheTensor(  # type: ignore[call-arg]
        size=num_blocks * page, layers=[layer], layer_stride=num_blocks * page, block_stride=page
    )


def _fixed_kernel_backend(kernel_block_size: int) -> type[CPUAttentionBackend]:
    class FixedKernelCPUBackend(CPUAttentionBackend):
        @staticmethod
        def get_supported_kernel_block_sizes(*_: Any) -> list[Any]:
            return [kernel_block_size]

    return FixedKernelCPUBackend


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
        self.kv_cache_config = self._kv_cache_config()
        self.sched_clock = HookClock()
        self.worker_clock = HookClock()
        self.finished_sending: set[str] = set()
        self.finished_recving: set[str] = set()
        self.finished: set[str] = set()
        self._aggregator = KVOutputAggregator(expected_finished_count=spec.tp)
        self.ranks: list[Any] = []
        with self._env():
            self.scheduler = Scheduler(
                vllm_config=self.vllm_config,
                kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=spec.block_size,
                log_stats=False,
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
        cfg = VllmConfig(
            model_config=ModelConfig(
                model=str(model_dir), dtype="bfloat16", max_model_len=MAX_MODEL_LEN
            ),
            cache_config=CacheConfig(block_size=s.block_size, enable_prefix_caching=False),
            parallel_config=ParallelConfig(tensor_parallel_size=s.tp),
            scheduler_config=SchedulerConfig(
                max_model_len=MAX_MODEL_LEN,
                max_num_batched_tokens=s.max_num_batched_tokens,
                max_num_seqs=s.max_num_seqs,
                is_encoder_decoder=False,
                **s.scheduler_extra,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector=CONNECTOR_NAMES[s.connector],
                kv_role=s.role,
                kv_buffer_device="cpu",
                engine_id=s.engine_id,
                kv_connector_extra_config=extra,
            ),
        )
        cfg.cache_config.num_gpu_blocks = s.num_blocks
        if hasattr(cfg.cache_config, "kv_cache_layout"):  # vLLM 0.32
            cfg.cache_config.kv_cache_layout = "LBHNC"
        return cfg

    def _kv_cache_config(self) -> KVCacheConfig:
        spec = FullAttentionSpec(
            block_size=self.spec.block_size,
            num_kv_heads=NUM_KV_HEADS // self.spec.tp,
            head_size=HEAD_SIZE,
            dtype=DTYPE,
        )
        n = self.spec.num_blocks
        return KVCacheConfig(
            num_blocks=n,
            kv_cache_tensors=[_kv_cache_tensor(n, spec.page_size_bytes, lay) for lay in LAYERS],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        )

    @contextlib.contextmanager
    def _env(self) -> Iterator[None]:
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.port),
            **ALLOW_VLLM_PUSH,
        }
        with mock.patch.dict(os.environ, env), set_current_vllm_config(self.vllm_config):
            yield

    def _build_rank(self, rank: int, fabric: FakeNixlFabric) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        module = compat_nixl.WORKER_MODULE
        patches: list[Any] = [
            mock.patch(f"{module}.NixlWrapper", fake_nixl_wrapper_cls(fabric)),
            mock.patch(f"{module}.get_tensor_model_parallel_rank", return_value=rank),
            mock.patch(f"{module}.get_tensor_model_parallel_world_size", return_value=self.spec.tp),
        ]
        if compat_nixl.SPLIT_NIXL:  # (vLLM 0.32's CPU backend: multiples of 32 only)
            backend = _fixed_kernel_backend(self.spec.block_size)
            patches.append(
                mock.patch(f"{module}.get_current_attn_backends", return_value=[backend])
            )
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            assert self.vllm_config.kv_transfer_config is not None
            cls = KVConnectorFactory.get_connector_class(self.vllm_config.kv_transfer_config)
            connector: Any = cls(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        w = connector.connector_worker
        heads = NUM_KV_HEADS // self.spec.tp
        shape = (w.num_blocks, heads, w.block_size, 2 * HEAD_SIZE)
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
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not reached within {timeout:g}s: {what}")
        step()
