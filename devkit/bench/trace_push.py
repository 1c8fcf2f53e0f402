# SPDX-License-Identifier: Apache-2.0
"""Where the hand-off time goes: our push connector with timestamps (diagnostics).

``TracedNixlPushConnector`` is our ``NixlPushConnector`` with its worker, writer
and NIXL calls wrapped (instance attributes only; the connector code is untouched)
to append one JSON line per event to ``$VLLM_EXT_TRACE_DIR/trace-<pid>.jsonl``.
All times are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process
on the machine, the same clock as the load generator's ``perf_counter``).

Used by the optional ``push-0.23-traced`` mode; ``devkit.bench.handoff`` turns
the traces of a run into per-request stages.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from devkit.bench.handoff import TRACE_ENV
from vllm_ext import compat_nixl
from vllm_ext.nixl_push.connector import NixlPushConnector
from vllm_ext.nixl_push.messages import KvChunk, KvFinal, Stopped
from vllm_ext.nixl_push.wire import Completion, parse_notif


class _Log:
    def __init__(self, path: Path) -> None:
        self._f = path.open("a", buffering=1)
        self._lock = threading.Lock()

    def __call__(self, ev: str, **kw: Any) -> None:
        kw["ev"] = ev
        kw.setdefault("t", time.monotonic())
        kw["th"] = threading.current_thread().name
        line = json.dumps(kw, default=str)
        with self._lock:
            self._f.write(line + "\n")


class _TracingNixl:
    """Forwards to the NIXL wrapper; logs the calls that matter for the hand-off."""

    def __init__(self, inner: Any, log: _Log) -> None:
        self._inner = inner
        self._log = log
        self._notif_of: dict[Any, str] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def initialize_xfer(self, op: str, src: Any, dst: Any, agent: Any, notif: bytes = b"") -> Any:
        t0 = time.monotonic()
        handle = self._inner.initialize_xfer(op, src, dst, agent, notif)
        self._notif_of[handle] = _notif_text(notif)
        self._log("init_xfer", t0=t0, notif=self._notif_of[handle])
        return handle

    def transfer(self, handle: Any, *a: Any) -> Any:
        t0 = time.monotonic()
        out = self._inner.transfer(handle, *a)
        self._log("transfer", t0=t0, notif=self._notif_of.get(handle), state=out)
        return out

    def check_xfer_state(self, handle: Any) -> Any:
        state = self._inner.check_xfer_state(handle)
        if state != "PROC":
            self._log("xfer_done", notif=self._notif_of.pop(handle, None), state=state)
        return state

    def get_new_notifs(self) -> Any:
        notifs = self._inner.get_new_notifs()
        for msgs in notifs.values():
            for m in msgs:
                self._log("notif_in", msg=_notif_text(m)[:200])
        return notifs

    def send_notif(self, agent: Any, notif_msg: bytes = b"", **kw: Any) -> Any:
        out = self._inner.send_notif(agent, notif_msg=notif_msg, **kw)
        self._log("notif_out", msg=_notif_text(notif_msg)[:200])
        return out


def _notif_text(msg: Any) -> str:
    """A notification as the trace shows it: a completion as vLLM writes it
    (``<D request id>:<tp size>``, also for ``PUSH_DONE:``), anything else decoded."""
    n = parse_notif(bytes(msg)) if msg else None
    if isinstance(n, Completion):
        return f"{n.request_id}:{n.tp_size}"
    return bytes(msg or b"").decode(errors="replace")


def _wrap(obj: Any, name: str, before: Any = None, after: Any = None) -> None:
    """Replace ``obj.name`` by a wrapper that logs; a method that is gone (renamed in
    the connector) is an error here, not a trace that silently lacks its events."""
    fn = getattr(obj, name, None)
    if fn is None:
        raise AttributeError(f"trace_push: {type(obj).__name__} has no {name}() to trace")

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        if before is not None:
            before(*a, **kw)
        out = fn(*a, **kw)
        if after is not None:
            after(out, *a, **kw)
        return out

    setattr(obj, name, wrapper)


def instrument_worker(worker: Any, log: _Log) -> None:
    """Wrap ``worker`` (a ``NixlPushConnectorWorker``), its writer, the writer's
    ``Writes`` and its NIXL agent with loggers (instance attributes only)."""

    def on_finished(out: Any) -> None:
        if isinstance(out, tuple):  # get_finished: (sending, recving)
            sending, recving = out
        else:  # get_transfer_results (vLLM 0.32+)
            sending, recving = out.finished_sending, out.finished_recving
        for rid in recving or ():
            log("got_recv", rid=rid)
        for rid in sending or ():
            log("got_sent", rid=rid)

    _wrap(worker, "start_load_kv", before=lambda meta: log("step"))
    # what the worker's vLLM asks after each step (compat_nixl.SPLIT_NIXL)
    results = "get_transfer_results" if compat_nixl.SPLIT_NIXL else "get_finished"
    _wrap(worker, results, after=on_finished)
    writer = worker.writer

    def handed(f: Any) -> None:
        # P: blocks handed to the writer. "handed": the KV is final (finished_at: when
        # the device had run the forward pass that wrote it, or when the engine thread
        # ended a CPU pass); "announced": before the pass that completes the prompt;
        # "chunk": a computed chunk (push_progressive).
        if isinstance(f, Stopped):
            log("stopped", rid=f.request_id)
        elif isinstance(f, KvChunk):
            log("chunk", rid=f.request_id, finished_at=f.finished_at, kv_tokens=f.kv_tokens)
        elif isinstance(f, KvFinal):
            log("handed", rid=f.request_id, finished_at=f.finished_at)
        else:
            log("announced", rid=f.request_id, finished_at=0.0)

    _wrap(writer, "add_finished", before=handed)
    _wrap(writer, "deliver_final", before=handed)
    writer.nixl = _TracingNixl(writer.nixl, log)
    writes = writer.writes
    _wrap(
        writes,
        "on_finished",
        before=lambda f: log("w_fin", rid=f.request_id, final=isinstance(f, KvFinal)),
    )
    _wrap(
        writes,
        "start",
        before=lambda m, now: log(
            "w_write", p_rid=m.send.request_id, d_rid=m.registration.request_id
        ),
    )
    _wrap(writes, "_stream", before=lambda send, w: log("w_chunk", rid=send.request_id))

    def settled(msg: Any) -> None:
        if type(msg).__name__ == "Settled":
            log("settle", rid=msg.request_id, failed=msg.failed_writes)

    _wrap(writes, "_post_to_engine", before=settled)


def instrument_scheduler(connector: Any, log: _Log) -> None:
    """Log each engine step's scheduled tokens (the scheduler side of ``connector``):
    what P's GPU computes while a WRITE runs."""

    def on_build(out: Any, scheduler_output: Any) -> None:
        per_req = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        log(
            "sched",
            tokens=getattr(scheduler_output, "total_num_scheduled_tokens", None),
            reqs=len(per_req),
            big=max(per_req.values(), default=0),
        )

    _wrap(connector, "build_connector_meta", after=on_build)


class TracedNixlPushConnector(NixlPushConnector):
    """Our push connector, traced (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        out = os.environ.get(TRACE_ENV)
        if out and self.connector_worker is not None:
            Path(out).mkdir(parents=True, exist_ok=True)
            log = _Log(Path(out) / f"trace-{self.engine_id}-{os.getpid()}-worker.jsonl")
            log("start", engine=self.engine_id, role=str(role))
            instrument_worker(self.connector_worker, log)
        if out and self.connector_scheduler is not None:
            Path(out).mkdir(parents=True, exist_ok=True)
            log = _Log(Path(out) / f"trace-{self.engine_id}-{os.getpid()}-scheduler.jsonl")
            instrument_scheduler(self, log)
