# SPDX-License-Identifier: Apache-2.0
"""The proxy's drain on SIGTERM, as a real process in front of fake engines.

SIGTERM: ``/health`` answers 503 at once; new requests are still served for
``--shutdown-delay``; then the proxy stops listening, lets the streams in flight
finish and exits 0, at most ``--shutdown-grace`` seconds after the signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from proxy_fakes import REPO, WAIT, FakeEngine, free_port, held_stream, run, serve, sse_events


@contextlib.asynccontextmanager
async def _proxy_process(*flags: str) -> AsyncIterator[tuple[Any, str, FakeEngine]]:
    """Fake P and D, and ``python -m vllm_ext.proxy`` in front of them once it is ready."""
    p, d = FakeEngine("prefill"), FakeEngine("decode")
    runners = [web.AppRunner(e.app(), handler_cancellation=True) for e in (p, d)]
    p_port, d_port = [await serve(r) for r in runners]
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_ext.proxy", "--port", str(port), *flags]
    cmd += ["--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}"]
    cmd += ["--p-engine-id", "P0", "--p-side-channel-port", "5601"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=REPO, env=env, stderr=asyncio.subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as client:
            for _ in range(400):
                with contextlib.suppress(aiohttp.ClientError):
                    async with client.get(url + "/health") as resp:
                        if resp.status == 200:
                            break
                assert proc.returncode is None, "proxy exited"
                await asyncio.sleep(0.05)
        yield proc, url, d
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        for r in runners:
            await r.cleanup()


async def _health_status(url: str) -> int:
    async with aiohttp.ClientSession() as client, client.get(url + "/health") as resp:
        return resp.status


@pytest.mark.timeout(60)
def test_sigterm_mid_stream_flips_readiness_serves_on_finishes_the_stream_and_exits() -> None:
    async def body() -> None:
        delay = 1.5
        async with _proxy_process("--shutdown-delay", str(delay), "--shutdown-grace", "20") as (
            proc,
            url,
            d,
        ):
            async with held_stream(url, d) as events:  # D holds it after the first event
                signalled = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                # readiness flips at once ...
                for _ in range(100):
                    if await _health_status(url) == 503:
                        break
                    await asyncio.sleep(0.02)
                assert await _health_status(url) == 503
                assert time.monotonic() - signalled < delay
                # ... while a request that still arrives within the delay is served
                async with (
                    aiohttp.ClientSession() as other,
                    other.post(url + "/v1/completions", json={"prompt": "b"}) as r,
                ):
                    assert r.status == 200
                    assert r.headers.get("Connection", "").lower() == "close"
                    assert (await r.json())["choices"][0]["text"] == "decode:Hello world"
                # after the delay the proxy listens no more, the stream still runs
                await asyncio.sleep(delay + 0.5)
                with pytest.raises(aiohttp.ClientConnectorError):
                    await _health_status(url)
                assert proc.returncode is None
                assert d.stream_gate is not None
                d.stream_gate.set()
                rest = [event async for event in events]
                assert rest[-1] == "[DONE]"
                assert "".join(json.loads(e)["choices"][0]["text"] for e in rest[:-1]) == (
                    "lo world"
                )
            rc = await asyncio.wait_for(proc.wait(), WAIT)
            assert rc == 0
            err = (await proc.stderr.read()).decode()
            assert "SIGTERM: draining" in err and "drain: nothing in flight" in err

    run(body)


@pytest.mark.timeout(60)
def test_a_stream_past_the_grace_is_cut_and_the_proxy_exits() -> None:
    async def body() -> None:
        grace = 1.0
        async with _proxy_process("--shutdown-delay", "0", "--shutdown-grace", str(grace)) as (
            proc,
            url,
            d,
        ):
            d.stream_gate = asyncio.Event()  # never set: the stream outlives the grace
            async with aiohttp.ClientSession() as client:
                data = json.dumps({"prompt": "a", "stream": True})
                async with client.post(url + "/v1/completions", data=data) as resp:
                    events = sse_events(resp)
                    await asyncio.wait_for(events.__anext__(), WAIT)
                    signalled = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
                    rc = await asyncio.wait_for(proc.wait(), grace + WAIT)
                    assert rc == 0 and time.monotonic() - signalled >= grace
                    with contextlib.suppress(aiohttp.ClientPayloadError):
                        rest = [event async for event in events]
                        assert "[DONE]" not in rest
            await asyncio.wait_for(d.cancelled.wait(), WAIT)  # the D leg was cancelled
            err = (await proc.stderr.read()).decode()
            assert "drain: 1 requests still in flight" in err

    run(body)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("manifest", ["prefill.yaml", "decode.yaml"])
def test_the_engines_prestop_waits_until_the_engine_is_idle(manifest: str) -> None:
    """The engines' preStop script (deploy/k8s/base), its waits shortened, against a fake
    engine's ``/metrics``: it returns only once nothing runs or waits there."""
    import yaml

    (pod,) = [
        doc
        for doc in yaml.safe_load_all((REPO / "deploy/k8s/base" / manifest).read_text())
        if doc["kind"] == "StatefulSet"
    ]
    (container,) = pod["spec"]["template"]["spec"]["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"]
    grace = pod["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert "< 540" in command[2] and grace > 540  # vLLM gets time to exit after it
    port = container["ports"][0]["containerPort"]

    async def body() -> None:
        engine = FakeEngine("decode")
        engine.metrics = {"vllm:num_requests_running": 1.0, "vllm:num_requests_waiting": 0.0}
        runner = web.AppRunner(engine.app())
        fake_port = await serve(runner)
        script = command[2].replace(f":{port}/", f":{fake_port}/")
        script = script.replace("time.sleep(20)", "time.sleep(0)").replace("time.sleep(5)", "")
        env = dict(os.environ, POD_IP="127.0.0.1")
        try:
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, env=env)
            await asyncio.sleep(3)
            assert proc.returncode is None and engine.metrics_scraped >= 1  # still busy
            engine.metrics["vllm:num_requests_running"] = 0.0
            assert await asyncio.wait_for(proc.wait(), WAIT) == 0
        finally:
            await runner.cleanup()

    run(body)
