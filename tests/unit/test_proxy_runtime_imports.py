# SPDX-License-Identifier: Apache-2.0
"""What runs in production imports no benchmark scaffolding (``devkit.bench``): the
proxy, and the plugin's ``register()`` also with the hand-off clock on; and the proxy
reads an engine's load through prometheus_client's parser, a bad text being no load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_ext.proxy.routing import parse_engine_load

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import sys
{body}
loaded = sorted(m for m in sys.modules if m.startswith(("devkit.bench", "tests")))
assert not loaded, loaded
print("clean")
"""


def _run(body: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_EXT_HANDOFF_TRACE=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(body=body)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("clean"), out.stderr[-3000:]


def test_the_proxy_imports_no_bench(tmp_path: Path) -> None:
    _run("import vllm_ext.proxy.cli, vllm_ext.proxy.routing, vllm_ext.proxy.serve", tmp_path)


@pytest.mark.timeout(300)
def test_the_plugin_registers_with_the_handoff_clock_and_no_bench(tmp_path: Path) -> None:
    _run(
        "import vllm_ext, vllm_ext.handoff_trace as t\n"
        "vllm_ext.register()\n"
        "assert any(getattr(getattr(__import__(m, fromlist=[c]), c, None), t._WRAPPED, False)"
        " for m, c in t.CONNECTORS if m.startswith('vllm_ext'))",
        tmp_path,
    )


@pytest.mark.parametrize(
    "text",
    [
        'vllm:num_requests_running{engine="0"} not-a-number\n',
        'vllm:num_requests_waiting{engine="0 1\n',
    ],
)
def test_a_metrics_text_that_does_not_parse_is_no_load(text: str) -> None:
    assert parse_engine_load(text, at=1.0, picked=0) is None


def test_load_families_are_matched_by_whole_name() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} 2\n'
        'vllm:num_requests_running{engine="1"} 1\n'
        'vllm:num_requests_waiting_by_reason{reason="x"} 7\n'
    )
    load = parse_engine_load(text, at=1.0, picked=0)
    assert load is not None and (load.running, load.waiting) == (3.0, 0.0)
