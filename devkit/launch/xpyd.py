# SPDX-License-Identifier: Apache-2.0
"""Several P and D engines on loopback behind our proxy and/or vLLM's ``vllm-router``.

``XPyDDeployment`` starts ``n_prefill`` producers and ``n_decode`` consumers of one
connector (each with its own engine id, HTTP port, NIXL side-channel port, log and
compile cache), then the routers named in ``routers``, all in front of the same
engines:

* ``proxy``: ``vllm-ext-proxy`` with every ``--prefill URL,engine_id=..,side_channel_port=..``
  and ``--decode URL`` (least-loaded choice, concurrent legs in push mode);
* ``proxy-sequential``: the same with ``--push-legs sequential`` (D leg after P's
  answer, as a router built for pull runs them: A/B measurements);
* ``vllm-router``: ``vllm-router --vllm-pd-disaggregation --prefill URL ... --decode URL ...``
  (the Rust router from PyPI, unmodified; it runs the legs one after the other
  and hands D the ``kv_transfer_params`` that P answered).

Cores: by default every P is bound to core 0 and every D to core 1 (one OMP
thread each; on this 2-core machine two engines share each core), so every P/D
pair spans both cores, as in the 1P1D layout; engines bound to one core start one
after another (``start_waves``). Everything is stopped by process group;
``kill_engine`` kills one engine's group with SIGKILL (a crash).
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devkit.launch.engine import (
    ENGINE_START_TIMEOUT_S,
    Engine,
    EngineSpec,
    kv_transfer_config,
    pin_to_core,
    start_engine,
)
from devkit.launch.process import (
    ManagedProcess,
    StartOnce,
    free_port,
    wait_http_ready,
)
from vllm_ext import EXT_CONNECTOR_NAME

ROUTERS = ("proxy", "proxy-sequential", "vllm-router")
ROUTER_START_TIMEOUT_S = 120.0


def vllm_router_binary(python: str = sys.executable) -> str | None:
    """The ``vllm-router`` script of the environment of ``python`` (or on PATH), if any."""
    beside = Path(python).parent / "vllm-router"
    if beside.exists():
        return str(beside)
    return shutil.which("vllm-router")


@dataclasses.dataclass
class XPyDConfig:
    model: str
    run_dir: Path
    n_prefill: int = 2
    n_decode: int = 2
    mode: str = "push"
    python: str = sys.executable
    connector: str = EXT_CONNECTOR_NAME
    #: P only: another connector class and its module (``kv_connector_module_path``)
    p_connector: str | None = None
    p_connector_module_path: str | None = None
    extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    enable_prefix_caching: bool = True
    max_model_len: int = 4096
    #: core of each P / each D (None: no pinning); the last entry repeats
    p_cpus: list[int | None] = dataclasses.field(default_factory=lambda: [0])
    d_cpus: list[int | None] = dataclasses.field(default_factory=lambda: [1])
    extra_env: dict[str, str] = dataclasses.field(default_factory=dict)
    routers: tuple[str, ...] = ("proxy",)
    proxy_extra_args: list[str] = dataclasses.field(default_factory=list)
    #: ``vllm-router`` arguments after the P/D lists (default: round robin)
    router_args: list[str] = dataclasses.field(default_factory=lambda: ["--policy", "round_robin"])

    def __post_init__(self) -> None:
        unknown = set(self.routers) - set(ROUTERS)
        if unknown:
            raise ValueError(f"unknown routers {sorted(unknown)}; known: {ROUTERS}")
        if self.n_prefill < 1 or self.n_decode < 1:
            raise ValueError("need at least one P and one D")


class XPyDDeployment(StartOnce):
    """``with XPyDDeployment(cfg) as dep: dep.proxy_url, dep.router_url ...``"""

    def __init__(self, cfg: XPyDConfig, progress: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.progress = progress or (lambda msg: None)
        tag = uuid.uuid4().hex[:6]
        self.p_engine_ids = [f"P{i}-{tag}" for i in range(cfg.n_prefill)]
        self.d_engine_ids = [f"D{i}-{tag}" for i in range(cfg.n_decode)]
        self.p_specs: list[EngineSpec] = []
        self.d_specs: list[EngineSpec] = []
        self._waves: list[list[EngineSpec]] = []
        self._started: dict[str, Engine] = {}
        #: the engines started so far, in index order
        self.prefills: list[Engine] = []
        self.decodes: list[Engine] = []
        self.routers: dict[str, ManagedProcess] = {}
        self.router_ports: dict[str, int] = {}
        self.startup_s = 0.0

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Starts the routers and the first wave of engines (``start_waves``); the
        others start in ``wait_ready``, each once the one before is ready."""
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self._t0 = time.monotonic()
        self.p_specs = [
            self._spec(f"prefill{i}", "kv_producer", eid, _nth(cfg.p_cpus, i))
            for i, eid in enumerate(self.p_engine_ids)
        ]
        self.d_specs = [
            self._spec(f"decode{i}", "kv_consumer", eid, _nth(cfg.d_cpus, i))
            for i, eid in enumerate(self.d_engine_ids)
        ]
        self._started = {}
        self.prefills, self.decodes = [], []
        self._waves = start_waves(self.p_specs + self.d_specs)
        self._start_engines(self._waves[0])
        self.routers = {}
        for name in cfg.routers:
            port = free_port()
            self.router_ports[name] = port
            if name == "vllm-router":
                argv = self.router_argv(port)
            else:
                argv = self.proxy_argv(port, name == "proxy-sequential")
            self.routers[name] = ManagedProcess(name, argv, cfg.run_dir / f"{name}.log")

    def wait_ready(self) -> float:
        for i, wave in enumerate(self._waves):
            engines = self._start_engines(wave) if i else [self._started[s.name] for s in wave]
            self.wait_engines(engines, self.cfg.run_dir, ENGINE_START_TIMEOUT_S)
        for name, proc in self.routers.items():
            wait_http_ready(f"{self.url(name)}/health", ROUTER_START_TIMEOUT_S, proc)
            self.progress(f"{name} ready on {self.url(name)}")
        self.startup_s = time.monotonic() - self._t0
        return self.startup_s

    def stop(self) -> None:
        for proc in self.routers.values():
            proc.stop()
        for e in self.decodes + self.prefills:
            e.stop()

    def kill_engine(self, engine: Engine) -> None:
        """SIGKILL the engine's whole process group (API server and engine core): a crash."""
        engine.kill(wait_s=10)

    # -- addresses -----------------------------------------------------------------------
    def url(self, router: str) -> str:
        return f"http://127.0.0.1:{self.router_ports[router]}"

    @property
    def proxy_url(self) -> str:
        return self.url("proxy")

    @property
    def router_url(self) -> str:
        return self.url("vllm-router")

    @property
    def engines(self) -> list[Engine]:
        return self.prefills + self.decodes

    # -- command lines -------------------------------------------------------------------
    def proxy_argv(self, port: int, sequential: bool = False) -> list[str]:
        cfg = self.cfg
        argv = [cfg.python, "-m", "vllm_ext.proxy", "--mode", cfg.mode]
        if sequential:
            argv += ["--push-legs", "sequential"]
        for eid, p in zip(self.p_engine_ids, self.p_specs):
            argv += ["--prefill", f"{p.url},engine_id={eid},side_channel_port="
                     f"{p.side_channel_port}"]  # fmt: skip
        for d in self.d_specs:
            argv += ["--decode", d.url]
        return argv + ["--host", "127.0.0.1", "--port", str(port), *cfg.proxy_extra_args]

    def router_argv(self, port: int) -> list[str]:
        binary = vllm_router_binary(self.cfg.python)
        if binary is None:
            raise FileNotFoundError(
                "vllm-router is not installed (pip install vllm-router, or the `router` "
                "extra of vllm-ext)"
            )
        argv = [binary, "--vllm-pd-disaggregation"]
        for p in self.p_specs:
            argv += ["--prefill", p.url]
        for d in self.d_specs:
            argv += ["--decode", d.url]
        return argv + [
            "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            *self.cfg.router_args,
        ]  # fmt: skip

    # -- helpers -------------------------------------------------------------------------
    def _start_engines(self, specs: list[EngineSpec]) -> list[Engine]:
        engines = [start_engine(spec, self.cfg.run_dir) for spec in specs]
        self._started.update((e.spec.name, e) for e in engines)
        self.prefills = [self._started[s.name] for s in self.p_specs if s.name in self._started]
        self.decodes = [self._started[s.name] for s in self.d_specs if s.name in self._started]
        return engines

    def _spec(self, name: str, role: str, engine_id: str, cpu: int | None) -> EngineSpec:
        cfg = self.cfg
        p_own = cfg.p_connector if role == "kv_producer" else None
        kv = kv_transfer_config(
            p_own or cfg.connector, role, engine_id, cfg.extra_config,
            module_path=cfg.p_connector_module_path if p_own else None,
        )  # fmt: skip
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
        pin_to_core(spec, cpu)
        return spec


def start_waves(specs: list[EngineSpec]) -> list[list[EngineSpec]]:
    """The engines in waves, in order, no two of a wave bound to one core (engines bound
    to none all start in the first). An engine's start keeps its core busy, and two
    starting on one core slow each other down by more than half: two push pairs (P on
    core 0, D on core 1) started at once were ready in 167 s here, one pair in 69 s."""
    waves: list[list[EngineSpec]] = []
    for spec in specs:
        wave = next(
            (w for w in waves if spec.cpu is None or all(s.cpu != spec.cpu for s in w)), None
        )
        if wave is None:
            waves.append([spec])
        else:
            wave.append(spec)
    return waves


def _nth(cpus: list[int | None], i: int) -> int | None:
    return cpus[min(i, len(cpus) - 1)] if cpus else None
