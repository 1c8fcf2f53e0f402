# SPDX-License-Identifier: Apache-2.0
"""P's leases: a finished request's blocks are freed when vLLM's lease ends, but never
while a WRITE may read them, and never later than a hard cap.

Two objects, two owners:

* :class:`LeaseClaims`, shared by the engine thread and the writer under one
  lock: whether a WRITE may read a request's blocks. The engine thread marks a
  request protected when it hands its blocks to the writer; the writer keeps it
  protected while it matches and writes, and unprotects it when no WRITE will read
  the blocks; the engine thread revokes it when the lease ends, after which the
  writer can no longer protect it (a registration arriving then is answered with a
  PUSH_FAIL instead of a WRITE into freed blocks). The writer also records each
  WRITE it posts on the blocks (:meth:`LeaseClaims.start_write`, refused once
  revoked) until NIXL reports that transfer ended (:meth:`LeaseClaims.end_write`):
  **P's half of S-SAFE-1 is enforced here: no lease end, cap included, revokes a
  request while NIXL may still run a WRITE reading its blocks.**
* :class:`LeaseKeeper`, the engine thread's: it decides the end of every lease near
  its end, before vLLM's reaper looks (``NixlConnectorWorker.get_finished`` reaps a
  lease whose expiry has passed). A lease about to end is held a moment so that
  vLLM never reaps it on its own; at its real end it is revoked and reaped here if
  unprotected, else extended, up to the lease end plus ``lease_overrun`` (a WRITE's
  deadline and as much again). Past that cap the blocks are freed anyway (an error:
  the writer should have settled the request by then, e.g. its thread is stuck),
  unless a WRITE posted on them still runs: those stay held until NIXL ends it.
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import hmac
import itertools
import threading
from collections.abc import Iterable, MutableMapping

#: vLLM's reaper runs a moment after the keeper looked: a lease ending within this
#: many seconds is held until the keeper decides it (at its real end).
HOLD_S = 1.0


class _Claim(enum.Enum):
    PROTECTED = "protected"
    UNPROTECTED = "unprotected"
    REVOKED = "revoked"
    #: vLLM preempted the request after it was announced: its blocks went back to the
    #: pool in that step's schedule (revoked for good, whatever the lease says)
    PREEMPTED = "preempted"


#: the states in which no WRITE may start on a request's blocks
_REFUSED = (None, _Claim.REVOKED, _Claim.PREEMPTED)


class LeaseClaims:
    """Which finished requests' blocks a WRITE may read (see the module docstring).

    * engine thread: :meth:`hand`, :meth:`reap`, :meth:`force_reap`, :meth:`preempt`;
    * writer: :meth:`protect` (False once revoked), :meth:`unprotect`, :meth:`discard`,
      :meth:`start_write` (False once revoked), :meth:`end_write`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: dict[str, _Claim] = {}
        #: WRITEs posted on a request's blocks that NIXL has not reported ended
        self._running: dict[str, int] = {}

    # engine thread
    def hand(self, request_id: str) -> None:
        """The blocks go to the writer: protected until it decides."""
        with self._lock:
            if self._state.get(request_id) not in _REFUSED[1:]:
                self._state[request_id] = _Claim.PROTECTED

    def reap(self, request_id: str) -> bool:
        """The lease ended: True (now revoked) unless a WRITE may read the blocks."""
        with self._lock:
            if self._state.get(request_id) is _Claim.PROTECTED:
                return False
            if self._state.get(request_id) in (_Claim.PROTECTED, _Claim.UNPROTECTED):
                self._state[request_id] = _Claim.REVOKED
            return True

    def force_reap(self, request_id: str) -> bool:
        """The lease's hard cap: revoke even a protected request, unless NIXL may still
        run a WRITE reading its blocks (False: they stay held)."""
        with self._lock:
            if self._running.get(request_id):
                return False
            if self._state.get(request_id) in (_Claim.PROTECTED, _Claim.UNPROTECTED):
                self._state[request_id] = _Claim.REVOKED
            return True

    def preempt(self, request_id: str) -> bool:
        """vLLM preempted the announced request in the schedule of the step about to
        run: no WRITE may start on its blocks from now on (they may be another
        request's in this step). True while NIXL may still run a WRITE already posted on
        them: the engine thread must not run the step until it ended (S-SAFE-1)."""
        with self._lock:
            self._state[request_id] = _Claim.PREEMPTED
            return bool(self._running.get(request_id))

    def preempted(self, request_id: str) -> bool:
        """Refused because vLLM preempted the request (not because its lease ended)."""
        with self._lock:
            return self._state.get(request_id) is _Claim.PREEMPTED

    # writer thread
    def protect(self, request_id: str) -> bool:
        """A WRITE will read the blocks; False if the engine thread no longer holds them."""
        with self._lock:
            if self._state.get(request_id) in _REFUSED:
                return False
            self._state[request_id] = _Claim.PROTECTED
            return True

    def unprotect(self, request_id: str) -> None:
        with self._lock:
            if self._state.get(request_id) is _Claim.PROTECTED and not self._running.get(
                request_id
            ):
                self._state[request_id] = _Claim.UNPROTECTED

    def start_write(self, request_id: str) -> bool:
        """A WRITE reading the blocks is about to be posted; False if the engine thread
        no longer holds them (then it must not be posted)."""
        with self._lock:
            if self._state.get(request_id) in _REFUSED:
                return False
            self._state[request_id] = _Claim.PROTECTED
            self._running[request_id] = self._running.get(request_id, 0) + 1
            return True

    def end_write(self, request_id: str) -> None:
        """NIXL reported a WRITE started by :meth:`start_write` ended (done or error)."""
        with self._lock:
            left = self._running.get(request_id, 0) - 1
            if left > 0:
                self._running[request_id] = left
            else:
                self._running.pop(request_id, None)

    def running_writes(self) -> int:
        """Any thread: WRITEs (final and chunk) NIXL has not reported ended."""
        with self._lock:
            return sum(self._running.values())

    def writing(self, request_id: str) -> bool:
        """NIXL may still run a WRITE reading the request's blocks."""
        with self._lock:
            return bool(self._running.get(request_id))

    def discard(self, request_id: str) -> None:
        """The request is gone (evicted)."""
        with self._lock:
            self._state.pop(request_id, None)

    # either
    def protects(self, request_id: str) -> bool:
        with self._lock:
            return self._state.get(request_id) is _Claim.PROTECTED

    def __len__(self) -> int:
        with self._lock:
            return len(self._state)


