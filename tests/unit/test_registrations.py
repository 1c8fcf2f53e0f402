# SPDX-License-Identifier: Apache-2.0
"""``registrations.RegOuts``: the one place a D PUSH_REG changes state keeps the count of
those SENT (the writer loop's O(1) "answers may come" check) exact through every
transition and eviction."""

from __future__ import annotations

import pytest

from vllm_ext.nixl_push.lifecycle import IllegalTransition, RegOut, RegOutState
from vllm_ext.nixl_push.registrations import RegOuts


def _sent_by_scan(t: RegOuts) -> int:
    return sum(out.state is RegOutState.SENT for out in t)


def test_the_sent_count_follows_every_transition_and_eviction() -> None:
    t = RegOuts()
    a, b, c = (t.add(RegOut(rid, None)) for rid in ("a", "b", "c"))
    assert not t.awaiting_answers and len(t) == 3
    t.sent(a, frozenset({"p0"}))
    t.sent(b, frozenset({"p0", "p1"}))
    assert t.awaiting_answers and _sent_by_scan(t) == 2
    assert t.cancel(a) == frozenset({"p0"})  # SENT -> CANCELLED: asks its producers
    assert t.cancel(a) == frozenset()  # cancelled already: nothing to ask
    t.fail(c)  # CONNECTING -> FAILED: never counted
    assert t.awaiting_answers and _sent_by_scan(t) == 1
    t.evict("b")  # evicted while SENT
    t.evict("unknown")
    assert not t.awaiting_answers and _sent_by_scan(t) == 0 and len(t) == 2
    t.evict("a")
    t.evict("c")
    assert len(t) == 0 and not t.awaiting_answers


def test_a_cancelled_unsent_registration_is_never_counted() -> None:
    t = RegOuts()
    out = t.add(RegOut("r", None, RegOutState.CANCELLED))  # the cancel overtook it
    assert t.cancel(out) == frozenset() and not t.awaiting_answers
    with pytest.raises(IllegalTransition):
        t.sent(out, frozenset({"p0"}))  # a CANCELLED one is never sent
    assert not t.awaiting_answers
