# SPDX-License-Identifier: Apache-2.0
"""Fakes for the proxy tests: OpenAI engines as real aiohttp servers on loopback.

A :class:`FakeEngine` records what it gets and misbehaves on demand; :func:`harness`
starts a fake P, a fake D and the proxy in front of them on free 127.0.0.1 ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from vllm_ext.proxy import PrefillCoordinates, ProxyConfig, make_runner

REPO = Path(__file__).resolve().parents[2]
P_COORDS = PrefillCoordinates(
    engine_id="p-engine-0", host="10.1.2.3", side_channel_port=5601, tp_size=2, pp_size=1
)
PULL_KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [4, 5, 6],
    "remote_engine_id": "p-engine-0",
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
    "tp_size": 1,
}
WAIT = 5.0  # seconds any single expected event may take

Hook = Callable[["FakeEngine", dict[str, Any]], Awaitable[None]]


@dataclass
class Received:
    """One request as a fake engine saw it."""

    path: str
    headers: Any  # case-insensitive, as the engine got them
    body: dict[str, Any]
    at: float


@dataclass
class FakeEngine:
    """A fake vLLM OpenAI server that records what it gets and misbehaves on demand."""

    name: str
    status: int = 200
    raw_response: bytes | None = None
    hang: bool = False
    delay: float = 0.0
    on_receive: Hook | None = None
    chunks: list[str] = field(default_factory=lambda: ["Hel", "lo", " wor", "ld"])
    stream_gate: asyncio.Event | None = None  # awaited after the first chunk
    #: seconds between a stream's ``[DONE]`` and the end of its body
    end_delay: float = 0.0
    kv_params_out: dict[str, Any] | None = None
    healthy: bool = True
    #: Close a keep-alive connection, unanswered, when a request arrives on it after it
    #: sat idle this long (what a server does that closes idle connections as the
    #: client reuses one); ``0``: close every connection so, at its first request.
    drop_idle_after: float | None = None
    #: Requests that arrived on a connection that was then closed unanswered.
    dropped: int = 0
    _idle_since: dict[Any, float] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    got_request: asyncio.Event = field(default_factory=asyncio.Event)
    first_chunk_sent: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    responded_at: float | None = None
    #: what ``GET /metrics`` reports (vLLM's gauge names -> value); ``None``: 404
    metrics: dict[str, float] | None = None
    metrics_scraped: int = 0

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._drop_idle])
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        return app

    @web.middleware
    async def _drop_idle(self, request: web.Request, handler: Any) -> web.StreamResponse:
        transport = request.transport
        since = self._idle_since.get(transport)
        limit = self.drop_idle_after
        if limit is not None and transport is not None:
            idle = time.monotonic() - since if since is not None else None
            if limit == 0 or (idle is not None and idle > limit):
                self.dropped += 1
                transport.close()
                raise ConnectionResetError("dropped an idle keep-alive connection")
        try:
            return await handler(request)
        finally:
            self._idle_since[transport] = time.monotonic()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        """Prometheus text as vLLM writes it (one sample per gauge, labelled)."""
        self.metrics_scraped += 1
        if self.metrics is None:
            return web.Response(status=404)
        lines = []
        for name, value in self.metrics.items():
            lines += [f"# TYPE {name} gauge", f'{name}{{engine="0",model_name="tiny"}} {value}']
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization")
        return web.json_response({"object": "list", "data": [{"id": "tiny"}], "auth": auth})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(Received(request.path, request.headers.copy(), body, time.time()))
        self.got_request.set()
        try:
            if self.on_receive is not None:
                await self.on_receive(self, body)
            if self.hang:
                await asyncio.sleep(3600)
            await asyncio.sleep(self.delay)
            if self.status != 200:
                err = {"error": {"message": f"{self.name} exploded", "code": self.status}}
                return web.json_response(err, status=self.status)
            if self.raw_response is not None:
                return web.Response(body=self.raw_response, content_type="application/json")
            if body.get("stream"):
                return await self._stream(request, body)
            return web.json_response(self._completion(request.path, body))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.responded_at = time.time()

    def _completion(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        text = f"{self.name}:{''.join(self.chunks)}"
        choice: dict[str, Any] = {"text": text}
        if "chat" in path:
            choice = {"message": {"role": "assistant", "content": text}}
        out: dict[str, Any] = {"id": "cmpl-x", "engine": self.name, "choices": [choice]}
        if self.kv_params_out is not None:
            out["kv_transfer_params"] = self.kv_params_out
        return out

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for i, piece in enumerate(self.chunks):
            await resp.write(f"data: {json.dumps({'choices': [{'text': piece}]})}\n\n".encode())
            if i == 0:
                self.first_chunk_sent.set()
                if self.stream_gate is not None:
                    await self.stream_gate.wait()
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(self.end_delay)
        await resp.write_eof()
        return resp


@dataclass
class Harness:
    prefill: FakeEngine
    decode: FakeEngine
    client: aiohttp.ClientSession
    url: str
    config: ProxyConfig

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any], Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.client.post(self.url + path, data=data, headers=headers) as resp:
            return resp.status, json.loads(await resp.read()), resp.headers


async def serve(runner: web.BaseRunner) -> int:
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner.addresses[0][1]


def prometheus_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(sample name, sorted labels): value}, parsed by prometheus_client."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def proxy_help() -> str:
    """What ``vllm-ext-proxy --help`` prints, from a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "vllm_ext.proxy", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=60,
    ).stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def harness(mode: str = "push", prefill_url: str | None = None, **kw: Any):
    p, d = FakeEngine("prefill"), FakeEngine("decode")
    runners = [web.AppRunner(e.app(), handler_cancellation=True) for e in (p, d)]
    p_port, d_port = [await serve(r) for r in runners]
    config = ProxyConfig(
        prefill_url=prefill_url or f"http://127.0.0.1:{p_port}",
        decode_url=f"http://127.0.0.1:{d_port}",
        mode=mode,  # type: ignore[arg-type]
        prefill=P_COORDS if mode == "push" else None,
        **kw,
    )
    proxy = make_runner(config)
    port = await serve(proxy)
    try:
        async with aiohttp.ClientSession() as client:
            yield Harness(p, d, client, f"http://127.0.0.1:{port}", config)
    finally:
        for r in (proxy, *runners):
            await r.cleanup()


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro_fn())  # type: ignore[arg-type]


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The ``data:`` payloads of a stream, one at a time, as they arrive."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            yield event.decode().removeprefix("data: ")


