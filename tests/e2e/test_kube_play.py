# SPDX-License-Identifier: Apache-2.0
"""The manifests' pod templates run: ``podman kube play`` of P's, D's and the proxy's
pods from ``deploy/k8s/base`` (rendered as kustomize would; ``kube_pods.cpu_pod`` lists
what the CPU images here need changed) on a container network of their own.

* Every startup, readiness and liveness probe of the three is answered as the kubelet
  asks it.
* Services and DNS: podman creates no Services, and its network's DNS (aardvark-dns)
  answers only A records of container names and network aliases, no SRV record
  (checked with podman 4.3). So a stand-in for the cluster's DNS (``cluster_dns.py``)
  answers what the cluster's DNS publishes for the headless Services over the pods
  played (``kube_pods.cluster_dns_records``), and each pod gets the ``resolv.conf`` the
  kubelet writes. The proxy, with the manifest's own ``--prefill-srv`` /
  ``--decode-srv``, finds P and D through it and serves requests: their tokens equal
  P's own as a plain engine, and the KV crossed from P's pod to D's over NIXL.
* The engines' ``preStop`` hook (which ``kube play`` never runs) is run in P's and D's
  containers as the kubelet runs it (an exec, with the container's environment) while
  a request runs on D: D's returns only once that request is gone, P's (idle) after its
  first wait. (``kube play`` runs no lifecycle hook itself.)
* The proxy's drain with the manifest's flags: after SIGTERM its readiness probe fails,
  requests are still served for ``--shutdown-delay``, then it stops listening.

The tests run in this order (the last one ends the proxy)."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import random
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from container_helpers import (
    PROXY_IMAGE,
    container_marks,
    ensure_images,
    images,
    podman,
    readable_copy,
)
from kube_pods import (
    MODEL_SUBDIR,
    WORKLOADS,
    cluster_dns_records,
    cpu_pod,
    make_probe,
    probes,
    template_pods,
)
from pd_helpers import MAX_TOKENS, metric, scrape_metrics
from support import REPO

from devkit.launch.client import complete
from devkit.launch.engine import saved_dtype

# FULL=1 only, as test_containers.py: 3.5 to 4.5 min here with the images up to date
# (the startup probes answered 130 to 187 s after kube play)
pytestmark = container_marks(2400, slow=True)
#: longest wait for an engine's startup probe (its own budget is 120 x 10 s)
START_TIMEOUT_S = 900.0
E2E = Path(__file__).resolve().parent


@dataclasses.dataclass
class Played:
    """The pods as played: their specs and addresses, by pod name."""

    pods: dict[str, dict[str, Any]]
    ips: dict[str, str]

    def url(self, pod: str) -> str:
        (c,) = self.pods[pod]["spec"]["containers"]
        (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "http"]
        return f"http://{self.ips[pod]}:{port}"

    def container(self, pod: str) -> str:
        """The podman name of the pod's (only) container."""
        (c,) = self.pods[pod]["spec"]["containers"]
        return f"{pod}-{c['name']}"

    def served_model(self, pod: str) -> str:
        (c,) = self.pods[pod]["spec"]["containers"]
        return c["args"][c["args"].index("--served-model-name") + 1]


