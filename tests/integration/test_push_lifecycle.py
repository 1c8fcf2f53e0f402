# SPDX-License-Identifier: Apache-2.0
"""The push lifecycle end to end: senders are checked, every state has a deadline, and
every request ends exactly once (docs/design.md, "Lifecycle"; S-WRT-6, S-FAIL-4, S-TMO-1).

Real vLLM Schedulers and connector workers over the fake NIXL fabric, which lets any
agent send anything (``FakeNixlFabric.inject_notif``) and can hold a WRITE in flight
(``fail_next_transfer("hang")``). ``PushEnv.assert_clean`` also checks that each
request was reported done (blocks freed) exactly once on each side.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from push_harness import (
    P_HOLDS_ITS_WRITE,
    Engine,
    HandshakeGate,
    HeldWriter,
    PushEnv,
    assert_kv_pushed,
    assert_untouched,
    block_pairs,
    capture_logs,
    completion,
    completions,
    held_finished,
    live_xfer_handles,
    notifs,
    pending_regs,
    wait_until,
)
from vllm.v1.request import RequestStatus

from devkit.testing.fake_nixl import FailureKind, FakeXferHandle
from vllm_ext.nixl_push.leases import HOLD_S
from vllm_ext.nixl_push.wire import (
    PUSH_FAIL_PREFIX,
    PUSH_HB_PREFIX,
    PUSH_REG_PREFIX,
    Completion,
    PushCancel,
    PushFailed,
    PushHeartbeat,
    parse_notif,
)
from vllm_ext.nixl_push.worker import NixlPushConnectorWorker

WRITES_LOG = "vllm.ext.nixl_push.writes"
WORKER_LOG = "vllm.ext.nixl_push.worker"


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 41 + i * 7) % 1000 + 3 for i in range(n)]


def _steps(env: PushEnv, n: int, pause: float = 0.002) -> None:
    for _ in range(n):
        env.step_all()
        time.sleep(pause)


# -- D accepts a producer's notification once, and only from a producer --------------------------


@pytest.mark.timeout(60)
def test_a_duplicate_completion_does_not_end_the_wait_early(env: PushEnv) -> None:
    """P tp 2 -> D tp 1: each P rank writes its half of the heads and sends a completion.
    A second completion from rank 0 (a replaying network, a confused peer) must not
    count for rank 1: D keeps waiting until rank 1's KV is in, and then it is right."""
    p, d = env.pair(p_kw={"tp": 2, "extra_config": P_HOLDS_ITS_WRITE})
    gate = HandshakeGate(p.workers[1])  # rank 1's WRITE waits for its handshake with D
    prompt = _prompt(1)
    d_id, p_id = "cmpl-dc-0-bbbbbbbb", "cmpl-dc-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg())
    env.run_until(lambda: d.totals("push_completions_received") == 1, what="rank 0 wrote")
    (first,) = completions(env.fabric, d_id, via="xfer")
    assert first.sender == p.agents[0].name
    for _ in range(2):
        env.fabric.inject_notif(d.agents[0].name, p.agents[0].name, first.msg)
    env.run_until(lambda: d.totals("push_notifs_duplicate") == 2, what="duplicates dropped")
    _steps(env, 20)
    assert d_id not in d.finished_recving, "D ended its wait before P rank 1's KV arrived"
    assert d.scheduler.requests[d_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    gate.open()
    env.run_until(lambda: d_id in d.finished)
    env.settle()
    assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert d.totals("push_completions_received") == 2
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.assert_clean()


@pytest.mark.timeout(60)
def test_notifications_from_a_foreign_agent_are_dropped(env: PushEnv) -> None:
    """Well-formed completion, PUSH_FAIL and PUSH_HB for a D request, from an agent that
    is not one of its producers (another engine's): counted, dropped, no effect, even
    with the registration's reply token (S-WIR-3) in them."""
    p, d = env.pair(p_kw={"extra_config": P_HOLDS_ITS_WRITE})
    stranger = env.engine("X", "kv_producer")
    gate = HandshakeGate(p.workers[0])  # P's WRITE waits: D is still waiting meanwhile
    prompt = _prompt(2)
    d_id, p_id = "cmpl-fo-0-bbbbbbbb", "cmpl-fo-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg())
    env.run_until(lambda: p.totals("push_match_base_id") == 1)
    foreign = stranger.agents[0].name
    token = d.reg_token(d_id)
    for msg in (
        Completion(d_id, 1, token).encode(),
        PushFailed(d_id, "made up", token).encode(),
        PushHeartbeat((d_id,), (token,)).encode(),
    ):
        env.fabric.inject_notif(d.agents[0].name, foreign, msg)
    env.run_until(lambda: d.totals("push_notifs_foreign") == 3, what="foreign ones dropped")
    _steps(env, 10)
    assert d_id not in d.finished and d.totals("push_failed_remote") == 0
    assert d.totals("push_heartbeats_received") == 0
    gate.open()
    env.run_until(lambda: d_id in d.finished)
    env.settle()
    assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    env.assert_clean()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("who", ["another_engine", "same_engine_other_rank"])
def test_p_accepts_a_cancel_only_from_the_agent_that_registered(env: PushEnv, who: str) -> None:
    """A PUSH_CANCEL naming D's request (engine id and rank of the real registration in
    its body) but sent by another agent does not make P drop the registration."""
    p, d = env.pair(d_kw={"tp": 2})
    stranger = env.engine("X", "kv_consumer")
    prompt = _prompt(3)
    d_id, p_id = "cmpl-pc-0-bbbbbbbb", "cmpl-pc-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    env.run_until(lambda: pending_regs(p.workers[0]) == 2)
    sender = stranger.agents[0].name if who == "another_engine" else d.agents[1].name
    body = PushCancel("D", d_id, 0, 2, "127.0.0.1", d.port)  # D rank 0's registration
    env.fabric.inject_notif(p.agents[0].name, sender, body.encode())
    env.run_until(lambda: p.totals("push_notifs_foreign") == 1)
    assert p.totals("push_cancels_received") == 0 and pending_regs(p.workers[0]) == 2
    assert not notifs(env.fabric, PUSH_FAIL_PREFIX)  # nobody was answered
    p.add_request(p_id, prompt, p.p_leg())
    env.run_until(lambda: d_id in d.finished)
    env.settle()
    assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    env.assert_clean()


# -- every state has a deadline, but a running WRITE holds its blocks until NIXL ends it ---------
# (S-SAFE-1, "Which blocks a WRITE may touch"; N-REL-1)


@dataclasses.dataclass
class _StuckWrite:
    """A pair whose one WRITE is in flight until the test ends it. Block ids are vLLM's
    allocator's (``get_block_ids``), read while both requests lived."""

    env: PushEnv
    p: Engine
    d: Engine
    p_id: str
    d_id: str
    p_blocks: list[int]
    d_blocks: list[int]
    write: FakeXferHandle
    #: time.perf_counter() before P's request arrived (vLLM's lease clock)
    started: float
    #: D's KV once the WRITE was posted (nothing landed yet)
    d_before: list[dict[str, torch.Tensor]]
    #: P's lease end as vLLM set it (time.perf_counter()), once P's worker saw it
    lease_end: list[float]
    #: per landing of the WRITE's bytes in D: (P's request still held its blocks, P's
    #: free block count), recorded the moment the bytes landed
    landings: list[tuple[bool, int]] = dataclasses.field(default_factory=list)

    def p_holds(self) -> bool:
        """P's request still holds its blocks in vLLM's allocator."""
        s = self.p.scheduler
        return self.p_id in s.requests and _block_ids(self.p, self.p_id) == self.p_blocks

    def assert_p_holds(self) -> None:
        assert self.p_holds(), "P freed blocks NIXL may still read"
        assert self.p.free_blocks() == self.p.initial_free_blocks - len(self.p_blocks)

    def assert_d_holds(self) -> None:
        """D keeps the blocks the WRITE may still land in, and waits (S-SAFE-1)."""
        d, d_id = self.d, self.d_id
        assert d_id in d.scheduler.requests, "D freed blocks a WRITE may land in"
        assert d.scheduler.requests[d_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert _block_ids(d, d_id) == self.d_blocks
        assert d.free_blocks() == d.initial_free_blocks - len(self.d_blocks)

    def push_fails(self) -> list[bytes]:
        """The PUSH_FAILs that reached D, in order."""
        return [n.msg for n in notifs(self.env.fabric, PUSH_FAIL_PREFIX)]

    def completions(self) -> list[bytes]:
        """The completions (``<D request id>:<P tp>``) that reached D."""
        return [n.msg for n in completions(self.env.fabric, self.d_id)]

    def assert_untold(self) -> None:
        assert not self.push_fails() and not self.completions(), "D told while it is written"

    def assert_held_and_untold(self) -> None:
        """While NIXL runs the WRITE: both sides hold their blocks, D is told nothing."""
        self.assert_p_holds()
        self.assert_d_holds()
        self.assert_untold()

    def land_while_p_holds(self) -> None:
        """The WRITE ends after all: it read P's blocks while P held them, D's hold P's."""
        p, d = self.p, self.d
        self.env.fabric.progress(p.agents[0].name)
        assert self.landings == [(True, p.initial_free_blocks - len(self.p_blocks))]
        assert_kv_pushed(p, d, block_pairs(p, d, self.p_blocks, self.d_blocks))

    def assert_served(self) -> None:
        """D took the completion (no PUSH_FAIL before it) and served P's KV."""
        d, d_id = self.d, self.d_id
        assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert d.recv_reports[d_id] == 1 and not d.invalid_block_ids
        assert d.totals("push_completions_received") == 1
        assert d.totals("push_failed_remote") == 0
        to_d = [
            n.msg
            for n in self.env.fabric.notifications()
            if n.receiver == d.agents[0].name
            and (n.msg.startswith(PUSH_FAIL_PREFIX) or n.msg in self.completions())
        ]
        assert completion(to_d[0]) == (d_id, 1), to_d
        assert len(self.landings) == 1  # nothing landed after D let the blocks go

    def assert_load_failed_with_nothing_landed(self) -> None:
        """D failed the load on P's PUSH_FAIL alone: its blocks invalid, nothing landed."""
        d, d_id = self.d, self.d_id
        assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
        assert set(self.d_blocks) <= d.invalid_block_ids
        assert d.recv_reports[d_id] == 1  # reported (as a failed recv) once
        answers = [m for m in self.push_fails() if not parse_notif(m).landing]  # type: ignore[union-attr]
        assert len(answers) == 1 and not self.completions()  # (and a notice: N-REL-2)
        assert d.totals("push_completions_received") == 0
        assert not self.landings
        assert_untouched(d, self.d_before, ())  # D's KV as it was: no byte landed


def _block_ids(e: Engine, request_id: str) -> list[int]:
    (ids,) = e.scheduler.kv_cache_manager.get_block_ids(request_id)
    return list(ids)


def _stuck_write(
    env: PushEnv,
    tag: str,
    p_extra: dict[str, Any],
    register_first: bool = False,
    stop_after_post: bool = False,
    kind: FailureKind = "hang_uncancellable",
) -> tuple[_StuckWrite, _WriterStops | None]:
    """P's one WRITE posted and hung (by default one NIXL refuses to release); with
    ``stop_after_post`` P's writer stops at the end of the pass that posted it."""
    p, d = env.pair(p_kw={"extra_config": p_extra})
    env.fabric.fail_next_transfer(kind, initiator=p.agents[0].name)
    prompt = _prompt(sum(map(ord, tag)))
    d_id, p_id = f"cmpl-{tag}-0-bbbbbbbb", f"cmpl-{tag}-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    if register_first:  # (a short lease must not end before the match)
        env.run_until(lambda: pending_regs(p.workers[0]) == 1)
        wait_until(lambda: p.workers[0].remote_agents_of("D"), what="P connected to D")
    stop = None
    if stop_after_post:
        stop = _WriterStops(p.workers[0], lambda: bool(p.agents[0].calls("transfer")))
    lease_end = _watch_lease_end(p, p_id)
    started = time.perf_counter()
    p.add_request(p_id, prompt, p.p_leg())
    env.run_until(lambda: p.agents[0].calls("transfer"), what="the WRITE posted")
    (write,) = env.fabric.pending_transfers()
    s = _StuckWrite(
        env, p, d, p_id, d_id, _block_ids(p, p_id), _block_ids(d, d_id), write, started,
        d.snapshot(), lease_end,
    )  # fmt: skip
    env.fabric.observe_writes(lambda _: s.landings.append((s.p_holds(), p.free_blocks())))
    return s, stop


def _watch_lease_end(p: Engine, p_id: str) -> list[float]:
    """Where P's worker will put the end of ``p_id``'s lease as vLLM set it
    (time.perf_counter()), read before the lease keeper moves it."""
    worker, lease_end = p.workers[0], []
    keeper = worker._hold_leases

    def see_the_lease_end() -> None:
        if not lease_end and p_id in worker._reqs_to_send:
            lease_end.append(worker._reqs_to_send[p_id])
        keeper()

    worker._hold_leases = see_the_lease_end  # type: ignore[method-assign]
    return lease_end


def _step_across_the_cap(p: Engine, cap: float) -> None:
    """Step P until a second before the lease cap, then not until it passed. In that
    second the lease keeper sets the lease to expire at the cap itself, so a step whose
    thread stalls across the cap lets vLLM's own reaper free the blocks (the gap of
    test_a_slow_step_at_the_lease_cap_frees_no_blocks_a_running_write_reads); the first
    step after it leaves the decision at the cap to the keeper."""
    while time.perf_counter() < cap - HOLD_S - 0.1:
        p.engine_step()
        time.sleep(0.005)
    time.sleep(max(0.0, cap + 0.05 - time.perf_counter()))


def _end_in_error(env: PushEnv, write: FakeXferHandle) -> None:
    """The hung WRITE ends at last, in an error (the transport's failure detection gave
    up on the link to D, N-REL-1): no byte lands, no notification. (``fail_next_transfer``
    only marks the next post, so the handle is marked here as an injected ``"state"``
    failure is.)"""
    write.fail_mode = "state"
    env.fabric.complete(write)
    assert write.state == "ERR"


class _WriterStops:
    """Stop a writer at the end of the first pass after which ``cond()`` holds, until
    :meth:`release`: what that pass decided stays decided, and nothing more runs."""

    def __init__(self, worker: NixlPushConnectorWorker, cond: Callable[[], bool]) -> None:
        self.stopped = threading.Event()
        self._go = threading.Event()
        original = worker.writer.step

        def step() -> None:
            original()
            if not self._go.is_set() and cond():
                self.stopped.set()
                self._go.wait(30)

        worker.writer.step = step  # type: ignore[method-assign]

    def release(self) -> None:
        self._go.set()


@pytest.mark.timeout(60)
def test_a_write_that_never_completes_is_abandoned(env: PushEnv) -> None:
    """push_write_timeout_s: P gives the WRITE up (counted, logged) but does not release
    it while NIXL runs it, although this one NIXL would let go: a release does not stop
    a UCX WRITE (N-REL-1). P keeps its blocks and D its own, untold, until NIXL ends
    the transfer. It ends in an error (nothing lands): P frees its blocks and tells D
    at once (PUSH_FAIL), which fails the load instead of waiting for its watchdog."""
    with capture_logs(WRITES_LOG) as logs:
        s, _ = _stuck_write(env, "wt", {"push_write_timeout_s": 0.3}, kind="hang")
        p, d, p_id, d_id = s.p, s.d, s.p_id, s.d_id
        env.run_until(lambda: p.totals("push_failed_write_stuck") == 1, what="given up")
    assert any("push_write_timeout_s" in r.getMessage() for r in logs)
    assert p.totals("push_failed_write_timeout") == 1
    s.assert_held_and_untold()
    assert not env.fabric.transfers(), "released in flight (recorded CANCELLED)"
    assert live_xfer_handles(env.fabric) == [s.write] and s.write.state == "PROC"
    _end_in_error(env, s.write)
    # (D's answer may come over a new connection: P removed D's failed one meanwhile)
    env.run_until(lambda: d_id in d.finished and d_id in d.recv_reports)
    env.run_until(lambda: p_id in p.finished_sending)
    s.assert_load_failed_with_nothing_landed()
    assert d.totals("push_failed_remote") == 1 and d.totals("push_watchdog_expired") == 0
    # a notice when NIXL reported the error, the answer once nothing can land (N-REL-2)
    notice, told = [parse_notif(n.msg) for n in notifs(env.fabric, PUSH_FAIL_PREFIX)]
    assert isinstance(notice, PushFailed) and notice.landing
    assert isinstance(told, PushFailed) and "0.3s" in told.reason and not told.landing
    (xfer,) = env.fabric.transfers()
    assert xfer.state == "ERR"
    stats = [st.data for r in p.ranks for st in r.stats]
    assert sum(len(st.get("num_failed_transfers", [])) for st in stats) == 1
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "ends", ["completes_late", "completes_after_the_bound", "fails_after_the_bound"]
)
def test_an_abandoned_write_nixl_cannot_cancel_holds_the_blocks_until_it_ends(
    env: PushEnv, ends: str
) -> None:
    """NIXL refuses to release a WRITE still in flight: P gives it up at
    push_write_timeout_s but keeps its blocks (NIXL reads them) and tells D nothing (its
    blocks are written) until NIXL ends the WRITE, also past the release bound
    (push_write_timeout_s again, logged as stuck): no bound of P's frees blocks a WRITE
    may read (S-SAFE-1). Meanwhile P renews D's watchdog, and D keeps its blocks.

    completes_late / completes_after_the_bound: the WRITE lands, within the bound or
    after it; it read P's blocks while P held them, D takes the completion and serves
    P's KV. fails_after_the_bound: it ends in an error, nothing lands, P frees its
    blocks and tells D, which fails the load."""
    s, _ = _stuck_write(env, f"wu{ends[0]}{ends[-1]}", {"push_write_timeout_s": 1.0})
    p, d, p_id, d_id = s.p, s.d, s.p_id, s.d_id
    s.assert_p_holds()
    if ends == "completes_late":
        # P's writer stops right after the pass that gave the WRITE up: the release
        # bound (its next deadline) cannot pass meanwhile, however slow the host.
        stop = _WriterStops(p.workers[0], lambda: p.totals("push_failed_write_timeout") == 1)
        try:
            assert stop.stopped.wait(20), "P never gave the WRITE up"
            _steps(env, 10)  # both engines step; P's writer waits
            assert p.totals("push_failed_write_stuck") == 0  # within the bound
            s.assert_held_and_untold()
            assert s.write.state == "PROC"
            s.land_while_p_holds()
        finally:
            stop.release()
    else:
        env.run_until(lambda: p.totals("push_failed_write_stuck") == 1, what="the bound")
        renewed = d.totals("push_heartbeats_received")
        env.run_until(
            lambda: d.totals("push_heartbeats_received") >= renewed + 2,
            what="P renews D's watchdog past the bound",
        )
        assert p.totals("push_failed_write_timeout") == 1
        s.assert_held_and_untold()
        assert live_xfer_handles(env.fabric) == [s.write] and s.write.state == "PROC"
        assert d.totals("push_watchdog_expired") == 0
        if ends == "completes_after_the_bound":
            s.land_while_p_holds()
        else:
            _end_in_error(env, s.write)
    env.run_until(lambda: d_id in d.finished and d_id in d.recv_reports)
    env.run_until(lambda: p_id in p.finished_sending)
    if ends == "fails_after_the_bound":
        s.assert_load_failed_with_nothing_landed()
    else:
        s.assert_served()
    env.settle()
    env.assert_clean()  # P's blocks too: freed once NIXL ended the WRITE


@pytest.mark.timeout(60)
def test_the_lease_is_never_extended_past_its_cap(env: PushEnv) -> None:
    """The writer is stuck (held here) before it could post the WRITE: P's lease
    (0.3 s) is extended while a WRITE may still read the blocks, but only up to the
    lease plus 2 x push_write_timeout_s, where the engine thread frees them (an error).
    The writer, running again, posts nothing on them and tells D, which fails the load:
    not a byte moved."""
    lease, write_timeout = 0.3, 1.0
    p, d = env.pair(
        p_kw={"extra_config": {"kv_lease_duration": lease, "push_write_timeout_s": write_timeout}}
    )
    prompt = _prompt(6)
    d_id, p_id = "cmpl-lc-0-bbbbbbbb", "cmpl-lc-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    env.run_until(lambda: pending_regs(p.workers[0]) == 1)
    wait_until(lambda: p.workers[0].remote_agents_of("D"), what="P connected to D")
    (d_blocks,) = d.scheduler.kv_cache_manager.get_block_ids(d_id)
    d_before = d.snapshot()
    lease_end = _watch_lease_end(p, p_id)
    started = time.perf_counter()
    with HeldWriter(p.workers[0]), capture_logs(WORKER_LOG) as logs:
        p.add_request(p_id, prompt, p.p_leg())
        wait_until(lambda: lease_end, step=p.engine_step, what="P's lease")
        _step_across_the_cap(p, lease_end[0] + 2 * write_timeout)
        wait_until(lambda: p_id in p.finished_sending, step=p.engine_step, timeout=10)
        freed_at = time.perf_counter()
        # Held past the lease (it began after `started`) by the WRITE's deadline and as
        # much again: a lower bound, which a slow host cannot break ...
        assert freed_at - started >= lease + 2 * write_timeout
        # ... and freed with the writer held: by the engine thread's cap
        assert p.totals("push_failed_lease_cap") == 1
        assert any("past its lease" in r.getMessage() for r in logs)
        assert p_id not in p.scheduler.requests and p.free_blocks() == p.initial_free_blocks
        assert not p.agents[0].calls("transfer")
    env.run_until(lambda: d_id in d.finished, what="P tells D")
    assert not env.fabric.transfers() and not p.agents[0].calls("transfer")  # nothing posted
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    assert set(d_blocks) <= d.invalid_block_ids and d.recv_reports[d_id] == 1
    assert len(notifs(env.fabric, PUSH_FAIL_PREFIX)) == 1
    assert not completions(env.fabric, d_id)
    assert_untouched(d, d_before, ())
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_running_write_keeps_the_blocks_past_the_lease_cap(env: PushEnv) -> None:
    """The writer is stuck (held here) right after it posted a WRITE NIXL cannot
    cancel: at the lease cap (lease + 2 x push_write_timeout_s) P does not free the
    blocks, since NIXL may still read them (S-SAFE-1); D keeps waiting. When the WRITE
    lands it reads P's blocks while P holds them, D serves P's KV, and P frees its
    blocks once the writer saw the WRITE end."""
    lease, write_timeout = 0.3, 1.0
    s, stop = _stuck_write(
        env, "lp", {"kv_lease_duration": lease, "push_write_timeout_s": write_timeout},
        register_first=True, stop_after_post=True,
    )  # fmt: skip
    assert stop is not None
    p, d, p_id, d_id = s.p, s.d, s.p_id, s.d_id
    try:
        assert stop.stopped.wait(20)
        wait_until(lambda: s.lease_end, step=p.engine_step, what="P's lease")
        _step_across_the_cap(p, s.lease_end[0] + 2 * write_timeout)
        with capture_logs(WORKER_LOG) as logs:
            wait_until(
                lambda: p.totals("push_lease_cap_pinned") == 1, step=p.engine_step, timeout=10,
                what="the lease cap",
            )  # fmt: skip
        assert time.perf_counter() - s.started >= lease + 2 * write_timeout
        assert any("stay held until NIXL ends it" in r.getMessage() for r in logs)
        _steps(env, 10)  # past the cap, both engines step; P's writer still waits
        assert p.totals("push_failed_lease_cap") == 0 and p_id not in p.finished_sending
        s.assert_held_and_untold()
        assert s.write.state == "PROC"
        s.land_while_p_holds()
    finally:
        stop.release()
    env.run_until(lambda: p_id in p.finished_sending and d_id in d.finished)
    s.assert_served()
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_slow_step_at_the_lease_cap_frees_no_blocks_a_running_write_reads(
    env: PushEnv,
) -> None:
    """As above, but P's engine thread is slow right after the lease keeper decided, in
    a step near the cap, before vLLM's reaper looks at the leases: the blocks must still
    stay held while NIXL runs the WRITE (S-SAFE-1)."""
    lease, write_timeout = 0.3, 1.0
    s, stop = _stuck_write(
        env, "ls", {"kv_lease_duration": lease, "push_write_timeout_s": write_timeout},
        register_first=True, stop_after_post=True,
    )  # fmt: skip
    assert stop is not None
    p, d, p_id, d_id = s.p, s.d, s.p_id, s.d_id
    worker = p.workers[0]
    keeper = worker._hold_leases

    def slow_after_the_keeper() -> None:
        keeper()
        expiry = worker._reqs_to_send.get(p_id)
        if expiry is not None and expiry - time.perf_counter() < HOLD_S / 2:
            # a lease set to expire this soon is at its cap: the thread stalls until then
            time.sleep(max(0.0, expiry - time.perf_counter()) + 0.01)

    worker._hold_leases = slow_after_the_keeper  # type: ignore[method-assign]
    try:
        assert stop.stopped.wait(20)
        wait_until(
            lambda: p_id in p.finished_sending or p.totals("push_lease_cap_pinned") == 1,
            step=p.engine_step, timeout=10, what="the lease cap",
        )  # fmt: skip
        freed_while_running = p_id in p.finished_sending and s.write.state == "PROC"
    finally:
        worker._hold_leases = keeper  # type: ignore[method-assign]
        stop.release()
        env.fabric.progress(p.agents[0].name)  # the WRITE ends
        env.run_until(lambda: d_id in d.finished and not live_xfer_handles(env.fabric))
    assert not freed_while_running, "P freed blocks a running WRITE reads"
    assert s.landings == [(True, p.initial_free_blocks - len(s.p_blocks))]


@pytest.mark.timeout(60)
def test_a_write_waiting_for_its_handshake_times_out(env: PushEnv) -> None:
    """The handshake with D never ends: the matched WRITE's deadline still applies."""
    p, d = env.pair(p_kw={"extra_config": {"push_write_timeout_s": 0.3}})
    gate = HandshakeGate(p.workers[0])
    prompt = _prompt(7)
    d_id, p_id = "cmpl-hw-0-bbbbbbbb", "cmpl-hw-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg())
    env.run_until(lambda: p_id in p.finished_sending, what="P gives up and frees its blocks")
    assert p.totals("push_failed_write_timeout") == 1 and not env.fabric.transfers()
    gate.open()  # connected after all: D is told now, once
    env.run_until(lambda: d_id in d.finished)
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    assert len(notifs(env.fabric, PUSH_FAIL_PREFIX)) == 1
    env.settle()
    env.assert_clean()


# -- P's heartbeats renew D's watchdog while P holds the request ---------------------------------


@pytest.mark.timeout(60)
def test_heartbeats_renew_the_watchdog_while_p_holds_the_request(env: PushEnv) -> None:
    """D's watchdog is 3 s; P's request stays queued for 4.5 s (P steps, but schedules
    nothing). P renews D's registration meanwhile (every 0.75 s), so D keeps waiting and
    is served. (A 1.5 s watchdog left too little room for a stalled step on a loaded
    host: a CI run once failed the request.)"""
    p, d = env.pair(d_kw={"extra_config": {"push_registration_timeout_s": 3.0}})
    prompt = _prompt(8)
    d_id, p_id = "cmpl-hb-0-bbbbbbbb", "cmpl-hb-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg("hb"), max_tokens=2)
    env.run_until(lambda: pending_regs(p.workers[0]) == 1)
    p.add_request(p_id, prompt, p.p_leg("hb"))  # live: queued in P's scheduler
    deadline = time.monotonic() + 4.5
    while time.monotonic() < deadline:  # P's engine loop, with nothing scheduled
        p.connector_step()
        d.engine_step()
        time.sleep(0.01)
    assert d.totals("push_watchdog_expired") == 0
    assert p.totals("push_heartbeats_sent") >= 3 and d.totals("push_heartbeats_received") >= 3
    assert d.scheduler.requests[d_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    env.run_until(lambda: d_id in d.finished)  # now P runs the request
    env.settle()
    assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_p_that_merely_holds_the_registration_does_not_renew(env: PushEnv) -> None:
    """No P request will serve the registration (the proxy lost the P leg): P sends no
    heartbeat and D's watchdog ends the request."""
    p, d = env.pair(d_kw={"extra_config": {"push_registration_timeout_s": 0.5}})
    d_id = "cmpl-nh-0-bbbbbbbb"
    d.add_request(d_id, _prompt(9), p.d_leg(), max_tokens=2)
    env.run_until(lambda: d_id in d.finished, what="D's watchdog")
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    assert p.totals("push_heartbeats_sent") == 0 and not notifs(env.fabric, PUSH_HB_PREFIX)
    env.settle()
    env.assert_clean()


# -- registrations after P released the blocks are answered at once -----------------------------


@pytest.mark.timeout(60)
def test_a_late_registration_is_answered_at_once(env: PushEnv) -> None:
    """P's lease ended before D registered: P answers the PUSH_REG with a PUSH_FAIL
    instead of keeping it for 0.8 x D's watchdog; D fails the request now."""
    p, d = env.pair(p_kw={"extra_config": {"kv_lease_duration": 0.3}})
    prompt = _prompt(10)
    d_id, p_id = "cmpl-lt-0-bbbbbbbb", "cmpl-lt-0-aaaaaaaa"
    p.add_request(p_id, prompt, p.p_leg("lt"))
    env.run_until(lambda: p_id in p.finished_sending, what="P's lease ends unmatched")
    wait_until(lambda: held_finished(p.workers[0]) == 0, step=env.step_all)
    t0 = time.monotonic()
    d.add_request(d_id, prompt, p.d_leg("lt"), max_tokens=2)
    env.run_until(lambda: d_id in d.finished)
    assert time.monotonic() - t0 < 10
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    assert p.totals("push_regs_late") == 1 and pending_regs(p.workers[0]) == 0
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("secret", [None, "s" * 32])
def test_a_d_request_queued_past_p_lease_is_served(env: PushEnv, secret: str | None) -> None:
    """P finished the prefill (lease 3 s); the D request waits in D's queue for 5 s
    before it gets blocks (both engines healthy). D's lease heartbeat names its transfer
    id meanwhile (with the proof of the legs' secret, when they carry one), P holds the
    blocks, and the request is served. Before: P's lease ended, the late registration
    got a PUSH_FAIL and the client an error (push D legs carry no remote_request_id, so
    vLLM's heartbeat never ran)."""
    legs = {"transfer_secret": secret} if secret else {}
    p, d = env.pair(
        p_kw={"extra_config": {"kv_lease_duration": 3}},
        d_kw={"extra_config": {"kv_lease_duration": 6}},  # D's heartbeat every 1 s
    )
    prompt = _prompt(12)
    d_id, p_id = "cmpl-qd-0-bbbbbbbb", "cmpl-qd-0-aaaaaaaa"
    p.add_request(p_id, prompt, p.p_leg("qd", **legs))
    env.run_until(lambda: held_finished(p.workers[0]) == 1, what="P holds the prefilled blocks")
    d.add_request(d_id, prompt, p.d_leg("qd", **legs), max_tokens=2)
    queued_until = time.monotonic() + 5.0
    while time.monotonic() < queued_until:  # D's engine loop, its request still queued
        d.connector_step()
        p.engine_step()
        time.sleep(0.01)
    assert p_id not in p.finished_sending, "P let the blocks go while D still wanted them"
    assert p.totals("push_leases_renewed_queued") >= 2
    assert p.totals("push_notifs_forged") == 0
    env.run_until(lambda: d_id in d.finished)
    assert d.finished[d_id].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert p.totals("push_regs_late") == 0
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_duplicate_registration_after_eviction_is_dropped(env: PushEnv) -> None:
    p, d = env.pair()
    prompt = _prompt(11)
    d_id, p_id = "cmpl-de-0-bbbbbbbb", "cmpl-de-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    p.add_request(p_id, prompt, p.p_leg())
    env.run_until(lambda: d_id in d.finished)
    env.settle()
    (original,) = notifs(env.fabric, PUSH_REG_PREFIX)
    env.fabric.inject_notif(p.agents[0].name, original.sender, original.msg)
    env.run_until(lambda: p.totals("push_regs_duplicate") == 1)
    assert pending_regs(p.workers[0]) == 0 and not notifs(env.fabric, PUSH_FAIL_PREFIX)
    env.settle()
    env.assert_clean()


# -- the writer's catch-all settles the request it was working on --------------------------------


@pytest.mark.timeout(60)
def test_an_unexpected_error_settles_the_request_on_p(env: PushEnv) -> None:
    p, d = env.pair()
    prompt = _prompt(12)
    d_id, p_id = "cmpl-ie-0-bbbbbbbb", "cmpl-ie-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(), max_tokens=2)
    env.run_until(lambda: pending_regs(p.workers[0]) == 1)
    wait_until(lambda: p.workers[0].remote_agents_of("D"), what="P connected to D")
    writes = p.workers[0].writer.writes
    with mock.patch.object(writes, "_prepare", side_effect=RuntimeError("bug")):
        p.add_request(p_id, prompt, p.p_leg())
        env.run_until(lambda: p_id in p.finished_sending and d_id in d.finished)
    assert p.totals("push_failed_internal") >= 1 and p.workers[0].writer.alive
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR  # told, not at its watchdog
    env.settle()
    env.assert_clean()


@pytest.mark.timeout(60)
def test_an_unexpected_error_settles_the_request_on_d(env: PushEnv) -> None:
    p, d = env.pair()
    d_id = "cmpl-id-0-bbbbbbbb"
    writer = d.workers[0].writer
    with mock.patch.object(writer.registrations, "_registration", side_effect=RuntimeError("bug")):
        d.add_request(d_id, _prompt(13), p.d_leg(), max_tokens=2)
        env.run_until(lambda: d_id in d.finished)
    assert d.totals("push_failed_internal") == 1 and writer.alive
    assert d.finished[d_id].status == RequestStatus.FINISHED_ERROR
    env.settle()
    env.assert_clean()
