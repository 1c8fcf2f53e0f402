# SPDX-License-Identifier: Apache-2.0
"""The Kubernetes example (deploy/k8s/, docs/deploy.md) agrees with the code: it parses,
every proxy flag is one of ``vllm-ext-proxy``'s, P runs as a StatefulSet of two pods whose
engine ids are their names, the proxy finds P and D by the SRV records of their headless
Services (resolved here through the proxy's own look-up, as the cluster's DNS would
publish them), the engines announce their pod IP, probes and Services point at declared
ports, the NetworkPolicy's selectors cover P's and D's pods and admit what push
needs (checked statically: no CNI enforces it here), Prometheus may scrape, the RDMA
overlay renders as kustomize renders it, and the schema hook covers every manifest.

vLLM's own parser, vLLM's variables and UCX's are checked in
tests/integration/test_k8s_engine_args.py (they need vLLM and NIXL loaded)."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import dns.name
import pytest
import yaml
from proxy_fakes import FakeDns, proxy_help

from vllm_ext import EXT_CONNECTOR_NAME
from vllm_ext.nixl_push.config import PushConfig
from vllm_ext.proxy.cli import build_parser, config_from_args
from vllm_ext.proxy.discovery import lookup, make_resolver

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s" / "base"
RDMA = REPO / "deploy" / "k8s" / "overlays" / "rdma"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
POD_IP = "10.1.2.3"
NAMESPACE = "vllm-pd"
WORKLOADS = ("StatefulSet", "Deployment")


def _hook() -> Any:
    """ci/hooks/check_k8s_manifests.py as a module (its renderer of kustomizations)."""
    spec = importlib.util.spec_from_file_location(
        "check_k8s_manifests", REPO / "ci" / "hooks" / "check_k8s_manifests.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _docs() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path, doc))
    return out


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for _, d in _docs()}


def _key(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def _obj(kind: str, name: str) -> dict[str, Any]:
    return _objects()[(kind, name)]


def _container(deploy: dict[str, Any]) -> dict[str, Any]:
    containers = deploy["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _engines() -> dict[str, dict[str, Any]]:
    return {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: d
        for _, d in _docs()
        if d["kind"] == "StatefulSet"
        and _container(d)["command"][-1] == "vllm.entrypoints.openai.api_server"
    }


def _workloads() -> list[dict[str, Any]]:
    return [d for _, d in _docs() if d["kind"] in WORKLOADS]


def _kv(deploy: dict[str, Any]) -> dict[str, Any]:
    return json.loads(_arg(_container(deploy)["args"], "--kv-transfer-config"))


def _proxy_args() -> list[str]:
    c = _container(_obj("Deployment", "vllm-pd-proxy"))
    assert c["command"] == ["vllm-ext-proxy"]
    return [a.replace("$(POD_IP)", POD_IP) for a in c["args"]]


def test_manifests_parse_into_the_expected_objects() -> None:
    assert {p.name for p in MANIFESTS} >= {"prefill.yaml", "decode.yaml", "proxy.yaml"}
    kinds = [(d["apiVersion"], d["kind"], d["metadata"]["name"]) for _, d in _docs()]
    assert len({k[1:] for k in kinds}) == len(kinds), "an object is defined twice"
    assert {k[1] for k in kinds} <= {*WORKLOADS, "Service", "NetworkPolicy", "PodDisruptionBudget"}
    assert set(_engines()) == {"prefill", "decode"}
    for path in [*MANIFESTS, *K8S.parent.rglob("kustomization.yaml")]:
        assert "SPDX-License-Identifier" in path.read_text().splitlines()[0], path
    # the kustomization applies every manifest, and yields what the files hold
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in MANIFESTS)
    rendered = _hook().render_kustomization(K8S)
    assert sorted(map(_key, rendered)) == sorted(_key(d) for _, d in _docs())
    assert all(d in rendered for _, d in _docs())


def test_every_proxy_flag_is_one_of_the_proxy_cli() -> None:
    help_text = proxy_help()
    flags = [a for a in _proxy_args() if a.startswith("--")]
    assert flags, "no flag found in the proxy's args"
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), flag


def _headless_service(workload: dict[str, Any]) -> dict[str, Any]:
    svc = _obj("Service", workload["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert _selects(svc, workload)
    return svc


def test_the_proxy_finds_p_and_d_by_their_headless_services() -> None:
    config = config_from_args(build_parser().parse_args(_proxy_args()))
    assert config.mode == "push" and config.host == "0.0.0.0"
    assert config.prefills == () and config.decodes == ()
    found = config.discovery
    assert found is not None and found.tp_size == 1
    engines = _engines()
    for role, srv in (("prefill", found.prefill_srv), ("decode", found.decode_srv)):
        workload = engines[role]
        c = _container(workload)
        svc = _headless_service(workload)
        # _<port name>._tcp.<service>: the SRV name of the Service's port "http"
        assert srv == f"_http._tcp.{svc['metadata']['name']}"
        (http,) = [sp for sp in svc["spec"]["ports"] if sp["name"] == "http"]
        assert http["targetPort"] == "http"
        assert http["port"] == int(_arg(c["args"], "--port")) == _ports(c)["http"]
        # the engine id is the pod's name: the first label of its SRV record's target
        assert _kv(workload)["engine_id"] == "$(POD_NAME)"
        assert _env(c)["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    pc = _container(engines["prefill"])
    assert found.side_channel_port == int(_env(pc)["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    assert found.side_channel_port == _ports(pc)["nixl-side"]
    assert "--tensor-parallel-size" not in pc["args"]


def _publish(fake: FakeDns) -> dict[str, list[str]]:
    """What the cluster's DNS publishes for the workloads' pods (all ready): role -> pods."""
    out: dict[str, list[str]] = {}
    for role, workload in _engines().items():
        svc = _headless_service(workload)["metadata"]["name"]
        port = _ports(_container(workload))["http"]
        domain = f"{svc}.{NAMESPACE}.svc.cluster.local"
        name = workload["metadata"]["name"]
        pods = [f"{name}-{i}" for i in range(workload["spec"]["replicas"])]
        fake.srv[f"_http._tcp.{domain}"] = [(f"{pod}.{domain}", port) for pod in pods]
        for i, pod in enumerate(pods):
            fake.a[f"{pod}.{domain}"] = f"10.1.{1 if role == 'prefill' else 2}.{i + 1}"
        out[role] = pods
    return out


def test_the_proxys_lookups_find_every_pod_as_cluster_dns_publishes_them() -> None:
    """The proxy's relative SRV names, through a pod's search list, reach every replica,
    each named as the pod names its engine id (a real UDP DNS server on loopback)."""
    config = config_from_args(build_parser().parse_args(_proxy_args()))
    discovery = config.discovery
    assert discovery is not None

    async def body() -> tuple[dict[str, list[str]], dict[str, list[tuple[str, str, int]]]]:
        fake = FakeDns()
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: fake, local_addr=("127.0.0.1", 0)
        )
        try:
            pods = _publish(fake)
            port = transport.get_extra_info("sockname")[1]
            resolver = make_resolver(replace(discovery, nameserver=f"127.0.0.1:{port}"))
            # what a pod's resolv.conf says
            resolver.search = [dns.name.from_text(f"{NAMESPACE}.svc.cluster.local")]
            resolver.ndots = 5
            found = {}
            for role, srv in (("prefill", discovery.prefill_srv), ("decode", discovery.decode_srv)):
                found[role] = [(e.name, e.address, e.port) for e in await lookup(resolver, srv)]
            return pods, found
        finally:
            transport.close()

    pods, found = asyncio.run(body())
    assert pods["prefill"] == ["vllm-prefill-0", "vllm-prefill-1"]  # P scaled to two
    assert found["prefill"] == [
        ("vllm-prefill-0", "10.1.1.1", 8100),
        ("vllm-prefill-1", "10.1.1.2", 8100),
    ]
    assert [name for name, _, _ in found["decode"]] == pods["decode"]


def _selects(service: dict[str, Any], deploy: dict[str, Any]) -> bool:
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def test_engines_run_our_connector_with_per_pod_engine_ids_and_p_scales() -> None:
    engines = _engines()
    roles = {c: _kv(d) for c, d in engines.items()}
    assert roles["prefill"]["kv_role"] == "kv_producer"
    assert roles["decode"]["kv_role"] == "kv_consumer"
    for kv in roles.values():
        assert kv["kv_connector"] == EXT_CONNECTOR_NAME
        assert kv["kv_buffer_device"] == "cuda"
        PushConfig.from_extra_config(kv.get("kv_connector_extra_config"), "cuda")
    # distinct ids: each pod's own name (<StatefulSet>-<ordinal>), unique across both
    a, b = (d["metadata"]["name"] for d in engines.values())
    assert not a.startswith(f"{b}-") and not b.startswith(f"{a}-")
    assert engines["prefill"]["spec"]["replicas"] == 2
    for workload in engines.values():
        assert workload["spec"]["podManagementPolicy"] == "Parallel"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engines_bind_and_announce_their_pod_ip(role: str) -> None:
    c = _container(_engines()[role])
    names = [e["name"] for e in c["env"]]
    env = _env(c)
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # $(POD_IP) expands only from variables defined before it
    assert names.index("POD_IP") < names.index("VLLM_NIXL_SIDE_CHANNEL_HOST")
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
    assert _arg(c["args"], "--host") == "0.0.0.0"  # pod IP and loopback (port-forward)
    ports = _ports(c)
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ports["nixl-side"] != ports["http"]


def test_every_env_var_of_the_manifests_is_explained_in_the_deploy_doc() -> None:
    doc = (REPO / "docs" / "deploy.md").read_text()
    names = {e["name"] for d in _workloads() for e in _container(d).get("env", [])}
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in names
    for name in names - {"POD_IP", "POD_NAME"}:
        assert f"`{name}" in doc, name


def test_probes_and_resources() -> None:
    for component, deploy in _engines().items():
        c = _container(deploy)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, (component, probe)
        start = c["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 900  # GPU start-up
        res = c["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"
    proxy = _container(_obj("Deployment", "vllm-pd-proxy"))
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # its /health is 503 while engines are down: liveness must not depend on it
    assert proxy["livenessProbe"]["tcpSocket"] == {"port": "http"}
    assert int(_arg(_proxy_args(), "--port")) == _ports(proxy)["http"]
    for d in _workloads():
        res = _container(d)["resources"]
        assert {"cpu", "memory"} <= set(res["requests"]), d["metadata"]["name"]
        assert "memory" in res["limits"], d["metadata"]["name"]
        # an engine's CPU is not capped: a CFS quota throttles the writer and NIXL's
        # progress thread mid-transfer (the proxy's is)
        engine = d["kind"] == "StatefulSet"
        assert ("cpu" in res["limits"]) is not engine, d["metadata"]["name"]


def test_the_proxy_survives_a_voluntary_disruption() -> None:
    proxy = _obj("Deployment", "vllm-pd-proxy")
    assert proxy["spec"]["replicas"] >= 2
    pdb = _obj("PodDisruptionBudget", "vllm-pd-proxy")
    assert pdb["spec"]["minAvailable"] == 1
    labels = proxy["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_services_select_pods_and_target_declared_ports() -> None:
    deploys = _workloads()
    for deploy in deploys:
        labels = deploy["spec"]["template"]["metadata"]["labels"]
        assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for _, svc in _docs():
        if svc["kind"] != "Service":
            continue
        chosen = [d for d in deploys if _selects(svc, d)]
        assert len(chosen) == 1, svc["metadata"]["name"]
        ports = _ports(_container(chosen[0]))
        for sp in svc["spec"]["ports"]:
            assert ports[sp["targetPort"]] == sp["port"], (svc["metadata"]["name"], sp)


def test_network_policy_opens_the_engines_ports_to_the_proxy_peers_and_prometheus() -> None:
    (policy,) = [d for _, d in _docs() if d["kind"] == "NetworkPolicy"]
    rules = policy["spec"]["ingress"]
    opened = [p for rule in rules for p in rule["ports"]]
    for deploy in _engines().values():
        c = _container(deploy)
        ports = _ports(c)
        named = {p["port"] for p in opened if isinstance(p["port"], str)}
        assert named == {"http", "nixl-side"} and named <= set(ports)
        low, high = (int(x) for x in _env(c)["UCX_TCP_PORT_RANGE"].split("-"))
        assert any(p["port"] == low and p.get("endPort") == high for p in opened)
    # Prometheus (another namespace) reaches the HTTP port, where /metrics is served
    scrape = [r for r in rules if any("namespaceSelector" in f for f in r["from"])]
    assert len(scrape) == 1 and [p["port"] for p in scrape[0]["ports"]] == ["http"]
    for workload in _workloads():
        notes = workload["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert int(notes["prometheus.io/port"]) == _ports(_container(workload))["http"]


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (``matchLabels``, ``matchExpressions``) on labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        value = labels.get(e["key"])
        ok = {
            "In": value is not None and value in e.get("values", []),
            "NotIn": value is None or value not in e.get("values", []),  # codespell:ignore
            "Exists": value is not None,
            "DoesNotExist": value is None,
        }[e["operator"]]
        if not ok:
            return False
    return True


def _admitted(policy: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(source component, destination component, port) for every pod of the workloads
    that the policy lets reach another in the namespace (a peer with a
    ``namespaceSelector`` selects none of them unless it selects this namespace); a named
    port must be one of the destination's, a range is written ``low-high``."""
    pods = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: d
        for d in _workloads()
    }
    labels = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in pods.items()}
    ours = {"kubernetes.io/metadata.name": NAMESPACE}
    admitted = set()
    for dst, dst_labels in labels.items():
        if not _matches(policy["spec"]["podSelector"], dst_labels):
            continue
        for rule in policy["spec"]["ingress"]:
            sources = [
                src
                for peer in rule["from"]
                for src, src_labels in labels.items()
                if _matches(peer.get("namespaceSelector", {"matchLabels": ours}), ours)
                and _matches(peer.get("podSelector", {}), src_labels)
            ]
            for port in rule["ports"]:
                if isinstance(port["port"], str):
                    assert port["port"] in _ports(_container(pods[dst])), (dst, port)
                    name = port["port"]
                else:
                    name = f"{port['port']}-{port.get('endPort', port['port'])}"
                admitted |= {(src, dst, name) for src in sources}
    return admitted


