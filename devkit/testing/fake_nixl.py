# SPDX-License-Identifier: Apache-2.0
"""An in-process fake of NIXL's Python agent, for unit tests of the push connector.

``FakeNixlAgent`` has the method names, signatures and return types of
``nixl._api.nixl_agent`` (nixl 1.5.1) for every call vLLM 0.23.0's NIXL worker
and the push connector make, and agents talk through a ``FakeNixlFabric`` (an
in-process "network" they join by name). ``fake_nixl_wrapper_cls(fabric)`` is
a drop-in for ``NixlWrapper(name, config)``.

Faithful to NIXL (checked against the real agent over UCX, see
``tests/unit/test_fake_nixl.py``):

* Metadata is opaque bytes and a *snapshot* of the registered memory: memory
  registered after ``get_agent_metadata()`` is invisible to a peer until it
  loads fresh metadata. ``add_remote_agent`` returns the remote name as
  **bytes** (``b"B"``) as the real binding does, while ``get_new_notifs`` keys
  are ``str``; every call that takes an agent name accepts both. Re-adding an
  agent keeps existing handles valid; loading our own metadata raises
  ``nixlInvalidParamError``; garbage metadata raises ``nixlMismatchError``.
* Errors: unknown or removed remote agents, and descriptors outside registered
  memory (either side, a region spanning two registrations, a wrong device id),
  raise the NotFound error in ``initialize_xfer`` / ``prep_xfer_dlist`` /
  ``send_notif``; size/length/index mismatches and swapped prepped sides raise
  InvalidParam; an unknown operation raises ``KeyError``. Handles made before
  ``remove_remote_agent`` are stale: ``transfer`` and ``make_prepped_xfer``
  with them raise NotFound, even after the agent is added again.
* Transfers: ``transfer()`` returns ``"PROC"`` (or ``"DONE"`` when
  ``complete_after_polls == 0``), ``check_xfer_state`` before the first post
  raises NotPosted, re-posting while in flight raises RepostActive, re-posting
  a finished handle runs it again. The notification of a WRITE **or READ** is
  delivered to the *remote* agent, keyed by the initiator's name, when the
  data is in place; a ``notif_msg`` given to ``transfer()`` replaces the
  handle's message for this and later posts. Loopback (``prep_xfer_dlist`` with
  the own name, ``send_notif`` to self) works.
* Telemetry needs ``capture_telemetry`` in the agent config (else
  NoTelemetry) and a completed transfer (else NotPosted). ``descCount``
  follows NIXL's merging: ``make_prepped_xfer`` merges neighbours whose local
  *and* remote indices are consecutive and whose addresses are contiguous on
  both sides (unless ``skip_desc_merge``); ``initialize_xfer`` never merges.
  ``FakeXferHandle.requested_desc_count`` (fake only) is the count the caller
  asked for, which is what a test of the connector's own run merging wants.

Simplified or stricter than NIXL (deliberately):

* Only host memory (``DRAM``/``cpu``) is supported; bytes are copied with
  ``ctypes.memmove`` when a transfer completes, under the fabric lock. Keep the
  buffers alive while registered (a tensor passed directly is kept alive).
* Completion is deterministic instead of driven by a progress thread: it
  happens on the ``complete_after_polls``-th ``check_xfer_state`` of that
  handle, or when ``FakeNixlFabric.progress()`` is called. An initiator that
  never polls never delivers its notification.
* A transfer whose target left the fabric, was removed, or deregistered the
  target memory before completion ends in ``"ERR"`` and lands nothing (real UCX
  shared memory may still write; ``failed_writes_land`` models that for a removed
  target). What releasing a handle in ``"PROC"`` does: "Pessimistic like UCX" below.
* Errors that real NIXL only surfaces via a ``None`` from ``get_xfer_descs``
  (missing ``mem_type``, wrong tuple arity) raise ``FakeNixlInvalidParamError``
  at once. Releasing a handle twice raises ``FakeNixlUsageError`` when the
  fabric is strict (the default; real NIXL ignores the second release), and
  using a released handle always raises (real NIXL: undefined behaviour).
  Handles are never freed by garbage collection: an unreleased handle is a
  leak reported by ``FakeNixlFabric.assert_no_leaks()``.
* Backends, strided (Nx5) descriptor lists, partial metadata, metadata
  servers, cost estimation and memory views are not implemented.
* Failures are injected with ``FakeNixlFabric.fail_next_transfer(kind)``:
  ``"post"`` makes ``transfer()`` return ``"ERR"``, ``"post_raise"`` makes it
  raise, ``"state"`` makes the handle end in ``"ERR"`` instead of ``"DONE"``,
  ``"state_raise"`` makes ``check_xfer_state`` raise at that point. (The real
  binding turns error statuses into exceptions -- as seen for NotFound and
  NotPosted -- so a connector must handle both the ``"ERR"`` string of the
  Python API and an exception.) ``"hang"`` keeps the transfer in ``"PROC"``
  however often it is polled (a peer that never completes it), until
  ``FakeNixlFabric.progress()`` (released meanwhile, it is detached: "Pessimistic
  like UCX" below); ``"hang_uncancellable"`` also makes releasing it
  while in flight raise and keep the handle, as NIXL does when it cannot cancel a
  transfer ("If it cannot be canceled, an error will be returned and the handle
  will not be freed", ``nixl_agent.release_xfer_handle``); ``"hang_state_raise"``
  is ``"hang_uncancellable"`` whose ``check_xfer_state`` raises while it runs.
* A target that removes the initiator's agent (``remove_remote_agent``) does not stop
  a transfer the initiator posted: as with UCX (a WRITE already on a TCP link, a
  same-host copy), it still lands. Only the initiator's removal fails it.

Pessimistic like UCX (``fake_nixl_faults.py`` has the details): what NIXL's UCX
backend does not rule out, the fake does, so a connector cannot rely on it.

* Releasing a transfer in flight (``release_xfer_handle`` in ``"PROC"``) returns
  success, as NIXL's UCX backend does, and records it ``CANCELLED``, but by default
  (``FakeNixlFabric(release_in_flight="detach")``) the transfer is *detached*: its
  bytes still land, read from the source as it is then, without its notification,
  at the next ``progress()`` (docs/design.md, N-REL-1, measured on real agents;
  ``detached_fate``: all with the notification, half, never, or left to the test),
  or when the test lands it (``detached()``, ``land_detached(i, part, notify=)``,
  ``drop_detached(i)``). ``release_in_flight="cancel"`` is the old kind model
  (nothing lands). ``hang_uncancellable`` still has NIXL refuse the release.
* ``failed_writes_land(part, later=)``: a WRITE that ends in ``"ERR"`` lands a part
  of its bytes first, and with ``later`` the rest may arrive after the initiator saw
  ``"ERR"`` (detached).
* ``cut_link(a, b, stale_writes=True)``: the WRITEs in flight between ``a`` and
  ``b`` stall in ``"PROC"`` and land once the link is back (released meanwhile or
  not), after notifications sent over a new endpoint (N-REL-1).
* ``reorder_landings()``: ``progress()`` lands the newest transfers first, so a
  later WRITE's data and notification overtake an earlier one's data on the same
  pair.
* A notification may come well after its WRITE's data (``hold_notifs`` matching
  ``via == "xfer"``), never before: ``"DONE"`` means the bytes are in place.
* The sender name of a notification is whatever the message says in real NIXL, so
  any peer can name itself another agent: ``inject_notif(receiver, sender, msg)``
  takes any string as the sender (forged, unknown, empty).

Test helpers (not part of NIXL's API, never recorded in the call log):

* ``FakeNixlAgent.calls(method)`` / ``call_threads(method)``: every NIXL call
  is recorded with ``threading.current_thread().name``, so tests can check
  thread ownership (e.g. "only ``nixl-push-writer`` calls ``send_notif``").
* ``FakeNixlFabric.progress()``, ``pending_transfers()``, ``transfers()``
  (finished transfers with byte and descriptor counts), ``notifications()``,
  ``inject_notif()`` (deliver arbitrary bytes, e.g. malformed notifications),
  ``fail_next_transfer()``, ``live_handles()`` and ``assert_no_leaks()``.
* ``fake_nixl_wrapper_cls(fabric)`` / ``patch_vllm_nixl_wrapper(monkeypatch,
  fabric)``: make vLLM's worker build fake agents.
* A misbehaving network, for model checks: ``hold_notifs(predicate)`` keeps matching
  notifications (``send_notif`` and WRITE completions alike) in the network;
  ``held_notifs()``, ``release_held(i)`` (deliver one now, out of order) and
  ``drop_held(i)`` reorder, delay and lose them (``inject_notif`` duplicates one).
  ``complete(handle)`` completes one in-flight transfer (WRITE completions out of
  order; ``ok=False``: it ends in ``"ERR"``). ``observe_writes(callback)`` calls
  ``callback(WriteLanding)`` the moment a WRITE's bytes land in the target's memory
  (all of them or a part, on time or late: ``WriteLanding.how``), before its
  notification; ``landings()`` lists them.

All fabric and agent state sits behind one re-entrant lock, so agents may be
called from several threads (handshake, engine, writer).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import json
import math
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Concatenate, Literal, NamedTuple, ParamSpec, TypeVar

import numpy as np

from devkit.testing.fake_nixl_faults import (
    DetachedFate,
    DetachedTransfer,
    ReleaseInFlight,
    UcxFaults,
)
from vllm_ext import compat

__all__ = [
    "NIXL_INIT_AGENT",
    "CallRecord",
    "DetachedFate",
    "DetachedTransfer",
    "FakeNixlAgent",
    "FakeNixlBackendError",
    "FakeNixlError",
    "FakeNixlFabric",
    "FakeNixlInvalidParamError",
    "FakeNixlLeakError",
    "FakeNixlMismatchError",
    "FakeNixlNoTelemetryError",
    "FakeNixlNotFoundError",
    "FakeNixlNotPostedError",
    "FakeNixlNotSupportedError",
    "FakeNixlRepostActiveError",
    "FakeNixlUsageError",
    "FakeNixlWrapper",
    "FakePreppedDlistHandle",
    "FakeRegDList",
    "FakeXferDList",
    "FakeXferHandle",
    "FakeXferTelemetry",
    "FailureKind",
    "NotifRecord",
    "ReleaseInFlight",
    "TransferRecord",
    "WriteLanding",
    "fake_nixl_wrapper_cls",
    "patch_vllm_nixl_wrapper",
]

NIXL_INIT_AGENT = "NIXL_INIT_AGENT"
_METADATA_MAGIC = b"\x00FAKENIXL/1\x00"
_MEM_TYPES = {"DRAM": "DRAM", "cpu": "DRAM", "VRAM": "VRAM", "cuda": "VRAM"}
_UNSUPPORTED_MEM_TYPES = ("FILE", "BLOCK", "OBJ")
_OPS = ("WRITE", "READ")

FailureKind = Literal[
    "post", "post_raise", "state", "state_raise", "hang", "hang_uncancellable", "hang_state_raise"
]
_FAILURE_KINDS: tuple[str, ...] = (
    "post", "post_raise", "state", "state_raise", "hang", "hang_uncancellable",
    "hang_state_raise",
)  # fmt: skip
_HANGS = ("hang", "hang_uncancellable", "hang_state_raise")
#: Transfers that NIXL cannot cancel while they run.
_UNCANCELLABLE = ("hang_uncancellable", "hang_state_raise")


# --------------------------------------------------------------------------- errors


class FakeNixlError(Exception):
    """Base of the fake's errors; ``status`` is the NIXL status name it stands for."""

    status = "NIXL_ERR_UNKNOWN"

    def __init__(self, detail: str) -> None:
        super().__init__(f"{self.status}: {detail}")
        self.detail = detail


