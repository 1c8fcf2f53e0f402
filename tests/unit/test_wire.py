# SPDX-License-Identifier: Apache-2.0
"""PUSH_REG and the other notifications: encode, validate, decode (S-WIR-1, S-WIR-2)."""

from __future__ import annotations

import dataclasses
import random

import msgpack
import pytest

from vllm_ext.nixl_push import wire
from vllm_ext.nixl_push.wire import (
    Completion,
    Heartbeat,
    Malformed,
    PushCancel,
    PushFailed,
    PushHeartbeat,
    PushRegistration,
    parse_notif,
)

REG = PushRegistration(
    engine_id="d-engine",
    request_id="cmpl-abc-0-1a2b3c4d",
    transfer_id="t-1",
    block_ids=((3, 4, 5), (9,)),
    tp_rank=1,
    tp_size=2,
    host="127.0.0.1",
    port=5601,
    block_size=128,
    prefix_tokens=256,
)


def _body(**overrides: object) -> bytes:
    body = msgpack.unpackb(REG.encode()[len(wire.PUSH_REG_PREFIX) :])
    for k, v in overrides.items():
        if v is _DEL:
            body.pop(k)
        else:
            body[k] = v
    return wire.PUSH_REG_PREFIX + msgpack.packb(body)


_DEL = object()


def test_round_trip() -> None:
    raw = REG.encode()
    assert raw.startswith(b"PUSH_REG:")  # pinned: the wire format
    assert parse_notif(raw) == REG
    with_heartbeats = dataclasses.replace(REG, timeout_s=30.0, heartbeat_s=2.5)
    assert parse_notif(with_heartbeats.encode()) == with_heartbeats


def test_heartbeat_s_is_optional_and_checked() -> None:
    """An older D sends no ``heartbeat_s`` (P then sends it no PUSH_HB)."""
    assert "heartbeat_s" not in msgpack.unpackb(REG.encode()[len(wire.PUSH_REG_PREFIX) :])
    got = parse_notif(_body())
    assert isinstance(got, PushRegistration) and got.heartbeat_s is None
    for bad in (0, -1, "2", True, float("nan"), float("inf")):
        got = parse_notif(_body(heartbeat_s=bad))
        assert isinstance(got, Malformed) and got.reason == "bad_type", bad


def test_unknown_fields_ignored_and_newer_version_read() -> None:
    assert parse_notif(_body(future_field=[1, 2], v=7)) == REG.__class__(
        **{**REG.__dict__, "version": 7}
    )


def test_optional_fields_may_be_absent() -> None:
    got = parse_notif(_body(transfer_id=_DEL, prefix_tokens=_DEL))
    assert isinstance(got, PushRegistration)
    assert got.transfer_id is None and got.prefix_tokens == 0


@pytest.mark.parametrize(
    "overrides,reason",
    [
        ({"engine_id": _DEL}, "missing_field"),
        ({"request_id": _DEL}, "missing_field"),
        ({"block_ids": _DEL}, "missing_field"),
        ({"tp_rank": _DEL}, "missing_field"),
        ({"v": _DEL}, "missing_field"),
        ({"engine_id": 5}, "bad_type"),
        ({"port": "5601"}, "bad_type"),
        ({"tp_size": True}, "bad_type"),
        ({"block_ids": [[1, "x"]]}, "bad_type"),
        ({"block_ids": [1, 2]}, "bad_type"),
        ({"block_ids": [[-1]]}, "bad_type"),
        ({"transfer_id": 3}, "bad_type"),
        ({"tp_rank": 2}, "bad_value"),
        ({"port": 0}, "bad_value"),
        ({"block_size": 0}, "bad_value"),
        ({"request_id": ""}, "bad_value"),
        ({"v": 0}, "bad_version"),
    ],
)
def test_invalid_registrations_are_rejected_with_a_reason(overrides: dict, reason: str) -> None:
    got = parse_notif(_body(**overrides))
    assert isinstance(got, Malformed)
    assert got.reason == reason, got


@pytest.mark.parametrize(
    "raw,reason",
    [
        (b"", "empty"),
        (b"PUSH_REG:\xc1\xff", "bad_msgpack"),
        (b"PUSH_REG:" + msgpack.packb([1, 2]), "bad_type"),
        (b"\xff\xfe:1", "not_utf8"),
        (b"no-separator", "bad_arity"),
        (b":2", "bad_arity"),
        (b"req:abc", "bad_tp"),
        (b"req:0", "bad_tp"),
        (b"x" * (wire.MAX_NOTIF_BYTES + 1), "oversized"),
        (b"PUSH_FAIL:" + msgpack.packb({"reason": "x"}), "missing_field"),
    ],
)
def test_every_malformed_notification_is_classified_never_raised(raw: bytes, reason: str) -> None:
    got = parse_notif(raw)
    assert isinstance(got, Malformed) and got.reason == reason, got


