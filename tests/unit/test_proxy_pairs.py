# SPDX-License-Identifier: Apache-2.0
"""Pair health and admission control of the proxy, against fake engines.

A P-D pair whose KV cannot cross (both engines healthy one by one) is backed off
after transfer failures in a row and routed around (xPyD); a lone pair backed off
still serves (1P1D); after its back-off one request probes it. Past
``max_in_flight`` requests the proxy answers 429 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import pytest
from aiohttp import web
from proxy_fakes import WAIT, FakeEngine, harness, run, xpyd_harness

from vllm_ext.proxy import ProxyConfig
from vllm_ext.proxy.cli import build_parser, config_from_args


class Partition:
    """A D engine hook: the D leg fails while KV from P ``engine_id`` cannot arrive."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.on = True

    async def __call__(self, engine: FakeEngine, body: dict[str, Any]) -> None:
        if self.on and body["kv_transfer_params"]["remote_engine_id"] == self.engine_id:
            err = {"error": {"message": f"KV transfer from {self.engine_id} failed"}}
            raise web.HTTPInternalServerError(text=json.dumps(err), content_type="application/json")


def _from_p(engine: FakeEngine, engine_id: str) -> int:
    """How many D legs ``engine`` got for requests served by P ``engine_id``."""
    return sum(
        r.body["kv_transfer_params"]["remote_engine_id"] == engine_id for r in engine.received
    )


async def _pairs(h: Any) -> dict[str, dict[str, Any]]:
    async with h.client.get(h.url + "/health") as resp:
        out = await resp.json()
    return {f"{p['prefill']}->{p['decode']}": p for p in out["pairs"]}


async def _health(h: Any) -> dict[str, Any]:
    async with h.client.get(h.url + "/health") as resp:
        out: dict[str, Any] = await resp.json()
        out["http_status"] = resp.status
        return out


def _messages(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if words in r.getMessage()]


# ---------------------------------------------------------------- xPyD


@pytest.mark.timeout(30)
def test_failing_pair_is_routed_around_probed_and_comes_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backoff = 1.5

    async def body() -> None:
        async with xpyd_harness(
            2, 2, health_interval=60, pair_failures=2, pair_backoff=backoff, pair_backoff_max=60
        ) as h:
            partition = Partition("P0")
            d0 = h.decodes[0]
            d0.on_receive = partition
            # Requests alternate over the pairs until P0->decode-0 failed twice in a row.
            failed = 0
            for _ in range(10):
                status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
                if status != 200:
                    assert status == 502, out
                    assert "KV transfer from P0 failed" in out["error"]["message"]
                    failed += 1
                if failed == 2:
                    break
            assert failed == 2
            pairs = await _pairs(h)
            assert pairs["P0->decode-0"]["state"] == "backed-off"
            assert 0 < pairs["P0->decode-0"]["retry_in_s"] <= backoff
            assert all(pairs[n]["state"] == "healthy" for n in pairs if n != "P0->decode-0")
            health = await _health(h)
            assert health["http_status"] == 200 and health["status"] == "degraded"

            # Backed off: every request succeeds; P0 and decode-0 still serve, with others.
            before = {e.name: len(e.received) for e in h.prefills + h.decodes}
            for _ in range(8):
                status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
                assert status == 200, out
            assert _from_p(d0, "P0") == 2  # no new D leg of the partitioned pair
            assert len(h.prefills[0].received) > before["P0"]  # P0 serves with decode-1
            assert len(d0.received) > before["D0"]  # decode-0 serves P1
            pairs = await _pairs(h)
            assert pairs["P0->decode-0"]["state"] == "backed-off"
            assert pairs["P0->decode-0"]["times_backed_off"] == 1  # no probe meanwhile

            # The back-off elapses, the partition is still on: the next request probes
            # the pair, fails there and is served by another pair; the back-off doubles.
            await asyncio.sleep(backoff + 0.1)
            status, out, _ = await h.post(
                "/v1/completions", {"prompt": "x"}, {"X-Request-Id": "probe-1"}
            )
            assert status == 200, out
            assert _from_p(d0, "P0") == 3
            pair = (await _pairs(h))["P0->decode-0"]
            assert pair["state"] == "backed-off" and pair["backoff_s"] == 2 * backoff
            assert pair["times_backed_off"] == 2 and not pair["probe_in_flight"]

            # Healed: after the doubled back-off the probe succeeds and the pair is back.
            partition.on = False
            await asyncio.sleep(2 * backoff + 0.1)
            status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 200 and out["engine"] == "D0", out
            assert _from_p(d0, "P0") == 4
            pair = (await _pairs(h))["P0->decode-0"]
            assert pair["state"] == "healthy" and pair["failures_in_a_row"] == 0
            assert pair["backoff_s"] == backoff

    with caplog.at_level(logging.INFO, logger="vllm.ext.proxy"):
        run(body)
    backed_off = _messages(caplog, "pair P0->decode-0 backed off")
    assert len(backed_off) == 2
    assert "after 2 transfer failures in a row" in backed_off[0]
    assert "its probe failed" in backed_off[1]
    assert len(_messages(caplog, "pair P0->decode-0: back-off of")) == 2  # -> probing
    assert len(_messages(caplog, "pair P0->decode-0: probe succeeded")) == 1
    assert not _messages(caplog, "pair P1->")  # nothing logged about healthy pairs
    probe_line = _messages(caplog, "request_id=probe-1 ")
    assert probe_line and "probed_pair=P0->decode-0" in probe_line[0]
    assert 'redispatched_after="probe of pair P0->decode-0' in probe_line[0]


