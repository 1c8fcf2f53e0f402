# SPDX-License-Identifier: Apache-2.0
"""Deadlines of the tickets of one table, in a heap: a step looks only at those due,
not at every ticket tracked (scheduler.py)."""

from __future__ import annotations

import heapq
import itertools
from typing import Any


class DeadlineHeap:
    """Request ids by deadline (``time.monotonic()``), for the tickets of one table.

    An entry is stale once its ticket left the table or got another deadline; stale
    entries are skipped when they come up and dropped when they outnumber the live
    ones. The table stays the truth: :meth:`due` yields a ticket only while the table
    holds it with that very deadline."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, rid: str, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._seq), rid))

    def table_emptied(self) -> None:
        """The table holds no ticket any more: every entry is stale. (Called where a
        ticket leaves, so that an idle engine keeps no entry: a step may not come.)"""
        self._heap.clear()

    def due(self, table: dict[str, Any], now: float) -> list[tuple[str, Any]]:
        """The (id, ticket) pairs of ``table`` whose deadline passed, removed from the
        heap (the caller pushes a ticket again if it sets a new deadline)."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            deadline, _, rid = heapq.heappop(self._heap)
            ticket = table.get(rid)
            if ticket is not None and ticket.deadline == deadline:
                out.append((rid, ticket))
        if len(self._heap) > 2 * len(table) + 64:  # mostly stale: rebuild
            self._heap = [e for e in self._heap if _live(table, e)]
            heapq.heapify(self._heap)
        return out


def _live(table: dict[str, Any], entry: tuple[float, int, str]) -> bool:
    ticket = table.get(entry[2])
    return ticket is not None and ticket.deadline == entry[0]
