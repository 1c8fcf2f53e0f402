# SPDX-License-Identifier: Apache-2.0
"""Sizes of every table a KV connector holds, read inside a running engine.

``sitehook/sitecustomize.py`` adds :data:`RPC_METHOD` to vLLM's ``WorkerBase`` in test
engines; with ``VLLM_SERVER_DEV_MODE=1`` the API server's ``/collective_rpc``
calls it on the worker (which on CPU lives in the engine-core process, beside the
scheduler). It finds every ``KVConnectorBase_V1`` instance of the process (the
scheduler's and the worker's) and walks its attributes a few levels deep (the
connector's scheduler/worker halves, a writer thread's state, a rendezvous ...),
reporting ``len()`` of each dict, set, list, deque and queue by attribute path.

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


def connector_tables() -> dict[str, int]:
    """``{"<role>.<attr path>": size}`` for every KV connector of this process."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    out: dict[str, int] = {}
    seen: set[int] = set()
    for obj in gc.get_objects():
        if isinstance(obj, KVConnectorBase_V1):
            role = getattr(getattr(obj, "_role", None), "name", None) or type(obj).__name__
            _walk(obj, role.lower(), out, 0, seen)
    return dict(sorted(out.items()))


def request_blocks() -> dict[str, list[int]]:
    """The KV block ids each request holds, from the scheduler's KV cache managers
    (``req_to_blocks`` of every single-type manager; on CPU the scheduler shares the
    worker's process)."""
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    out: dict[str, list[int]] = {}
    for obj in gc.get_objects():
        # By type: probing any object's attributes is not safe (ctypes' library loaders
        # dlopen the attribute's name, and the OSError killed the engine's worker).
        if not isinstance(obj, SingleTypeKVCacheManager):
            continue
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


def install(worker_base_cls: Any) -> None:
    if not hasattr(worker_base_cls, RPC_METHOD):
        setattr(worker_base_cls, RPC_METHOD, _rpc)
        setattr(worker_base_cls, RPC_BLOCKS, _rpc_blocks)
