# SPDX-License-Identifier: Apache-2.0
"""``--routing``: engine-load (the engines' own /metrics) and prefix-affinity, with fakes.

The fake engines serve ``/metrics`` with numbers the test sets, as vLLM writes them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from proxy_fakes import WAIT, FakeEngine, p_coords, run, xpyd_harness

from vllm_ext.proxy import ProxyConfig
from vllm_ext.proxy.cli import build_parser, config_from_args
from vllm_ext.proxy.config import DecodeEndpoint, PrefillEndpoint
from vllm_ext.proxy.pool import Pool
from vllm_ext.proxy.routing import (
    KV_USAGE,
    RUNNING,
    WAITING,
    parse_engine_load,
    prefix_key,
    rendezvous_order,
)

FAST = {"metrics_interval": 0.05, "metrics_timeout": 0.5}
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0
"""


def _load(waiting: float, running: float, kv: float = 0.0) -> dict[str, float]:
    return {WAITING: waiting, RUNNING: running, KV_USAGE: kv}


def _prompt(group: int, i: int) -> str:
    """A prompt of prefix ``group`` (200 shared characters) with its own tail."""
    return f"system prompt {group:03d} " * 10 + f"question {i}"


async def _until_scraped(h: Any, names: set[str]) -> None:
    """Until ``/health`` shows a scraped ``engine_load`` for each engine in ``names``."""
    for _ in range(int(WAIT / 0.02)):
        engines = (await h.health())["engines"]
        if names <= {e["name"] for e in engines if "engine_load" in e}:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no scrape of {names}")


async def _served_by(h: Any, engines: list[FakeEngine], prompt: str) -> str:
    before = {e.name: len(e.received) for e in engines}
    status, out, _ = await h.post("/v1/completions", {"prompt": prompt})
    assert status == 200, out
    (name,) = [e.name for e in engines if len(e.received) > before[e.name]]
    return name


def test_metrics_parse_into_the_load_gauges_summed_over_labels() -> None:
    load = parse_engine_load(VLLM_METRICS, at=1.0, picked=2)
    assert load is not None
    assert (load.waiting, load.running, load.kv_usage) == (5.0, 3.0, 0.25)
    assert parse_engine_load("# nothing here\nother_metric 1\n", at=1.0, picked=0) is None


def test_prefix_key_hashes_whole_leading_chunks() -> None:
    a, b = {"prompt": _prompt(1, 1)}, {"prompt": _prompt(1, 2)}
    assert prefix_key(a, 128, 64) == prefix_key(b, 128, 64) is not None
    assert prefix_key({"prompt": _prompt(2, 1)}, 128, 64) != prefix_key(a, 128, 64)
    assert prefix_key({"prompt": "short"}, 128, 64) is None  # under one chunk
    chat = {
        "messages": [{"role": "system", "content": "x" * 100}, {"role": "user", "content": "q"}]
    }
    assert prefix_key(chat, 64, 64) is not None
    assert prefix_key({"prompt": list(range(100))}, 128, 64) is not None  # token ids


@pytest.mark.timeout(30)
def test_engine_load_picks_the_engine_the_metrics_say_is_least_busy() -> None:
    """Other clients loaded P0 and D1: the proxy sent them nothing, yet avoids them."""

    async def body() -> None:
        async with xpyd_harness(2, 2, routing="engine-load", **FAST) as h:
            h.prefills[0].metrics, h.prefills[1].metrics = _load(5, 3, 0.9), _load(0, 1)
            h.decodes[0].metrics, h.decodes[1].metrics = _load(0, 2), _load(4, 10)
            await _until_scraped(h, {"P0", "P1", "decode-0", "decode-1"})
            for i in range(4):
                status, out, _ = await h.post("/v1/completions", {"prompt": f"x{i}"})
                assert status == 200, out
            assert [len(e.received) for e in h.prefills] == [0, 4]
            assert [len(e.received) for e in h.decodes] == [4, 0]
            # the engines' numbers change: the choice follows
            h.prefills[1].metrics = _load(20, 8)
            h.prefills[0].metrics = _load(0, 0)

            async def p0_chosen() -> bool:
                return await _served_by(h, h.prefills, "y") == "P0"

            for _ in range(int(WAIT / 0.05)):
                if await p0_chosen():
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the choice never followed the new metrics")

    run(body)


