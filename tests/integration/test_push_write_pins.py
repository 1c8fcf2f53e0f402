# SPDX-License-Identifier: Apache-2.0
"""P's blocks stay the request's until the last of its running WRITEs ended (S-SAFE-1:
"P never frees what a running WRITE reads").

A request of P has several WRITEs running at once when one P rank serves several D
ranks (one WRITE per D rank), and, with progressive push (S-PRG-1), when one D rank's
chunk WRITE still runs beside another rank's last WRITE. vLLM may take the blocks back
only once the *last* of them ended: before that, the transfer reads them.

The truth is vLLM's own: a :class:`BlockOwners` watch maps every WRITE P has in flight
(the fake NIXL's handles, by source address) to the blocks of P's KV cache it reads and
asks vLLM's KV cache manager, after every step, whether those blocks are still allocated
to the request they were read for. WRITEs end in an order the test picks: the fabric
completes none by itself (``complete_after_polls``), the test ends one at a time with
``FakeNixlFabric.complete``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from push_harness import (
    LAYERS,
    P_HOLDS_ITS_WRITE,
    SAMPLED_TOKEN,
    Engine,
    PushEnv,
    assert_kv_pushed,
    block_pairs,
    pending_regs,
    wait_until,
)
from test_push_progressive import ChunkedForward
from vllm.v1.request import RequestStatus

from devkit.testing.fake_nixl import FakeXferHandle

#: The fabric completes a WRITE on its n-th poll: never, here (the test ends each).
NEVER = 10**9


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 53 + i * 13) % 1000 + 3 for i in range(n)]


class BlockOwners:
    """Which of P's logical blocks each in-flight WRITE of P reads, and whether vLLM
    still gives them to the request the WRITE was posted for."""

    def __init__(self, env: PushEnv, p: Engine) -> None:
        self.env, self.p = env, p
        #: handle id -> the request whose blocks the WRITE read when first seen
        self.owner: dict[int, str] = {}
        #: handle id -> what went wrong (the first time it was seen)
        self.violations: dict[int, str] = {}
        self.max_in_flight = 0

    def _req_to_blocks(self) -> dict[str, set[int]]:
        (mgr,) = self.p.scheduler.kv_cache_manager.coordinator.single_type_managers
        return {rid: {b.block_id for b in blocks} for rid, blocks in mgr.req_to_blocks.items()}

    def _blocks_read(self, h: FakeXferHandle) -> set[int]:
        rank = next(r for r in self.p.ranks if r.agent is h._agent)
        per_logical = self.p.spec.physical_per_logical
        out: set[int] = set()
        for loc, _ in h.pairs:
            for layer in LAYERS:
                t = rank.caches[layer]
                base, stride = t.data_ptr(), t.stride(0) * t.element_size()
                if base <= loc.addr < base + t.shape[0] * stride:
                    first = (loc.addr - base) // stride
                    last = (loc.addr + loc.length - 1 - base) // stride
                    out.update(b // per_logical for b in range(first, last + 1))
                    break
            else:
                raise AssertionError(f"{h!r} reads outside P's KV cache")
        return out

    def in_flight(self) -> list[FakeXferHandle]:
        agents = {a.name for a in self.p.agents}
        return [
            h for h in self.env.fabric.pending_transfers()
            if h._agent.name in agents and h.op == "WRITE"
        ]  # fmt: skip

    def check(self) -> None:
        running = self.in_flight()
        self.max_in_flight = max(self.max_in_flight, len(running))
        owned = self._req_to_blocks()
        for h in running:
            blocks = self._blocks_read(h)
            rid = self.owner.get(h._handle)
            if rid is None:
                holders = [r for r, ids in owned.items() if blocks <= ids]
                assert len(holders) == 1, f"{h!r} reads blocks {blocks}; vLLM's: {owned}"
                rid = self.owner[h._handle] = holders[0]
            lost = blocks - owned.get(rid, set())
            if lost or rid in self.p.finished_sending:
                self.violations.setdefault(
                    h._handle,
                    f"{h!r} still reads blocks {sorted(blocks)} of {rid}, but vLLM "
                    f"{'was told it was sent' if rid in self.p.finished_sending else ''}"
                    f"{' and ' if lost and rid in self.p.finished_sending else ''}"
                    f"{f'no longer gives it {sorted(lost)}' if lost else ''}",
                )

    def step(self, forward: object = None) -> None:
        self.p.engine_step(forward=forward)  # type: ignore[arg-type]
        self.check()
        for e in self.env.engines:
            if e is not self.p:
                e.engine_step()
        self.check()


def _end_all_but_the_oldest(
    watch: BlockOwners, until: Callable[[], bool], forward: object = None
) -> None:
    """Step the engines until ``until()`` holds, then 10 steps more, ending every WRITE
    of P as soon as it runs except the oldest in flight, which stays in flight
    throughout."""
    oldest = min(watch.in_flight(), key=lambda h: h._handle)

    def step() -> None:
        watch.step(forward)
        for h in watch.in_flight():
            if h is not oldest:
                watch.env.fabric.complete(h)
        watch.check()
        time.sleep(0.002)

    wait_until(until, timeout=60, step=step, what="the prompt ended while its oldest WRITE ran")
    for _ in range(10):
        step()
    assert oldest.state == "PROC"


def _end_all(watch: BlockOwners, until: object, forward: object = None) -> None:
    def step() -> None:
        watch.step(forward)
        for h in sorted(watch.in_flight(), key=lambda h: h._handle):
            watch.env.fabric.complete(h)

    wait_until(until, step=step, what="the push ended")  # type: ignore[arg-type]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("held", ["first", "last"])
def test_p_keeps_the_blocks_until_the_last_write_to_the_d_ranks_ends(
    env: PushEnv, held: str
) -> None:
    """P at TP 1 writes one request to D at TP 2 (one KV head each): two WRITEs, one
    per D rank. One of them (the first posted or the last) stays in flight while the
    other ends and both engines step on: vLLM must not get P's blocks back (nor be
    told the request was sent) until it ended too; D then serves P's KV."""
    p, d = env.pair(d_kw={"tp": 2, "num_blocks": 48})
    env.fabric.complete_after_polls = NEVER
    watch = BlockOwners(env, p)
    prompt = _prompt(1, 56)  # 4 blocks, the last partial
    d_id, p_id = "cmpl-pin-0-bbbbbbbb", "cmpl-pin-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg("PIN"), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg("PIN"))
    wait_until(lambda: len(watch.in_flight()) == 2, step=watch.step, what="2 WRITEs posted")
    writes = sorted(watch.in_flight(), key=lambda h: h._handle)
    kept = writes[0] if held == "first" else writes[-1]
    for h in writes:
        if h is not kept:
            assert env.fabric.complete(h)
    for _ in range(40):
        watch.step()
        time.sleep(0.002)
    assert kept.state == "PROC"
    assert not watch.violations, "\n".join(watch.violations.values())
    assert p_id not in p.finished_sending and d_id not in d.finished
    assert env.fabric.complete(kept)
    env.run_until(lambda: d_id in d.finished and p_id in p.finished_sending)
    watch.check()
    assert not watch.violations, "\n".join(watch.violations.values())
    assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert list(d.finished[d_id].output_token_ids) == [SAMPLED_TOKEN] * 2
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(90)
def test_a_write_running_past_the_lease_cap_keeps_the_blocks_when_others_ended(
    env: PushEnv,
) -> None:
    """As above with P's lease short (0.3 s, cap 0.3 + 2 x 2 s): the WRITE to one
    D rank ends, the other runs past the cap. No lease end frees the blocks while it
    runs (its deadline passed: P abandons it; when it ends, its completion lands with
    its bytes, so D may serve the request, with P's KV). D registers first, so P's
    short lease starts with both registrations at P."""
    lease_s, write_timeout_s = 0.3, 2.0
    extra = {"kv_lease_duration": lease_s, "push_write_timeout_s": write_timeout_s}
    p, d = env.pair(p_kw={"extra_config": extra}, d_kw={"tp": 2, "num_blocks": 48})
    env.fabric.complete_after_polls = NEVER
    watch = BlockOwners(env, p)
    prompt = _prompt(2, 56)
    d_id, p_id = "cmpl-cap-0-bbbbbbbb", "cmpl-cap-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg("CAP"), max_tokens=2)
    wait_until(lambda: pending_regs(p.workers[0]) == 2, step=env.step_all,
               what="both D ranks registered with P")  # fmt: skip
    p.add_request(p_id, prompt, p.p_leg("CAP"))
    wait_until(lambda: len(watch.in_flight()) == 2, step=watch.step, what="2 WRITEs posted")
    kept, *others = sorted(watch.in_flight(), key=lambda h: h._handle)
    for h in others:
        assert env.fabric.complete(h)
    cap_passed = time.monotonic() + lease_s + 2 * write_timeout_s + 0.5
    wait_until(lambda: time.monotonic() > cap_passed, step=watch.step, what="the lease cap")
    for _ in range(20):
        watch.step()
    assert kept.state == "PROC"
    assert not watch.violations, "\n".join(watch.violations.values())
    assert p.totals("push_lease_cap_pinned") == 1
    assert env.fabric.complete(kept)
    env.run_until(lambda: d_id in d.finished and p_id in p.finished_sending)
    assert not watch.violations, "\n".join(watch.violations.values())
    assert p.totals("push_failed_write_timeout") == 1
    if d.finished[d_id].status != RequestStatus.FINISHED_ERROR:
        fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
        assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.settle()
    env.assert_clean()


