# SPDX-License-Identifier: Apache-2.0
"""The rendezvous tables and the id rules (S-WRT-4)."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_ext.nixl_push.matching import FinishedBlocks, Match, Rendezvous, base_request_id
from vllm_ext.nixl_push.wire import PushRegistration


def reg(rid: str, tid: str | None = None, rank: int = 0, tp: int = 1) -> PushRegistration:
    return PushRegistration(
        engine_id="D", request_id=rid, transfer_id=tid, block_ids=((1, 2),), tp_rank=rank,
        tp_size=tp, host="127.0.0.1", port=1, block_size=16,
    )  # fmt: skip


def fin(rid: str, tid: str | None = None) -> FinishedBlocks:
    return FinishedBlocks(rid, ((7, 8),), tid)


def test_base_request_id() -> None:
    assert base_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-1-1a2b3c4d") == "cmpl-abc-1"
    assert base_request_id("cmpl-abc-0") == "cmpl-abc-0"  # randomization disabled
    assert base_request_id("chatcmpl-abc-ZZZZZZZZ") == "chatcmpl-abc-ZZZZZZZZ"  # not hex
    assert base_request_id("-1a2b3c4d") == "-1a2b3c4d"


@pytest.mark.parametrize("reg_first", [True, False])
@pytest.mark.parametrize(
    "p_id,d_id,p_tid,d_tid,rule",
    [
        ("cmpl-r-0-aaaaaaaa", "cmpl-r-0-bbbbbbbb", "T", "T", "transfer_id"),
        ("cmpl-r-0", "cmpl-r-0", None, None, "exact"),
        ("cmpl-r-0", "cmpl-r-0", "T", None, "exact"),
        ("cmpl-r-0-aaaaaaaa", "cmpl-r-0-bbbbbbbb", None, None, "base_id"),
        ("cmpl-r-0-aaaaaaaa", "cmpl-r-0-bbbbbbbb", None, "T", "base_id"),
    ],
)
def test_rules_both_arrival_orders(reg_first, p_id, d_id, p_tid, d_tid, rule) -> None:
    rv = Rendezvous(p_tp_size=1)
    if reg_first:
        assert rv.add_registration(reg(d_id, d_tid), 0.0) is None
        assert rv.has_unmatched_finished is False
        matches = rv.add_finished(fin(p_id, p_tid))
        assert isinstance(matches, list) and len(matches) == 1
        m = matches[0]
    else:
        assert rv.add_finished(fin(p_id, p_tid)) == []
        assert rv.has_unmatched_finished
        m = rv.add_registration(reg(d_id, d_tid), 0.0)  # type: ignore[assignment]
    assert isinstance(m, Match) and m.rule == rule
    assert m.finished.request_id == p_id and m.registration.request_id == d_id
    assert not rv.has_unmatched_finished
    assert rv.evict(p_id) is not None and rv.is_empty()


def test_different_transfer_ids_never_match() -> None:
    rv = Rendezvous(1)
    rv.add_registration(reg("cmpl-r-0-bbbbbbbb", "T2"), 0.0)
    assert rv.add_finished(fin("cmpl-r-0-aaaaaaaa", "T1")) == []


def test_multi_prompt_sub_requests_stay_distinct() -> None:
    rv = Rendezvous(1)
    rv.add_registration(reg("cmpl-r-1-bbbbbbbb"), 0.0)
    rv.add_registration(reg("cmpl-r-0-cccccccc"), 0.0)
    (m0,) = rv.add_finished(fin("cmpl-r-0-aaaaaaaa"))  # type: ignore[misc]
    (m1,) = rv.add_finished(fin("cmpl-r-1-dddddddd"))  # type: ignore[misc]
    assert m0.registration.request_id == "cmpl-r-0-cccccccc"
    assert m1.registration.request_id == "cmpl-r-1-bbbbbbbb"


def test_duplicates_are_idempotent() -> None:
    rv = Rendezvous(1)
    r = reg("cmpl-r-0-bbbbbbbb")
    assert rv.add_registration(r, 0.0) is None
    assert rv.add_registration(dataclasses.replace(r), 0.0) is False  # pending duplicate
    assert len(rv.add_finished(fin("cmpl-r-0-aaaaaaaa"))) == 1  # type: ignore[arg-type]
    assert rv.add_registration(r, 0.0) is False  # duplicate of a served registration
    assert rv.add_finished(fin("cmpl-r-0-aaaaaaaa")) is False  # duplicate finished


def test_fan_out_to_several_d_ranks() -> None:
    rv = Rendezvous(p_tp_size=1)
    assert rv.add_finished(fin("cmpl-r-0-aaaaaaaa")) == []
    m0 = rv.add_registration(reg("cmpl-r-0-bbbbbbbb", rank=0, tp=2), 0.0)
    assert isinstance(m0, Match) and not m0.finished.complete
    assert rv.has_unmatched_finished  # rank 1 still expected
    m1 = rv.add_registration(reg("cmpl-r-0-bbbbbbbb", rank=1, tp=2), 0.0)
    assert isinstance(m1, Match) and m1.finished.complete
    assert not rv.has_unmatched_finished


def test_expiry_drops_only_old_registrations() -> None:
    rv = Rendezvous(1)
    rv.add_registration(reg("a-0"), 0.0)
    rv.add_registration(reg("b-0"), 5.0)
    expired = rv.expire_registrations(now=10.0, ttl=7.0)
    assert [r.request_id for r in expired] == ["a-0"]
    assert [r.request_id for r in rv.pending_registrations()] == ["b-0"]
    rv.expire_registrations(now=100.0, ttl=7.0)
    assert rv.is_empty()
