# SPDX-License-Identifier: Apache-2.0
"""What a NIXL transfer may still do once its initiator stopped watching it (UCX).

The fake fabric (``fake_nixl.py``) mixes :class:`UcxFaults` in. It holds the
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

A WRITE the initiator saw ``"DONE"`` has landed (its bytes are in place then); its
notification may still come later (``hold_notifs`` with ``via == "xfer"``).

Every method runs under the fabric lock.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import threading

    from vllm_ext.testing.fake_nixl import FakeNixlAgent, FakeXferHandle, WriteLanding

ReleaseInFlight = Literal["detach", "cancel"]
#: what ``progress()`` does with detached transfers: ``land_silent`` (every byte, no
#: notification: N-REL-1, the default), ``land`` (every byte, then the notification),
#: ``part`` (half of what is left, no notification, the rest never), ``never``
#: (dropped) or ``keep`` (left for :meth:`UcxFaults.land_detached` /
#: :meth:`UcxFaults.drop_detached`)
DetachedFate = Literal["land", "land_silent", "part", "never", "keep"]
_FATES: tuple[str, ...] = ("land", "land_silent", "part", "never", "keep")


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
                self._detached[-1].dies_at = time.monotonic() + self._failed_within_s

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
