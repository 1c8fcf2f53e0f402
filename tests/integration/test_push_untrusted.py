# SPDX-License-Identifier: Apache-2.0
"""Untrusted input never stops a writer or an engine (S-WIR-1, S-WIR-2, S-LEG-2).

Malformed notifications are injected into the real agents of running
workers through the fake fabric; malformed ``kv_transfer_params`` go through
vLLM's real Scheduler.
"""

from __future__ import annotations

import functools
from typing import Any

import msgpack
import msgspec
import pytest
import zmq
from push_harness import (
    Engine,
    PushEnv,
    assert_kv_pushed,
    block_pairs,
    capture_logs,
    held_finished,
    notifs,
    pending_regs,
    wait_until,
)
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.wire import MAX_NOTIF_BYTES, PUSH_REG_PREFIX, PushFailed


def _prompt(seed: int, n: int = 24) -> list[int]:
    return [(seed * 97 + i * 13) % 1000 + 3 for i in range(n)]


def _push_one(env: PushEnv, tag: str, **d_override: Any) -> None:
    """One more request pair pushes fine (the writers are alive and well)."""
    p, d = env.engines[0], env.engines[1]
    prompt = _prompt(sum(map(ord, tag)))
    d_id, p_id = f"cmpl-{tag}-0-bbbbbbbb", f"cmpl-{tag}-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(**d_override))
    p.add_request(p_id, prompt, p.p_leg())
    env.run_until(lambda: d_id in d.finished, what=f"push {tag}")
    assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))


def _reg_body(**override: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "v": 1,
        "engine_id": "D",
        "request_id": "cmpl-x-0-bbbbbbbb",
        "transfer_id": None,
        "block_ids": [[1, 2]],
        "tp_rank": 0,
        "tp_size": 1,
        "host": "127.0.0.1",
        "port": 5600,
        "block_size": 16,
        "prefix_tokens": 0,
    }
    body.update(override)
    return {k: v for k, v in body.items() if v is not _DROP}


_DROP = object()


def _reg(**override: Any) -> bytes:
    return PUSH_REG_PREFIX + msgpack.packb(_reg_body(**override), use_bin_type=True)


MALFORMED_PUSH_REG = {
    "not_msgpack": PUSH_REG_PREFIX + b"\xc1\xc1\xc1 definitely not msgpack",
    "truncated": _reg()[:-3],
    "not_a_map": PUSH_REG_PREFIX + msgpack.packb([1, 2, 3]),
    "empty_body": PUSH_REG_PREFIX,
    "wrong_type_tp_rank": _reg(tp_rank="0"),
    "wrong_type_block_ids": _reg(block_ids=[["1", "2"]]),
    "wrong_type_block_ids_flat": _reg(block_ids=[1, 2]),
    "wrong_type_port": _reg(port="5600"),
    "wrong_type_request_id": _reg(request_id=17),
    "wrong_type_bool_as_int": _reg(block_size=True),
    "missing_request_id": _reg(request_id=_DROP),
    "missing_engine_id": _reg(engine_id=_DROP),
    "missing_block_ids": _reg(block_ids=_DROP),
    "missing_version": _reg(v=_DROP),
    "bad_tp_rank": _reg(tp_rank=1, tp_size=1),
    "bad_port": _reg(port=0),
    "negative_block": _reg(block_ids=[[-1]]),
    "empty_request_id": _reg(request_id=""),
    "old_version": _reg(v=0),
}


