# SPDX-License-Identifier: Apache-2.0
"""vLLM's NIXL classes our push connector builds on, per pinned release (the NIXL half
of the compat seam; :mod:`vllm_ext.compat` has the rest).

``vllm_ext/nixl_push`` subclasses the classes exported here and never checks a
version itself. Each pin gets an adapter class between vLLM's class and ours that
turns vLLM's private hooks into version-neutral ``_push_*`` hooks of our worker and
scheduler, and exposes a few helpers whose shape differs between releases:

============================  ==========================  ===============================
                              vLLM 0.23.0                 vLLM 0.32.0
============================  ==========================  ===============================
worker / scheduler base       ``nixl.worker`` /           ``nixl.pull_worker`` /
                              ``nixl.scheduler``          ``nixl.pull_scheduler`` (split)
connector base                ``NixlConnector``           ``NixlBaseConnector``
step results                  ``get_finished``            ``get_transfer_results``
``_pop_done_transfers``       ``set`` of done ids         ``(done, failed)``
``_nixl_handshake``           ``{rank: agent}``           ``({(pp, tp): agent}, offset)``
``_remote_agents[engine]``    keyed by side-channel rank  keyed by ``(pp, tp)``
side channel query / answer   ``(msg, rank)`` / payload   ``(msg, pp, tp)`` / payload, clock
completion ``<id>:<n>``       ``n`` = producer TP size    ``n`` = expected consumers
failing a D request           ``_handle_failed_transfer`` ``_failed_recv_reqs`` queue
SW clipping                   ``get_sw_clipped_blocks``   ``get_exchange_clipped_blocks``
logical -> kernel block ids   ``(ids)``                   ``(ids, ratio)``
cross-layer KV blocks         yes                         no such layout in vLLM 0.32
side channel of a PP engine   rank ``s * tp + r``         key ``(0, s * tp + r)``
``region_members``            patch 0002                  vLLM's, or one per region name
============================  ==========================  ===============================

vLLM 0.34.0 has the 0.32.0 shapes in every row (``SPLIT_NIXL``). What else differs there
is in :mod:`vllm_ext.compat` (``ModelRunnerOutput`` without ``req_id_to_index``, a resumed
request scheduled as a new one); vLLM prepares its own local lists in nixl's strided
(Nx5) form, which our code never builds.

**Compatibility marker (0.32).** vLLM 0.32's handshake compares a hash of the
configuration that includes the worker's transfer mode. Ours is
:data:`EXT_TRANSFER_MODE`, so a pair of ours with vLLM's own ``NixlPushConnector`` (or
its pull ``NixlConnector``) is refused at the handshake by both sides, and our side
says which connector the peer runs (:func:`explain_hash_mismatch`). On 0.23.0 there is
no in-tree push connector to confuse ours with.
"""

from __future__ import annotations

import threading
import time
import types
from typing import Any

import msgspec
import zmq

from vllm_ext import compat
from vllm_ext.log import get_logger

logger = get_logger(__name__)

_installed = compat.installed_vllm_version()
#: vLLM 0.32 split the NIXL connector into base / pull / push modules.
SPLIT_NIXL: bool = _installed is not None and compat._series(_installed) >= (0, 32)
#: vLLM lays KV out cross-layer (``register_cross_layers_kv_cache``) only before 0.32:
#: 0.32 and 0.34 have no such hook or layout on any device (their model runners
#: allocate per-layer tensors).
CROSS_LAYER_KV: bool = not SPLIT_NIXL
#: D may receive several KV cache groups (hybrid KV, S-HYB-1): vLLM's workers report a
#: failed load per request (``failed_recving``, which the scheduler applies to every
#: group), not only as block ids of one group (0.32 and later; 0.23 has only the latter)
HYBRID_RECV: bool = SPLIT_NIXL
#: Our worker's transfer mode in vLLM 0.32's compatibility hash (see the module doc).
EXT_TRANSFER_MODE = "vllm-ext-push/1"

if SPLIT_NIXL:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # type: ignore[attr-defined]
        NixlBaseConnector as ConnectorBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler as _VllmScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
        NixlPullConnectorWorker as _VllmWorker,
    )
else:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # type: ignore[assignment]
        NixlConnector as ConnectorBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import (  # type: ignore[assignment]
        NixlConnectorScheduler as _VllmScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import (  # type: ignore[assignment]
        NixlConnectorWorker as _VllmWorker,
    )

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import zmq_ctx  # noqa: E402
from vllm.utils.network_utils import make_zmq_path  # noqa: E402

from vllm_ext.nixl_push.wire import PUSH_LAYOUT_QUERY, PeerLayout, WireError  # noqa: E402

#: The module whose names (``NixlWrapper``, TP rank getters) a worker is built with.
WORKER_MODULE = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
    if SPLIT_NIXL
    else _VllmWorker.__module__
)

__all__ = [
    "ConnectorBase",
    "CROSS_LAYER_KV",
    "EXT_TRANSFER_MODE",
    "SPLIT_NIXL",
    "SchedulerBase",
    "WORKER_MODULE",
    "WorkerBase",
    "agent_rank",
    "virtually_split_kv",
]


def agent_rank(key: int | tuple[int, int]) -> int:
    """The side-channel rank of a key of vLLM's ``_remote_agents[engine]``: an int
    before 0.32, ``(0, rank)`` since (our handshake keeps every stage's ranks flat,
    ``members.producer_rank``)."""
    return key[1] if isinstance(key, tuple) else key


def virtually_split_kv(topo: Any) -> bool:
    """Whether this rank's blocks interleave K and V (0.23's
    ``virtually_split_kv_in_blocks``; vLLM 0.32 no longer lays them out that way)."""
    return bool(getattr(topo, "virtually_split_kv_in_blocks", False))


#: Extra ``ReqMeta`` fields of a push D request. vLLM 0.32 post-processes a received
#: request whose peer splits its logical blocks differently (``hetero_ppl``) by zeroing
#: what a READ clipped; a push WRITE fills exactly the blocks D registered, so an empty
#: ``region_blocks_to_zero`` tells it there is nothing to zero or convert.
PUSH_REQ_META_EXTRA: dict[str, Any] = {"region_blocks_to_zero": []} if SPLIT_NIXL else {}


def pull_consumers_expected(field: int, tp_ratio: Any, world_size: int) -> int:
    """P: how many notifications a pull-mode D sends for one request, from the field
    after ``:`` of its completion (``tp_ratio``: vLLM's ``transfer_topo.tp_ratio``)."""
    if SPLIT_NIXL:
        return max(1, field)  # vLLM 0.32: the field is the number of consumers
    return -tp_ratio(field) if field > world_size else 1  # 0.23: the D's TP size


def _serve_handshakes(
    encoded: dict[Any, bytes],
    key_of: Any,
    reply: Any,
    ready: threading.Event,
    stop: threading.Event,
    host: str,
    port: int,
    layout: bytes = b"",
) -> None:
    """vLLM's side channel, hardened (S-LEG-2, S-WIR-2): a query it cannot answer (a
    rank it does not have, bytes that are not a query) gets an empty payload, so the
    requester fails at once, and the listener keeps serving. vLLM's own listener
    thread dies on the first such query, cutting the engine off from every peer.
    It also answers ``[PUSH_LAYOUT_QUERY]`` with ``layout``, this engine's
    :class:`~vllm_ext.nixl_push.wire.PeerLayout` (S-LEG-5)."""
    path = make_zmq_path("tcp", host, port)
    with zmq_ctx(zmq.ROUTER, path) as sock:
        sock.setsockopt(zmq.RCVTIMEO, 1000)
        ready.set()
        last_warning = 0.0
        while True:
            try:
                frames = sock.recv_multipart()
            except zmq.Again:
                if stop.is_set():
                    break
                continue
            if len(frames) != 3:  # not a REQ client: nobody to answer
                continue
            identity, _, msg = frames
            try:
                query = msgspec.msgpack.decode(msg)
                if query[0] == PUSH_LAYOUT_QUERY and layout:
                    sock.send_multipart((identity, b"", *reply(layout)))
                    continue
                payload = encoded[key_of(query)]
                if query[0] != GET_META_MSG:
                    raise ValueError(f"unexpected message {query[0]!r}")
            except Exception as e:
                payload = b""
                now = time.monotonic()
                if now - last_warning > 10.0:
                    last_warning = now
                    logger.warning(
                        "push: unanswerable handshake query dropped (%s: %s); "
                        "this engine serves ranks %s",
                        type(e).__name__, e, sorted(encoded),
                    )  # fmt: skip
            sock.send_multipart((identity, b"", *reply(payload)))