def test_other_notifications() -> None:
    assert parse_notif(b"cmpl-x-0-abcdef12:2") == Completion("cmpl-x-0-abcdef12", 2)
    assert parse_notif(Completion("a:b", 1).encode()) == Completion("a:b", 1)
    assert parse_notif(b"HB:r1,r2") == Heartbeat("r1,r2")  # pinned: vLLM's format
    assert parse_notif(PushFailed("r", "no").encode()) == PushFailed("r", "no")
    notice = PushFailed("r", "ERR", "tok", landing=True)
    assert parse_notif(notice.encode()) == notice and b"landing" in notice.encode()
    assert b"landing" not in PushFailed("r", "no").encode()  # an older D reads it as before
    hb = PushHeartbeat(("r1", "r2"))
    assert hb.encode().startswith(b"PUSH_HB:") and parse_notif(hb.encode()) == hb
    cancel = PushCancel("D", "r", 0, 2, "h", 5600)
    assert parse_notif(cancel.encode()) == cancel


@pytest.mark.parametrize(
    "body,reason",
    [
        ({"v": 1}, "missing_field"),
        ({"v": 1, "request_ids": "r1"}, "bad_type"),
        ({"v": 1, "request_ids": ["r1", 2]}, "bad_type"),
        ({"v": 1, "request_ids": [""]}, "bad_type"),
    ],
)
def test_bad_heartbeats_are_rejected(body: dict, reason: str) -> None:
    got = parse_notif(wire.PUSH_HB_PREFIX + msgpack.packb(body))
    assert isinstance(got, Malformed) and got.reason == reason, got


_FIELD_VALUES: list[object] = [
    None, True, 0, -1, 1, 2**40, 1.5, float("nan"), "", "x", "²", "\x00", b"\xff",
    [], [[]], [[1, 2]], [["1"]], [1], {}, {"a": 1}, [None],
]  # fmt: skip


def _random_body(rng: random.Random) -> dict:
    """A map of known keys (of every kind of notification) with random values."""
    keys = [
        "v", "engine_id", "request_id", "transfer_id", "block_ids", "tp_rank", "tp_size",
        "host", "port", "block_size", "prefix_tokens", "timeout_s", "heartbeat_s",
        "reason", "request_ids",
    ]  # fmt: skip
    body = {k: rng.choice(_FIELD_VALUES) for k in rng.sample(keys, rng.randrange(len(keys)))}
    if rng.random() < 0.5:  # mostly valid, one field off
        body = {**msgpack.unpackb(REG.encode()[len(wire.PUSH_REG_PREFIX) :]), **body}
    return body


def test_fuzz_never_raises() -> None:
    """Random bytes and random maps after every prefix: always classified, and never by
    the catch-all (``internal``): every way a notification can be wrong has a reason."""
    rng = random.Random(0)
    prefixes = [
        b"", wire.PUSH_REG_PREFIX, wire.PUSH_FAIL_PREFIX, wire.PUSH_CANCEL_PREFIX,
        wire.PUSH_HB_PREFIX, wire.HEARTBEAT_PREFIX, b"req:",
    ]  # fmt: skip
    reasons: set[str] = set()
    for i in range(6000):
        prefix = rng.choice(prefixes)
        if i % 2:
            tail = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        else:
            tail = msgpack.packb(_random_body(rng), use_bin_type=True)
        got = parse_notif(prefix + tail)
        if isinstance(got, Malformed):
            assert got.reason != "internal", (prefix + tail, got)
            reasons.add(got.reason)
    assert {"bad_msgpack", "bad_type", "missing_field", "bad_value"} <= reasons


def test_a_unicode_digit_tp_size_is_malformed_not_an_error() -> None:
    got = parse_notif("req:²".encode())  # "²".isdigit(), but int("²") raises
    assert isinstance(got, Malformed) and got.reason == "bad_tp"