class LeaseKeeper:
    """The engine thread's decisions on leases near their end (see the module docstring).

    It looks only at the leases that end within ``HOLD_S``: each lease is queued by its
    expiry (:meth:`track`, for the leases vLLM sets from a step's metadata; a lease
    the keeper does not know is queued when it finds more leases than it queued).
    vLLM only ever moves a lease later (heartbeats), which the queue finds when the
    old expiry comes up."""

    def __init__(self, claims: LeaseClaims, overrun_s: float) -> None:
        self.claims = claims
        self.overrun_s = overrun_s
        #: request id -> (its lease's real end, the expiry this keeper last set)
        self._ends: dict[str, tuple[float, float]] = {}
        #: requests past the hard cap whose blocks a running WRITE still pins
        self._pinned: set[str] = set()
        #: (expiry, seq, request id) of every lease known; an entry whose expiry is
        #: not ``_queued[id]`` is stale
        self._queue: list[tuple[float, int, str]] = []
        self._queued: dict[str, float] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._ends)

    def track(self, leases: MutableMapping[str, float], request_ids: Iterable[str]) -> None:
        """vLLM set the leases of ``request_ids`` (a step's ``reqs_to_send``)."""
        for rid in request_ids:
            expires = leases.get(rid)
            if expires is not None and self._queued.get(rid) != expires:
                self._enqueue(rid, expires)

    def next_expiry(self) -> float | None:
        """No lease the keeper knows expires before this (None: it knows none). A
        lease vLLM moved later may still be queued at its earlier expiry: a bound."""
        return self._queue[0][0] if self._queue else None

    def _enqueue(self, rid: str, expires: float) -> None:
        self._queued[rid] = expires
        heapq.heappush(self._queue, (expires, next(self._seq), rid))

    def _sync(self, leases: MutableMapping[str, float]) -> None:
        """Queue every lease the keeper does not know (or knows at another expiry)."""
        for rid, expires in leases.items():
            if self._queued.get(rid) != expires:
                self._enqueue(rid, expires)
        for rid in [r for r in self._queued if r not in leases]:
            del self._queued[rid]

    def _due(self, leases: MutableMapping[str, float], hold: float) -> list[tuple[str, float]]:
        """The leases ending by ``hold`` (id, expiry), taken off the queue."""
        if len(leases) > len(self._queued):  # a lease set outside ``track``
            self._sync(leases)
        due = []
        while self._queue and self._queue[0][0] <= hold:
            expires, _, rid = heapq.heappop(self._queue)
            if self._queued.get(rid) != expires:
                continue  # stale
            now_expires = leases.get(rid)
            if now_expires is None:
                del self._queued[rid]
            elif now_expires > hold:
                self._enqueue(rid, now_expires)  # moved later (a heartbeat)
            else:
                del self._queued[rid]
                due.append((rid, now_expires))
        if not self._queued:
            self._queue.clear()
        elif len(self._queue) > 2 * len(self._queued) + 64:  # mostly stale: rebuild
            self._queue = [e for e in self._queue if self._queued.get(e[2]) == e[0]]
            heapq.heapify(self._queue)
        return due

    def decide(
        self, leases: MutableMapping[str, float], now: float
    ) -> tuple[list[str], list[str], list[str]]:
        """Go over vLLM's leases (request id -> expiry, ``time.perf_counter``, in the
        order vLLM's reaper walks them); returns the requests to free now (those whose
        lease ended with nothing protecting them, and those at the hard cap) and the
        ones newly found past the cap but pinned by a running WRITE (held on)."""
        hold = now + HOLD_S
        ended: list[str] = []
        capped: list[str] = []
        pinned: list[str] = []
        held: list[tuple[str, float]] = []
        for rid, expires in self._due(leases, hold):
            end = self._lease_end(rid, expires)
            if now >= end and self.claims.reap(rid):
                ended.append(rid)
            elif now >= end + self.overrun_s and self.claims.force_reap(rid):
                capped.append(rid)
            else:  # not ended yet, or a WRITE may read the blocks: vLLM must not reap it
                if now >= end + self.overrun_s and rid not in self._pinned:
                    self._pinned.add(rid)  # past the cap: only a running WRITE is left
                    pinned.append(rid)
                # a running WRITE pins them: never let vLLM's reaper (a later clock in
                # the same step) find the lease ending at the cap
                writing = self.claims.writing(rid)
                until = hold if now < end or writing else min(hold, end + self.overrun_s)
                del leases[rid]  # vLLM's reaper stops at the first live lease
                leases[rid] = until
                self._ends[rid] = (end, until)
                held.append((rid, until))
                continue
            del leases[rid]
            self.forget(rid)
        for rid, until in held:  # (queued after the loop: until <= hold)
            self._enqueue(rid, until)
        return ended, capped, pinned

    def forget(self, request_id: str) -> None:
        self._ends.pop(request_id, None)
        self._pinned.discard(request_id)
        self._queued.pop(request_id, None)
        if not self._queued:  # every entry left is stale; an idle engine keeps none
            self._queue.clear()

    def _lease_end(self, rid: str, expires: float) -> float:
        """The lease's real end: ``expires``, unless that is this keeper's own hold
        (vLLM may have moved it since, e.g. a pull-mode heartbeat: then it is the end)."""
        known = self._ends.get(rid)
        if known is not None and known[1] == expires:
            return known[0]
        return expires


