# SPDX-License-Identifier: Apache-2.0
"""The push rendezvous: P's finished blocks meet D's registrations (S-WRT-4).

Either side may arrive first; the second arrival produces the match that fires
the WRITE. Owned by the writer thread alone (no locking).

Id rules, in order:

1. ``transfer_id`` when both sides carry one (the proxy sets the same value on
   both legs), within one sub-request: vLLM splits one client body into
   sub-requests that all carry the body's ``transfer_id`` (a completion with
   several prompts: ids ``...-0``, ``...-1``; ``n > 1``: children ``0_...``,
   ``1_...``), so the id is qualified with the sub-request's place in the body
   (:func:`sub_request_of`). If both carry one and they differ, or the
   sub-requests differ, they do not match at all (S-WRT-4). A P request that
   carries one serves only a registration with the same one: the id, random and
   carried by both legs only, is what proves a registration belongs to it.
2. The exact request id (P's and D's ids are equal when vLLM's per-engine
   request-id randomization is off).
3. The base id: the request id with vLLM's per-engine random suffix
   (``-<8 hex>``) removed. The completion index before it is kept, so the
   sub-requests of a multi-prompt completion (``...-0``, ``...-1``) stay apart.

Whatever rule matched, the two sides' prompts must be the same (S-WRT-7,
:func:`same_prompt`): ids that collide can fail a request, never give it the KV
of another prompt.

One P request may serve several D ranks (D tp > P tp): a finished entry stays
until every expected registration was served, and until the worker evicts it
(WRITE done or lease expired). After that the rendezvous remembers it for a while
(:data:`RECENTLY_EVICTED_MAX` entries, ``gone_ttl`` seconds), so a registration
that arrives after P released the blocks is answered at once instead of waiting
out P's TTL: a repeat of one already served is a ``DUPLICATE`` (D had its answer:
the completion or a PUSH_FAIL) and is dropped; any other is ``LATE`` and the writer
tells D with a PUSH_FAIL so that D fails it now rather than at its watchdog.

It also indexes the P requests that are queued or prefilling (:meth:`Rendezvous.add_live`),
so that P renews D's watchdog only for a registration one of them will serve.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import re
import string
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from vllm_ext.nixl_push.send_lifecycle import PushSend, RegKey, reg_key
from vllm_ext.nixl_push.wire import PushRegistration

_HEX = frozenset(string.hexdigits.lower())
#: Length of the random suffix vLLM's input processor appends to request ids.
RANDOM_SUFFIX_LEN = 8
#: At most this many evicted P requests are remembered (oldest forgotten first).
RECENTLY_EVICTED_MAX = 4096
#: At most this many tombstones of cancels from agents P cannot tie to the D engine
#: they name (any peer can send those); a D's own cancels are kept for the whole TTL.
UNVERIFIED_CANCELS_MAX = 4096
#: The waiting registrations are looked over when the first of them is due (a
#: registration stored with its TTL moves that time; without one, it is at once), and
#: at least this often; not at every pass of the writer (every millisecond while busy).
REG_EXPIRY_SCAN_S = 1.0


def base_request_id(request_id: str) -> str:
    """``cmpl-abc-0-1a2b3c4d`` -> ``cmpl-abc-0``; ids without the suffix are unchanged."""
    head, sep, tail = request_id.rpartition("-")
    if sep and head and len(tail) == RANDOM_SUFFIX_LEN and set(tail) <= _HEX:
        return head
    return request_id


_CHILD_PREFIX = re.compile(r"^(\d+)_")


def sub_request_of(request_id: str) -> str:
    """Where a vLLM request id sits inside its client body: ``"<child>/<prompt>"``.

    vLLM names the ``n > 1`` children of a request ``<index>_<id>`` and the
    sub-requests of a multi-prompt completion ``<id>-<index>`` (before its per-engine
    random suffix). ``0_cmpl-x-1-1a2b3c4d`` -> ``"0/1"``; ``chatcmpl-x`` -> ``"/"``.
    Both legs of one transfer come from the same client body, so the same
    sub-request gets the same value on P and on D; a mismatch only ever prevents
    a match (the request then fails), never makes a wrong one.
    """
    base = base_request_id(request_id)
    child = m.group(1) if (m := _CHILD_PREFIX.match(base)) else ""
    _, sep, tail = base.rpartition("-")
    prompt = tail if sep and tail.isdigit() else ""
    return f"{child}/{prompt}"


def body_of(request_id: str) -> str:
    """The client body a vLLM request id belongs to: the id without what
    :func:`sub_request_of` reads (the ``<child>_`` prefix, the ``-<prompt>`` index)
    and without the per-engine random suffix. ``1_cmpl-x-2-1a2b3c4d`` -> ``cmpl-x``."""
    base = base_request_id(request_id)
    if m := _CHILD_PREFIX.match(base):
        base = base[m.end() :]
    head, sep, tail = base.rpartition("-")
    return head if sep and head and tail.isdigit() else base


def transfer_tag(transfer_id: str | None, request_id: str) -> str | None:
    """The id rule 1 matches by: the transfer id of the client body, qualified with
    the sub-request (:func:`sub_request_of`); None without a transfer id."""
    return None if transfer_id is None else f"{transfer_id}#{sub_request_of(request_id)}"


@dataclasses.dataclass(eq=False)
class PendingReg:
    """A PUSH_REG waiting for P's blocks, and the NIXL agent that sent it."""

    registration: PushRegistration
    sender: str
    #: when it arrived, or when P last renewed it (a live P request awaits it)
    since: float
    #: P renewed it (PUSH_HB): from then on it is kept only while a live P request
    #: awaits it (N-LIV-1: D counts on P's TTL only for one P never renewed)
    renewed: bool = False


