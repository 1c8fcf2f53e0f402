# SPDX-License-Identifier: Apache-2.0
"""The push rendezvous: P's finished blocks meet D's registrations (S-WRT-4).

Either side may arrive first; the second arrival produces the match that fires
the WRITE. Owned by the writer thread alone (no locking).

Id rules, in order:

1. ``transfer_id`` when both sides carry one (the proxy sets the same value on
   both legs). If both carry one and they differ, they do not match at all.
2. The exact request id (P's and D's ids are equal when vLLM's per-engine
   request-id randomization is off).
3. The base id: the request id with vLLM's per-engine random suffix
   (``-<8 hex>``) removed. The completion index before it is kept, so the
   sub-requests of a multi-prompt completion (``...-0``, ``...-1``) stay apart.

One P request may serve several D ranks (D tp > P tp): a finished entry stays
until every expected registration was served, and until the worker evicts it
(WRITE done or lease expired), so a late duplicate is recognised as one.
"""

from __future__ import annotations

import dataclasses
import string
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from vllm_ext.nixl_push.wire import PushRegistration

_HEX = frozenset(string.hexdigits.lower())
#: Length of the random suffix vLLM's input processor appends to request ids.
RANDOM_SUFFIX_LEN = 8


def base_request_id(request_id: str) -> str:
    """``cmpl-abc-0-1a2b3c4d`` -> ``cmpl-abc-0``; ids without the suffix are unchanged."""
    head, sep, tail = request_id.rpartition("-")
    if sep and head and len(tail) == RANDOM_SUFFIX_LEN and set(tail) <= _HEX:
        return head
    return request_id


RegKey = tuple[str, str, int]  # (D engine id, D request id, D tp rank)


def reg_key(reg: PushRegistration) -> RegKey:
    return (reg.engine_id, reg.request_id, reg.tp_rank)


