# SPDX-License-Identifier: Apache-2.0
"""The fake NIXL's in-process network (:class:`FakeNixlFabric`): agents join it by name;
it completes transfers, injects failures and cuts links, and reports leaks."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from devkit.testing.fake_nixl.errors import (
    _FAILURE_KINDS,
    FailureKind,
    FakeNixlLeakError,
    FakeNixlUsageError,
)
from devkit.testing.fake_nixl.faults import (
    DetachedTransfer,
    ReleaseInFlight,
    UcxFaults,
)
from devkit.testing.fake_nixl.memory import _msg, _name
from devkit.testing.fake_nixl.transfers import (
    FakePreppedDlistHandle,
    FakeXferHandle,
    NotifRecord,
    TransferRecord,
    WriteLanding,
)

if TYPE_CHECKING:
    from devkit.testing.fake_nixl.agent import FakeNixlAgent

# ------------------------------------------------------------------------------ fabric


class FakeNixlFabric(UcxFaults):
    """The in-process network that ``FakeNixlAgent`` instances join by name.

    Args:
        complete_after_polls: a posted transfer completes (copies, notifies) on
            its n-th ``check_xfer_state``; 0 completes inside ``transfer()``.
        strict_release: releasing a handle twice raises ``FakeNixlUsageError``.
        release_in_flight: ``detach`` (UCX: a transfer released in flight may still
            land) or ``cancel`` (nothing of it lands).
    """

    def __init__(
        self,
        *,
        complete_after_polls: int = 2,
        strict_release: bool = True,
        release_in_flight: ReleaseInFlight = "detach",
    ) -> None:
        if complete_after_polls < 0:
            raise ValueError("complete_after_polls must be >= 0")
        self._init_ucx_faults(release_in_flight)
        self.complete_after_polls = complete_after_polls
        self.strict_release = strict_release
        self.fabric_id = uuid.uuid4().hex
        self._lock = threading.RLock()
        self._agents: dict[str, FakeNixlAgent] = {}
        self._ids = itertools.count(1)
        self._live_xfers: dict[int, FakeXferHandle] = {}
        self._live_dlists: dict[int, FakePreppedDlistHandle] = {}
        self._failures: list[tuple[str, str | None]] = []
        self._transfers: list[TransferRecord] = []
        self._notifs: list[NotifRecord] = []
        self._hold: Callable[[NotifRecord], bool] | None = None
        self._held: list[NotifRecord] = []
        self._write_observers: list[Callable[[WriteLanding], None]] = []
        self._cut: set[frozenset[str]] = set()

    # -- agents
    def _join(self, agent: FakeNixlAgent) -> None:
        with self._lock:
            if agent.name in self._agents:
                raise FakeNixlUsageError(f"an agent named {agent.name!r} is already on the fabric")
            self._agents[agent.name] = agent

    def _leave(self, agent: FakeNixlAgent) -> None:
        with self._lock:
            if self._agents.get(agent.name) is agent:
                del self._agents[agent.name]

    def agent(self, name: str | bytes) -> FakeNixlAgent:
        """The agent called ``name`` (KeyError if none)."""
        with self._lock:
            return self._agents[_name(name)]

    def agents(self) -> list[FakeNixlAgent]:
        """The agents on the fabric, in joining order."""
        with self._lock:
            return list(self._agents.values())

    # -- completion and failures
    def progress(self, initiator: str | bytes | None = None) -> int:
        """Complete every in-flight transfer (of ``initiator`` only, if given), and do
        with every detached one what ``detached_fate`` says (default: it lands, then
        its notification), oldest first (newest first after ``reorder_landings``).

        Returns the number of in-flight transfers completed (successfully or not).
        """
        with self._lock:
            self._tick()
            who = None if initiator is None else _name(initiator)
            pending = [
                h
                for h in self._live_xfers.values()
                if h.state == "PROC"
                and (who is None or h._agent.name == who)
                and not (h.stalled and self.link_cut(h._agent.name, h.remote_agent))
            ]
            order: list[tuple[int, FakeXferHandle | DetachedTransfer]] = [
                *((h._handle, h) for h in pending),
                *(
                    (d.handle_id, d)
                    for d in self._detached
                    if (who is None or d.initiator == who)
                    and not (d.why == "cut" and self.link_cut(d.initiator, d.target))
                ),
            ]
            order.sort(key=lambda x: x[0], reverse=self._reorder)
            for _, x in order:
                if isinstance(x, DetachedTransfer):
                    self._progress_detached(x)
                elif x.state == "PROC":
                    x._agent._complete(x)
            return len(pending)

    def pending_transfers(self) -> list[FakeXferHandle]:
        """Live handles whose transfer is in flight (state ``PROC``)."""
        with self._lock:
            return [h for h in self._live_xfers.values() if h.state == "PROC"]

    def fail_next_transfer(
        self, kind: FailureKind = "post", *, initiator: str | bytes | None = None
    ) -> None:
        """Make the next ``transfer()`` (of ``initiator``, if given) fail.

        ``post``: ``transfer()`` returns ``"ERR"``; ``post_raise``: it raises
        ``FakeNixlBackendError``; ``state``: the transfer ends in ``"ERR"``
        instead of ``"DONE"``; ``state_raise``: ``check_xfer_state`` raises
        ``FakeNixlBackendError`` at that point. No byte is copied and no
        notification is sent in any of these. ``hang``: the transfer stays in
        ``"PROC"`` until :meth:`progress` completes it (normally: bytes and
        notification); ``hang_uncancellable``: the same, and releasing it while
        in flight raises ``FakeNixlBackendError`` and keeps the handle;
        ``hang_state_raise``: like ``hang_uncancellable``, and ``check_xfer_state``
        raises while it is in flight (the transfer still runs). Calls queue up, first
        in first out.
        """
        if kind not in _FAILURE_KINDS:
            raise ValueError(f"kind must be one of {_FAILURE_KINDS}, got {kind!r}")
        with self._lock:
            self._failures.append((kind, None if initiator is None else _name(initiator)))

    def _take_failure(self, initiator: str) -> str | None:
        for i, (kind, who) in enumerate(self._failures):
            if who is None or who == initiator:
                del self._failures[i]
                return kind
        return None

    def inject_notif(self, receiver: str | bytes, sender: str | bytes, msg: bytes | str) -> None:
        """Deliver ``msg`` to ``receiver`` as if ``sender`` had sent it (no checks at all).

        For tests of untrusted-notification handling (empty, non-UTF-8, ...).
        """
        with self._lock:
            self.agent(receiver)._deliver(_name(sender), _msg(msg), "inject")

    # -- a misbehaving network (model checks, partitions)
    def cut_link(self, a: str | bytes, b: str | bytes, *, stale_writes: bool = False) -> None:
        """Partition agents ``a`` and ``b`` long enough for UCX to declare their
        endpoints failed: ``send_notif`` and new transfers between them fail (what is
        sent is lost), and an endpoint loaded during the cut fails too. After
        :meth:`restore_link` the failed endpoints stay failed, as UCX's do, until the
        agent removes the peer and loads its metadata again. Transfers already in flight
        are the test's to complete or fail (``hang`` kinds); with ``stale_writes`` they
        stall instead, as over UCX (N-REL-1: a WRITE to a peer behind a cut stayed in
        progress): polls leave them in ``"PROC"``, ``progress()`` passes them by while
        the link is cut, and they land at the first ``progress()`` after
        :meth:`restore_link`, released meanwhile or not (then detached)."""
        pair = frozenset((_name(a), _name(b)))
        with self._lock:
            self._tick()
            self._cut.add(pair)
            if stale_writes or self._ucx_cuts:
                for h in self._live_xfers.values():
                    if h.state == "PROC" and frozenset((h._agent.name, h.remote_agent)) == pair:
                        h.stalled = True
                        if self._ucx_cuts:
                            self._stalled_at[h._handle] = time.monotonic()
            if self._ucx_cuts:
                return  # endpoints fail only once a send waited T (ucx_partitions)
            for x, y in (tuple(pair), tuple(pair)[::-1]):
                view = self._agents[x]._remotes.get(y) if x in self._agents else None
                if view is not None:
                    view.failed = True

    def restore_link(self, a: str | bytes, b: str | bytes) -> None:
        """End the partition of :meth:`cut_link` (failed endpoints stay failed)."""
        with self._lock:
            self._tick()
            self._cut.discard(frozenset((_name(a), _name(b))))
            self._link_restored(_name(a), _name(b))

    def link_cut(self, a: str, b: str) -> bool:
        with self._lock:
            return frozenset((a, b)) in self._cut

    def complete(self, handle: FakeXferHandle, *, ok: bool = True) -> bool:
        """Complete one in-flight transfer now (e.g. a hung one, out of order); with
        ``ok`` False it ends in ``"ERR"`` instead, as an injected ``state`` failure
        (``failed_writes_land`` applies). False if it is not in flight."""
        with self._lock:
            if handle.state != "PROC" or handle._released:
                return False
            if not ok:
                handle.fail_mode = "state"
            handle._agent._complete(handle)
            return True

    def hold_notifs(self, predicate: Callable[[NotifRecord], bool] | None) -> None:
        """From now on keep every notification ``predicate`` matches in the network
        instead of delivering it (``None``: deliver all again; held ones stay held)."""
        with self._lock:
            self._hold = predicate

    def held_notifs(self) -> list[NotifRecord]:
        """Notifications held in the network, oldest first."""
        with self._lock:
            return list(self._held)

    def release_held(self, index: int = 0) -> NotifRecord:
        """Deliver the ``index``-th held notification now (after later ones, maybe)."""
        with self._lock:
            rec = self._held.pop(index)
            target = self._agents.get(rec.receiver)
            if target is not None:
                target._deliver(rec.sender, rec.msg, rec.via, hold=False)
            return rec

    def drop_held(self, index: int = 0) -> NotifRecord:
        """Lose the ``index``-th held notification."""
        with self._lock:
            return self._held.pop(index)

    def observe_writes(self, callback: Callable[[WriteLanding], None]) -> None:
        """Call ``callback`` (under the fabric lock, on the thread completing the
        transfer) each time a WRITE's bytes land, before its notification."""
        with self._lock:
            self._write_observers.append(callback)

    # -- records
    def transfers(self) -> list[TransferRecord]:
        """Finished transfers in completion order (DONE, ERR, CANCELLED)."""
        with self._lock:
            return list(self._transfers)

    def notifications(self) -> list[NotifRecord]:
        """Every notification delivered on the fabric, in delivery order."""
        with self._lock:
            return list(self._notifs)

    # -- leaks
    def live_handles(
        self, agent: str | bytes | None = None
    ) -> list[FakeXferHandle | FakePreppedDlistHandle]:
        """Unreleased transfer and prepped-dlist handles (of one agent, if given)."""
        with self._lock:
            handles: list[FakeXferHandle | FakePreppedDlistHandle] = [
                *self._live_xfers.values(),
                *self._live_dlists.values(),
            ]
            if agent is not None:
                handles = [h for h in handles if h._agent.name == _name(agent)]
            return sorted(handles, key=lambda h: h._handle)

    def assert_no_leaks(self, *, include_memory: bool = False) -> None:
        """Raise ``FakeNixlLeakError`` listing every unreleased handle.

        With ``include_memory``, memory still registered by any agent counts too.
        """
        with self._lock:
            lines = [f"  {h!r}" for h in self.live_handles()]
            if include_memory:
                for a in self._agents.values():
                    lines += [f"  agent {a.name!r} still registers {r}" for r in a._regions]
            if lines:
                raise FakeNixlLeakError(
                    f"{len(lines)} leaked NIXL resource(s):\n" + "\n".join(lines)
                )