class SchedulerBase(_VllmScheduler):  # type: ignore[misc,valid-type]
    """vLLM's (pull) NIXL scheduler half, with the shapes our push scheduler uses."""

    def _push_track_lease_heartbeats(
        self, request_id: str, params: dict[str, Any], remote_id: str
    ) -> None:
        """Have vLLM's D->P lease heartbeat (``HB:<ids>``, sent by the D worker while
        the request waits) name ``remote_id`` for this D request. Both pins'
        ``on_new_request`` track a D leg by its ``remote_request_id`` alone, which a
        push D leg does not carry; ``_stop_heartbeat(request_id)`` ends it."""
        stand_in = types.SimpleNamespace(
            request_id=request_id, kv_transfer_params={**params, "remote_request_id": remote_id}
        )
        _VllmScheduler.on_new_request(self, stand_in)

    def _push_clipped_blocks(self, block_ids: Any) -> Any:
        """Block ids clipped to what a transfer moves (sliding windows)."""
        if SPLIT_NIXL:
            return self.get_exchange_clipped_blocks(block_ids)
        return self.get_sw_clipped_blocks(block_ids)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Serve every (PP stage, TP rank) of this engine on its side channel.

        Stage ``s`` rank ``r`` is served as side-channel rank ``s * tp_size + r``
        (``members.producer_rank``), ``r`` without PP, and a D handshakes with a PP
        producer one stage at a time (the push worker's ``_push_handshake``). vLLM
        0.23's side channel answers integer ranks; 0.32's queries are keyed
        ``(pp_rank, tp_rank)``, where ours are ``(0, s * tp_size + r)``: the query vLLM
        0.32's handshake sends for the ranks our stage-aware targets name.
        """
        parallel = self.vllm_config.parallel_config
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        # What the side channel answers a layout query with (S-LEG-5): read by the
        # listener that vLLM starts in set_xfer_handshake_metadata.
        self._push_layout_answer = PeerLayout(
            self.engine_id,
            tp,
            pp,
            self._push_tcp_user_timeout_s(),
            getattr(self, "_push_kv_groups", ()),
            tuple(sorted(push_model_identity(self).items())),
            self._push_peer_hosts(),
        ).encode()
        flat = {p * tp + r: m for (p, r), m in metadata.items()}
        if SPLIT_NIXL:
            self.set_xfer_handshake_metadata({(0, rank): m for rank, m in flat.items()})
            return
        self.set_xfer_handshake_metadata(flat)

    def _push_tcp_user_timeout_s(self) -> float:
        """The TCP user timeout of this engine's NIXL agents (our scheduler knows it)."""
        raise NotImplementedError

    def _push_peer_hosts(self) -> tuple[str, ...]:
        """The D hosts a producer connects to (``push_peer_hosts``; our scheduler knows)."""
        raise NotImplementedError

    def _nixl_handshake_listener(
        self,
        encoded_data: dict[Any, Any],
        ready_event: threading.Event,
        stop_event: threading.Event,
        host: str,
        port: int,
    ) -> None:
        """vLLM starts it as ``self._nixl_handshake_listener`` (a static method there)."""
        serve_side_channel(
            encoded_data, ready_event, stop_event, host, port,
            getattr(self, "_push_layout_answer", b""),
        )  # fmt: skip


def push_model_identity(owner: Any) -> dict[str, str]:
    """The model identity (S-LEG-6) of the engine of ``owner`` (a push scheduler, which
    announces it, or worker, which checks a peer's against it), worked out once each."""
    ident = getattr(owner, "_push_model_id", None)
    if ident is None:
        ident = owner._push_model_id = compat.model_identity(owner.vllm_config)
    return ident


def serve_side_channel(
    encoded_data: dict[Any, Any],
    ready_event: threading.Event,
    stop_event: threading.Event,
    host: str,
    port: int,
    layout: bytes = b"",
) -> None:
    """Serve an engine's side channel (:func:`_serve_handshakes`) in this vLLM's shape."""
    if SPLIT_NIXL:  # query (msg, pp, tp); answer payload + this process's clock

        def reply(payload: bytes) -> tuple[bytes, ...]:
            return payload, msgspec.msgpack.encode(time.perf_counter())

        _serve_handshakes(
            encoded_data, lambda q: (q[1], q[2]), reply, ready_event, stop_event, host, port,
            layout,
        )  # fmt: skip
    else:  # query (msg, rank); answer payload
        _serve_handshakes(
            encoded_data, lambda q: q[1], lambda p: (p,), ready_event, stop_event, host, port,
            layout,
        )  # fmt: skip


def query_peer_layout(worker: Any, host: str, port: int, timeout_ms: int = 5000) -> PeerLayout:
    """Ask a peer's side channel for its :class:`~vllm_ext.nixl_push.wire.PeerLayout`
    (S-LEG-5); raises ``RuntimeError`` naming the peer if it does not answer one.

    The query has the shape of vLLM's own metadata query for rank 0, so that the
    listener of vLLM's own connectors (which dies on a query it cannot unpack or a
    rank it lacks) answers rank 0's metadata instead: refused here, it stays up."""
    path = make_zmq_path("tcp", host, port)
    query = (PUSH_LAYOUT_QUERY, 0, 0) if SPLIT_NIXL else (PUSH_LAYOUT_QUERY, 0)
    with zmq_ctx(zmq.REQ, path) as sock:
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.LINGER, 0)
        sock.send(msgspec.msgpack.encode(query))
        try:
            payload = sock.recv_multipart()[0]
        except zmq.Again:
            raise RuntimeError(
                f"push: the side channel {path} did not answer the layout query in "
                f"{timeout_ms / 1000:g}s"
            ) from None
    try:
        return PeerLayout.decode(payload)
    except WireError as e:
        raise _no_layout(worker, payload, path, e) from None


