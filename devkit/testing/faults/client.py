# SPDX-License-Identifier: Apache-2.0
"""Requests whose end a fault test records: status, error message, tokens, timing.

:class:`Call` runs one completion request on a thread (through the proxy, or one
leg straight to an engine) and can be aborted by the test at a chosen moment:
the socket is shut down under the reader, as a client that goes away. Every call
has a timeout, so a request nobody ends still ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import random
import socket
import threading
import time
import urllib.parse
import uuid
from typing import Any

from devkit.launch.client import completion_body, sse_events
from vllm_ext.proxy import bodies
from vllm_ext.proxy.config import PrefillCoordinates

#: A request id the NIXL shim can match: unique, and no id contains another.
RID_PREFIX = "flt"


def new_rid(tag: str = "") -> str:
    return f"{RID_PREFIX}{tag}{uuid.uuid4().hex[:12]}x"


def make_prompt(n: int, seed: int, vocab: int = 1024) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(n)]


@dataclasses.dataclass
class Outcome:
    rid: str
    prompt_len: int
    #: "ok", "error" (an HTTP error or an error event), "aborted" (by the test),
    #: "exception" (connection reset, timeout ...)
    kind: str = "pending"
    status: int | None = None
    message: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    t0: float = 0.0
    t1: float = 0.0
    #: streams: monotonic arrival time of each token
    token_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def elapsed(self) -> float:
        return self.t1 - self.t0

    def brief(self) -> str:
        if self.ok:
            return f"ok {len(self.token_ids)} tokens in {self.elapsed:.1f}s"
        return f"{self.kind} {self.status} after {self.elapsed:.1f}s: {self.message[:160]}"


class Call:
    """One POST on its own thread. ``start()``, then ``abort()`` and/or ``result()``."""

    def __init__(
        self,
        url: str,
        body: dict[str, Any],
        rid: str,
        timeout: float = 150.0,
        path: str = "/v1/completions",
    ) -> None:
        self.url, self.body, self.rid, self.timeout, self.path = url, body, rid, timeout, path
        prompt = body.get("prompt")
        self.outcome = Outcome(rid, len(prompt) if isinstance(prompt, list) else 0)
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = False
        self._thread = threading.Thread(target=self._run, name=f"call-{rid}", daemon=True)
        self.first_token = threading.Event()
        #: what the caller needs to find the expected output (e.g. prompt key, max tokens)
        self.key: tuple[Any, ...] | None = None

    def start(self) -> Call:
        self.outcome.t0 = time.monotonic()
        self._thread.start()
        return self

    def abort(self) -> None:
        """The client goes away: shut the socket down under the reading thread."""
        self._aborted = True
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def result(self, timeout: float | None = None) -> Outcome:
        self._thread.join(self.timeout + 30 if timeout is None else timeout)
        return self.outcome

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def _run(self) -> None:
        o = self.outcome
        try:
            self._request()
        except Exception as e:
            o.kind = "aborted" if self._aborted else "exception"
            o.message = f"{type(e).__name__}: {e}"
        finally:
            o.t1 = time.monotonic()
            if o.kind == "pending":
                o.kind = "aborted" if self._aborted else "exception"
            if self._aborted and o.kind != "ok":
                o.kind = "aborted"
            if self._conn is not None:
                self._conn.close()

    def _request(self) -> None:
        o = self.outcome
        u = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=self.timeout)
        self._conn = conn
        headers = {"Content-Type": "application/json", "X-Request-Id": self.rid}
        conn.request("POST", self.path, json.dumps(self.body), headers)
        if self._aborted:
            self.abort()
        resp = conn.getresponse()
        o.status = resp.status
        if resp.status != 200:
            o.kind, o.message = "error", _error_message(resp.read())
            return
        if not self.body.get("stream"):
            data = json.loads(resp.read())
            o.token_ids = list(data["choices"][0].get("token_ids") or [])
            o.kind = "ok"
            self.first_token.set()
            return
        done = False

        def lines() -> Any:
            nonlocal done
            for raw in resp:
                line = raw.strip()
                if line.startswith(b"data:") and line[5:].strip() == b"[DONE]":
                    done = True
                yield raw

        for data in sse_events(lines()):
            if "error" in data:
                o.kind, o.message = "error", _error_message(json.dumps(data).encode())
                return
            ids = data["choices"][0].get("token_ids") or []
            if ids:
                o.token_ids.extend(ids)
                o.token_times.extend([time.monotonic()] * len(ids))
                self.first_token.set()
        if not done:  # the stream was cut short (a client abort, a dropped connection)
            o.kind = "aborted" if self._aborted else "exception"
            o.message = f"stream ended without [DONE] after {len(o.token_ids)} tokens"
            return
        o.kind = "ok" if o.kind == "pending" else o.kind


def _error_message(raw: bytes) -> str:
    try:
        parsed = json.loads(raw)
        err = parsed.get("error", parsed)
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    except ValueError:
        return raw.decode(errors="replace")[:500]


def via_proxy(
    url: str, prompt: list[int], max_tokens: int = 8, rid: str | None = None,
    stream: bool = False, timeout: float = 150.0,
) -> Call:  # fmt: skip
    """A client request through the proxy (not started)."""
    return Call(url, completion_body(prompt, max_tokens, stream), rid or new_rid(), timeout)


def direct_legs(
    p_url: str,
    d_url: str,
    coords: PrefillCoordinates,
    prompt: list[int],
    max_tokens: int = 8,
    rid: str | None = None,
    d_extra: dict[str, Any] | None = None,
    timeout: float = 150.0,
) -> tuple[Call, Call]:
    """The two push legs the proxy would send, straight to the engines (not started),
    so that the test can end one leg alone."""
    rid = rid or new_rid()
    client = completion_body(prompt, max_tokens, stream=False)
    transfer_id = bodies.new_transfer_id()
    p_body = bodies.push_prefill_body(client, transfer_id)
    d_body = bodies.push_decode_body(client, coords, transfer_id)
    d_body["kv_transfer_params"].update(d_extra or {})
    if "remote_request_id" in (d_extra or {}):
        d_body["kv_transfer_params"]["remote_request_id"] = transfer_id
    return Call(p_url, p_body, rid, timeout), Call(d_url, d_body, rid, timeout)


def plain(url: str, prompt: list[int], max_tokens: int, rid: str | None = None,
          timeout: float = 150.0) -> Call:  # fmt: skip
    """A request to one engine without disaggregation (the reference; D's load)."""
    return Call(url, completion_body(prompt, max_tokens, stream=False), rid or new_rid(), timeout)
