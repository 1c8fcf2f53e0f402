# SPDX-License-Identifier: Apache-2.0
"""``vllm-ext-proxy --log-format json``: every line the proxy writes is a JSON object
(python-json-logger), and a request's line carries its fields as keys of their own."""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import aiohttp
import pytest
from proxy_fakes import WAIT, run
from test_proxy_drain import _proxy_process


@pytest.mark.timeout(60)
def test_json_log_lines_carry_the_request_id_and_outcome() -> None:
    async def body() -> str:
        async with _proxy_process("--log-format", "json") as (proc, url, d):
            async with aiohttp.ClientSession() as client:
                headers = {"X-Request-Id": "req-json-1"}
                async with client.post(
                    url + "/v1/completions", json={"prompt": "a"}, headers=headers
                ) as resp:
                    assert resp.status == 200
                d.status = 500
                headers = {"X-Request-Id": "req-json-2"}
                async with client.post(
                    url + "/v1/completions", json={"prompt": "a"}, headers=headers
                ) as resp:
                    assert resp.status == 502
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 4 * WAIT) == 0
            return (await proc.stderr.read()).decode()

    stderr = ""

    async def main() -> None:
        nonlocal stderr
        stderr = await body()

    run(main)
    lines = [json.loads(line) for line in stderr.splitlines() if line.strip()]
    assert lines and all({"time", "level", "logger", "message"} <= set(x) for x in lines)
    requests = {x["request_id"]: x for x in lines if x.get("event") == "request"}
    ok, failed = requests["req-json-1"], requests["req-json-2"]
    assert ok["level"] == "INFO" and ok["logger"] == "vllm.ext.proxy"
    assert ok["status"] == "200" and ok["path"] == "/v1/completions" and ok["mode"] == "push"
    assert ok["prefill"].startswith("200/") and ok["decode"].startswith("200/")
    assert ok["total_ms"] > 0 and "request_id=req-json-1" in ok["message"]
    assert failed["status"] == "502" and "exploded" in failed["decode_error"]
    assert any("draining" in x["message"] for x in lines)  # the other lines too


def test_text_is_the_default_and_json_is_a_choice() -> None:
    from proxy_fakes import proxy_help

    assert "--log-format {text,json}" in proxy_help()


def test_json_without_the_library_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_ext.proxy.cli import main

    monkeypatch.setitem(sys.modules, "pythonjsonlogger.json", None)  # import fails
    with pytest.raises(SystemExit) as exit_:
        main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
              "--mode", "pull", "--log-format", "json"])  # fmt: skip
    assert exit_.value.code == 2
    assert "--log-format json needs python-json-logger" in capsys.readouterr().err
