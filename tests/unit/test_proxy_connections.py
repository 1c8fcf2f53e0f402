# SPDX-License-Identifier: Apache-2.0
"""Connections the engines close: a leg whose request never reached the engine is sent
again once on a new connection, and every leg error is named in the request's log line.

Issue 12: the first 16k-token request of a GPU run came back as 502 after 2.3 ms with
``prefill=error`` and no reason logged; P never saw it. A pooled keep-alive connection
that the engine had closed is the usual cause. The fake engines here are real aiohttp
servers that close such connections unanswered, as a server does when the client reuses
an idle connection at the moment the server drops it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
from proxy_fakes import harness, run


@pytest.fixture
def proxy_log() -> Iterator[list[str]]:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger("vllm.ext.proxy")
    handler, old_level = Keep(level=logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield lines
    log.removeHandler(handler)
    log.setLevel(old_level)


async def _line(lines: list[str], request_id: str) -> str:
    for _ in range(200):
        found = [ln for ln in lines if f"request_id={request_id} " in ln]
        if found:
            return found[0]
        await asyncio.sleep(0.01)
    raise AssertionError(f"no log line for {request_id}: {lines}")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_leg_on_a_connection_the_engine_closed_is_retried_once(mode, proxy_log) -> None:
    async def body() -> None:
        # The proxy keeps idle connections longer than the engines do: the reuse race.
        async with harness(mode, keepalive_timeout=30.0) as h:
            for engine in (h.prefill, h.decode):
                engine.drop_idle_after = 0.2
                if mode == "pull":
                    engine.kv_params_out = {"do_remote_prefill": True}
            status, _, _ = await h.post("/v1/completions", {"prompt": "a"}, {"X-Request-Id": "r1"})
            assert status == 200
            await asyncio.sleep(0.4)  # both pooled connections now idle past the engines' limit
            status, out, _ = await h.post(
                "/v1/completions", {"prompt": "b"}, {"X-Request-Id": "r2"}
            )
            assert status == 200, out
            assert out["engine"] == "decode"
            # each engine dropped the reused connection once and served the retry
            assert (h.prefill.dropped, h.decode.dropped) == (1, 1)
            assert [len(h.prefill.received), len(h.decode.received)] == [2, 2]
            line = await _line(proxy_log, "r2")
            assert "status=200" in line
            for leg in ("prefill", "decode"):
                assert f'{leg}_retried_after="ServerDisconnectedError' in line, line
            assert "_error=" not in line
            first = await _line(proxy_log, "r1")
            assert "retried" not in first

    run(body)


@pytest.mark.timeout(30)
def test_a_new_connection_dropped_unanswered_is_not_retried_and_is_named(proxy_log) -> None:
    """The engine may have taken the request before it dropped the connection: a 502,
    with the exception class and message in the client's error and the log line."""

    async def body() -> None:
        async with harness("push") as h:
            h.prefill.drop_idle_after = 0  # every connection, at its first request
            status, out, _ = await h.post("/v1/completions", {"prompt": "a"}, {"X-Request-Id": "r"})
            assert status == 502
            assert out["error"]["message"].startswith(
                "prefill leg failed: ServerDisconnectedError"
            ), out
            assert h.prefill.dropped == 1  # one attempt only
            line = await _line(proxy_log, "r")
            assert "prefill=error/" in line
            assert 'prefill_error="ServerDisconnectedError: Server disconnected"' in line, line
            assert "retried" not in line

    run(body)


@pytest.mark.timeout(30)
def test_a_refused_connection_is_tried_twice_then_named(proxy_log) -> None:
    from proxy_fakes import free_port

    async def body() -> None:
        async with harness("push", prefill_url=f"http://127.0.0.1:{free_port()}") as h:
            status, out, _ = await h.post("/v1/completions", {"prompt": "a"}, {"X-Request-Id": "x"})
            assert status == 503
            line = await _line(proxy_log, "x")
            assert 'prefill_retried_after="ClientConnectorError' in line, line
            assert 'prefill_error="ClientConnectorError' in line, line

    run(body)