def _no_layout(worker: Any, payload: bytes, path: str, e: WireError) -> RuntimeError:
    """The peer answered no layout: name vLLM's connector it runs, where its answer (rank
    0's handshake payload) shows which."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload

    try:
        theirs = msgspec.msgpack.decode(payload, type=NixlHandshakePayload).compatibility_hash
    except Exception:
        theirs = None
    mine = getattr(worker, "compat_hash", None)
    if SPLIT_NIXL and theirs is not None and mine is not None and theirs != mine:
        mismatch = RuntimeError(f"NIXL compatibility hash mismatch ({mine} vs {theirs})")
        named = explain_hash_mismatch(worker, mismatch)
        if named is not mismatch:  # it names vLLM's connector the peer runs
            return named
    return RuntimeError(
        f"push: the side channel {path} announces no push layout ({e.reason}); the peer "
        "runs another connector or an older vllm-ext: run the same vllm-ext release on P and D"
    )


class WorkerBase(_VllmWorker):  # type: ignore[misc,valid-type]
    """vLLM's (pull) NIXL worker, turning its private hooks into our ``_push_*`` ones.

    The subclass implements ``_push_before_finished()``, ``_push_after_finished(sending,
    recving)``, ``_push_done_sending()``, ``_push_done_recving()``,
    ``_push_first_lease_expiry()`` and
    ``_push_handshake(host, port, remote_tp_size, engine_id) -> {rank: agent}``.
    """

    if SPLIT_NIXL:
        _TRANSFER_MODE = EXT_TRANSFER_MODE
        #: vLLM's worker refuses a pipeline-parallel hybrid (HMA) engine unless its
        #: subclass routes each stage's layers by name into the consumer's regions
        #: (S-PP-2) and pairs blocks by KV cache group (S-HYB-1): ours does both.
        _supports_pp_hma = True

        def _set_region_layers(self, region_layers: list[list[str]]) -> None:
            """The layers behind each registered region (``region_members``, served in
            the handshake): vLLM 0.34 lists them always, 0.32 only for hybrid or packed
            layouts and leaves them empty otherwise. There each region is one layer's
            tensor (``region_names``), and a PP producer's stage needs the names to
            route its layers into D's regions (``members.derive_member_layout``)."""
            if not region_layers:
                region_layers = [[name] for name in getattr(self, "region_names", ())]
            super()._set_region_layers(region_layers)

    # -- the step's results ----------------------------------------------------------
    if SPLIT_NIXL:

        def get_transfer_results(self) -> Any:
            self._push_before_finished()
            results = super().get_transfer_results()
            self._push_after_finished(results.finished_sending, results.finished_recving)
            return results

        def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> Any:
            done, failed = super()._pop_done_transfers(transfers)
            return done | self._push_done_recving(), failed

        def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
            # vLLM 0.32 walks every lease each step. The lease keeper decided the
            # leases near their end just before (``_push_before_finished``) and knows
            # the earliest expiry of all: before it, vLLM's walk would find nothing.
            first = self._push_first_lease_expiry()
            if first is not None and first <= time.perf_counter():
                super()._reap_expired_send_leases(done_sending)

        def _push_fail_recv(self, request_id: str) -> None:
            """D: report ``request_id`` received with its blocks invalid (the KV load
            failed): vLLM applies its ``kv_load_failure_policy``."""
            self._recv_failures.add(request_id)
            self.xfer_stats.record_failed_transfer()

        def _push_drop_recv(self, request_id: str) -> None:
            """D: report ``request_id`` (aborted, nothing written) received without
            vLLM's post-processing of its KV (0.32 marks its blocks invalid on that
            path: the request is gone, so nothing acts on it)."""
            self._recv_failures.add(request_id)

    else:

        def get_finished(self) -> tuple[set[str], set[str]]:
            self._push_before_finished()
            done_sending, done_recving = super().get_finished()
            self._push_after_finished(done_sending, done_recving)
            return done_sending, done_recving

        def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> Any:
            return super()._pop_done_transfers(transfers) | self._push_done_recving()

        def _push_fail_recv(self, request_id: str) -> None:
            self._handle_failed_transfer(request_id, None)

        def _push_drop_recv(self, request_id: str) -> None:
            self._failed_recv_reqs.put(request_id)  # skips post-processing, blocks valid

    def _get_new_notifs(self) -> set[str]:
        """NIXL notifications are read by the push writer only."""
        return self._push_done_sending()  # type: ignore[no-any-return]

    def _push_kernel_block_ids(self, block_ids: Any) -> Any:
        if SPLIT_NIXL:
            return self._logical_to_kernel_block_ids(
                block_ids, self._physical_blocks_per_logical_kv_block
            )
        return self._logical_to_kernel_block_ids(block_ids)

    # -- handshakes ------------------------------------------------------------------------
    def _push_remote_agent(self, engine_id: str, rank: int) -> str | None:
        """The agent of a connected peer rank (under vLLM's handshake lock)."""
        with self._handshake_lock:
            for key, name in self._remote_agents.get(engine_id, {}).items():
                if agent_rank(key) == rank:
                    return name  # type: ignore[no-any-return]
        return None

    def _push_query_stage(
        self, host: str, port: int, remote_tp_size: int, engine_id: str
    ) -> dict[int, str]:
        """One run of vLLM's handshake (the ranks ``handshake_target_ranks`` names):
        the agents it connected, by side-channel rank."""
        if not SPLIT_NIXL:
            return super()._nixl_handshake(host, port, remote_tp_size, engine_id)  # type: ignore[no-any-return]
        try:
            agents, offset = super()._nixl_handshake(host, port, remote_tp_size, engine_id)
        except RuntimeError as e:
            raise explain_hash_mismatch(self, e) from e
        self._push_clock.offset = offset
        return {agent_rank(k): v for k, v in agents.items()}

    if SPLIT_NIXL:
        _push_clock = threading.local()

        def _nixl_handshake(  # type: ignore[override]
            self, host: str, port: int, remote_tp_size: int, expected_engine_id: str, *_: Any
        ) -> Any:
            self._push_clock.offset = 0.0
            agents = self._push_handshake(host, port, remote_tp_size, expected_engine_id)
            return {(0, r): a for r, a in agents.items()}, self._push_clock.offset

    else:

        def _nixl_handshake(
            self, host: str, port: int, remote_tp_size: int, expected_engine_id: str, *_: Any
        ) -> Any:
            return self._push_handshake(host, port, remote_tp_size, expected_engine_id)

    if SPLIT_NIXL:

        def _evict_stale_engines(self) -> None:
            """vLLM 0.32 evicts a remote engine idle for longer than its TTL at every new
            handshake, judging idleness by stamps only its pull path refreshes: a push
            peer in use (WRITEs in flight) would be torn down about an hour after its
            handshake. Our worker ends peers itself (``forget_peer``: a restarted peer,
            an overdue answer, a transport error), so vLLM's idle eviction is off here."""

    def _push_request_handshake(self, engine_id: str, host: str, port: int, tp_size: int) -> Any:
        """vLLM's non-blocking ``_ensure_handshake`` (None once connected, else a future)."""
        return self._ensure_handshake(engine_id, host, port, tp_size)