@pytest.mark.timeout(60)
def test_malformed_push_reg_counted_dropped_writer_keeps_running(env: PushEnv) -> None:
    p, d = env.pair()
    p_w = p.workers[0]
    sender = d.agents[0].name
    with capture_logs("vllm.ext.nixl_push.context") as logs:
        for raw in MALFORMED_PUSH_REG.values():
            env.fabric.inject_notif(p.agents[0].name, sender, raw)
        n = len(MALFORMED_PUSH_REG)
        env.run_until(lambda: p.totals("push_regs_rejected") == n, what="all rejected")
    assert p.totals("push_notifs_malformed") == n
    assert p.totals("push_regs_received") == 0 and pending_regs(p_w) == 0
    assert p.totals("push_failed_internal") == 0
    assert p_w.writer.alive
    reasons = p_w.drops.counts()
    assert {"bad_msgpack", "bad_type", "missing_field", "bad_value", "bad_version"} <= set(reasons)
    assert sum(reasons.values()) == n
    # Rate-limited: one warning for the whole burst.
    assert sum("malformed notification" in r.getMessage() for r in logs) == 1
    # A forward-compatible registration (unknown keys) is accepted, and a real push works.
    _push_one(env, "after")
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_unknown_fields_are_ignored(env: PushEnv) -> None:
    """A newer D's PUSH_REG (higher version, extra keys) is read as far as understood."""
    p, d = env.pair()
    prompt = _prompt(7)
    p.add_request("cmpl-fc-0-aaaaaaaa", prompt, p.p_leg())
    env.run_until(lambda: held_finished(p.workers[0]) == 1)
    # Let D register for real, then replace the PUSH_REG on the wire by a "v2" one.
    d.add_request("cmpl-fc-0-bbbbbbbb", prompt, p.d_leg())
    env.run_until(lambda: "cmpl-fc-0-bbbbbbbb" in d.finished)
    (sent,) = notifs(env.fabric, PUSH_REG_PREFIX)
    body = msgpack.unpackb(sent.msg[len(PUSH_REG_PREFIX) :], raw=False)
    body.update(v=2, request_id="cmpl-fc-1-bbbbbbbb", future_field={"x": [1, 2]})
    env.fabric.inject_notif(
        p.agents[0].name, d.agents[0].name, PUSH_REG_PREFIX + msgpack.packb(body)
    )
    env.run_until(lambda: pending_regs(p.workers[0]) == 1)
    assert p.totals("push_regs_rejected") == 0 and p.totals("push_regs_received") == 2


@pytest.mark.timeout(60)
def test_duplicate_push_reg_is_idempotent(env: PushEnv) -> None:
    p, d = env.pair()
    prompt = _prompt(11, 40)
    d_id, p_id = "cmpl-dup-0-bbbbbbbb", "cmpl-dup-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg())
    env.run_until(lambda: pending_regs(p.workers[0]) == 1)
    (original,) = notifs(env.fabric, PUSH_REG_PREFIX)
    for _ in range(3):  # a replaying network, a confused peer ...
        env.fabric.inject_notif(p.agents[0].name, original.sender, original.msg)
    env.run_until(lambda: p.totals("push_regs_duplicate") == 3)
    assert pending_regs(p.workers[0]) == 1
    p.add_request(p_id, prompt, p.p_leg())
    env.run_until(lambda: d_id in d.finished)
    env.settle()
    assert p.totals("push_writes") == 1 and len(env.fabric.transfers()) == 1
    assert d.totals("push_completions_received") == 1
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.assert_clean()


