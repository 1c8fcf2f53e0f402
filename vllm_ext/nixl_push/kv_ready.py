# SPDX-License-Identifier: Apache-2.0
"""P on a GPU: learn when the forward pass that wrote a request's KV has run.

``wait_for_save`` ends the forward pass on the engine thread, but on a GPU that only
means its kernels are queued; the KV is final once the device has run them. The
worker records a CUDA event there and hands the request to this module's thread
(``nixl-push-kv-ready``), which waits for the event, stamps the moment
(``KvFinal.finished_at``: the start of the hand-off clock) and passes the
request to the writer. So neither the engine thread nor the writer ever blocks on the
GPU: the writer keeps reading notifications and posting other WRITEs meanwhile, and
the hand-off time measures the transfer, not the forward pass still running.

Requests are handed over in the order their events were recorded on one stream, so
waiting for them one after the other never holds a finished one behind an
unfinished one.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm_ext.log import get_logger
from vllm_ext.nixl_push.messages import HandOver, KvChunk, KvFinal

logger = get_logger(__name__)

KV_READY_THREAD_NAME = "nixl-push-kv-ready"


class KvUnreadable:
    """Stands in for the event of a forward pass whose completion could not be
    awaited: the writer's wait on it fails, so the request is not written."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def synchronize(self) -> None:
        raise RuntimeError(f"waiting for the forward pass failed: {self.error}")


class KvReadyWatcher:
    """One thread that waits for each handed-over request's event, in order.

    ``deliver`` is called on this thread with the request once its KV is final
    (``fin.ready`` is then None) or once waiting failed (``fin.ready`` is a
    :class:`KvUnreadable`).
    """

    def __init__(self, deliver: Callable[[HandOver], None]) -> None:
        self._deliver = deliver
        self._queue: queue.SimpleQueue[HandOver | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=KV_READY_THREAD_NAME, daemon=True)
        self._thread.start()

    def put(self, fin: HandOver) -> None:
        """Engine thread: ``fin.ready`` is the event recorded after the forward pass."""
        self._queue.put(fin)

    def stop(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @staticmethod
    def _wait(fin: KvChunk | KvFinal) -> KvChunk | KvFinal:
        """``fin`` once its KV is final (``ready`` None), or unreadable."""
        ready: Any = None
        try:
            if fin.ready is not None:
                fin.ready.synchronize()  # releases the GIL while the device runs
        except Exception as e:
            logger.exception("push: waiting for the KV of %s failed", fin.request_id)
            ready = KvUnreadable(e)
        return dataclasses.replace(fin, ready=ready, finished_at=time.monotonic())

    def _run(self) -> None:
        while True:
            fin = self._queue.get()
            if fin is None:
                return
            if isinstance(fin, (KvChunk, KvFinal)):  # (announced, stopped: in order only)
                fin = self._wait(fin)
            try:
                self._deliver(fin)
            except Exception:  # never let the thread die
                logger.exception("push: handing %s to the writer failed", fin.request_id)
