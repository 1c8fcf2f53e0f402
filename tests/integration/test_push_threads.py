# SPDX-License-Identifier: Apache-2.0
"""S-WRT-1: the nixl-push-writer thread is the only caller of the NIXL operations of push
(notifications and WRITEs); vLLM's heartbeats stay on the engine's main thread."""

from __future__ import annotations

import gc
import types
from collections.abc import Iterator
from unittest import mock

import pytest
from push_harness import (
    PushEnv,
    assert_nixl_calls_on_writer,
    assert_self_polls,
    assert_writer_sleeps,
    held_finished,
    notifs,
    pending_regs,
    wait_until,
)
from vllm.v1.request import RequestStatus

from vllm_ext import compat
from vllm_ext.nixl_push.metadata import PushConnectorMetadata


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 3) % 1000 + 3 for i in range(n)]


@pytest.mark.timeout(60)
def test_push_nixl_calls_only_on_the_writer_thread(env: PushEnv) -> None:
    # TP fan-out, so several writers on each side; a short lease on D's side gives
    # a heartbeat every 0.1 s (vLLM's HB: notification, sent by the main thread).
    p, d = env.pair(p_kw={"tp": 1}, d_kw={"tp": 2, "extra_config": {"kv_lease_duration": 0.6}})
    # Requests in both arrival orders and malformed notifications (the failure paths
    # check the same in test_push_failures.py).
    d_ids = []
    for i in range(6):
        p_id, d_id = f"cmpl-th{i}-0-aaaaaaaa", f"cmpl-th{i}-0-bbbbbbbb"
        # remote_request_id makes vLLM's D scheduler heartbeat P's request.
        leg = p.d_leg(remote_request_id=p_id)
        if i % 2:
            d.add_request(d_id, _prompt(i, 20 + 9 * i), leg, max_tokens=2)
            env.step_all()
            p.add_request(p_id, _prompt(i, 20 + 9 * i), p.p_leg())
        else:
            p.add_request(p_id, _prompt(i, 20 + 9 * i), p.p_leg())
            env.step_all()
            d.add_request(d_id, _prompt(i, 20 + 9 * i), leg, max_tokens=2)
        d_ids.append(d_id)
    env.fabric.inject_notif(p.agents[0].name, d.agents[0].name, b"\xff")
    env.fabric.inject_notif(d.agents[1].name, p.agents[0].name, b"nope")
    env.run_until(lambda: all(r in d.finished for r in d_ids))
    # Keep stepping until a heartbeat went out (0.1 s interval) while pushes ran.
    env.run_until(lambda: notifs(env.fabric, b"HB:"), what="a heartbeat")
    env.settle()
    assert all(d.finished[r].status == RequestStatus.FINISHED_LENGTH_CAPPED for r in d_ids)
    checked = assert_nixl_calls_on_writer(env.fabric)
    # The check was not vacuous.
    for method in ("get_new_notifs", "send_notif", "initialize_xfer", "transfer"):
        assert checked[method] > 0, method
    assert checked["check_xfer_state"] >= 6
    env.assert_clean()


@pytest.mark.timeout(60)
def test_wake_model(env: PushEnv) -> None:
    """S-WRT-2: the writer sleeps on its Event; start_load_kv sets it only when it hands
    over work, get_finished always; it polls by itself (1 ms) only while P holds finished
    blocks that no registration matched yet, or WRITEs run, or D awaits the answers to a
    PUSH_REG it sent (D's engine thread never waits for them)."""
    p, d = env.pair()
    assert_writer_sleeps(p)  # idle engines: the writers block
    assert_writer_sleeps(d)

    rank = d.ranks[0]
    with mock.patch.object(rank.worker.writer, "wake", wraps=rank.worker.writer.wake) as wake:
        rank.connector.bind_connector_metadata(PushConnectorMetadata())
        rank.connector.start_load_kv(None)
        assert wake.call_count == 0  # nothing handed over
        rank.connector.get_finished(set())
        assert wake.call_count == 1  # always: inbound notifications
        d.add_request("cmpl-wk-0-bbbbbbbb", [5] * 40, p.d_leg(), max_tokens=2)
        out = d.scheduler.schedule()
        assert isinstance(out.kv_connector_metadata, PushConnectorMetadata)
        assert out.kv_connector_metadata.push_registrations
        rank.connector.bind_connector_metadata(out.kv_connector_metadata)
        rank.connector.start_load_kv(None)
        assert wake.call_count == 2  # a registration handed over
        rank.connector.get_finished(set())
        rank.connector.clear_connector_metadata()
    # (hand the step's output back, as the engine would)
    d.scheduler.update_from_output(out, compat.model_runner_output([]))

    # P holding only a registration does not poll by itself; D, awaiting its answer, does.
    env.run_until(lambda: pending_regs(p.workers[0]) == 1)
    assert_writer_sleeps(p)
    assert_self_polls(d, n=10)
    # P holding finished blocks without a registration does (1 ms period).
    p.add_request("cmpl-other-0-aaaaaaaa", [9] * 40, p.p_leg())
    env.run_until(lambda: held_finished(p.workers[0]) == 1)
    assert_self_polls(p, n=10)
    # Matched and written: back to sleep.
    p.add_request("cmpl-wk-0-aaaaaaaa", [5] * 40, p.p_leg())
    env.run_until(lambda: "cmpl-wk-0-bbbbbbbb" in d.finished)
    wait_until(lambda: held_finished(p.workers[0]) == 1 and p.totals("push_writes") == 1)
    assert_self_polls(p)  # the unmatched "other" request still keeps it polling


def _reachable(root: object, limit: int = 200_000) -> Iterator[object]:
    """Objects reachable from ``root`` by strong references, not following modules,
    classes or module globals (a function's ``__globals__`` leads everywhere)."""
    seen = {id(root)}
    todo = [root]
    while todo and len(seen) < limit:
        obj = todo.pop()
        yield obj
        for ref in gc.get_referents(obj):
            if id(ref) in seen or isinstance(ref, (types.ModuleType, type)):
                continue
            if isinstance(ref, dict) and "__builtins__" in ref:
                continue  # a module's globals
            seen.add(id(ref))
            todo.append(ref)


@pytest.mark.timeout(60)
def test_the_writer_holds_no_reference_to_the_worker(env: PushEnv) -> None:
    """No attribute cycle between the worker and the writer: the writer (its context,
    its sends, its thread) reaches neither the worker nor the connector."""
    p, d = env.pair()
    for w in (*p.workers, *d.workers):
        forbidden = {id(w)}
        for engine in (p, d):
            forbidden |= {id(r.connector) for r in engine.ranks}
        hits = [type(o).__name__ for o in _reachable(w.writer) if id(o) in forbidden]
        assert not hits, f"the writer reaches {hits}"