@dataclasses.dataclass(frozen=True)
class Match:
    send: PushSend
    registration: PushRegistration
    sender: str
    rule: str  # "transfer_id" | "exact" | "base_id"
    #: when the registration arrived (or P last renewed it)
    since: float


class RegResult(enum.Enum):
    STORED = "stored"  # waits for P's blocks
    MATCHED = "matched"  # P's blocks were waiting: write them
    DUPLICATE = "duplicate"  # this registration is already waiting or served
    TAKEN = "taken"  # its P request serves another request of its D engine and rank
    FOREIGN = "foreign"  # its key is waiting, registered by another agent
    LATE = "late"  # P already released the blocks it would have matched
    UNAUTHORIZED = "unauthorized"  # its P request's leg has a secret; it lacks it
    MISMATCHED = "mismatched"  # its P request's prompt is not D's (S-WRT-7): refused
    CANCELLED = "cancelled"  # D cancelled this registration before (a replay)


@dataclasses.dataclass(frozen=True)
class RegOutcome:
    result: RegResult
    match: Match | None = None


class RegWhere(enum.Enum):
    PENDING = "pending"  # waiting for its blocks
    SERVED = "served"  # matched: a WRITE was started for it
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class _Gone:
    """An evicted P request, remembered for late registrations."""

    transfer_id: str | None
    served_keys: frozenset[RegKey]
    evicted_at: float


K = TypeVar("K", str, RegKey)


class _Index(Generic[K]):
    """str -> set of keys, for one id rule."""

    def __init__(self) -> None:
        self._m: dict[str, set[K]] = defaultdict(set)

    def add(self, k: str | None, key: K) -> None:
        if k:
            self._m[k].add(key)

    def discard(self, k: str | None, key: K) -> None:
        if k and k in self._m:
            self._m[k].discard(key)
            if not self._m[k]:
                del self._m[k]

    def get(self, k: str | None) -> set[K]:
        return set(self._m.get(k, ())) if k else set()

    def __len__(self) -> int:
        return len(self._m)


