# SPDX-License-Identifier: Apache-2.0
"""Scheduler side of push (S-SCH-1..4).

* D: when blocks are allocated for a push D leg (``update_state_after_alloc``)
  a registration is stashed and a soft watchdog armed; ``build_connector_meta``
  hands stashed registrations to the worker (``meta.push_registrations``).
  A registration whose push did not complete within
  ``push_registration_timeout`` is failed (its blocks are reported invalid, so
  the request fails or is recomputed per ``kv_load_failure_policy`` and the
  blocks are released instead of waiting forever).
* P: a request whose last prompt token runs in this step and which finishes
  with it (``max_tokens`` 1, as the proxy's P leg asks) is announced in this
  step's metadata (``meta.push_prefill_done``): the worker hands its blocks to
  the writer at the end of the forward pass, one engine step before
  ``request_finished`` runs. ``request_finished`` then only keeps the blocks
  (``delay_free_blocks=True``, whatever the status: a WRITE may be reading
  them) under vLLM's lease until the WRITE is done. Other P requests are
  stashed there for the next worker step (``meta.push_finished_blocks``).
* Both: ``has_pending_push_work`` is True while any of that is in flight.

All request content is validated here (S-LEG-2); a bad request fails alone.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.scheduler import NixlConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import zmq_ctx
from vllm.utils.network_utils import make_zmq_path

from vllm_ext.log import get_logger
from vllm_ext.nixl_push.config import PushConfig
from vllm_ext.nixl_push.members import producer_rank
from vllm_ext.nixl_push.metadata import (
    DLegParams,
    PushConnectorMetadata,
    PushFinishedMeta,
    PushRegMeta,
    is_push_d_leg,
    parse_d_leg,
    parse_p_leg,
)

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)


@dataclasses.dataclass
class _Prefilling:
    """P: a request that will be announced when its last prompt token is scheduled."""

    request: Request
    transfer_id: str | None
    #: this request's block ids per KV cache group, as the scheduler outputs give them
    block_ids: list[list[int]] = dataclasses.field(default_factory=list)


def finishes_with_prefill(request: Request) -> bool:
    """The step that computes this request's last prompt token also finishes it: it
    may emit one token (``max_tokens`` 1), whether it stops or hits the length cap."""
    return request.max_tokens == 1 and request.num_output_tokens == 0


class NixlPushConnectorScheduler(NixlConnectorScheduler):
    def __init__(self, vllm_config, engine_id, kv_cache_config, push_config: PushConfig) -> None:  # type: ignore[no-untyped-def]
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.push_config = push_config
        # D: registrations to hand to the worker at the next step.
        self._push_pending_registrations: dict[str, PushRegMeta] = {}
        # D: watchdog deadline per registered request, until finished_recving.
        self._push_registration_deadlines: dict[str, float] = {}
        # D: requests to fail at the next step (bad params, watchdog expiry).
        self._push_failed_recvs: dict[str, str] = {}
        # D: requests aborted while waiting for their push (sent to the worker next step).
        self._push_cancelled: set[str] = set()
        # D: requests whose watchdog expired (sent to the worker next step).
        self._push_expired: set[str] = set()
        # D: parsed D-leg params between get_num_new_matched_tokens and allocation.
        self._push_d_legs: dict[str, DLegParams | str] = {}
        # P: finished requests to hand to the worker at the next step.
        self._newly_finished_push_blocks: dict[str, PushFinishedMeta] = {}
        # P: requests whose blocks are held for a push, until finished_sending.
        self._finished_request_blocks: set[str] = set()
        # P: requests to announce when their last prompt token is scheduled.
        self._push_prefilling: dict[str, _Prefilling] = {}
        # P: requests announced to the worker, until request_finished.
        self._push_announced: set[str] = set()

    # -- D side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if is_push_d_leg(params):
            parsed = parse_d_leg(params)  # type: ignore[arg-type]
            self._push_d_legs[request.request_id] = parsed
            if isinstance(parsed, str):
                logger.error("push: request %s rejected: %s", request.request_id, parsed)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not is_push_d_leg(params):
            self._track_prefill(request)
            return super().update_state_after_alloc(request, blocks, num_external_tokens)
        assert params is not None
        rid = request.request_id
        parsed = self._push_d_legs.pop(rid, None) or parse_d_leg(params)
        # Only one transfer per request, as in vLLM's pull path.
        params["do_remote_prefill"] = False
        params["_remote_blocks_processed"] = True
        if isinstance(parsed, str):
            self._push_failed_recvs[rid] = parsed
            self._push_pending_registrations[rid] = self._registration(
                request, blocks, num_external_tokens, None
            )
            return None
        self._push_pending_registrations[rid] = self._registration(
            request, blocks, num_external_tokens, parsed
        )
        self._push_registration_deadlines[rid] = (
            time.monotonic() + self.push_config.push_registration_timeout
        )
        return None

    def _registration(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
        leg: DLegParams | None,
    ) -> PushRegMeta:
        allocated = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else ()
        block_ids = self.get_sw_clipped_blocks(allocated)  # type: ignore[arg-type]
        return PushRegMeta(
            request_id=request.request_id,
            block_ids=tuple(tuple(g) for g in block_ids),
            p_engine_id=leg.p_engine_id if leg else "",
            p_host=leg.p_host if leg else "",
            p_port=leg.p_port if leg else 0,
            p_tp_size=leg.p_tp_size if leg else 1,
            transfer_id=leg.transfer_id if leg else None,
            prefix_tokens=self._cached_prefix_tokens(blocks) if num_external_tokens > 0 else 0,
            p_pp_size=leg.p_pp_size if leg else 1,
        )

    def _cached_prefix_tokens(self, blocks: KVCacheBlocks) -> int:
        """Tokens D already holds from its local prefix cache: its hashed leading blocks.

        (``request.num_computed_tokens`` is not updated yet when the scheduler
        calls ``update_state_after_alloc``.)
        """
        if not blocks.blocks:
            return 0
        cached = 0
        for block in blocks.blocks[0]:
            if block.block_hash is None:
                break
            cached += 1
        return cached * self.block_size

    # -- P side ----------------------------------------------------------------------
    def _track_prefill(self, request: Request) -> None:
        """P: follow a push P leg that will finish with its prefill, so its blocks go
        to the writer as soon as its KV is computed (its block ids are collected from
        the scheduler outputs in ``build_connector_meta``)."""
        params = request.kv_transfer_params
        if not (self.push_config.push_at_forward_end and params and params.get("do_remote_decode")):
            return
        tid = parse_p_leg(params)
        if isinstance(tid, ValueError) or not finishes_with_prefill(request):
            return  # request_finished reports a bad leg; other requests go through it too
        self._push_prefilling[request.request_id] = _Prefilling(request, tid)

    def _announce_prefill_done(self, out: SchedulerOutput) -> dict[str, PushFinishedMeta]:
        """P: the tracked requests whose last prompt token runs in this step."""
        if not self._push_prefilling:
            return {}
        for new in out.scheduled_new_reqs:
            if (p := self._push_prefilling.get(new.req_id)) is not None:
                p.block_ids = [list(g) for g in new.block_ids]
        cached = out.scheduled_cached_reqs
        for rid, added in zip(cached.req_ids, cached.new_block_ids):
            if added is None or (p := self._push_prefilling.get(rid)) is None:
                continue
            if rid in cached.resumed_req_ids:  # preempted, then resumed: all its blocks
                p.block_ids = [list(g) for g in added]
            else:
                for group, ids in zip(p.block_ids, added):
                    group.extend(ids)
        done: dict[str, PushFinishedMeta] = {}
        for rid, n in out.num_scheduled_tokens.items():
            p = self._push_prefilling.get(rid)
            # num_computed_tokens is advanced only after this method, in the scheduler.
            if p is None or p.request.num_computed_tokens + n < p.request.num_prompt_tokens:
                continue
            del self._push_prefilling[rid]
            self._push_announced.add(rid)
            done[rid] = PushFinishedMeta(
                request_id=rid,
                block_ids=tuple(tuple(g) for g in self.get_sw_clipped_blocks(p.block_ids)),  # type: ignore[arg-type]
                transfer_id=p.transfer_id,
                finished_at=0.0,  # set by the worker when the forward pass ends
            )
        return done

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        self._push_d_legs.pop(request.request_id, None)
        if is_push_d_leg(params):
            # Finished (aborted) before blocks were allocated: nothing was registered
            # with P, so there is nothing to release remotely (vLLM's pull path would
            # send P a notification here; P's blocks go back via its lease).
            params["do_remote_prefill"] = False  # type: ignore[index]
            return False, None
        if self._push_registration_deadlines.pop(request.request_id, None) is not None:
            # D request finished (aborted) before its KV arrived. vLLM keeps its
            # blocks until finished_recving; the worker asks P to stand down and
            # reports the request received once P answered (or wrote).
            self._push_cancelled.add(request.request_id)
        self._push_prefilling.pop(request.request_id, None)
        delay, out = super().request_finished(request, block_ids)
        if request.request_id in self._push_announced:
            return self._finish_announced(request, delay, out)
        if not (params and params.get("do_remote_decode")):
            return delay, out
        if not delay:
            return delay, out  # aborted, or nothing to send
        tid = parse_p_leg(params)
        if isinstance(tid, ValueError):
            # Fail only this request: do not push; its blocks go back via the lease.
            logger.error("push: request %s not pushed: %s", request.request_id, tid)
            return delay, out
        self._newly_finished_push_blocks[request.request_id] = PushFinishedMeta(
            request_id=request.request_id,
            block_ids=tuple(tuple(g) for g in self.get_sw_clipped_blocks(block_ids)),
            transfer_id=tid,
            finished_at=time.monotonic(),
        )
        self._finished_request_blocks.add(request.request_id)
        return delay, out

    def _finish_announced(
        self, request: Request, delay: bool, out: dict[str, Any] | None
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: the blocks of an announced request are with the writer already. Keep
        them until the worker reports the request sent (or its lease ends), whatever
        the status: vLLM frees an aborted request's blocks at once, and a WRITE may
        be reading them."""
        rid = request.request_id
        self._push_announced.discard(rid)
        if not delay:
            self._reqs_not_processed.discard(rid)
            self._reqs_need_send[rid] = time.perf_counter() + self._kv_lease_duration
        self._finished_request_blocks.add(rid)
        return True, out

    # -- both --------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PushConnectorMetadata:
        base = super().build_connector_meta(scheduler_output)
        meta = PushConnectorMetadata()
        meta.__dict__.update(base.__dict__)
        self._check_watchdog()
        meta.push_registrations, self._push_pending_registrations = (
            self._push_pending_registrations,
            {},
        )
        meta.push_finished_blocks, self._newly_finished_push_blocks = (
            self._newly_finished_push_blocks,
            {},
        )
        meta.push_prefill_done = self._announce_prefill_done(scheduler_output)
        meta.push_failed_recvs, self._push_failed_recvs = self._push_failed_recvs, {}
        meta.push_cancelled, self._push_cancelled = self._push_cancelled, set()
        meta.push_expired, self._push_expired = self._push_expired, set()
        meta.push_step_idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    def _check_watchdog(self) -> None:
        now = time.monotonic()
        expired = [r for r, t in self._push_registration_deadlines.items() if now >= t]
        for rid in expired:
            # The worker asks P to stand down and fails the KV load once P answered
            # (a WRITE that already started may still land: the blocks stay until then).
            del self._push_registration_deadlines[rid]
            self._push_expired.add(rid)
            logger.warning(
                "push: registration of %s expired (no KV within push_registration_timeout="
                "%gs); cancelling it with P, then failing its KV load",
                rid, self.push_config.push_registration_timeout,
            )  # fmt: skip

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        for rid in connector_output.finished_sending or ():
            self._finished_request_blocks.discard(rid)
        for rid in connector_output.finished_recving or ():
            self._push_registration_deadlines.pop(rid, None)

    def has_pending_push_work(self) -> bool:
        return bool(
            self._push_pending_registrations
            or self._push_failed_recvs
            or self._push_cancelled
            or self._push_expired
            or self._newly_finished_push_blocks
            or self._finished_request_blocks
            or self._push_announced
            or self._push_registration_deadlines
        )

    # -- the side channel -------------------------------------------------------------------
    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Serve every (PP stage, TP rank) of this engine on its side channel.

        vLLM's engine core collects the metadata by ``(pp_rank, tp_rank)``; the
        side channel answers integer ranks. Stage ``s`` rank ``r`` is served as
        ``s * tp_size + r`` (``members.producer_rank``), which is ``r`` without PP,
        so a D handshakes with a PP producer one stage at a time (see the worker's
        ``_nixl_handshake``).
        """
        tp = self.vllm_config.parallel_config.tensor_parallel_size
        self.set_xfer_handshake_metadata(
            {producer_rank(pp, r, tp): m for (pp, r), m in metadata.items()}
        )

    @staticmethod
    def _nixl_handshake_listener(
        encoded_data: dict[int, Any],
        ready_event: threading.Event,
        stop_event: threading.Event,
        host: str,
        port: int,
    ) -> None:
        """vLLM's handshake listener, hardened (S-LEG-2, S-WIR-2).

        vLLM 0.23.0's listener thread dies on the first query it cannot answer:
        a rank this engine does not have (a D leg whose ``tp_size`` is larger
        than P's: ``KeyError``) or bytes that are not a ``(GET_META_MSG, rank)``
        msgpack pair. Every later handshake with this engine then hangs and fails,
        so one bad request would cut P off from every D until it restarts. Here
        such a query is answered with an empty payload (the requester fails at
        once, decoding it) and the listener keeps serving.
        """
        path = make_zmq_path("tcp", host, port)
        with zmq_ctx(zmq.ROUTER, path) as sock:
            sock.setsockopt(zmq.RCVTIMEO, 1000)
            ready_event.set()
            last_warning = 0.0
            while True:
                try:
                    frames = sock.recv_multipart()
                except zmq.Again:
                    if stop_event.is_set():
                        break
                    continue
                if len(frames) != 3:  # not a REQ client: nobody to answer
                    continue
                identity, _, msg = frames
                try:
                    kind, rank = msgspec.msgpack.decode(msg)
                    payload = encoded_data[rank]
                    if kind != GET_META_MSG:
                        raise ValueError(f"unexpected message {kind!r}")
                except Exception as e:
                    payload = b""
                    now = time.monotonic()
                    if now - last_warning > 10.0:
                        last_warning = now
                        logger.warning(
                            "push: unanswerable handshake query dropped (%s: %s); "
                            "this engine serves ranks %s",
                            type(e).__name__, e, sorted(encoded_data),
                        )  # fmt: skip
                sock.send_multipart((identity, b"", payload))
