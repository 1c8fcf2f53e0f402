# SPDX-License-Identifier: Apache-2.0
"""Where the hand-off time goes: our push connector with timestamps (diagnostics).

``TracedNixlPushConnector`` is our ``NixlPushConnector`` with its worker, writer
and NIXL calls wrapped (instance attributes only; the connector code is untouched)
to append one JSON line per event to ``$VLLM_EXT_TRACE_DIR/trace-<pid>.jsonl``.
All times are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process
on the machine, the same clock as the load generator's ``perf_counter``).

Used by the optional ``push-0.23-traced`` mode; ``vllm_ext.bench.handoff`` turns
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

from vllm_ext.bench.handoff import TRACE_ENV
from vllm_ext.nixl_push.connector import NixlPushConnector


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
        self._notif_of[handle] = bytes(notif).decode(errors="replace")
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
                self._log("notif_in", msg=bytes(m)[:200].decode(errors="replace"))
        return notifs

    def send_notif(self, agent: Any, notif_msg: bytes = b"", **kw: Any) -> Any:
        out = self._inner.send_notif(agent, notif_msg=notif_msg, **kw)
        self._log("notif_out", msg=bytes(notif_msg)[:200].decode(errors="replace"))
        return out


def _wrap(obj: Any, name: str, before: Any = None, after: Any = None) -> None:
    fn = getattr(obj, name, None)
    if fn is None:
        return

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
    def on_meta(meta: Any) -> None:
        for rid, fin in getattr(meta, "push_finished_blocks", {}).items():
            log("meta_fin", rid=rid, tid=fin.transfer_id, finished_at=fin.finished_at)
        for rid in getattr(meta, "push_prefill_done", {}):
            log("meta_prefill_done", rid=rid)
        for rid, reg in getattr(meta, "push_registrations", {}).items():
            log("meta_reg", rid=rid, tid=reg.transfer_id)

    def on_finished(out: Any) -> None:
        sending, recving = out
        for rid in recving or ():
            log("got_recv", rid=rid)
        for rid in sending or ():
            log("got_sent", rid=rid)

    _wrap(worker, "start_load_kv", before=on_meta)
    _wrap(worker, "get_finished", after=on_finished)
    writer = worker.writer
    # P: blocks handed to the writer (engine thread): at the end of the forward pass
    # (finished_at = then) or a step after the scheduler finished the request.
    # (announced: before the forward pass that completes the prompt; not final yet)
    _wrap(
        writer,
        "add_finished",
        before=lambda f: log(
            "handed" if f.final else "announced", rid=f.request_id, finished_at=f.finished_at
        ),
    )
    writer.nixl = _TracingNixl(writer.nixl, log)
    _wrap(writer, "_on_finished", before=lambda f: log("w_fin", rid=f.request_id))
    _wrap(writer, "step", before=lambda: log("w_pass"))
    _wrap(
        writer,
        "_write",
        before=lambda m: log(
            "w_write",
            p_rid=getattr(getattr(m, "finished", None), "request_id", None),
            d_rid=getattr(getattr(m, "registration", None), "request_id", None),
        ),
    )
    _wrap(writer, "_settle_one", before=lambda rid, failed=False: log("settle", rid=rid))


class TracedNixlPushConnector(NixlPushConnector):
    """Our push connector, traced (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        out = os.environ.get(TRACE_ENV)
        if out and self.connector_worker is not None:
            Path(out).mkdir(parents=True, exist_ok=True)
            log = _Log(Path(out) / f"trace-{self.engine_id}-{os.getpid()}.jsonl")
            log("start", engine=self.engine_id, role=str(role))
            instrument_worker(self.connector_worker, log)
