# SPDX-License-Identifier: Apache-2.0
"""What the ``nixl-push-writer`` thread may use: one :class:`WriterContext`.

The worker builds it once and hands it to the writer; the writer never sees the
worker. Everything in it is either immutable (identity, config) or safe to use
from any thread (counters, :class:`PeerAgents`, :class:`~vllm_ext.nixl_push.layouts.KvLayouts`,
:class:`~vllm_ext.nixl_push.leases.LeaseClaims`, :class:`NotifDrops`, and the
``request_handshake`` function, which is vLLM's ``_ensure_handshake``: non-blocking,
guarded by vLLM's handshake lock).
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol

from vllm_ext.log import get_logger
from vllm_ext.nixl_push.config import PushConfig
from vllm_ext.nixl_push.layouts import KvLayouts
from vllm_ext.nixl_push.leases import LeaseClaims
from vllm_ext.nixl_push.stats import PushCounters
from vllm_ext.nixl_push.wire import Malformed

logger = get_logger(__name__)

#: At most one malformed-notification warning per this many seconds (S-WIR-2).
MALFORMED_LOG_INTERVAL_S = 10.0

#: ``request_handshake(engine_id, host, port, tp_size)``: None when connected, else the
#: pending handshake's future (S-WRT-5).
RequestHandshake = Callable[[str, str, int, int], "Future[Any] | None"]


#: How long :func:`refuses_connections` waits for an answer (a partitioned host sends
#: none: that is not a refusal).
REFUSAL_PROBE_S = 1.0


def refuses_connections(host: str, port: int) -> bool:
    """True if ``host`` answers that nothing listens at ``port`` (a TCP reset): a peer
    whose side channel was there is gone (vLLM keeps it open for the life of the
    engine). A timeout, an unreachable network or an open port are all False: a
    partitioned or hung peer may still have transfers on their way."""
    try:
        with socket.create_connection((host, port), timeout=REFUSAL_PROBE_S):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


#: ``forget_peer(engine_id, why, remove=False)``: drop a peer's agents and layouts so
#: that the next request handshakes with it again; with ``remove`` also remove its
#: agents from NIXL (nothing it posts lands afterwards); False if it was not connected
#: (S-FLT-1).
class ForgetPeer(Protocol):
    def __call__(self, engine_id: str, why: str, remove: bool = False) -> bool: ...


def agent_name(name: str | bytes) -> str:
    """NIXL names an agent with ``bytes`` in ``add_remote_agent``'s result and with
    ``str`` in ``get_new_notifs``'s keys; compare them as ``str``."""
    return name.decode() if isinstance(name, bytes) else str(name)


@dataclasses.dataclass(frozen=True)
class Identity:
    """This rank, as the peers see it."""

    engine_id: str
    tp_rank: int
    tp_size: int
    #: the side channel D's peers handshake with (carried in PUSH_REG / PUSH_CANCEL)
    host: str
    port: int
    #: tokens per physical (kernel) block
    block_size: int


class PeerAgents:
    """A thread-safe read view of the remote agents vLLM's handshakes connected:
    engine id -> side-channel rank -> agent name (vLLM's ``_remote_agents``, read under
    vLLM's handshake lock, which is also the lock its writers hold)."""

    def __init__(
        self,
        lock: Any,
        agents: Mapping[str, Mapping[Any, str | bytes]],
        rank_of: Callable[[Any], int] = int,
    ) -> None:
        self._lock = lock
        self._agents = agents
        #: side-channel rank of a key of vLLM's table (``compat_nixl.agent_rank``)
        self._rank_of = rank_of

    def of(self, engine_id: str) -> dict[int, str]:
        """Agent names of ``engine_id`` by rank (a snapshot)."""
        with self._lock:
            agents = dict(self._agents.get(engine_id, {}))
        return {self._rank_of(k): agent_name(a) for k, a in agents.items()}

    def agent(self, engine_id: str, rank: int) -> str | None:
        return self.of(engine_id).get(rank)


class NotifDrops:
    """Counts dropped malformed notifications by reason and warns at most every
    :data:`MALFORMED_LOG_INTERVAL_S` (S-WIR-2). Used by the writer and the engine thread."""

    def __init__(self, counters: PushCounters) -> None:
        self._counters = counters
        self._lock = threading.Lock()
        self._counts: dict[str, int] = defaultdict(int)
        self._logged_at = 0.0

    def drop(self, sender: str, n: Malformed) -> None:
        self._counters.inc("push_notifs_malformed")
        now = time.monotonic()
        with self._lock:
            self._counts[n.reason] += 1
            if now - self._logged_at < MALFORMED_LOG_INTERVAL_S:
                return
            self._logged_at = now
            totals = dict(self._counts)
        logger.warning(
            "push: dropped malformed notification from %s (%s: %s); totals %s",
            sender, n.reason, n.detail, totals,
        )  # fmt: skip

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@dataclasses.dataclass
class WriterContext:
    """Everything the writer thread uses, and nothing else."""

    #: the rank's NIXL agent (vLLM's ``NixlWrapper``); only the writer calls it for push
    nixl: Any
    #: NIXL memory type of the KV cache (``DRAM``/``VRAM``)
    memory_type: str
    identity: Identity
    config: PushConfig
    counters: PushCounters
    peers: PeerAgents
    layouts: KvLayouts
    claims: LeaseClaims
    drops: NotifDrops
    request_handshake: RequestHandshake
    forget_peer: ForgetPeer
