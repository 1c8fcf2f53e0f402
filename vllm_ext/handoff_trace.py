# SPDX-License-Identifier: Apache-2.0
"""One hand-off clock for any push connector: P's prefill done -> D's KV usable.

Our connector's own metric (``vllm:ext_push_handoff_seconds``) ends when P sees its
WRITE done, and vLLM's (``vllm:nixl_xfer_time_seconds``) starts at the WRITE's post,
so neither can be set against the other. This module times both connectors the same
way, at three calls of vLLM's connector interface that every push connector has:

* P, scheduler side: ``request_finished`` (or ``request_finished_all_groups``) of a
  request with ``do_remote_decode``
  (right after the engine step that ran its last prompt token) -> ``p_done``;
* D, scheduler side: ``update_state_after_alloc`` of a request with
  ``do_remote_prefill`` -> ``d_alloc`` (D's request id <-> the proxy's transfer id);
* D, worker side: ``get_finished`` (or ``get_transfer_results``, which vLLM's V2 model
  runner calls instead) reporting the request as received -> ``d_recv``
  (the step in which D's scheduler learns that the KV is there).

hand-off = ``d_recv`` - ``p_done`` of one transfer id.

D's engine steps too, the same way for every push connector: after each
``get_finished`` / ``get_transfer_results`` of a consumer, one ``d_step`` event with
``hook_us`` (wall time the engine thread spent in the worker-side hooks
``start_load_kv``, ``wait_for_layer_load``, ``wait_for_save`` and that call since the
previous one: what the connector made that step wait), ``hook_cpu_us`` (the engine
thread's CPU time in those hooks: the part of ``hook_us`` that was the connector's own
work; the rest is time the thread did not run: blocked on a lock, an event or the GIL)
and ``reqs`` / ``tokens`` (the batch of the latest schedule, from
``build_connector_meta``; None where the scheduler runs in another process, as vLLM's
engine core does with a worker process: each schedule is then its own ``d_sched``
event, and the reader takes the latest one before the step).

One JSON line per event in
``$VLLM_EXT_HANDOFF_TRACE/handoff-<pid>.jsonl``, ``time.monotonic()`` (one clock for
every process of the machine). The connector classes are wrapped in place (by the
plugin, in every vLLM process, only when the variable is set), so the engines keep
the connector names the launcher and vLLM know.

This is the writing side, which runs in the engines; the benchmarks read the files
with :mod:`devkit.bench.handoff_trace`.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

ENV = "VLLM_EXT_HANDOFF_TRACE"
#: (module, class) of the push connectors that may be wrapped: ours, vLLM's own
CONNECTORS = (
    ("vllm_ext.nixl_push.connector", "NixlPushConnector"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector", "NixlPushConnector"),
)
_WRAPPED = "_vllm_ext_handoff_traced"
#: D's worker-side hooks timed per step besides ``get_finished``
STEP_HOOKS = ("start_load_kv", "wait_for_layer_load", "wait_for_save")
_lock = threading.Lock()
_files: dict[int, Any] = {}


def _log(ev: str, **kw: Any) -> None:
    directory = os.environ.get(ENV)
    if not directory:
        return
    kw["ev"] = ev
    kw.setdefault("t", time.monotonic())
    line = json.dumps(kw, default=str) + "\n"
    pid = os.getpid()
    with _lock:
        f = _files.get(pid)
        if f is None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            f = _files[pid] = open(Path(directory) / f"handoff-{pid}.jsonl", "a", buffering=1)  # noqa: SIM115
        f.write(line)


class _Step:
    """D's current engine step (one engine per process; written by its engine thread)."""

    hook_s = 0.0
    cpu_s = 0.0
    #: inside get_finished or get_transfer_results (the outermost of them logs)
    ending = False
    reqs: int | None = None
    tokens: int | None = None


def _consumer(connector: Any) -> bool:
    kv = getattr(connector, "_kv_transfer_config", None)
    return bool(getattr(kv, "is_kv_consumer", False))


def _timed(method: Any) -> Any:
    """Add the wall time of a worker-side hook of a consumer to the step's."""

    @functools.wraps(method)
    def timed(self: Any, *a: Any, **kw: Any) -> Any:
        if not _consumer(self):
            return method(self, *a, **kw)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return method(self, *a, **kw)
        finally:
            _Step.hook_s += time.perf_counter() - t0
            _Step.cpu_s += time.thread_time() - c0

    return timed


def _recving(out: Any) -> Any:
    """The ids a step reports received: ``get_finished``'s (sending, recving) tuple, or
    ``get_transfer_results``'s ``finished_recving``."""
    if isinstance(out, tuple):
        return (out[1] if len(out) > 1 else None) or ()
    return getattr(out, "finished_recving", None) or ()