def forget_remote_engine(worker: Any, engine_id: str) -> None:
    """Drop what vLLM keeps per remote engine beside ``_remote_agents`` when our worker
    forgets the engine (under vLLM's handshake lock): vLLM 0.32's idle stamp, which
    would otherwise make its ``_cleanup_remote_engine`` (eviction, shutdown) assert on
    an engine ``_remote_agents`` no longer has. Nothing on 0.23."""
    stamps = getattr(worker, "_engine_last_active", None)
    if isinstance(stamps, dict):
        stamps.pop(engine_id, None)


def report_blocks_invalid(worker: Any, request_id: str) -> bool:
    """D: report the blocks of ``request_id``, still awaiting its KV, invalid now
    without reporting it received: vLLM fails it (``kv_load_failure_policy`` "fail")
    or marks it for recomputation, and keeps its blocks until it is reported received
    (a request waiting for remote KV is freed only then). False where vLLM cannot map
    the blocks back to the request (several KV cache groups), as its own failure path
    does. Same on 0.23 and 0.32."""
    meta = worker._recving_metadata.get(request_id)
    if meta is None or worker._is_hma_required:
        return False
    worker._invalid_block_ids.put(set(meta.local_block_ids[0]))
    return True


def engine_known(worker: Any, engine_id: str) -> bool:
    """Whether vLLM's transfer topology has ``engine_id`` (its post-processing of a
    received request looks the producer up there, and raises if it never connected)."""
    topo = worker.transfer_topo
    try:
        topo.get_engine_info(engine_id)
    except KeyError:
        return False
    return True


def explain_hash_mismatch(worker: Any, error: RuntimeError) -> RuntimeError:
    """vLLM 0.32 refused a peer whose compatibility hash differs from ours: say so plainly
    when the peer runs one of vLLM's own NIXL connectors with our configuration."""
    text = str(error)
    if "compatibility hash mismatch" not in text:
        return error
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        compute_nixl_compatibility_hash,
    )

    for mode, name in (("push", "NixlPushConnector"), ("pull", "NixlConnector")):
        theirs = compute_nixl_compatibility_hash(
            worker.vllm_config,
            worker.backend_name,
            transfer_mode=mode,  # type: ignore[call-arg]
        )
        if theirs in text:
            return RuntimeError(
                f"push: the peer runs vLLM's own {name}, this engine vllm-ext's "
                f"ExtNixlPushConnector; they do not speak the same push protocol. Run "
                f"ExtNixlPushConnector on both P and D (or vLLM's {name} on both)."
            )
    return error
