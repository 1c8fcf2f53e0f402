# SPDX-License-Identifier: Apache-2.0
"""The fake NIXL agent (:class:`FakeNixlAgent`): NIXL's Python agent API over a
:class:`~devkit.testing.fake_nixl.fabric.FakeNixlFabric`."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from devkit.testing.fake_nixl.errors import (
    _HANGS,
    _METADATA_MAGIC,
    _OPS,
    _UNCANCELLABLE,
    NIXL_INIT_AGENT,
    FakeNixlBackendError,
    FakeNixlInvalidParamError,
    FakeNixlMismatchError,
    FakeNixlNoTelemetryError,
    FakeNixlNotFoundError,
    FakeNixlNotPostedError,
    FakeNixlNotSupportedError,
    FakeNixlRepostActiveError,
    FakeNixlUsageError,
)
from devkit.testing.fake_nixl.memory import (
    FakeRegDList,
    FakeXferDList,
    _convert,
    _covered,
    _Desc,
    _expand_strided,
    _merge,
    _msg,
    _name,
    _Region,
)
from devkit.testing.fake_nixl.transfers import (
    CallRecord,
    FakePreppedDlistHandle,
    FakeXferHandle,
    FakeXferTelemetry,
    NotifRecord,
    TransferRecord,
    WriteLanding,
)
from vllm_ext import compat

if TYPE_CHECKING:
    from devkit.testing.fake_nixl.fabric import FakeNixlFabric

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
        if self._fabric.models_ucx_cuts and self._fabric.link_cut(self.name, name):
            # the side channel the metadata came over shares the link: a real handshake
            # across the cut times out before it gets here
            raise FakeNixlBackendError(
                f"add_remote_agent: {name!r} is behind a cut link (handshake timed out)"
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
