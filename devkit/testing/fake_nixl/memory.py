# SPDX-License-Identifier: Apache-2.0
"""Memory in the fake NIXL: descriptors, registered regions, descriptor lists, and NIXL's
merging of neighbouring descriptors."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from devkit.testing.fake_nixl.errors import (
    _MEM_TYPES,
    _UNSUPPORTED_MEM_TYPES,
    FakeNixlInvalidParamError,
    FakeNixlNotSupportedError,
)


# --------------------------------------------------------------------- small types
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