@contextlib.asynccontextmanager
async def held_stream(url: str, decode: FakeEngine) -> AsyncIterator[AsyncIterator[str]]:
    """A streamed completion through the proxy at ``url`` whose D holds its stream after
    the first event (``decode.stream_gate``; set it to let the rest come): the stream's
    events, the first one read."""
    decode.stream_gate = asyncio.Event()
    async with aiohttp.ClientSession() as client:
        data = json.dumps({"prompt": "a", "stream": True})
        async with client.post(url + "/v1/completions", data=data) as resp:
            assert resp.status == 200
            events = sse_events(resp)
            first = await asyncio.wait_for(events.__anext__(), WAIT)
            assert json.loads(first)["choices"][0]["text"] == "Hel"
            yield events


def wait_for_other(other: FakeEngine) -> Hook:
    """A hook that records whether the other leg arrived while this one was in flight."""

    async def hook(engine: FakeEngine, body: dict[str, Any]) -> None:
        try:
            await asyncio.wait_for(other.got_request.wait(), WAIT)
            engine.kv_params_out = {"saw_other": True}
        except TimeoutError:
            engine.kv_params_out = {"saw_other": False}

    return hook


def p_coords(i: int) -> PrefillCoordinates:
    """Distinct coordinates of the i-th fake P (xPyD)."""
    return PrefillCoordinates(
        engine_id=f"P{i}", host=f"10.0.0.{i + 1}", side_channel_port=5600 + i, tp_size=1
    )


