# SPDX-License-Identifier: Apache-2.0
"""The diagnostic trace (``devkit.bench.trace_push``) on real connector workers.

The benchmark's ``push-0.23-traced`` mode wraps our worker, writer and NIXL agent to
log each hand-off stage; ``devkit.bench.handoff`` pairs P's and D's events per
request. Both name methods of the connector, so they are checked here against the
connector as it is (real vLLM Schedulers and workers over the fake NIXL fabric), not
against synthetic traces: a renamed method must fail here, not leave a GPU run with
an empty breakdown.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from push_harness import Engine, PushEnv, pending_regs, wait_until

from devkit.bench import handoff
from devkit.bench.trace_push import _Log, instrument_scheduler, instrument_worker


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 53 + i * 13) % 1000 + 3 for i in range(n)]


def _traced(p: Engine, d: Engine, trace: Path) -> None:
    """Trace files named as the traced connector names them (P's engine ids start with
    ``prefill`` in a deployment)."""
    instrument_worker(p.workers[0], _Log(trace / "trace-prefill-P-1-worker.jsonl"))
    instrument_scheduler(p.scheduler.connector, _Log(trace / "trace-prefill-P-1-scheduler.jsonl"))
    instrument_worker(d.workers[0], _Log(trace / "trace-decode-D-2-worker.jsonl"))


def _push(env: PushEnv, p: Engine, d: Engine, tag: str, n: int, register_first: bool) -> str:
    prompt = _prompt(sum(map(ord, tag)), n)  # no prefix shared between tags
    d_id, p_id = f"cmpl-{tag}-0-bbbbbbbb", f"cmpl-{tag}-0-aaaaaaaa"
    if register_first:
        d.add_request(d_id, prompt, p.d_leg(tag), max_tokens=2)
        wait_until(lambda: pending_regs(p.workers[0]) == 1, step=d.engine_step, what="PUSH_REG")
        # P connects to D when the registration arrives; a chunk is written only once
        # connected (a loaded machine may still be handshaking when P's first chunk ends)
        wait_until(lambda: p.workers[0].remote_agents_of("D"), what="P connected to D")
        p.add_request(p_id, prompt, p.p_leg(tag))
    else:
        p.add_request(p_id, prompt, p.p_leg(tag))
        d.add_request(d_id, prompt, p.d_leg(tag), max_tokens=2)
    env.run_until(lambda: d_id in d.finished, what=f"{tag} decoded")
    return d_id


@pytest.mark.timeout(60)
@pytest.mark.parametrize("register_first", [True, False])
def test_every_stage_of_a_whole_write_is_traced(
    env: PushEnv, tmp_path: Path, register_first: bool
) -> None:
    p, d = env.pair()
    _traced(p, d, tmp_path)
    d_ids = [_push(env, p, d, f"w{i}", 40 + 9 * i, register_first) for i in range(2)]
    env.settle()
    res = handoff.breakdown(tmp_path)
    assert res["requests"] == 2
    stages = res["stages_ms"]
    for name in (
        "P KV final -> handed to the writer",
        "handed -> writer picks it up",
        "post -> DONE seen by P writer",
        "DONE -> settled (hand-off end)",
        "hand-off total (P finished -> settled)",
        "post -> completion notif read on D",
        "D notif read -> D get_finished reports it",
        "P finished -> D get_finished reports it",
    ):
        assert stages[name]["n"] == 2, name
        assert stages[name]["p50"] >= 0.0, name
    # P's steps are traced: each WRITE is set against the tokens P scheduled meanwhile
    load = res["write_vs_p_load"]["warm-up"]
    assert load["n"] == 2
    assert sum(c["n"] for k, c in load.items() if k in ("p_idle", "p_computing")) == 2
    sched = [e for e in handoff._load(tmp_path)["P"] if e["ev"] == "sched"]
    assert sum(e["tokens"] for e in sched) >= 40 + 49  # both prompts were scheduled
    completions = [e["msg"] for e in handoff._load(tmp_path)["D"] if e["ev"] == "notif_in"]
    assert [m for m in completions if m.endswith(":1")] == [f"{i}:1" for i in d_ids]


@pytest.mark.timeout(60)
def test_a_progressive_requests_chunks_and_last_write_are_told_apart(
    env: PushEnv, tmp_path: Path
) -> None:
    """push_progressive: chunk WRITEs carry no notification; the breakdown times the
    last WRITE (the one D is told of), from the moment the prompt's KV is final."""
    extra = {"push_progressive": True, "push_handover_wait_ms": 1000}
    p, d = env.pair(p_kw={"extra_config": extra, "max_num_batched_tokens": 32})
    _traced(p, d, tmp_path)
    _push(env, p, d, "prog", 100, register_first=True)
    env.settle()
    assert p.totals("push_chunk_writes") >= 1
    res = handoff.breakdown(tmp_path)
    assert res["requests"] == 1
    p_events = handoff._load(tmp_path)["P"]
    kinds = [e["ev"] for e in p_events]
    assert kinds.count("chunk") >= 3 and kinds.count("handed") == 1
    assert kinds.count("w_chunk") >= 1
    # the one completion WRITE is what the breakdown timed
    assert res["stages_ms"]["post -> completion notif read on D"]["n"] == 1
    posts = [e for e in p_events if e["ev"] == "transfer"]
    assert [bool(e["notif"]) for e in posts][-1] and not any(e["notif"] for e in posts[:-1])