# ---------------------------------------------------------------- 1P1D


@pytest.mark.timeout(30)
def test_lone_pair_backed_off_still_serves_and_a_success_puts_it_back() -> None:
    """A back-off steers requests to other pairs; with none, the backed-off pair is the
    last resort: the request goes to it (never a 503) and its success puts it back."""

    async def body() -> None:
        async with harness(pair_failures=2, pair_backoff=60, health_interval=60) as h:
            h.prefill.status = 500  # P reports the failed transfer
            for _ in range(2):
                status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
                assert status == 502, out
            assert (await _pairs(h))["prefill->decode"]["state"] == "backed-off"
            # still backed off: the request goes to the pair anyway and gets its answer
            status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 502 and "prefill exploded" in out["error"]["message"]
            pair = (await _pairs(h))["prefill->decode"]
            assert pair["state"] == "backed-off" and pair["backoff_s"] == 60
            h.prefill.status = 200
            status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 200, out
            pair = (await _pairs(h))["prefill->decode"]
            assert pair["state"] == "healthy" and pair["transfer_failures"] == 3

    run(body)


@pytest.mark.timeout(30)
def test_client_errors_and_aborts_do_not_count_against_the_pair() -> None:
    async def body() -> None:
        async with harness(pair_failures=1, health_interval=60) as h:
            h.decode.status = 400  # the engine rejects the client's request
            for _ in range(3):
                status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
                assert status == 400, out
            h.decode.status = 200
            h.prefill.hang = h.decode.hang = True  # a client that gives up
            task = asyncio.create_task(h.post("/v1/completions", {"prompt": "x"}))
            await asyncio.wait_for(h.decode.got_request.wait(), WAIT)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await asyncio.wait_for(h.decode.cancelled.wait(), WAIT)
            h.prefill.hang = h.decode.hang = False
            status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 200, out
            pair = (await _pairs(h))["prefill->decode"]
            assert pair["state"] == "healthy" and pair["transfer_failures"] == 0
            # ... while one engine error does (pair_failures=1)
            h.decode.status = 500
            status, _, _ = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 502
            assert (await _pairs(h))["prefill->decode"]["state"] == "backed-off"

    run(body)


@pytest.mark.timeout(30)
def test_a_success_resets_the_failure_count() -> None:
    async def body() -> None:
        async with harness(pair_failures=2, health_interval=60) as h:
            for status_of_d in (500, 200, 500, 200, 500):
                h.decode.status = status_of_d
                status, _, _ = await h.post("/v1/completions", {"prompt": "x"})
                assert status == (200 if status_of_d == 200 else 502)
            pair = (await _pairs(h))["prefill->decode"]
            assert pair["state"] == "healthy" and pair["failures_in_a_row"] == 1
            assert pair["transfer_failures"] == 3 and pair["successes"] == 2

    run(body)


