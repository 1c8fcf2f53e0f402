# SPDX-License-Identifier: Apache-2.0
"""A 1P1D deployment built for fault injection: :class:`FaultPair`.

P, D and the proxy are started by the one pair launcher
(:class:`~devkit.launch.pd.PDDeployment`: own process groups, own logs, stopped by
PID, a start stuck on a taken port tried again); this module adds what faults need:

* the fault hooks of :mod:`~devkit.testing.faults.nixl_shim` loaded in both
  engines (``sitehook`` first on ``PYTHONPATH``), driven by :meth:`FaultPair.rules`
  and observed through :meth:`FaultPair.events`;
* ``/collective_rpc`` on (``VLLM_SERVER_DEV_MODE=1``) for the connector table
  sizes of :mod:`~devkit.testing.faults.introspect` (:meth:`FaultPair.tables`);
* ``net="netns"``: P and D in namespaces of their own, KV over a link the test
  can cut or shape (:mod:`~devkit.testing.faults.netns`); ``"loopback"``: all on
  127.0.0.1 as in the other e2e tests;
* :meth:`FaultPair.kill` (SIGKILL of an engine's process group) and
  :meth:`FaultPair.restart` (the same spec again: same engine id, ports and
  addresses, as a restarted pod), without touching the other engine.

A :class:`Stack` says which vLLM and connector the engines run: ours on the
primary pin, or vLLM 0.32's own ``NixlPushConnector`` behind the proxy variant the
benchmark uses for it (``devkit.bench.vllm_push_proxy``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import vllm_ext
from devkit.launch.engine import ENGINE_START_TIMEOUT_S, Engine, EngineSpec, start_engine
from devkit.launch.http import metric, scrape_metrics
from devkit.launch.pd import SHORT_TIMEOUTS_CONFIG, PDConfig, PDDeployment
from devkit.launch.process import ManagedProcess, free_port, wait_http_ready
from devkit.testing.faults import introspect, netns, nixl_shim
from vllm_ext.proxy.config import PrefillCoordinates

__all__ = ["STACKS", "FaultPair", "PairConfig", "Stack", "metric"]

SITEHOOK = Path(__file__).parent / "sitehook"
REPO_ROOT = Path(vllm_ext.__file__).resolve().parent.parent
ROLES = ("prefill", "decode")
Net = Literal["loopback", "netns"]

#: The e2e tests' short lease and watchdog (``SHORT_TIMEOUTS_CONFIG``), so a lost push
#: ends in seconds; both connectors read them (vLLM's own by its name,
#: ``Stack.key_names``). A P that stops renewing (hung, cut off) is noticed 10 s after
#: its last PUSH_HB (ours only).
FAULT_EXTRA_CONFIG: dict[str, Any] = {**SHORT_TIMEOUTS_CONFIG, "push_heartbeat_timeout_s": 10}
#: D's KV pool, in blocks of 128 tokens: small, so "D out of blocks" is reachable
#: and freed blocks are reused soon.
D_NUM_BLOCKS = 96
#: The proxy's bound on a leg: a request nobody ends gets a 504 after this.
LEG_IDLE_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class Stack:
    """Which engines and proxy a fault run uses."""

    name: str
    pin: str
    connector: str
    proxy_module: str = "vllm_ext.proxy"
    #: PUSH_REG keys naming D's engine id and side-channel port (for ``rewrite``)
    reg_engine_key: str = "engine_id"
    reg_port_key: str = "port"
    #: side-channel query of the engines' vLLM: (msg, rank) = 2, (msg, pp, tp) = 3
    side_channel_query: int = 2
    #: D legs need ``remote_request_id`` (vLLM 0.32's push; see vllm_push_proxy)
    d_leg_remote_request_id: bool = False
    #: our ``kv_connector_extra_config`` key -> the name this stack's connector reads
    key_names: tuple[tuple[str, str], ...] = ()
    about: str = ""


STACKS: dict[str, Stack] = {
    s.name: s
    for s in (
        Stack("ours", "0.23.0", "ExtNixlPushConnector",
              about="vllm-ext's push connector (this checkout) on vLLM 0.23.0"),
        Stack("vllm-push-0.32", "0.32.0", "NixlPushConnector",
              proxy_module="devkit.bench.vllm_push_proxy",
              reg_engine_key="decode_engine_id", reg_port_key="decode_port",
              side_channel_query=3, d_leg_remote_request_id=True,
              key_names=(("push_registration_timeout_s", "push_registration_timeout"),),
              about="vLLM 0.32.0's own NixlPushConnector"),
    )
}  # fmt: skip


@dataclasses.dataclass
class PairConfig:
    stack: Stack
    model: str
    run_dir: Path
    python: str = sys.executable
    net: Net = "loopback"
    extra_config: dict[str, Any] = dataclasses.field(
        default_factory=lambda: dict(FAULT_EXTRA_CONFIG)
    )
    max_model_len: int = 4096
    d_num_blocks: int | None = D_NUM_BLOCKS
    p_cpu: int | None = 0
    d_cpu: int | None = 1
    proxy_args: list[str] = dataclasses.field(
        default_factory=lambda: [
            "--decode-idle-timeout", str(LEG_IDLE_TIMEOUT_S),
            "--prefill-timeout", str(LEG_IDLE_TIMEOUT_S),
        ]
    )  # fmt: skip


class FaultPair:
    """``with FaultPair(cfg) as pair: ...`` starts P, D and the proxy (a
    :class:`~devkit.launch.pd.PDDeployment`) and always stops them."""

    def __init__(self, cfg: PairConfig, progress: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.say = progress or (lambda msg: None)
        tag = uuid.uuid4().hex[:6]
        self.faults_dir = cfg.run_dir / "faults"
        self.topology: netns.Topology | None = None
        #: each engine's starts so far (the pair's own start is the first)
        self.starts: dict[str, int] = {r: 1 for r in ROLES}
        self.num_blocks: dict[str, int] = {}
        self.deployment = PDDeployment(self._pd_config(f"P-{tag}", f"D-{tag}"), self.say)

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> FaultPair:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.faults_dir.mkdir(parents=True, exist_ok=True)
        if self.cfg.net == "netns":
            self.topology = netns.Topology().create()
            self.say(f"namespaces {self.topology.ns('prefill')}, {self.topology.ns('decode')}")
        for role in ROLES:
            self.rules(role, [])
        self.deployment.__enter__()  # P and D at once, then the proxy
        for role in ROLES:
            self._count_blocks(role)

    def stop(self) -> None:
        self.deployment.stop()
        if self.topology is not None:
            self.topology.destroy()

    def kill(self, role: str) -> None:
        """SIGKILL the engine's whole process group (API server and engine core): a crash."""
        self.engine(role).kill()

    def restart(self, role: str) -> float:
        """Start the engine again with the same spec (engine id, ports, address); the
        other engine and the proxy keep running. Returns the seconds it took."""
        return self.restart_all((role,))

    def restart_all(self, roles: tuple[str, ...] = ROLES) -> float:
        """Restart the engines at once (same specs; default both); the proxy keeps
        running. Returns the seconds it took."""
        t0 = time.monotonic()
        for role in roles:
            self.engine(role).stop()
        for role in roles:
            self.starts[role] += 1  # a restart gets a log of its own; the compile cache stays
            spec = dataclasses.replace(self.specs[role], name=f"{role}-{self.starts[role]}")
            spec.cache_root = self.cfg.run_dir / f"cache-{role}"
            setattr(self.deployment, role, start_engine(spec, self.cfg.run_dir))
        engines = [self.engine(role) for role in roles]
        self.deployment.wait_engines(engines, self.cfg.run_dir, ENGINE_START_TIMEOUT_S)
        for role in roles:
            self._count_blocks(role)
        return time.monotonic() - t0

    def engine(self, role: str) -> Engine:
        engine = getattr(self.deployment, role)
        assert isinstance(engine, Engine), role
        return engine

    def pgid(self, role: str) -> int:
        return self.engine(role).proc.pid

    def alive(self, role: str) -> bool:
        return self.engine(role).proc.alive()

    # -- addresses ----------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.deployment.url

    @property
    def engine_ids(self) -> dict[str, str]:
        return {"prefill": self.deployment.p_engine_id, "decode": self.deployment.d_engine_id}

    @property
    def specs(self) -> dict[str, EngineSpec]:
        return {role: self.engine(role).spec for role in ROLES}

    def engine_url(self, role: str) -> str:
        return self.specs[role].url

    def coords(self) -> PrefillCoordinates:
        """P's coordinates as the proxy puts them in a D leg."""
        p = self.specs["prefill"]
        return PrefillCoordinates(
            self.engine_ids["prefill"], p.side_channel_host, p.side_channel_port
        )

    @contextlib.contextmanager
    def extra_proxy(self, **kw: Any) -> Iterator[str]:
        """A second proxy in front of the same engines, whose D legs name another P engine
        id and/or side-channel port (``p_engine_id``, ``p_side_channel_port``); yields
        its URL, stops it after."""
        port = free_port()
        argv = self.deployment.proxy_argv(port, **kw)
        proc = ManagedProcess("proxy-extra", argv, self.cfg.run_dir / "proxy-extra.log")
        try:
            wait_http_ready(f"http://127.0.0.1:{port}/health", 60, proc)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.stop()

    # -- fault hooks ----------------------------------------------------------------------
    def rules(self, role: str, rules: list[dict[str, Any]]) -> None:
        """Replace the engine's fault rules (see nixl_shim); applied within ~20 ms."""
        path = nixl_shim.rules_path(self.faults_dir, role)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rules": rules}))
        tmp.replace(path)

    def clear_rules(self) -> None:
        for role in ROLES:
            self.rules(role, [])

    def events(self, role: str, since: float = 0.0) -> list[dict[str, Any]]:
        path = nixl_shim.events_path(self.faults_dir, role)
        out = []
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    ev = json.loads(line)
                    if ev.get("t", 0) >= since:
                        out.append(ev)
        return out

    def wait_event(
        self,
        role: str,
        pred: Callable[[dict[str, Any]], bool],
        timeout: float,
        since: float = 0.0,
        interval: float = 0.01,
    ) -> dict[str, Any] | None:
        """The first event of ``role`` after ``since`` for which ``pred`` holds (None
        after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        path = nixl_shim.events_path(self.faults_dir, role)
        offset = 0
        while True:
            with contextlib.suppress(OSError), path.open() as f:
                f.seek(offset)
                chunk = f.read()
                complete = chunk[: chunk.rfind("\n") + 1]
                offset += len(complete.encode())
                for line in complete.splitlines():
                    with contextlib.suppress(ValueError):
                        ev = json.loads(line)
                        if ev.get("t", 0) >= since and pred(ev):
                            return ev
            if time.monotonic() > deadline:
                return None
            time.sleep(interval)

    # -- observation ----------------------------------------------------------------------
    def metrics(self, role: str) -> dict[str, float]:
        return scrape_metrics(self.engine_url(role))

    def usage(self, role: str) -> dict[str, float]:
        """KV blocks in use (from ``vllm:kv_cache_usage_perc``), running and waiting."""
        m = self.metrics(role)
        frac = metric(m, "vllm:kv_cache_usage_perc")
        return {
            "blocks": round(frac * self.num_blocks.get(role, 0)),
            "usage": frac,
            "running": metric(m, "vllm:num_requests_running"),
            "waiting": metric(m, "vllm:num_requests_waiting"),
        }

    def request_blocks(self, role: str, timeout: float = 30) -> dict[str, list[int]]:
        """KV block ids per request inside the engine (introspect.request_blocks)."""
        return self._rpc(role, introspect.RPC_BLOCKS, timeout)[0] or {}

    def tables(self, role: str, timeout: float = 30) -> dict[str, int]:
        """Connector table sizes inside the engine (introspect.connector_tables)."""
        results = self._rpc(role, introspect.RPC_METHOD, timeout)
        merged: dict[str, int] = {}
        for rank, tables in enumerate(results):
            for k, v in (tables or {}).items():
                merged[k if rank == 0 else f"rank{rank}:{k}"] = v
        return merged

    def _rpc(self, role: str, method: str, timeout: float) -> list[Any]:
        body = json.dumps({"method": method, "timeout": timeout}).encode()
        req = urllib.request.Request(
            f"{self.engine_url(role)}/collective_rpc", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout + 5) as r:
            return list(json.loads(r.read())["results"])

    def log_path(self, role: str) -> Path:
        return self.engine(role).proc.log_path

    def log_lines(self, role: str, pattern: str, start: int = 0) -> list[str]:
        """Lines of the engine's log (from byte ``start``) matching a regex."""
        rx = re.compile(pattern)
        try:
            with self.log_path(role).open("rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
        except OSError:
            return []
        return [ln for ln in text.splitlines() if rx.search(ln)]

    def log_size(self, role: str) -> int:
        try:
            return self.log_path(role).stat().st_size
        except OSError:
            return 0

    # -- internals ------------------------------------------------------------------------
    def _pd_config(self, p_engine_id: str, d_engine_id: str) -> PDConfig:
        """The launcher's configuration: this stack's connector (its config keys under
        the names it reads) and proxy, the fault hooks, no prefix caching, D's small
        KV pool."""
        cfg = self.cfg
        pythonpath = os.pathsep.join(
            p for p in (str(SITEHOOK), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
        return PDConfig(
            mode="push",
            model=cfg.model,
            run_dir=cfg.run_dir,
            python=cfg.python,
            connector=cfg.stack.connector,
            extra_config={
                dict(cfg.stack.key_names).get(k, k): v for k, v in cfg.extra_config.items()
            },
            enable_prefix_caching=False,
            max_model_len=cfg.max_model_len,
            p_cpu=cfg.p_cpu,
            d_cpu=cfg.d_cpu,
            extra_env={
                "PYTHONPATH": pythonpath,
                nixl_shim.DIR_ENV: str(self.faults_dir),
                "VLLM_SERVER_DEV_MODE": "1",
            },
            engine_ids=(p_engine_id, d_engine_id),
            place=self._place,
            d_extra_args=(
                ["--num-gpu-blocks-override", str(cfg.d_num_blocks)] if cfg.d_num_blocks else []
            ),
            proxy_extra_args=list(cfg.proxy_args),
            proxy_module=cfg.stack.proxy_module,
        )

    def _place(self, spec: EngineSpec) -> None:
        """The engine's name for the NIXL shim; with namespaces, its host there."""
        role = spec.name
        spec.extra_env[nixl_shim.NAME_ENV] = role
        if self.topology is not None:
            spec.wrapper = self.topology.wrapper(role)
            spec.host = self.topology.ctrl_ip(role)
            spec.side_channel_host = self.topology.data_ip(role)
            spec.extra_env.update(self.topology.engine_env(role))

    def _count_blocks(self, role: str) -> None:
        self.num_blocks[role] = _num_blocks(self.metrics(role))
        self.say(f"{role}: {self.num_blocks[role]} KV blocks")


def _num_blocks(m: dict[str, float]) -> int:
    for key in m:
        if key.startswith("vllm:cache_config_info"):
            found = re.search(r'num_gpu_blocks="(\d+)"', key)
            if found:
                return int(found.group(1))
    return 0
