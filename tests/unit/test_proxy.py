# SPDX-License-Identifier: Apache-2.0
"""The P/D proxy over real loopback HTTP, against two fake OpenAI engines (no vLLM).

Each test drives its own event loop (``asyncio.run``): the fake P and D engines
and the proxy are real aiohttp servers on free 127.0.0.1 ports (``proxy_fakes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from proxy_fakes import (
    P_COORDS,
    PULL_KV,
    REPO,
    WAIT,
    FakeEngine,
    free_port,
    harness,
    run,
    serve,
    sse_events,
    wait_for_other,
)

from vllm_ext.proxy import LegTimeouts, PrefillCoordinates, ProxyConfig, bodies
from vllm_ext.proxy.cli import build_parser, config_from_args, main, new_event_loop

# ---------------------------------------------------------------- push mode


@pytest.mark.timeout(30)
def test_push_legs_concurrent_shared_ids_and_exact_kv_params() -> None:
    async def body() -> None:
        async with harness() as h:
            h.prefill.on_receive = wait_for_other(h.decode)
            h.decode.on_receive = wait_for_other(h.prefill)
            client_body = {"model": "tiny", "prompt": "hi", "max_tokens": 7, "min_tokens": 2}
            status, out, headers = await h.post("/v1/completions", client_body)
            assert status == 200, out
            assert out["engine"] == "decode"  # the client gets D's answer
            # Both legs were in flight at the same time (each saw the other arrive).
            (p,), (d,) = h.prefill.received, h.decode.received
            assert h.prefill.kv_params_out == {"saw_other": True}
            assert h.decode.kv_params_out == {"saw_other": True}
            rid = p.headers["X-Request-Id"]
            assert rid.startswith("cmpl-") and d.headers["X-Request-Id"] == rid
            assert headers["X-Request-Id"] == rid
            tid = p.body["kv_transfer_params"]["transfer_id"]
            assert len(tid) == 32 and int(tid, 16) >= 0
            secret = p.body["kv_transfer_params"]["transfer_secret"]
            assert len(secret) >= 16 and secret != tid  # S-LEG-3: unguessable, in both legs
            assert p.body["kv_transfer_params"] == {
                "do_remote_decode": True,
                "transfer_id": tid,
                "transfer_secret": secret,
            }
            assert d.body["kv_transfer_params"] == {
                "do_remote_prefill": True,
                "remote_engine_id": "p-engine-0",
                "remote_host": "10.1.2.3",
                "remote_port": 5601,
                "tp_size": 2,
                "pp_size": 1,
                "transfer_id": tid,
                "transfer_secret": secret,
            }
            assert p.body["max_tokens"] == 1 and p.body["stream"] is False
            assert "min_tokens" not in p.body and p.body["prompt"] == "hi"
            assert d.body["max_tokens"] == 7 and d.body["min_tokens"] == 2
            assert "stream" not in d.body

    run(body)


@pytest.mark.timeout(30)
def test_push_client_request_id_and_authorization_reach_both_legs() -> None:
    """The client's ``Authorization`` reaches the legs with ``forward_authorization``
    (test_proxy_security.py: not without it)."""

    async def body() -> None:
        async with harness(forward_authorization=True) as h:
            hdrs = {"X-Request-Id": "my-req-42", "Authorization": "Bearer sk-test"}
            for _ in range(2):  # two requests: distinct transfer ids, pooled connections
                status, _, headers = await h.post("/v1/completions", {"prompt": "x"}, hdrs)
                assert status == 200 and headers["X-Request-Id"] == "my-req-42"
            for r in h.prefill.received + h.decode.received:
                assert r.headers["X-Request-Id"] == "my-req-42"
                assert r.headers["Authorization"] == "Bearer sk-test"
            tids = [r.body["kv_transfer_params"]["transfer_id"] for r in h.decode.received]
            assert len(set(tids)) == 2
            secrets = {r.body["kv_transfer_params"]["transfer_secret"] for r in h.decode.received}
            assert len(secrets) == 2  # one secret per transfer

    run(body)


@pytest.mark.timeout(30)
def test_push_chat_streaming_passes_chunks_in_order() -> None:
    async def body() -> None:
        async with harness() as h:
            req = {
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 9,
                "max_tokens": 9,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with h.client.post(h.url + "/v1/chat/completions", json=req) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                events = [e async for e in sse_events(resp)]
            texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
            assert texts == ["Hel", "lo", " wor", "ld"] and events[-1] == "[DONE]"
            (p,), (d,) = h.prefill.received, h.decode.received
            assert p.path == d.path == "/v1/chat/completions"
            assert p.body["stream"] is False and "stream_options" not in p.body
            assert p.body["max_tokens"] == 1 and p.body["max_completion_tokens"] == 1
            assert d.body["stream"] is True and d.body["stream_options"] == {"include_usage": True}
            assert d.body["max_completion_tokens"] == 9

    run(body)


@pytest.mark.timeout(30)
def test_streaming_is_flushed_chunk_by_chunk() -> None:
    """The client sees D's first chunk while D still holds back the rest."""

    async def body() -> None:
        async with harness() as h:
            h.decode.stream_gate = asyncio.Event()
            req = {"prompt": "x", "stream": True}
            async with h.client.post(h.url + "/v1/completions", json=req) as resp:
                events = sse_events(resp)
                first = await asyncio.wait_for(events.__anext__(), WAIT)
                assert json.loads(first)["choices"][0]["text"] == "Hel"
                h.decode.stream_gate.set()
                rest = [e async for e in events]
            assert len(rest) == 4 and rest[-1] == "[DONE]"

    run(body)