def _progressive_pair(env: PushEnv, d_tp: int, **extra: object) -> tuple[Engine, Engine]:
    p_extra = {"push_progressive": True, "push_handover_wait_ms": 1000, **extra}
    return env.pair(
        p_kw={"extra_config": p_extra, "max_num_batched_tokens": 32},
        d_kw={"tp": d_tp, "num_blocks": 48},
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("d_tp", [1, 2])
def test_a_chunk_write_still_running_keeps_the_blocks(env: PushEnv, d_tp: int) -> None:
    """Progressive push, a 100-token prompt in chunks of 32: the first chunk WRITE
    stays in flight while every other WRITE (the other D rank's chunks and last WRITE)
    ends and the prompt ends. vLLM gets P's blocks back only after that chunk WRITE
    ended; D then serves P's KV."""
    p, d = _progressive_pair(env, d_tp, **P_HOLDS_ITS_WRITE)
    forward = ChunkedForward(p)
    env.fabric.complete_after_polls = NEVER
    watch = BlockOwners(env, p)
    prompt = _prompt(3, 100)
    d_id, p_id = "cmpl-chk-0-bbbbbbbb", "cmpl-chk-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg("CHK"), max_tokens=2)
    wait_until(
        lambda: d.scheduler.requests[d_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        and len(p.workers[0].remote_agents_of("D")) == d_tp,
        step=d.engine_step, what="D registered with P",
    )  # fmt: skip
    wait_until(lambda: pending_regs(p.workers[0]) == d_tp, step=env.step_all,
               what="the registrations reached P's writer")  # fmt: skip
    p.add_request(p_id, prompt, p.p_leg("CHK"))
    wait_until(watch.in_flight, step=lambda: watch.step(forward), what="a chunk WRITE posted")
    _end_all_but_the_oldest(watch, lambda: p_id in p.finished, forward)
    assert not watch.violations, "\n".join(watch.violations.values())
    assert p_id not in p.finished_sending and d_id not in d.finished
    _end_all(watch, lambda: d_id in d.finished and p_id in p.finished_sending, forward)
    assert not watch.violations, "\n".join(watch.violations.values())
    assert watch.max_in_flight >= 1
    assert list(d.finished[d_id].output_token_ids) == [SAMPLED_TOKEN] * 2
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.settle()
    env.assert_clean()
