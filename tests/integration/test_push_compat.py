# SPDX-License-Identifier: Apache-2.0
"""A pair of our connector with vLLM's own NIXL connector is refused at the handshake
(vLLM 0.32, which ships its own NixlPushConnector): never a silently wrong push."""

from __future__ import annotations

import threading

import msgspec
import pytest
from push_harness import PushEnv, free_port
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlHandshakePayload,
    compute_nixl_compatibility_hash,
)

from vllm_ext import compat_nixl

if compat_nixl.SPLIT_NIXL:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )

pytestmark = pytest.mark.skipif(
    not compat_nixl.SPLIT_NIXL, reason="vLLM 0.23 has no in-tree push connector"
)


def _serve(hash_: str, port: int, stop: threading.Event) -> threading.Thread:
    """vLLM's own side channel listener, serving an engine of its connector with this hash."""
    payload = NixlHandshakePayload(compatibility_hash=hash_, agent_metadata_bytes=b"")
    encoded = {(0, 0): msgspec.msgpack.encode(payload)}
    ready = threading.Event()
    t = threading.Thread(
        target=NixlPullConnectorScheduler._nixl_handshake_listener,
        args=(encoded, ready, stop, "127.0.0.1", port),
        daemon=True,
    )
    t.start()
    ready.wait(5)
    return t


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "name"), [("push", "NixlPushConnector"), ("pull", "NixlConnector")]
)
def test_vllms_own_connector_is_refused_by_name(env: PushEnv, mode: str, name: str) -> None:
    d = env.engine("D", "kv_consumer")
    w = d.workers[0]
    theirs = compute_nixl_compatibility_hash(w.vllm_config, w.backend_name, mode)
    # Ours differs from vLLM's own, so vLLM's side refuses us too (its hash check).
    assert theirs != w.compat_hash
    port, stop = free_port(), threading.Event()
    t = _serve(theirs, port, stop)
    try:
        with pytest.raises(RuntimeError, match=f"vLLM's own {name}.*ExtNixlPushConnector"):
            w._nixl_handshake("127.0.0.1", port, 1, "P")
        # Our layout query (S-LEG-5) left vLLM's listener serving: it dies on a query it
        # cannot unpack.
        assert t.is_alive()
    finally:
        stop.set()
        t.join(3)


@pytest.mark.timeout(60)
def test_our_pair_still_connects(env: PushEnv) -> None:
    p, d = env.pair()
    assert p.workers[0].compat_hash == d.workers[0].compat_hash
    agents, _ = d.workers[0]._nixl_handshake("127.0.0.1", p.port, 1, "P")
    assert list(agents) == [(0, 0)]
