# SPDX-License-Identifier: Apache-2.0
"""The push gauges move with what they count, summed over TP ranks (docs/metrics.md).

Two P ranks and two D ranks on the fake NIXL fabric; the levels are read where vLLM
reads them (each rank's ``get_kv_connector_stats``, summed as vLLM's aggregator and
Prometheus sum them) and compared with what is really there: the registrations
waiting at P, the transfers the fabric holds in flight, vLLM's leases on P's blocks
and D's requests waiting for remote KV.
"""

from __future__ import annotations

import functools

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from push_harness import Engine, PushEnv, live_xfer_handles, pending_regs
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.stats import GAUGES, PushPromMetrics


def level(engine: Engine, key: str) -> float:
    """The engine's gauge as vLLM's Prometheus logger exports it, from every step's
    connector stats (``SchedulerStats.kv_connector_stats``: every rank's, aggregated)."""
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = PushPromMetrics(engine.vllm_config, types, ["engine"], {0: ["0"]})
    for data in engine.connector_stats:
        prom.observe(data, 0)
    value = registry.get_sample_value(f"vllm:ext_{key}", {"engine": "0"})
    assert value is not None, key
    return value


def levels(engine: Engine) -> dict[str, float]:
    return {key: level(engine, key) for key in GAUGES}


@pytest.mark.timeout(90)
def test_gauges_follow_a_push_over_two_ranks(env: PushEnv) -> None:
    p, d = env.pair({"tp": 2}, {"tp": 2})
    prompt = [(i * 7) % 1000 + 3 for i in range(40)]
    d_id, p_id = "cmpl-g-0-1111aaaa", "cmpl-g-0-2222bbbb"

    d.add_request(d_id, prompt, p.d_leg("T-g"), max_tokens=2)
    env.run_until(
        lambda: sum(pending_regs(w) for w in p.workers) == 2, what="both registrations wait at P"
    )
    env.step_all()  # one more step: each rank reports what it has now
    assert d.scheduler.requests[d_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert levels(p) == {
        "push_writes_in_flight": 0, "push_regs_pending": 2, "push_recvs_pending": 0,
        "push_leases_held": 0, "push_blocks_quarantined_now": 0,
    }  # fmt: skip
    assert levels(d)["push_recvs_pending"] == 2  # the request, on each D rank

    env.fabric.complete_after_polls = 10**9  # the WRITEs stay in flight
    p.add_request(p_id, prompt, p.p_leg("T-g"))
    env.run_until(lambda: len(live_xfer_handles(env.fabric)) == 2, what="both WRITEs posted")
    env.run_until(lambda: level(p, "push_writes_in_flight") == 2, what="the gauge sees them")
    in_flight = [h for h in live_xfer_handles(env.fabric) if h.state == "PROC"]
    assert len(in_flight) == 2
    assert level(p, "push_regs_pending") == 0
    # P finished the request and keeps its blocks for D on both ranks (vLLM's leases).
    assert p_id in p.finished
    assert level(p, "push_leases_held") == sum(len(w._reqs_to_send) for w in p.workers) == 2
    assert level(d, "push_recvs_pending") == 2

    env.fabric.complete_after_polls = 0
    env.run_until(lambda: d_id in d.finished, what="D request finished")
    env.settle()
    for _ in range(2):
        env.step_all()  # the last changes are reported on the next steps
    assert levels(p) == levels(d) == dict.fromkeys(GAUGES, 0)
    assert p.totals("push_writes") == 2
    env.assert_clean()
