# SPDX-License-Identifier: Apache-2.0
"""Sizes of every table a KV connector holds, read inside a running engine.

``sitehook/sitecustomize.py`` adds :data:`RPC_METHOD` and :data:`RPC_BLOCKS` to vLLM's
``WorkerBase`` in test engines and wraps the engine core's ``collective_rpc``; with
``VLLM_SERVER_DEV_MODE=1`` the API server's ``/collective_rpc`` reaches both. The
engines run vLLM's multiprocess executor (``--distributed-executor-backend mp``): the
scheduler and its half of the connector live in the engine-core process, each worker
in a process of its own. So :data:`RPC_METHOD` is answered by the workers (their
connector halves) plus the engine core (its own, merged into rank 0's), and
:data:`RPC_BLOCKS` by the engine core alone, where the scheduler's KV cache managers
are. The engine core freezes its start-up objects (``gc.freeze()``), which hides
them from ``gc.get_objects()``: there the scheduler's connector and KV cache managers
are reached from the engine core object itself. Each connector found (by gc in a
worker) is walked a few levels deep (the connector's scheduler/worker halves, a writer
thread's state, a rendezvous ...), reporting ``len()`` of each dict, set, list,
deque and queue by attribute path.

Nothing here knows one connector's internals: the audit compares the sizes after
a fault with those of the same engine idle after warm-up, so it works on our
connector before and after its lifecycle rewrite and on vLLM's own push.
"""

from __future__ import annotations

import collections
import concurrent.futures
import gc
import queue
from typing import Any

RPC_METHOD = "vllm_ext_connector_tables"
#: ``{request id: [KV block ids]}`` of every request holding blocks (the scheduler's)
RPC_BLOCKS = "vllm_ext_request_blocks"
#: How deep to follow attributes from a connector.
MAX_DEPTH = 4
#: Attribute names never followed (configuration, models, tensors, NIXL).
_SKIP_NAMES = ("config", "model", "kv_caches", "nixl_wrapper", "device_kv_caches", "tensor")
#: Only objects of these packages are followed.
_FOLLOW_MODULES = ("vllm_ext.", "vllm.distributed.kv_transfer.")


def _size(value: Any) -> int | None:
    if isinstance(value, dict | set | frozenset | list | collections.deque):
        return len(value)
    if isinstance(value, queue.Queue | queue.SimpleQueue):
        return value.qsize()
    if isinstance(value, concurrent.futures.ThreadPoolExecutor):
        return value._work_queue.qsize()  # handshakes waiting for the executor
    return None


def _follow(value: Any) -> bool:
    module = type(value).__module__ or ""
    return module.startswith(_FOLLOW_MODULES) and hasattr(value, "__dict__")


def _walk(obj: Any, path: str, out: dict[str, int], depth: int, seen: set[int]) -> None:
    if id(obj) in seen or depth > MAX_DEPTH:
        return
    seen.add(id(obj))
    try:
        items = list(vars(obj).items())
    except TypeError:
        return
    for name, value in items:
        if any(s in name.lower() for s in _SKIP_NAMES):
            continue
        n = _size(value)
        if n is not None:
            out[f"{path}.{name}"] = n
        elif _follow(value):
            _walk(value, f"{path}.{name}", out, depth + 1, seen)


def connector_tables(connectors: list[Any] | None = None) -> dict[str, int]:
    """``{"<role>.<attr path>": size}`` for ``connectors`` (default: every KV
    connector of this process that gc lists)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    out: dict[str, int] = {}
    seen: set[int] = set()
    if connectors is None:
        connectors = [o for o in gc.get_objects() if isinstance(o, KVConnectorBase_V1)]
    for obj in connectors:
        role = getattr(getattr(obj, "_role", None), "name", None) or type(obj).__name__
        _walk(obj, role.lower(), out, 0, seen)
    return dict(sorted(out.items()))


def _instances(root: Any, cls: type, depth: int = 3) -> list[Any]:
    """Instances of ``cls`` reachable from ``root`` through attributes, lists and
    tuples, at most ``depth`` steps away (by type only: see :func:`request_blocks`)."""
    found: list[Any] = []
    seen: set[int] = set()

    def visit(obj: Any, d: int) -> None:
        if obj is None or id(obj) in seen or d > depth:
            return
        seen.add(id(obj))
        if isinstance(obj, cls):
            found.append(obj)
            return
        if isinstance(obj, list | tuple):
            for item in obj:
                visit(item, d + 1)
        elif (type(obj).__module__ or "").startswith("vllm.") and hasattr(obj, "__dict__"):
            for value in list(vars(obj).values()):
                visit(value, d + 1)

    visit(root, 0)
    return found


def request_blocks(scheduler: Any = None) -> dict[str, list[int]]:
    """The KV block ids each request holds, from the scheduler's KV cache managers
    (``req_to_blocks`` of every single-type manager), reached from ``scheduler``
    (default: those gc lists). Answered in the engine-core process, where the
    scheduler is."""
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    # By type: probing any object's attributes is not safe (ctypes' library loaders
    # dlopen the attribute's name, and the OSError killed the engine's worker).
    if scheduler is not None:
        managers = _instances(getattr(scheduler, "kv_cache_manager", None),
                              SingleTypeKVCacheManager)  # fmt: skip
    else:
        managers = [o for o in gc.get_objects() if isinstance(o, SingleTypeKVCacheManager)]
    out: dict[str, list[int]] = {}
    for obj in managers:
        blocks = getattr(obj, "req_to_blocks", None)
        if isinstance(blocks, dict):
            for rid, bl in blocks.items():
                out.setdefault(str(rid), []).extend(
                    int(b.block_id) for b in bl if getattr(b, "block_id", None)
                )
    return out


def _rpc(self: Any) -> dict[str, int]:
    return connector_tables()


def _rpc_blocks(self: Any) -> dict[str, list[int]]:
    return request_blocks()


def install_engine_core(engine_core_cls: Any) -> None:
    """Wrap the engine core's ``collective_rpc``: :data:`RPC_BLOCKS` is answered here
    (the scheduler's process), and :data:`RPC_METHOD` adds this process's connector
    tables (the scheduler's half) to rank 0's answer."""
    inner = engine_core_cls.collective_rpc
    if getattr(inner, "_vllm_ext_faults", False):
        return

    def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:  # fmt: skip
        scheduler = getattr(self, "scheduler", None)
        if method == RPC_BLOCKS:
            return [request_blocks(scheduler)]
        results = inner(self, method, timeout, args, kwargs)
        if method == RPC_METHOD:
            connector = getattr(scheduler, "connector", None)
            mine = connector_tables([connector]) if connector is not None else {}
            results = list(results) or [{}]
            results[0] = {**mine, **(results[0] or {})}
        return results

    collective_rpc._vllm_ext_faults = True  # type: ignore[attr-defined]
    engine_core_cls.collective_rpc = collective_rpc


def install(worker_base_cls: Any) -> None:
    if not hasattr(worker_base_cls, RPC_METHOD):
        setattr(worker_base_cls, RPC_METHOD, _rpc)
        setattr(worker_base_cls, RPC_BLOCKS, _rpc_blocks)