@pytest.mark.timeout(30)
def test_chat_and_completions_non_streaming() -> None:
    async def body() -> None:
        async with harness() as h:
            status, out, _ = await h.post("/v1/completions", {"prompt": "a"})
            assert status == 200 and out["choices"][0]["text"] == "decode:Hello world"
            chat = {"messages": [{"role": "user", "content": "a"}]}
            status, out, _ = await h.post("/v1/chat/completions", chat)
            assert status == 200
            assert out["choices"][0]["message"]["content"] == "decode:Hello world"

    run(body)


# ---------------------------------------------------------------- pull mode


@pytest.mark.timeout(30)
def test_pull_legs_sequential_and_d_gets_p_kv_params() -> None:
    async def body() -> None:
        async with harness(mode="pull") as h:
            h.prefill.kv_params_out = PULL_KV
            h.prefill.delay = 0.2
            status, out, _ = await h.post("/v1/completions", {"prompt": "a", "max_tokens": 5})
            assert status == 200 and out["engine"] == "decode"
            (p,), (d,) = h.prefill.received, h.decode.received
            assert h.prefill.responded_at is not None and d.at >= h.prefill.responded_at
            assert p.body["kv_transfer_params"] == {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
            assert p.body["max_tokens"] == 1 and p.body["stream"] is False
            assert d.body["kv_transfer_params"] == PULL_KV and d.body["max_tokens"] == 5
            assert p.headers["X-Request-Id"] == d.headers["X-Request-Id"]

    run(body)


@pytest.mark.timeout(30)
def test_pull_chat_streaming() -> None:
    async def body() -> None:
        async with harness(mode="pull") as h:
            h.prefill.kv_params_out = PULL_KV
            req = {"messages": [{"role": "user", "content": "a"}], "stream": True}
            async with h.client.post(h.url + "/v1/chat/completions", json=req) as resp:
                assert resp.status == 200
                events = [e async for e in sse_events(resp)]
            assert len(events) == 5 and events[-1] == "[DONE]"
            assert h.decode.received[0].body["kv_transfer_params"] == PULL_KV

    run(body)


@pytest.mark.timeout(30)
def test_pull_prefill_without_kv_params_is_502_and_d_never_called() -> None:
    async def body() -> None:
        async with harness(mode="pull") as h:
            status, out, _ = await h.post("/v1/completions", {"prompt": "a"})
            assert status == 502
            assert "prefill leg failed" in out["error"]["message"]
            assert "kv_transfer_params" in out["error"]["message"]
            assert h.decode.received == []

    run(body)


# ---------------------------------------------------------------- failures


async def _assert_leg_closed(engine: FakeEngine) -> None:
    """The fake engine saw its request's connection closed (vLLM would abort it)."""
    await asyncio.wait_for(engine.cancelled.wait(), WAIT)


@pytest.mark.timeout(30)
def test_prefill_500_gives_502_and_cancels_decode() -> None:
    async def body() -> None:
        async with harness() as h:
            h.decode.hang = True  # D waits for the KV that never comes

            async def fail_after_d(engine: FakeEngine, _: dict[str, Any]) -> None:
                await h.decode.got_request.wait()

            h.prefill.on_receive = fail_after_d
            h.prefill.status = 500
            status, out, headers = await h.post("/v1/completions", {"prompt": "a"})
            assert status == 502
            err = out["error"]
            assert err["message"] == "prefill leg failed: HTTP 500: prefill exploded"
            assert err["code"] == 502 and err["type"] == "upstream_error"
            assert headers["X-Request-Id"].startswith("cmpl-")
            await _assert_leg_closed(h.decode)

    run(body)


@pytest.mark.timeout(30)
def test_prefill_connection_refused_gives_503_and_cancels_decode() -> None:
    async def body() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        async with harness(prefill_url=dead) as h:
            h.decode.hang = True
            status, out, headers = await h.post("/v1/completions", {"prompt": "a", "stream": True})
            assert status == 503 and int(headers["Retry-After"]) >= 1
            assert out["error"]["message"].startswith("prefill leg failed: ClientConnectorError")
            assert out["error"]["type"] == "upstream_unavailable"
            if h.decode.received:  # D's leg may not even have been accepted yet
                await _assert_leg_closed(h.decode)

    run(body)


@pytest.mark.timeout(30)
def test_prefill_timeout_gives_504_and_closes_both_legs() -> None:
    async def body() -> None:
        async with harness(prefill_timeouts=LegTimeouts(connect=2.0, total=0.5)) as h:
            h.prefill.hang = True
            h.decode.hang = True
            t0 = time.monotonic()
            status, out, _ = await h.post("/v1/completions", {"prompt": "a"})
            assert status == 504 and time.monotonic() - t0 < 3
            msg = out["error"]["message"]
            assert msg.startswith("prefill leg failed: timed out after "), msg
            assert "total=0.5s" in msg
            assert out["error"]["type"] == "upstream_timeout"
            await _assert_leg_closed(h.prefill)
            await _assert_leg_closed(h.decode)

    run(body)


@pytest.mark.timeout(30)
def test_decode_500_gives_502_and_cancels_prefill() -> None:
    async def body() -> None:
        async with harness() as h:
            h.prefill.hang = True

            async def fail_after_p(engine: FakeEngine, _: dict[str, Any]) -> None:
                await h.prefill.got_request.wait()

            h.decode.on_receive = fail_after_p
            h.decode.status = 503
            status, out, _ = await h.post("/v1/completions", {"prompt": "a", "stream": True})
            assert status == 502
            assert out["error"]["message"] == "decode leg failed: HTTP 503: decode exploded"
            await _assert_leg_closed(h.prefill)

    run(body)


@pytest.mark.timeout(30)
def test_engine_4xx_is_passed_on_with_its_message() -> None:
    async def body() -> None:
        async with harness() as h:
            h.prefill.status = 400
            h.decode.hang = True
            status, out, _ = await h.post("/v1/completions", {"prompt": "a"})
            assert status == 400
            assert out["error"]["message"] == "prefill leg failed: HTTP 400: prefill exploded"
            assert out["error"]["type"] == "invalid_request_error"
            await _assert_leg_closed(h.decode)

    run(body)


@pytest.mark.timeout(30)
def test_bad_json_from_a_leg_is_502() -> None:
    async def body() -> None:
        async with harness() as h:
            h.prefill.raw_response = b"{not json"
            h.decode.hang = True
            status, out, _ = await h.post("/v1/completions", {"prompt": "a"})
            assert status == 502
            assert out["error"]["message"].startswith("prefill leg failed: response is not JSON")
            await _assert_leg_closed(h.decode)

    run(body)


@pytest.mark.timeout(30)
def test_prefill_failure_mid_stream_sends_sse_error_and_closes_decode() -> None:
    async def body() -> None:
        async with harness() as h:
            h.decode.stream_gate = asyncio.Event()  # never set: D waits after chunk 1

            async def fail_after_first_chunk(engine: FakeEngine, _: dict[str, Any]) -> None:
                await h.decode.first_chunk_sent.wait()

            h.prefill.on_receive = fail_after_first_chunk
            h.prefill.status = 500
            req = {"prompt": "a", "stream": True}
            async with h.client.post(h.url + "/v1/completions", json=req) as resp:
                assert resp.status == 200
                events = [e async for e in sse_events(resp)]
            assert json.loads(events[0])["choices"][0]["text"] == "Hel"
            err = json.loads(events[1])["error"]
            assert err["message"] == "prefill leg failed: HTTP 500: prefill exploded"
            assert events[2:] == ["[DONE]"]
            await _assert_leg_closed(h.decode)

    run(body)


@pytest.mark.timeout(30)
def test_client_disconnect_mid_stream_cancels_both_legs() -> None:
    async def body() -> None:
        async with harness() as h:
            h.prefill.hang = True
            h.decode.stream_gate = asyncio.Event()
            req = {"prompt": "a", "stream": True}
            resp = await h.client.post(h.url + "/v1/completions", json=req)
            first = await asyncio.wait_for(sse_events(resp).__anext__(), WAIT)
            assert json.loads(first)["choices"][0]["text"] == "Hel"
            resp.close()  # the client goes away
            await _assert_leg_closed(h.decode)
            await _assert_leg_closed(h.prefill)

    run(body)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_client_disconnect_while_waiting_cancels_legs(mode: str) -> None:
    async def body() -> None:
        async with harness(mode=mode) as h:
            h.prefill.hang = h.decode.hang = True
            task = asyncio.create_task(h.post("/v1/completions", {"prompt": "a"}))
            engines = [h.prefill, h.decode] if mode == "push" else [h.prefill]
            for engine in engines:
                await asyncio.wait_for(engine.got_request.wait(), WAIT)
            task.cancel()  # the client gives up and closes its connection
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for engine in engines:
                await _assert_leg_closed(engine)
            if mode == "pull":
                assert h.decode.received == []

    run(body)


# ---------------------------------------------------------------- validation, health, models


@pytest.mark.timeout(30)
def test_leg_bodies_leave_the_client_body_as_it_came() -> None:
    """The legs share the client's nested values (no deep copy): building all four
    bodies, and changing each leg's own kv_transfer_params after, changes nothing of
    what the client sent, nor another leg's body."""
    client = {
        "model": "m", "stream": True, "max_tokens": 9, "min_tokens": 2,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        "kv_transfer_params": {"from": "client"},
    }  # fmt: skip
    sent = json.loads(json.dumps(client))
    legs = [
        bodies.push_prefill_body(client, "t1"),
        bodies.push_decode_body(client, P_COORDS, "t1"),
        bodies.pull_prefill_body(client),
        bodies.pull_decode_body(client, PULL_KV),
    ]
    for leg in legs:
        leg["kv_transfer_params"]["mark"] = True
    assert client == sent
    assert [leg["max_tokens"] for leg in legs] == [1, 9, 1, 9]
    assert "stream_options" not in legs[0] and legs[1]["stream_options"] == sent["stream_options"]
    assert legs[1]["messages"] == sent["messages"]
    assert PULL_KV.get("mark") is None and "mark" not in client["kv_transfer_params"]


def test_bad_client_bodies_get_4xx() -> None:
    async def body() -> None:
        async with harness(max_request_bytes=1024) as h:
            cases = [
                (b"{bad", 400, "not valid JSON"),
                (b"", 400, "empty"),
                (b"[1, 2]", 400, "JSON object"),
                (b'{"prompt": "a", "stream": "yes"}', 400, "'stream'"),
                (b'{"prompt": "' + b"a" * 2048 + b'"}', 413, "too large"),
            ]
            for raw, want, words in cases:
                status, out, _ = await h.post("/v1/completions", raw)
                assert status == want, (raw[:20], out)
                assert words in out["error"]["message"]
                assert out["error"]["code"] == want
            assert h.prefill.received == [] and h.decode.received == []

    run(body)


@pytest.mark.timeout(30)
def test_models_forwarded_to_decode() -> None:
    async def body() -> None:
        async with harness(forward_authorization=True) as h:
            hdrs = {"Authorization": "Bearer k"}
            async with h.client.get(h.url + "/v1/models", headers=hdrs) as resp:
                out = await resp.json()
            assert resp.status == 200 and out["data"] == [{"id": "tiny"}]
            assert out["auth"] == "Bearer k"

    run(body)


@pytest.mark.timeout(30)
def test_one_info_line_per_request_with_legs() -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("vllm.ext.proxy")
    handler, old_level = Keep(level=logging.INFO), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)

    async def body() -> None:
        async with harness() as h:
            await h.post("/v1/completions", {"prompt": "a"}, {"X-Request-Id": "log-me"})
            for _ in range(100):
                if records:
                    break
                await asyncio.sleep(0.02)

    try:
        run(body)
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
    lines = [r.getMessage() for r in records if "log-me" in r.getMessage()]
    assert len(lines) == 1 and records[0].levelno == logging.INFO
    line = lines[0]
    assert "mode=push" in line and "status=200" in line
    assert "prefill=200/" in line and "decode=200/" in line and "total=" in line


