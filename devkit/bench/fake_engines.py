# SPDX-License-Identifier: Apache-2.0
"""Fake OpenAI engines for the proxy-at-scale benchmark (:mod:`devkit.bench.scale_proxy`).

    python -m devkit.bench.fake_engines --role decode --port 18001 --tokens 16 --gap-ms 5

One process serves one role on 127.0.0.1, with no model behind it, so that what a
proxy in front adds can be told from what the engines take:

* ``prefill`` answers ``POST /v1/completions`` and ``/v1/chat/completions`` at once
  with a one-token completion whose ``kv_transfer_params`` are what a D leg needs
  (a router that runs the legs one after the other, as vllm-router does, hands them
  to D verbatim); a P leg with ``stream`` true gets the same answer as SSE.
* ``decode`` streams ``--tokens`` SSE events (the first at once, then one every
  ``--gap-ms`` milliseconds on a fixed schedule from the request's arrival, so a
  slow reader does not stretch the pace), then ``data: [DONE]``; a request with
  ``stream`` false gets the whole completion as one JSON body after the same time.

Both take whatever ``kv_transfer_params`` come (our proxy's push legs, vllm-router's
pull-style legs, none from a client that calls D directly) and count what they saw
at ``GET /stats``: requests by path, how many carried ``kv_transfer_params``, and
how many D legs carried P's coordinates (``remote_engine_id``). ``GET /health``,
``/v1/models`` and ``/metrics`` answer what routers probe at start.

The events are built once per process (one id for every request): the fakes'
own cost per token is one socket write, and uvloop runs their loop when installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections import Counter
from typing import Any

from aiohttp import web

MODEL = "fake-model"
#: P's side-channel coordinates as the fake P answers them (no NIXL behind them)
FAKE_P_COORDS = {
    "remote_engine_id": "fake-prefill",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}


def _completion_event(index: int, chat: bool, final: bool) -> bytes:
    """One SSE event of a streamed answer, as vLLM's OpenAI server writes it."""
    finish = "length" if final else None
    if chat:
        body: dict[str, Any] = {
            "id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": f" tok{index}"}, "logprobs": None,
                         "finish_reason": finish}],
        }  # fmt: skip
    else:
        body = {
            "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "text": f" tok{index}", "logprobs": None,
                         "finish_reason": finish, "stop_reason": None}],
        }  # fmt: skip
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _completion_json(tokens: int, chat: bool, kv_params: dict[str, Any] | None) -> bytes:
    """A whole (non-streamed) answer of ``tokens`` tokens."""
    text = "".join(f" tok{i}" for i in range(tokens))
    usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}
    if chat:
        choice: dict[str, Any] = {
            "index": 0, "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
        }  # fmt: skip
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        obj = "text_completion"
    body = {
        "id": "cmpl-fake", "object": obj, "created": 0, "model": MODEL,
        "choices": [choice], "usage": usage, "kv_transfer_params": kv_params,
    }  # fmt: skip
    return json.dumps(body, separators=(",", ":")).encode()


class FakeEngine:
    """One role's fake engine (see the module docstring)."""

    def __init__(self, role: str, tokens: int, gap_s: float) -> None:
        self.role = role
        self.tokens = tokens
        self.gap_s = gap_s
        self.stats: Counter[str] = Counter()
        self._events = {
            chat: [_completion_event(i, chat, i == tokens - 1) for i in range(tokens)]
            for chat in (False, True)
        }

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/health", _empty)
        app.router.add_get("/metrics", _empty)
        app.router.add_get("/v1/models", _models)
        app.router.add_get("/stats", self.report)
        return app

    async def report(self, request: web.Request) -> web.Response:
        return web.json_response(dict(self.stats))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        kv = body.get("kv_transfer_params")
        self.stats[request.path] += 1
        if isinstance(kv, dict):
            self.stats["with_kv_transfer_params"] += 1
            if kv.get("remote_engine_id") is not None:
                self.stats["with_p_coordinates"] += 1
        if self.role == "prefill":
            return await self._prefill(request, body, chat)
        if not body.get("stream", False):
            await asyncio.sleep(
                max(0.0, arrived + self.gap_s * (self.tokens - 1) - time.monotonic())
            )
            raw = _completion_json(self.tokens, chat, None)
            return web.Response(body=raw, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, event in enumerate(self._events[chat]):
            wait = arrived + i * self.gap_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await response.write(event)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _prefill(
        self, request: web.Request, body: dict[str, Any], chat: bool
    ) -> web.StreamResponse:
        kv = {
            **FAKE_P_COORDS,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [0],
            "transfer_id": uuid.uuid4().hex,
        }
        raw = _completion_json(1, chat, kv)
        if not body.get("stream", False):
            return web.Response(body=raw, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + raw + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response


async def _empty(request: web.Request) -> web.Response:
    return web.Response(text="")


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


def new_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop when uvloop is installed, else asyncio's (the harness's
    processes only: the proxies under test run as they ship)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m devkit.bench.fake_engines",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokens", type=int, default=16, help="tokens D streams per request")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="milliseconds between D's tokens")
    args = ap.parse_args(argv)
    engine = FakeEngine(args.role, args.tokens, args.gap_ms / 1000)
    web.run_app(
        engine.app(), host="127.0.0.1", port=args.port, access_log=None, print=None,
        backlog=4096, loop=new_loop(),
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
