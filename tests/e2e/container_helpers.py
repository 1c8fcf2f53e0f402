# SPDX-License-Identifier: Apache-2.0
"""P, D, the proxy and a reference engine as podman containers on one container network
(the images of ``tools/images.py``): the engines' command lines and variables are the
ones ``devkit.launch`` gives the engines of the other e2e tests, with each container's
own address for the side channel. Every container and the network are removed by id
at the end; each server's port is published on 127.0.0.1 only."""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support import REPO

if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))
import images  # noqa: E402  (tools/images.py)

from devkit.launch.engine import EngineSpec, saved_dtype  # noqa: E402
from devkit.launch.process import free_port  # noqa: E402
from vllm_ext import EXT_CONNECTOR_NAME  # noqa: E402

ENGINE_IMAGE = images.RECIPES["engine-cpu"][1]
PROXY_IMAGE = images.RECIPES["proxy"][1]
#: where the model is mounted in the engines
MODEL_IN_CONTAINER = "/models/tiny"
ENGINE_PORT = 8100
SIDE_CHANNEL_PORT = 5601
PROXY_PORT = 8000
#: proxy processes (``--workers``) in the proxy's container
PROXY_WORKERS = 2
#: NIXL's UCX between containers: TCP over the container network (no shared memory or
#: CMA across their namespaces), as the manifests' base does on the pod network
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
START_TIMEOUT_S = 600.0
#: the e2e tests' short lease and watchdog (pd_helpers.TEST_EXTRA_CONFIG)
EXTRA_CONFIG = {"kv_lease_duration": 8, "push_registration_timeout_s": 20}


def container_marks(timeout_s: int, slow: bool) -> list[pytest.MarkDecorator]:
    """The marks of a test module that runs containers: e2e, slow (FULL=1 only) where
    asked, bounded in time, and skipped (with podman's reason) where podman cannot run
    a container, unless ``VLLM_EXT_REQUIRE_PODMAN`` is set (ci/test.sh under FULL=1,
    which installs podman): then that is a failure."""
    why = images.podman_works()
    required = os.environ.get("VLLM_EXT_REQUIRE_PODMAN") == "1"
    return [
        pytest.mark.e2e,
        *([pytest.mark.slow] if slow else []),
        pytest.mark.timeout(timeout_s),
        pytest.mark.skipif(why is not None and not required, reason=f"no container engine: {why}"),
    ]


@functools.cache
def ensure_images() -> dict[str, float]:
    """Build the base and both CPU images (``tools/images.py``), once per session; the
    seconds each took (a few where podman's layers are up to date)."""
    took = {"base": images.build_base()}
    for name in ("engine-cpu", "proxy"):
        took[name] = images.build_image(name)
    print(f"image builds (s): {took}")
    return took


def readable_copy(src: Path, dst: Path) -> Path:
    """A copy of a folder that every container user may read (the model cache's
    folders are private)."""
    shutil.copytree(src, dst)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


def podman(*args: str, timeout: float = 120, check: bool = True) -> str:
    out = subprocess.run(
        ["podman", *args], env=images.podman_env(), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    if check and out.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ...: {out.stderr.strip()[-2000:]}")
    return out.stdout.strip()


@dataclasses.dataclass
class Container:
    name: str
    ip: str
    #: published on 127.0.0.1 (the container's server port -> this host's port)
    host_port: int
    cid: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.host_port}"

    def running(self) -> bool:
        state = podman("inspect", "-f", "{{.State.Running}}", self.cid, check=False)
        return state == "true"


