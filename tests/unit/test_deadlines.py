# SPDX-License-Identifier: Apache-2.0
"""DeadlineHeap: a step finds the tickets whose deadline passed, and only while the
table still holds them with that deadline (the table is the truth)."""

from __future__ import annotations

import dataclasses

from vllm_ext.nixl_push.deadlines import DeadlineHeap


@dataclasses.dataclass
class Ticket:
    deadline: float


def test_only_the_due_tickets_come_out_in_deadline_order() -> None:
    table = {f"r{i}": Ticket(float(i)) for i in range(10)}
    heap = DeadlineHeap()
    for rid in reversed(list(table)):
        heap.push(rid, table[rid].deadline)
    assert [rid for rid, _ in heap.due(table, now=2.5)] == ["r0", "r1", "r2"]
    assert heap.due(table, now=2.5) == []  # taken off: not again
    assert [rid for rid, _ in heap.due(table, now=4.0)] == ["r3", "r4"]


def test_a_ticket_gone_or_moved_is_not_due_at_its_old_deadline() -> None:
    table = {"gone": Ticket(1.0), "moved": Ticket(1.0), "kept": Ticket(1.0)}
    heap = DeadlineHeap()
    for rid, t in table.items():
        heap.push(rid, t.deadline)
    del table["gone"]
    table["moved"].deadline = 5.0  # renewed: its owner pushes the new deadline
    heap.push("moved", 5.0)
    assert [rid for rid, _ in heap.due(table, now=2.0)] == ["kept"]
    assert [rid for rid, _ in heap.due(table, now=5.0)] == ["moved"]


def test_stale_entries_are_dropped_once_they_outnumber_the_table() -> None:
    table = {"r": Ticket(0.0)}
    heap = DeadlineHeap()
    for i in range(200):  # renewed again and again
        table["r"].deadline = 1000.0 + i
        heap.push("r", table["r"].deadline)
    assert heap.due(table, now=0.0) == []
    assert len(heap) <= 2 * len(table) + 64
    assert [rid for rid, _ in heap.due(table, now=2000.0)] == ["r"]
