# SPDX-License-Identifier: Apache-2.0
"""The pod templates of ``deploy/k8s/base`` (rendered as kustomize would) as pods that
``podman kube play`` runs with the CPU images: one pod per workload (P's first replica,
D's, the proxy's), each the template's spec with only what a CPU engine on this machine
needs changed (:func:`cpu_pod` lists every change). Their probes are then made as the
kubelet makes them: from this host to the pod's address, on the port the probe names."""

from __future__ import annotations

import copy
import importlib.util
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from container_helpers import ENGINE_IMAGE, PROXY_IMAGE
from support import REPO

BASE = REPO / "deploy" / "k8s" / "base"
#: the model directory the engines' pod templates name (``--model``) inside the claim
MODEL_SUBDIR = "Qwen3-8B"
#: workload -> the pod's name (a StatefulSet's first pod is <name>-0)
WORKLOADS = {"vllm-prefill": "vllm-prefill-0", "vllm-decode": "vllm-decode-0",
             "vllm-pd-proxy": "vllm-pd-proxy"}  # fmt: skip
#: the namespace the README applies the manifests in, and Kubernetes' default domain
NAMESPACE = "vllm-pd"
CLUSTER_DOMAIN = "cluster.local"


def render_base() -> list[dict[str, Any]]:
    """The objects of ``deploy/k8s/base`` (the renderer of the k8s-manifests hook)."""
    spec = importlib.util.spec_from_file_location(
        "check_k8s_manifests", REPO / "ci" / "hooks" / "check_k8s_manifests.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.render_kustomization(BASE)


def template_pods() -> dict[str, dict[str, Any]]:
    """Pod name -> a Pod of that workload's template, unchanged."""
    pods = {}
    for obj in render_base():
        name = obj["metadata"]["name"]
        if obj["kind"] in ("StatefulSet", "Deployment") and name in WORKLOADS:
            template = obj["spec"]["template"]
            pods[WORKLOADS[name]] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": WORKLOADS[name], "labels": template["metadata"]["labels"]},
                "spec": copy.deepcopy(template["spec"]),
            }
    assert set(pods) == set(WORKLOADS.values()), sorted(pods)
    return pods


def kubelet_env(pod: dict[str, Any], ip: str) -> None:
    """What the kubelet does and podman 4.3's ``kube play`` does not: the downward API's
    ``status.podIP`` (``ip``, given to ``kube play --ip``) and ``metadata.name`` as
    values, and ``$(VAR)`` references to earlier variables expanded in variables,
    ``command`` and ``args``."""
    fields = {"status.podIP": ip, "metadata.name": pod["metadata"]["name"]}
    for c in pod["spec"]["containers"]:
        known: dict[str, str] = {}

        def expand(text: str, known: dict[str, str] = known) -> str:
            return re.sub(r"\$\((\w+)\)", lambda m: known.get(m[1], m[0]), text)

        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if ref is not None:
                del env["valueFrom"]
                env["value"] = fields[ref]
            env["value"] = expand(env["value"])
            known[env["name"]] = env["value"]
        for key in ("command", "args"):
            if key in c:
                c[key] = [expand(a) for a in c[key]]


def cpu_pod(
    pod: dict[str, Any], models: Path, dtype: str, ip: str, scratch: Path, dns_ip: str
) -> dict[str, Any]:
    """The pod for the CPU images here. Changed, and nothing else: the images' names;
    for an engine, the CUDA-only parts (``--gpu-memory-utilization``, the KV buffer on
    ``cuda``, ``UCX_TLS``'s ``cuda_copy``, the GPU resources) and the model claim (a host
    folder holding the tiny model under the name the arguments use), plus what the
    other CPU e2e engines get (``--enforce-eager``, the model's dtype, a 1 GiB KV cache,
    OpenMP threads bound to one core);
    the resource requests and limits (sized for a GPU host: 8 to 16 cores, 64 GiB); each
    ``emptyDir`` a folder under ``scratch`` that anyone may write, as the kubelet makes
    it (podman 4.3's is root's alone: the engine, not root, could not use its
    ``/dev/shm``); and the kubelet's part that podman lacks: :func:`kubelet_env`, and
    the ``resolv.conf`` the kubelet writes for a pod (``dnsPolicy: ClusterFirst``: the
    cluster's DNS at ``dns_ip``, the namespace's search list, ``ndots:5``), as
    ``dnsConfig``, which ``kube play`` honours."""
    pod = copy.deepcopy(pod)
    for c in pod["spec"]["containers"]:
        c.pop("resources", None)
        if c["image"].startswith("vllm-ext-proxy"):
            c["image"] = PROXY_IMAGE
            continue
        c["image"] = ENGINE_IMAGE
        args = list(c["args"])
        i = args.index("--gpu-memory-utilization")
        del args[i : i + 2]
        args = [a.replace('"kv_buffer_device":"cuda"', '"kv_buffer_device":"cpu"') for a in args]
        c["args"] = [*args, "--enforce-eager", "--dtype", dtype]
        for env in c["env"]:
            if env["name"] == "UCX_TLS":
                env["value"] = ",".join(t for t in env["value"].split(",") if t != "cuda_copy")
        c["env"].append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"})
        # P's OpenMP threads on core 0, D's on core 1, as the other CPU e2e engines
        # (unbound, both engines' threads took both cores of this machine)
        core = "0" if "kv_producer" in " ".join(c["args"]) else "1"
        c["env"].append({"name": "VLLM_CPU_OMP_THREADS_BIND", "value": core})
    for v in pod["spec"].get("volumes", []):
        if "persistentVolumeClaim" in v:
            del v["persistentVolumeClaim"]
            v["hostPath"] = {"path": str(models), "type": "Directory"}
        if "emptyDir" in v:
            del v["emptyDir"]
            folder = scratch / f"{pod['metadata']['name']}-{v['name']}"
            folder.mkdir(parents=True)
            folder.chmod(0o1777)
            v["hostPath"] = {"path": str(folder), "type": "Directory"}
    kubelet_env(pod, ip)
    pod["spec"]["dnsConfig"] = {
        "nameservers": [dns_ip],
        "searches": [f"{NAMESPACE}.svc.{CLUSTER_DOMAIN}", f"svc.{CLUSTER_DOMAIN}", CLUSTER_DOMAIN],
        "options": [{"name": "ndots", "value": "5"}],
    }
    return pod