@pytest.fixture(scope="module")
def played(tiny_model: Path, tmp_path_factory) -> Iterator[Played]:
    ensure_images()
    run = tmp_path_factory.mktemp("kube")
    readable_copy(tiny_model, run / "models" / MODEL_SUBDIR)
    (run / "models").chmod(0o755)
    net = f"vllm-ext-kube-{os.getpid()}-{random.randrange(1 << 16):04x}"
    subnet = ipaddress.ip_network(f"10.{random.randrange(90, 250)}.{random.randrange(256)}.0/24")
    hosts = [str(h) for h in subnet.hosts()]
    ips = hosts[20 : 20 + len(WORKLOADS)]
    dns_ip = hosts[9]
    templates = template_pods()
    dtype = saved_dtype(str(tiny_model))
    pods = [
        cpu_pod(templates[name], run / "models", dtype, ip, run / "volumes", dns_ip)
        for name, ip in zip(WORKLOADS.values(), ips)
    ]
    manifest = run / "pods.yaml"
    manifest.write_text(yaml.safe_dump_all(pods, sort_keys=False))
    records = cluster_dns_records(pods, ips)
    (run / "dns.json").write_text(json.dumps(records, indent=1))
    podman("network", "create", "--subnet", str(subnet), net)
    dns_cid = ""
    try:
        # the cluster's DNS first: the proxy's first look-up finds the engines' records
        dns_cid = podman(
            "run", "--detach", f"--name={net}-dns", f"--network={net}", f"--ip={dns_ip}",
            "--user=0", "--entrypoint=/opt/proxy/bin/python",
            f"--volume={E2E / 'cluster_dns.py'}:/dns/cluster_dns.py:ro",
            f"--volume={REPO / 'tests' / 'unit'}:/dns/unit:ro",
            PROXY_IMAGE, "/dns/cluster_dns.py", dns_ip, json.dumps(records),
        )  # fmt: skip
        ip_args = [f"--ip={ip}" for ip in ips]
        podman("kube", "play", f"--network={net}", *ip_args, str(manifest), timeout=300)
        yield Played({p["metadata"]["name"]: p for p in pods}, dict(zip(WORKLOADS.values(), ips)))
    finally:
        for pod in pods:
            for c in pod["spec"]["containers"]:
                name = f"{pod['metadata']['name']}-{c['name']}"
                (run / f"{name}.log").write_text(podman("logs", name, check=False, timeout=60))
        podman("kube", "down", str(manifest), check=False, timeout=300)
        if dns_cid:
            (run / "dns.log").write_text(podman("logs", dns_cid, check=False, timeout=60))
            podman("rm", "--force", "--time=5", dns_cid, check=False, timeout=120)
        podman("network", "rm", net, check=False)


def _running(played: Played, pod: str) -> bool:
    state = podman("inspect", "-f", "{{.State.Running}}", played.container(pod), check=False)
    return state == "true"


def test_every_probe_of_the_pod_templates_is_answered(played: Played) -> None:
    t0 = time.monotonic()
    # first each startup probe (the others start counting once it succeeds)
    for name, pod in played.pods.items():
        for container, kind, probe in probes(pod):
            if kind != "startupProbe":
                continue
            while (failed := make_probe(pod, container, probe, played.ips[name])) != "":
                assert _running(played, name), (name, "exited", failed)
                assert time.monotonic() - t0 < START_TIMEOUT_S, (name, failed)
                time.sleep(2)
    print(f"pods started in {time.monotonic() - t0:.0f} s")
    answered = []
    for name, pod in played.pods.items():
        for container, kind, probe in probes(pod):
            assert make_probe(pod, container, probe, played.ips[name]) == "", (name, kind)
            answered.append((name, kind))
    # each of the three has a readiness and a liveness probe, the engines a startup one
    assert len(answered) == 8, answered


