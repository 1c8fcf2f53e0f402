# SPDX-License-Identifier: Apache-2.0
"""What a NIXL transfer may still do once its initiator stopped watching it (UCX).

The fake fabric (``fake_nixl/fabric.py``) mixes :class:`UcxFaults` in. It holds the
transfers that left their initiator's hands while their bytes may still be on the
way (:class:`DetachedTransfer`), and decides what the fabric does with them. Nothing
here is a promise NIXL makes; each is something its UCX backend does not rule out:

* **Released while in flight** (``release_in_flight="detach"``, the default):
  ``release_xfer_handle`` on a transfer in ``"PROC"`` returns success and the handle
  is gone, but the transfer is *detached*: its bytes still land, read from the source
  when they land (what P wrote there since included), at the next
  ``FakeNixlFabric.progress()`` or whenever the test says
  (:meth:`UcxFaults.land_detached`: all or a part), or never. That is what NIXL 1.5.1
  over UCX did in every measured release (docs/design.md, N-REL-1: the WRITE went on
  in full, also across a link cut; its notification never came, since it dies with
  the handle). ``detached_fate("land")`` / ``land_detached(notify=True)`` deliver the
  notification too, beyond what was measured. ``"cancel"`` is the kind model (no
  byte, no notification), for tests that want it explicitly.
* **Failed WRITEs land partly** (:meth:`UcxFaults.failed_writes_land`, opt-in): a
  WRITE that ends in ``"ERR"`` (an injected ``state`` failure, or the initiator
  removed the target agent) may have landed a part of its bytes before the error,
  and with ``later=True`` the rest may still arrive after the initiator saw
  ``"ERR"`` (detached): NIXL does not promise that an error status means the
  transfer's other requests are over (not measured).
* **A cut link leaves its WRITEs on the wire** (``cut_link(..., stale_writes=True)``):
  the WRITEs in flight between the two agents stall in ``"PROC"`` (N-REL-1: a WRITE
  to a peer behind a cut stayed in progress) and land once the link is back, released
  meanwhile or not (detached, ``why="cut"``): after anything the initiator sent since
  over a new endpoint.
* **Notifications overtake data** (:meth:`UcxFaults.reorder_landings`, opt-in):
  ``progress()`` lands newest first, so the data and notification of a later WRITE
  arrive before the data of an earlier one on the same pair (a detached one, or one
  still in flight), which may then overwrite them.

* **A cut link as UCX over TCP sees it** (``ucx_partitions()``, or
  ``VLLM_EXT_FAKE_NIXL_PARTITIONS=ucx`` for every fabric of a process; off: a cut fails
  every send at once): nothing fails at the cut. A ``send_notif`` over it returns as if
  sent and is queued; it is delivered if the link returns within the sender's TCP user
  timeout *T* of the send, and otherwise the sender's endpoint fails then (every send
  queued on it is lost, later sends raise). A WRITE on the link stalls in ``"PROC"`` and
  lands once the link is back, or ends in ``"ERR"`` *T* (the initiator's) after it
  stalled; its bytes are then detached (``why="cut"``) and still land once the link is
  back, within 2 x *T* of the error (N-REL-2) or, with ``late_rest`` of the time (seeded),
  up to three times that. Each agent's *T* is what ``UCX_TCP_USER_TIMEOUT`` said when the
  agent was built (a UCX context reads it then), so *T* differs per side as the
  connector configures it; unset or unbounded: none of this ever times out. The side
  channel shares the link: loading a peer's metadata across a cut raises (a real
  handshake times out on the side channel), so a handshake never proves a cut peer alive.

A WRITE the initiator saw ``"DONE"`` has landed (its bytes are in place then); its
notification may still come later (``hold_notifs`` with ``via == "xfer"``).

Every method runs under the fabric lock.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import threading

    from devkit.testing.fake_nixl.agent import FakeNixlAgent
    from devkit.testing.fake_nixl.transfers import FakeXferHandle, WriteLanding

ReleaseInFlight = Literal["detach", "cancel"]
#: what ``progress()`` does with detached transfers: ``land_silent`` (every byte, no
#: notification: N-REL-1, the default), ``land`` (every byte, then the notification),
#: ``part`` (half of what is left, no notification, the rest never), ``never``
#: (dropped) or ``keep`` (left for :meth:`UcxFaults.land_detached` /
#: :meth:`UcxFaults.drop_detached`)
DetachedFate = Literal["land", "land_silent", "part", "never", "keep"]
_FATES: tuple[str, ...] = ("land", "land_silent", "part", "never", "keep")
#: ``ucx``: every fabric of this process models cut links as UCX does (:meth:`UcxFaults.
#: ucx_partitions`), with the seed ``VLLM_EXT_FAKE_NIXL_SEED`` (default 0)
PARTITIONS_ENV = "VLLM_EXT_FAKE_NIXL_PARTITIONS"
SEED_ENV = "VLLM_EXT_FAKE_NIXL_SEED"
#: how much later than its 2 x T bound the rest of a failed WRITE may land, at most
LATE_REST_FACTOR = 3.0


@dataclasses.dataclass(frozen=True)
class QueuedSend:
    """A ``send_notif`` over a cut link that UCX still holds (:meth:`UcxFaults.
    ucx_partitions`): delivered if the link returns before ``expires_at``."""

    sender: str
    receiver: str
    msg: bytes
    expires_at: float


@dataclasses.dataclass(eq=False)
class DetachedTransfer:
    """A transfer its initiator no longer tracks whose bytes may still land.

    ``why``: ``released`` (released while in flight), ``failed`` (ended in ``"ERR"``,
    the rest of its bytes still on the way) or ``cut`` (released while stalled behind a
    cut link: it lands only once the link is back). ``landed_bytes``: how many of its
    bytes (in descriptor order) landed so far.
    """

    handle_id: int
    initiator: str
    target: str
    op: str
    notif: bytes
    total_bytes: int
    why: str
    landed_bytes: int = 0
    agent: FakeNixlAgent | None = dataclasses.field(default=None, repr=False)
    pairs: tuple[Any, ...] = dataclasses.field(default=(), repr=False)
    mem_types: tuple[str, str] = dataclasses.field(default=("DRAM", "DRAM"), repr=False)
    #: ``failed``: time.monotonic() after which none of it lands any more (the
    #: transport declared its connection dead: N-REL-2); None: no such bound
    dies_at: float | None = None


class UcxFaults:
    """The fabric's part that keeps detached transfers (see the module docstring)."""

    _lock: threading.RLock
    release_in_flight: ReleaseInFlight
    _agents: dict[str, FakeNixlAgent]
    _live_xfers: dict[int, FakeXferHandle]

    def link_cut(self, a: str, b: str) -> bool:
        raise NotImplementedError

    def _init_ucx_faults(self, release_in_flight: ReleaseInFlight) -> None:
        if release_in_flight not in ("detach", "cancel"):
            raise ValueError(
                f"release_in_flight must be 'detach' or 'cancel': {release_in_flight!r}"
            )
        self.release_in_flight = release_in_flight
        self._detached: list[DetachedTransfer] = []
        self._fate: str = "land_silent"
        self._failed_part: float | None = None
        self._failed_later = False
        self._failed_within_s: float | None = None
        self._reorder = False
        self._landings: list[WriteLanding] = []
        self._ucx_cuts = os.environ.get(PARTITIONS_ENV, "") == "ucx"
        self._rng = random.Random(int(os.environ.get(SEED_ENV, "0") or 0))
        self._late_rest = 0.0
        self._queued: list[QueuedSend] = []
        #: when each in-flight transfer stalled behind a cut (handle id -> monotonic)
        self._stalled_at: dict[int, float] = {}

    # -- knobs
    def detached_fate(self, fate: DetachedFate) -> None:
        """What :meth:`progress` does from now on with detached transfers (default
        ``land_silent``: every byte, no notification)."""
        if fate not in _FATES:
            raise ValueError(f"fate must be one of {_FATES}, got {fate!r}")
        with self._lock:
            self._fate = fate

    def failed_writes_land(
        self, part: float | None, *, later: bool = False, within_s: float | None = None
    ) -> None:
        """From now on a WRITE that ends in ``"ERR"`` (injected ``state`` /
        ``state_raise``, or its target removed by the initiator) lands ``part`` (0..1)
        of its bytes, in descriptor order, before the error is reported, without a
        notification; with ``later`` the rest is detached (``why="failed"``), and
        with ``within_s`` none of that rest lands once that long passed since the
        error (the transport's bound, twice its TCP user timeout: N-REL-2). ``None``
        (the default): nothing of a failed WRITE lands."""
        if part is not None and not 0.0 <= part <= 1.0:
            raise ValueError(f"part must be within [0, 1], got {part!r}")
        with self._lock:
            self._failed_part, self._failed_later = part, later
            self._failed_within_s = within_s

    def reorder_landings(self, on: bool = True) -> None:
        """From now on :meth:`progress` lands the newest transfers first (in flight and
        detached alike): a later WRITE's data and notification overtake an earlier
        one's data on the same pair."""
        with self._lock:
            self._reorder = on

    def ucx_partitions(
        self, on: bool = True, *, seed: int | None = None, late_rest: float = 0.0
    ) -> None:
        """Cut links behave as UCX over TCP (module docstring): sends are queued for up
        to the sender's TCP user timeout, WRITEs stall and fail after it, and with
        ``late_rest`` (0..1) of the failed WRITEs, picked with ``random.Random(seed)``,
        their rest lands past the 2 x T bound."""
        if not 0.0 <= late_rest <= 1.0:
            raise ValueError(f"late_rest must be within [0, 1], got {late_rest!r}")
        with self._lock:
            self._ucx_cuts, self._late_rest = on, late_rest
            if seed is not None:
                self._rng = random.Random(seed)

    @property
    def models_ucx_cuts(self) -> bool:
        return self._ucx_cuts

    def queued_sends(self) -> list[QueuedSend]:
        """Sends over a cut link still held, oldest first."""
        with self._lock:
            self._tick()
            return list(self._queued)

    # -- the detached transfers
    def detached(self) -> list[DetachedTransfer]:
        """Detached transfers whose bytes may still land, oldest first."""
        with self._lock:
            return list(self._detached)

    def land_detached(
        self, index: int = 0, part: float = 1.0, *, notify: bool = False
    ) -> WriteLanding | None:
        """Land ``part`` of what is left of the ``index``-th detached transfer now.

        Once every byte landed it is no longer detached and, with ``notify``, its
        notification is delivered (to the target, from the initiator's name, as a
        completion; UCX was never seen doing that, N-REL-1). Returns the landing, or
        None if nothing could land (target gone, memory deregistered: then it is
        dropped)."""
        if not 0.0 < part <= 1.0:
            raise ValueError(f"part must be within (0, 1], got {part!r}")
        with self._lock:
            d = self._detached[index]
            left = d.total_bytes - d.landed_bytes
            landing = self._land_detached(d, math.ceil(part * left), notify)
            if landing is None or d.landed_bytes >= d.total_bytes:
                self._detached.remove(d)
            return landing

    def drop_detached(self, index: int = 0) -> DetachedTransfer:
        """The ``index``-th detached transfer never lands (UCX did cancel it)."""
        with self._lock:
            return self._detached.pop(index)

    def landings(self) -> list[WriteLanding]:
        """Every WRITE landing so far (whole or partial, on time or late), in order."""
        with self._lock:
            return list(self._landings)

    # -- called by the fabric and its agents (under the lock)
    def _queue_send(self, sender: FakeNixlAgent, receiver: str, msg: bytes) -> None:
        t = sender.tcp_user_timeout_s
        self._queued.append(QueuedSend(sender.name, receiver, msg, time.monotonic() + t))

    def _rest_lands_within(self, t: float) -> float:
        """How long after its error the rest of a failed WRITE may still land."""
        bound = 2 * t
        if self._late_rest and self._rng.random() < self._late_rest:
            return bound * self._rng.uniform(1.0, LATE_REST_FACTOR)
        return bound

    def _tick(self) -> None:
        """Time out what waits behind a cut link (UCX's TCP user timeout)."""
        if not self._ucx_cuts or not (self._queued or self._stalled_at):
            return
        now = time.monotonic()
        for q in list(self._queued):
            if q in self._queued and now >= q.expires_at and self.link_cut(q.sender, q.receiver):
                self._endpoint_failed(q.sender, q.receiver)
        for hid, since in list(self._stalled_at.items()):
            h = self._live_xfers.get(hid)
            if h is None or h.state != "PROC" or not h.stalled:
                del self._stalled_at[hid]
                continue
            t = h._agent.tcp_user_timeout_s
            if now >= since + t and self.link_cut(h._agent.name, h.remote_agent):
                del self._stalled_at[hid]
                h.state, h.reason, h.stalled = "ERR", "the endpoint timed out behind a cut", False
                h._end_ns = time.monotonic_ns()
                h._agent._record(h)
                self._detach(h, "cut")
                self._detached[-1].dies_at = now + self._rest_lands_within(t)
                self._endpoint_failed(h._agent.name, h.remote_agent)

    def _endpoint_failed(self, sender: str, receiver: str) -> None:
        """``sender``'s endpoint to ``receiver`` failed: what it still queued is lost."""
        self._queued = [q for q in self._queued if (q.sender, q.receiver) != (sender, receiver)]
        agent = self._agents.get(sender)
        view = agent._remotes.get(receiver) if agent is not None else None
        if view is not None:
            view.failed = True

    def _link_restored(self, a: str, b: str) -> None:
        """Deliver what UCX still held for the link, in order; its stalled transfers go
        on (a poll may complete them)."""
        pair = {a, b}
        for hid in list(self._stalled_at):
            h = self._live_xfers.get(hid)
            if h is not None and {h._agent.name, h.remote_agent} == pair:
                h.stalled = False
                del self._stalled_at[hid]
        for q in [q for q in self._queued if {q.sender, q.receiver} == pair]:
            self._queued.remove(q)
            target = self._agents.get(q.receiver)
            if target is not None:
                target._deliver(q.sender, q.msg, "send_notif")

    def _detach(self, h: FakeXferHandle, why: str, landed: int = 0) -> None:
        self._detached.append(
            DetachedTransfer(
                handle_id=h._handle,
                initiator=h._agent.name,
                target=h.remote_agent,
                op=h.op,
                notif=h.notif,
                total_bytes=h.total_bytes,
                why=why,
                landed_bytes=landed,
                agent=h._agent,
                pairs=tuple(h.pairs),
                mem_types=h.mem_types,
            )
        )

    def _failed_write(self, h: FakeXferHandle) -> None:
        """A WRITE just ended in ERR with its target still there: land a part of it."""
        if self._failed_part is None or h.op != "WRITE":
            return
        n = math.ceil(self._failed_part * h.total_bytes)
        if n:
            h._agent._land(h.op, h.remote_agent, h.pairs, h.mem_types, 0, n, h.notif, "failed")
        if self._failed_later and n < h.total_bytes:
            self._detach(h, "failed", landed=n)
            if self._failed_within_s is not None:
                within = self._rest_lands_within(self._failed_within_s / 2)
                self._detached[-1].dies_at = time.monotonic() + within

    def _land_detached(self, d: DetachedTransfer, n: int, notify: bool) -> WriteLanding | None:
        assert d.agent is not None
        if d.dies_at is not None and time.monotonic() > d.dies_at:
            return None  # its connection was declared dead: dropped
        start, end = d.landed_bytes, min(d.total_bytes, d.landed_bytes + n)
        landing = d.agent._land(
            d.op, d.target, d.pairs, d.mem_types, start, end, d.notif, d.why,
        )  # fmt: skip
        if landing is None:
            return None
        d.landed_bytes = end
        if notify and end >= d.total_bytes and d.notif:
            d.agent._notify(d.target, d.notif)
        return landing

    def _progress_detached(self, d: DetachedTransfer) -> None:
        """What :meth:`progress` does with one detached transfer (its fate)."""
        fate = self._fate
        if fate == "keep":
            return
        self._detached.remove(d)
        left = d.total_bytes - d.landed_bytes
        if fate in ("land", "land_silent"):
            self._land_detached(d, left, notify=fate == "land")
        elif fate == "part" and left > 1:
            self._land_detached(d, left // 2, notify=False)
