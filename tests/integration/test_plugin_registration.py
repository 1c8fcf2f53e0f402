# SPDX-License-Identifier: Apache-2.0
"""The vllm.general_plugins entry point registers our connector as SPEC S-PIN-3 says."""

from __future__ import annotations

import json

import pytest
from support import run_in_pin

import vllm_ext
from vllm_ext import compat

PROBE = r"""
import json
from vllm.plugins import load_general_plugins
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
import vllm_ext

load_general_plugins()
reg = KVConnectorFactory._registry
first = {n: vllm_ext._is_ours(reg[n]) for n in ("ExtNixlPushConnector", "NixlPushConnector")
         if n in reg}
again = vllm_ext.register()          # a second call must be harmless
second = {n: vllm_ext._is_ours(reg[n]) for n in first}
loads = reg["ExtNixlPushConnector"]().__module__ if "ExtNixlPushConnector" in reg else None
try:  # what a config naming NixlPushConnector gets
    push = KVConnectorFactory.get_connector_class_by_name("NixlPushConnector").__module__
except Exception as e:
    push = f"{type(e).__name__}: {e}"
print("RESULT" + json.dumps({"first": first, "second": second, "again": again, "loads": loads,
                             "push": push}))
"""


def _probe(version: str, env: dict[str, str] | None = None) -> dict:
    proc = run_in_pin(version, PROBE, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    out = json.loads(line[len("RESULT") :])
    out["log"] = proc.stdout + proc.stderr
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("version", sorted(compat.load_pins()))
def test_entry_point_registers_per_pin(version: str) -> None:
    pin = compat.load_pins()[version]
    out = _probe(version)
    if not pin.connector:
        # not ported yet: no name that would break at the first request
        assert "ExtNixlPushConnector" not in out["first"] and out["again"] == []
        assert out["first"].get("NixlPushConnector") in (None, False)
        assert "does not run on vLLM" in out["log"] and "vllm-ext: registered" not in out["log"]
        return
    assert out["first"]["ExtNixlPushConnector"] is True
    # the class imports on this pin (compat_nixl found vLLM's NIXL classes)
    assert out["loads"] == "vllm_ext.nixl_push.connector"
    if pin.in_tree_push:
        # vLLM's own push connector is never shadowed.
        assert out["first"]["NixlPushConnector"] is False
        assert out["again"] == ["ExtNixlPushConnector"]
    else:
        assert out["first"]["NixlPushConnector"] is True
        assert sorted(out["again"]) == ["ExtNixlPushConnector", "NixlPushConnector"]
        assert out["push"] == "vllm_ext.nixl_push.connector"
    assert out["second"] == out["first"]
    # exactly one registration line per process, naming what was registered
    assert out["log"].count("vllm-ext: registered") == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "version", sorted(v for v, p in compat.load_pins().items() if p.in_tree_push)
)
def test_vllms_own_push_connector_name_is_an_error_unless_allowed(version: str) -> None:
    """A config written for our connector (``NixlPushConnector``, its name on 0.23) must
    not run vLLM's own push connector silently where vLLM has one."""
    out = _probe(version)
    assert out["push"].startswith("ValueError: kv_connector 'NixlPushConnector' is vLLM")
    assert "use kv_connector 'ExtNixlPushConnector'" in out["push"]
    assert f"{vllm_ext.ALLOW_VLLM_PUSH_ENV}=1" in out["push"]
    allowed = _probe(version, env={vllm_ext.ALLOW_VLLM_PUSH_ENV: "1"})
    assert allowed["push"].startswith("vllm.distributed.kv_transfer.kv_connector.v1.nixl")
    assert allowed["first"]["NixlPushConnector"] is False


@pytest.mark.timeout(240)
def test_vllm_plugins_filter_excludes_us() -> None:
    version = next(v for v, p in compat.load_pins().items() if p.primary)
    out = _probe(version, env={"VLLM_PLUGINS": "some_other_plugin"})
    # load_general_plugins skipped us; only the explicit register() call in the probe ran.
    assert "vllm-ext: registered" in out["log"]  # from the explicit call
    assert out["log"].count("vllm-ext: registered") == 1
    proc = run_in_pin(
        version,
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "load_general_plugins()\n"
        "print('HAS', 'ExtNixlPushConnector' in KVConnectorFactory._registry)\n",
        env={"VLLM_PLUGINS": "some_other_plugin"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HAS False" in proc.stdout
    assert "vllm-ext" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("installed", ["0.5.0", "0.33.1", None])
def test_unsupported_version_is_refused_at_startup(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, installed: str | None
) -> None:
    """S-PIN-4: on a vLLM no pin covers, nothing of ours runs, and a config naming our
    connector fails where vLLM builds it (the factory's class lookup) with a message
    naming the supported releases, not vLLM's bare "unsupported connector"."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    monkeypatch.setattr(compat, "installed_vllm_version", lambda: installed)
    registry = dict(KVConnectorFactory._registry)
    registry.pop("ExtNixlPushConnector", None)  # as in a process that never registered it
    monkeypatch.setattr(KVConnectorFactory, "_registry", registry)
    with caplog.at_level("ERROR"):
        assert vllm_ext.register() == []
    with pytest.raises(ValueError) as refused:
        KVConnectorFactory.get_connector_class_by_name("ExtNixlPushConnector")
    message = str(refused.value)
    assert message == vllm_ext.unsupported_vllm_message(installed)
    supported = [v for v, p in compat.load_pins().items() if p.connector]
    assert supported and all(v in message for v in supported)
    assert (f"vLLM {installed}" if installed else "version cannot be read") in message
    assert "Install one of those vLLM releases" in message
    assert message in caplog.text  # also said once when the plugin loads
    # a second load changes nothing and still refuses
    assert vllm_ext.register() == []
    with pytest.raises(ValueError, match="does not run on"):
        KVConnectorFactory.get_connector_class_by_name("ExtNixlPushConnector")


def test_pin_for_matches_series() -> None:
    assert compat.pin_for("0.23.0") is not None
    assert compat.pin_for("0.23.1") == compat.pin_for("0.23.0")
    assert compat.pin_for("0.24.0") is None
    assert compat.pin_for(None) is None
