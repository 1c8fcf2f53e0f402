# SPDX-License-Identifier: Apache-2.0
"""P on a GPU: the WRITE waits for the device to run the forward pass, off the engine
thread and off the writer (``kv_ready.py``), and the hand-off clock starts when the KV
is final on the device, not when the engine thread finished queueing the pass.

No GPU here: a gate object stands in for the CUDA event the worker records at the end
of the forward pass (``synchronize`` blocks until the test opens it).
"""

from __future__ import annotations

import threading
import time

import pytest
from push_harness import (
    PushEnv,
    assert_kv_pushed,
    block_pairs,
    notifs,
    pending_regs,
    wait_until,
)

from vllm_ext.nixl_push.kv_ready import KV_READY_THREAD_NAME, KvReadyWatcher
from vllm_ext.nixl_push.wire import PUSH_FAIL_PREFIX, PushFailed, parse_notif
from vllm_ext.nixl_push.writer import WRITER_THREAD_NAME


class Gate:
    """A stand-in for ``torch.cuda.Event``: ``synchronize`` returns once opened."""

    def __init__(self, fail: bool = False) -> None:
        self._open = threading.Event()
        self.fail = fail
        self.opened_at = 0.0
        self.waiters: list[str] = []

    def open(self) -> None:
        self.opened_at = time.monotonic()
        self._open.set()

    def synchronize(self) -> None:
        self.waiters.append(threading.current_thread().name)
        assert self._open.wait(30), "gate never opened"
        if self.fail:
            raise RuntimeError("device error")


def _gpu_like_pair(env: PushEnv, gate: Gate, tag: str):  # type: ignore[no-untyped-def]
    p, d = env.pair()
    w = p.workers[0]
    w._kv_written_marker = lambda: gate  # type: ignore[method-assign]
    w._kv_watcher = KvReadyWatcher(w.writer.deliver_final)
    prompt = [(i * 13) % 900 + 5 for i in range(40)]
    d_id, p_id = f"cmpl-{tag}-0-bbbbbbbb", f"cmpl-{tag}-0-aaaaaaaa"
    d.add_request(d_id, prompt, p.d_leg(tag), max_tokens=2)
    env.run_until(lambda: pending_regs(w) == 1, what="PUSH_REG waits at P")
    wait_until(lambda: w.remote_agents_of("D"), what="P connected to D")
    p.add_request(p_id, prompt, p.p_leg(tag), max_tokens=1)
    return p, d, d_id, p_id


@pytest.mark.timeout(60)
def test_the_write_waits_for_the_device_and_the_clock_starts_there(env: PushEnv) -> None:
    gate = Gate()
    p, d, d_id, p_id = _gpu_like_pair(env, gate, "kr")
    t0 = time.monotonic()
    p.engine_step()  # the prompt's forward pass "ends" (queued on the device)
    assert time.monotonic() - t0 < 5  # the engine thread never waited for the device
    time.sleep(0.3)
    # Prepared during the pass, but not posted: the device has not run the pass yet.
    assert p.agents[0].calls("initialize_xfer") and not p.agents[0].calls("transfer")
    assert p.workers[0].writer.alive  # the writer is not stuck on the device either
    gate.open()
    env.run_until(lambda: d_id in d.finished)
    (xfer,) = env.fabric.transfers()
    assert xfer.post_thread == WRITER_THREAD_NAME
    assert gate.waiters == [KV_READY_THREAD_NAME]
    env.settle()
    handoffs = [v for s in p.ranks[0].stats if s is not None
                for v in (s.data.get("push_handoff_seconds") or [])]  # fmt: skip
    # Measured from the device's end of the pass (the gate), not from the step.
    assert len(handoffs) == 1 and handoffs[0] < time.monotonic() - gate.opened_at
    assert handoffs[0] < 0.3  # the 0.3 s the device "ran" are not in it
    fin, reg = p.finished_meta(p_id), d.reg_meta(d_id)
    assert_kv_pushed(p, d, block_pairs(p, d, fin.block_ids[0], reg.block_ids[0]))
    env.assert_clean()


@pytest.mark.timeout(60)
def test_a_device_error_fails_the_write_and_tells_d(env: PushEnv) -> None:
    gate = Gate(fail=True)
    p, d, d_id, _ = _gpu_like_pair(env, gate, "kf")
    p.engine_step()
    gate.open()
    env.run_until(lambda: d_id in d.finished)
    assert not p.agents[0].calls("transfer")
    fails = [parse_notif(n.msg) for n in notifs(env.fabric, PUSH_FAIL_PREFIX)]
    assert [f.request_id for f in fails if isinstance(f, PushFailed)] == [d_id]
    assert d.totals("push_failed_remote") == 1
    env.settle()
    env.assert_clean()