class ContainerPD:
    """A push 1P1D as three containers plus one plain engine (the reference), on a
    podman network of its own. ``start()`` then ``wait_ready()``; ``stop()`` always."""

    def __init__(self, model: Path, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.tag = f"vllm-ext-e2e-{os.getpid()}-{random.randrange(1 << 16):04x}"
        self.subnet = ipaddress.ip_network(
            f"10.{random.randrange(90, 250)}.{random.randrange(256)}.0/24"
        )
        hosts = list(self.subnet.hosts())
        self.network_id = ""
        self.containers: list[Container] = []
        self.model = readable_copy(model, run_dir / "model")
        self.dtype = saved_dtype(str(model))
        self.p = Container("prefill", str(hosts[10]), free_port())
        self.d = Container("decode", str(hosts[11]), free_port())
        self.single = Container("single", str(hosts[12]), free_port())
        self.proxy = Container("proxy", str(hosts[13]), free_port())
        self.p_engine_id = f"prefill-{self.tag}"

    # -- what each container runs ------------------------------------------------------
    def engine_spec(self, c: Container, kv: dict | None, cpu: int) -> EngineSpec:
        return EngineSpec(
            name=c.name, model=MODEL_IN_CONTAINER, port=ENGINE_PORT,
            kv_transfer_config=kv, side_channel_port=SIDE_CHANNEL_PORT if kv else 0,
            cpu=cpu, host=c.ip, side_channel_host=c.ip, python="python3", dtype=self.dtype,
        )  # fmt: skip

    @staticmethod
    def engine_args(spec: EngineSpec) -> list[str]:
        """The server's arguments (the image's entry point is the server module)."""
        argv = spec.argv()
        return argv[argv.index("vllm.entrypoints.openai.api_server") + 1 :]

    def engine_env(self, spec: EngineSpec) -> dict[str, str]:
        """What the launcher sets for the engine (not what this process inherits); the
        image's own cache folder instead of the run folder's."""
        env = {k: v for k, v in spec.env(self.run_dir).items() if os.environ.get(k) != v}
        env.pop("VLLM_CACHE_ROOT", None)
        return {**env, **UCX_ENV}

    def kv(self, role: str, engine_id: str) -> dict:
        return {
            "kv_connector": EXT_CONNECTOR_NAME,
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "engine_id": engine_id,
            "kv_connector_extra_config": dict(EXTRA_CONFIG),
        }

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self.network_id = podman("network", "create", "--subnet", str(self.subnet), self.tag)
        # P's OMP threads on core 0, D's and the reference's on core 1 (as the other
        # e2e tests)
        for c, kv, cpu in (
            (self.p, self.kv("kv_producer", self.p_engine_id), 0),
            (self.d, self.kv("kv_consumer", f"decode-{self.tag}"), 1),
            (self.single, None, 1),
        ):
            spec = self.engine_spec(c, kv, cpu)
            env = [f"--env={k}={v}" for k, v in sorted(self.engine_env(spec).items())]
            # vLLM's engine core talks to its workers through /dev/shm (160 MiB here;
            # podman's default is 64 MiB; the manifests mount an 8 GiB one)
            # No --cpuset-cpus: vLLM 0.32's NIXL worker on CPU moves a thread to the last
            # core of each NUMA node, which a container limited to others may not use
            # (EINVAL at the engine's start); the OMP threads are bound to `cpu` instead.
            self._run(c, ENGINE_PORT, [*env, "--shm-size=1g",
                                       f"--volume={self.model}:{MODEL_IN_CONTAINER}:ro",
                                       ENGINE_IMAGE, *self.engine_args(spec)])  # fmt: skip
        # the proxy as the manifests run it (a read-only root file system, non-root),
        # with two workers: their shared metrics folder needs a writable /tmp (an
        # emptyDir there on Kubernetes, deploy/k8s/README.md)
        self._run(self.proxy, PROXY_PORT, [
            "--read-only", "--read-only-tmpfs=false", "--tmpfs=/tmp",
            PROXY_IMAGE,
            "--mode", "push",
            "--workers", str(PROXY_WORKERS),
            "--prefill", f"http://{self.p.ip}:{ENGINE_PORT}",
            "--decode", f"http://{self.d.ip}:{ENGINE_PORT}",
            "--p-engine-id", self.p_engine_id,
            "--p-host", self.p.ip,
            "--p-side-channel-port", str(SIDE_CHANNEL_PORT),
            "--host", self.proxy.ip, "--port", str(PROXY_PORT),
        ])  # fmt: skip

    def _run(self, c: Container, port: int, args: list[str]) -> None:
        c.cid = podman(
            "run", "--detach", f"--name={self.tag}-{c.name}", f"--network={self.tag}",
            f"--ip={c.ip}", f"--publish=127.0.0.1:{c.host_port}:{port}", *args,
        )  # fmt: skip
        self.containers.append(c)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> float:
        """Until every container's /health answers 200 (the proxy's once both engines
        do); fails at once if a container exits. Returns the seconds waited."""
        t0 = time.monotonic()
        waiting = list(self.containers)
        while waiting:
            for c in list(waiting):
                try:
                    with urllib.request.urlopen(f"{c.url}/health", timeout=5) as r:
                        if r.status == 200:
                            waiting.remove(c)
                            continue
                except (OSError, urllib.error.URLError):
                    pass
                if not c.running():
                    raise RuntimeError(f"container {c.name} exited:\n{self.logs(c)[-3000:]}")
            if time.monotonic() - t0 > timeout:
                names = [c.name for c in waiting]
                raise TimeoutError(f"not ready after {timeout:.0f} s: {names}")
            time.sleep(2)
        return time.monotonic() - t0

    def logs(self, c: Container) -> str:
        return podman("logs", c.cid, check=False, timeout=60)

    def stop(self) -> None:
        """Save each container's log to the run folder, then remove the containers and
        the network by id."""
        for c in self.containers:
            (self.run_dir / f"{c.name}.log").write_text(self.logs(c))
        for c in self.containers:
            podman("rm", "--force", "--time=10", c.cid, check=False, timeout=120)
        if self.network_id:
            podman("network", "rm", self.network_id, check=False)