def _malformed_notifs(unknown_id: str) -> dict[str, bytes]:
    return {
        "empty": b"",
        "not_utf8": b"\xff\xfe\xfd:1",
        "oversized": b"r" * (MAX_NOTIF_BYTES + 1) + b":1",
        "no_separator": b"just some text",
        "unknown_prefix": b"HELLO",
        "unknown_prefix_colon": b"HELLO:world",
        "non_integer_tp": b"cmpl-x-0-aaaaaaaa:abc",
        "zero_tp": b"cmpl-x-0-aaaaaaaa:0",
        "empty_request_id": b":1",
        "bad_push_fail": b"PUSH_FAIL:\xc1 not msgpack",
        "unknown_request": f"{unknown_id}:1".encode(),
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("side", ["P", "D"])
def test_malformed_notifications_counted_dropped(env: PushEnv, side: str) -> None:
    """S-WIR-2, for every kind, on the producer's and on the consumer's writer."""
    p, d = env.pair()
    target, sender = (p, d) if side == "P" else (d, p)
    bad = _malformed_notifs("cmpl-nobody-0-cccccccc")
    # The sender has completed a handshake with the target (the dangerous case).
    _push_one(env, "first")
    w = target.workers[0]
    before = w.drops.counts()
    for raw in bad.values():
        env.fabric.inject_notif(target.agents[0].name, sender.agents[0].name, raw)
    # A PUSH_FAIL for a request the target does not know is ignored, not an error.
    env.fabric.inject_notif(
        target.agents[0].name,
        sender.agents[0].name,
        PushFailed("cmpl-nobody-1-cccccccc", "made up").encode(),
    )
    n = len(bad)
    wait_until(
        lambda: sum(w.drops.counts().values()) - sum(before.values()) == n,
        step=env.step_all,
        what="every malformed notification counted",
    )
    counts = {k: v - before.get(k, 0) for k, v in w.drops.counts().items()}
    assert counts == {
        "empty": 1,
        "not_utf8": 1,
        "oversized": 1,
        "bad_arity": 3,  # no separator, unknown prefix, empty request id
        "bad_tp": 3,  # "HELLO:world", non-integer, zero
        "bad_msgpack": 1,
        "unknown_request": 1,
    }
    assert w.writer.alive and target.totals("push_failed_internal") == 0
    assert target.totals("push_failed_remote") == 0 and not target.invalid_block_ids
    _push_one(env, "second")
    env.settle()
    env.assert_clean()


# -- S-LEG-2: kv_transfer_params through vLLM's real Scheduler ---------------------------


def _bad_d_legs(p_port: int) -> dict[str, dict[str, Any]]:
    good = {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_host": "127.0.0.1",
        "remote_port": p_port,
        "tp_size": 1,
    }

    def leg(**kw: Any) -> dict[str, Any]:
        out = {**good, **kw}
        return {k: v for k, v in out.items() if v is not _DROP}

    return {
        "port_str": leg(remote_port="abc"),
        "port_range": leg(remote_port=70000),
        "port_bool": leg(remote_port=True),
        "no_host": leg(remote_host=_DROP),
        "host_int": leg(remote_host=127),
        "empty_engine": leg(remote_engine_id=""),
        "engine_list": leg(remote_engine_id=["P"]),
        "no_engine": leg(remote_engine_id=_DROP),
        "tp_zero": leg(tp_size=0),
        "tp_str": leg(tp_size="1"),
        "no_tp": leg(tp_size=_DROP),
        "pp_str": leg(pp_size="x"),
        "tid_int": leg(transfer_id=5),
    }


@pytest.mark.timeout(60)
def test_malformed_kv_transfer_params_fail_only_their_request(env: PushEnv) -> None:
    # P's lease brings the bad P leg's blocks back; it must not end before the good
    # pairs' registrations reach P on a loaded host (0.5 s did once, in a CI run, and
    # P then answered them "P released the KV first", as it should)
    p, d = env.pair(p_kw={"extra_config": {"kv_lease_duration": 3.0}})
    bad = _bad_d_legs(p.port)
    with capture_logs("vllm.ext.nixl_push.scheduler") as logs:
        for i, (name, params) in enumerate(bad.items()):
            d.add_request(f"cmpl-bad-{name}-0-bbbbbbbb", _prompt(100 + i), params, max_tokens=2)
        # A P leg with an ill-typed transfer_id: P finishes it but does not push it.
        p.add_request("cmpl-badp-0-aaaaaaaa", _prompt(50), p.p_leg(transfer_id=["x"]))
        # Good pairs in the same steps.
        for i in range(3):
            d.add_request(f"cmpl-good{i}-0-bbbbbbbb", _prompt(200 + i), p.d_leg(), max_tokens=2)
            p.add_request(f"cmpl-good{i}-0-aaaaaaaa", _prompt(200 + i), p.p_leg())
        wanted = {f"cmpl-bad-{n}-0-bbbbbbbb" for n in bad} | {
            f"cmpl-good{i}-0-bbbbbbbb" for i in range(3)
        }
        env.run_until(lambda: wanted <= set(d.finished), what="every D request finished")
        env.settle()
    for name in bad:
        req = d.finished[f"cmpl-bad-{name}-0-bbbbbbbb"]
        assert req.status == RequestStatus.FINISHED_ERROR, name
    for i in range(3):
        rid = f"cmpl-good{i}-0-bbbbbbbb"
        assert d.finished[rid].status == RequestStatus.FINISHED_LENGTH_CAPPED
        fin, reg = p.finished_meta(f"cmpl-good{i}-0-aaaaaaaa"), d.reg_meta(rid)
        assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    # Every bad request was rejected with an error naming the field; no PUSH_REG for them.
    messages = " ".join(r.getMessage() for r in logs)
    for field in ("remote_port", "remote_host", "remote_engine_id", "tp_size", "pp_size"):
        assert field in messages
    assert "transfer_id" in messages
    assert len(notifs(env.fabric, PUSH_REG_PREFIX)) == 3
    # The bad P leg was not pushed; its blocks came back through the lease.
    assert "cmpl-badp-0-aaaaaaaa" in p.finished_sending
    assert p.totals("push_writes") == 3
    env.assert_clean()


@pytest.mark.timeout(60)
def test_wrong_p_tp_size_in_d_leg_fails_only_that_request(env: PushEnv) -> None:
    """Junk can reach P's side channel, and a D leg may claim P has more TP ranks than it
    has. Only that request fails: P's side channel answers at once and keeps serving
    (vLLM 0.23.0's own listener dies)."""
    p, d = env.pair()
    for junk in (b"\xc1 not msgpack", msgspec.msgpack.encode(["get_meta_msg"]), b""):
        assert _side_channel_query(p.port, junk) == b""
    bad_id = "cmpl-tp-0-bbbbbbbb"
    with capture_logs("vllm.ext.nixl_push.writer") as logs:
        d.add_request(bad_id, _prompt(61), p.d_leg(tp_size=2), max_tokens=2)
        env.run_until(lambda: bad_id in d.finished, what="the bad request fails")
    # Refused from P's announced layout before any rank was queried (not timed out).
    (failure,) = [r.getMessage() for r in logs if bad_id in r.getMessage()]
    assert "announces tensor parallel size 1" in failure
    assert "Resource temporarily unavailable" not in failure
    assert d.finished[bad_id].status == RequestStatus.FINISHED_ERROR
    listener = p.sched._nixl_handshake_listener_t
    assert listener is not None and listener.is_alive(), "P's handshake listener died"
    _push_one(env, "good")
    env.settle()
    env.assert_clean()


def _side_channel_query(port: int, raw: bytes) -> bytes:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 3000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(raw)
        return sock.recv()
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("connected_first", [False, True], ids=["cold", "connected"])
@pytest.mark.parametrize("p_tp,leg_tp", [(2, 1), (1, 2)], ids=["p2-leg1", "p1-leg2"])
def test_p_tp_size_comes_from_ps_handshake_not_the_leg(
    env: PushEnv, p_tp: int, leg_tp: int, connected_first: bool
) -> None:
    """A D leg whose ``tp_size`` disagrees with P's (a proxy not told P's TP) fails that
    request with an error naming both sizes: D takes P's layout from P's handshake. Before,
    a leg saying 1 for a P at TP 2 made D register with P rank 0 only; its completion
    ended the request with half of each block's heads written (wrong output, no error),
    and the connection cached under P's engine id served later legs the same way."""
    p, d = env.pair(p_kw={"tp": p_tp})
    if connected_first:
        _push_one(env, "first")
    bad_id = "cmpl-badtp-0-bbbbbbbb"
    prompt = _prompt(71, 40)
    with capture_logs("vllm.ext.nixl_push.writer") as logs:
        d.add_request(bad_id, prompt, p.d_leg(tp_size=leg_tp), max_tokens=2)
        env.run_until(lambda: bad_id in d.finished, what="the bad request ends")
    assert d.finished[bad_id].status == RequestStatus.FINISHED_ERROR
    (failure,) = [r.getMessage() for r in logs if bad_id in r.getMessage()]
    assert f"tp_size={leg_tp}" in failure and f"tensor parallel size {p_tp}" in failure
    # No cache was poisoned: right legs push every head, before and after.
    _push_one(env, "after")
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_push_reg_claiming_another_d_tp_size_is_never_written(env: PushEnv) -> None:
    """P takes D's TP size from D's handshake too (S-LEG-5): a PUSH_REG from D's own
    agent that says ``tp_size: 2`` for a D at TP 1 gets no WRITE (P would slice its
    heads for two D ranks into one rank's blocks); D is told, and D still gets pushes."""
    from vllm_ext.nixl_push.wire import PromptKey, PushRegistration

    p, d = env.pair(p_kw={"tp": 2})
    _push_one(env, "before")  # P is connected to D (TP 1)
    prompt, d_id = _prompt(83), "cmpl-dtp-0-bbbbbbbb"
    lie = PushRegistration(
        engine_id="D", request_id=d_id, block_ids=((5, 6),), tp_rank=0, tp_size=2,
        host="127.0.0.1", port=d.port, block_size=16, transfer_id="T-dtp",
        prompt=PromptKey.of(prompt), reply_token="t" * 32,
    )  # fmt: skip
    writes_before = len(env.fabric.transfers())
    for agent in p.agents:  # as if each P rank's slice went to a D rank of its own
        env.fabric.inject_notif(agent.name, d.agents[0].name, lie.encode())
    p.add_request("cmpl-dtp-0-aaaaaaaa", prompt, p.p_leg("T-dtp"))
    env.run_until(lambda: p.totals("push_failed_descriptors") >= 1, what="P refuses it")
    assert len(env.fabric.transfers()) == writes_before, "P wrote for a wrong D TP size"
    _push_one(env, "after")
    env.settle()


@pytest.mark.timeout(60)
def test_d_does_not_pair_with_a_p_whose_tcp_user_timeout_is_longer(env: PushEnv) -> None:
    """D gives up a silent P 2 x its own TCP user timeout after its send to P failed
    (N-LIV-1): safe only while P's failed WRITEs stop landing within that (N-REL-2), i.e.
    P's timeout is at most D's. P announces its own in its layout (S-LEG-5), and D
    refuses to pair with a P whose timeout is longer (or unbounded), naming both."""
    p, d = env.pair(p_kw={"extra_config": {"ucx_tcp_user_timeout_s": 45}})
    failure = _d_refuses_p(env, p, d, "cmpl-tcp-0-bbbbbbbb", _prompt(97))
    assert "after 45s, this engine's after 30s" in failure


def _d_refuses_p(env: PushEnv, p: Engine, d: Engine, d_id: str, prompt: list[int]) -> str:
    """D's request ``d_id`` fails at its handshake with ``p`` and leaves no connection
    to P behind; returns the failure D logs."""
    with capture_logs("vllm.ext.nixl_push.writer") as logs:
        d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
        env.run_until(lambda: d_id in d.finished, what="the request fails")
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    (failure,) = [r.getMessage() for r in logs if d_id in r.getMessage()]
    assert not d.workers[0].remote_agents_of(p.engine_id)
    return failure


@pytest.mark.timeout(60)
def test_p_connects_only_to_d_hosts_among_push_peer_hosts(env: PushEnv) -> None:
    """With ``push_peer_hosts`` set, P never connects to a D host outside it, whatever a
    PUSH_REG names (the trust boundary: docs/deploy.md); D's own host inside it is served."""
    allowed = {"extra_config": {"push_peer_hosts": ["127.0.0.0/8"]}}
    p, d = env.pair(p_kw=allowed)
    _push_one(env, "inside")
    from vllm_ext.nixl_push.wire import PushRegistration

    elsewhere = PushRegistration(
        engine_id="D-elsewhere", request_id="cmpl-far-0-bbbbbbbb", block_ids=((1, 2),),
        tp_rank=0, tp_size=1, host="192.0.2.44", port=5600, block_size=16,
    )  # fmt: skip
    env.fabric.inject_notif(p.agents[0].name, "an-agent-elsewhere", elsewhere.encode())
    env.run_until(lambda: p.totals("push_peer_hosts_refused") >= 1, what="P refuses the host")
    assert not p.workers[0].remote_agents_of("D-elsewhere")


@pytest.mark.timeout(60)
def test_d_outside_ps_push_peer_hosts_fails_at_its_handshake(env: PushEnv) -> None:
    """P's push_peer_hosts leaves out D's host: P would refuse to connect to D, and D's
    request would wait for its watchdog (here 300 s). P announces the list in its layout
    (S-LEG-5), so D fails the request at its handshake, naming the list and its host."""
    p, d = env.pair(
        p_kw={"extra_config": {"push_peer_hosts": ["192.0.2.0/24"]}},
        d_kw={"extra_config": {"push_registration_timeout_s": 300}},
    )
    failure = _d_refuses_p(env, p, d, "cmpl-ph-0-bbbbbbbb", _prompt(98))
    assert "push_peer_hosts ['192.0.2.0/24']" in failure and "'127.0.0.1'" in failure
    env.settle()
    assert d.free_blocks() == d.initial_free_blocks
    env.assert_clean()


def _compare_at_recv(
    p: Engine,
    d: Engine,
    pairs: list[tuple[Engine, str, str, int]],
    out: dict[str, str],
    recved: set[str],
) -> None:
    """``d`` reports ``recved`` received: record whether each one's blocks hold the
    KV of its P request, while vLLM still holds them for it."""
    for engine, d_id, p_id, _ in pairs:
        if engine is not d or d_id not in recved:
            continue
        try:
            fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
            assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
            out[d_id] = "P's KV"
        except (AssertionError, KeyError) as e:  # (KeyError: P never handed it over)
            out[d_id] = repr(e)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["registrations_first", "interleaved"])
