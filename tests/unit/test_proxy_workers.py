# SPDX-License-Identifier: Apache-2.0
"""``--workers N``: several proxy processes on one port, as real processes in front of
fake engines. Requests land on every worker (SO_REUSEPORT spreads new connections),
``/metrics`` from any worker sums them all, and SIGTERM to the supervisor drains
every worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from proxy_fakes import (
    REPO,
    WAIT,
    FakeEngine,
    free_port,
    held_stream,
    prometheus_samples,
    run,
    serve,
)

from vllm_ext.proxy import bodies
from vllm_ext.proxy.metrics import state_families

WORKERS = 2


def _fresh() -> aiohttp.ClientSession:
    """A client that opens a new connection per request (each may land on any worker)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def _health(url: str) -> tuple[int, dict[str, Any]]:
    async with _fresh() as client, client.get(url + "/health") as resp:
        return resp.status, await resp.json()


async def _workers_seen(url: str) -> dict[int, dict[str, Any]]:
    """Each worker's ``/health`` ``worker`` block, by pid (new connections until every
    worker answered once, at most 200 tries)."""
    seen: dict[int, dict[str, Any]] = {}
    for _ in range(200):
        _, payload = await _health(url)
        seen[payload["worker"]["pid"]] = payload["worker"]
        if len(seen) == WORKERS:
            break
    return seen


