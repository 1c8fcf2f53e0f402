# SPDX-License-Identifier: Apache-2.0
"""A 1P1D deployment built for fault injection: :class:`FaultPair`.

P, D and the proxy as real processes (the launcher's ``EngineSpec`` /
``ManagedProcess``: own process group, own log, stopped by PID), with:

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
import signal
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import vllm_ext
from devkit.launch.engine import (
    ENGINE_START_TIMEOUT_S,
    Engine,
    EngineSpec,
    kv_transfer_config,
    pin_to_core,
    start_engine,
)
from devkit.launch.http import metric, scrape_metrics
from devkit.launch.process import ManagedProcess, ProcessStuck, free_port, wait_http_ready
from devkit.launch.proxy_cmd import pair_proxy_argv
from devkit.testing.faults import introspect, netns, nixl_shim
from vllm_ext.proxy.config import PrefillCoordinates

SITEHOOK = Path(__file__).parent / "sitehook"
REPO_ROOT = Path(vllm_ext.__file__).resolve().parent.parent
ROLES = ("prefill", "decode")
Net = Literal["loopback", "netns"]

#: Short lease and watchdog, the e2e tests' values (tests/e2e/pd_helpers.py), so a
#: lost push ends in seconds; both connectors read the first two keys (vLLM's own by
#: its name, ``Stack.key_names``). A P that stops renewing (hung, cut off) is noticed
#: 10 s after its last PUSH_HB (ours only).
FAULT_EXTRA_CONFIG: dict[str, Any] = {
    "kv_lease_duration": 8,
    "push_registration_timeout_s": 20,
    "push_heartbeat_timeout_s": 10,
}
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
    """``with FaultPair(cfg) as pair: ...`` starts P, D and the proxy and always stops them."""

    def __init__(self, cfg: PairConfig, progress: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.say = progress or (lambda msg: None)
        tag = uuid.uuid4().hex[:6]
        self.engine_ids = {"prefill": f"P-{tag}", "decode": f"D-{tag}"}
        self.faults_dir = cfg.run_dir / "faults"
        self.topology: netns.Topology | None = None
        self.specs: dict[str, EngineSpec] = {}
        self.engines: dict[str, Engine] = {}
        self.proxy: ManagedProcess | None = None
        self.proxy_port = 0
        self.starts: dict[str, int] = {r: 0 for r in ROLES}
        self.num_blocks: dict[str, int] = {}

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
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.faults_dir.mkdir(parents=True, exist_ok=True)
        if cfg.net == "netns":
            self.topology = netns.Topology().create()
            self.say(f"namespaces {self.topology.ns('prefill')}, {self.topology.ns('decode')}")
        for role in ROLES:
            self.specs[role] = self._spec(role)
            self.rules(role, [])
        for role in ROLES:
            self._start_engine(role)
        for role in ROLES:
            try:
                self._wait_engine(role)
            except ProcessStuck as e:  # a port taken between vLLM's pick and its bind
                self.say(f"{e}; starting {role} again with fresh ports")
                self.engines[role].stop()
                self.specs[role] = self._spec(role)
                self._start_engine(role)
                self._wait_engine(role)
        self._start_proxy()

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for e in self.engines.values():
            e.stop()
        if self.topology is not None:
            self.topology.destroy()

    def kill(self, role: str) -> None:
        """SIGKILL the engine's whole process group (API server and engine core): a crash."""
        proc = self.engines[role].proc
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.proc.wait(15)

    def restart(self, role: str) -> float:
        """Start the engine again with the same spec (engine id, ports, address); the
        other engine and the proxy keep running. Returns the seconds it took."""
        t0 = time.monotonic()
        self.engines[role].stop()
        self._start_engine(role)
        self._wait_engine(role)
        return time.monotonic() - t0

    def restart_all(self) -> float:
        """Restart both engines at once (same specs); the proxy keeps running."""
        t0 = time.monotonic()
        for role in ROLES:
            self.engines[role].stop()
        for role in ROLES:
            self._start_engine(role)
        for role in ROLES:
            self._wait_engine(role)
        return time.monotonic() - t0

    def pgid(self, role: str) -> int:
        return self.engines[role].proc.pid

    def alive(self, role: str) -> bool:
        return self.engines[role].proc.alive()

    # -- addresses ----------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def engine_url(self, role: str) -> str:
        return self.specs[role].url

    def coords(self) -> PrefillCoordinates:
        """P's coordinates as the proxy puts them in a D leg."""
        p = self.specs["prefill"]
        return PrefillCoordinates(
            self.engine_ids["prefill"], p.side_channel_host, p.side_channel_port
        )

    def proxy_argv(
        self, port: int, p_side_channel_port: int | None = None, p_engine_id: str | None = None
    ) -> list[str]:
        p = self.specs["prefill"]
        return pair_proxy_argv(
            self.cfg.python, port, prefill_url=p.url, decode_url=self.specs["decode"].url,
            p_engine_id=p_engine_id or self.engine_ids["prefill"],
            p_side_channel_port=p_side_channel_port or p.side_channel_port,
            module=self.cfg.stack.proxy_module,
            options=["--p-host", p.side_channel_host, *self.cfg.proxy_args],
        )  # fmt: skip

    @contextlib.contextmanager
    def extra_proxy(self, **kw: Any) -> Iterator[str]:
        """A second proxy in front of the same engines, whose D legs name another P engine
        id and/or side-channel port; yields its URL, stops it after."""
        port = free_port()
        proc = ManagedProcess(
            "proxy-extra", self.proxy_argv(port, **kw), self.cfg.run_dir / "proxy-extra.log"
        )
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
        return self.engines[role].proc.log_path

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
    def _spec(self, role: str) -> EngineSpec:
        cfg = self.cfg
        kv = kv_transfer_config(
            cfg.stack.connector,
            "kv_producer" if role == "prefill" else "kv_consumer",
            self.engine_ids[role],
            {dict(cfg.stack.key_names).get(k, k): v for k, v in cfg.extra_config.items()},
        )
        cpu = cfg.p_cpu if role == "prefill" else cfg.d_cpu
        pythonpath = os.pathsep.join(
            p for p in (str(SITEHOOK), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
        env = {
            "PYTHONPATH": pythonpath,
            nixl_shim.DIR_ENV: str(self.faults_dir),
            nixl_shim.NAME_ENV: role,
            "VLLM_SERVER_DEV_MODE": "1",
        }
        spec = EngineSpec(
            name=role,
            model=cfg.model,
            kv_transfer_config=kv,
            cpu=cpu,
            max_model_len=cfg.max_model_len,
            enable_prefix_caching=False,
            python=cfg.python,
            extra_env=env,
        )
        if role == "decode" and cfg.d_num_blocks:
            spec.extra_args += ["--num-gpu-blocks-override", str(cfg.d_num_blocks)]
        spec.wrapper = []
        if self.topology is not None:
            spec.wrapper = self.topology.wrapper(role)
            spec.host = self.topology.ctrl_ip(role)
            spec.side_channel_host = self.topology.data_ip(role)
            env.update(self.topology.engine_env(role))
        pin_to_core(spec, cpu)
        return spec

    def _start_engine(self, role: str) -> None:
        self.starts[role] += 1
        spec = self.specs[role]
        if self.starts[role] > 1:  # keep the first log; a restart gets its own
            spec = dataclasses.replace(spec, name=f"{role}-{self.starts[role]}")
            spec.cache_root = self.cfg.run_dir / f"cache-{role}"
        self.engines[role] = start_engine(spec, self.cfg.run_dir)

    def _wait_engine(self, role: str) -> None:
        e = self.engines[role]
        waited = e.wait_ready(
            ENGINE_START_TIMEOUT_S,
            progress=lambda s: self.say(f"waiting for {role} ({s:.0f}s; {e.proc.log_path})"),
        )
        self.num_blocks[role] = _num_blocks(self.metrics(role))
        self.say(f"{role} ready in {waited:.0f}s on {e.url} ({self.num_blocks[role]} KV blocks)")

    def _start_proxy(self) -> None:
        self.proxy_port = free_port()
        self.proxy = ManagedProcess(
            "proxy", self.proxy_argv(self.proxy_port), self.cfg.run_dir / "proxy.log"
        )
        wait_http_ready(f"{self.url}/health", 60, self.proxy)


def _num_blocks(m: dict[str, float]) -> int:
    for key in m:
        if key.startswith("vllm:cache_config_info"):
            found = re.search(r'num_gpu_blocks="(\d+)"', key)
            if found:
                return int(found.group(1))
    return 0