def test_network_policy_selectors_match_the_pods_and_admit_what_push_needs() -> None:
    """The selectors (no CNI enforces them here): the policy covers P's and D's pods, not
    the proxy's; the proxy reaches the engines' HTTP port only; P and D reach each
    other's side channel and UCX ports both ways; Prometheus' peer (another namespace)
    selects none of this namespace's pods."""
    (policy,) = [d for _, d in _docs() if d["kind"] == "NetworkPolicy"]
    workloads = _workloads()
    covered = {
        d["metadata"]["name"]
        for d in workloads
        if _matches(policy["spec"]["podSelector"], d["spec"]["template"]["metadata"]["labels"])
    }
    assert covered == {"vllm-prefill", "vllm-decode"}
    admitted = _admitted(policy)
    need = set()
    for role, workload in _engines().items():
        c = _container(workload)
        # the proxy's legs and probes: the port its SRV name (_http) gives
        need.add(("proxy", role, "http"))
        peer = "decode" if role == "prefill" else "prefill"
        side = int(_env(c)["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        (side_name,) = [n for n, p in _ports(c).items() if p == side]
        need |= {(peer, role, side_name), (peer, role, _env(c)["UCX_TCP_PORT_RANGE"])}
    assert need <= admitted, need - admitted
    # the proxy reaches no side channel or UCX port; nothing else reaches an engine
    assert {(s, d, p) for s, d, p in admitted if s == "proxy"} == {
        x for x in need if x[0] == "proxy"
    }
    assert {s for s, _, _ in admitted} == {"proxy", "prefill", "decode"}


def _run_prestop(
    role: str, answers: list[Any], monkeypatch: pytest.MonkeyPatch
) -> tuple[float, int]:
    """The engine's preStop command as the manifest gives it, on a fake clock, its
    /metrics answering ``answers`` in turn (an exception is raised, a number is the
    requests running; the last answer repeats); when it ended, and how many scrapes."""
    c = _container(_engines()[role])
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"]
    clock = [0.0]
    calls = [0]

    def urlopen(url: str, timeout: float) -> Any:
        assert url == f"http://{POD_IP}:{_ports(c)['http']}/metrics" and timeout > 0
        answer = answers[min(calls[0], len(answers) - 1)]
        calls[0] += 1
        if isinstance(answer, BaseException):
            raise answer
        text = (
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {float(answer)}\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
        )
        return io.BytesIO(text.encode())

    monkeypatch.setenv("POD_IP", POD_IP)
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    exec(compile(command[2], "preStop", "exec"), {"__name__": "__main__"})
    return clock[0], calls[0]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_prestop_drain_outlasts_a_slow_metrics_answer(
    role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scrape that times out (a busy engine) does not end the drain: the hook asks
    again and ends 5 s after the engine runs nothing; nothing listening (the engine is
    gone) ends it at once; 540 s bound it."""
    slow = urllib.error.URLError(TimeoutError("timed out"))
    # 20 s, a timeout, 2 s, one running, 2 s, none running, 5 s
    assert _run_prestop(role, [slow, TimeoutError("read"), 1, 0], monkeypatch) == (31, 4)
    refused = urllib.error.URLError(ConnectionRefusedError(111, "refused"))
    assert _run_prestop(role, [refused], monkeypatch) == (20, 1)
    ended, _ = _run_prestop(role, [1], monkeypatch)
    assert 540 <= ended < 545


def _differences(base: Any, other: Any, at: str = "") -> list[str]:
    """The places (JSON pointers) where ``other`` differs from ``base``."""
    if isinstance(base, dict) and isinstance(other, dict):
        keys = sorted(set(base) | set(other))
        return [p for k in keys for p in _differences(base.get(k), other.get(k), f"{at}/{k}")]
    if isinstance(base, list) and isinstance(other, list) and len(base) == len(other):
        pairs = enumerate(zip(base, other))
        return [p for i, (x, y) in pairs for p in _differences(x, y, f"{at}/{i}")]
    return [] if base == other else [at]


RDMA_PLACES = tuple(
    f"/spec/template/{place}"
    for place in (
        "spec/containers/0/resources/",
        "spec/containers/0/securityContext",
        "spec/containers/0/env/",
        "metadata/annotations/k8s.v1.cni.cncf.io",
    )
)


def test_the_rdma_overlay_adds_the_device_ipc_lock_and_ucx_rc_to_both_engines() -> None:
    base = {_key(d): d for _, d in _docs()}
    rendered = {_key(d): d for d in _hook().render_kustomization(RDMA)}
    assert set(rendered) == set(base)
    changed = {key for key in base if base[key] != rendered[key]}
    assert changed == {("StatefulSet", "vllm-prefill"), ("StatefulSet", "vllm-decode")}
    for key in changed:
        c = _container(rendered[key])
        res = c["resources"]
        rdma = [k for k in res["limits"] if k.startswith("rdma/")]
        assert len(rdma) == 1 and res["requests"][rdma[0]] == res["limits"][rdma[0]] == "1"
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        env = _env(c)
        assert "rc" in env["UCX_TLS"].split(",") and "tcp" not in env["UCX_TLS"].split(",")
        assert env["UCX_NET_DEVICES"] != "eth0"
        # nothing else of the engine changed (ports, ids, probes stay the base's)
        places = _differences(base[key], rendered[key])
        assert places and all(p.startswith(RDMA_PLACES) for p in places), places


def test_the_renderer_agrees_with_kustomize() -> None:
    """The hook validates what kustomize would apply: same objects as ``kubectl kustomize``."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its kustomize) is not installed here")
    for directory in (K8S, RDMA):
        out = subprocess.run(
            [kubectl, "kustomize", str(directory)],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        theirs = [d for d in yaml.safe_load_all(out) if d is not None]
        ours = _hook().render_kustomization(directory)
        assert sorted(theirs, key=_key) == sorted(ours, key=_key), directory


def test_the_schema_hook_covers_every_manifest() -> None:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    hooks = {h["id"]: h for repo in config["repos"] for h in repo["hooks"]}
    hook = hooks["k8s-manifests"]
    assert hook["language"] == "python"
    (dep,) = hook["additional_dependencies"]
    assert re.fullmatch(r"kubernetes-validate==[\d.]+", dep), dep
    script = hook["entry"].split()[1]
    assert (REPO / script).is_file()
    version = re.search(r"--kubernetes-version (\d+\.\d+)", hook["entry"])
    assert version and f"Kubernetes {version.group(1)}" in (REPO / "docs" / "deploy.md").read_text()
    patches = {
        (k.parent / p["path"]).resolve()
        for k in K8S.parent.rglob("kustomization.yaml")
        for p in yaml.safe_load(k.read_text()).get("patches", [])
    }
    assert patches
    for path in K8S.parent.rglob("*.yaml"):
        rel = str(path.relative_to(REPO))
        assert re.search(hook["files"], rel), path
        # a patch is checked as applied, through its kustomization; everything else itself
        assert bool(re.search(hook["exclude"], rel)) == (path.resolve() in patches), path
