# SPDX-License-Identifier: Apache-2.0
"""What vllm-router (the real binary, ``--vllm-pd-disaggregation``) sends the engines,
recorded by two fake engines: the contract push behind it relies on.

* the P leg carries ``do_remote_decode`` and no ``transfer_id`` (P then makes one);
* the D leg leaves after P's answer and carries P's ``kv_transfer_params`` verbatim,
  a ``transfer_secret`` included (P answers one when the P leg carried it);
* both legs carry the same ``X-Request-Id`` (the router's own, not the client's), so
  vLLM's request ids on P and D differ only in their per-engine random suffix and a
  sub-request meets its twin under the transfer id P made.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from devkit.launch.process import ManagedProcess, free_port, wait_http_ready
from devkit.launch.xpyd import vllm_router_binary
from vllm_ext.nixl_push.answer import SequentialLegIds, d_leg_answer
from vllm_ext.nixl_push.matching import sub_request_of, transfer_tag

ROUTER = vllm_router_binary()
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed"),
]


class RecordingEngine:
    """An OpenAI completions server on 127.0.0.1 that records each request."""

    def __init__(self, answer: dict[str, Any] | None) -> None:
        self.answer = answer
        self.seen: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/health", _health)
        app.router.add_get("/metrics", _metrics)
        app.router.add_post("/v1/completions", self._complete)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _complete(self, request: web.Request) -> web.Response:
        self.seen.append((dict(request.headers), await request.json()))
        return await _json({
            "id": "cmpl-x", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": "a", "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            "kv_transfer_params": self.answer,
        })  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


async def _json(body: dict[str, Any]) -> web.Response:
    return web.json_response(body)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({})


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text="")


P_ANSWER = d_leg_answer(
    {"remote_engine_id": "P0", "remote_host": "127.0.0.1", "remote_port": 5601, "tp_size": 1},
    1, *SequentialLegIds().ids_for("cmpl-x-0-11111111", "a-leg-secret-0123456789"),
)  # fmt: skip


@pytest.fixture(scope="module")
def routed(tmp_path_factory) -> Iterator[tuple[str, RecordingEngine, RecordingEngine]]:
    p, d = RecordingEngine(P_ANSWER), RecordingEngine(None)
    port = free_port()
    argv = [
        ROUTER, "--vllm-pd-disaggregation", "--policy", "round_robin",
        "--prefill", p.url, "--decode", d.url, "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    proc = ManagedProcess("vllm-router", argv, tmp_path_factory.mktemp("router") / "router.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(f"{url}/health", 60, proc)
        yield url, p, d
    finally:
        proc.stop()
        p.close()
        d.close()


def test_the_d_leg_carries_p_answer_verbatim_under_the_same_request_id(routed) -> None:
    url, p, d = routed
    body = {"model": "m", "prompt": "hello", "max_tokens": 3}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json", "X-Request-Id": "client-id-1"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    ((p_headers, p_body),) = p.seen
    ((d_headers, d_body),) = d.seen
    p_params = p_body["kv_transfer_params"]
    assert p_params["do_remote_decode"] is True and "transfer_id" not in p_params
    assert p_body["max_tokens"] == 1
    assert d_body["kv_transfer_params"] == P_ANSWER  # the secret included
    assert d_body["max_tokens"] == 3

    hdr = {k.lower(): v for k, v in p_headers.items()}["x-request-id"]
    assert {k.lower(): v for k, v in d_headers.items()}["x-request-id"] == hdr
    assert hdr != "client-id-1"
    assert re.fullmatch(
        rf"___prefill_addr_127\.0\.0\.1:{p.port}___decode_addr_127\.0\.0\.1:{d.port}_[0-9a-f]{{32}}",
        hdr,
    ), hdr
    # vLLM's engine request ids from that header (completions: "cmpl-<id>-<prompt>",
    # then a random "-<8 hex>" per engine): the same sub-request on both sides.
    p_rid, d_rid = f"cmpl-{hdr}-0-1a2b3c4d", f"cmpl-{hdr}-0-deadbeef"
    assert sub_request_of(p_rid) == sub_request_of(d_rid) == "/0"
    tid = P_ANSWER["transfer_id"]
    assert transfer_tag(tid, p_rid) == transfer_tag(tid, d_rid)
