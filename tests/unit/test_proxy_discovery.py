# SPDX-License-Identifier: Apache-2.0
"""The proxy finds P and D by DNS SRV records and follows them as they change (scale up,
scale down, a pod back at a new address, DNS failing). Real DNS over UDP on loopback
(a small authoritative server answering from a table, built with dnspython), real HTTP
to fake engines (tests/unit/proxy_fakes.py), the proxy as ``vllm-ext-proxy`` runs it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from proxy_fakes import FakeDns, FakeEngine, prometheus_samples, run, serve

from vllm_ext.proxy import make_runner
from vllm_ext.proxy.cli import build_parser, config_from_args

P_SRV = "_http._tcp.vllm-prefill.vllm-pd.svc.cluster.local"
D_SRV = "_http._tcp.vllm-decode.vllm-pd.svc.cluster.local"
SIDE_PORT = 5601
INTERVAL = 0.1
WAIT = 10.0


@dataclass
class Cluster:
    dns: FakeDns
    engines: dict[str, FakeEngine]
    ports: dict[str, int]
    client: aiohttp.ClientSession
    url: str

    async def post(self, prompt: str) -> tuple[int, dict[str, Any], Any]:
        async with self.client.post(
            self.url + "/v1/completions", data=json.dumps({"prompt": prompt})
        ) as resp:
            return resp.status, json.loads(await resp.read()), resp.headers

    async def engine_names(self) -> dict[str, list[str]]:
        async with self.client.get(self.url + "/health") as resp:
            health = await resp.json()
        out: dict[str, list[str]] = {"prefill": [], "decode": []}
        for engine in health["engines"]:
            out[engine["role"]].append(engine["name"])
        return {role: sorted(names) for role, names in out.items()}

    async def until_engines(self, role: str, names: list[str]) -> None:
        deadline = asyncio.get_running_loop().time() + WAIT
        while (await self.engine_names())[role] != names:
            assert asyncio.get_running_loop().time() < deadline, await self.engine_names()
            await asyncio.sleep(INTERVAL / 2)

    async def metrics(self) -> dict[tuple[str, tuple], float]:
        async with self.client.get(self.url + "/metrics") as resp:
            text = await resp.text()
        return prometheus_samples(text)


@contextlib.asynccontextmanager
async def cluster(pods: list[str], published: dict[str, list[str]]) -> AsyncIterator[Cluster]:
    """Fake engines ``pods`` (``vllm-prefill-*`` / ``vllm-decode-*``), the ones in
    ``published`` in DNS, and the proxy started from its command line."""
    loop = asyncio.get_running_loop()
    fake = FakeDns()
    transport, _ = await loop.create_datagram_endpoint(lambda: fake, local_addr=("127.0.0.1", 0))
    dns_port = transport.get_extra_info("sockname")[1]
    engines = {pod: FakeEngine(pod) for pod in pods}
    runners = {pod: web.AppRunner(e.app(), handler_cancellation=True) for pod, e in engines.items()}
    ports = {pod: await serve(r) for pod, r in runners.items()}
    for srv, names in published.items():
        fake.publish(srv, {n: ports[n] for n in names})
    args = ["--mode", "push", "--prefill-srv", P_SRV, "--decode-srv", D_SRV,
            "--p-side-channel-port", str(SIDE_PORT), "--dns-server", f"127.0.0.1:{dns_port}",
            "--dns-interval", str(INTERVAL), "--health-interval", "60"]  # fmt: skip
    proxy = make_runner(config_from_args(build_parser().parse_args(args)))
    try:
        port = await serve(proxy)
        async with aiohttp.ClientSession() as client:
            yield Cluster(fake, engines, ports, client, f"http://127.0.0.1:{port}")
    finally:
        for r in (proxy, *runners.values()):
            await r.cleanup()
        transport.close()


def _legs(engine: FakeEngine) -> int:
    return len(engine.received)


@pytest.mark.timeout(60)
def test_engines_follow_the_srv_records_as_p_scales_up_and_down() -> None:
    async def body() -> None:
        pods = ["vllm-prefill-0", "vllm-prefill-1", "vllm-decode-0"]
        published = {P_SRV: ["vllm-prefill-0"], D_SRV: ["vllm-decode-0"]}
        async with cluster(pods, published) as c:
            p0, p1, d = (c.engines[n] for n in pods)
            # found before the first request could come (the first look-up ran at start)
            assert await c.engine_names() == {
                "prefill": ["vllm-prefill-0"],
                "decode": ["vllm-decode-0"],
            }
            assert (await c.post("a"))[0] == 200
            # D is told the P that served: its pod name as engine id, its address
            kv = d.received[-1].body["kv_transfer_params"]
            assert (kv["remote_engine_id"], kv["remote_host"], kv["remote_port"]) == (
                "vllm-prefill-0",
                "127.0.0.1",
                SIDE_PORT,
            )

            # scale up: the second P's record appears
            c.dns.publish(P_SRV, {n: c.ports[n] for n in ("vllm-prefill-0", "vllm-prefill-1")})
            await c.until_engines("prefill", ["vllm-prefill-0", "vllm-prefill-1"])
            before = _legs(p0), _legs(p1)
            for i in range(4):
                assert (await c.post(f"b{i}"))[0] == 200
            assert _legs(p0) - before[0] == 2 and _legs(p1) - before[1] == 2
            for leg in d.received[-4:]:
                pick = [e for e in (p0, p1) if any(r.body["prompt"] == leg.body["prompt"]
                                                   for r in e.received)]  # fmt: skip
                assert [leg.body["kv_transfer_params"]["remote_engine_id"]] == [
                    e.name for e in pick
                ]
            m = await c.metrics()
            assert m[("vllm_ext_proxy_engines", (("role", "prefill"),))] == 2
            assert sum(v for (n, _), v in m.items() if n == "vllm_ext_proxy_pair_state") == 2

            # scale down: the first P's record goes; nothing more is sent to it
            c.dns.publish(P_SRV, {"vllm-prefill-1": c.ports["vllm-prefill-1"]})
            await c.until_engines("prefill", ["vllm-prefill-1"])
            before = _legs(p0), _legs(p1)
            for i in range(3):
                assert (await c.post(f"c{i}"))[0] == 200
            assert (_legs(p0), _legs(p1)) == (before[0], before[1] + 3)

    run(body)


@pytest.mark.timeout(60)
def test_a_failing_dns_keeps_the_engines_and_no_record_is_a_503() -> None:
    async def body() -> None:
        pods = ["vllm-prefill-0", "vllm-decode-0", "elsewhere"]
        published = {P_SRV: ["vllm-prefill-0"], D_SRV: ["vllm-decode-0"]}
        async with cluster(pods, published) as c:
            c.dns.fail = True
            asked = c.dns.questions
            for _ in range(100):  # a few look-up rounds fail
                if c.dns.questions >= asked + 4:
                    break
                await asyncio.sleep(INTERVAL / 2)
            assert (await c.post("a"))[0] == 200  # the known engines still serve
            m = await c.metrics()
            failed = sum(
                v for (n, _), v in m.items() if n == "vllm_ext_proxy_discovery_failures_total"
            )
            assert failed >= 1

            # the StatefulSet scaled to zero: no record, no P, 503 with Retry-After
            c.dns.fail = False
            c.dns.srv[P_SRV] = []
            await c.until_engines("prefill", [])
            status, out, headers = await c.post("b")
            assert status == 503 and int(headers["Retry-After"]) >= 1
            assert out["error"]["message"] == "no prefill engine is known yet"
            async with c.client.get(c.url + "/health") as resp:
                # the proxy stays ready (it answers the 503s itself); its payload says why
                assert resp.status == 200 and (await resp.json())["status"] == "unavailable"
            async with c.client.get(c.url + "/v1/models") as resp:
                assert resp.status == 200  # D alone answers it
            m = await c.metrics()
            assert m[("vllm_ext_proxy_rejected_total", (("reason", "no_engine"),))] == 1

            # the P back elsewhere (a rescheduled pod: same name, new port): served there
            c.dns.publish(P_SRV, {"vllm-prefill-0": c.ports["elsewhere"]})
            await c.until_engines("prefill", ["vllm-prefill-0"])
            assert (await c.post("c"))[0] == 200
            assert [r.body["prompt"] for r in c.engines["elsewhere"].received] == ["c"]

    run(body)


def test_the_command_line_takes_either_a_list_or_a_dns_name_per_role() -> None:
    parse = build_parser().parse_args
    base = ["--decode", "http://127.0.0.1:8200", "--p-side-channel-port", "5601"]
    config = config_from_args(parse(["--prefill-srv", P_SRV, *base]))
    assert config.discovery is not None and config.discovery.prefill_srv == P_SRV
    assert config.prefills == () and len(config.decodes) == 1
    for bad in (
        base,  # no P at all
        ["--prefill-srv", P_SRV, "--prefill", "http://127.0.0.1:8100", *base],  # both
        ["--prefill-srv", P_SRV, "--decode", "http://127.0.0.1:8200"],  # push: no side port
        ["--prefill-srv", P_SRV, "--p-engine-id", "x", *base],  # ids come from DNS
    ):
        with pytest.raises(ValueError):
            config_from_args(parse(bad))