@dataclass
class XHarness:
    prefills: list[FakeEngine]
    decodes: list[FakeEngine]
    client: aiohttp.ClientSession
    url: str
    config: ProxyConfig
    runners: dict[str, web.AppRunner]

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any], Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.client.post(self.url + path, data=data, headers=headers) as resp:
            return resp.status, json.loads(await resp.read()), resp.headers

    async def health(self) -> dict[str, Any]:
        async with self.client.get(self.url + "/health") as resp:
            out: dict[str, Any] = await resp.json()
            out["http_status"] = resp.status
            return out

    async def stop_engine(self, engine: FakeEngine) -> None:
        """Close a fake engine's server: its port refuses connections from now on."""
        await self.runners[engine.name].cleanup()


@contextlib.asynccontextmanager
async def xpyd_harness(n_prefill: int = 2, n_decode: int = 2, mode: str = "push", **kw: Any):
    """``n_prefill`` fake P (``P0``...) and ``n_decode`` fake D (``D0``...) behind the proxy."""
    from vllm_ext.proxy.config import DecodeEndpoint, PrefillEndpoint

    ps = [FakeEngine(f"P{i}") for i in range(n_prefill)]
    ds = [FakeEngine(f"D{i}") for i in range(n_decode)]
    runners = {e.name: web.AppRunner(e.app(), handler_cancellation=True) for e in ps + ds}
    ports = {name: await serve(r) for name, r in runners.items()}
    config = ProxyConfig(
        mode=mode,  # type: ignore[arg-type]
        prefills=tuple(
            PrefillEndpoint(
                f"http://127.0.0.1:{ports[e.name]}", p_coords(i) if mode == "push" else None
            )
            for i, e in enumerate(ps)
        ),
        decodes=tuple(DecodeEndpoint(f"http://127.0.0.1:{ports[e.name]}") for e in ds),
        **kw,
    )
    proxy = make_runner(config)
    port = await serve(proxy)
    try:
        async with aiohttp.ClientSession() as client:
            yield XHarness(ps, ds, client, f"http://127.0.0.1:{port}", config, runners)
    finally:
        for r in (proxy, *runners.values()):
            await r.cleanup()


@dataclass
class FakeDns(asyncio.DatagramProtocol):
    """Answers SRV and A questions from ``srv`` / ``a``; ``fail`` answers SERVFAIL."""

    #: SRV name -> [(target, port)]
    srv: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    #: host name -> IPv4 address
    a: dict[str, str] = field(default_factory=dict)
    fail: bool = False
    questions: int = 0
    transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        query = dns.message.from_wire(data)
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.AA
        self.questions += 1
        (question,) = query.question
        name = question.name.to_text(omit_final_dot=True)
        rdtype = dns.rdatatype.to_text(question.rdtype)
        if self.fail:
            reply.set_rcode(dns.rcode.SERVFAIL)
        elif rdtype == "SRV" and self.srv.get(name):
            texts = [f"0 10 {port} {target}." for target, port in self.srv[name]]
            reply.answer.append(dns.rrset.from_text(question.name, 5, "IN", "SRV", *texts))
        elif rdtype == "A" and name in self.a:
            reply.answer.append(dns.rrset.from_text(question.name, 5, "IN", "A", self.a[name]))
        elif name not in self.srv and name not in self.a:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        self.transport.sendto(reply.to_wire(), addr)

    def publish(self, srv: str, engines: dict[str, int]) -> None:
        """``srv`` points at ``engines`` (pod name -> HTTP port), all on 127.0.0.1."""
        service = srv.split(".", 2)[2]
        self.srv[srv] = [(f"{pod}.{service}", port) for pod, port in engines.items()]
        for pod in engines:
            self.a[f"{pod}.{service}"] = "127.0.0.1"
