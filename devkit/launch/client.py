# SPDX-License-Identifier: Apache-2.0
"""A minimal streaming OpenAI client that measures TTFT (demo and e2e tests)."""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

from devkit.launch.engine import SERVED_MODEL_NAME


@dataclasses.dataclass
class Completion:
    text: str
    token_ids: list[int]
    ttft_s: float
    total_s: float
    raw_chunks: int


def sse_events(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON events of an OpenAI server-sent-event stream, up to ``[DONE]``."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


def completion_body(prompt: str | list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
    """A greedy ``/v1/completions`` body that answers token ids (every client here)."""
    return {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }


def complete(
    url: str,
    prompt: str | list[int],
    max_tokens: int = 16,
    stream: bool = True,
    timeout: float = 300.0,
    request_id: str | None = None,
    extra: dict[str, Any] | None = None,
) -> Completion:
    """Greedy completion through ``url`` (proxy or engine); TTFT = first token chunk."""
    body = {**completion_body(prompt, max_tokens, stream), **(extra or {})}
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), headers)
    t0 = time.perf_counter()
    ttft = None
    texts: list[str] = []
    ids: list[int] = []
    chunks = 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        if not stream:
            data = json.loads(r.read())
            ttft = time.perf_counter() - t0
            choice = data["choices"][0]
            return Completion(choice["text"], choice.get("token_ids") or [], ttft, ttft, 1)
        for data in sse_events(r):
            if "error" in data:
                raise RuntimeError(f"stream error: {data['error']}")
            choice = data["choices"][0]
            if choice.get("text") or choice.get("token_ids"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                texts.append(choice.get("text") or "")
                ids.extend(choice.get("token_ids") or [])
                chunks += 1
    total = time.perf_counter() - t0
    return Completion("".join(texts), ids, ttft if ttft is not None else total, total, chunks)
