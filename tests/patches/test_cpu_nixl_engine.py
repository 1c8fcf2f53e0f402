# SPDX-License-Identifier: Apache-2.0
"""A real vLLM 0.23.0 engine with its own pull NixlConnector on CPU (patched env).

* 0003: the engine registers the CPU KV cache with NIXL and serves completions (the
  released 0.23.0 fails at registration: see test_patch_series.py, which runs the
  patch's test against an unpatched overlay and checks for that error).
* 0002: the handshake metadata served on its side channel carries ``region_members``.
* 0004: a NIXL agent in this process sends the engine every kind of malformed
  notification; the engine counts and drops them and keeps serving.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
import zmq

from devkit.launch.engine import SERVED_MODEL_NAME, EngineSpec, start_engine

MALFORMED = [b"", b"\xff\xfe:1", b"no-separator", b":1", b"cmpl-x:zero", b"cmpl-x:0",
             b"cmpl-unknown-1:1"]  # fmt: skip


def _complete(url: str, prompt: str) -> dict:
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _handshake_metadata(port: int):
    """Fetch and decode rank 0's metadata exactly as a decode worker's handshake does."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        GET_META_MSG,
        NixlAgentMetadata,
        NixlHandshakePayload,
    )

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 10000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(msgspec.msgpack.encode((GET_META_MSG, 0)))
        payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(sock.recv())
    finally:
        ctx.destroy(linger=0)
    return msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)


def _dropped_counter(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    values = re.findall(r"^vllm:nixl_num_dropped_notifications_total\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(v) for v in values)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pull_nixl_connector_on_cpu(tiny_model: Path, tmp_path: Path) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    spec = EngineSpec(
        name="nixl-producer",
        model=str(tiny_model),
        max_model_len=2048,
        kv_transfer_config={
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer",
            "kv_buffer_device": "cpu",
        },
    )
    engine = start_engine(spec, tmp_path)
    agent = remote = None
    try:
        engine.wait_ready()
        first = _complete(engine.url, "The prefill cache of the decode block")
        assert first["usage"]["completion_tokens"] == 4
        log = engine.proc.log_path.read_text(errors="replace")
        assert "Registering KV_Caches" in log
        assert "same number of blocks" not in log

        metadata = _handshake_metadata(spec.side_channel_port)
        assert metadata.attn_backend_name == "CPU_ATTN"
        layers = [[f"model.layers.{i}.self_attn.attn"] for i in range(4)]
        assert metadata.region_members == layers  # one region per layer on CPU
        assert len(metadata.kv_caches_base_addr) == len(layers)

        agent = nixl_agent("malformed-notif-sender", nixl_agent_config(backends=["UCX"]))
        remote = agent.add_remote_agent(metadata.agent_metadata)
        for notif in MALFORMED:
            agent.send_notif(remote, notif)

        # Engine steps run get_finished -> _get_new_notifs; completions drive them.
        deadline = time.monotonic() + 60
        while _dropped_counter(engine.url) < len(MALFORMED):
            assert time.monotonic() < deadline, engine.proc.log_tail()
            _complete(engine.url, "A block of the decode cache")
            time.sleep(0.5)
        assert _dropped_counter(engine.url) == len(MALFORMED)

        log = engine.proc.log_path.read_text(errors="replace")
        assert "malformed or unexpected NIXL notification" in log
        assert "Traceback" not in log and "EngineCore encountered" not in log
        again = _complete(engine.url, "The prefill cache of the decode block")
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert engine.proc.alive()
    finally:
        if agent is not None and remote is not None:
            agent.remove_remote_agent(remote)
        engine.stop()
    assert not engine.proc.alive()
