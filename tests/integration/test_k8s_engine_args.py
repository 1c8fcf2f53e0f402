# SPDX-License-Identifier: Apache-2.0
"""The engines of the Kubernetes example (deploy/k8s/) start as written, as far as a
machine without a cluster or a GPU can tell: vLLM's own server parser takes their
arguments (the kv-transfer-config included) and knows our connector by the name they
use; every ``VLLM_*`` variable they set is one of vLLM's; and NIXL's UCX knows every
``UCX_*`` variable (it warns about unknown ones) and keeps its TCP listening ports in
the manifests' ``UCX_TCP_PORT_RANGE``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
POD_IP = "10.1.2.3"


def _engines() -> dict[str, dict[str, Any]]:
    """component -> the engine container of each vLLM StatefulSet in deploy/k8s/base/."""
    out = {}
    for path in sorted((REPO / "deploy" / "k8s" / "base").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["kind"] != "StatefulSet":
                continue
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            if container["command"][-1] == "vllm.entrypoints.openai.api_server":
                labels = doc["spec"]["template"]["metadata"]["labels"]
                out[labels["app.kubernetes.io/component"]] = container
    assert set(out) == {"prefill", "decode"}
    return out


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_vllm_parses_the_engine_arguments(role: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.plugins import load_general_plugins
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    container = _engines()[role]
    pod = f"vllm-{role}-0"
    args = [a.replace("$(POD_IP)", POD_IP).replace("$(POD_NAME)", pod) for a in container["args"]]
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    cfg = parsed.kv_transfer_config
    assert kv["engine_id"] == pod  # each pod's own name
    assert (cfg.kv_connector, cfg.kv_role, cfg.engine_id, cfg.kv_buffer_device) == (
        kv["kv_connector"],
        kv["kv_role"],
        kv["engine_id"],
        "cuda",
    )
    # HTTP on every interface (kubectl port-forward reaches it; the NetworkPolicy limits
    # who may); the side channel announces the pod IP (VLLM_NIXL_SIDE_CHANNEL_HOST)
    assert parsed.host == "0.0.0.0"
    side_channel = {e["name"]: e.get("value") for e in container["env"]}
    assert side_channel["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
    assert parsed.port == int(args[args.index("--port") + 1])
    load_general_plugins()
    assert cfg.kv_connector in KVConnectorFactory._registry


def test_every_vllm_variable_is_one_of_vllms() -> None:
    import vllm.envs

    for role, container in _engines().items():
        names = {e["name"] for e in container["env"] if e["name"].startswith("VLLM_")}
        assert "VLLM_NIXL_SIDE_CHANNEL_HOST" in names and "VLLM_NIXL_SIDE_CHANNEL_PORT" in names
        unknown = names - set(vllm.envs.environment_variables)
        assert not unknown, (role, unknown)


#: A NIXL agent as vLLM makes it (num_threads 4); prints its TCP listening ports.
UCX_PROBE = r"""
import json, os
import torch
from nixl._api import nixl_agent, nixl_agent_config

agent = nixl_agent("k8s-probe", nixl_agent_config(num_threads=4))
agent.register_memory(torch.zeros(1 << 16, dtype=torch.uint8))
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        continue
    if link.startswith("socket:["):
        inodes.add(link[8:-1])
ports = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    with open(table) as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                ports.append(int(cols[1].rsplit(":", 1)[1], 16))
print("PORTS" + json.dumps(sorted(ports)))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_ucx_knows_every_ucx_variable_and_keeps_to_the_port_range(role: str) -> None:
    ucx = {k: v for k, v in _env(_engines()[role]).items() if k.startswith("UCX_")}
    assert {"UCX_TLS", "UCX_NET_DEVICES", "UCX_TCP_PORT_RANGE"} <= set(ucx)
    # The names as in the manifest; the values this host has (no GPU, no eth0 assumed).
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env.update(ucx, UCX_TLS="tcp", UCX_NET_DEVICES="lo", UCX_WARN_UNUSED_ENV_VARS="y")
    proc = subprocess.run(
        [sys.executable, "-c", UCX_PROBE], env=env, capture_output=True, text=True, timeout=240
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert "unused environment variable" not in log, log[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("PORTS"))
    ports = json.loads(line[len("PORTS") :])
    low, high = (int(x) for x in ucx["UCX_TCP_PORT_RANGE"].split("-"))
    assert ports, log[-3000:]
    assert all(low <= p <= high for p in ports), (ports, ucx["UCX_TCP_PORT_RANGE"])
