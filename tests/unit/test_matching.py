# SPDX-License-Identifier: Apache-2.0
"""The rendezvous tables and the id rules (S-WRT-4)."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_ext.nixl_push.matching import (
    RANDOM_SUFFIX_LEN,
    RECENTLY_EVICTED_MAX,
    UNVERIFIED_CANCELS_MAX,
    Match,
    RegResult,
    RegWhere,
    Rendezvous,
    base_request_id,
    sub_request_of,
)
from vllm_ext.nixl_push.messages import KvFinal
from vllm_ext.nixl_push.send_lifecycle import PushSend
from vllm_ext.nixl_push.wire import PromptKey, PushRegistration

D_AGENT = "d-agent-0"


def reg(rid: str, tid: str | None = None, rank: int = 0, tp: int = 1) -> PushRegistration:
    return PushRegistration(
        engine_id="D", request_id=rid, transfer_id=tid, block_ids=((1, 2),), tp_rank=rank,
        tp_size=tp, host="127.0.0.1", port=1, block_size=16,
    )  # fmt: skip


def fin(rid: str, tid: str | None = None) -> PushSend:
    return PushSend.of(KvFinal(rid, ((7, 8),), tid), now=0.0)


def add(rv: Rendezvous, r: PushRegistration, sender: str = D_AGENT, now: float = 0.0):  # type: ignore[no-untyped-def]
    return rv.add_registration(r, sender, now)


def test_base_request_id() -> None:
    suffix = "1a2b3c4d"
    assert len(suffix) == RANDOM_SUFFIX_LEN
    assert base_request_id(f"cmpl-abc-0-{suffix}") == "cmpl-abc-0"
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
        ("cmpl-r-0-aaaaaaaa", "cmpl-r-0-bbbbbbbb", None, None, "base_id"),
        ("cmpl-r-0-aaaaaaaa", "cmpl-r-0-bbbbbbbb", None, "T", "base_id"),
    ],
)
def test_rules_both_arrival_orders(reg_first, p_id, d_id, p_tid, d_tid, rule) -> None:
    rv = Rendezvous(p_tp_size=1)
    if reg_first:
        assert add(rv, reg(d_id, d_tid)).result is RegResult.STORED
        assert rv.has_unmatched_finished is False
        (m,) = rv.add_finished(fin(p_id, p_tid))
    else:
        assert rv.add_finished(fin(p_id, p_tid)) == []
        assert rv.has_unmatched_finished
        out = add(rv, reg(d_id, d_tid))
        assert out.result is RegResult.MATCHED and out.match is not None
        m = out.match
    assert isinstance(m, Match) and m.rule == rule and m.sender == D_AGENT
    assert m.send.request_id == p_id and m.registration.request_id == d_id
    assert not rv.has_unmatched_finished
    assert rv.evict(p_id, now=1.0) is not None and rv.is_empty()


def test_different_transfer_ids_never_match() -> None:
    rv = Rendezvous(1)
    add(rv, reg("cmpl-r-0-bbbbbbbb", "T2"))
    assert rv.add_finished(fin("cmpl-r-0-aaaaaaaa", "T1")) == []


@pytest.mark.parametrize("p_tid", ["T", "p-answer-0123"])
@pytest.mark.parametrize("reg_first", [True, False])
def test_a_p_request_with_a_transfer_id_serves_no_registration_without_it(
    reg_first: bool, p_tid: str
) -> None:
    """The transfer id both legs carried (the proxy's, or the one P made and answered)
    is what proves a registration belongs to the request: a PUSH_REG that names the
    request's ids without it (any NIXL peer can send one) is never served (before: it
    matched by request id, and P wrote the KV into the blocks it named)."""
    rv = Rendezvous(1)
    for d_tid in (None, "T-other"):
        if reg_first:
            assert add(rv, reg("cmpl-r-0", d_tid)).result is RegResult.STORED
            assert rv.add_finished(fin("cmpl-r-0", p_tid)) == []
        else:
            rv.add_finished(fin("cmpl-r-0", p_tid))
            assert add(rv, reg("cmpl-r-0", d_tid)).result is RegResult.STORED
        rv = Rendezvous(1)


def _with_prompt(r: PushRegistration, tokens: list[int]) -> PushRegistration:
    return dataclasses.replace(r, prompt=PromptKey.of(tokens))


def _fin_prompt(rid: str, tid: str | None, tokens: list[int]) -> PushSend:
    return PushSend.of(KvFinal(rid, ((7, 8),), tid, prompt=PromptKey.of(tokens)), 0.0)


@pytest.mark.parametrize("reg_first", [True, False])
def test_a_registration_for_another_prompt_is_refused(reg_first: bool) -> None:
    """S-WRT-7: ids that collide (two bodies under one X-Request-Id) meet, but the
    prompts differ: nothing is served and the registration is refused (D is told),
    whichever arrives first; the same prompt under the same ids is served."""
    rv = Rendezvous(1)
    d = _with_prompt(reg("cmpl-r-0-bbbbbbbb", "T"), [1, 2, 3])
    p = _fin_prompt("cmpl-r-0-aaaaaaaa", "T", [1, 2, 4])
    if reg_first:
        assert add(rv, d).result is RegResult.STORED
        assert rv.add_finished(p) == []
        (refused,) = rv.take_refused()
        assert refused.registration is d and rv.take_refused() == []
    else:
        assert rv.add_finished(p) == []
        assert add(rv, d).result is RegResult.MISMATCHED
    assert rv.find_registration(("D", "cmpl-r-0-bbbbbbbb", 0))[0] is RegWhere.UNKNOWN
    rv2 = Rendezvous(1)
    add(rv2, _with_prompt(reg("cmpl-r-0-bbbbbbbb", "T"), [1, 2, 3]))
    (m,) = rv2.add_finished(_fin_prompt("cmpl-r-0-aaaaaaaa", "T", [1, 2, 3]))
    assert m.rule == "transfer_id"


def test_multi_prompt_sub_requests_stay_distinct() -> None:
    rv = Rendezvous(1)
    add(rv, reg("cmpl-r-1-bbbbbbbb"))
    add(rv, reg("cmpl-r-0-cccccccc"))
    (m0,) = rv.add_finished(fin("cmpl-r-0-aaaaaaaa"))
    (m1,) = rv.add_finished(fin("cmpl-r-1-dddddddd"))
    assert m0.registration.request_id == "cmpl-r-0-cccccccc"
    assert m1.registration.request_id == "cmpl-r-1-bbbbbbbb"


@pytest.mark.parametrize("reg_first", [True, False])
@pytest.mark.parametrize(
    "ids",
    [
        # a completion with four prompts: vLLM's sub-requests "<id>-<i>", one transfer id
        [f"cmpl-r-{i}" for i in range(4)],
        # n = 3: vLLM's children "<i>_<id>", one transfer id
        [f"{i}_cmpl-r-0" for i in range(3)],
        # both at once: two prompts, n = 2
        [f"{c}_cmpl-r-{i}" for i in range(2) for c in range(2)],
    ],
)
def test_sub_requests_of_one_body_match_their_own_twin_by_transfer_id(reg_first, ids) -> None:
    """The proxy gives one transfer id to a whole client body and vLLM splits it into
    sub-requests that all carry it: each of P's sub-requests must meet the D
    sub-request in the same place of the body, and every one must be served (before,
    P's sub-request 0 met D's sub-request 1 (wrong KV, HTTP 200) and D's sub-request 0
    was then dropped as a duplicate)."""
    rv = Rendezvous(1)
    d_ids = [f"{i}-bbbbbbbb" for i in ids]
    p_ids = [f"{i}-aaaaaaaa" for i in ids]
    matches: list[Match] = []
    if reg_first:
        for d in reversed(d_ids):  # arrival order other than the body's
            assert add(rv, reg(d, "T")).result is RegResult.STORED
        for p in p_ids:
            matches += rv.add_finished(fin(p, "T"))
    else:
        for p in p_ids:
            assert rv.add_finished(fin(p, "T")) == []
        for d in reversed(d_ids):
            out = add(rv, reg(d, "T"))
            assert out.result is RegResult.MATCHED and out.match is not None
            matches.append(out.match)
    pairs = {m.send.request_id: m.registration.request_id for m in matches}
    assert pairs == dict(zip(p_ids, d_ids))
    assert {m.rule for m in matches} == {"transfer_id"}


def test_sub_request_of() -> None:
    assert sub_request_of("cmpl-x-1-1a2b3c4d") == "/1"
    assert sub_request_of("2_cmpl-x-0-1a2b3c4d") == "2/0"
    assert sub_request_of("chatcmpl-x-1a2b3c4d") == "/"
    assert sub_request_of("3_chatcmpl-x") == "3/"


def test_duplicates_are_idempotent() -> None:
    rv = Rendezvous(1)
    r = reg("cmpl-r-0-bbbbbbbb")
    assert add(rv, r).result is RegResult.STORED
    assert add(rv, dataclasses.replace(r)).result is RegResult.DUPLICATE  # pending duplicate
    assert len(rv.add_finished(fin("cmpl-r-0-aaaaaaaa"))) == 1
    assert add(rv, r).result is RegResult.DUPLICATE  # duplicate of a served registration
    with pytest.raises(ValueError):
        rv.add_finished(fin("cmpl-r-0-aaaaaaaa"))  # the writer checks before


def test_the_same_key_from_another_agent_is_foreign() -> None:
    rv = Rendezvous(1)
    r = reg("cmpl-r-0-bbbbbbbb")
    assert add(rv, r).result is RegResult.STORED
    assert add(rv, r, sender="someone-else").result is RegResult.FOREIGN
    assert rv.find_registration(("D", r.request_id, 0)) == (RegWhere.PENDING, D_AGENT)


def test_registrations_after_eviction_are_answered_at_once() -> None:
    """A repeat of a served registration is a duplicate; one that P never served is late."""
    rv = Rendezvous(1, gone_ttl=10.0)
    served = reg("cmpl-r-0-bbbbbbbb", rank=0, tp=2)
    rv.add_finished(fin("cmpl-r-0-aaaaaaaa"))
    assert add(rv, served).result is RegResult.MATCHED
    rv.evict("cmpl-r-0-aaaaaaaa", now=1.0)
    assert add(rv, served, now=2.0).result is RegResult.DUPLICATE
    other_rank = reg("cmpl-r-0-bbbbbbbb", rank=1, tp=2)
    assert add(rv, other_rank, now=2.0).result is RegResult.LATE
    assert rv.is_empty()  # neither was stored
    # Different transfer ids never match, evicted or not.
    rv.add_finished(fin("cmpl-t-0-aaaaaaaa", "T1"))
    rv.evict("cmpl-t-0-aaaaaaaa", now=1.0)
    assert add(rv, reg("cmpl-t-0-bbbbbbbb", "T2"), now=2.0).result is RegResult.STORED
    # Forgotten after gone_ttl: a registration waits again.
    rv.expire(now=20.0, ttl=lambda _r: 100.0)
    assert add(rv, other_rank, now=20.0).result is RegResult.STORED


def test_the_memory_of_evicted_requests_is_bounded() -> None:
    rv = Rendezvous(1)
    for i in range(RECENTLY_EVICTED_MAX + 10):
        rv.add_finished(fin(f"cmpl-g{i}-0-aaaaaaaa"))
        rv.evict(f"cmpl-g{i}-0-aaaaaaaa", now=0.0)
    assert len(rv._gone) == RECENTLY_EVICTED_MAX
    assert add(rv, reg("cmpl-g0-0-bbbbbbbb")).result is RegResult.STORED  # forgotten
    assert add(rv, reg("cmpl-g20-0-bbbbbbbb")).result is RegResult.LATE


def test_live_requests_mark_the_registrations_they_will_serve() -> None:
    rv = Rendezvous(1)
    add(rv, reg("cmpl-l-0-bbbbbbbb", "T"))
    add(rv, reg("cmpl-m-0-bbbbbbbb", "T2"))
    assert list(rv.awaited()) == []  # P merely holds them
    rv.add_live("cmpl-l-0-aaaaaaaa", "T")
    rv.add_live("cmpl-m-0-aaaaaaaa", "other")  # base id matches, transfer ids do not
    assert [p.registration.request_id for p in rv.awaited()] == ["cmpl-l-0-bbbbbbbb"]
    rv.drop_live("cmpl-l-0-aaaaaaaa")
    assert list(rv.awaited()) == []


def test_fan_out_to_several_d_ranks() -> None:
    rv = Rendezvous(p_tp_size=1)
    assert rv.add_finished(fin("cmpl-r-0-aaaaaaaa")) == []
    m0 = add(rv, reg("cmpl-r-0-bbbbbbbb", rank=0, tp=2)).match
    assert m0 is not None and not m0.send.complete
    assert rv.has_unmatched_finished  # rank 1 still expected
    m1 = add(rv, reg("cmpl-r-0-bbbbbbbb", rank=1, tp=2)).match
    assert m1 is not None and m1.send.complete
    assert not rv.has_unmatched_finished


def test_expiry_drops_only_old_registrations() -> None:
    rv = Rendezvous(1)
    add(rv, reg("a-0"), now=0.0)
    add(rv, reg("b-0"), now=5.0)
    expired = rv.expire(now=10.0, ttl=lambda _r: 7.0)
    assert [p.registration.request_id for p in expired] == ["a-0"]
    assert [r.request_id for r in rv.pending_registrations()] == ["b-0"]
    rv.expire(now=100.0, ttl=lambda _r: 7.0)
    assert rv.is_empty()


def test_expiry_looks_over_the_registrations_when_the_first_is_due() -> None:
    """The waiting registrations are not looked over at every writer pass, yet each is
    dropped at the first pass after its TTL, also one stored after the last look."""
    rv = Rendezvous(1)
    ttls = {"a-0": 7.0, "b-0": 0.1}

    def ttl(r: PushRegistration) -> float:
        return ttls[r.request_id]

    def expired(now: float) -> list[str]:
        return [p.registration.request_id for p in rv.expire(now, ttl)]

    rv.add_registration(reg("a-0"), D_AGENT, now=0.0, ttl_s=ttl(reg("a-0")))
    assert expired(1.0) == []  # looked over: next at 1.0 + REG_EXPIRY_SCAN_S at the latest
    rv.add_registration(reg("b-0"), D_AGENT, now=1.05, ttl_s=ttl(reg("b-0")))  # due 1.15
    assert expired(1.2) == ["b-0"]
    assert expired(6.9) == []
    assert expired(7.1) == ["a-0"]


def test_tombstones_of_unverified_cancels_are_capped_and_those_of_d_agents_are_not() -> None:
    """Any peer may send a PUSH_CANCEL naming any engine: P keeps at most
    UNVERIFIED_CANCELS_MAX tombstones of those (a flood cannot grow P). A D agent's own
    cancels are all kept for the TTL (forgetting one early would let a delayed PUSH_REG
    of it be served into blocks D reused); both kinds end with the TTL."""
    r = Rendezvous(p_tp_size=1, gone_ttl=480.0)
    n = UNVERIFIED_CANCELS_MAX + 100
    for i in range(n):
        r.remember_cancelled(("X", f"x-{i}", 0), "anyone", now=0.0, verified=False)
        r.remember_cancelled(("D", f"d-{i}", 0), "agent-D", now=0.0, verified=True)
    assert r.tombstones() == UNVERIFIED_CANCELS_MAX + n
    assert add(r, reg("d-0"), sender="agent-D", now=1.0).result is RegResult.CANCELLED
    r.expire(now=481.0, ttl=lambda reg: 1.0)
    assert r.tombstones() == 0


def test_another_d_request_of_a_served_engine_and_rank_is_taken_not_a_duplicate() -> None:
    """A P request serves one registration per D engine and rank. A second D request of
    that engine and rank whose ids meet it (a repeated X-Request-Id, a reused transfer id)
    is not a repeat of the first: it is answered at once (TAKEN, D fails it) instead of
    dropped as DUPLICATE, which left it waiting for D's watchdog (480 s)."""
    rv = Rendezvous(p_tp_size=1)
    rv.add_finished(fin("cmpl-r-0-aaaaaaaa", "T"))
    first = reg("cmpl-r-0-bbbbbbbb", "T")
    assert add(rv, first).result is RegResult.MATCHED
    assert add(rv, first).result is RegResult.DUPLICATE  # the same registration again
    assert add(rv, reg("cmpl-r-0-cccccccc", "T")).result is RegResult.TAKEN
