# SPDX-License-Identifier: Apache-2.0
"""The proxy's API keys, what it forwards to the engines, and two small bugs (the
``--log-level`` flag, a 504's message), against fake engines over real HTTP."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest
from proxy_fakes import REPO, harness, run

from vllm_ext.proxy import LegTimeouts
from vllm_ext.proxy.cli import build_parser, config_from_args

ARGS = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"]
ARGS += ["--p-engine-id", "P0", "--p-side-channel-port", "5601"]


async def _get(h: Any, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with h.client.get(h.url + path, headers=headers) as resp:
        return resp.status, resp


@pytest.mark.timeout(30)
def test_api_keys_guard_the_openai_routes_only() -> None:
    async def body() -> None:
        async with harness(api_keys=("old-key", "new-key")) as h:
            for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "new-key"}):
                status, out, resp_headers = await h.post(
                    "/v1/completions", {"prompt": "x"}, headers
                )
                assert status == 401, out
                assert resp_headers["WWW-Authenticate"] == "Bearer"
                assert out["error"]["code"] == 401
                assert out["error"]["type"] == "invalid_request_error"
                assert "API key" in out["error"]["message"]
                assert "wrong" not in out["error"]["message"]
            assert h.prefill.received == [] and h.decode.received == []
            async with h.client.get(h.url + "/v1/models") as resp:
                assert resp.status == 401
            for key in ("old-key", "new-key"):
                auth = {"Authorization": f"Bearer {key}"}
                status, out, _ = await h.post("/v1/chat/completions", {"messages": []}, auth)
                assert status == 200, out
                async with h.client.get(h.url + "/v1/models", headers=auth) as resp:
                    assert resp.status == 200
            # probes and scrapes need no key
            for path in ("/health", "/metrics"):
                async with h.client.get(h.url + path) as resp:
                    assert resp.status == 200, path
            # the client's key stays at the proxy
            assert all("Authorization" not in r.headers for r in h.decode.received)
            async with h.client.get(h.url + "/metrics") as resp:
                assert 'vllm_ext_proxy_rejected_total{reason="unauthorized"} 4.0' in (
                    await resp.text()
                )

    run(body)


@pytest.mark.timeout(30)
def test_the_clients_authorization_reaches_the_engines_only_when_configured() -> None:
    async def body() -> None:
        auth = {"Authorization": "Bearer client-secret", "traceparent": "00-abc-def-01"}
        async with harness() as h:
            assert (await h.post("/v1/completions", {"prompt": "x"}, auth))[0] == 200
            async with h.client.get(h.url + "/v1/models", headers=auth) as resp:
                assert (await resp.json())["auth"] is None
            for engine in (h.prefill, h.decode):
                (got,) = engine.received
                assert "Authorization" not in got.headers
                assert got.headers["traceparent"] == "00-abc-def-01"  # tracing still goes
        async with harness(forward_authorization=True) as h:
            assert (await h.post("/v1/completions", {"prompt": "x"}, auth))[0] == 200
            for engine in (h.prefill, h.decode):
                assert engine.received[0].headers["Authorization"] == "Bearer client-secret"
        async with harness(engine_api_key="engine-key", forward_authorization=True) as h:
            assert (await h.post("/v1/completions", {"prompt": "x"}, auth))[0] == 200
            for engine in (h.prefill, h.decode):
                assert engine.received[0].headers["Authorization"] == "Bearer engine-key"
            async with h.client.get(h.url + "/v1/models", headers=auth) as resp:
                assert (await resp.json())["auth"] == "Bearer engine-key"

    run(body)


def test_cli_keys_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser().parse_args
    config = config_from_args(parse(ARGS))
    assert config.api_keys == () and not config.forward_authorization
    assert config.engine_api_key == "" and config.host == "127.0.0.1"
    monkeypatch.setenv("VLLM_EXT_PROXY_API_KEY", "k1, k2")
    monkeypatch.setenv("VLLM_EXT_PROXY_ENGINE_API_KEY", "ek")
    config = config_from_args(parse([*ARGS, "--api-key", "k0", "--host", "0.0.0.0"]))
    assert config.api_keys == ("k0", "k1", "k2") and config.engine_api_key == "ek"
    assert config.host == "0.0.0.0"
    assert "k0" not in repr(config) and "ek" not in repr(config)
    config = config_from_args(parse([*ARGS, "--forward-authorization"]))
    assert config.forward_authorization


def test_log_level_verbose_is_a_clear_usage_error() -> None:
    """It was a traceback (ValueError: Unknown level: 'VERBOSE') from logging."""
    out = subprocess.run(
        [sys.executable, "-m", "vllm_ext.proxy", *ARGS, "--log-level", "verbose"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=60,
    )
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr
    assert "argument --log-level: invalid choice: 'VERBOSE'" in out.stderr
    assert build_parser().parse_args([*ARGS, "--log-level", "debug"]).log_level == "DEBUG"


@pytest.mark.timeout(30)
def test_a_504_names_its_limits_without_nones() -> None:
    """A leg without an idle limit said ``idle=Nones``."""

    async def body() -> None:
        async with harness(
            mode="pull", prefill_timeouts=LegTimeouts(connect=10.0, total=0.2, idle=None)
        ) as h:
            h.prefill.delay = 2.0
            status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 504, out
            message = out["error"]["message"]
            assert message.endswith("[limits: connect=10s total=0.2s idle=none]"), message
            assert "Nones" not in message
            await asyncio.sleep(0)

    run(body)