class FakeNixlNotFoundError(FakeNixlError):
    """Like ``nixlNotFoundError``: unknown agent, or memory not registered."""

    status = "NIXL_ERR_NOT_FOUND"


class FakeNixlInvalidParamError(FakeNixlError):
    """Like ``nixlInvalidParamError``: mismatched lists, bad indices, bad sides."""

    status = "NIXL_ERR_INVALID_PARAM"


class FakeNixlMismatchError(FakeNixlError):
    """Like ``nixlMismatchError``: metadata that cannot be deserialized."""

    status = "NIXL_ERR_MISMATCH"


class FakeNixlNotPostedError(FakeNixlError):
    """Like ``nixlNotPostedError``: state/telemetry of a transfer not posted/complete."""

    status = "NIXL_ERR_NOT_POSTED"


class FakeNixlRepostActiveError(FakeNixlError):
    """Like ``nixlRepostActiveError``: ``transfer()`` on a handle still in flight."""

    status = "NIXL_ERR_REPOST_ACTIVE"


class FakeNixlBackendError(FakeNixlError):
    """Like ``nixlBackendError``: the (injected) backend failure."""

    status = "NIXL_ERR_BACKEND"


class FakeNixlNoTelemetryError(FakeNixlError):
    """Like ``nixlNoTelemetryError``: telemetry asked of an agent without capture."""

    status = "NIXL_ERR_NO_TELEMETRY"


