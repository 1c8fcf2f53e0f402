# SPDX-License-Identifier: Apache-2.0
"""An in-process fake of NIXL's Python agent, for unit tests of the push connector.

``FakeNixlAgent`` has the method names, signatures and return types of
``nixl._api.nixl_agent`` (nixl 1.5.1) for every call vLLM 0.23.0's NIXL worker
and the push connector make, and agents talk through a ``FakeNixlFabric`` (an
in-process "network" they join by name). ``fake_nixl_wrapper_cls(fabric)`` is
a drop-in for ``NixlWrapper(name, config)``.

Faithful to NIXL (checked against the real agent over UCX, see
``tests/unit/test_fake_nixl_parity.py``):

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

Pessimistic like UCX (``fake_nixl/faults.py`` has the details): what NIXL's UCX
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

from devkit.testing.fake_nixl.agent import FakeNixlAgent
from devkit.testing.fake_nixl.errors import (
    NIXL_INIT_AGENT,
    FailureKind,
    FakeNixlBackendError,
    FakeNixlError,
    FakeNixlInvalidParamError,
    FakeNixlLeakError,
    FakeNixlMismatchError,
    FakeNixlNoTelemetryError,
    FakeNixlNotFoundError,
    FakeNixlNotPostedError,
    FakeNixlNotSupportedError,
    FakeNixlRepostActiveError,
    FakeNixlUsageError,
)
from devkit.testing.fake_nixl.fabric import FakeNixlFabric
from devkit.testing.fake_nixl.faults import DetachedFate, DetachedTransfer, ReleaseInFlight
from devkit.testing.fake_nixl.memory import FakeRegDList, FakeXferDList
from devkit.testing.fake_nixl.transfers import (
    CallRecord,
    FakePreppedDlistHandle,
    FakeXferHandle,
    FakeXferTelemetry,
    NotifRecord,
    TransferRecord,
    WriteLanding,
)
from devkit.testing.fake_nixl.wrapper import (
    FakeNixlWrapper,
    fake_nixl_wrapper_cls,
    patch_vllm_nixl_wrapper,
)

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