def _params(request: Any) -> dict[str, Any]:
    return getattr(request, "kv_transfer_params", None) or {}


def wrap(cls: Any) -> bool:
    """Wrap ``cls``'s interface methods (once); False if already wrapped."""
    if getattr(cls, _WRAPPED, False):
        return False
    request_finished = cls.request_finished
    update_state_after_alloc = cls.update_state_after_alloc
    get_finished = cls.get_finished

    def p_side(method: Any) -> Any:
        @functools.wraps(method)
        def traced(self: Any, request: Any, *a: Any, **kw: Any) -> Any:
            params = _params(request)
            if params.get("do_remote_decode"):
                _log("p_done", tid=params.get("transfer_id"), rid=request.request_id)
            return method(self, request, *a, **kw)

        return traced

    @functools.wraps(update_state_after_alloc)
    def traced_alloc(self: Any, request: Any, *a: Any, **kw: Any) -> Any:
        params = _params(request)
        if params.get("do_remote_prefill"):
            _log("d_alloc", tid=params.get("transfer_id"), rid=request.request_id)
        return update_state_after_alloc(self, request, *a, **kw)

    def step_end(method: Any) -> Any:
        """The call that ends D's step: ``get_finished``, or ``get_transfer_results``
        where vLLM's model runner calls that one instead (its V2 runner, 0.32.0 on),
        which a connector may answer without calling ``get_finished``. Both are
        wrapped; the outermost call of a step logs (the base class's
        ``get_transfer_results`` calls ``get_finished``)."""

        @functools.wraps(method)
        def traced(self: Any, *a: Any, **kw: Any) -> Any:
            if _Step.ending:  # inside the other one of the two: it logs
                return method(self, *a, **kw)
            _Step.ending = True
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                out = method(self, *a, **kw)
            finally:
                _Step.ending = False
            # the hook's end, before this trace writes anything (its own cost is not
            # the connector's)
            t, t1, c1 = time.monotonic(), time.perf_counter(), time.thread_time()
            for rid in _recving(out):
                _log("d_recv", rid=rid, t=t)
            if _consumer(self):
                hook_s, _Step.hook_s = _Step.hook_s + t1 - t0, 0.0
                cpu_s, _Step.cpu_s = _Step.cpu_s + c1 - c0, 0.0
                _log(
                    "d_step", t=t, hook_us=round(hook_s * 1e6, 1),
                    hook_cpu_us=round(cpu_s * 1e6, 1), reqs=_Step.reqs, tokens=_Step.tokens,
                )  # fmt: skip
            return out

        return traced

    build_connector_meta = cls.build_connector_meta

    @functools.wraps(build_connector_meta)
    def traced_build(self: Any, scheduler_output: Any, *a: Any, **kw: Any) -> Any:
        if _consumer(self):
            _Step.reqs = len(getattr(scheduler_output, "num_scheduled_tokens", None) or {})
            _Step.tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
            # (vLLM may run the worker in another process: the reader then pairs each
            # d_step with the latest d_sched before it)
            _log("d_sched", reqs=_Step.reqs, tokens=_Step.tokens)
        return build_connector_meta(self, scheduler_output, *a, **kw)

    cls.request_finished = p_side(request_finished)  # type: ignore[method-assign]
    # vLLM's scheduler calls this one instead where the connector supports several
    # KV cache groups (vLLM's NIXL connectors do from 0.26.0 on)
    all_groups = getattr(cls, "request_finished_all_groups", None)
    if all_groups is not None:
        cls.request_finished_all_groups = p_side(all_groups)  # type: ignore[attr-defined]
    cls.update_state_after_alloc = traced_alloc  # type: ignore[method-assign]
    cls.get_finished = step_end(get_finished)  # type: ignore[method-assign]
    transfer_results = getattr(cls, "get_transfer_results", None)
    if transfer_results is not None:
        cls.get_transfer_results = step_end(transfer_results)  # type: ignore[attr-defined]
    cls.build_connector_meta = traced_build  # type: ignore[method-assign]
    for name in STEP_HOOKS:
        setattr(cls, name, _timed(getattr(cls, name)))
    setattr(cls, _WRAPPED, True)
    return True


def install() -> list[str]:
    """Wrap every importable push connector class when ``$VLLM_EXT_HANDOFF_TRACE`` is
    set (called by the plugin in each vLLM process); returns what was wrapped."""
    if not os.environ.get(ENV):
        return []
    import importlib

    done = []
    for module, name in CONNECTORS:
        try:
            cls = getattr(importlib.import_module(module), name)
        except Exception:  # not on this vLLM (ours on 0.26, vLLM's push on 0.23)
            continue
        wrap(cls)
        done.append(f"{module}.{name}")
    return done