class FakeNixlNotSupportedError(FakeNixlError):
    """Like ``nixlNotSupportedError``: a feature the fake does not model."""

    status = "NIXL_ERR_NOT_SUPPORTED"


class FakeNixlUsageError(FakeNixlError):
    """Misuse real NIXL does not report (double release, use after release, ...)."""

    status = "FAKE_NIXL_USAGE"


class FakeNixlLeakError(FakeNixlError, AssertionError):
    """Raised by ``FakeNixlFabric.assert_no_leaks``."""

    status = "FAKE_NIXL_LEAK"


# --------------------------------------------------------------------- small types


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


@dataclasses.dataclass(frozen=True)
class _Desc:
    addr: int
    length: int
    dev: int

    def end(self) -> int:
        return self.addr + self.length

    def __str__(self) -> str:
        return f"(addr=0x{self.addr:x}, len={self.length}, dev={self.dev})"


@dataclasses.dataclass(frozen=True)
class _Region:
    mem_type: str
    addr: int
    length: int
    dev: int

    def covers(self, mem_type: str, d: _Desc) -> bool:
        return (
            mem_type == self.mem_type
            and d.dev == self.dev
            and self.addr <= d.addr
            and d.end() <= self.addr + self.length
        )


def _covered(regions: Sequence[_Region], mem_type: str, d: _Desc) -> bool:
    return any(r.covers(mem_type, d) for r in regions)


def _name(agent: str | bytes) -> str:
    return agent.decode() if isinstance(agent, bytes) else str(agent)


def _msg(notif_msg: bytes | str) -> bytes:
    return notif_msg.encode() if isinstance(notif_msg, str) else bytes(notif_msg)


def _mem_type(mem_type: str) -> str:
    if mem_type in _UNSUPPORTED_MEM_TYPES:
        raise FakeNixlNotSupportedError(f"memory type {mem_type!r} is not modelled by the fake")
    return _MEM_TYPES[mem_type]  # KeyError for unknown names, like nixl_agent


def _is_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _tensor_row(t: Any) -> tuple[str, tuple[int, int, int]]:
    if not t.is_contiguous():
        raise FakeNixlInvalidParamError("please use contiguous tensors")
    dev = t.get_device()
    mem_type = "DRAM" if dev == -1 else "VRAM"
    return mem_type, (int(t.data_ptr()), int(t.numel() * t.element_size()), max(dev, 0))


# ------------------------------------------------------------------ descriptor lists


class _DList:
    """Common part of the descriptor lists (methods named like the NIXL bindings)."""

    _width = 3

    def __init__(self, mem_type: str, rows: Sequence[Sequence[Any]], keepalive: Any = ()) -> None:
        self._mem_type = _mem_type(mem_type)
        self._descs: tuple[_Desc, ...] = tuple(_Desc(int(r[0]), int(r[1]), int(r[2])) for r in rows)
        self._meta: tuple[bytes, ...] = tuple((_msg(r[3]) if len(r) > 3 else b"") for r in rows)
        for d in self._descs:
            if d.addr < 0 or d.length < 0:
                raise FakeNixlInvalidParamError(f"invalid descriptor {d}")
        self._keepalive = keepalive

    def descCount(self) -> int:  # noqa: N802 (NIXL's name)
        return len(self._descs)

    def isEmpty(self) -> bool:  # noqa: N802
        return not self._descs

    def getType(self) -> str:  # noqa: N802
        return self._mem_type

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return (self[i] for i in range(len(self._descs)))

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        d = self._descs[i]
        if self._width == 4:
            return (d.addr, d.length, d.dev, self._meta[i])
        return (d.addr, d.length, d.dev)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._mem_type}, {len(self._descs)} descs)"


class FakeXferDList(_DList):
    """Like ``nixlXferDList``: ``(addr, len, dev)`` rows of one memory type."""


class FakeRegDList(_DList):
    """Like ``nixlRegDList``: ``(addr, len, dev, meta)`` rows of one memory type."""

    _width = 4