@dataclasses.dataclass
class FinishedBlocks:
    """P side: a prefilled request whose blocks wait to be written."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    transfer_id: str | None = None
    #: time.monotonic() when the KV was final on P (hand-off latency start)
    finished_at: float = 0.0
    #: something with ``synchronize()`` to wait on before reading the blocks (a CUDA
    #: event recorded after the forward pass that wrote them), or None
    ready: Any = None
    #: False while the forward pass that writes the KV still runs (announced early,
    #: see PushWriter.announce): WRITEs may be prepared, not posted.
    final: bool = True
    #: D (engine, rank) pairs already matched to this entry.
    served: set[tuple[str, int]] = dataclasses.field(default_factory=set)
    #: How many D registrations this P rank must serve; known from the first one.
    expected: int | None = None
    #: the registrations matched to this entry, by key
    served_keys: set[tuple[str, str, int]] = dataclasses.field(default_factory=set)

    @property
    def complete(self) -> bool:
        return self.expected is not None and len(self.served) >= self.expected


@dataclasses.dataclass(frozen=True)
class Match:
    finished: FinishedBlocks
    registration: PushRegistration
    rule: str  # "transfer_id" | "exact" | "base_id"


class _Index:
    """str -> set of keys, for the three id rules."""

    def __init__(self) -> None:
        self._m: dict[str, set[Hashable]] = defaultdict(set)

    def add(self, k: str | None, key: Hashable) -> None:
        if k:
            self._m[k].add(key)

    def discard(self, k: str | None, key: Hashable) -> None:
        if k and k in self._m:
            self._m[k].discard(key)
            if not self._m[k]:
                del self._m[k]

    def get(self, k: str | None) -> set[Hashable]:
        return set(self._m.get(k, ())) if k else set()

    def __len__(self) -> int:
        return len(self._m)


class Rendezvous:
    """The two matching tables: ``_pending_d_registrations`` and ``_push_finished_blocks``."""

    def __init__(self, p_tp_size: int) -> None:
        self.p_tp_size = p_tp_size
        self._pending_d_registrations: dict[RegKey, tuple[PushRegistration, float]] = {}
        self._push_finished_blocks: dict[str, FinishedBlocks] = {}
        self._reg_by = {"transfer_id": _Index(), "exact": _Index(), "base_id": _Index()}
        self._fin_by = {"transfer_id": _Index(), "exact": _Index(), "base_id": _Index()}

    # -- arrivals -------------------------------------------------------------------
    def add_registration(self, reg: PushRegistration, now: float) -> Match | None | bool:
        """A PUSH_REG arrived. Returns the match, None (stored), or False (duplicate)."""
        key = reg_key(reg)
        if key in self._pending_d_registrations:
            return False
        fin = self._find_finished(reg)
        if fin is not None:
            finished, rule = fin
            if (reg.engine_id, reg.tp_rank) in finished.served:
                return False
            return self._serve(finished, reg, rule)
        self._pending_d_registrations[key] = (reg, now)
        self._reg_by["transfer_id"].add(reg.transfer_id, key)
        self._reg_by["exact"].add(reg.request_id, key)
        self._reg_by["base_id"].add(base_request_id(reg.request_id), key)
        return None

    def add_finished(self, finished: FinishedBlocks) -> list[Match] | bool:
        """P finished a request. Returns the matches (maybe none), or False (duplicate)."""
        rid = finished.request_id
        if rid in self._push_finished_blocks:
            return False
        self._push_finished_blocks[rid] = finished
        self._fin_by["transfer_id"].add(finished.transfer_id, rid)
        self._fin_by["exact"].add(rid, rid)
        self._fin_by["base_id"].add(base_request_id(rid), rid)
        matches = []
        for key, rule in self._find_registrations(finished):
            if finished.complete:
                break
            reg, _ = self._pending_d_registrations[key]
            self._drop_registration(key)
            matches.append(self._serve(finished, reg, rule))
        return matches

    # -- departures -----------------------------------------------------------------
    def evict(self, p_request_id: str) -> FinishedBlocks | None:
        """Forget a P request (WRITE finished or lease expired)."""
        fin = self._push_finished_blocks.pop(p_request_id, None)
        if fin is not None:
            self._fin_by["transfer_id"].discard(fin.transfer_id, p_request_id)
            self._fin_by["exact"].discard(p_request_id, p_request_id)
            self._fin_by["base_id"].discard(base_request_id(p_request_id), p_request_id)
        return fin

    def cancel_registration(self, key: RegKey) -> str:
        """D cancelled: ``"dropped"`` (was waiting), ``"served"`` (a WRITE was
        started for it; its completion will answer) or ``"unknown"``."""
        if key in self._pending_d_registrations:
            self._drop_registration(key)
            return "dropped"
        for fin in self._push_finished_blocks.values():
            if key in fin.served_keys:
                return "served"
        return "unknown"

    def expire_registrations(
        self, now: float, ttl: float | Callable[[PushRegistration], float]
    ) -> list[PushRegistration]:
        """Drop registrations that waited longer than ``ttl`` seconds (or ``ttl(reg)``)."""
        ttl_of = ttl if callable(ttl) else (lambda _reg: ttl)
        old = [k for k, (r, t) in self._pending_d_registrations.items() if now - t > ttl_of(r)]
        out = [self._pending_d_registrations[k][0] for k in old]
        for k in old:
            self._drop_registration(k)
        return out

    # -- queries --------------------------------------------------------------------
    def finished(self, p_request_id: str) -> FinishedBlocks | None:
        return self._push_finished_blocks.get(p_request_id)

    @property
    def has_unmatched_finished(self) -> bool:
        """True while P holds finished blocks that still wait for a registration."""
        return any(not f.complete for f in self._push_finished_blocks.values())

    def pending_registrations(self) -> Iterator[PushRegistration]:
        return (r for r, _ in self._pending_d_registrations.values())

    def __len__(self) -> int:
        return len(self._pending_d_registrations) + len(self._push_finished_blocks)

    def is_empty(self) -> bool:
        return len(self) == 0 and all(
            len(ix) == 0 for ix in (*self._reg_by.values(), *self._fin_by.values())
        )

    # -- internals --------------------------------------------------------------------
    def _expected_for(self, reg: PushRegistration) -> int:
        # D ranks served by one P rank: the D ranks holding a slice of its heads.
        return reg.tp_size // self.p_tp_size if reg.tp_size > self.p_tp_size else 1

    def _serve(self, finished: FinishedBlocks, reg: PushRegistration, rule: str) -> Match:
        if finished.expected is None:
            finished.expected = self._expected_for(reg)
        finished.served.add((reg.engine_id, reg.tp_rank))
        finished.served_keys.add(reg_key(reg))
        return Match(finished, reg, rule)

    def _find_finished(self, reg: PushRegistration) -> tuple[FinishedBlocks, str] | None:
        for rule, probe in self._probes(reg.transfer_id, reg.request_id):
            for rid in sorted(self._fin_by[rule].get(probe)):  # type: ignore[type-var]
                fin = self._push_finished_blocks[str(rid)]
                if _compatible(reg.transfer_id, fin.transfer_id) and not fin.complete:
                    return fin, rule
                if _compatible(reg.transfer_id, fin.transfer_id) and (
                    (reg.engine_id, reg.tp_rank) in fin.served
                ):
                    return fin, rule  # a duplicate; the caller drops it
        return None

    def _find_registrations(self, fin: FinishedBlocks) -> Iterator[tuple[RegKey, str]]:
        seen: set[RegKey] = set()
        for rule, probe in self._probes(fin.transfer_id, fin.request_id):
            for key in sorted(self._reg_by[rule].get(probe)):  # type: ignore[type-var]
                k: RegKey = key  # type: ignore[assignment]
                if k in seen or k not in self._pending_d_registrations:
                    continue
                reg = self._pending_d_registrations[k][0]
                if _compatible(reg.transfer_id, fin.transfer_id):
                    seen.add(k)
                    yield k, rule

    @staticmethod
    def _probes(transfer_id: str | None, request_id: str) -> list[tuple[str, str | None]]:
        return [
            ("transfer_id", transfer_id),
            ("exact", request_id),
            ("base_id", base_request_id(request_id)),
        ]

    def _drop_registration(self, key: RegKey) -> None:
        reg, _ = self._pending_d_registrations.pop(key)
        self._reg_by["transfer_id"].discard(reg.transfer_id, key)
        self._reg_by["exact"].discard(reg.request_id, key)
        self._reg_by["base_id"].discard(base_request_id(reg.request_id), key)


def _compatible(a: str | None, b: str | None) -> bool:
    """Two transfer ids allow a match unless both are set and differ."""
    return a is None or b is None or a == b
