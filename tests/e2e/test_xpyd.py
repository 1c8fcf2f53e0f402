# SPDX-License-Identifier: Apache-2.0
"""2P2D push on real engines, behind our proxy and behind vLLM's ``vllm-router``.

One deployment serves the whole module (four engines start once, ~2-3 min here):
two producers and two consumers of our connector, as configured by default (P on
core 0, D on core 1, one OMP thread and a 1 GiB KV cache each), our proxy and,
where installed, ``vllm-router`` in front of the same engines. The router runs
the legs one after the other and sends a P leg without ``transfer_id``: our P
answers it with the push D leg (``push_answer_sequential_legs``, on by default),
which the router hands to D. Our proxy sends its own transfer ids and ignores
P's answer.

The failover test kills a P with SIGKILL and must run last.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pd_helpers import MAX_TOKENS, TEST_EXTRA_CONFIG, make_prompts, metric, scrape_metrics

from devkit.launch.client import complete
from devkit.launch.engine import SERVED_MODEL_NAME
from devkit.launch.xpyd import XPyDConfig, XPyDDeployment, vllm_router_binary

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

HAVE_ROUTER = vllm_router_binary() is not None
KV_PER_TOKEN = 2 * 2 * 64 * 2 * 4  # K+V x 2 KV heads x head dim 64 x bf16 x 4 layers
TCP_USER_TIMEOUT_S = 10
CANCEL_ANSWER_S = 10  # push_cancel_answer_timeout_s's default


@pytest.fixture(scope="module")
def xpyd(tiny_model: Path, tmp_path_factory) -> Iterator[XPyDDeployment]:
    cfg = XPyDConfig(
        model=str(tiny_model),
        run_dir=tmp_path_factory.mktemp("xpyd"),
        # a killed P is known gone 2 x the TCP user timeout after D's send to it failed
        # (docs/design.md N-LIV-1): 10 s keeps the failover test's wait short; a producer
        # needs its write timeout below 2 x that (N-REL-2)
        extra_config={
            **TEST_EXTRA_CONFIG,
            "ucx_tcp_user_timeout_s": TCP_USER_TIMEOUT_S,
            "push_write_timeout_s": 1.5 * TCP_USER_TIMEOUT_S,
        },
        # every test sends the same prompts: no prefix cache, so each one pushes them whole
        enable_prefix_caching=False,
        routers=("proxy", "vllm-router") if HAVE_ROUTER else ("proxy",),
        # fast failover: probe every 0.5 s
        proxy_extra_args=["--health-interval", "0.5", "--prefill-timeout", "60"],
    )
    with XPyDDeployment(cfg) as dep:
        log = (cfg.run_dir / "prefill0.log").read_text()
        assert "vllm-ext: registered" in log  # the engines load this checkout's plugin
        yield dep


def _run(url: str, prompts: list[list[int]], rounds: int = 2) -> list[list[int]]:
    """Each prompt ``rounds`` times (2 in flight), greedy; all rounds must agree."""
    work = [p for _ in range(rounds) for p in prompts]
    with ThreadPoolExecutor(2) as ex:
        outs = list(ex.map(lambda p: complete(url, p, max_tokens=MAX_TOKENS).token_ids, work))
    by_prompt = [outs[i :: len(prompts)] for i in range(len(prompts))]
    for i, variants in enumerate(by_prompt):
        assert all(v == variants[0] for v in variants), f"prompt {i}: {variants}"
    return [v[0] for v in by_prompt]


def _snap(dep: XPyDDeployment) -> dict[str, dict[str, float]]:
    return {e.spec.name: scrape_metrics(e.url) for e in dep.engines}


def _delta(before, after, engine: str, name: str, **labels: str) -> float:
    return metric(after[engine], name, **labels) - metric(before[engine], name, **labels)


def _wait_idle(dep: XPyDDeployment, timeout: float = 60.0, engines=None) -> None:
    """Every engine: no KV block in use, nothing running or waiting."""
    deadline = time.monotonic() + timeout
    engines = engines if engines is not None else dep.engines
    while True:
        busy = {}
        for e in engines:
            m = scrape_metrics(e.url)
            usage = [
                metric(m, "vllm:kv_cache_usage_perc"),
                metric(m, "vllm:num_requests_running"),
                metric(m, "vllm:num_requests_waiting"),
            ]
            if any(usage):
                busy[e.spec.name] = usage
        if not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"engines not idle after {timeout}s (usage, running, waiting): {busy}"
            )
        time.sleep(0.5)


def _check_pushed(dep: XPyDDeployment, before, after, prompts) -> None:
    """Both P and both D took part; the KV crossed by push WRITEs, not by D's compute:
    D counts the prompt tokens as external KV."""
    names = [e.spec.name for e in dep.engines]
    for name in names:
        if name.startswith("prefill"):
            assert _delta(before, after, name, "vllm:ext_push_writes_total") >= 1, name
        else:
            assert _delta(before, after, name, "vllm:ext_push_recv_wait_seconds_count") >= 1, name
    writes = sum(
        _delta(before, after, n, "vllm:ext_push_writes_total") for n in names if "prefill" in n
    )
    sent = sum(
        _delta(before, after, n, "vllm:ext_push_bytes_total") for n in names if "prefill" in n
    )
    multi_block = [p for p in prompts if len(p) >= 128]
    assert writes >= 2 * len(multi_block), writes
    assert sent >= 2 * KV_PER_TOKEN * sum(len(p) for p in multi_block) * 0.9, sent
    local = sum(
        _delta(before, after, n, "vllm:prompt_tokens_by_source_total", source="local_compute")
        for n in names
        if n.startswith("decode")
    )
    assert local <= 2 * len(prompts), local  # D computes at most the last prompt token
    external = sum(
        _delta(before, after, n, "vllm:prompt_tokens_by_source_total",
               source="external_kv_transfer")
        for n in names
        if n.startswith("decode")
    )  # fmt: skip
    assert external >= 2 * sum(len(p) for p in multi_block) * 0.9, external


def test_proxy_2p2d_push(xpyd, prompts, reference) -> None:
    before = _snap(xpyd)
    assert _run(xpyd.proxy_url, prompts) == reference
    _wait_idle(xpyd)
    _check_pushed(xpyd, before, _snap(xpyd), prompts)


@pytest.mark.skipif(not HAVE_ROUTER, reason="vllm-router is not installed")
def test_vllm_router_2p2d_push(xpyd, prompts, reference) -> None:
    """The product connector behind the unmodified router: P answers the push D leg
    (a transfer id and secret it made), and every request is pushed."""
    before = _snap(xpyd)
    assert _run(xpyd.router_url, prompts) == reference
    _wait_idle(xpyd)
    _check_pushed(xpyd, before, _snap(xpyd), prompts)


def _post(url: str, prompt: list[int], max_tokens: int, timeout: float) -> tuple[int, str]:
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_killed_prefill_fails_its_requests_cleanly_and_the_rest_go_on(xpyd, prompts) -> None:
    """SIGKILL P0 while requests are in flight through the proxy: those on P0 end with an
    HTTP error naming the leg, within the proxy's timeouts; the others, and every request
    after, succeed on P1; the survivors hold no blocks at the end."""
    url = xpyd.proxy_url
    long_prompts = [p * 13 for p in make_prompts(seed=4321) if len(p) >= 300]  # 3900+ tokens
    results: list[tuple[float, int, str]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        t0 = time.monotonic()
        status, text = _post(url, long_prompts[i % len(long_prompts)][: 3900 + i], 4, 120)
        with lock:
            results.append((time.monotonic() - t0, status, text))

    p0 = xpyd.prefills[0]
    with ThreadPoolExecutor(8) as ex:
        futures = [ex.submit(one, i) for i in range(8)]
        # kill once P0 is prefilling one of them
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if metric(scrape_metrics(p0.url), "vllm:num_requests_running") >= 1:
                break
            time.sleep(0.05)
        xpyd.kill_engine(p0)
        killed_at = time.monotonic()
        for f in futures:
            f.result()
    failed = [(t, s, txt) for t, s, txt in results if s != 200]
    ok = [r for r in results if r[1] == 200]
    assert failed, f"no request was on P0 when it died: {results}"
    assert ok, "every request failed"
    for took, status, text in failed:
        # 503: a leg refused by the dead P with no other P to redispatch to (docs/proxy.md)
        assert status in (502, 503, 504), (status, text)
        msg = json.loads(text)["error"]["message"]
        assert "leg failed" in msg, msg
        assert took < 60, (took, msg)
    # new requests all succeed, on P1
    p1_before = scrape_metrics(xpyd.prefills[1].url)
    for p in prompts:
        assert complete(url, p, max_tokens=2, timeout=60).token_ids
    p1_after = scrape_metrics(xpyd.prefills[1].url)
    writes = metric(p1_after, "vllm:ext_push_writes_total") - metric(
        p1_before, "vllm:ext_push_writes_total"
    )
    assert writes >= len([p for p in prompts if len(p) >= 128])
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        health = json.loads(r.read())
    # /health names engines, never their addresses: P0's name is its engine id
    p0_state = next(e for e in health["engines"] if e["name"] == xpyd.p_engine_ids[0])
    assert not p0_state["in_service"], health
    # D blocks that waited for P0's KV come back (D's watchdog, its cancel unanswered,
    # then P0 known gone: N-LIV-1's bound), P1's lease ends
    survivors = [xpyd.prefills[1], *xpyd.decodes]
    bound = TEST_EXTRA_CONFIG["push_registration_timeout_s"] + CANCEL_ANSWER_S
    _wait_idle(xpyd, timeout=bound + 2 * TCP_USER_TIMEOUT_S + 30, engines=survivors)
    print(
        f"failover: {len(failed)} failed ({[s for _, s, _ in failed]}), {len(ok)} ok; "
        f"slowest failure {max(t for t, _, _ in failed):.1f}s; "
        f"idle {time.monotonic() - killed_at:.1f}s after the kill; "
        f"e.g. {json.loads(failed[0][2])['error']['message']!r}"
    )
