# SPDX-License-Identifier: Apache-2.0
"""What D's per-step hooks were made to do less of keeps its meaning: a D leg is told
apart in one look, a leg's fields are typed as before, the stats clone keeps what was
counted and leaves the live stats empty, and the writer formats an inbox item only to
log an error about it."""

from __future__ import annotations

import functools
import logging
import queue
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_ext.nixl_push.metadata import (
    LegError,
    is_d_leg,
    is_pull_d_leg,
    is_push_d_leg,
    parse_d_leg,
)
from vllm_ext.nixl_push.stats import PushCounters, PushKVConnectorStats
from vllm_ext.nixl_push.writer import PushWriter

LEG = {
    "do_remote_prefill": True, "remote_engine_id": "P0", "remote_host": "127.0.0.1",
    "remote_port": 5601, "tp_size": 2, "transfer_id": "T-1",
}  # fmt: skip


@pytest.mark.parametrize(
    "params",
    [
        None, {}, {"do_remote_prefill": False}, {"do_remote_prefill": None},
        {"do_remote_prefill": True}, {"do_remote_prefill": 1, "remote_block_ids": [1]},
        {"do_remote_prefill": True, "remote_block_ids": None}, {"do_remote_decode": True},
    ],
)  # fmt: skip
def test_a_d_leg_is_push_or_pull(params: dict[str, Any] | None) -> None:
    assert is_d_leg(params) == (is_push_d_leg(params) or is_pull_d_leg(params))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("remote_port", True, "must be int, not bool"),
        ("remote_port", "5601", "must be int, not str"),
        ("remote_port", 5601.0, "must be int, not float"),
        ("tp_size", None, "'tp_size'] is required"),
        ("remote_host", 7, "must be str, not int"),
        ("transfer_id", b"T", "must be str, not bytes"),
    ],
)
def test_a_leg_field_of_another_type_is_refused(key: str, value: Any, message: str) -> None:
    with pytest.raises(LegError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_d_leg({**LEG, key: value})


def test_a_leg_field_of_a_subtype_is_taken() -> None:
    class Port(int):
        pass

    class Host(str):
        pass

    leg = parse_d_leg({**LEG, "remote_port": Port(5601), "remote_host": Host("h")})
    assert (leg.p_port, leg.p_host, leg.p_tp_size, leg.transfer_id) == (5601, "h", 2, "T-1")


def test_the_stats_clone_keeps_what_was_counted_and_the_stats_start_empty() -> None:
    stats = PushKVConnectorStats()
    assert stats.is_empty()
    stats.merge({"push_completions_received": [1, 1], "push_recvs_pending": [2]})
    assert not stats.is_empty()
    stats.record_failed_transfer()
    clone = stats.clone_and_reset()
    assert type(clone) is PushKVConnectorStats and clone.data is not stats.data
    assert clone.data["push_completions_received"] == [1, 1]
    assert clone.data["num_failed_transfers"] == [1] and not clone.is_empty()
    assert stats.is_empty() and "push_completions_received" not in stats.data
    assert stats.data["num_failed_transfers"] == []


def test_a_push_key_counts_only_with_values_and_an_unknown_key_never() -> None:
    stats = PushKVConnectorStats()
    stats.merge({"push_completions_received": []})
    assert stats.is_empty()
    stats.data["not_a_push_key"] = [1]
    assert stats.is_empty()
    stats.merge({"push_regs_sent": [1]})
    assert not stats.is_empty()


class _Item:
    """An inbox item that counts how often it was formatted."""

    def __init__(self) -> None:
        self.formatted = 0

    def __repr__(self) -> str:
        self.formatted += 1
        return "_Item(the-blocks)"


def _writer_stand_in() -> Any:
    w = SimpleNamespace(ctx=SimpleNamespace(counters=PushCounters()))
    w._guarded = functools.partial(PushWriter._guarded, w)
    return w


def test_the_writer_formats_an_item_only_to_log_its_error(caplog: Any) -> None:
    w, q = _writer_stand_in(), queue.SimpleQueue()
    ok, bad = _Item(), _Item()
    q.put(ok)
    PushWriter._drain(w, q, lambda item: None, lambda item: None)
    assert ok.formatted == 0  # handled: never formatted

    def fail(item: _Item) -> None:
        raise RuntimeError("boom")

    settled = []
    q.put(bad)
    with caplog.at_level(logging.ERROR, logger="vllm.ext"):
        PushWriter._drain(w, q, fail, settled.append)
    assert bad.formatted >= 1 and settled == [bad]  # (each log handler formats it)
    assert "unexpected error in _Item _Item(the-blocks)" in caplog.text
    assert w.ctx.counters.totals()["push_failed_internal"] == 1
