# SPDX-License-Identifier: Apache-2.0
"""One request's failure never takes the only pair out (SPEC S-PRX-2), against fake
engines served over real HTTP.

Only what says an engine is unhealthy takes it out of service: its ``/health``
failing, a refused connection, a connection dropped before any answer. A slow prompt
(a leg timeout) or an error answer to one request does not. While a role has no
engine in service the proxy answers a JSON 503 with ``Retry-After`` itself and its
own ``/health`` stays 200 (its readiness), so a Service keeps routing clients to it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from proxy_fakes import free_port, harness, run, xpyd_harness

from vllm_ext.proxy.config import LegTimeouts


async def _health(h: Any) -> tuple[int, dict[str, Any]]:
    async with h.client.get(h.url + "/health") as resp:
        return resp.status, await resp.json()


def _pair(health: dict[str, Any]) -> dict[str, Any]:
    (pair,) = health["pairs"]
    return pair


@pytest.mark.timeout(30)
def test_slow_prompts_and_one_error_leave_the_lone_pair_serving() -> None:
    """Two P-leg timeouts and one 500 in a row (the defaults back a pair off after three
    transfer failures): the next request is served, nothing is backed off."""

    async def body() -> None:
        async with harness(prefill_timeouts=LegTimeouts(total=0.3), health_interval=60) as h:
            # a prompt slower than the P leg's timeout (D waits for its KV meanwhile)
            h.prefill.delay = h.decode.delay = 1.0
            for _ in range(2):
                status, out, _ = await h.post("/v1/completions", {"prompt": "long"})
                assert status == 504 and out["error"]["message"].startswith("prefill"), out
            h.prefill.delay = h.decode.delay = 0.0
            h.prefill.status = 500
            status, _, _ = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 502
            h.prefill.status = 200
            status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 200, out
            code, health = await _health(h)
            assert code == 200 and health["status"] == "ok"
            pair = _pair(health)
            assert pair["state"] == "healthy" and pair["times_backed_off"] == 0
            assert pair["transfer_failures"] == 1  # the 500 only; timeouts never count
            assert all(e["in_service"] for e in health["engines"])

    run(body)


@pytest.mark.timeout(30)
def test_an_engine_whose_health_fails_gets_a_json_503_and_the_proxy_stays_ready() -> None:
    async def body() -> None:
        async with harness(health_interval=0.1, health_failures=2) as h:
            assert (await h.post("/v1/completions", {"prompt": "x"}))[0] == 200
            h.decode.healthy = False  # D's /health answers 503
            for _ in range(100):
                code, health = await _health(h)
                if not next(e for e in health["engines"] if e["role"] == "decode")["in_service"]:
                    break
                await asyncio.sleep(0.05)
            assert code == 200 and health["status"] == "unavailable", health
            sent = (len(h.prefill.received), len(h.decode.received))
            status, out, headers = await h.post(
                "/v1/completions", {"prompt": "x"}, {"X-Request-Id": "while-down"}
            )
            assert status == 503, out
            assert headers["Content-Type"].startswith("application/json")
            assert headers["X-Request-Id"] == "while-down"
            assert int(headers["Retry-After"]) >= 1
            assert out["error"]["type"] == "service_unavailable" and out["error"]["code"] == 503
            assert out["error"]["message"].startswith("no decode engine is in service")
            assert (len(h.prefill.received), len(h.decode.received)) == sent
            h.decode.healthy = True  # the next good probe puts it back
            for _ in range(100):
                status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
                if status == 200:
                    break
                await asyncio.sleep(0.05)
            assert status == 200, out

    run(body)


@pytest.mark.timeout(30)
def test_a_connection_dropped_before_any_answer_counts_as_a_failed_probe() -> None:
    """D closes every new connection unanswered: two such legs in a row take it out
    (``health_failures``) and the pair is not blamed; a good probe puts D back."""

    async def body() -> None:
        async with harness(health_interval=60, health_failures=2, pair_failures=1) as h:
            h.decode.drop_idle_after = 0  # close each connection at its first request
            for _ in range(2):
                status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
                assert status == 502, out
            status, out, headers = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 503 and int(headers["Retry-After"]) >= 1, out
            assert h.decode.dropped >= 2  # the two legs (and the probe the 503 made first)
            h.decode.drop_idle_after = None
            code, health = await _health(h)  # probes now: D answers its /health
            assert code == 200 and health["status"] == "ok", health
            assert _pair(health)["state"] == "healthy"
            assert _pair(health)["transfer_failures"] == 0
            assert (await h.post("/v1/completions", {"prompt": "x"}))[0] == 200

    run(body)


@pytest.mark.timeout(30)
def test_an_engine_back_before_the_next_probe_serves_the_next_request() -> None:
    """D's port refuses (taken out at once); D comes back on the same port: the next
    request probes it now instead of getting 503 until the background probe (60 s)."""

    async def body() -> None:
        async with xpyd_harness(1, 1, health_interval=60) as h:
            (d,) = h.decodes
            port = int(h.config.decode_url.rsplit(":", 1)[1])
            await h.stop_engine(d)  # nothing listens on D's port
            status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 503 and "cannot connect" in out["error"]["message"], out
            status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 503 and "no decode engine is in service" in out["error"]["message"]
            runner = web.AppRunner(d.app(), handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            try:
                await asyncio.sleep(0.6)  # past the proxy's probe-on-demand interval
                status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
                assert status == 200, out
            finally:
                await runner.cleanup()

    run(body)


@pytest.mark.timeout(30)
def test_health_reports_which_engine_is_down() -> None:
    """``/health``'s status says whether the proxy takes requests (200 while it serves,
    engines down or not); its payload says which engine is down, never where."""

    async def body() -> None:
        async with harness() as h:
            async with h.client.get(h.url + "/health") as resp:
                assert resp.status == 200
                assert (await resp.json())["down"] == []
            h.decode.healthy = False
            async with h.client.get(h.url + "/health") as resp:
                out = await resp.json()
                assert resp.status == 200 and out["down"] == ["decode"]
                assert out["status"] == "unavailable"
                assert out["prefill"] == "up" and out["decode"] == "down: HTTP 503"
        dead_port = free_port()
        dead = f"http://127.0.0.1:{dead_port}"
        async with harness(prefill_url=dead) as h, h.client.get(h.url + "/health") as resp:
            text = await resp.text()
            out = json.loads(text)
            assert resp.status == 200 and out["down"] == ["prefill"]
            assert out["prefill"].startswith("down: ClientConnectorError")
            assert str(dead_port) not in text and "127.0.0.1" not in text
            assert "10.1.2.3" not in text  # P's side channel (P_COORDS) neither

    run(body)
