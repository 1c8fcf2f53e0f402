# SPDX-License-Identifier: Apache-2.0
"""The harness's fixture (:class:`PushEnv`: a fake NIXL fabric and the engines built on
it, paired as P and D) and one request pushed through a pair (:func:`push_one`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from push_engine import Engine
from push_rank import EngineSpec
from vllm.v1.request import Request

import vllm_ext
from devkit.testing.fake_nixl import FakeNixlFabric, FakeXferHandle
from devkit.testing.faults.audit import grown_tables
from devkit.testing.inproc import DTYPE, HEAD_SIZE, NUM_KV_HEADS, Role, wait_until
from vllm_ext.nixl_push.writer import WRITER_THREAD_NAME


def live_xfer_handles(fabric: FakeNixlFabric) -> list[Any]:
    """Unreleased transfer handles (prepped dlists are held for the worker's lifetime)."""
    return [h for h in fabric.live_handles() if isinstance(h, FakeXferHandle)]


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WRITER_THREAD_NAME]


# -- the fixture ---------------------------------------------------------------------------


class PushEnv:
    """A fake NIXL fabric and the engines built on it; ``close()`` shuts everything down."""

    def __init__(
        self, model_dir: Path, complete_after_polls: int = 2, async_scheduling: bool = False
    ) -> None:
        vllm_ext.register()
        self.model_dir = model_dir
        #: the engines' default (``EngineSpec.async_scheduling``)
        self.async_scheduling = async_scheduling
        self.fabric = FakeNixlFabric(complete_after_polls=complete_after_polls)
        self.engines: list[Engine] = []

    def engine(self, engine_id: str, role: Role, **kw: Any) -> Engine:
        kw.setdefault("async_scheduling", self.async_scheduling)
        e = Engine(EngineSpec(engine_id, role, **kw), self.fabric, self.model_dir)
        self.engines.append(e)
        return e

    def pair(self, p_kw: dict | None = None, d_kw: dict | None = None) -> tuple[Engine, Engine]:
        return self.engine("P", "kv_producer", **(p_kw or {})), self.engine(
            "D", "kv_consumer", **(d_kw or {})
        )

    def step_all(self) -> None:
        for e in self.engines:
            e.engine_step()

    def run_until(self, cond: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
        return wait_until(cond, timeout=timeout, step=self.step_all, what=what)

    def settle(self, timeout: float = 20.0) -> None:
        """Step every engine until all are idle."""
        try:
            self.run_until(lambda: all(e.idle() for e in self.engines), timeout)
        except AssertionError:
            raise AssertionError(
                "engines not idle:\n" + "\n".join(e.describe() for e in self.engines)
            ) from None

    def assert_clean(self) -> None:
        """Every table empty and every transfer handle released."""
        for e in self.engines:
            assert e.idle(), f"{e.engine_id} not idle: {[w.debug_state() for w in e.workers]}"
            assert e.free_blocks() == e.initial_free_blocks, f"{e.engine_id} leaks KV blocks"
            assert not e.sched._sends and not e.sched._recvs, f"{e.engine_id} keeps tickets"
            # (the writer thread may not have taken its last inbox message yet)
            until = time.monotonic() + 2.0
            while grown := grown_tables(e.initial_tables, e.initial_tables, e.tables()):
                if time.monotonic() > until:
                    break
                time.sleep(0.01)
            assert not grown, f"{e.engine_id}: per-request containers not empty: {grown}"
            twice = {r: n for r, n in (e.send_reports + e.recv_reports).items() if n != 1}
            assert not twice, f"{e.engine_id} reported requests more than once: {twice}"
        assert not live_xfer_handles(self.fabric), live_xfer_handles(self.fabric)

    def close(self) -> None:
        for e in self.engines:
            e.shutdown()
        for t in writer_threads():
            t.join(2)
        assert not writer_threads(), "a nixl-push-writer thread survived shutdown"
        self.fabric.assert_no_leaks(include_memory=True)


@contextlib.contextmanager
def open_push_env(
    model_dir: Path, complete_after_polls: int = 2, async_scheduling: bool = False
) -> Iterator[PushEnv]:
    """A :class:`PushEnv` for one test (use in a fixture); closes it afterwards."""
    env = PushEnv(model_dir, complete_after_polls, async_scheduling)
    try:
        yield env
    finally:
        env.close()


#: One 16-token block of one layer on an engine with every KV head: heads x tokens x
#: (K+V) x head_size x bf16.
BLOCK_BYTES = NUM_KV_HEADS * 16 * 2 * HEAD_SIZE * DTYPE.itemsize


def prompt_tokens(seed: int, n: int) -> list[int]:
    """``n`` prompt token ids, the same for the same seed."""
    return [(seed * 131 + i * 7) % 1000 + 3 for i in range(n)]


def push_one(
    env: PushEnv, p: Engine, d: Engine, prompt: Sequence[int], tag: str, max_tokens: int = 2
) -> Request:
    """One request through P and D (D's leg first), run until D finished it and every
    engine is idle again; D's finished request (``d-<tag>``, ``p-<tag>`` on P)."""
    d_id = f"d-{tag}"
    d.add_request(d_id, prompt, p.d_leg(f"T-{tag}"), max_tokens=max_tokens)
    p.add_request(f"p-{tag}", prompt, p.p_leg(f"T-{tag}"))
    env.run_until(lambda: d_id in d.finished, what=f"D request {d_id} finished")
    env.settle()
    return d.finished[d_id]
