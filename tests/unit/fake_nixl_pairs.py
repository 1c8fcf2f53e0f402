# SPDX-License-Identifier: Apache-2.0
"""Two fake NIXL agents with registered memory, for the fake's own tests
(``test_fake_nixl_api.py``, ``test_fake_nixl_parity.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from devkit.testing.fake_nixl import (
    FakeNixlAgent,
    FakeNixlFabric,
    FakeXferHandle,
)

N = 256


@dataclasses.dataclass
class Cfg:
    capture_telemetry: bool = True


@dataclasses.dataclass
class Pair:
    fabric: FakeNixlFabric
    a: FakeNixlAgent  # initiator ("P")
    b: FakeNixlAgent  # target ("D")
    src: torch.Tensor  # registered by a
    dst: torch.Tensor  # registered by b
    b_name: bytes  # what a.add_remote_agent returned

    def descs(self, t: torch.Tensor, rows: list[tuple[int, int]]) -> Any:
        return self.a.get_xfer_descs([(t.data_ptr() + o, n, 0) for o, n in rows], "DRAM")

    def write(self, rows: list[tuple[int, int]], notif: bytes = b"") -> FakeXferHandle:
        return self.a.initialize_xfer(
            "WRITE", self.descs(self.src, rows), self.descs(self.dst, rows), self.b_name, notif
        )


def make_pair(fabric: FakeNixlFabric, before: Callable[[str], Any] = lambda _: None) -> Pair:
    """Agents A and B, each built after ``before(name)`` ran (e.g. to set its env)."""
    before("A")
    a = FakeNixlAgent("A", Cfg(), fabric=fabric)
    before("B")
    b = FakeNixlAgent("B", fabric=fabric)
    src = torch.arange(N, dtype=torch.int32).to(torch.uint8)
    dst = torch.zeros(N, dtype=torch.uint8)
    a.register_memory(a.get_reg_descs([(src.data_ptr(), N, 0, "")], "DRAM"))
    b.register_memory(b.get_reg_descs([(dst.data_ptr(), N, 0, "")], "DRAM"))
    b_name = a.add_remote_agent(b.get_agent_metadata())
    return Pair(fabric, a, b, src, dst, b_name)