class _Indexes(Generic[K]):
    """The three id rules over one table: transfer id, exact id, base id."""

    RULES = ("transfer_id", "exact", "base_id")

    def __init__(self) -> None:
        self._by: dict[str, _Index[K]] = {rule: _Index() for rule in self.RULES}

    def add(self, transfer_id: str | None, request_id: str, key: K) -> None:
        for rule, probe in _probes(transfer_id, request_id):
            self._by[rule].add(probe, key)

    def discard(self, transfer_id: str | None, request_id: str, key: K) -> None:
        for rule, probe in _probes(transfer_id, request_id):
            self._by[rule].discard(probe, key)

    def lookup(self, transfer_id: str | None, request_id: str) -> Iterator[tuple[str, K]]:
        """(rule, key) candidates, rule by rule in order, keys sorted within a rule."""
        for rule, probe in _probes(transfer_id, request_id):
            for key in sorted(self._by[rule].get(probe)):
                yield rule, key

    def empty(self) -> bool:
        return all(len(ix) == 0 for ix in self._by.values())


class Rendezvous:
    """The two matching tables, ``_pending_d_registrations`` (:class:`PendingReg`) and
    ``_push_finished_blocks`` (:class:`~vllm_ext.nixl_push.send_lifecycle.PushSend`), plus
    what P recently evicted and what it has live."""

    def __init__(self, p_tp_size: int, gone_ttl: float = 480.0) -> None:
        self.p_tp_size = p_tp_size
        self.gone_ttl = gone_ttl
        self._pending_d_registrations: dict[RegKey, PendingReg] = {}
        self._push_finished_blocks: dict[str, PushSend] = {}
        #: the requests of _push_finished_blocks matched at least once (they have
        #: WRITEs): the writer's passes look at these, not at every finished request
        self._serving: dict[str, PushSend] = {}
        #: when :meth:`expire` looks over the waiting registrations next
        self._reg_scan_due = 0.0
        self._reg_by: _Indexes[RegKey] = _Indexes()
        self._fin_by: _Indexes[str] = _Indexes()
        self._gone: OrderedDict[str, _Gone] = OrderedDict()
        #: registrations D cancelled, or P answered (tombstones): a duplicated or
        #: reordered PUSH_REG of one arriving later is never stored nor served (its
        #: blocks are D's again).
        #: Cancels from the agent that registered, or from the D agent P is connected to
        #: for that rank, stay for ``gone_ttl`` whatever their number; the others are
        #: capped (:data:`UNVERIFIED_CANCELS_MAX`), oldest forgotten first.
        self._cancelled: OrderedDict[tuple[RegKey, str], float] = OrderedDict()
        self._cancelled_unverified: OrderedDict[tuple[RegKey, str], float] = OrderedDict()
        self._gone_by: _Indexes[str] = _Indexes()
        self._live: dict[str, str | None] = {}
        self._live_by: _Indexes[str] = _Indexes()
        #: registrations dropped because their id met a P request with another prompt
        #: (S-WRT-7); the writer takes them (:meth:`take_refused`) and answers D
        self.refused: list[PendingReg] = []

    # -- arrivals -------------------------------------------------------------------
    def add_registration(
        self, reg: PushRegistration, sender: str, now: float, ttl_s: float | None = None
    ) -> RegOutcome:
        """A PUSH_REG arrived from the NIXL agent ``sender``; stored, it waits at most
        ``ttl_s`` (:meth:`expire`; None: the TTL ``expire`` is given)."""
        key = reg_key(reg)
        if (key, sender) in self._cancelled or (key, sender) in self._cancelled_unverified:
            return RegOutcome(RegResult.CANCELLED)
        pending = self._pending_d_registrations.get(key)
        if pending is not None:
            same = pending.sender == sender
            return RegOutcome(RegResult.DUPLICATE if same else RegResult.FOREIGN)
        found = self._find_send(reg)
        if found is None and self._find_send(reg, check_secret=False) is not None:
            return RegOutcome(RegResult.UNAUTHORIZED)
        if found is not None and not same_prompt(reg, found[0]):
            return RegOutcome(RegResult.MISMATCHED)
        if found is not None:
            send, rule = found
            if (reg.engine_id, reg.tp_rank) in send.served:
                taken = key not in send.served_keys  # another D request of that rank
                return RegOutcome(RegResult.TAKEN if taken else RegResult.DUPLICATE)
            return RegOutcome(RegResult.MATCHED, self._serve(send, reg, sender, rule, now))
        gone = self._find_gone(reg)
        if gone is not None:
            late = key not in gone.served_keys
            return RegOutcome(RegResult.LATE if late else RegResult.DUPLICATE)
        self._pending_d_registrations[key] = PendingReg(reg, sender, now)
        self._reg_by.add(reg.transfer_id, reg.request_id, key)
        self._reg_scan_due = min(self._reg_scan_due, now + ttl_s if ttl_s is not None else now)
        return RegOutcome(RegResult.STORED)

    def add_finished(self, send: PushSend) -> list[Match]:
        """P handed a request's blocks over; returns the matches (maybe none)."""
        rid = send.request_id
        if rid in self._push_finished_blocks:
            raise ValueError(f"{rid} is already in the rendezvous")
        self._push_finished_blocks[rid] = send
        self._fin_by.add(send.transfer_id, rid, rid)
        self.drop_live(rid)
        matches = []
        for rule, key in self._reg_by.lookup(send.transfer_id, rid):
            pending = self._pending_d_registrations.get(key)
            if pending is None or not _compatible(
                _tag_of(pending.registration), transfer_tag(send.transfer_id, rid)
            ):
                continue
            if not authorized(pending.registration, send):
                continue  # not from the D this request was sent to: left to expire
            if send.complete:
                break
            if not same_prompt(pending.registration, send):
                self.refused.append(self._drop_registration(key))
                continue
            self._drop_registration(key)
            matches.append(
                self._serve(send, pending.registration, pending.sender, rule, pending.since)
            )
        return matches

    # -- departures -----------------------------------------------------------------
    def evict(self, p_request_id: str, now: float) -> PushSend | None:
        """Forget a P request (settled, or its lease ended); remember it for a while."""
        send = self._push_finished_blocks.pop(p_request_id, None)
        self._serving.pop(p_request_id, None)
        self.drop_live(p_request_id)
        if send is None:
            return None
        self._fin_by.discard(send.transfer_id, p_request_id, p_request_id)
        self._gone[p_request_id] = _Gone(send.transfer_id, frozenset(send.served_keys), now)
        self._gone_by.add(send.transfer_id, p_request_id, p_request_id)
        while len(self._gone) > RECENTLY_EVICTED_MAX:
            self._forget_gone(next(iter(self._gone)))
        return send

    def find_registration(self, key: RegKey) -> tuple[RegWhere, str | None]:
        """Where D's registration ``key`` is, and the agent that sent it (if known)."""
        pending = self._pending_d_registrations.get(key)
        if pending is not None:
            return RegWhere.PENDING, pending.sender
        for send in self._serving.values():
            if key in send.served_keys:
                senders = [w.sender for w in send.writes if w.key == key]
                return RegWhere.SERVED, senders[0] if senders else None
        return RegWhere.UNKNOWN, None

    def drop_registration(self, key: RegKey) -> PendingReg | None:
        """D cancelled a registration that still waits for its blocks."""
        if key not in self._pending_d_registrations:
            return None
        return self._drop_registration(key)

    def remember_cancelled(self, key: RegKey, sender: str, now: float, verified: bool) -> None:
        """The agent ``sender`` cancelled ``key``: refuse its PUSH_REG of it from now on,
        for ``gone_ttl`` seconds (D's request ids are unique). Keyed by the sender too,
        so nobody else can cancel ahead. ``verified``: the sender registered ``key`` or
        is the D agent P is connected to for that engine and rank; the number of those
        is bounded by that D's own cancels in ``gone_ttl``, so none is forgotten early
        (a PUSH_REG delayed past a forgotten tombstone would be served into blocks D
        reused). The others are capped at :data:`UNVERIFIED_CANCELS_MAX`."""
        table = self._cancelled if verified else self._cancelled_unverified
        table[(key, sender)] = now
        table.move_to_end((key, sender))
        while not verified and len(table) > UNVERIFIED_CANCELS_MAX:
            table.popitem(last=False)

    def remember_answered(self, key: RegKey, sender: str, now: float, verified: bool) -> None:
        """P answered ``key`` (a PUSH_FAIL: expired, late, refused, or ended on a heal)
        and holds it no more: D lets its blocks go on that answer, so a duplicated or
        delayed PUSH_REG of it is refused from now on, as after a cancel."""
        self.remember_cancelled(key, sender, now, verified)

    def tombstones(self) -> int:
        """Cancelled registrations remembered now (both kinds)."""
        return len(self._cancelled) + len(self._cancelled_unverified)

    def expire(self, now: float, ttl: Callable[[PushRegistration], float]) -> list[PendingReg]:
        """Drop registrations that waited (since arrival or renewal) longer than their
        ``ttl``, and those P renewed that no live P request awaits any more (N-LIV-1:
        D counts on P's TTL only for a registration P never renewed); forget evicted
        requests older than ``gone_ttl``."""
        out = []
        if now >= self._reg_scan_due:
            old, due = [], now + REG_EXPIRY_SCAN_S
            pending = self._pending_d_registrations
            awaited = (
                {id(p) for p in self.awaited()}
                if any(p.renewed for p in pending.values())
                else set()
            )
            for k, p in pending.items():
                ends = p.since + ttl(p.registration)
                if now > ends or (p.renewed and id(p) not in awaited):
                    old.append(k)
                else:  # (a renewal only moves ``since`` later)
                    due = min(due, ends)
            out = [self._drop_registration(k) for k in old]
            self._reg_scan_due = due
        while self._gone:
            rid, gone = next(iter(self._gone.items()))
            if now - gone.evicted_at <= self.gone_ttl:
                break
            self._forget_gone(rid)
        for table in (self._cancelled, self._cancelled_unverified):
            while table and now - next(iter(table.values())) > self.gone_ttl:
                table.popitem(last=False)
        return out

    # -- live P requests (heartbeats) --------------------------------------------------
    def add_live(self, p_request_id: str, transfer_id: str | None) -> None:
        """P's scheduler has this request (queued or prefilling)."""
        if p_request_id in self._live or p_request_id in self._push_finished_blocks:
            return
        self._live[p_request_id] = transfer_id
        self._live_by.add(transfer_id, p_request_id, p_request_id)

    def drop_live(self, p_request_id: str) -> None:
        if p_request_id in self._live:
            tid = self._live.pop(p_request_id)
            self._live_by.discard(tid, p_request_id, p_request_id)
            pending = self._pending_d_registrations
            if any(
                key in pending and pending[key].renewed
                for _, key in self._reg_by.lookup(tid, p_request_id)
            ):
                self._reg_scan_due = 0.0  # a renewed registration it awaited ends (expire)

    def awaited(self) -> Iterator[PendingReg]:
        """Waiting registrations that a live P request will serve."""
        for pending in self._pending_d_registrations.values():
            reg = pending.registration
            for _, rid in self._live_by.lookup(reg.transfer_id, reg.request_id):
                if _compatible(_tag_of(reg), transfer_tag(self._live[rid], rid)):
                    yield pending
                    break

    def take_refused(self) -> list[PendingReg]:
        out, self.refused = self.refused, []
        return out

    # -- queries --------------------------------------------------------------------
    def finished(self, p_request_id: str) -> PushSend | None:
        return self._push_finished_blocks.get(p_request_id)

    def sends(self) -> list[PushSend]:
        return list(self._push_finished_blocks.values())

    def serving(self) -> list[PushSend]:
        """The finished requests matched at least once: those with WRITEs."""
        return list(self._serving.values())

    @property
    def has_unmatched_finished(self) -> bool:
        """True while P holds finished blocks that still wait for a registration."""
        return any(not s.complete for s in self._push_finished_blocks.values())

    def pending_count(self) -> int:
        """Registrations waiting for their request's KV or a match (any thread: one len)."""
        return len(self._pending_d_registrations)

    def pending_keys_of(self, engine_id: str) -> list[RegKey]:
        """The waiting registrations of D engine ``engine_id``."""
        return [k for k in self._pending_d_registrations if k[0] == engine_id]

    def pending_registrations(self) -> Iterator[PushRegistration]:
        return (p.registration for p in self._pending_d_registrations.values())

    def __len__(self) -> int:
        return len(self._pending_d_registrations) + len(self._push_finished_blocks)

    def is_empty(self) -> bool:
        """No registration, finished request or live request (evicted ones may be
        remembered)."""
        return (
            len(self) == 0
            and not self._live
            and self._reg_by.empty()
            and self._fin_by.empty()
            and self._live_by.empty()
        )

    # -- internals --------------------------------------------------------------------
    def _expected_for(self, reg: PushRegistration) -> int:
        # D ranks served by one P rank: the D ranks holding a slice of its heads.
        return reg.tp_size // self.p_tp_size if reg.tp_size > self.p_tp_size else 1

    def _serve(
        self, send: PushSend, reg: PushRegistration, sender: str, rule: str, since: float
    ) -> Match:
        send.serve(reg, self._expected_for(reg))
        self._serving[send.request_id] = send
        return Match(send, reg, sender, rule, since)

    def _find_send(
        self, reg: PushRegistration, check_secret: bool = True
    ) -> tuple[PushSend, str] | None:
        for rule, rid in self._fin_by.lookup(reg.transfer_id, reg.request_id):
            send = self._push_finished_blocks[rid]
            if not _compatible(_tag_of(reg), transfer_tag(send.transfer_id, rid)):
                continue
            if check_secret and not authorized(reg, send):
                continue
            if not send.complete or (reg.engine_id, reg.tp_rank) in send.served:
                return send, rule  # to serve, or a duplicate the caller drops
        return None

    def _find_gone(self, reg: PushRegistration) -> _Gone | None:
        for _, rid in self._gone_by.lookup(reg.transfer_id, reg.request_id):
            gone = self._gone[rid]
            if _compatible(_tag_of(reg), transfer_tag(gone.transfer_id, rid)):
                return gone
        return None

    def _forget_gone(self, p_request_id: str) -> None:
        gone = self._gone.pop(p_request_id)
        self._gone_by.discard(gone.transfer_id, p_request_id, p_request_id)

    def _drop_registration(self, key: RegKey) -> PendingReg:
        pending = self._pending_d_registrations.pop(key)
        reg = pending.registration
        self._reg_by.discard(reg.transfer_id, reg.request_id, key)
        return pending