# ---------------------------------------------------------------- config and CLI


def test_cli_config_and_defaults() -> None:
    args = build_parser().parse_args(
        ["--prefill", "http://127.0.0.1:8100/", "--decode", "http://127.0.0.1:8200"]
        + ["--p-engine-id", "P0", "--p-side-channel-port", "5601", "--p-tp-size", "2"]
        + ["--prefill-timeout", "0"]
    )
    cfg = config_from_args(args)
    assert cfg.mode == "push" and cfg.host == "127.0.0.1" and cfg.port == 8000
    assert cfg.prefill_url == "http://127.0.0.1:8100"
    assert cfg.prefill == PrefillCoordinates("P0", "127.0.0.1", 5601, 2, 1)
    assert cfg.prefill_timeouts.total is None
    with pytest.raises(SystemExit) as exc:
        main(["--prefill", "http://a:1", "--decode", "http://b:2", "--mode", "push"])
    assert exc.value.code == 2
    pull = config_from_args(
        build_parser().parse_args(
            ["--prefill", "http://a:1", "--decode", "http://b:2"]
            + [
                "--mode",
                "pull",
            ]
        )
    )
    assert pull.prefill is None
    with pytest.raises(ValueError):
        ProxyConfig(prefill_url="a:1", decode_url="http://b:2", mode="pull")