# ---------------------------------------------------------------- admission


@pytest.mark.timeout(30)
def test_admission_refuses_past_max_in_flight_and_admits_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body() -> None:
        async with harness(max_in_flight=2) as h:
            gate = asyncio.Event()

            async def hold(engine: FakeEngine, _: dict[str, Any]) -> None:
                await gate.wait()

            h.decode.on_receive = hold
            held = [
                asyncio.create_task(h.post("/v1/completions", {"prompt": f"held-{i}"}))
                for i in range(2)
            ]
            for _ in range(int(WAIT / 0.02)):
                if len(h.decode.received) == 2:
                    break
                await asyncio.sleep(0.02)
            assert len(h.decode.received) == 2
            for _ in range(3):
                status, out, headers = await h.post(
                    "/v1/completions", {"prompt": "over"}, {"X-Request-Id": "over"}
                )
                assert status == 429, out
                assert headers["Retry-After"] == "1" and headers["X-Request-Id"] == "over"
                err = out["error"]
                assert err["type"] == "rate_limit_exceeded" and err["code"] == 429
                assert "2 requests in flight (max_in_flight 2)" in err["message"]
            assert len(h.prefill.received) == 2  # refused requests reached no engine
            admission = (await _health(h))["admission"]
            assert admission == {"in_flight": 2, "max_in_flight": 2, "rejected": 3}
            gate.set()
            for task in held:
                status, _, _ = await task
                assert status == 200
            for _ in range(int(WAIT / 0.02)):
                if (await _health(h))["admission"]["in_flight"] == 0:
                    break
                await asyncio.sleep(0.02)
            h.decode.on_receive = None
            results = await asyncio.gather(
                *(h.post("/v1/completions", {"prompt": "again"}) for _ in range(2))
            )
            assert [status for status, _, _ in results] == [200, 200]
            admission = (await _health(h))["admission"]
            assert admission == {"in_flight": 0, "max_in_flight": 2, "rejected": 3}

    with caplog.at_level(logging.INFO, logger="vllm.ext.proxy"):
        run(body)
    assert len(_messages(caplog, "new requests get 429")) == 1  # once per episode
    (back,) = _messages(caplog, "admitting again")
    assert "3 refused meanwhile" in back


@pytest.mark.timeout(30)
def test_admission_default_admits_a_burst() -> None:
    async def body() -> None:
        async with harness() as h:
            assert h.config.max_in_flight == 512
            h.decode.delay = 0.2
            t0 = time.monotonic()
            results = await asyncio.gather(
                *(h.post("/v1/completions", {"prompt": "x"}) for _ in range(40))
            )
            assert [status for status, _, _ in results] == [200] * 40
            assert time.monotonic() - t0 < WAIT
            assert (await _health(h))["admission"]["rejected"] == 0

    run(body)


# ---------------------------------------------------------------- config and CLI


def test_cli_pair_and_admission_flags() -> None:
    base = ["--prefill", "http://a:1", "--decode", "http://b:2", "--mode", "pull"]
    cfg = config_from_args(build_parser().parse_args(base))
    assert (cfg.max_in_flight, cfg.pair_failures) == (512, 3)
    assert (cfg.pair_backoff, cfg.pair_backoff_max) == (10.0, 160.0)
    cfg = config_from_args(
        build_parser().parse_args(
            base
            + ["--max-in-flight", "0", "--pair-failures", "5"]
            + ["--pair-backoff", "2.5", "--pair-backoff-max", "40"]
        )
    )
    assert (cfg.max_in_flight, cfg.pair_failures) == (0, 5)
    assert (cfg.pair_backoff, cfg.pair_backoff_max) == (2.5, 40.0)


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"max_in_flight": -1}, "max_in_flight"),
        ({"pair_failures": 0}, "pair_failures"),
        ({"pair_backoff": 0}, "pair_backoff"),
        ({"pair_backoff": 10, "pair_backoff_max": 5}, "pair_backoff_max"),
    ],
)
def test_config_rejects_bad_pair_and_admission_values(kw: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ProxyConfig(prefill_url="http://a:1", decode_url="http://b:2", mode="pull", **kw)
