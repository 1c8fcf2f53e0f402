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

import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from pd_helpers import metric, scrape_metrics

from vllm_ext.launch.client import SERVED_MODEL_NAME
from vllm_ext.launch.pd import PDDeployment

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