def test_event_loop_choice() -> None:
    """``--event-loop``: Python's own loop by default, uvloop's on request."""
    uvloop = pytest.importorskip("uvloop")
    assert build_parser().parse_args(["--decode", "http://b:2"]).event_loop == "asyncio"
    for kind, cls in (("asyncio", asyncio.BaseEventLoop), ("uvloop", uvloop.Loop)):
        loop = new_event_loop(kind)
        try:
            assert isinstance(loop, cls), kind
            assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
        finally:
            loop.close()


def test_cli_process_serves_push() -> None:
    """``python -m vllm_ext.proxy`` as a real process, in front of the fake engines."""

    async def body() -> None:
        p, d = FakeEngine("prefill"), FakeEngine("decode")
        runners = [web.AppRunner(e.app(), handler_cancellation=True) for e in (p, d)]
        p_port, d_port = [await serve(r) for r in runners]
        port = free_port()
        cmd = [sys.executable, "-m", "vllm_ext.proxy"]
        cmd += ["--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}"]
        cmd += ["--p-engine-id", "P9", "--p-side-channel-port", "5609", "--port", str(port)]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = await asyncio.create_subprocess_exec(
            *cmd, cwd=REPO, env=env, stderr=asyncio.subprocess.PIPE
        )
        try:
            async with aiohttp.ClientSession() as client:
                for _ in range(200):
                    with contextlib.suppress(aiohttp.ClientError):
                        async with client.get(f"http://127.0.0.1:{port}/health") as hr:
                            if hr.status == 200:
                                break
                    assert proc.returncode is None, "proxy exited"
                    await asyncio.sleep(0.05)
                url = f"http://127.0.0.1:{port}/v1/completions"
                async with client.post(url, json={"prompt": "a"}) as resp:
                    assert resp.status == 200
            assert d.received[0].body["kv_transfer_params"]["remote_engine_id"] == "P9"
            assert d.received[0].body["kv_transfer_params"]["remote_port"] == 5609
        finally:
            proc.terminate()
            _, err = await asyncio.wait_for(proc.communicate(), WAIT)
            for r in runners:
                await r.cleanup()
        assert b"request_id=cmpl-" in err and b"mode=push" in err

    run(body)
