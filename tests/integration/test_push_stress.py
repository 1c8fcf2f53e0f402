# SPDX-License-Identifier: Apache-2.0
"""Randomized (seeded) push traffic between real engines: many requests, both arrival
orders, random delays, shared prompt prefixes, every id rule, duplicate PUSH_REGs.

Every D request must receive exactly its P request's KV, and afterwards every table
must be empty, every KV block back in its pool and every NIXL handle released.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from push_harness import (
    PushEnv,
    assert_kv_pushed,
    assert_nixl_calls_on_writer,
    block_pairs,
    notifs,
    open_push_env,
)
from vllm.v1.request import RequestStatus

from vllm_ext.nixl_push.wire import PUSH_REG_PREFIX

N_PAIRS = 48


@pytest.fixture
def env(tiny_model: Path) -> Iterator[PushEnv]:
    with open_push_env(tiny_model, complete_after_polls=3) as e:
        yield e


def _hex8(rng: random.Random) -> str:
    return f"{rng.getrandbits(32):08x}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed,p_tp,d_tp", [(1, 1, 2), (2, 1, 1), (3, 2, 1)])
def test_randomized_push_traffic(env: PushEnv, seed: int, p_tp: int, d_tp: int) -> None:
    rng = random.Random(seed)
    # (no WRITE fails here: P's write timeout is the default's, not the harness's short
    # one, which 48 pairs' WRITEs on a loaded host can outlast)
    p, d = env.pair(
        p_kw={"tp": p_tp, "num_blocks": 200, "extra_config": {"push_write_timeout_s": 30.0}},
        d_kw={"tp": d_tp, "num_blocks": 200},
    )
    shared_prefix = [rng.randrange(3, 1000) for _ in range(40)]
    links = max(p_tp, d_tp)  # WRITEs (and PUSH_REGs) per request pair

    # The plan: for each pair, when each leg arrives and how the legs are identified.
    events: dict[int, list[tuple[str, int]]] = {}
    pairs: dict[str, str] = {}  # D request id -> P request id
    rules: dict[str, int] = {"transfer_id": 0, "exact": 0, "base_id": 0}
    specs = []
    for i in range(N_PAIRS):
        rule = rng.choice(list(rules))
        rules[rule] += links
        base = f"cmpl-s{seed}x{i}-{rng.randrange(3)}"
        if rule == "exact":
            p_id = d_id = base
        else:
            p_id, d_id = f"{base}-{_hex8(rng)}", f"{base}-{_hex8(rng)}"
        tid = f"T{seed}-{i}" if rule == "transfer_id" else None
        n = rng.randrange(1, 130)
        prompt = [rng.randrange(3, 1000) for _ in range(n)]
        if rng.random() < 0.3:  # D and P may hit their prefix caches
            prompt = shared_prefix[: rng.randrange(16, 41)] + prompt
        start = rng.randrange(0, 80)
        delay = rng.choice([0, 0, 1, 2, 3, 5, 8, 13])
        first, second = rng.sample(["P", "D"], 2)
        events.setdefault(start, []).append((first, i))
        events.setdefault(start + delay, []).append((second, i))
        specs.append((p_id, d_id, tid, prompt, rng.random() < 0.25))
        pairs[d_id] = p_id

    checked: set[str] = set()

    def verify(done: set[str]) -> None:
        # D's blocks still hold what arrived: compare them with P's now.
        for d_id in done:
            reg = d.reg_meta(d_id)
            fin = p.finished_meta(pairs[d_id])
            got = block_pairs(p, d, fin.block_ids[0], reg.block_ids[0], reg.prefix_tokens)
            if got:
                assert_kv_pushed(p, d, got)
            checked.add(d_id)

    d.on_recved.append(verify)
    added: dict[str, set[int]] = {"P": set(), "D": set()}
    duplicates = 0
    step = 0
    while len(added["P"]) + len(added["D"]) < 2 * N_PAIRS:
        for side, i in events.get(step, []):
            p_id, d_id, tid, prompt, dup = specs[i]
            if side == "D":
                d.add_request(d_id, prompt, p.d_leg(tid), max_tokens=rng.randrange(1, 4))
            else:
                if dup and i in added["D"]:
                    # Replay D's PUSH_REGs to P (before P's blocks exist, so that P
                    # still knows the originals when the replays arrive).
                    regs = env.run_until(lambda d_id=d_id: _regs_of(env, d_id, links))
                    for n in regs:
                        env.fabric.inject_notif(n.receiver, n.sender, n.msg)
                        duplicates += 1
                p.add_request(p_id, prompt, p.p_leg(tid))
            added[side].add(i)
        env.step_all()
        step += 1
        if rng.random() < 0.3:  # give the writer threads a chance to run ahead
            time.sleep(rng.choice([0.0005, 0.001, 0.002]))
    env.run_until(lambda: set(pairs) <= set(d.finished), timeout=60, what="every D request")
    env.settle(timeout=30)

    assert checked == set(pairs)
    for d_id in pairs:
        assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED, d_id
    assert set(pairs.values()) <= p.finished_sending
    assert not d.invalid_block_ids and not p.invalid_block_ids
    assert p.totals("push_writes") == N_PAIRS * links
    assert p.totals("push_regs_duplicate") == duplicates
    assert {r: p.totals(f"push_match_{r}") for r in rules} == rules
    assert d.totals("push_completions_received") == N_PAIRS * links
    for e in (p, d):
        for w in e.workers:
            bad = {
                k: v
                for k, v in w.push_counters.totals().items()
                if v and (k.startswith("push_failed") or k.endswith(("malformed", "rejected")))
            }
            assert not bad, (e.engine_id, bad)
    env.assert_clean()
    assert_nixl_calls_on_writer(env.fabric)


def _regs_of(env: PushEnv, d_id: str, n: int) -> list:
    """D's PUSH_REGs for ``d_id`` once all ``n`` of them were delivered."""
    out = []
    for notif in notifs(env.fabric, PUSH_REG_PREFIX, via="send_notif"):
        body = msgpack.unpackb(notif.msg[len(PUSH_REG_PREFIX) :], raw=False)
        if body["request_id"] == d_id:
            out.append(notif)
    return out if len(out) == n else []