def _convert(descs: Any, mem_type: str | None, width: int, kind: type[_DList]) -> _DList:
    """The input forms of ``nixl_agent.get_xfer_descs`` / ``get_reg_descs``."""
    other = FakeRegDList if kind is FakeXferDList else FakeXferDList
    if isinstance(descs, kind):
        return descs
    if isinstance(descs, other):
        raise FakeNixlInvalidParamError(f"{other.__name__} given where a {kind.__name__} is needed")
    if isinstance(descs, np.ndarray):
        if mem_type is None:
            raise FakeNixlInvalidParamError("please specify a mem type for a numpy array")
        if descs.ndim != 2 or descs.shape[1] != 3:
            raise FakeNixlInvalidParamError("an Nx3 numpy array is required")
        return kind(mem_type, [tuple(int(x) for x in row) for row in descs])
    if _is_tensor(descs):
        mt, row = _tensor_row(descs)
        return kind(mt, [(*row, "")], keepalive=(descs,))
    if isinstance(descs[0], tuple):  # IndexError on an empty list, like nixl_agent
        if mem_type is None:
            raise FakeNixlInvalidParamError("please specify a mem type if not using tensors")
        if any(len(r) != width for r in descs):
            raise FakeNixlInvalidParamError(f"a list of {width}-tuples is required")
        return kind(mem_type, descs)
    if _is_tensor(descs[0]):
        rows = []
        mts = set()
        for t in descs:
            mt, row = _tensor_row(t)
            mts.add(mt)
            rows.append((*row, ""))
        if len(mts) != 1:
            raise FakeNixlInvalidParamError("all tensors must be on the same kind of device")
        return kind(mts.pop(), rows, keepalive=tuple(descs))
    raise FakeNixlInvalidParamError(f"unsupported descriptor input {type(descs).__name__}")


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

    def wrapper_cls(self) -> type[FakeNixlWrapper]:
        """Same as ``fake_nixl_wrapper_cls(self)``."""
        return fake_nixl_wrapper_cls(self)


# ------------------------------------------------------------------------------- agent

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _nixl_api(
    fn: Callable[Concatenate[FakeNixlAgent, _P], _R],
) -> Callable[Concatenate[FakeNixlAgent, _P], _R]:
    """Record the call (method, thread) and run it under the fabric lock."""
    method = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: FakeNixlAgent, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._fabric._lock:
            self._calls.append(CallRecord(method, threading.current_thread().name))
            self._fabric._tick()
            return fn(self, *args, **kwargs)

    return wrapper


@dataclasses.dataclass
class _RemoteView:
    regions: tuple[_Region, ...]
    generation: int
    #: its endpoint failed (a cut link): sends over it raise until it is loaded anew
    failed: bool = False


def _expand_strided(rows: np.ndarray, mem_type: str | None) -> np.ndarray:
    """An Nx5 strided list (``address, len, device, stride, count``: ``count`` blocks of
    ``len`` bytes ``stride`` apart, as nixl 1.5's ``prep_xfer_dlist`` takes it, vLLM 0.34)
    as the Nx3 list of its blocks in order: the prepared list's indices are the blocks'."""
    if mem_type is None:  # as nixl: an Nx5 array carries no memory type
        raise ValueError("Please specify a mem type for strided descriptors")
    rows = rows.astype(np.uint64, copy=False)
    counts = rows[:, 4].astype(np.int64)
    if (counts < 0).any():
        raise FakeNixlInvalidParamError("strided descriptor with a negative count")
    within = np.arange(int(counts.sum()), dtype=np.uint64) - np.repeat(
        (np.cumsum(counts) - counts).astype(np.uint64), counts
    )
    out = np.empty((len(within), 3), dtype=np.uint64)
    out[:, 0] = np.repeat(rows[:, 0], counts) + within * np.repeat(rows[:, 3], counts)
    out[:, 1] = np.repeat(rows[:, 1], counts)
    out[:, 2] = np.repeat(rows[:, 2], counts)
    return out


