# SPDX-License-Identifier: Apache-2.0
"""The proxy in front of several P and D engines (xPyD), against fake engines.

Least-loaded choice per request, each D leg told which P serves it, health checks
that take an engine out and put it back, a refused engine taken out at once (its
request dispatched again elsewhere), and the CLI for several endpoints.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from proxy_fakes import WAIT, FakeEngine, p_coords, run, xpyd_harness

from vllm_ext.proxy import ProxyConfig
from vllm_ext.proxy.cli import build_parser, config_from_args
from vllm_ext.proxy.config import DecodeEndpoint, PrefillCoordinates, PrefillEndpoint


def _by_request(engines: list[FakeEngine]) -> dict[str, tuple[str, dict[str, Any]]]:
    """X-Request-Id -> (engine name, body) over what ``engines`` received."""
    return {r.headers["X-Request-Id"]: (e.name, r.body) for e in engines for r in e.received}


async def _until(predicate: Any, what: str) -> None:
    for _ in range(int(WAIT / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _in_service(health: dict[str, Any]) -> dict[str, bool]:
    return {e["name"]: e["in_service"] for e in health["engines"]}


async def _no_leg_in_flight(h: Any) -> None:
    """Every leg the proxy counted was given back, whatever its outcome."""

    async def idle() -> bool:
        return all(e["in_flight"] == 0 for e in (await h.health())["engines"])

    await _until(idle, "no leg in flight")


@pytest.mark.timeout(30)
def test_each_d_leg_carries_the_coordinates_of_the_p_that_serves_it() -> None:
    async def body() -> None:
        async with xpyd_harness(2, 2) as h:
            for i in range(6):
                status, out, _ = await h.post(
                    "/v1/completions", {"prompt": "x"}, {"X-Request-Id": f"r{i}"}
                )
                assert status == 200, out
            p_of, d_of = _by_request(h.prefills), _by_request(h.decodes)
            assert set(p_of) == set(d_of) == {f"r{i}" for i in range(6)}
            for rid, (p_name, p_body) in p_of.items():
                _, d_body = d_of[rid]
                i = int(p_name[1:])
                c = p_coords(i)
                tid = p_body["kv_transfer_params"]["transfer_id"]
                assert d_body["kv_transfer_params"] == {
                    "do_remote_prefill": True,
                    "remote_engine_id": c.engine_id,
                    "remote_host": c.host,
                    "remote_port": c.side_channel_port,
                    "tp_size": c.tp_size,
                    "pp_size": c.pp_size,
                    "transfer_id": tid,
                    "transfer_secret": p_body["kv_transfer_params"]["transfer_secret"],
                }
            # idle engines share the load in turn
            assert [len(e.received) for e in h.prefills] == [3, 3]
            assert [len(e.received) for e in h.decodes] == [3, 3]

    run(body)


@pytest.mark.timeout(30)
def test_least_loaded_p_and_d_are_picked() -> None:
    async def body() -> None:
        async with xpyd_harness(2, 2) as h:
            gate = asyncio.Event()

            async def hold_busy(engine: FakeEngine, body: dict[str, Any]) -> None:
                if body.get("prompt") == "busy":
                    await gate.wait()

            for e in h.prefills + h.decodes:
                e.on_receive = hold_busy
            busy = asyncio.create_task(h.post("/v1/completions", {"prompt": "busy"}))
            await asyncio.wait_for(h.prefills[0].got_request.wait(), WAIT)
            await asyncio.wait_for(h.decodes[0].got_request.wait(), WAIT)
            # P0 and D0 each hold one leg: every new request goes to P1 and D1.
            for _ in range(3):
                status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
                assert status == 200 and out["engine"] == "D1"
            assert len(h.prefills[0].received) == 1 and len(h.prefills[1].received) == 3
            health = await h.health()
            load = {e["name"]: e["in_flight"] for e in health["engines"]}
            assert load == {"P0": 1, "P1": 0, "decode-0": 1, "decode-1": 0}
            gate.set()
            status, _, _ = await busy
            assert status == 200
            # concurrent requests spread over both pairs
            for e in h.prefills + h.decodes:
                e.received.clear()
                e.delay = 0.2
            results = await asyncio.gather(
                *(h.post("/v1/completions", {"prompt": "y"}) for _ in range(4))
            )
            assert all(status == 200 for status, _, _ in results)
            assert [len(e.received) for e in h.prefills] == [2, 2]
            assert [len(e.received) for e in h.decodes] == [2, 2]
            await _no_leg_in_flight(h)

    run(body)


@pytest.mark.timeout(30)
def test_unhealthy_engine_is_taken_out_and_put_back() -> None:
    async def body() -> None:
        async with xpyd_harness(
            2, 2, health_interval=0.05, health_failures=2, health_successes=2
        ) as h:
            p0 = h.prefills[0]
            p0.healthy = False

            async def p0_out() -> bool:
                return not _in_service(await h.health())["P0"]

            await _until(p0_out, "P0 taken out")
            health = await h.health()
            assert health["http_status"] == 200 and health["status"] == "degraded"
            assert health["down"] == ["P0"]
            before = len(p0.received)
            for _ in range(4):
                status, _, _ = await h.post("/v1/completions", {"prompt": "x"})
                assert status == 200
            assert len(p0.received) == before and len(h.prefills[1].received) == 4
            p0.healthy = True

            async def p0_back() -> bool:
                return _in_service(await h.health())["P0"]

            await _until(p0_back, "P0 put back")
            for _ in range(4):
                status, _, _ = await h.post("/v1/completions", {"prompt": "x"})
                assert status == 200
            assert len(p0.received) == before + 2

    run(body)


@pytest.mark.timeout(30)
def test_refused_engine_is_taken_out_and_its_request_goes_elsewhere(caplog) -> None:
    async def body() -> None:
        # probes too rare to matter: only the refused leg can take P0 out
        async with xpyd_harness(2, 2, health_interval=60) as h:
            await h.stop_engine(h.prefills[0])
            for i in range(4):
                status, out, _ = await h.post(
                    "/v1/completions", {"prompt": "x"}, {"X-Request-Id": f"after-kill-{i}"}
                )
                assert status == 200, out
            assert len(h.prefills[1].received) == 4
            p_of, d_of = _by_request(h.prefills), _by_request(h.decodes)
            for rid in p_of:
                assert d_of[rid][1]["kv_transfer_params"]["remote_engine_id"] == "P1"
            engines = {e["name"]: e for e in (await h.health())["engines"]}
            assert not engines["P0"]["in_service"]
            assert engines["P0"]["state"].startswith("down: ClientConnectorError")
            await _no_leg_in_flight(h)

    with caplog.at_level(logging.INFO, logger="vllm.ext.proxy"):
        run(body)
    lines = [r.getMessage() for r in caplog.records]
    assert any("prefill engine P0" in ln and "taken out of service" in ln for ln in lines)
    first = [ln for ln in lines if "request_id=after-kill-0 " in ln]
    assert first and "redispatched_after=" in first[0] and "p=P1" in first[0]


@pytest.mark.timeout(30)
def test_every_p_gone_is_a_503_naming_the_engine() -> None:
    async def body() -> None:
        async with xpyd_harness(2, 1, health_interval=60) as h:
            for p in h.prefills:
                await h.stop_engine(p)
            status, out, headers = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 503 and headers["Retry-After"] == "60"
            msg = out["error"]["message"]
            assert msg.startswith("prefill leg failed on P"), msg
            assert "ClientConnectorError" in msg
            health = await h.health()
            assert health["http_status"] == 200 and health["status"] == "unavailable"
            assert sorted(health["down"]) == ["P0", "P1"]
            # every P out of service: the next request gets 503 at once, nothing sent
            sent = len(h.decodes[0].received)
            status, out, headers = await h.post("/v1/completions", {"prompt": "y"})
            assert status == 503 and headers["Retry-After"] == "60"
            assert out["error"]["type"] == "service_unavailable"
            assert out["error"]["message"].startswith("no prefill engine is in service")
            assert len(h.decodes[0].received) == sent
            await _no_leg_in_flight(h)

    run(body)


@pytest.mark.timeout(30)
def test_engine_error_names_the_engine() -> None:
    async def body() -> None:
        async with xpyd_harness(2, 2) as h:
            h.prefills[0].status = 500
            h.decodes[0].hang = True
            status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 502
            # named, but not by its address (test_proxy_operator.py checks that)
            assert out["error"]["message"] == "prefill leg failed on P0: HTTP 500: P0 exploded"
            # an engine that answers is not taken out by one error
            assert _in_service(await h.health())["P0"]
            await _no_leg_in_flight(h)  # D's hanging leg was cancelled and given back

    run(body)


@pytest.mark.timeout(30)
def test_pull_xpyd_d_gets_the_kv_params_of_its_p() -> None:
    async def body() -> None:
        async with xpyd_harness(2, 2, mode="pull") as h:
            for i, p in enumerate(h.prefills):
                p.kv_params_out = {"do_remote_prefill": True, "remote_engine_id": f"P{i}"}
            for i in range(4):
                status, _, _ = await h.post(
                    "/v1/completions", {"prompt": "x"}, {"X-Request-Id": f"q{i}"}
                )
                assert status == 200
            p_of, d_of = _by_request(h.prefills), _by_request(h.decodes)
            for rid, (p_name, _) in p_of.items():
                assert d_of[rid][1]["kv_transfer_params"]["remote_engine_id"] == p_name
            assert [len(e.received) for e in h.prefills] == [2, 2]

    run(body)


# ---------------------------------------------------------------- config and CLI


def test_cli_several_endpoints() -> None:
    args = build_parser().parse_args(
        ["--prefill", "http://127.0.0.1:8100,engine_id=P0,side_channel_port=5601"]
        + ["--prefill", "http://127.0.0.1:8101/,engine_id=P1,side_channel_port=5602,tp_size=2"]
        + ["--prefill", "http://127.0.0.1:8102,engine_id=P2,side_channel_port=5602,host=h2"]
        + ["--decode", "http://127.0.0.1:8200", "--decode", "http://127.0.0.1:8201,name=DX"]
        + ["--p-pp-size", "2", "--health-interval", "0.5", "--health-failures", "3"]
    )
    cfg = config_from_args(args)
    assert [ep.url for ep in cfg.prefills] == [f"http://127.0.0.1:810{i}" for i in range(3)]
    assert [ep.coords for ep in cfg.prefills] == [
        PrefillCoordinates("P0", "127.0.0.1", 5601, 1, 2),
        PrefillCoordinates("P1", "127.0.0.1", 5602, 2, 2),
        PrefillCoordinates("P2", "h2", 5602, 1, 2),
    ]
    assert [ep.name for ep in cfg.prefills] == ["P0", "P1", "P2"]
    assert [ep.name for ep in cfg.decodes] == ["decode-0", "DX"]
    assert cfg.prefill_url == "http://127.0.0.1:8100" and cfg.prefill == cfg.prefills[0].coords
    assert cfg.health_interval == 0.5 and cfg.health_failures == 3


def test_cli_one_pair_keeps_the_old_options() -> None:
    cfg = config_from_args(
        build_parser().parse_args(
            ["--prefill", "http://a:1", "--decode", "http://b:2"]
            + ["--p-engine-id", "P0", "--p-side-channel-port", "5601"]
        )
    )
    assert cfg.prefills == (
        PrefillEndpoint("http://a:1", PrefillCoordinates("P0", "127.0.0.1", 5601), "prefill"),
    )
    assert cfg.decodes == (DecodeEndpoint("http://b:2", "decode"),)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ["--prefill", "http://a:1", "--prefill", "http://a:2", "--p-engine-id", "P0"],
            "give each its engine_id=",
        ),
        (["--prefill", "http://a:1,engine_id=P0", "--prefill", "http://a:2"], "engine_id="),
        (["--prefill", "http://a:1,colour=red"], "bad option 'colour=red'"),
        (["--prefill", "http://a:1,side_channel_port=x"], "side_channel_port must be int"),
        (
            [
                "--prefill", "http://a:1,engine_id=P0,side_channel_port=1",
                "--prefill", "http://a:2,engine_id=P0,side_channel_port=2",
            ],
            "its own engine id",
        ),
        (
            [
                "--prefill", "http://a:1,engine_id=P0,side_channel_port=1",
                "--prefill", "http://a:2,engine_id=P1,side_channel_port=1",
            ],
            "its own side channel",
        ),
        (
            [
                "--prefill", "http://a:1,engine_id=P0,side_channel_port=1",
                "--prefill", "http://a:1,engine_id=P1,side_channel_port=2",
            ],
            "listed twice",
        ),
    ],
)  # fmt: skip
def test_cli_rejects_bad_endpoints(argv: list[str], words: str) -> None:
    args = build_parser().parse_args([*argv, "--decode", "http://d:1"])
    with pytest.raises(ValueError, match=words):
        config_from_args(args)


def test_config_rejects_push_p_without_coordinates() -> None:
    with pytest.raises(ValueError, match="missing for http://a:2"):
        ProxyConfig(
            prefills=(
                PrefillEndpoint("http://a:1", PrefillCoordinates("P0")),
                PrefillEndpoint("http://a:2"),
            ),
            decodes=(DecodeEndpoint("http://d:1"),),
        )


@pytest.mark.timeout(30)
def test_push_legs_sequential_sends_d_after_p_answered() -> None:
    async def body() -> None:
        async with xpyd_harness(1, 1, push_legs="sequential") as h:
            h.prefills[0].delay = 0.2
            status, _, _ = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 200
            (d,) = h.decodes[0].received
            assert h.prefills[0].responded_at is not None
            assert d.at >= h.prefills[0].responded_at
            assert d.body["kv_transfer_params"]["remote_engine_id"] == "P0"
            h.prefills[0].status = 500
            status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 502 and len(h.decodes[0].received) == 1  # D never asked
            load = {e["name"]: e["in_flight"] for e in (await h.health())["engines"]}
            assert load == {"prefill": 0, "decode": 0}

    run(body)
