# SPDX-License-Identifier: Apache-2.0
"""The proxy's time-to-first-token histogram (``vllm_ext_proxy_ttft_seconds``, docs/proxy.md):
observed when the first bytes of D's stream reach the client, not when the request ends;
only for streamed requests that got some."""

from __future__ import annotations

import asyncio

import pytest
from proxy_fakes import WAIT, harness, prometheus_samples, run, sse_events

TTFT = "vllm_ext_proxy_ttft_seconds"


def _value(samples: dict, name: str, **labels: str) -> float:
    """Sum of ``name`` over label sets containing ``labels``."""
    return sum(
        v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()
    )


@pytest.mark.timeout(30)
def test_ttft_is_observed_at_the_first_streamed_bytes_by_path() -> None:
    path = "/v1/chat/completions"
    # D waits this long before it answers: no first byte can reach the client sooner
    d_delay = 0.2

    async def body() -> None:
        async with harness() as h:

            async def scrape() -> dict:
                async with h.client.get(h.url + "/metrics") as resp:
                    return prometheus_samples(await resp.text())

            assert _value(await scrape(), TTFT + "_count") == 0
            h.decode.delay = d_delay
            gate = h.decode.stream_gate = asyncio.Event()  # D holds after its first chunk
            request = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with h.client.post(h.url + path, json=request) as resp:
                assert resp.status == 200
                events = sse_events(resp)
                first = await asyncio.wait_for(events.__anext__(), WAIT)
                assert "Hel" in first
                mid = await scrape()  # the stream is still open: D waits on the gate
                gate.set()
                rest = [e async for e in events]
            assert rest[-1] == "[DONE]"
            end = await scrape()

        # observed at the first bytes, before the request ended (not yet counted)
        assert _value(mid, TTFT + "_count", path=path) == 1
        assert _value(mid, "vllm_ext_proxy_request_duration_seconds_count", path=path) == 0
        assert _value(mid, TTFT + "_sum", path=path) >= d_delay
        # the one observation, under the request's path only
        assert _value(end, TTFT + "_count", path=path) == 1
        assert _value(end, TTFT + "_count") == 1
        assert _value(end, "vllm_ext_proxy_request_duration_seconds_count", path=path) == 1
        ttft = _value(end, TTFT + "_sum", path=path)
        assert ttft <= _value(end, "vllm_ext_proxy_request_duration_seconds_sum", path=path)
        # the buckets agree with the sum: none below D's delay holds the observation
        below = [
            v
            for (n, ls), v in end.items()
            if n == TTFT + "_bucket" and float(dict(ls)["le"]) < d_delay
        ]
        assert below and not any(below)

    run(body)


@pytest.mark.timeout(30)
def test_ttft_leaves_out_unstreamed_and_failed_requests() -> None:
    async def body() -> None:
        async with harness() as h:
            assert (await h.post("/v1/completions", {"prompt": "a"}))[0] == 200
            h.decode.status = 500  # D fails before any byte of a stream
            status, _, _ = await h.post("/v1/completions", {"prompt": "a", "stream": True})
            assert status == 502  # D's 500, answered as the proxy's 502
            async with h.client.get(h.url + "/metrics") as resp:
                got = prometheus_samples(await resp.text())
        assert _value(got, "vllm_ext_proxy_request_duration_seconds_count") == 2
        assert _value(got, TTFT + "_count") == 0

    run(body)
