# SPDX-License-Identifier: Apache-2.0
"""Probes of what crossed the fake NIXL fabric (notifications, completions, PUSH_REG
reply tokens) and of the writer threads (its rendezvous tables, which thread made each
NIXL call, held handshakes and passes, self-polling)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from devkit.testing.fake_nixl import FakeNixlFabric
from devkit.testing.inproc import wait_until
from vllm_ext.nixl_push.wire import (
    HEARTBEAT_PREFIX,
    PUSH_REG_PREFIX,
    Completion,
    PushRegistration,
    parse_notif,
)
from vllm_ext.nixl_push.worker import NixlPushConnectorWorker
from vllm_ext.nixl_push.writer import IDLE_NOTIF_POLL_S, WRITER_THREAD_NAME

if TYPE_CHECKING:
    from push_engine import Engine

#: NIXL calls that push makes and that only the writer thread may make (S-WRT-1);
#: ``send_notif`` of vLLM's ``HB:`` heartbeats is the one allowed exception.
WRITER_ONLY_CALLS = (
    "get_new_notifs",
    "send_notif",
    "initialize_xfer",
    "make_prepped_xfer",
    "transfer",
    "check_xfer_state",
)


def push_reg_token(fabric: FakeNixlFabric, d_request_id: str) -> str:
    """The reply token (S-WIR-3) of the PUSH_REG D sent for ``d_request_id``."""
    for n in notifs(fabric, PUSH_REG_PREFIX):
        reg = parse_notif(n.msg)
        if isinstance(reg, PushRegistration) and reg.request_id == d_request_id:
            assert reg.reply_token is not None
            return reg.reply_token
    raise AssertionError(f"no PUSH_REG of {d_request_id}")


def completion(notif: bytes | None) -> tuple[str, int] | None:
    """(D request id, P tp size) of the completion a WRITE carries (None: none)."""
    if not notif:
        return None
    n = parse_notif(notif)
    assert isinstance(n, Completion), f"not a completion: {notif!r}"
    return n.request_id, n.tp_size


def pending_regs(w: NixlPushConnectorWorker) -> int:
    """P: registrations waiting for their blocks in the writer's rendezvous."""
    return len(w.writer.writes.rendezvous._pending_d_registrations)


def held_finished(w: NixlPushConnectorWorker) -> int:
    """P: finished requests held in the writer's rendezvous."""
    return len(w.writer.writes.rendezvous._push_finished_blocks)


def notifs(fabric: FakeNixlFabric, prefix: bytes = b"", via: str | None = None) -> list[Any]:
    """Delivered notifications starting with ``prefix`` (and sent ``via``, if given)."""
    return [
        n
        for n in fabric.notifications()
        if n.msg.startswith(prefix) and (via is None or n.via == via)
    ]


def completions(fabric: FakeNixlFabric, d_request_id: str, via: str | None = None) -> list[Any]:
    """Delivered completions of ``d_request_id`` (and sent ``via``, if given)."""
    return [
        n
        for n in notifs(fabric, via=via)
        if (completion_or_none(n.msg) or ("",))[0] == d_request_id
    ]


def completion_or_none(msg: bytes | None) -> tuple[str, int] | None:
    n = parse_notif(msg) if msg else None
    return (n.request_id, n.tp_size) if isinstance(n, Completion) else None


class HandshakeGate:
    """Hold a worker's handshakes (vLLM's ``_nixl_handshake``) until :meth:`open`.

    Counts the handshakes started, so tests can check nothing is retried. A handshake
    held longer than :attr:`HOLD_LIMIT_S` fails (a test that never opens its gate): well
    past what a test holds on a loaded machine, well within a test's own time limit.
    """

    HOLD_LIMIT_S = 30.0

    def __init__(self, worker: NixlPushConnectorWorker, closed: bool = True) -> None:
        self.worker = worker
        self.started = 0
        self.finished = 0
        self._open = threading.Event()
        if not closed:
            self._open.set()
        original = worker._nixl_handshake

        def gated(*args: Any, **kwargs: Any) -> Any:
            self.started += 1
            try:
                if not self._open.wait(self.HOLD_LIMIT_S):
                    raise TimeoutError("handshake gate never opened")
                return original(*args, **kwargs)
            finally:
                self.finished += 1

        worker._nixl_handshake = gated  # type: ignore[method-assign]

    def open(self) -> None:
        self._open.set()


def assert_nixl_calls_on_writer(fabric: FakeNixlFabric) -> dict[str, int]:
    """S-WRT-1: every push NIXL call (WRITER_ONLY_CALLS) of every agent ran on the writer
    thread, except ``send_notif`` of vLLM's ``HB:`` heartbeats, which stay on the engine's
    main thread. Returns the number of calls checked per method."""
    checked: dict[str, int] = {}
    for agent in fabric.agents():
        heartbeats = sum(
            1
            for n in fabric.notifications()
            if n.sender == agent.name
            and n.via == "send_notif"
            and n.msg.startswith(HEARTBEAT_PREFIX)
        )
        for method in WRITER_ONLY_CALLS:
            calls = agent.calls(method)
            checked[method] = checked.get(method, 0) + len(calls)
            off = [c.thread for c in calls if c.thread != WRITER_THREAD_NAME]
            if method == "send_notif":
                # (the engine thread is the test's thread: it runs every engine step)
                assert set(off) <= {threading.current_thread().name}, (agent.name, off)
                assert len(off) == heartbeats, (
                    f"{agent.name}: {len(off)} send_notif off the writer, "
                    f"{heartbeats} of them heartbeats"
                )
            else:
                assert not off, f"{agent.name}.{method} called on {sorted(set(off))}"
    return checked


class HeldWriter:
    """Hold a writer thread between passes: while held, a woken writer waits before its
    next pass, so everything the engine thread enqueues meanwhile lands in one pass."""

    def __init__(self, worker: NixlPushConnectorWorker) -> None:
        self._lock = threading.Lock()
        self.passes = 0
        writer = worker.writer
        original = writer.step

        def held_step() -> None:
            with self._lock:
                self.passes += 1
                original()

        writer.step = held_step  # type: ignore[method-assign]

    def __enter__(self) -> HeldWriter:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def notif_reads(engine: Engine) -> int:
    """``get_new_notifs`` calls made so far on the engine's agents (by its writers)."""
    return sum(len(a.calls("get_new_notifs")) for a in engine.agents)


def assert_self_polls(engine: Engine, n: int = 3, timeout: float = 10.0) -> None:
    """The engine's writer reads notifications again and again with no engine step."""
    before = notif_reads(engine)
    wait_until(lambda: notif_reads(engine) >= before + n, timeout, what="writer self-polls")


def assert_writer_sleeps(engine: Engine, window: float = 0.5, timeout: float = 10.0) -> None:
    """The engine's writer does not self-poll: without a step it reads notifications
    only at its idle period (``IDLE_NOTIF_POLL_S``), not at the busy one (1 ms), once a
    pass that was already running has had time to end."""
    idle_reads = window / IDLE_NOTIF_POLL_S + 2

    def quiet(seconds: float) -> bool:
        before = notif_reads(engine)
        time.sleep(seconds)
        return notif_reads(engine) - before <= seconds / IDLE_NOTIF_POLL_S + 2

    wait_until(lambda: quiet(0.1), timeout, what="writer goes back to sleep")
    before = notif_reads(engine)
    time.sleep(window)
    reads = notif_reads(engine) - before
    assert reads <= idle_reads, f"the writer still polls by itself ({reads} reads in {window}s)"