@contextlib.asynccontextmanager
async def _workers(*flags: str) -> AsyncIterator[tuple[Any, str, FakeEngine, list[int]]]:
    """Fake P and D, and ``python -m vllm_ext.proxy --workers 2`` in front of them once
    both workers answer; the workers' pids."""
    p, d = FakeEngine("prefill"), FakeEngine("decode")
    runners = [web.AppRunner(e.app(), handler_cancellation=True) for e in (p, d)]
    p_port, d_port = [await serve(r) for r in runners]
    port = free_port()
    cmd = [sys.executable, "-m", "vllm_ext.proxy", "--port", str(port), *flags]
    cmd += ["--workers", str(WORKERS)]
    cmd += ["--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}"]
    cmd += ["--p-engine-id", "P0", "--p-side-channel-port", "5601", "--log-level", "warning"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=REPO, env=env, stderr=asyncio.subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"
    pids: list[int] = []
    try:
        for _ in range(400):
            with contextlib.suppress(aiohttp.ClientError):
                if (await _health(url))[0] == 200:
                    break
            assert proc.returncode is None, "proxy exited"
            await asyncio.sleep(0.05)
        for _ in range(100):  # the second worker may bind a little later
            pids = sorted(await _workers_seen(url))
            if len(pids) == WORKERS:
                break
            await asyncio.sleep(0.05)
        yield proc, url, d, pids
    finally:
        for pid in [proc.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await proc.wait()
        for r in runners:
            await r.cleanup()


@pytest.mark.timeout(90)
def test_requests_land_on_both_workers_and_metrics_sum_them() -> None:
    n = 40

    async def body() -> None:
        async with _workers() as (proc, url, _d, pids):
            assert len(pids) == WORKERS, "SO_REUSEPORT gave every connection one worker"
            async with _fresh() as client:
                for i in range(n):
                    data = {"prompt": f"p{i}", "stream": i % 2 == 0, "max_tokens": 4}
                    async with client.post(url + "/v1/completions", json=data) as resp:
                        assert resp.status == 200
                        await resp.read()
            # each worker served some, and together all of them
            admitted = {pid: w["admitted"] for pid, w in (await _workers_seen(url)).items()}
            assert sorted(admitted) == pids
            assert all(a > 0 for a in admitted.values()) and sum(admitted.values()) == n
            # whichever worker answers the scrape, the counters are the sum of both
            await asyncio.sleep(1.5)  # every worker published its state (once a second)
            key = ("vllm_ext_proxy_requests_total", (("code", "200"), ("path", "/v1/completions")))
            async with _fresh() as client:
                for _ in range(10):
                    async with client.get(url + "/metrics") as resp:
                        samples = prometheus_samples(await resp.text())
                    assert samples[key] == n
                    assert samples[("vllm_ext_proxy_workers", ())] == WORKERS
                    assert samples[("vllm_ext_proxy_in_flight", ())] == 0
                    legs = [
                        v
                        for (name, labels), v in samples.items()
                        if name == "vllm_ext_proxy_legs_total" and ("leg", "decode") in labels
                    ]
                    assert sum(legs) == n
                    ttft = ("vllm_ext_proxy_ttft_seconds_count", (("path", "/v1/completions"),))
                    assert samples[ttft] == n // 2

    run(body)


@pytest.mark.timeout(90)
def test_sigterm_drains_every_worker_and_the_supervisor_exits_0() -> None:
    async def body() -> None:
        async with _workers("--shutdown-delay", "0.5", "--shutdown-grace", "20") as (
            proc,
            url,
            d,
            pids,
        ):
            async with held_stream(url, d) as events:  # D holds it after the first event
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(1.5)  # past the delay: no worker listens any more
                with pytest.raises(aiohttp.ClientConnectorError):
                    await _health(url)
                assert proc.returncode is None  # the stream's worker still runs
                assert d.stream_gate is not None
                d.stream_gate.set()
                rest = [event async for event in events]
                assert rest[-1] == "[DONE]"
            rc = await asyncio.wait_for(proc.wait(), WAIT)
            assert rc == 0
            for pid in pids:  # every worker exited with the supervisor
                with pytest.raises(ProcessLookupError):
                    os.kill(pid, 0)
            err = (await proc.stderr.read()).decode()
            assert err.count("SIGTERM: draining") == WORKERS, err

    run(body)


def test_bad_worker_flags_are_refused() -> None:
    from vllm_ext.proxy.cli import main

    base = ["--prefill", "http://a:1", "--decode", "http://b:2", "--mode", "pull"]
    for flags in (["--workers", "0"], ["--workers", "2", "--port", "0"]):
        with pytest.raises(SystemExit) as exited:
            main([*base, *flags])
        assert exited.value.code == 2


def test_state_of_two_workers_sums() -> None:
    """The state series summed over two workers' snapshots: in flight and limits add up,
    an engine is up only where both have it in service, a pair's state counts workers."""
    one = {
        "in_flight": 3, "max_in_flight": 10, "engines": {"prefill": 1, "decode": 1},
        "backends": [["prefill", "P0", 1.0, 2], ["decode", "D0", 1.0, 3]],
        "pairs": [["P0", "D0", "healthy", 1, 0]],
    }  # fmt: skip
    two = {
        "in_flight": 1, "max_in_flight": 10, "engines": {"prefill": 1, "decode": 1},
        "backends": [["prefill", "P0", 0.0, 0], ["decode", "D0", 1.0, 1]],
        "pairs": [["P0", "D0", "backed-off", 2, 1]],
    }  # fmt: skip
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in state_families([one, two])
        for s in family.samples
    }
    assert got[("vllm_ext_proxy_in_flight", ())] == 4
    assert got[("vllm_ext_proxy_max_in_flight", ())] == 20
    assert got[("vllm_ext_proxy_engine_up", (("engine", "P0"), ("role", "prefill")))] == 0
    assert got[("vllm_ext_proxy_engine_up", (("engine", "D0"), ("role", "decode")))] == 1
    assert (
        got[("vllm_ext_proxy_engine_legs_in_flight", (("engine", "D0"), ("role", "decode")))] == 4
    )
    pair = (("decode", "D0"), ("prefill", "P0"))
    assert got[("vllm_ext_proxy_pair_state", (*pair, ("state", "healthy")))] == 1
    assert got[("vllm_ext_proxy_pair_state", (*pair[:2], ("state", "backed-off")))] == 1
    assert got[("vllm_ext_proxy_pair_transfer_failures_total", pair)] == 3
    assert got[("vllm_ext_proxy_workers", ())] == 2
    alone = {s.name for family in state_families([one]) for s in family.samples}
    assert "vllm_ext_proxy_workers" not in alone


def test_push_decode_leg_is_the_client_bytes_with_the_params_added() -> None:
    """The D leg's bytes are the client's as they came, ``kv_transfer_params`` added
    before the closing brace; a client body that has the field is serialized anew."""
    raw = b' {"prompt": "\xc3\xa9t\xc3\xa9",  "stream": true, "n": [1, {}]}\n'
    client = json.loads(raw)
    params = {"kv_transfer_params": {"transfer_id": "t"}}
    out = bodies.with_fields(raw, client, params)
    assert out.startswith(raw.strip()[:-1])
    assert json.loads(out) == {**client, **params}
    assert json.loads(bodies.with_fields(b"{}", {}, params)) == params
    mine = {"prompt": "x", "kv_transfer_params": {"from": "client"}}
    assert json.loads(bodies.with_fields(json.dumps(mine).encode(), mine, params)) == {
        "prompt": "x",
        **params,
    }
    utf16 = json.dumps({"prompt": "x"}).encode("utf-16")
    assert json.loads(bodies.with_fields(utf16, {"prompt": "x"}, params)) == {
        "prompt": "x",
        **params,
    }