class FakeNixlAgent:
    """A fake ``nixl_agent`` on a ``FakeNixlFabric`` (see the module docstring).

    Args:
        agent_name: unique name on the fabric.
        nixl_conf: a ``nixl_agent_config`` (or any object); only its
            ``capture_telemetry`` attribute is read.
        instantiate_all: accepted for signature compatibility, ignored.
        fabric: the fabric to join.
    """

    def __init__(
        self,
        agent_name: str,
        nixl_conf: Any = None,
        instantiate_all: bool = False,
        *,
        fabric: FakeNixlFabric,
    ) -> None:
        self.name = _name(agent_name)
        self.nixl_conf = nixl_conf
        self._fabric = fabric
        self._capture_telemetry = bool(getattr(nixl_conf, "capture_telemetry", False))
        self._regions: list[_Region] = []
        self._remotes: dict[str, _RemoteView] = {}
        self._generations: dict[str, int] = {}
        self._notifs: dict[str, list[bytes]] = {}
        self._calls: list[CallRecord] = []
        self._closed = False
        #: UCX's TCP user timeout, read as a UCX context reads it: from the environment
        #: when the agent is built (``inf``: unset or unbounded)
        self.tcp_user_timeout_s = compat.effective_tcp_user_timeout_s(0.0) or math.inf
        fabric._join(self)

    @property
    def fabric(self) -> FakeNixlFabric:
        return self._fabric

    # ---------------------------------------------------------------- fake-only helpers
    def calls(self, method: str | None = None) -> list[CallRecord]:
        """The NIXL calls made on this agent (only those to ``method``, if given)."""
        with self._fabric._lock:
            return [c for c in self._calls if method is None or c.method == method]

    def call_threads(self, method: str) -> set[str]:
        """Names of the threads that called ``method`` on this agent."""
        return {c.thread for c in self.calls(method)}

    def peek_notifs(self) -> dict[str, list[bytes]]:
        """Undelivered notifications, without consuming them (not logged)."""
        with self._fabric._lock:
            return {k: list(v) for k, v in self._notifs.items()}

    def remote_agents(self) -> list[str]:
        """Names of the remote agents currently loaded."""
        with self._fabric._lock:
            return list(self._remotes)

    def close(self) -> None:
        """Leave the fabric (real agents simply get destroyed). Handles stay tracked."""
        with self._fabric._lock:
            self._closed = True
            self._fabric._leave(self)

    # ----------------------------------------------------------------- memory
    @_nixl_api
    def get_reg_descs(self, descs: Any, mem_type: str | None = None) -> FakeRegDList:
        out = _convert(descs, mem_type, 4, FakeRegDList)
        assert isinstance(out, FakeRegDList)
        return out

    @_nixl_api
    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> FakeXferDList:
        out = _convert(descs, mem_type, 3, FakeXferDList)
        assert isinstance(out, FakeXferDList)
        return out

    @_nixl_api
    def register_memory(
        self, reg_list: Any, mem_type: str | None = None, backends: list[str] | None = None
    ) -> FakeRegDList:
        dlist = _convert(reg_list, mem_type, 4, FakeRegDList)
        assert isinstance(dlist, FakeRegDList)
        if dlist.getType() != "DRAM":
            raise FakeNixlNotSupportedError("the fake registers host (DRAM) memory only")
        self._regions += [_Region("DRAM", d.addr, d.length, d.dev) for d in dlist._descs]
        return dlist

    @_nixl_api
    def deregister_memory(
        self, dereg_list: FakeRegDList, backends: list[str] | None = None
    ) -> None:
        if not isinstance(dereg_list, FakeRegDList):
            raise TypeError(f"deregister_memory needs a FakeRegDList, got {type(dereg_list)}")
        wanted = [_Region(dereg_list.getType(), d.addr, d.length, d.dev) for d in dereg_list._descs]
        remaining = list(self._regions)
        for r in wanted:
            if r not in remaining:
                raise FakeNixlNotFoundError(
                    f"deregister_memory: {r} is not registered by {self.name!r}"
                )
            remaining.remove(r)
        self._regions = remaining

    # ----------------------------------------------------------------- metadata
    @_nixl_api
    def get_agent_metadata(self) -> bytes:
        body = {
            "fabric": self._fabric.fabric_id,
            "name": self.name,
            "regions": [[r.mem_type, r.addr, r.length, r.dev] for r in self._regions],
        }
        return _METADATA_MAGIC + json.dumps(body).encode()

    @_nixl_api
    def add_remote_agent(self, metadata: bytes) -> bytes:
        if not isinstance(metadata, bytes | bytearray) or not metadata.startswith(_METADATA_MAGIC):
            raise FakeNixlMismatchError("add_remote_agent: failed to deserialize remote metadata")
        try:
            body = json.loads(bytes(metadata[len(_METADATA_MAGIC) :]))
            name = str(body["name"])
            regions = tuple(
                _Region(str(m), int(a), int(n), int(d)) for m, a, n, d in body["regions"]
            )
        except (ValueError, KeyError, TypeError) as e:
            raise FakeNixlMismatchError(f"add_remote_agent: corrupt metadata ({e})") from e
        if body.get("fabric") != self._fabric.fabric_id:
            raise FakeNixlMismatchError(
                f"add_remote_agent: metadata of {name!r} comes from another FakeNixlFabric"
            )
        if name == self.name:
            raise FakeNixlInvalidParamError(
                "add_remote_agent: remote agent name same as local agent"
            )
        gen = self._generations.setdefault(name, 0)
        loaded = self._remotes.get(name)  # loading it again keeps its endpoint
        failed = (loaded is not None and loaded.failed) or (
            not self._fabric.models_ucx_cuts and self._fabric.link_cut(self.name, name)
        )
        self._remotes[name] = _RemoteView(regions, gen, failed)
        return name.encode()

    @_nixl_api
    def remove_remote_agent(self, agent: str | bytes) -> None:
        name = _name(agent)
        if self._remotes.pop(name, None) is not None:
            self._generations[name] += 1

    @_nixl_api
    def check_remote_metadata(self, agent: str | bytes, descs: Any = None) -> bool:
        return _name(agent) in self._remotes

    @_nixl_api
    def make_connection(self, remote_agent: str | bytes, backends: list[str] | None = None) -> None:
        self._require_remote(_name(remote_agent), "make_connection")

    # ----------------------------------------------------------------- transfers
    @_nixl_api
    def prep_xfer_dlist(
        self,
        agent_name: str | bytes,
        xfer_list: Any,
        mem_type: str | None = None,
        backends: list[str] | None = None,
    ) -> FakePreppedDlistHandle:
        if isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            xfer_list = _expand_strided(xfer_list, mem_type)
        name = _name(agent_name)
        dlist = _convert(xfer_list, mem_type, 3, FakeXferDList)
        assert isinstance(dlist, FakeXferDList)
        if name in (NIXL_INIT_AGENT, ""):
            target, regions, gen = None, self._regions, 0
        elif name == self.name:
            target, regions, gen = name, self._regions, 0
        else:
            view = self._require_remote(name, "prep_xfer_dlist")
            target, regions, gen = name, list(view.regions), view.generation
        owner = self.name if target is None else target
        for i, d in enumerate(dlist._descs):
            if not _covered(regions, dlist.getType(), d):
                raise FakeNixlNotFoundError(
                    f"prep_xfer_dlist: descriptor #{i} {d} is not inside "
                    f"{dlist.getType()} memory registered by {owner!r}"
                )
        h = FakePreppedDlistHandle(
            self, next(self._fabric._ids), target, dlist, gen, threading.current_thread().name
        )
        self._fabric._live_dlists[h._handle] = h
        return h

    @_nixl_api
    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: FakePreppedDlistHandle,
        local_indices: Sequence[int] | np.ndarray,
        remote_xfer_side: FakePreppedDlistHandle,
        remote_indices: Sequence[int] | np.ndarray,
        notif_msg: bytes | str = b"",
        backends: list[str] | None = None,
        skip_desc_merge: bool = False,
    ) -> FakeXferHandle:
        op = self._op(operation)
        for side in (local_xfer_side, remote_xfer_side):
            self._check_own(side, FakePreppedDlistHandle, "make_prepped_xfer")
        if local_xfer_side.target is not None or remote_xfer_side.target is None:
            raise FakeNixlInvalidParamError(
                "make_prepped_xfer: invalid sides (local must be local, remote must be remote)"
            )
        li = [int(i) for i in local_indices]
        ri = [int(i) for i in remote_indices]
        if len(li) != len(ri) or not li:
            raise FakeNixlInvalidParamError(
                f"make_prepped_xfer: different or zero number of indices "
                f"(local={len(li)}, remote={len(ri)})"
            )
        for side_name, idx, side in (
            ("local", li, local_xfer_side),
            ("remote", ri, remote_xfer_side),
        ):
            n = side.dlist.descCount()
            for k, i in enumerate(idx):
                if not 0 <= i < n:
                    raise FakeNixlInvalidParamError(
                        f"make_prepped_xfer: {side_name} index out of range at index {k} "
                        f"with value {i} (list has {n} descriptors)"
                    )
        target = remote_xfer_side.target
        assert target is not None
        gen = self._check_fresh(target, remote_xfer_side.generation, "make_prepped_xfer")
        ld, rd = local_xfer_side.dlist._descs, remote_xfer_side.dlist._descs
        pairs = [(ld[a], rd[b]) for a, b in zip(li, ri, strict=True)]
        self._check_lengths(pairs, "make_prepped_xfer")
        if not skip_desc_merge:
            pairs = _merge(pairs, li, ri)
        return self._new_xfer(
            op,
            (local_xfer_side.dlist.getType(), remote_xfer_side.dlist.getType()),
            pairs,
            target,
            gen,
            _msg(notif_msg),
            len(li),
            "make_prepped_xfer",
        )

    @_nixl_api
    def initialize_xfer(
        self,
        operation: str,
        local_descs: FakeXferDList,
        remote_descs: FakeXferDList,
        remote_agent: str | bytes,
        notif_msg: bytes | str = b"",
        backends: list[str] | None = None,
    ) -> FakeXferHandle:
        op = self._op(operation)
        for dl in (local_descs, remote_descs):
            if not isinstance(dl, FakeXferDList):
                raise TypeError(
                    f"initialize_xfer needs FakeXferDList (from get_xfer_descs), got {type(dl)}"
                )
        target = _name(remote_agent)
        if target == self.name:
            regions, gen = self._regions, 0
        else:
            view = self._require_remote(target, "initialize_xfer")
            regions, gen = list(view.regions), view.generation
        if local_descs.descCount() != remote_descs.descCount() or local_descs.isEmpty():
            raise FakeNixlInvalidParamError(
                f"initialize_xfer: different or zero descriptor list sizes "
                f"(local={local_descs.descCount()}, remote={remote_descs.descCount()})"
            )
        pairs = list(zip(local_descs._descs, remote_descs._descs, strict=True))
        self._check_lengths(pairs, "initialize_xfer")
        for i, (loc, rem) in enumerate(pairs):
            if not _covered(self._regions, local_descs.getType(), loc):
                raise FakeNixlNotFoundError(
                    f"initialize_xfer: local descriptor #{i} {loc} is not inside memory "
                    f"registered by {self.name!r}"
                )
            if not _covered(regions, remote_descs.getType(), rem):
                raise FakeNixlNotFoundError(
                    f"initialize_xfer: remote descriptor #{i} {rem} is not inside memory "
                    f"registered by {target!r} (as of its loaded metadata)"
                )
        return self._new_xfer(
            op,
            (local_descs.getType(), remote_descs.getType()),
            pairs,
            target,
            gen,
            _msg(notif_msg),
            len(pairs),
            "initialize_xfer",
        )

    @_nixl_api
    def transfer(self, handle: FakeXferHandle, notif_msg: bytes | str = b"") -> str:
        self._check_own(handle, FakeXferHandle, "transfer")
        if handle.state == "PROC":
            raise FakeNixlRepostActiveError(f"transfer: {handle!r} is still in flight")
        self._check_fresh(handle.remote_agent, handle.generation, "transfer")
        view = self._remotes.get(handle.remote_agent)
        msg = _msg(notif_msg)
        if msg:
            handle.notif = msg  # NIXL keeps the new message for later posts too
        t0 = time.monotonic_ns()
        handle.posts += 1
        handle.polls = 0
        handle.reason = ""
        handle.post_thread = threading.current_thread().name
        handle._start_ns = t0
        handle.fail_mode = self._fabric._take_failure(self.name)
        if view is not None and view.failed:
            handle.fail_mode = "post"  # over a failed endpoint: ends in ERR at once
        if handle.fail_mode in ("post", "post_raise"):
            handle.state = "ERR"
            handle.reason = f"injected {handle.fail_mode} failure"
            self._record(handle)
            if handle.fail_mode == "post_raise":
                raise FakeNixlBackendError(f"transfer: injected post failure of {handle!r}")
            return "ERR"
        handle.state = "PROC"
        handle._post_ns = time.monotonic_ns() - t0
        fabric = self._fabric
        if fabric.models_ucx_cuts and fabric.link_cut(self.name, handle.remote_agent):
            handle.stalled = True  # on the wire until the link returns or T passed
            fabric._stalled_at[handle._handle] = time.monotonic()
            return "PROC"
        if self._fabric.complete_after_polls == 0 and handle.fail_mode not in _HANGS:
            self._complete(handle)
            return self._state_of(handle)
        return "PROC"

    @_nixl_api
    def check_xfer_state(self, handle: FakeXferHandle) -> str:
        self._check_own(handle, FakeXferHandle, "check_xfer_state")
        if handle.state == "INIT":
            raise FakeNixlNotPostedError(f"check_xfer_state: {handle!r} was never posted")
        if handle.state == "PROC":
            handle.polls += 1
            hung = handle.fail_mode in _HANGS or handle.stalled
            if handle.polls >= self._fabric.complete_after_polls and not hung:
                self._complete(handle)
        return self._state_of(handle)

    @_nixl_api
    def get_xfer_telemetry(self, handle: FakeXferHandle) -> FakeXferTelemetry:
        self._check_own(handle, FakeXferHandle, "get_xfer_telemetry")
        if not self._capture_telemetry:
            raise FakeNixlNoTelemetryError(
                "get_xfer_telemetry: telemetry is not enabled (nixl_agent_config.capture_telemetry)"
            )
        if handle.state != "DONE":
            raise FakeNixlNotPostedError(
                f"get_xfer_telemetry: transfer is not complete yet ({handle.state})"
            )
        return FakeXferTelemetry(
            startTime=handle._start_ns // 1000,
            postDuration=handle._post_ns // 1000,
            xferDuration=(handle._end_ns - handle._start_ns) // 1000,
            totalBytes=handle.total_bytes,
            descCount=handle.desc_count,
        )

    @_nixl_api
    def release_xfer_handle(self, handle: FakeXferHandle) -> None:
        if self._released_again(handle, FakeXferHandle):
            return
        if handle.state == "PROC" and handle.fail_mode in _UNCANCELLABLE:
            raise FakeNixlBackendError(
                f"release_xfer_handle: {handle!r} is in flight and cannot be cancelled"
            )
        if handle.state == "PROC":
            handle.state = "CANCELLED"
            handle.reason = "released while in flight"
            self._record(handle)
            if self._fabric.release_in_flight == "detach":  # UCX: it goes on (N-REL-1)
                self._fabric._detach(handle, "cut" if handle.stalled else "released")
        handle._released = True
        del self._fabric._live_xfers[handle._handle]

    @_nixl_api
    def release_dlist_handle(self, handle: FakePreppedDlistHandle) -> None:
        if self._released_again(handle, FakePreppedDlistHandle):
            return
        handle._released = True
        del self._fabric._live_dlists[handle._handle]

    # ----------------------------------------------------------------- notifications
    @_nixl_api
    def send_notif(
        self, remote_agent_name: str | bytes, notif_msg: bytes | str, backend: str | None = None
    ) -> None:
        name = _name(remote_agent_name)
        if name != self.name and self._require_remote(name, "send_notif").failed:
            raise FakeNixlBackendError(f"send_notif: the endpoint to {name!r} failed")
        target = self._fabric._agents.get(name)
        if target is None:
            raise FakeNixlBackendError(f"send_notif: agent {name!r} has left the fabric")
        if self._fabric.models_ucx_cuts and self._fabric.link_cut(self.name, name):
            self._fabric._queue_send(self, name, _msg(notif_msg))  # UCX holds it
            return
        target._deliver(self.name, _msg(notif_msg), "send_notif")

    @_nixl_api
    def get_new_notifs(self, backends: list[str] | None = None) -> dict[str, list[bytes]]:
        new, self._notifs = self._notifs, {}
        return new

    # ----------------------------------------------------------------- internals
    def _deliver(self, sender: str, msg: bytes, via: str, hold: bool = True) -> None:
        rec = NotifRecord(sender, self.name, msg, via)
        fabric = self._fabric
        if hold and fabric._hold is not None and fabric._hold(rec):
            fabric._held.append(rec)
            return
        self._notifs.setdefault(sender, []).append(msg)
        fabric._notifs.append(rec)

    def _op(self, operation: str) -> str:
        if operation not in _OPS:
            raise KeyError(operation)  # like nixl_agent's self.nixl_ops[operation]
        return operation

    def _require_remote(self, name: str, where: str) -> _RemoteView:
        view = self._remotes.get(name)
        if view is None:
            raise FakeNixlNotFoundError(
                f"{where}: metadata for remote agent {name!r} not found "
                f"(not added with add_remote_agent, or removed) on agent {self.name!r}"
            )
        return view

    def _check_fresh(self, target: str, generation: int, where: str) -> int:
        if target == self.name:
            return 0
        view = self._require_remote(target, where)
        if view.generation != generation:
            raise FakeNixlNotFoundError(
                f"{where}: remote agent {target!r} was invalidated or re-registered after "
                "the handle was created; handles must be re-created"
            )
        return generation

    def _check_own(
        self,
        handle: Any,
        cls: type[FakeXferHandle] | type[FakePreppedDlistHandle],
        where: str,
    ) -> None:
        if not isinstance(handle, cls):
            raise TypeError(f"{where}: expected {cls.__name__}, got {type(handle).__name__}")
        if handle._agent is not self:
            raise FakeNixlInvalidParamError(
                f"{where}: {handle!r} belongs to agent {handle._agent.name!r}, not {self.name!r}"
            )
        if handle._released:
            raise FakeNixlUsageError(f"{where}: {handle!r} was already released")

    def _released_again(
        self, handle: Any, cls: type[FakeXferHandle] | type[FakePreppedDlistHandle]
    ) -> bool:
        if isinstance(handle, cls) and handle._released and not self._fabric.strict_release:
            return True
        self._check_own(handle, cls, f"release ({cls.__name__})")
        return False

    @staticmethod
    def _check_lengths(pairs: Sequence[tuple[_Desc, _Desc]], where: str) -> None:
        for i, (loc, rem) in enumerate(pairs):
            if loc.length != rem.length:
                raise FakeNixlInvalidParamError(
                    f"{where}: length mismatch at index {i} (local {loc.length}, "
                    f"remote {rem.length})"
                )

    def _new_xfer(
        self,
        op: str,
        mem_types: tuple[str, str],
        pairs: list[tuple[_Desc, _Desc]],
        target: str,
        gen: int,
        notif: bytes,
        requested: int,
        created_by: str,
    ) -> FakeXferHandle:
        h = FakeXferHandle(
            self,
            next(self._fabric._ids),
            op,
            mem_types,
            pairs,
            target,
            gen,
            notif,
            requested,
            created_by,
            threading.current_thread().name,
        )
        self._fabric._live_xfers[h._handle] = h
        return h

    def _state_of(self, handle: FakeXferHandle) -> str:
        if handle.state == "PROC" and handle.fail_mode == "hang_state_raise":
            raise FakeNixlBackendError(f"check_xfer_state: injected failure of {handle!r}")
        if handle.state == "ERR" and handle.fail_mode == "state_raise":
            raise FakeNixlBackendError(f"check_xfer_state: injected failure of {handle!r}")
        return handle.state

    def _complete(self, h: FakeXferHandle) -> None:
        """Finish an in-flight transfer: copy the bytes and notify, or fail."""
        target = self._fabric._agents.get(h.remote_agent)
        view = self._remotes.get(h.remote_agent)
        may_land = True  # (a failed WRITE whose bytes were on their way: UcxFaults)
        if h.fail_mode in ("state", "state_raise"):
            reason = f"injected {h.fail_mode} failure"
        elif target is None:
            reason, may_land = f"remote agent {h.remote_agent!r} left the fabric", False
        elif target is not self and (view is None or view.generation != h.generation):
            reason = f"remote agent {h.remote_agent!r} was removed"
        elif not all(_covered(self._regions, h.mem_types[0], loc) for loc, _ in h.pairs):
            reason, may_land = f"local memory of {self.name!r} was deregistered", False
        elif not all(_covered(target._regions, h.mem_types[1], rem) for _, rem in h.pairs):
            reason, may_land = f"remote memory of {h.remote_agent!r} was deregistered", False
        else:
            reason = ""
        h._end_ns = time.monotonic_ns()
        if reason:
            if may_land:
                self._fabric._failed_write(h)
            h.state, h.reason = "ERR", reason
            self._record(h)
            return
        self._land(h.op, h.remote_agent, h.pairs, h.mem_types, 0, h.total_bytes, h.notif, "done")
        h.state = "DONE"
        if h.notif:
            self._notify(h.remote_agent, h.notif)
        self._record(h)

    def _land(
        self,
        op: str,
        target_name: str,
        pairs: Sequence[tuple[_Desc, _Desc]],
        mem_types: tuple[str, str],
        start: int,
        end: int,
        notif: bytes,
        how: str,
    ) -> WriteLanding | None:
        """Copy bytes ``[start, end)`` of a transfer (in descriptor order) and report a
        WRITE's landing; None (nothing copied) if either side left the fabric or
        deregistered the memory."""
        fabric = self._fabric
        target = fabric._agents.get(target_name)
        if target is None or fabric._agents.get(self.name) is not self:
            return None
        if not all(_covered(self._regions, mem_types[0], loc) for loc, _ in pairs) or not all(
            _covered(target._regions, mem_types[1], rem) for _, rem in pairs
        ):
            return None
        spans, offset = [], 0
        for loc, rem in pairs:
            lo, hi = max(start, offset), min(end, offset + loc.length)
            if lo < hi:
                k = lo - offset
                src, dst = (
                    (loc.addr + k, rem.addr + k) if op == "WRITE" else (rem.addr + k, loc.addr + k)
                )
                ctypes.memmove(dst, src, hi - lo)
                spans.append((loc.addr + k, rem.addr + k, hi - lo))
            offset += loc.length
        landing = WriteLanding(
            self.name, target_name, notif, tuple(spans), how, whole=end >= offset
        )
        if op == "WRITE":
            fabric._landings.append(landing)
            for observe in fabric._write_observers:
                observe(landing)
        return landing

    def _notify(self, target_name: str, msg: bytes) -> None:
        """A transfer's notification, once its bytes are in place."""
        target = self._fabric._agents.get(target_name)
        if target is not None:
            target._deliver(self.name, msg, "xfer")

    def _record(self, h: FakeXferHandle) -> None:
        self._fabric._transfers.append(
            TransferRecord(
                handle_id=h._handle,
                initiator=self.name,
                target=h.remote_agent,
                op=h.op,
                state=h.state,
                total_bytes=h.total_bytes,
                desc_count=h.desc_count,
                requested_desc_count=h.requested_desc_count,
                notif=h.notif if (h.state == "DONE" and h.notif) else None,
                post_thread=h.post_thread,
                reason=h.reason,
            )
        )

    def __repr__(self) -> str:
        remotes = list(self._remotes)
        return f"FakeNixlAgent({self.name!r}, {len(self._regions)} regions, remotes={remotes})"