def test_two_d_engines_under_one_engine_id_never_get_each_others_kv(
    env: PushEnv, order: str
) -> None:
    """A deployment slip: two D engines started with one ``engine_id`` (a constant in a
    shared config). P keys its connections by engine id and takes a proven PUSH_REG
    from a new agent as a restart (S-FLT-1), so it connects to one, then the other,
    until the handshakes prove both live and P refuses the one it does not serve: some
    requests fail, but a WRITE only ever lands in the blocks of the registration it
    answers, on the engine that sent it, and nothing is left: P answers the agents it
    retired (their cancels and registrations), so each D gets every block back into
    vLLM's free pool (before, those cancels were dropped as foreign and that engine kept
    the blocks quarantined while P lived: seen with ``--step-delay-s 0.2``)."""
    fast = {"extra_config": {"push_registration_timeout_s": 8}}
    p = env.engine("P", "kv_producer")
    d1, d2 = env.engine("D", "kv_consumer", **fast), env.engine("D", "kv_consumer", **fast)
    pairs = [((d1, d2)[i % 2], f"cmpl-dup{i}-0-bbbbbbbb", f"cmpl-dup{i}-0-aaaaaaaa", i)
             for i in range(6)]  # fmt: skip
    # D's blocks are compared with P's when D receives them: a served request's blocks
    # go back to D's pool when it ends, and a later WRITE may fill them for another.
    # (P's blocks keep their bytes: no forward pass runs here.)
    kv_at_recv: dict[str, str] = {}
    for d in (d1, d2):
        d.on_recved.append(functools.partial(_compare_at_recv, p, d, pairs, kv_at_recv))
    for d, d_id, p_id, i in pairs:
        d.add_request(d_id, _prompt(200 + i), p.d_leg(f"T{i}"), max_tokens=2)
        if order == "interleaved":
            env.step_all()
            p.add_request(p_id, _prompt(200 + i), p.p_leg(f"T{i}"))
    if order == "registrations_first":
        for _ in range(5):
            env.step_all()
        for _, _, p_id, i in pairs:
            p.add_request(p_id, _prompt(200 + i), p.p_leg(f"T{i}"))
    env.run_until(lambda: all(d_id in d.finished for d, d_id, *_ in pairs), timeout=60)
    served = [
        pair for pair in pairs if pair[0].finished[pair[1]].status != RequestStatus.FINISHED_ERROR
    ]
    assert served, "no request served"
    for _, d_id, _, _ in served:
        assert kv_at_recv.get(d_id) == "P's KV", f"{d_id}: {kv_at_recv.get(d_id, 'never received')}"
    assert p.totals("push_writes") == len(served)
    env.settle(timeout=60)
    for d in (d1, d2):
        assert d.free_blocks() == d.initial_free_blocks, "a D engine kept blocks (quarantined)"
    env.assert_clean()
