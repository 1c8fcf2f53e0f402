# SPDX-License-Identifier: Apache-2.0
"""A P/D pair plus the proxy on loopback, or a single engine: used by the demo,
the e2e tests, the benchmark and the fault tools (``devkit.testing.faults.pair``
builds on it).

Each engine gets its own core (``VLLM_CPU_OMP_THREADS_BIND`` and ``taskset``),
free ports, its own log file and compile cache under ``run_dir``; everything is
stopped by process group on ``stop()``, on errors and at interpreter exit. With
``PDConfig.gpu`` the engines run on GPUs instead (:mod:`devkit.launch.gpu`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from devkit.launch.engine import (
    ENGINE_START_TIMEOUT_S,
    Engine,
    EngineSpec,
    kv_transfer_config,
    pin_to_core,
    start_engine,
)
from devkit.launch.gpu import GpuOptions, cross_layer_env
from devkit.launch.process import (
    ManagedProcess,
    StartOnce,
    free_port,
    wait_http_ready,
)
from devkit.launch.proxy_cmd import pair_proxy_argv
from vllm_ext import EXT_CONNECTOR_NAME

Mode = Literal["push", "pull", "single"]

#: Connector used per mode unless the caller overrides it.
DEFAULT_CONNECTOR = {"push": EXT_CONNECTOR_NAME, "pull": "NixlConnector"}
PROXY_START_TIMEOUT_S = 60.0
#: A short lease and D's registration watchdog, so that a lost push ends in seconds
#: and its blocks come back (the e2e tests and the fault tools run with these).
SHORT_TIMEOUTS_CONFIG: dict[str, Any] = {"kv_lease_duration": 8, "push_registration_timeout_s": 20}


@dataclasses.dataclass
class PDConfig:
    mode: Mode
    model: str
    run_dir: Path
    python: str = sys.executable
    connector: str | None = None
    extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    enable_prefix_caching: bool = True
    max_model_len: int = 4096
    #: cores for P and D (None: no pinning)
    p_cpu: int | None = 0
    d_cpu: int | None = 1
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    #: P's and D's engine ids (None: fresh ones)
    engine_ids: tuple[str, str] | None = None
    #: called with P's and D's spec (``spec.name`` is ``prefill`` / ``decode``) before
    #: it is pinned to its core: where else it runs (e.g. in a network namespace:
    #: ``wrapper``, ``host``, ``side_channel_host``, environment)
    place: Callable[[EngineSpec], None] | None = None
    #: a different model directory for P only (tests: show that D's output follows P's KV)
    p_model: str | None = None
    #: P's pipeline-parallel stages (> 1: ``--pipeline-parallel-size`` with the ``mp``
    #: executor, and the proxy tells D). Bind each stage's OMP threads with
    #: ``p_extra_env`` (e.g. ``VLLM_CPU_OMP_THREADS_BIND="0|0"`` to keep them on ``p_cpu``).
    p_pp_size: int = 1
    #: ``--enforce-eager`` on P (CPU engines; False: vLLM compiles the model at start)
    p_enforce_eager: bool = True
    #: extra server arguments / environment for P only
    p_extra_args: list[str] = dataclasses.field(default_factory=list)
    p_extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    #: extra server arguments for D only
    d_extra_args: list[str] = dataclasses.field(default_factory=list)
    #: ``kv_connector_extra_config`` keys for P only (over ``extra_config``)
    p_extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: called once P is ready, before D starts (D then starts after P, not beside it;
    #: tests: change what D finds at P's model path, as on another host)
    before_decode: Callable[[], None] | None = None
    #: extra ``vllm-ext-proxy`` arguments (e.g. timeouts)
    proxy_extra_args: list[str] = dataclasses.field(default_factory=list)
    #: the proxy's module (a stand-in with the same options, e.g. the benchmark's
    #: proxy for vLLM's own push connector)
    proxy_module: str = "vllm_ext.proxy"
    #: run the engines on GPUs (None: on CPU cores, as above)
    gpu: GpuOptions | None = None


class PDDeployment(StartOnce):
    """``with PDDeployment(cfg) as dep: dep.url ...`` starts, waits and always stops."""

    def __init__(self, cfg: PDConfig, progress: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.progress = progress or (lambda msg: None)
        self.prefill: Engine | None = None
        self.decode: Engine | None = None
        self.proxy: ManagedProcess | None = None
        self.proxy_port = 0
        self.p_engine_id, self.d_engine_id = cfg.engine_ids or (
            f"prefill-{uuid.uuid4().hex[:8]}",
            f"decode-{uuid.uuid4().hex[:8]}",
        )
        self.startup_s = 0.0

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self._t0 = time.monotonic()
        if cfg.mode == "single":
            self.decode = start_engine(self._spec("single", None, cfg.d_cpu), cfg.run_dir)
            return
        connector = cfg.connector or DEFAULT_CONNECTOR[cfg.mode]
        p_kv = self._kv(connector, "kv_producer", self.p_engine_id)
        p_kv["kv_connector_extra_config"].update(cfg.p_extra_config)
        p_spec = self._spec("prefill", p_kv, cfg.p_cpu)
        if cfg.p_model:
            p_spec.model = cfg.p_model
        if cfg.gpu is None:
            p_spec.enforce_eager = cfg.p_enforce_eager
        if cfg.p_pp_size > 1:
            p_spec.extra_args += [
                "--pipeline-parallel-size", str(cfg.p_pp_size),
                "--distributed-executor-backend", "mp",
            ]  # fmt: skip
        p_spec.extra_args += cfg.p_extra_args
        p_spec.extra_env.update(cfg.p_extra_env)
        self.prefill = start_engine(p_spec, cfg.run_dir)
        if cfg.gpu is not None and not self.concurrent_start_safe(cfg.gpu):
            # P and D on one GPU: D sizes its KV cache from the memory its own start
            # used, so P's allocations during D's profiling would count as D's (D once
            # had 2.7 GiB of KV next to P's 40 and refused to start); P goes first.
            self.wait_engines([self.prefill], cfg.run_dir, cfg.gpu.start_timeout_s)
        elif cfg.before_decode is not None:
            self.wait_engines([self.prefill], cfg.run_dir, ENGINE_START_TIMEOUT_S)
        if cfg.before_decode is not None:
            cfg.before_decode()
        d_spec = self._spec(
            "decode", self._kv(connector, "kv_consumer", self.d_engine_id), cfg.d_cpu
        )
        d_spec.extra_args += cfg.d_extra_args
        self.decode = start_engine(d_spec, cfg.run_dir)
        self.proxy_port = free_port()
        self.proxy = ManagedProcess(
            "proxy", self.proxy_argv(self.proxy_port), cfg.run_dir / "proxy.log"
        )

    def wait_ready(self) -> float:
        """Wait for every engine and the proxy; reports progress; returns startup seconds."""
        engines = [e for e in (self.prefill, self.decode) if e is not None]
        timeout = self.cfg.gpu.start_timeout_s if self.cfg.gpu else ENGINE_START_TIMEOUT_S
        self.wait_engines(engines, self.cfg.run_dir, timeout)
        if self.proxy is not None:
            wait_http_ready(f"{self.url}/health", PROXY_START_TIMEOUT_S, self.proxy)
            self.progress(f"proxy ready on {self.url} ({self.cfg.mode})")
        self.startup_s = time.monotonic() - self._t0
        return self.startup_s

    def stop(self) -> None:
        for p in (self.proxy,):
            if p is not None:
                p.stop()
        for e in (self.decode, self.prefill):
            if e is not None:
                e.stop()

    @staticmethod
    def concurrent_start_safe(gpu: GpuOptions) -> bool:
        """Whether D may start while P starts: on separate GPUs, or on one GPU with a
        fixed KV cache size (``kv_cache_memory_bytes``: vLLM then skips the memory
        profiling that would count the other engine's allocations as its own)."""
        return gpu.devices("prefill") != gpu.devices("decode") or bool(gpu.kv_cache_memory_bytes)

    # -- addresses -----------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Where clients send requests: the proxy, or the single engine."""
        if self.cfg.mode == "single":
            assert self.decode is not None
            return self.decode.url
        return f"http://127.0.0.1:{self.proxy_port}"

    def proxy_argv(
        self, port: int, *, p_engine_id: str | None = None, p_side_channel_port: int | None = None
    ) -> list[str]:
        """The proxy's command line on ``port``; its D legs name P's engine id and
        side-channel port, or the ones given (a proxy that points D elsewhere)."""
        cfg = self.cfg
        assert self.prefill is not None and self.decode is not None
        p = self.prefill.spec
        p_tp = cfg.gpu.p_tp_size if cfg.gpu else 1
        return pair_proxy_argv(
            cfg.python, port, prefill_url=p.url, decode_url=self.decode.url,
            p_engine_id=p_engine_id or self.p_engine_id,
            p_side_channel_port=p_side_channel_port or p.side_channel_port,
            mode="push" if cfg.mode == "push" else "pull",
            module=cfg.proxy_module,
            options=[
                "--p-host", p.side_channel_host,
                "--p-pp-size", str(cfg.p_pp_size),
                *(["--p-tp-size", str(p_tp)] if p_tp > 1 else []),
                *cfg.proxy_extra_args,
            ],
        )  # fmt: skip

    # -- helpers -------------------------------------------------------------------------
    def _kv(self, connector: str, role: str, engine_id: str) -> dict[str, Any]:
        device = "cuda" if self.cfg.gpu else "cpu"
        return kv_transfer_config(connector, role, engine_id, self.cfg.extra_config, device=device)

    def _spec(self, name: str, kv: dict[str, Any] | None, cpu: int | None) -> EngineSpec:
        cfg = self.cfg
        spec = EngineSpec(
            name=name,
            model=cfg.model,
            kv_transfer_config=kv,
            cpu=cpu,
            max_model_len=cfg.max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching,
            python=cfg.python,
            extra_env=dict(cfg.extra_env),
        )
        if cfg.gpu is not None:
            gpu = cfg.gpu
            spec.device, spec.cpu = "cuda", None
            spec.cuda_devices = gpu.devices(name)
            spec.gpu_args = gpu.args(name)
            spec.enforce_eager = gpu.enforce_eager
            spec.cache_root = gpu.cache_dir(name)
            spec.extra_env = {**cross_layer_env(kv), **spec.extra_env}
        if cfg.place is not None:
            cfg.place(spec)
        if cfg.gpu is None:
            pin_to_core(spec, cpu)
        return spec
