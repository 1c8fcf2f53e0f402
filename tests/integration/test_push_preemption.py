# SPDX-License-Identifier: Apache-2.0
"""P preempts a request after it was announced (S-SAFE-1, "Preempted after it was
announced" in docs/design.md).

With asynchronous scheduling (vLLM's default on GPU engines) or pipeline parallelism,
the step after the one that runs a request's last prompt token is scheduled before
that step's output is processed. If it runs out of blocks, vLLM preempts the last
running request, which may be the announced one: its blocks are freed and given to
another request in that very step, while the writer is about to post (or has posted)
the WRITE that reads them. ``reset_prefix_cache`` preempts every running request too.

Real vLLM schedulers (``AsyncScheduler``) and connector workers over the fake NIXL,
whose WRITEs read their source when they complete (as late as a real one may). The
truths are vLLM's: which blocks the fake forward pass filled for which request (its
block table), and the bytes D serves (the model check's oracle, push_modelcheck.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from push_harness import (
    Engine,
    HeldWriter,
    PushEnv,
    Rank,
    completion_or_none,
    notifs,
    pending_regs,
    wait_until,
)
from push_modelcheck import KvOwnership

from vllm_ext import compat
from vllm_ext.nixl_push.wire import PUSH_FAIL_PREFIX, PushFailed, parse_notif

#: How long R's posted WRITE stays in flight after step N (it then reads its source)
POSTED_WRITE_RUNS_S = 1.5

POSTED = pytest.mark.parametrize("posted", [True, False], ids=["write-posted", "write-not-posted"])


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 41 + i * 13) % 1000 + 3 for i in range(n)]


class ReadsAfterReuse:
    """Which P blocks each forward pass filled, for which request (vLLM's block table
    at that pass), and every WRITE that read a block after a pass filled it for another
    request than the one the WRITE is for."""

    def __init__(self, oracle: KvOwnership, p_of_d: dict[str, str]) -> None:
        self.oracle, self.p_of_d = oracle, p_of_d
        p = oracle.p
        self._p_blocks = [
            (t.data_ptr(), t.numel() * t.element_size(), t.stride(0) * t.element_size())
            for t in p.ranks[0].caches.values()
        ]
        #: P physical block -> the P request a forward pass last filled it for
        self.filled_by: dict[int, str] = {}
        self.bad: list[str] = []
        self.preempted: set[str] = set()
        self._schedule = p.scheduler.schedule
        p.scheduler.schedule = self._scheduled  # type: ignore[method-assign]
        p.fabric.observe_writes(self._landed)

    def _scheduled(self) -> Any:
        out = self._schedule()
        self.preempted |= compat.preempted_request_ids(out)
        return out

    def fill(self, rank: Rank) -> None:
        self.oracle.fill(rank)
        p = self.oracle.p
        for rid in self.oracle._scheduled:
            if rid in p.scheduler.requests:
                (ids,) = p.scheduler.kv_cache_manager.get_block_ids(rid)
                for b in p.physical(ids):
                    self.filled_by[b] = rid

    def _landed(self, w: Any) -> None:
        if w.initiator not in {a.name for a in self.oracle.p.agents} or not w.notif:
            return
        done = completion_or_none(w.notif)
        if done is None:
            return
        d_rid = done[0]
        for local, _, length in w.spans:
            for base, size, per_block in self._p_blocks:
                if not base <= local < base + size:
                    continue
                for b in range(
                    (local - base) // per_block, (local + length - 1 - base) // per_block + 1
                ):
                    if (owner := self.filled_by.get(b)) != self.p_of_d.get(d_rid):
                        self.bad.append(f"WRITE for {d_rid} read P block {b}, filled for {owner}")


@dataclasses.dataclass
class Scene:
    """P (async scheduling, 4 usable blocks) and D; R (P leg, 24 tokens: 2 blocks) with
    D's registration waiting at P, and Q (local, 32 tokens: 2 blocks, then a third for
    its first output token) queued before it."""

    env: PushEnv
    p: Engine
    d: Engine
    oracle: KvOwnership
    reads: ReadsAfterReuse
    posted: bool
    d_id: str = "cmpl-pe-0-bbbbbbbb"
    p_id: str = "cmpl-pe-0-aaaaaaaa"
    q_id: str = "cmpl-local-q"
    #: ends R's posted WRITE (``posted``)
    landing: threading.Timer | None = None

    @classmethod
    def build(cls, env: PushEnv, posted: bool) -> Scene:
        # (the posted WRITE runs POSTED_WRITE_RUNS_S: P must not give it up before)
        extra = {
            "push_handover_wait_ms": 1000 if posted else 20,
            "push_write_timeout_s": 4 * POSTED_WRITE_RUNS_S,
        }
        p, d = env.pair(p_kw={"async_scheduling": True, "num_blocks": 5, "extra_config": extra})
        oracle = KvOwnership(p, d)
        s = cls(env, p, d, oracle, ReadsAfterReuse(oracle, {}), posted)
        s.reads.p_of_d[s.d_id] = s.p_id
        oracle.pair(s.p_id, s.d_id)
        prompt = _prompt(1, 24)
        d.add_request(s.d_id, prompt, p.d_leg("pe"), max_tokens=2)
        env.run_until(lambda: pending_regs(p.workers[0]) == 1, what="PUSH_REG waits at P")
        wait_until(lambda: p.workers[0].remote_agents_of("D"), what="P connected to D")
        p.add_request(s.q_id, _prompt(2, 32), None, max_tokens=6)
        p.add_request(s.p_id, prompt, p.p_leg("pe"))
        return s

    @contextlib.contextmanager
    def writer(self) -> Iterator[None]:
        """``posted``: R's WRITE, posted at the end of step N, runs another
        ``POSTED_WRITE_RUNS_S`` (NIXL reads its source as late as that); else the writer
        is held until step N+1 ran (a GPU whose KV-ready event for step N fires after
        step N+1 started)."""
        if self.posted:
            self.env.fabric.fail_next_transfer("hang", initiator=self.p.agents[0].name)
            self.landing = threading.Timer(POSTED_WRITE_RUNS_S, self.env.fabric.progress)
            yield
            return
        with HeldWriter(self.p.workers[0]):
            yield

    def step_n(self, before_update: Callable[[], Any] | None = None) -> None:
        """Step N: Q's prompt and R's whole prompt (R announced, its WRITE handed over)."""
        self.p.engine_step(forward=self.reads.fill, before_update=before_update)
        assert self.p_id in self.p.ranks[0].metas[-1].push_prefill_done
        posted = bool(self.p.agents[0].calls("transfer"))
        assert posted == self.posted, "R's WRITE was posted in step N" if self.posted else ""
        if self.landing is not None:
            self.landing.start()

    def finish(self) -> None:
        """Run to the end: no WRITE read a block after another request's pass filled it,
        and D serves R only from R's KV, or fails it after P's PUSH_FAIL."""
        self.env.run_until(
            lambda: self.d_id in self.d.finished and self.q_id in self.p.finished,
            what="D's request and Q done",
        )
        self.env.settle()
        if self.landing is not None:
            self.landing.join()
        assert not self.reads.bad, self.reads.bad
        assert not self.oracle.violations, self.oracle.report()
        fails = [parse_notif(n.msg) for n in notifs(self.env.fabric, PUSH_FAIL_PREFIX)]
        failed = [f.request_id for f in fails if isinstance(f, PushFailed)]
        if self.posted:  # read before the blocks changed: D serves R's KV
            assert not failed and self.oracle.served.get(self.d_id), self.oracle.describe(self.d_id)
        else:  # never posted: D was told and did not serve it from its blocks
            assert failed == [self.d_id] and not self.oracle.served.get(self.d_id)
        self.env.assert_clean()


@pytest.mark.timeout(90)
@POSTED
def test_an_announced_request_preempted_for_blocks_gets_no_write_of_reused_blocks(
    env: PushEnv, posted: bool
) -> None:
    """Step N+1, scheduled before N's output is processed, needs a block for Q's first
    token and none is free. vLLM 0.23 preempts the last running request, R (0.32 asks
    the connector first, which holds the preemption back while R is announced)."""
    s = Scene.build(env, posted)
    with s.writer():
        s.step_n()
        s.p.engine_step(forward=s.reads.fill)  # N+1; then N's output is processed
    preempted = s.p_id in s.reads.preempted
    assert preempted != compat.scheduler_asks_before_preempting()
    if not preempted:
        s.posted = True  # (not preempted: written as any other, whether posted early or late)
    s.finish()


@pytest.mark.timeout(90)
@POSTED
def test_an_announced_request_preempted_by_a_prefix_cache_reset_gets_no_write_of_reused_blocks(
    env: PushEnv, posted: bool
) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` between step N and its output
    preempts Q and R (vLLM 0.23 does not report it in the next schedule); step N+1
    resumes Q in R's blocks."""
    s = Scene.build(env, posted)
    with s.writer():
        s.step_n(lambda: s.p.scheduler.reset_prefix_cache(reset_running_requests=True))
        s.p.engine_step(forward=s.reads.fill)
    s.finish()