def authorized(reg: PushRegistration, send: PushSend) -> bool:
    """S-LEG-3: a P request whose leg carries a ``transfer_secret`` serves only a
    registration carrying the same secret (compared in constant time); one without
    a secret serves any (the behaviour of legs from proxies that send none)."""
    if send.secret is None:
        return True
    return reg.secret is not None and hmac.compare_digest(reg.secret, send.secret)


def same_prompt(reg: PushRegistration, send: PushSend) -> bool:
    """S-WRT-7: a P request's KV goes only into the blocks of a registration for the
    same prompt (when both sides know it: an older D sends no key)."""
    return reg.prompt is None or send.prompt is None or reg.prompt == send.prompt


def _tag_of(reg: PushRegistration) -> str | None:
    return transfer_tag(reg.transfer_id, reg.request_id)


def _probes(transfer_id: str | None, request_id: str) -> list[tuple[str, str | None]]:
    return [
        ("transfer_id", transfer_tag(transfer_id, request_id)),
        ("exact", request_id),
        ("base_id", base_request_id(request_id)),
    ]


def _compatible(reg_tag: str | None, send_tag: str | None) -> bool:
    """A registration's transfer tag (:func:`transfer_tag`) allows a match with a P
    request's: a P request whose leg carried a transfer id (or got one from P) serves
    only a registration with the same tag, the id being the unguessable name of the
    transfer that both legs carried; one without serves any (S-WRT-4)."""
    return send_tag is None or reg_tag == send_tag