#: between a transfer id and its proof in a lease heartbeat's name (S-TMO-2)
HEARTBEAT_PROOF_SEP = "~"


def heartbeat_name(transfer_id: str, secret: str | None) -> str:
    """What a push D leg queued on D names in vLLM's lease heartbeat (``HB:``): its
    transfer id and, when its legs carry a secret, a proof of that secret (a BLAKE2b
    digest of secret and transfer id: the secret itself never travels in a heartbeat,
    which vLLM may log). P renews a held request that has a secret only with the
    proof, so nobody who merely saw a transfer id can keep P's blocks."""
    if not secret:
        return transfer_id
    return f"{transfer_id}{HEARTBEAT_PROOF_SEP}{_heartbeat_proof(transfer_id, secret)}"


def _heartbeat_proof(transfer_id: str, secret: str) -> str:
    data = f"{secret}\0{transfer_id}".encode()
    return hashlib.blake2b(data, digest_size=16, person=b"vllm-ext-HB").hexdigest()


class QueuedRenewals:
    """P, engine thread: the held requests a waiting D leg may renew by transfer id
    (S-TMO-2). A push D leg queued on D for blocks names its transfer id in vLLM's
    lease heartbeat (``HB:``), which otherwise names P request ids (pull mode), with a
    proof of the legs' secret where they carry one (:func:`heartbeat_name`). A renewal
    moves the lease as vLLM's own would (``extension`` from now), never past ``cap_s``
    after the request was held: a D that never allocates cannot keep P's blocks for
    good."""

    def __init__(self, cap_s: float) -> None:
        self.cap_s = cap_s
        #: transfer id -> the requests holding its blocks (the sub-requests of one
        #: client body share it: several prompts, ``n > 1``)
        self._by_transfer: dict[str, set[str]] = {}
        #: request id -> (its transfer id, the latest expiry a renewal may set, the
        #: P leg's secret)
        self._held: dict[str, tuple[str, float, str | None]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def hold(
        self, request_id: str, transfer_id: str | None, now: float, secret: str | None = None
    ) -> None:
        if transfer_id and request_id not in self._held:
            self._by_transfer.setdefault(transfer_id, set()).add(request_id)
            self._held[request_id] = (transfer_id, now + self.cap_s, secret)

    def forget(self, request_id: str) -> None:
        if (entry := self._held.pop(request_id, None)) is not None:
            held = self._by_transfer.get(entry[0], set())
            held.discard(request_id)
            if not held:
                self._by_transfer.pop(entry[0], None)

    def renew(
        self, leases: MutableMapping[str, float], names: list[str], now: float,
        extension: float,
    ) -> tuple[list[str], int]:  # fmt: skip
        """Renew the leases (``time.perf_counter`` expiries) of the requests holding
        the named transfers' blocks; returns the requests renewed and how many named
        requests were refused for a missing or wrong proof of their secret."""
        renewed, refused = [], 0
        for name in names:
            tid, sep, proof = name.rpartition(HEARTBEAT_PROOF_SEP)
            if not sep or tid not in self._by_transfer:  # no proof, or "~" in the id
                tid, proof = name, ""
            for rid in sorted(self._by_transfer.get(tid, ())):
                if rid not in leases:
                    continue
                _, cap, secret = self._held[rid]
                if secret and not hmac.compare_digest(proof, _heartbeat_proof(tid, secret)):
                    refused += 1
                    continue
                until = min(now + extension, cap)
                if until > leases[rid]:
                    del leases[rid]  # to the end, as the keeper moves the leases it extends
                    leases[rid] = until
                    renewed.append(rid)
        return renewed, refused
