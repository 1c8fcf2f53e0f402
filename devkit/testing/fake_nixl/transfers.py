# SPDX-License-Identifier: Apache-2.0
"""Transfers in the fake NIXL: the records tests read (calls, transfers, notifications,
landings, telemetry) and the prepared-list and transfer handles."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

from devkit.testing.fake_nixl.memory import FakeXferDList, _Desc

if TYPE_CHECKING:
    from devkit.testing.fake_nixl.agent import FakeNixlAgent


class CallRecord(NamedTuple):
    """One NIXL API call on an agent: method name and the calling thread's name."""

    method: str
    thread: str


@dataclasses.dataclass(frozen=True)
class TransferRecord:
    """A finished transfer (``state`` is ``DONE``, ``ERR`` or ``CANCELLED``)."""

    handle_id: int
    initiator: str
    target: str
    op: str
    state: str
    total_bytes: int
    desc_count: int
    requested_desc_count: int
    notif: bytes | None
    post_thread: str
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class NotifRecord:
    """A delivered notification; ``via`` is ``send_notif``, ``xfer`` or ``inject``."""

    sender: str
    receiver: str
    msg: bytes
    via: str


@dataclasses.dataclass(frozen=True)
class WriteLanding:
    """A WRITE whose bytes just landed: ``spans`` are ``(local addr, remote addr,
    length)``; ``notif`` is the WRITE's message (it names what the WRITE is for; it
    follows a ``done`` landing, maybe held, and maybe a late one's last part).

    ``how``: ``done`` (the transfer completed), ``released`` / ``cut`` / ``failed``
    (a detached transfer's bytes, late), or ``failed`` with ``whole`` False for the
    part a failed WRITE landed before its error. ``whole``: every byte of the WRITE
    is in place now."""

    initiator: str
    target: str
    notif: bytes
    spans: tuple[tuple[int, int, int], ...]
    how: str = "done"
    whole: bool = True


@dataclasses.dataclass
class FakeXferTelemetry:
    """Like ``nixlXferTelemetry``: times in microseconds."""

    startTime: int  # noqa: N815 (NIXL's field names)
    postDuration: int  # noqa: N815
    xferDuration: int  # noqa: N815
    totalBytes: int  # noqa: N815
    descCount: int  # noqa: N815


# ----------------------------------------------------------------------------- handles


class FakePreppedDlistHandle:
    """Like ``nixl_prepped_dlist_handle``; ``target`` is None for local lists."""

    def __init__(
        self,
        agent: FakeNixlAgent,
        handle_id: int,
        target: str | None,
        dlist: FakeXferDList,
        generation: int,
        created_on: str,
    ) -> None:
        self._handle = handle_id
        self._agent = agent
        self.target = target
        self.dlist = dlist
        self.generation = generation
        self.created_on = created_on
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        self._agent.release_dlist_handle(self)

    def __repr__(self) -> str:
        side = "local" if self.target is None else f"remote={self.target!r}"
        return (
            f"FakePreppedDlistHandle(#{self._handle}, agent={self._agent.name!r}, {side}, "
            f"{self.dlist.descCount()} descs, created on thread {self.created_on!r}, "
            f"released={self._released})"
        )


class FakeXferHandle:
    """Like ``nixl_xfer_handle``, with the fake's bookkeeping readable by tests."""

    def __init__(
        self,
        agent: FakeNixlAgent,
        handle_id: int,
        op: str,
        mem_types: tuple[str, str],
        pairs: list[tuple[_Desc, _Desc]],
        remote_agent: str,
        generation: int,
        notif: bytes,
        requested_desc_count: int,
        created_by: str,
        created_on: str,
    ) -> None:
        self._handle = handle_id
        self._agent = agent
        self.op = op
        self.mem_types = mem_types
        self.pairs = pairs
        self.remote_agent = remote_agent
        self.generation = generation
        self.notif = notif
        self.requested_desc_count = requested_desc_count
        self.desc_count = len(pairs)
        self.total_bytes = sum(loc.length for loc, _ in pairs)
        self.created_by = created_by
        self.created_on = created_on
        self.state = "INIT"  # INIT, PROC, DONE, ERR, CANCELLED
        self.polls = 0
        self.posts = 0
        self.fail_mode: str | None = None
        #: in flight over a link cut with ``stale_writes``: no progress until restored
        self.stalled = False
        self.reason = ""
        self.post_thread = ""
        self._start_ns = 0
        self._post_ns = 0
        self._end_ns = 0
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        self._agent.release_xfer_handle(self)

    def __repr__(self) -> str:
        return (
            f"FakeXferHandle(#{self._handle}, agent={self._agent.name!r}, {self.op} "
            f"-> {self.remote_agent!r}, {self.desc_count} descs, state={self.state}, "
            f"made by {self.created_by} on thread {self.created_on!r}, "
            f"released={self._released})"
        )
