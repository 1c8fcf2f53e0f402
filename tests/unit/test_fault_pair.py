# SPDX-License-Identifier: Apache-2.0
"""The fault harness's pair is the pair launcher's (``devkit.launch.pd``) plus the fault
hooks: what each engine and the proxy are started with, read from their command lines
and environments (the processes themselves are recorded, not started)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from devkit.launch.engine import EngineSpec
from devkit.testing.faults import nixl_shim
from devkit.testing.faults.pair import (
    D_NUM_BLOCKS,
    SITEHOOK,
    STACKS,
    FaultPair,
    PairConfig,
)


class Recorded:
    """Stands in for ManagedProcess: keeps the command line and environment."""

    def __init__(
        self, name: str, argv: list[str], log_path: Path, env=None, cwd=None, scratch_env=None
    ) -> None:
        self.name, self.argv, self.log_path = name, list(argv), log_path
        self.env = dict(env or {})
        self.pid = 0


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> dict[str, Recorded]:
    import devkit.launch.engine as engine_mod
    import devkit.launch.pd as pd_mod
    import devkit.testing.faults.pair as pair_mod

    procs: dict[str, Recorded] = {}

    def record(*a: Any, **k: Any) -> Recorded:
        proc = Recorded(*a, **k)
        procs[proc.name] = proc
        return proc

    for mod in (engine_mod, pd_mod, pair_mod):
        monkeypatch.setattr(mod, "ManagedProcess", record)
    return procs


def _opt(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _kv(proc: Recorded) -> dict[str, Any]:
    return json.loads(_opt(proc.argv, "--kv-transfer-config"))


def test_the_pair_runs_the_stack_with_the_fault_hooks(
    tmp_path: Path, started: dict[str, Recorded]
) -> None:
    cfg = PairConfig(STACKS["vllm-push-0.32"], "/m", tmp_path, python="/py")
    pair = FaultPair(cfg)
    pair.deployment.start()
    p, d, proxy = started["prefill"], started["decode"], started["proxy"]
    for role, proc in (("prefill", p), ("decode", d)):
        kv = _kv(proc)
        assert kv["kv_connector"] == "NixlPushConnector"
        assert kv["engine_id"] == pair.engine_ids[role]
        # the extra config under the names vLLM's own connector reads
        assert kv["kv_connector_extra_config"]["push_registration_timeout"] == 20
        assert "push_registration_timeout_s" not in kv["kv_connector_extra_config"]
        assert "--no-enable-prefix-caching" in proc.argv
        assert proc.env[nixl_shim.NAME_ENV] == role
        assert proc.env[nixl_shim.DIR_ENV] == str(tmp_path / "faults")
        assert proc.env["PYTHONPATH"].split(":")[0] == str(SITEHOOK)
        assert proc.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert pair.engine_ids["prefill"].startswith("P-")
    assert _opt(d.argv, "--num-gpu-blocks-override") == str(D_NUM_BLOCKS)
    assert "--num-gpu-blocks-override" not in p.argv
    assert proxy.argv[:3] == ["/py", "-m", "devkit.bench.vllm_push_proxy"]
    assert _opt(proxy.argv, "--p-engine-id") == pair.engine_ids["prefill"]
    assert _opt(proxy.argv, "--decode-idle-timeout") == "60"
    assert _opt(proxy.argv, "--p-host") == "127.0.0.1"
    # a second proxy whose D legs name another P
    other = pair.deployment.proxy_argv(1234, p_engine_id="P-else", p_side_channel_port=9)
    assert (_opt(other, "--p-engine-id"), _opt(other, "--p-side-channel-port")) == ("P-else", "9")
    assert _opt(other, "--decode") == pair.engine_url("decode")


class Namespaces:
    """Stands in for netns.Topology: each role's wrapper and addresses."""

    def wrapper(self, role: str) -> list[str]:
        return ["ip", "netns", "exec", f"ns-{role}"]

    def ctrl_ip(self, role: str) -> str:
        return {"prefill": "10.0.0.2", "decode": "10.0.1.2"}[role]

    def data_ip(self, role: str) -> str:
        return {"prefill": "10.0.2.1", "decode": "10.0.2.2"}[role]

    def engine_env(self, role: str) -> dict[str, str]:
        return {"UCX_NET_DEVICES": f"kv0-{role}"}


def test_in_namespaces_each_engine_runs_in_its_own(
    tmp_path: Path, started: dict[str, Recorded], monkeypatch: pytest.MonkeyPatch
) -> None:
    import devkit.launch.engine as engine_mod

    monkeypatch.setattr(engine_mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    pair = FaultPair(PairConfig(STACKS["ours"], "/m", tmp_path, net="netns"))
    pair.topology = Namespaces()  # type: ignore[assignment]
    pair.deployment.start()
    for role, cpu in (("prefill", "0"), ("decode", "1")):
        proc = started[role]
        # in its namespace, then on its core
        assert proc.argv[:7] == ["ip", "netns", "exec", f"ns-{role}", "taskset", "-c", cpu]
        assert _opt(proc.argv, "--host") == Namespaces().ctrl_ip(role)
        assert proc.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == Namespaces().data_ip(role)
        assert proc.env["UCX_NET_DEVICES"] == f"kv0-{role}"
        assert (
            pair.engine_url(role)
            == f"http://{_opt(proc.argv, '--host')}:{_opt(proc.argv, '--port')}"
        )
    proxy = started["proxy"].argv
    assert _opt(proxy, "--p-host") == Namespaces().data_ip("prefill")
    assert _opt(proxy, "--prefill") == pair.engine_url("prefill")


def test_a_restart_keeps_the_spec_with_a_log_of_its_own(
    tmp_path: Path, started: dict[str, Recorded], monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = FaultPair(PairConfig(STACKS["ours"], "/m", tmp_path))
    pair.deployment.start()
    first: EngineSpec = pair.specs["decode"]
    stopped: list[str] = []
    monkeypatch.setattr(type(pair.engine("decode")), "stop", lambda e: stopped.append(e.spec.name))
    monkeypatch.setattr(type(pair.deployment), "wait_engines", lambda self, engines, *a: None)
    monkeypatch.setattr(pair, "_count_blocks", lambda role: None)
    pair.restart("decode")
    again = pair.specs["decode"]
    assert stopped == ["decode"]
    assert again.name == "decode-2" and "decode-2" in started
    assert (again.port, again.side_channel_port, again.host) == (
        first.port, first.side_channel_port, first.host,
    )  # fmt: skip
    assert _kv(started["decode-2"])["engine_id"] == pair.engine_ids["decode"]
    assert again.cache_root == tmp_path / "cache-decode"  # the first start's compile cache
    assert pair.specs["prefill"].name == "prefill"  # the other engine keeps running