def _health(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        return {"http_status": e.code, **json.load(e)}


def _outputs(played: Played, url: str, prompts: list[list[int]], max_tokens: int) -> list[Any]:
    model = played.served_model("vllm-prefill-0")
    return [
        complete(url, p, max_tokens=max_tokens, timeout=120, extra={"model": model}).token_ids
        for p in prompts
    ]


def test_the_proxy_finds_p_and_d_by_their_services_srv_records_and_serves(
    played: Played, prompts: list[list[int]]
) -> None:
    proxy = played.url("vllm-pd-proxy")
    # the proxy looks its SRV names up again every --dns-interval (10 s)
    deadline = time.monotonic() + 90
    while True:
        health = _health(proxy)
        names = sorted(e["name"] for e in health.get("engines", []) if e["in_service"])
        if health.get("status") == "ok" and names == ["vllm-decode-0", "vllm-prefill-0"]:
            break
        assert time.monotonic() < deadline, health
        time.sleep(2)
    (p_engine,) = [e for e in health["engines"] if e["role"] == "prefill"]
    assert p_engine["engine_id"] == "vllm-prefill-0"  # the pod's name, as its engine_id
    p = played.url("vllm-prefill-0")
    before = scrape_metrics(p)
    pair = _outputs(played, proxy, prompts, MAX_TOKENS)
    # the reference: P as a plain engine (a request with no kv_transfer_params)
    assert pair == _outputs(played, p, prompts, MAX_TOKENS)
    after = scrape_metrics(p)
    name = "vllm:ext_push_writes_total"
    writes = metric(after, name) - metric(before, name)
    # a WRITE per request from P's pod into D's (a prompt shorter than a block has none)
    assert writes >= len(prompts) - 1
    assert metric(after, "vllm:ext_push_failures_total") == 0


def _prestop_command(played: Played, pod: str) -> list[str]:
    (c,) = played.pods[pod]["spec"]["containers"]
    return c["lifecycle"]["preStop"]["exec"]["command"]


def _stream_until(url: str, body: dict[str, Any], stop_at: float) -> tuple[int, bool]:
    """Stream a completion until ``stop_at`` (``time.monotonic()``), then hang up (vLLM
    aborts the request); the chunks read and whether the request was still running."""
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    chunks = 0
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.strip() == b"data: [DONE]":
                return chunks, False
            chunks += line.startswith(b"data:")
            if time.monotonic() >= stop_at:
                return chunks, True
    return chunks, False


def test_the_engines_prestop_hook_waits_until_the_engine_has_no_request(
    played: Played, prompts: list[list[int]]
) -> None:
    """The hook as the kubelet runs it (an exec in the container, with its environment),
    in P's and D's containers at once, while a request runs on D (sent to D itself)
    until 50 s after the hooks started: D's hook ends only after that request is gone
    (within a poll and the hook's 5 s for KV still crossing), P's (idle) after its first
    wait of 20 s and those 5 s."""
    d = played.url("vllm-decode-0")
    body = {
        "model": played.served_model("vllm-decode-0"), "prompt": prompts[1],
        "max_tokens": 8000 - len(prompts[1]), "temperature": 0, "ignore_eos": True,
        "stream": True,
    }  # fmt: skip
    ended: dict[str, float] = {}
    outputs: dict[str, str] = {}
    t0 = time.monotonic()

    def hook(pod: str) -> None:
        out = subprocess.run(
            ["podman", "exec", played.container(pod), *_prestop_command(played, pod)],
            env=images.podman_env(), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        ended[pod] = time.monotonic() - t0
        outputs[pod] = f"rc={out.returncode} {out.stdout[-500:]} {out.stderr[-1000:]}"

    threads = [
        threading.Thread(target=hook, args=(pod,), daemon=True)
        for pod in ("vllm-prefill-0", "vllm-decode-0")
    ]
    for th in threads:
        th.start()
    chunks, running = _stream_until(d, body, stop_at=t0 + 50)
    ended["request"] = time.monotonic() - t0
    for th in threads:
        th.join(timeout=600)
    print(f"seconds after the hooks started: {ended}; {chunks} chunks streamed")
    assert running, f"the request ended by itself after {chunks} tokens: too short"
    assert all(o.startswith("rc=0 ") for o in outputs.values()), outputs
    # P, idle: its first wait and 5 s (podman exec's start and end and a slow scrape on
    # top), not D's request
    assert 25 <= ended["vllm-prefill-0"] <= 45 and ended["vllm-prefill-0"] < ended["request"], ended
    # D: not before the request is gone plus the 5 s; at most a poll (2 s), a scrape
    # and podman exec's end later
    assert ended["request"] + 4.5 <= ended["vllm-decode-0"] <= ended["request"] + 15, ended


def test_the_proxy_drains_on_sigterm_as_its_probes_expect(
    played: Played, prompts: list[list[int]]
) -> None:
    """Last (it ends the proxy): SIGTERM as the kubelet sends it; readiness 503 at once,
    requests served for ``--shutdown-delay`` (5 s), then no listener."""
    name = "vllm-pd-proxy"
    pod, ip = played.pods[name], played.ips[name]
    readiness = [p for c, kind, p in probes(pod) if kind == "readinessProbe"][0]
    liveness = [p for c, kind, p in probes(pod) if kind == "livenessProbe"][0]
    container = pod["spec"]["containers"][0]["name"]
    assert make_probe(pod, container, readiness, ip) == ""
    podman("kill", "--signal=TERM", played.container(name))
    t0 = time.monotonic()
    while make_probe(pod, container, readiness, ip) == "":
        assert time.monotonic() - t0 < 3, "readiness still 200 after SIGTERM"
        time.sleep(0.1)
    health = _health(played.url(name))
    assert health.get("http_status") == 503 and health["status"] == "draining", health
    assert make_probe(pod, container, liveness, ip) == ""
    # a request that arrives while the Service's endpoints catch up is still served
    # (to its end, which may come after the listener closed)
    assert _outputs(played, played.url(name), prompts[1:2], MAX_TOKENS)
    while make_probe(pod, container, liveness, ip) == "":
        assert time.monotonic() - t0 < 30, "the proxy still listens 30 s after SIGTERM"
        time.sleep(0.2)
    stopped = time.monotonic() - t0  # (an upper bound if the request outlasted the delay)
    print(f"the proxy stopped listening {stopped:.1f} s after SIGTERM")
    assert stopped >= 4.5