def cluster_dns_records(pods: list[dict[str, Any]], ips: list[str]) -> dict[str, dict[str, Any]]:
    """What the cluster's DNS publishes for the headless Services of ``deploy/k8s/base``
    over the pods played (all ready), as Kubernetes' DNS specification has it: for each
    named port of a headless Service and each pod its selector selects, an SRV record
    ``_<port>._tcp.<service>.<namespace>.svc.<domain>`` whose target is the pod's
    ``<hostname>.<subdomain>.<namespace>.svc.<domain>`` (a StatefulSet's pod: its own
    name and the StatefulSet's ``serviceName``) at the port the Service's
    ``targetPort`` names in the pod, and that name's A record, the pod's address.
    ``{"srv": {name: [[target, port], ...]}, "a": {name: address}}``."""
    objects = render_base()
    subdomain = {
        WORKLOADS[o["metadata"]["name"]]: o["spec"].get("serviceName")
        for o in objects
        if o["kind"] in ("StatefulSet", "Deployment") and o["metadata"]["name"] in WORKLOADS
    }
    srv: dict[str, list[list[Any]]] = {}
    a: dict[str, str] = {}
    for svc in objects:
        if svc["kind"] != "Service" or svc["spec"].get("clusterIP") != "None":
            continue
        name = svc["metadata"]["name"]
        domain = f"{name}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"
        for pod, ip in zip(pods, ips):
            labels = pod["metadata"]["labels"]
            if not svc["spec"]["selector"].items() <= labels.items():
                continue
            pod_name = pod["metadata"]["name"]
            assert subdomain[pod_name] == name, (pod_name, name)
            target = f"{pod_name}.{domain}"
            a[target] = ip
            for sp in svc["spec"]["ports"]:
                (container,) = pod["spec"]["containers"]
                port = probe_port(pod, container["name"], sp["targetPort"])
                srv.setdefault(f"_{sp['name']}._tcp.{domain}", []).append([target, port])
    return {"srv": srv, "a": a}


def probes(pod: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(container, kind, probe) for every probe of the pod."""
    out = []
    for c in pod["spec"]["containers"]:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in c:
                out.append((c["name"], kind, c[kind]))
    return out


def probe_port(pod: dict[str, Any], container: str, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == container]
    (p,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    return int(p)


def make_probe(pod: dict[str, Any], container: str, probe: dict[str, Any], ip: str) -> str:
    """The probe made as the kubelet makes it (``httpGet``: 200-399 succeeds;
    ``tcpSocket``: a connection); '' on success, else what failed."""
    timeout = probe.get("timeoutSeconds", 1)
    if "httpGet" in probe:
        get = probe["httpGet"]
        url = f"http://{ip}:{probe_port(pod, container, get['port'])}{get.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return "" if 200 <= r.status < 400 else f"{url}: {r.status}"
        except (OSError, urllib.error.URLError) as e:
            return f"{url}: {e}"
    if "tcpSocket" in probe:
        port = probe_port(pod, container, probe["tcpSocket"]["port"])
        try:
            socket.create_connection((ip, port), timeout=timeout).close()
            return ""
        except OSError as e:
            return f"{ip}:{port}: {e}"
    return f"unsupported probe {sorted(probe)}"
