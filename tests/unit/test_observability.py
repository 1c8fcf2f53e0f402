# SPDX-License-Identifier: Apache-2.0
"""deploy/observability: the alert rules and their unit tests pass ``promtool`` (Debian's
``prometheus`` package), the dashboard's queries parse, every series they name is one
the code exports (the proxy's registry, the push connector's, vLLM's own), and the
PodMonitor selects the pods of deploy/k8s/base by ports they have.

Without ``promtool`` the promtool tests are skipped, except where
``VLLM_EXT_REQUIRE_PROMTOOL=1`` (ci/test.sh sets it, after installing the package when it
runs as root): there a missing ``promtool`` fails them.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from test_k8s_manifests import _hook

from vllm_ext.proxy import ProxyConfig
from vllm_ext.proxy.app import Admission
from vllm_ext.proxy.metrics import ProxyMetrics
from vllm_ext.proxy.pool import Pool

REPO = Path(__file__).resolve().parents[2]
OBS = REPO / "deploy" / "observability"
ALERTS = OBS / "alerts.yaml"
ALERT_TESTS = OBS / "alerts.test.yaml"
DASHBOARD = OBS / "dashboard.json"
PODMONITOR = OBS / "podmonitor.yaml"
#: labels the scrape adds (podmonitor.yaml), not the code
TARGET_LABELS = {"namespace", "pod", "job", "instance", "component", "container", "endpoint"}
#: a series name of ours or vLLM's in a PromQL expression
SERIES = re.compile(r"(?<![\w:])(vllm(?:_ext_|:)[A-Za-z0-9_:]*)")
SELECTOR = re.compile(r"(?<![\w:])(vllm(?:_ext_|:)[A-Za-z0-9_:]*)\{([^}]*)\}")


def _promtool() -> str:
    found = shutil.which("promtool")
    if found:
        return found
    if os.environ.get("VLLM_EXT_REQUIRE_PROMTOOL") == "1":
        pytest.fail(
            "promtool is required here (VLLM_EXT_REQUIRE_PROMTOOL=1): apt-get install prometheus"
        )
    pytest.skip("promtool not installed (Debian: apt-get install prometheus)")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=OBS)


def _rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]


def test_promtool_checks_the_alert_rules() -> None:
    out = _run(_promtool(), "check", "rules", str(ALERTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in out.stdout


def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    out = _run(_promtool(), "test", "rules", ALERT_TESTS.name)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_promtool_unit_tests_fail_on_a_wrong_expectation(tmp_path: Path) -> None:
    """The unit tests can fail: with one alert's rule made never to fire, they do."""
    rules = ALERTS.read_text().replace(
        "expr: vllm:ext_push_blocks_quarantined_now > 0\n        for: 1h",
        "expr: vllm:ext_push_blocks_quarantined_now > 1e9\n        for: 1h",
    )
    assert rules != ALERTS.read_text()
    (tmp_path / "alerts.yaml").write_text(rules)
    (tmp_path / "alerts.test.yaml").write_text(ALERT_TESTS.read_text())
    out = subprocess.run(
        [_promtool(), "test", "rules", "alerts.test.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode != 0
    assert "VllmExtPushBlocksQuarantinedLong" in out.stdout + out.stderr


def test_every_alert_has_a_unit_test_where_it_fires() -> None:
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    fired = {
        case["alertname"]
        for t in tests
        for case in t.get("alert_rule_test", ())
        if case.get("exp_alerts")
    }
    assert {r["alert"] for r in _rules()} <= fired, {r["alert"] for r in _rules()} - fired


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each panel's query as a recording rule (Grafana's ``$__rate_interval`` as 5m)."""
    exprs = _dashboard_exprs()
    assert len(exprs) >= 20
    rules = [
        {"record": f"dashboard:query{i}", "expr": e.replace("$__rate_interval", "5m")}
        for i, e in enumerate(exprs)
    ]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = _run(_promtool(), "check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_dashboard_panels_have_unique_ids_and_the_chosen_data_source() -> None:
    dash = json.loads(DASHBOARD.read_text())
    (variable,) = dash["templating"]["list"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${" + variable["name"] + "}", panel["title"]
            assert panel["targets"], panel["title"]


def _sample_names(registry: CollectorRegistry) -> dict[str, set[str]]:
    """The series names a registry exports -> their label names (as far as known)."""
    out: dict[str, set[str]] = {}
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    for family in registry.collect():
        for suffix in suffixes[family.type]:
            out.setdefault(family.name + suffix, set())
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    # labels of series that have no child yet: from the metric objects themselves
    for collector in list(registry._collector_to_names):  # noqa: SLF001
        names = getattr(collector, "_labelnames", None)
        if names is not None:
            for name in registry._collector_to_names[collector]:  # noqa: SLF001
                out.setdefault(name, set()).update(names)
    for name, labels in out.items():
        if name.endswith("_bucket"):
            labels.add("le")
    return out


def _proxy_series() -> dict[str, set[str]]:
    config = ProxyConfig(
        prefill_url="http://127.0.0.1:9", decode_url="http://127.0.0.1:10", mode="pull"
    )
    return _sample_names(ProxyMetrics(Pool(config), Admission(0).describe).registry)


def _push_series() -> dict[str, set[str]]:
    """The engine's series as our connector's Prometheus class registers them (vLLM's
    NIXL series included), with vLLM's labels."""
    from vllm_ext.nixl_push.stats import PushPromMetrics

    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    labels = ["model_name", "engine"]
    PushPromMetrics(SimpleNamespace(kv_transfer_config=None), types, labels, {0: ["m", "0"]})
    return _sample_names(registry)


def _vllm_declares(name: str) -> bool:
    """Whether vLLM's metrics code names the series ``name`` (its base, without a
    counter's or histogram's suffix)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    base = re.sub(r"_(bucket|sum|count|total)$", "", name)
    return f'"{base}"' in source


def _used() -> dict[str, list[str]]:
    """Every series name in the rules, their unit tests and the dashboard -> where."""
    exprs = [("alerts.yaml", r["expr"]) for r in _rules()]
    exprs += [("dashboard.json", e) for e in _dashboard_exprs()]
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    exprs += [("alerts.test.yaml", s["series"]) for t in tests for s in t["input_series"]]
    used: dict[str, list[str]] = {}
    for where, expr in exprs:
        for name in SERIES.findall(expr):
            used.setdefault(name, []).append(where)
    return used


def test_every_series_in_the_dashboard_and_rules_is_exported() -> None:
    exported = {**_proxy_series(), **_push_series()}
    assert "vllm_ext_proxy_ttft_seconds_bucket" in exported
    assert "vllm:ext_push_blocks_quarantined_now" in exported
    used = _used()
    assert len(used) >= 40, sorted(used)
    unknown = {n: w for n, w in used.items() if n not in exported and not _vllm_declares(n)}
    assert not unknown, f"series no code exports: {unknown}"
    # vLLM's own series the dashboard shows (checked against its metrics code above)
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= set(used)


def test_label_matchers_name_labels_the_series_have() -> None:
    exported = {**_proxy_series(), **_push_series()}
    texts = [r["expr"] for r in _rules()] + _dashboard_exprs()
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    texts += [s["series"] for t in tests for s in t["input_series"]]
    wrong = []
    for text in texts:
        for name, matchers in SELECTOR.findall(text):
            if name not in exported:
                continue  # vLLM's own: checked by name only
            for label in re.findall(r"(\w+)\s*[=!]~?", matchers):
                if label not in exported[name] | TARGET_LABELS:
                    wrong.append((name, label))
    assert not wrong, wrong


def test_the_podmonitor_scrapes_every_component_of_the_base_by_a_port_it_has() -> None:
    monitor = yaml.safe_load(PODMONITOR.read_text())
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "PodMonitor"
    spec = monitor["spec"]
    match = spec["selector"]["matchLabels"]
    (expression,) = spec["selector"]["matchExpressions"]
    objects = _hook().render_kustomization(REPO / "deploy" / "k8s" / "base")
    selected = {}
    for obj in objects:
        if obj["kind"] not in ("StatefulSet", "Deployment"):
            continue
        labels = obj["spec"]["template"]["metadata"]["labels"]
        if match.items() <= labels.items() and labels[expression["key"]] in expression["values"]:
            selected[labels["app.kubernetes.io/component"]] = obj["spec"]["template"]
    assert set(selected) == {"prefill", "decode", "proxy"}
    for endpoint in spec["podMetricsEndpoints"]:
        assert endpoint["path"] == "/metrics"
        for component, template in selected.items():
            ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", ())}
            assert endpoint["port"] in ports, (component, endpoint["port"], ports)
    assert spec["jobLabel"] in match
