# SPDX-License-Identifier: Apache-2.0
"""What an operator meets at the proxy: OpenAI error JSON for every error status, 503 with
``Retry-After`` when engines cannot be reached, no internal address in a client's error,
trace context forwarded to both legs, ``/metrics`` in Prometheus format, defaults in
``--help``. Real HTTP on loopback against fake engines (tests/unit/proxy_fakes.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import pytest
from proxy_fakes import (
    REPO,
    free_port,
    harness,
    prometheus_samples,
    proxy_help,
    run,
    sse_events,
    xpyd_harness,
)

from vllm_ext.proxy.cli import build_parser

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
ADDRESS = re.compile(r"https?://|127\.0\.0\.1|\d+\.\d+\.\d+\.\d+|localhost|:\d{2,5}\b")


def _value(samples: dict, name: str, **labels: str) -> float:
    """Sum of ``name`` over label sets containing ``labels``."""
    return sum(
        v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/nope", 404), ("GET", "/v1/completions", 405), ("POST", "/health", 405)],
)
def test_unrouted_and_wrong_method_answer_openai_error_json(
    method: str, path: str, status: int
) -> None:
    async def body() -> None:
        async with harness() as h:
            async with h.client.request(method, h.url + path) as resp:
                assert resp.status == status
                assert resp.content_type == "application/json"
                err = (await resp.json())["error"]
            assert err["code"] == status and err["type"] == "invalid_request_error"
            assert path in err["message"]
            if status == 405:
                assert resp.headers["Allow"]

    run(body)


@pytest.mark.timeout(30)
def test_unreachable_engine_is_503_with_retry_after_and_no_address() -> None:
    async def body() -> None:
        async with harness(prefill_url=f"http://127.0.0.1:{free_port()}") as h:
            status, out, headers = await h.post("/v1/completions", {"prompt": "a"})
            assert status == 503, out
            assert int(headers["Retry-After"]) >= 1
            err = out["error"]
            assert err["type"] == "upstream_unavailable" and err["code"] == 503
            assert "ClientConnectorError" in err["message"]
            assert not ADDRESS.search(err["message"]), err["message"]

    run(body)


@pytest.mark.timeout(30)
def test_engine_errors_name_the_engine_but_not_its_address() -> None:
    async def body() -> None:
        async with xpyd_harness(2, 1) as h:
            for p in h.prefills:
                p.status = 500
            status, out, _ = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 502
            msg = out["error"]["message"]
            assert re.fullmatch(r"prefill leg failed on P\d: HTTP 500: P\d exploded", msg), msg
            assert not ADDRESS.search(msg)

    run(body)


@pytest.mark.timeout(30)
def test_trace_context_reaches_both_legs() -> None:
    async def body() -> None:
        async with harness() as h:
            headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}
            status, _, _ = await h.post("/v1/completions", {"prompt": "a"}, headers)
            assert status == 200
            for engine in (h.prefill, h.decode):
                (got,) = engine.received
                assert got.headers["traceparent"] == TRACEPARENT
                assert got.headers["tracestate"] == "vendor=abc"
            # without one, none is made up
            h.prefill.received.clear()
            await h.post("/v1/completions", {"prompt": "a"})
            assert "traceparent" not in h.prefill.received[0].headers

    run(body)


@pytest.mark.timeout(30)
def test_metrics_count_requests_legs_latency_pairs_and_rejections() -> None:
    async def body() -> None:
        async with harness(max_in_flight=1) as h:

            async def scrape() -> dict:
                async with h.client.get(h.url + "/metrics") as resp:
                    assert resp.status == 200
                    assert resp.content_type == "text/plain"
                    return prometheus_samples(await resp.text())

            before = await scrape()
            assert _value(before, "vllm_ext_proxy_requests_total") == 0
            assert _value(before, "vllm_ext_proxy_pair_state", state="healthy") == 1
            assert _value(before, "vllm_ext_proxy_engine_up", role="prefill") == 1

            for _ in range(3):
                assert (await h.post("/v1/completions", {"prompt": "a"}))[0] == 200
            h.decode.hang = True  # hold the one admitted request: the next gets 429
            held = asyncio.create_task(h.post("/v1/completions", {"prompt": "b"}))
            for _ in range(500):  # until D holds it
                if h.decode.received[-1].body["prompt"] == "b":
                    break
                await asyncio.sleep(0.01)
            status, _, _ = await h.post("/v1/completions", {"prompt": "c"})
            assert status == 429
            got = await scrape()
            held.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await held

            path = "/v1/completions"
            assert _value(got, "vllm_ext_proxy_requests_total", path=path, code="200") == 3
            assert _value(got, "vllm_ext_proxy_requests_total", path=path, code="429") == 1
            assert _value(got, "vllm_ext_proxy_rejected_total", reason="over_capacity") == 1
            # the refused request is timed too (it ended at once)
            assert _value(got, "vllm_ext_proxy_request_duration_seconds_count", path=path) == 4
            assert _value(got, "vllm_ext_proxy_request_duration_seconds_sum", path=path) > 0
            for leg in ("prefill", "decode"):
                assert _value(got, "vllm_ext_proxy_legs_total", leg=leg, outcome="200") == 3
                assert _value(got, "vllm_ext_proxy_leg_duration_seconds_count", leg=leg) == 3
            assert _value(got, "vllm_ext_proxy_in_flight") == 1
            assert _value(got, "vllm_ext_proxy_pair_transfer_failures_total") == 0

    run(body)


@pytest.mark.timeout(30)
def test_metrics_show_a_pair_backed_off_and_the_503s_of_an_engine_out() -> None:
    async def body() -> None:
        async with harness(
            pair_failures=1, pair_backoff=60, pair_backoff_max=60, health_interval=60
        ) as h:
            h.decode.status = 500
            assert (await h.post("/v1/completions", {"prompt": "a"}))[0] == 502
            # the lone pair is backed off, yet still takes requests (its last resort)
            assert (await h.post("/v1/completions", {"prompt": "a"}))[0] == 502
            h.decode.status = 200
            h.decode.healthy = False
            async with h.client.get(h.url + "/health"):
                pass  # two failed probes take D out of service (health_failures=2)
            async with h.client.get(h.url + "/health"):
                pass
            status, _, headers = await h.post("/v1/completions", {"prompt": "a"})
            assert status == 503 and int(headers["Retry-After"]) >= 1
            got = await _settled(h)
            assert _value(got, "vllm_ext_proxy_pair_state", state="backed-off") == 1
            assert _value(got, "vllm_ext_proxy_pair_state", state="healthy") == 0
            assert _value(got, "vllm_ext_proxy_pair_transfer_failures_total") == 2
            assert _value(got, "vllm_ext_proxy_pair_backoffs_total") == 1
            assert _value(got, "vllm_ext_proxy_engine_up", role="decode") == 0
            assert _value(got, "vllm_ext_proxy_rejected_total", reason="no_engine") == 1
            assert _value(got, "vllm_ext_proxy_requests_total", code="503") == 1
            assert _value(got, "vllm_ext_proxy_legs_total", leg="decode", outcome="500") == 2

    run(body)


@pytest.mark.timeout(30)
def test_a_stream_the_client_closes_after_done_counts_as_answered() -> None:
    """A streaming client may close as soon as it read ``[DONE]``, before the end of the
    chunked body: it got the whole answer, which is a 200, not a client gone (499)."""

    async def body() -> None:
        async with harness() as h:
            h.decode.end_delay = 0.3  # D ends its body after the client left
            data = json.dumps({"prompt": "a", "stream": True})
            async with h.client.post(h.url + "/v1/completions", data=data) as resp:
                assert resp.status == 200
                async for event in sse_events(resp):
                    if event == "[DONE]":
                        break
                resp.close()  # closes the connection too
            got = await _settled(h)
            path = "/v1/completions"
            assert _value(got, "vllm_ext_proxy_requests_total", path=path, code="200") == 1
            assert _value(got, "vllm_ext_proxy_requests_total", code="499") == 0
            # and so did its decode leg (a clean-clone CI run saw it counted cancelled)
            legs = "vllm_ext_proxy_legs_total"
            assert _value(got, legs, leg="decode", outcome="200") == 1
            assert _value(got, legs, leg="decode", outcome="cancelled") == 0

    run(body)


async def _settled(h) -> dict:
    """The proxy's samples once no request is in flight: a request is counted when its
    handler ends, just after the client got the last byte of its answer."""
    for _ in range(200):
        async with h.client.get(h.url + "/metrics") as resp:
            got = prometheus_samples(await resp.text())
        if _value(got, "vllm_ext_proxy_in_flight") == 0:
            return got
        await asyncio.sleep(0.01)
    raise AssertionError("a request stayed in flight")


def test_help_shows_every_default() -> None:
    text = proxy_help()
    flat = " ".join(text.split("options:", 1)[1].split())  # past the usage line
    for action in build_parser()._actions:
        if action.default in (None, False) or action.dest == "help":
            continue
        flag = action.option_strings[-1]
        shown = re.search(rf"{re.escape(flag)}\b(?:(?! --[a-z]).)*?\(default: [^)]*\)", flat)
        assert shown, f"{flag}: no default in --help"


def test_every_flag_is_in_the_docs_table_with_its_default() -> None:
    rows = {}
    for line in (REPO / "docs" / "proxy.md").read_text().splitlines():
        m = re.fullmatch(r"\| `(--[a-z-]+)` \| ([^|]+) \| .+ \|", line)
        if m:
            rows[m.group(1)] = m.group(2).strip()
    flags = {a.option_strings[-1]: a.default for a in build_parser()._actions if a.dest != "help"}
    assert set(rows) == set(flags)
    for flag, default in flags.items():
        assert rows[flag] == ("—" if default is None else f"`{default}`"), flag
