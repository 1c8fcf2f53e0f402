# SPDX-License-Identifier: Apache-2.0
"""How the proxy weighs engines (``--routing``): its own count, the engines' own load, prefixes.

* ``least-in-flight`` (default): the legs in flight through this proxy. Exact and free
  while the proxy is the engines' only client.
* ``engine-load``: what each engine says on its Prometheus ``/metrics``
  (``vllm:num_requests_waiting`` + ``vllm:num_requests_running``; ties broken by
  ``vllm:kv_cache_usage_perc``), scraped in the background every ``metrics_interval``
  seconds with a bounded timeout, plus the legs this proxy sent it since that scrape
  and still has in flight (the scrape cannot know them yet). So the proxy still
  balances when other clients share the engines. An engine whose last scrape failed
  or is stale counts with the proxy's own in-flight count.
* ``prefix-affinity``: P is chosen per request by rendezvous hashing of the prompt's
  leading chunks over the P engines that may serve (so requests that share a prefix
  land on the P whose prefix cache holds it), bounded by load: a P more than
  ``prefix_max_imbalance`` requests busier than the least loaded one is passed over for
  the next in the request's rendezvous order. Load is measured as ``engine-load`` does.
  D is chosen by load.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from vllm_ext.proxy.config import Routing

if TYPE_CHECKING:
    from vllm_ext.proxy.pool import Backend

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
LOAD_FAMILIES = (WAITING, RUNNING, KV_USAGE)


@dataclass(frozen=True)
class EngineLoad:
    """One scrape of an engine's ``/metrics``."""

    waiting: float
    running: float
    kv_usage: float
    #: monotonic time of the scrape
    at: float
    #: the engine's ``picked`` count at the scrape (legs sent after it are not in it)
    picked: int


def parse_engine_load(text: str, at: float, picked: int) -> EngineLoad | None:
    """The load gauges of one ``/metrics`` text (summed over labels), or ``None`` without
    them or when their lines do not parse (the text is the engine's: untrusted).

    Only the lines of :data:`LOAD_FAMILIES` go through prometheus_client's parser
    (vLLM's text has hundreds of others, histograms mostly)."""
    lines = [line for line in text.splitlines() if line.startswith(LOAD_FAMILIES)]
    metrics: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                if sample.name in LOAD_FAMILIES:
                    metrics[sample.name] = metrics.get(sample.name, 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError, KeyError):
        return None
    if WAITING not in metrics and RUNNING not in metrics:
        return None
    return EngineLoad(
        waiting=metrics.get(WAITING, 0.0),
        running=metrics.get(RUNNING, 0.0),
        kv_usage=metrics.get(KV_USAGE, 0.0),
        at=at,
        picked=picked,
    )


async def scrape_load(
    session: aiohttp.ClientSession, backend: Backend, timeout: float
) -> EngineLoad | None:
    """Scrape ``backend``'s ``/metrics`` once; ``None`` on any failure (never raises)."""
    picked = backend.picked
    try:
        async with session.get(
            backend.url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                return None
            text = await resp.text(errors="replace")
    except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
        return None
    return parse_engine_load(text, time.monotonic(), picked)


def engine_requests(backend: Backend, now: float, stale_after: float) -> float:
    """Requests on ``backend`` as its last fresh scrape says, plus what the proxy sent
    since then and still has in flight; its in-flight count without a fresh scrape."""
    load = backend.engine_load
    if load is None or now - load.at > stale_after:
        return float(backend.in_flight)
    sent_since = min(backend.in_flight, max(0, backend.picked - load.picked))
    return load.waiting + load.running + sent_since


def load_key(backend: Backend, routing: Routing, now: float, stale_after: float) -> tuple:
    """What the choice minimizes for ``backend`` under ``routing``."""
    if routing == "least-in-flight":
        return (backend.in_flight, 0.0)
    kv = backend.engine_load.kv_usage if backend.engine_load is not None else 0.0
    return (engine_requests(backend, now, stale_after), kv)


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt of a completions or chat request as one string ('' if none)."""
    prompt = body.get("prompt")
    if prompt is None and isinstance(body.get("messages"), list):
        parts = []
        for message in body["messages"]:
            if isinstance(message, dict):
                parts.append(f"{message.get('role', '')}:{message.get('content', '')}")
        return "\n".join(parts)
    if isinstance(prompt, list):  # token ids, or a batch (its first prompt)
        if prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list):
            return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def prefix_key(body: dict[str, Any], max_chars: int, chunk_chars: int) -> str | None:
    """The hash of the prompt's leading whole chunks of ``chunk_chars`` characters, up to
    ``max_chars``; ``None`` for a prompt shorter than one chunk (no affinity then)."""
    text = prompt_text(body)
    whole = min(len(text), max_chars) // chunk_chars * chunk_chars
    if whole == 0:
        return None
    return hashlib.blake2b(text[:whole].encode(errors="replace"), digest_size=16).hexdigest()


def rendezvous_order(key: str, backends: list[Backend]) -> list[Backend]:
    """``backends`` by decreasing rendezvous weight for ``key`` (stable as engines come and go)."""

    def weight(b: Backend) -> bytes:
        return hashlib.blake2b(f"{key}|{b.name}".encode(), digest_size=8).digest()

    return sorted(backends, key=weight, reverse=True)


async def watch_loads(
    session: aiohttp.ClientSession,
    engines: Callable[[], list[Backend]],
    interval: float,
    timeout: float,
) -> None:
    """Scrape every engine's ``/metrics`` every ``interval`` seconds, until cancelled
    (``engines()`` is asked each round: discovery may change them)."""
    while True:
        backends = engines()
        results = await asyncio.gather(
            *(scrape_load(session, b, timeout) for b in backends), return_exceptions=True
        )
        for backend, load in zip(backends, results):
            ok = isinstance(load, EngineLoad)
            backend.engine_load = load if isinstance(load, EngineLoad) else None
            backend.scrapes_failed += not ok
        await asyncio.sleep(interval)