@pytest.mark.timeout(30)
def test_an_engine_whose_scrape_fails_counts_with_the_proxys_in_flight() -> None:
    """P0 has no /metrics (404): it counts with 0 legs in flight, below P1's 50 requests."""

    async def body() -> None:
        async with xpyd_harness(2, 1, routing="engine-load", **FAST) as h:
            h.prefills[1].metrics, h.decodes[0].metrics = _load(50, 0), _load(0, 0)
            await _until_scraped(h, {"P1"})
            for i in range(3):
                assert await _served_by(h, h.prefills, f"x{i}") == "P0"
            assert h.prefills[0].metrics_scraped > 0
            p0 = next(e for e in (await h.health())["engines"] if e["name"] == "P0")
            assert "engine_load" not in p0

    run(body)


@pytest.mark.timeout(30)
def test_prefix_affinity_keeps_each_prefix_on_one_p_while_load_is_balanced() -> None:
    async def body() -> None:
        async with xpyd_harness(3, 1, routing="prefix-affinity", **FAST) as h:
            for e in h.prefills + h.decodes:
                e.metrics = _load(0, 0)
            await _until_scraped(h, {"P0", "P1", "P2"})
            p_of: dict[int, set[str]] = {}
            for i in range(24):
                group = i % 8
                p_of.setdefault(group, set()).add(
                    await _served_by(h, h.prefills, _prompt(group, i))
                )
            assert all(len(ps) == 1 for ps in p_of.values()), p_of
            assert len(set().union(*p_of.values())) > 1  # prefixes spread over the P engines

    run(body)


@pytest.mark.timeout(30)
def test_prefix_affinity_spills_over_when_its_p_is_overloaded() -> None:
    async def body() -> None:
        async with xpyd_harness(2, 1, routing="prefix-affinity", **FAST) as h:
            for e in h.prefills + h.decodes:
                e.metrics = _load(0, 0)
            await _until_scraped(h, {"P0", "P1"})
            home = await _served_by(h, h.prefills, _prompt(7, 0))
            other = next(e for e in h.prefills if e.name != home)
            assert await _served_by(h, h.prefills, _prompt(7, 1)) == home
            next(e for e in h.prefills if e.name == home).metrics = _load(10, 8)  # > 4 more
            await asyncio.sleep(0.3)  # a few scrapes
            assert await _served_by(h, h.prefills, _prompt(7, 2)) == other.name
            next(e for e in h.prefills if e.name == home).metrics = _load(1, 2)  # within 4
            await asyncio.sleep(0.3)
            assert await _served_by(h, h.prefills, _prompt(7, 3)) == home

    run(body)


def test_prefix_affinity_respects_pair_back_off() -> None:
    config = ProxyConfig(
        mode="push",
        prefills=tuple(
            PrefillEndpoint(f"http://127.0.0.1:{9100 + i}", p_coords(i)) for i in range(2)
        ),
        decodes=(DecodeEndpoint("http://127.0.0.1:9200"),),
        routing="prefix-affinity",
        pair_failures=1,
    )
    pool = Pool(config)
    key = prefix_key({"prompt": _prompt(3, 0)}, config.prefix_chars, config.prefix_chunk_chars)
    assert key is not None
    home = rendezvous_order(key, pool.backends["prefill"])[0]
    p, d, lease = pool.pick_pair(key)
    assert p is home
    lease.end("failure", "HTTP 500")  # one failure backs the pair off
    p.release(), d.release()
    p2, _, _ = pool.pick_pair(key)
    assert p2 is not home


def test_cli_routing_flags() -> None:
    args = build_parser().parse_args(
        ["--mode", "pull", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
        + ["--routing", "prefix-affinity", "--metrics-interval-ms", "200"]
        + ["--prefix-chars", "256", "--prefix-max-imbalance", "2"]
    )
    config = config_from_args(args)
    assert config.routing == "prefix-affinity"
    assert config.metrics_interval == pytest.approx(0.2)
    assert (config.prefix_chars, config.prefix_max_imbalance) == (256, 2)
    default = config_from_args(
        build_parser().parse_args(
            ["--mode", "pull", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
        )
    )
    assert default.routing == "least-in-flight" and default.metrics_interval == 0.5
    with pytest.raises(ValueError, match="routing"):
        ProxyConfig(prefill_url="http://a:1", decode_url="http://b:2", mode="pull", routing="x")  # type: ignore[arg-type]
