# SPDX-License-Identifier: Apache-2.0
"""A foreign NIXL agent that floods an engine with notifications (a fault test tool).

It does what any process that can reach an engine's NIXL side channel can do:
ask for the engine's agent metadata the way a vLLM peer does (ZMQ REQ on
``VLLM_NIXL_SIDE_CHANNEL_PORT``: ``(b"get_meta_msg", rank)`` for vLLM 0.23,
``(b"get_meta_msg", pp_rank, tp_rank)`` for 0.32), add it to its own
``nixl_agent``, and send notifications. No vLLM import: the payloads are decoded as
plain msgpack maps, so the same script serves every connector version.

``python -m devkit.testing.faults.foreign --host H --port P --query 2|3 \\
    --mode flood|forge [--rid R] --out result.json``

* ``flood``: ``--malformed`` malformed messages of every kind (empty, not UTF-8,
  bad msgpack behind every PUSH_* prefix, wrong types, no ``:<tp>``, a 1 MiB blob,
  junk heartbeats), ``--wellformed`` well-formed PUSH_REGs for unknown requests
  naming one fake D engine, ``--engines`` PUSH_REGs naming distinct fake engines
  (each costs the target one handshake attempt to a closed port), and forged
  completions and PUSH_FAILs for unknown requests; then one malformed side-channel
  query and a check that the side channel still answers.
* ``forge``: ``--count`` completions ``<rid>:1`` for a request the target is
  waiting for (a rank that is not the producer claims to have written its KV).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
import uuid
from typing import Any

import msgpack
import zmq


def query_metadata(host: str, port: int, form: int, timeout_ms: int = 5000) -> bytes:
    """The engine's NIXL agent metadata, asked over its side channel as a peer does."""
    msg = msgpack.packb([b"get_meta_msg", 0] if form == 2 else [b"get_meta_msg", 0, 0])
    frames = _ask(host, port, msg, timeout_ms)
    payload = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    inner = payload["agent_metadata_bytes"] if isinstance(payload, dict) else payload[1]
    meta = msgpack.unpackb(inner, raw=False, strict_map_key=False)
    return bytes(meta["agent_metadata"] if isinstance(meta, dict) else meta[1])


def _ask(host: str, port: int, msg: bytes, timeout_ms: int) -> list[bytes]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msg)
        return sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()


def side_channel_alive(host: str, port: int, form: int) -> bool:
    try:
        query_metadata(host, port, form, timeout_ms=5000)
        return True
    except Exception:
        return False


def make_agent() -> tuple[Any, str]:
    from nixl._api import nixl_agent, nixl_agent_config

    from vllm_ext import compat

    name = f"foreign-{uuid.uuid4().hex[:8]}"
    # the engines' NIXL settings: no busy progress thread on a shared core
    with compat.tuned_nixl_agents(100, True, agent_cls=nixl_agent):
        return nixl_agent(name, nixl_agent_config(backends=["UCX"])), name


def malformed_messages(n: int, rng: random.Random) -> list[bytes]:
    kinds = [
        lambda: b"",
        lambda: bytes(rng.randrange(128, 256) for _ in range(rng.randrange(1, 64))),
        lambda: b"PUSH_REG:" + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40))),
        lambda: b"PUSH_REG:" + msgpack.packb([1, 2, 3]),
        lambda: b"PUSH_REG:" + msgpack.packb({"v": 1, "request_id": 7, "block_ids": "x"}),
        lambda: b"PUSH_FAIL:" + bytes(rng.randrange(256) for _ in range(8)),
        lambda: b"PUSH_CANCEL:" + msgpack.packb({"request_id": None}),
        lambda: b"no-colon-here",
        lambda: b"req:notanint",
        lambda: b"req:0",
        lambda: b"HB:" + bytes(rng.randrange(128, 256) for _ in range(16)),
    ]
    out = [kinds[i % len(kinds)]() for i in range(n)]
    out.append(b"X" * (1 << 20))  # one 1 MiB blob
    return out


def push_reg(rid: str, engine_id: str, port: int) -> bytes:
    """A well-formed registration in both our and vLLM 0.32's format (the union of keys)."""
    body = {
        "v": 1, "engine_id": engine_id, "request_id": rid, "transfer_id": uuid.uuid4().hex,
        "block_ids": [[0, 1]], "tp_rank": 0, "tp_size": 1, "host": "127.0.0.1", "port": port,
        "block_size": 128, "prefix_tokens": 0, "timeout_s": 600.0,
        "decode_engine_id": engine_id, "decode_host": "127.0.0.1", "decode_port": port,
        "decode_tp_size": 1, "local_block_ids": [[0, 1]], "remote_engine_id": "nobody",
        "remote_host": "127.0.0.1", "remote_port": port, "remote_tp_size": 1,
        "remote_pp_size": 1,
    }  # fmt: skip
    return b"PUSH_REG:" + msgpack.packb(body, use_bin_type=True)


def flood(agent: Any, target: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    closed_port = args.closed_port
    msgs = malformed_messages(args.malformed, rng)
    msgs += [push_reg(f"ghost-{i}-{uuid.uuid4().hex[:6]}", "ghost-engine", closed_port)
             for i in range(args.wellformed)]  # fmt: skip
    msgs += [push_reg(f"ghost-e{i}", f"ghost-engine-{i}", closed_port) for i in range(args.engines)]
    msgs += [f"cmpl-ghost-{i}-0-{uuid.uuid4().hex[:8]}:1".encode() for i in range(args.wellformed)]
    msgs += [b"PUSH_FAIL:" + msgpack.packb({"v": 1, "request_id": f"ghost-{i}", "reason": "x"})
             for i in range(args.wellformed // 4)]  # fmt: skip
    rng.shuffle(msgs)
    return _send_all(agent, target, msgs)


def _send_all(agent: Any, target: str, msgs: list[bytes]) -> dict[str, Any]:
    sent = errors = 0
    first_error = ""
    t0 = time.monotonic()
    for m in msgs:
        try:
            agent.send_notif(target, m)
            sent += 1
        except Exception as e:
            errors += 1
            first_error = first_error or f"{type(e).__name__}: {e}"
    # let UCX's progress thread push the queue out before the process ends
    time.sleep(2.0)
    return {"sent": sent, "errors": errors, "first_error": first_error,
            "send_s": round(time.monotonic() - t0, 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devkit.testing.faults.foreign")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--query", type=int, choices=(2, 3), default=2)
    p.add_argument("--mode", choices=("flood", "forge"), default="flood")
    p.add_argument("--malformed", type=int, default=2000)
    p.add_argument("--wellformed", type=int, default=500)
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--closed-port", type=int, default=9)
    p.add_argument("--rid", default="")
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    result: dict[str, Any] = {"mode": args.mode, "pid": os.getpid()}
    try:
        meta = query_metadata(args.host, args.port, args.query)
        agent, name = make_agent()
        target = agent.add_remote_agent(meta)
        target = target.decode() if isinstance(target, bytes) else target
        result.update(agent=name, target=target)
        if args.mode == "forge":
            result.update(_send_all(agent, target, [f"{args.rid}:1".encode()] * args.count))
        else:
            result.update(flood(agent, target, args))
            # a query the side channel cannot answer, then: does it still answer?
            with contextlib.suppress(Exception):
                _ask(args.host, args.port, b"\xc1garbage", timeout_ms=2000)
            result["side_channel_alive_after_bad_query"] = side_channel_alive(
                args.host, args.port, args.query
            )
        result["ok"] = True
    except Exception as e:
        result.update(ok=False, error=f"{type(e).__name__}: {e}")
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text, flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
