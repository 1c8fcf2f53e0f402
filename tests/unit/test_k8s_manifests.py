# SPDX-License-Identifier: Apache-2.0
"""The Kubernetes example (deploy/k8s/, docs/deploy.md) agrees with the code: it parses,
every proxy flag is one of ``vllm-ext-proxy``'s, the proxy names P's engine id, headless
Service and side-channel port, the engines announce their pod IP, probes and Services
point at declared ports, and the schema hook covers every manifest.

vLLM's own parser, vLLM's variables and UCX's are checked in
tests/integration/test_k8s_engine_args.py (they need vLLM and NIXL loaded)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from proxy_fakes import proxy_help

from vllm_ext import EXT_CONNECTOR_NAME, PUSH_CONNECTOR_NAME
from vllm_ext.nixl_push.config import PushConfig
from vllm_ext.proxy.cli import build_parser, config_from_args

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
POD_IP = "10.1.2.3"


def _docs() -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path, doc))
    return out


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for _, d in _docs()}


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
        if d["kind"] == "Deployment"
        and _container(d)["command"][-1] == "vllm.entrypoints.openai.api_server"
    }


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
    assert {k[1] for k in kinds} <= {"Deployment", "Service", "NetworkPolicy"}
    assert set(_engines()) == {"prefill", "decode"}
    for path in MANIFESTS:
        assert "SPDX-License-Identifier" in path.read_text().splitlines()[0], path


def test_every_proxy_flag_is_one_of_the_proxy_cli() -> None:
    help_text = proxy_help()
    flags = [a for a in _proxy_args() if a.startswith("--")]
    assert flags, "no flag found in the proxy's args"
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), flag


def test_the_proxy_names_p_as_p_is_configured() -> None:
    config = config_from_args(build_parser().parse_args(_proxy_args()))
    engines = _engines()
    p, d = engines["prefill"], engines["decode"]
    pc, dc = _container(p), _container(d)
    assert config.mode == "push" and config.host == POD_IP
    [prefill], [decode] = config.prefills, config.decodes
    coords = prefill.coords
    assert coords is not None
    # engine id: P's kv-transfer-config
    assert coords.engine_id == _kv(p)["engine_id"]
    # side-channel port: P's VLLM_NIXL_SIDE_CHANNEL_PORT, declared and served by P's Service
    assert coords.side_channel_port == int(_env(pc)["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    assert coords.side_channel_port == _ports(pc)["nixl-side"]
    # host: P's headless Service (its DNS name resolves to P's pod IP)
    svc = _obj("Service", coords.host)
    assert svc["spec"]["clusterIP"] == "None"
    svc_ports = {sp["name"]: sp for sp in svc["spec"]["ports"]}
    assert svc_ports["nixl-side"]["port"] == coords.side_channel_port
    assert svc_ports["nixl-side"]["targetPort"] == "nixl-side"
    assert coords.tp_size == 1 and "--tensor-parallel-size" not in pc["args"]
    # HTTP: the legs go to the engines' Services, on the port vLLM listens on
    for url, deploy, container in ((prefill.url, p, pc), (decode.url, d, dc)):
        m = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", url)
        assert m, url
        port = int(_arg(container["args"], "--port"))
        assert int(m.group(2)) == port == _ports(container)["http"]
        service = _obj("Service", m.group(1))
        assert {sp["port"] for sp in service["spec"]["ports"]} >= {port}
        assert _selects(service, deploy)


def _selects(service: dict[str, Any], deploy: dict[str, Any]) -> bool:
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def test_engines_run_our_connector_with_fixed_distinct_engine_ids() -> None:
    engines = _engines()
    roles = {c: _kv(d) for c, d in engines.items()}
    assert roles["prefill"]["kv_role"] == "kv_producer"
    assert roles["decode"]["kv_role"] == "kv_consumer"
    assert roles["prefill"]["engine_id"] != roles["decode"]["engine_id"]
    for kv in roles.values():
        assert kv["kv_connector"] in (PUSH_CONNECTOR_NAME, EXT_CONNECTOR_NAME)
        assert kv["kv_buffer_device"] == "cuda"
        PushConfig.from_extra_config(kv.get("kv_connector_extra_config"), "cuda")
    assert roles["prefill"]["kv_connector"] == roles["decode"]["kv_connector"]
    for deploy in engines.values():
        # one pod per engine id, also during a rollout
        assert deploy["spec"]["replicas"] == 1
        assert deploy["spec"]["strategy"]["type"] == "Recreate"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engines_bind_and_announce_their_pod_ip(role: str) -> None:
    c = _container(_engines()[role])
    names = [e["name"] for e in c["env"]]
    env = _env(c)
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # $(POD_IP) expands only from variables defined before it
    assert names.index("POD_IP") < names.index("VLLM_NIXL_SIDE_CHANNEL_HOST")
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
    assert _arg(c["args"], "--host") == "$(POD_IP)"
    ports = _ports(c)
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ports["nixl-side"] != ports["http"]


def test_every_env_var_of_the_manifests_is_explained_in_the_deploy_doc() -> None:
    doc = (REPO / "docs" / "deploy.md").read_text()
    deploys = [d for _, d in _docs() if d["kind"] == "Deployment"]
    names = {e["name"] for d in deploys for e in _container(d).get("env", [])}
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in names
    for name in names - {"POD_IP"}:
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
    for _, d in _docs():
        if d["kind"] == "Deployment":
            res = _container(d)["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res[kind]), d["metadata"]["name"]


def test_services_select_pods_and_target_declared_ports() -> None:
    deploys = [d for _, d in _docs() if d["kind"] == "Deployment"]
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


def test_network_policy_opens_the_engines_ports() -> None:
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
    for path in MANIFESTS:
        assert re.search(hook["files"], str(path.relative_to(REPO))), path