def test_group_starts_round_trip_and_are_checked() -> None:
    """Hybrid KV (S-HYB-1): per KV cache group, the prompt token D's first block of it
    begins at; absent, every group starts at ``prefix_tokens`` (what an older D means)."""
    assert "group_starts" not in msgpack.unpackb(REG.encode()[len(wire.PUSH_REG_PREFIX) :])
    assert REG.start_of(0) == REG.start_of(1) == 256
    hybrid = dataclasses.replace(REG, group_starts=(256, 512))
    got = parse_notif(hybrid.encode())
    assert got == hybrid and isinstance(got, PushRegistration)
    assert (got.start_of(0), got.start_of(1)) == (256, 512)
    for bad in ([256], [256, 128], [256, "512"], [256, True], 3):
        got = parse_notif(_body(group_starts=bad))
        assert isinstance(got, Malformed) and got.reason in ("bad_value", "bad_type"), bad


def test_a_layout_announces_its_kv_cache_groups() -> None:
    groups = (
        ("FullAttentionSpec", 0, ("l.1", "l.3")),
        ("SlidingWindowSpec", 512, ("l.0", "l.2")),
    )
    layout = wire.PeerLayout("P", 2, 1, 5.0, groups)
    assert wire.PeerLayout.decode(layout.encode()) == layout
    body = msgpack.unpackb(layout.encode())
    body.pop("kv_groups")  # an older peer announces none
    assert wire.PeerLayout.decode(msgpack.packb(body)).kv_groups == ()
    for bad in ([["FullAttentionSpec", -1, []]], [["x", 0]], [[1, 0, []]], [["x", 0, [3]]]):
        body["kv_groups"] = bad
        with pytest.raises(wire.WireError):
            wire.PeerLayout.decode(msgpack.packb(body))


def test_a_deferred_prompt_key_equals_the_eager_one_and_ignores_later_changes() -> None:
    """S-WRT-7: the key the engine thread takes (``PromptKey.later``: a copy of the ids,
    the digest computed when first read) is the key of the ids at that moment, from a
    list (vLLM 0.23.0, 0.32.0) or a 32-bit integer array (0.34.0's ``TokenBuffer``) alike,
    and one of a different prompt or extra differs."""
    import array
    import hashlib
    import pickle

    ids = [random.Random(7).randrange(200_000) for _ in range(3000)]
    eager = wire.PromptKey.of(ids, ["mm:a"])
    h = hashlib.blake2b(array.array("q", ids).tobytes() + b"\0mm:a", digest_size=16)
    assert eager == wire.PromptKey(3000, h.hexdigest())  # the format P and D agree on
    as_list, as_array = list(ids), array.array("i", ids)
    from_list = wire.PromptKey.later(as_list, ["mm:a"])
    from_array = wire.PromptKey.later(as_array, ["mm:a"])
    as_list.append(5)  # a streaming session extends the prompt after the key was taken
    as_array.append(5)
    as_list[0] += 1
    assert from_list == eager and from_array == eager
    assert from_list.digest == from_array.digest == eager.digest
    assert pickle.loads(pickle.dumps(wire.PromptKey.later(ids, ["mm:a"]))) == eager
    assert wire.PromptKey.later(array.array("q", ids), ["mm:a"]) == eager
    assert wire.PromptKey.later(ids, ["mm:b"]) != eager
    assert wire.PromptKey.later(ids[:-1] + [ids[-1] + 1], ["mm:a"]) != eager
    assert wire.PromptKey.later(as_list, ["mm:a"]) != eager  # the changed ids: another key
    # what goes on the wire is the digest of the ids as 64-bit integers (a P and a D on
    # different vLLM versions compare the same key)
    reg = dataclasses.replace(REG, prompt=from_array)
    body = msgpack.unpackb(reg.encode()[len(wire.PUSH_REG_PREFIX) :])
    assert (body["prompt_tokens"], body["prompt_digest"]) == (3000, eager.digest)


def test_a_layout_announces_a_producers_peer_hosts() -> None:
    layout = wire.PeerLayout("P", 1, 1, 5.0, peer_hosts=("10.0.0.0/8", "d-host"))
    assert wire.PeerLayout.decode(layout.encode()) == layout
    body = msgpack.unpackb(layout.encode())
    body.pop("peer_hosts")  # an older peer announces none: any host, as before
    assert wire.PeerLayout.decode(msgpack.packb(body)).peer_hosts == ()
    for bad in ("10.0.0.0/8", [""], [3], {"a": 1}):
        body["peer_hosts"] = bad
        with pytest.raises(wire.WireError):
            wire.PeerLayout.decode(msgpack.packb(body))
