# SPDX-License-Identifier: Apache-2.0
"""Client bodies that vLLM splits into sub-requests, through push 1P1D and our proxy.

A completion with several prompts becomes sub-requests ``<id>-0``, ``<id>-1``, ...
and ``n > 1`` becomes children ``0_<id>``, ``1_<id>``, ...; the proxy gives the whole
body one transfer id, so every sub-request of P and of D carries the same one. Each
must still get its own prompt's KV (S-WRT-4, S-SAFE-1): the outputs equal one plain
engine's, per choice. Before the sub-request rule, a four-prompt body made P WRITE
once and the client hang until D's watchdog.

The outputs are deterministic without seeds: ``n = 1`` bodies are greedy, and the
``n > 1`` ones (which vLLM refuses greedy) sample with ``top_k = 1``. Seeds do not
work for this on vLLM's CPU sampler: it honours a request's seed only in a batch where
every request has one (``TopKTopPSampler.forward_cpu``; seeded children then differed
from one engine's with the right KV: same first-token logprobs, other samples), and a
seeded request whose prefill is chunked kills the engine ("CPU Generator does not use
offset").
"""

from __future__ import annotations

import functools
import json
import random
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from pd_helpers import metric, scrape_metrics

from devkit.launch.client import SERVED_MODEL_NAME
from devkit.launch.pd import PDDeployment

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MAX_TOKENS = 6
#: (prompts in the body, n), sent 4 at a time
BODIES = [(k, 1) for k in (2, 3, 5, 8)] + [(1, n) for n in (2, 3, 4)] + [(2, 2)]


def _prompts(k: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1024) for _ in range(rng.choice((40, 130, 260)))] for _ in range(k)]


def _body(k: int, n: int, i: int) -> dict[str, Any]:
    prompts = _prompts(k, 1000 + i)
    return {
        "model": SERVED_MODEL_NAME,
        "prompt": prompts if k > 1 else prompts[0],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "return_token_ids": True,
        "n": n,
        # the argmax either way: greedy, or top-1 sampling where vLLM refuses greedy
        **({"temperature": 0} if n == 1 else {"temperature": 1.0, "top_k": 1}),
    }


def _choices(url: str, body: dict[str, Any]) -> list[list[int]]:
    """Token ids of every choice, in choice order (non-streaming)."""
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        data = json.loads(r.read())
    choices = sorted(data["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices]


def _send_all(url: str) -> list[list[list[int]]]:
    with ThreadPoolExecutor(4) as ex:
        return list(ex.map(lambda ib: _choices(url, _body(*ib[1], ib[0])), enumerate(BODIES)))


@pytest.fixture(scope="module")
def push(push_1p1d: PDDeployment) -> PDDeployment:
    return push_1p1d


@pytest.fixture(scope="module")
def single_outputs(single_engine: PDDeployment) -> list[list[list[int]]]:
    return [_choices(single_engine.url, _body(*b, i)) for i, b in enumerate(BODIES)]


def test_multi_prompt_and_n_bodies_equal_one_engine(push, single_outputs) -> None:
    before = scrape_metrics(push.prefill.url)
    outputs = _send_all(push.url)
    after = scrape_metrics(push.prefill.url)
    for (k, n), got, want in zip(BODIES, outputs, single_outputs):
        assert len(got) == k * n, (k, n, got)
        assert got == want, f"{k} prompt(s), n={n}: push {got} != one engine {want}"
    # Every sub-request met its own twin by transfer id; none was dropped as a repeat.
    subs = sum(k * n for k, n in BODIES)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert delta("vllm:ext_push_match_transfer_id_total") == subs
    assert delta("vllm:ext_push_regs_duplicate_total") == 0


#: What a sequential router's P leg carries (vllm-router 0.1.17: the pull fields, empty)
ROUTER_P_LEG = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip


def _post(url: str, body: dict[str, Any], request_id: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json", "X-Request-Id": request_id},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}


def _router_legs(push: PDDeployment, body: dict[str, Any], request_id: str = "") -> tuple[int, Any]:
    """One body the way vllm-router sends it: the P leg (one token), then the D leg
    with P's answer verbatim, both under the client's X-Request-Id."""
    assert push.prefill is not None and push.decode is not None
    p_body = {**body, "max_tokens": 1, "kv_transfer_params": dict(ROUTER_P_LEG)}
    status, p_out = _post(push.prefill.url, p_body, request_id)
    if status != 200:
        return status, p_out
    d_body = {**body, "kv_transfer_params": p_out["kv_transfer_params"]}
    status, d_out = _post(push.decode.url, d_body, request_id)
    return status, d_out["choices"][0]["token_ids"] if status == 200 else d_out


ROUNDS = 8


def test_router_legs_of_two_bodies_under_one_request_id_never_cross(push, single_engine) -> None:
    """Two different prompts at once, each sent as a router sends its legs, under the
    same X-Request-Id (gateways that forward the client's id): every answer is its own
    prompt's, as one engine gives it. Before S-WRT-7 and per-body ids, 8 of 16 answers
    here were the other prompt's continuation, each with HTTP 200 (P gave both bodies
    one transfer id)."""
    bodies = [_body(1, 1, 2000 + i) for i in range(2)]
    want = [_choices(single_engine.url, b)[0] for b in bodies]
    before = scrape_metrics(push.prefill.url)
    results = []
    with ThreadPoolExecutor(2) as ex:
        for r in range(ROUNDS):
            rid = f"shared-{r}"
            results += list(ex.map(functools.partial(_router_legs, push, request_id=rid), bodies))
    after = scrape_metrics(push.prefill.url)
    wrong = [
        (i, got) for i, (status, got) in enumerate(results)
        if status == 200 and got != want[i % 2]
    ]  # fmt: skip
    assert not wrong, f"answers of the other prompt with HTTP 200: {wrong} (want {want})"
    served = sum(status == 200 for status, _ in results)
    # Each body has ids of its own, so each meets its own twin (a refused collision would
    # be an error, never a 200): all are served.
    assert served == 2 * ROUNDS, results
    assert metric(after, "vllm:ext_push_regs_prompt_mismatch_total") == metric(
        before, "vllm:ext_push_regs_prompt_mismatch_total"
    )
