# SPDX-License-Identifier: Apache-2.0
"""The manifests' pod templates run: ``podman kube play`` of P's, D's and the proxy's
pods from ``deploy/k8s/base`` (rendered as kustomize would; ``kube_pods.cpu_pod`` lists
what the CPU images here need changed) on a container network of their own, and every
startup, readiness and liveness probe of the three is answered as the kubelet asks it.
The proxy finds no engine here (no cluster DNS for its SRV names): its probes are
answered all the same (its readiness does not follow the engines)."""

from __future__ import annotations

import ipaddress
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from container_helpers import container_marks, ensure_images, podman, readable_copy
from kube_pods import MODEL_SUBDIR, WORKLOADS, cpu_pod, make_probe, probes, template_pods

from devkit.launch.engine import saved_dtype

# in the default e2e run: 94 to 130 s here with the images up to date
pytestmark = container_marks(2400, slow=True)  # FULL=1 only, as test_containers.py
#: longest wait for an engine's startup probe (its own budget is 120 x 10 s)
START_TIMEOUT_S = 900.0


@pytest.fixture(scope="module")
def played(tiny_model: Path, tmp_path_factory) -> Iterator[tuple[list[dict[str, Any]], list[str]]]:
    """The pods as played, and each one's address."""
    ensure_images()
    run = tmp_path_factory.mktemp("kube")
    readable_copy(tiny_model, run / "models" / MODEL_SUBDIR)
    (run / "models").chmod(0o755)
    net = f"vllm-ext-kube-{os.getpid()}-{random.randrange(1 << 16):04x}"
    subnet = ipaddress.ip_network(f"10.{random.randrange(90, 250)}.{random.randrange(256)}.0/24")
    ips = [str(h) for h in list(subnet.hosts())[20 : 20 + len(WORKLOADS)]]
    templates = template_pods()
    dtype = saved_dtype(str(tiny_model))
    pods = [
        cpu_pod(templates[name], run / "models", dtype, ip, run / "volumes")
        for name, ip in zip(WORKLOADS.values(), ips)
    ]
    manifest = run / "pods.yaml"
    manifest.write_text(yaml.safe_dump_all(pods, sort_keys=False))
    podman("network", "create", "--subnet", str(subnet), net)
    try:
        ip_args = [f"--ip={ip}" for ip in ips]
        podman("kube", "play", f"--network={net}", *ip_args, str(manifest), timeout=300)
        yield pods, ips
    finally:
        for pod in pods:
            for c in pod["spec"]["containers"]:
                name = f"{pod['metadata']['name']}-{c['name']}"
                (run / f"{name}.log").write_text(podman("logs", name, check=False, timeout=60))
        podman("kube", "down", str(manifest), check=False, timeout=300)
        podman("network", "rm", net, check=False)


def _running(pod: dict[str, Any], container: str) -> bool:
    name = f"{pod['metadata']['name']}-{container}"
    return podman("inspect", "-f", "{{.State.Running}}", name, check=False) == "true"


def test_every_probe_of_the_pod_templates_is_answered(played) -> None:
    pods, ips = played
    t0 = time.monotonic()
    # first each startup probe (the others start counting once it succeeds)
    for pod, ip in zip(pods, ips):
        for container, kind, probe in probes(pod):
            if kind != "startupProbe":
                continue
            while (failed := make_probe(pod, container, probe, ip)) != "":
                assert _running(pod, container), (pod["metadata"]["name"], "exited", failed)
                assert time.monotonic() - t0 < START_TIMEOUT_S, (pod["metadata"]["name"], failed)
                time.sleep(2)
    print(f"pods started in {time.monotonic() - t0:.0f} s")
    answered = []
    for pod, ip in zip(pods, ips):
        for container, kind, probe in probes(pod):
            assert make_probe(pod, container, probe, ip) == "", (pod["metadata"]["name"], kind)
            answered.append((pod["metadata"]["name"], kind))
    # each of the three has a readiness and a liveness probe, the engines a startup one
    assert len(answered) == 8, answered
