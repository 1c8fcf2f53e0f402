# SPDX-License-Identifier: Apache-2.0
"""Push 1P1D through real vLLM 0.23.0 engines, real NIXL over UCX and the proxy."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from pd_helpers import (
    MAX_TOKENS,
    TEST_EXTRA_CONFIG,
    kernel_libraries,
    make_prompts,
    metric,
    run_all,
    scrape_metrics,
)

from devkit.cpu_isa import cpu_flags, expected_library, is_x86_64
from devkit.launch.client import complete
from devkit.launch.pd import PDDeployment
from vllm_ext.nixl_push.stats import GAUGES

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def push(push_1p1d: PDDeployment) -> PDDeployment:
    return push_1p1d


def test_outputs_equal_single_engine_concurrency_1(push, prompts, reference) -> None:
    before, d_before = scrape_metrics(push.prefill.url), scrape_metrics(push.decode.url)
    proxy_before = scrape_metrics(push.url)
    assert run_all(push.url, prompts, concurrency=1) == reference
    after, d_after = scrape_metrics(push.prefill.url), scrape_metrics(push.decode.url)
    # The proxy's own /metrics counts every request and both its legs, with latency,
    # and shows the pair healthy (docs/proxy.md, Metrics). A request is counted when its
    # handler ends, just after the client got its last byte: wait until none is in flight.
    # (The decode leg is counted when its stream is closed, which may come a moment
    # after the request's own count: wait for every series, up to 10 s.)
    series = (
        ("vllm_ext_proxy_requests_total", {"path": "/v1/completions", "code": "200"}),
        ("vllm_ext_proxy_request_duration_seconds_count", {"path": "/v1/completions"}),
        ("vllm_ext_proxy_legs_total", {"leg": "prefill", "outcome": "200"}),
        ("vllm_ext_proxy_legs_total", {"leg": "decode", "outcome": "200"}),
    )
    deadline = time.monotonic() + 10
    while True:
        proxy = scrape_metrics(push.url)
        grown = [metric(proxy, n, **lb) - metric(proxy_before, n, **lb) for n, lb in series]
        idle = metric(proxy, "vllm_ext_proxy_in_flight") == 0
        if (idle and all(g >= len(prompts) for g in grown)) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, "the proxy kept a request in flight"
    for (name, labels), g in zip(series, grown):
        assert g == len(prompts), (name, labels, g)
    assert metric(proxy, "vllm_ext_proxy_pair_state", state="healthy") == 1
    rejected = "vllm_ext_proxy_rejected_total"
    assert metric(proxy, rejected) == metric(proxy_before, rejected)
    # Both sides time their part: P's hand-off, D's wait for the KV (one per request).
    for m0, m1, name in (
        (before, after, "vllm:ext_push_handoff_seconds_count"),
        (d_before, d_after, "vllm:ext_push_recv_wait_seconds_count"),
    ):
        assert metric(m1, name) - metric(m0, name) >= len(prompts) - 1, name
    # The KV really crossed NIXL: one WRITE (or, for a prompt that needs no block,
    # a completion only) per request, and the prompt's KV bytes.
    writes = metric(after, "vllm:ext_push_writes_total") - metric(
        before, "vllm:ext_push_writes_total"
    )
    sent = metric(after, "vllm:ext_push_bytes_total") - metric(before, "vllm:ext_push_bytes_total")
    assert writes >= len(prompts) - 1, writes
    kv_per_token = 2 * 2 * 64 * 2 * 4  # K+V x 2 KV heads x head dim 64 x bf16 x 4 layers
    assert sent >= kv_per_token * sum(len(p) for p in prompts if len(p) >= 128) * 0.9


def test_outputs_equal_single_engine_concurrency_8(push, prompts, reference) -> None:
    before = [scrape_metrics(e.url) for e in (push.prefill, push.decode)]
    outputs = run_all(push.url, prompts, concurrency=8)
    after = [scrape_metrics(e.url) for e in (push.prefill, push.decode)]
    # Under load nothing is dropped as foreign, forged or repeated, no WRITE times out or
    # outlives its lease, and nothing hits the writer's catch-all.
    for m0, m1 in zip(before, after):
        for name, labels in (
            ("vllm:ext_push_notifs_foreign_total", {}),
            ("vllm:ext_push_notifs_duplicate_total", {}),
            # every answer carries its reply token (S-WIR-3), none is malformed
            ("vllm:ext_push_notifs_forged_total", {}),
            ("vllm:ext_push_notifs_malformed_total", {}),
            ("vllm:ext_push_failures_total", {"reason": "write_timeout"}),
            ("vllm:ext_push_failures_total", {"reason": "lease_cap"}),
            ("vllm:ext_push_failures_total", {"reason": "internal"}),
        ):
            exported = [k for k in m1 if k.split("{", 1)[0] == name]
            assert all(f'{k}="{v}"' in " ".join(exported) for k, v in labels.items()), (
                f"{name} {labels} not exported"
            )
            assert exported, f"{name} not exported"
            assert metric(m1, name, **labels) - metric(m0, name, **labels) == 0, (name, labels)
        for gauge in GAUGES:  # the levels are exported by both engines, never negative
            values = [v for k, v in m1.items() if k.split("{", 1)[0] == f"vllm:ext_{gauge}"]
            assert values and min(values) >= 0, (gauge, values)
    assert outputs == reference


@pytest.mark.skipif(not is_x86_64(), reason="vLLM's kernel library choice is x86 only")
def test_both_engines_load_the_hosts_kernel_library(push) -> None:
    """On an AVX2-only host this is the AVX2 path (test_cpu_isa_avx2.py forces it)."""
    want = expected_library(cpu_flags())
    assert push.prefill is not None and push.decode is not None
    assert kernel_libraries(push.prefill) == {want}
    assert kernel_libraries(push.decode) == {want}


def test_decode_computes_no_prompt_tokens(push) -> None:
    prompts = make_prompts(seed=99)  # unseen prompts: no prefix-cache hits on D
    before = scrape_metrics(push.decode.url)
    for p in prompts:
        complete(push.url, p, max_tokens=2)
    after = scrape_metrics(push.decode.url)

    def delta(source: str) -> float:
        name = "vllm:prompt_tokens_by_source_total"
        return metric(after, name, source=source) - metric(before, name, source=source)

    external = delta("external_kv_transfer")
    local = delta("local_compute")
    # D recomputes at most the last prompt token of each request itself.
    assert local <= len(prompts), (local, external)
    assert external >= sum(len(p) for p in prompts) - 2 * len(prompts), (local, external)


def test_streaming_through_proxy(push, prompts) -> None:
    out = complete(push.url, prompts[2], max_tokens=MAX_TOKENS, stream=True)
    assert out.raw_chunks >= 2 and len(out.token_ids) == MAX_TOKENS
    assert out.ttft_s < out.total_s


def _usage_idle(url: str) -> bool:
    m = scrape_metrics(url)
    return (
        metric(m, "vllm:kv_cache_usage_perc") == 0
        and metric(m, "vllm:num_requests_running") == 0
        and metric(m, "vllm:num_requests_waiting") == 0
    )


def _wait_idle(dep: PDDeployment, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _usage_idle(dep.prefill.url) and _usage_idle(dep.decode.url):
            return
        time.sleep(1)
    raise AssertionError(f"engines not idle after {timeout}s: P {scrape_metrics(dep.prefill.url)} ")


def test_failed_leg_is_a_clear_error_and_leaks_nothing(push, prompts) -> None:
    # D rejects max_tokens beyond its context; P (max_tokens=1) prefills normally.
    body = {"model": "tiny", "prompt": prompts[3], "max_tokens": 100_000, "temperature": 0}
    req = urllib.request.Request(
        f"{push.url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert 400 <= err.value.code < 600
    payload = json.loads(err.value.read())
    assert "decode leg failed" in payload["error"]["message"]
    # P's blocks come back when its lease (8 s here) ends; D never allocated.
    _wait_idle(push, timeout=60)
    # ... and the pair still serves.
    assert complete(push.url, prompts[1], max_tokens=2).token_ids


def test_client_abort_while_d_waits_frees_d_blocks_promptly(push) -> None:
    """D's request is aborted before its KV arrived: D tells P to stand down
    (PUSH_CANCEL) and frees its blocks within seconds, not at the watchdog."""
    import http.client
    import random

    rng = random.Random(7)
    long_prompt = [rng.randrange(10, 1024) for _ in range(3800)]
    before = scrape_metrics(push.decode.url)
    host, port = push.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": "tiny", "prompt": long_prompt, "max_tokens": 4, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    time.sleep(0.15)  # both legs are in flight; P is still prefilling
    conn.sock.close()  # the client goes away
    conn.close()
    t0 = time.monotonic()
    _wait_idle(push, timeout=TEST_EXTRA_CONFIG["push_registration_timeout_s"] - 5)
    took = time.monotonic() - t0
    after = scrape_metrics(push.decode.url)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    cancels = delta("vllm:ext_push_cancels_sent_total") + delta(
        "vllm:ext_push_cancels_unsent_total"
    )
    assert cancels == 1, "D did not take the cancel path"
    assert took < TEST_EXTRA_CONFIG["push_registration_timeout_s"] - 5
    # the pair still serves afterwards
    assert complete(push.url, long_prompt[:200], max_tokens=2).token_ids