def _merge(
    pairs: list[tuple[_Desc, _Desc]], li: Sequence[int], ri: Sequence[int]
) -> list[tuple[_Desc, _Desc]]:
    """NIXL's make_prepped_xfer merging: consecutive indices, contiguous on both sides."""
    out = [pairs[0]]
    for k in range(1, len(pairs)):
        (pl, pr), (cl, cr) = out[-1], pairs[k]
        if (
            li[k] == li[k - 1] + 1
            and ri[k] == ri[k - 1] + 1
            and pl.end() == cl.addr
            and pr.end() == cr.addr
            and pl.dev == cl.dev
            and pr.dev == cr.dev
        ):
            out[-1] = (
                _Desc(pl.addr, pl.length + cl.length, pl.dev),
                _Desc(pr.addr, pr.length + cr.length, pr.dev),
            )
        else:
            out.append(pairs[k])
    return out


# ---------------------------------------------------------------------- vLLM drop-in


class FakeNixlWrapper(FakeNixlAgent):
    """Base of the classes ``fake_nixl_wrapper_cls`` makes: ``NixlWrapper``'s signature."""

    bound_fabric: ClassVar[FakeNixlFabric]

    def __init__(
        self, agent_name: str, nixl_conf: Any = None, instantiate_all: bool = False
    ) -> None:
        fabric = getattr(type(self), "bound_fabric", None)
        if fabric is None:
            raise TypeError("make the class with fake_nixl_wrapper_cls(fabric)")
        super().__init__(agent_name, nixl_conf, instantiate_all, fabric=fabric)


def fake_nixl_wrapper_cls(fabric: FakeNixlFabric) -> type[FakeNixlWrapper]:
    """A class usable as vLLM's ``NixlWrapper``: ``cls(agent_name, nixl_conf)`` joins ``fabric``.

    vLLM's worker builds its agent as ``NixlWrapper(str(uuid.uuid4()), config)``;
    find it afterwards with ``fabric.agents()``.
    """
    return type("FakeNixlWrapper", (FakeNixlWrapper,), {"bound_fabric": fabric})


def patch_vllm_nixl_wrapper(
    monkeypatch: Any,
    fabric: FakeNixlFabric,
    module: str = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker",
) -> type[FakeNixlWrapper]:
    """Make vLLM's NIXL worker (and subclasses) build fake agents on ``fabric``.

    ``monkeypatch`` is pytest's fixture; the module is imported here.
    """
    import importlib

    cls = fake_nixl_wrapper_cls(fabric)
    monkeypatch.setattr(importlib.import_module(module), "NixlWrapper", cls)
    return cls
