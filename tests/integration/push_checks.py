# SPDX-License-Identifier: Apache-2.0
"""What the push integration tests check KV and logs with, and a side channel that
answers junk (``push_harness`` re-exports every name: the tests import them from there).
The checks read an :class:`~push_harness.Engine`'s ranks and KV tensors."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import msgspec
import torch
import zmq
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from devkit.testing.inproc import LAYERS, NUM_KV_HEADS

if TYPE_CHECKING:
    from push_harness import Engine


class GarbageSideChannel:
    """A side channel answering every handshake query with junk: handshakes fail at once."""

    def __init__(self, port: int) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://127.0.0.1:{port}")
        self._stop = threading.Event()
        self.queries = 0
        self._t = threading.Thread(target=self._run, name="garbage-side-channel", daemon=True)
        self._t.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(10):
                continue
            identity, _, msg = self._sock.recv_multipart()
            msgspec.msgpack.decode(msg)
            self.queries += 1
            self._sock.send_multipart((identity, b"", b"\x00 not a handshake payload"))

    def stop(self) -> None:
        self._stop.set()
        self._t.join(2)
        self._sock.close(0)
        self._ctx.term()


def kv_blocks(block_ids: Sequence[int]) -> KVCacheBlocks:
    """Real ``KVCacheBlocks`` (one KV cache group) of unhashed blocks with these ids."""
    return KVCacheBlocks((tuple(KVCacheBlock(block_id=b) for b in block_ids),))


# -- KV content checks -------------------------------------------------------------------


def block_pairs(
    p: Engine, d: Engine, p_logical: Sequence[int], d_logical: Sequence[int], prefix_tokens: int = 0
) -> list[tuple[int, int]]:
    """(P physical block, D physical block) pairs that must hold the same tokens."""
    kernel = p.spec.kernel_block_size or p.spec.block_size
    assert prefix_tokens % kernel == 0
    src = p.physical(p_logical)[prefix_tokens // kernel :]
    dst = d.physical(d_logical)
    n = min(len(src), len(dst))
    return list(zip(src[:n], dst[:n]))


def assert_kv_pushed(p: Engine, d: Engine, pairs: Sequence[tuple[int, int]]) -> None:
    """D's blocks hold P's bytes, head for head across the TP ranks of both sides."""
    assert pairs
    p_heads = NUM_KV_HEADS // p.spec.tp
    d_heads = NUM_KV_HEADS // d.spec.tp
    for layer in LAYERS:
        for pb, db in pairs:
            for g in range(NUM_KV_HEADS):
                src = layer_cache(p, layer, g // p_heads)[pb, g % p_heads]
                dst = layer_cache(d, layer, g // d_heads)[db, g % d_heads]
                assert torch.equal(src, dst), f"{layer}: head {g} of D block {db} != P block {pb}"


def layer_cache(engine: Engine, layer: str, tp_rank: int) -> torch.Tensor:
    """``layer``'s KV tensor on TP rank ``tp_rank`` of the pipeline stage holding it."""
    (cache,) = [r.caches[layer] for r in engine.ranks if r.rank == tp_rank and layer in r.caches]
    return cache


def assert_untouched(
    d: Engine, before: list[dict[str, torch.Tensor]], written: Iterable[int]
) -> None:
    """Every D block outside ``written`` (physical ids) is as it was in ``before``."""
    written = set(written)
    for r, snap in zip(d.ranks, before):
        for layer in r.caches:  # (a pipeline stage's layers only)
            now, then = r.caches[layer], snap[layer]
            for b in range(now.shape[0]):
                if b not in written:
                    assert torch.equal(now[b], then[b]), (
                        f"D rank {r.rank} {layer} block {b} changed"
                    )


@contextlib.contextmanager
def capture_logs(*names: str) -> Iterator[list[logging.LogRecord]]:
    """Records of the given loggers (vLLM's loggers do not propagate to caplog)."""
    records: list[logging.LogRecord] = []

    class _H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    h = _H(level=logging.DEBUG)
    loggers = [logging.getLogger(n) for n in names]
    for lg in loggers:
        lg.addHandler(h)
    try:
        yield records
    finally:
        for lg in loggers:
            lg.removeHandler(h)
