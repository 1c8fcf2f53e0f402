# SPDX-License-Identifier: Apache-2.0
"""Scheduler side of push (S-SCH-1..4): one ticket per push request, in two tables.

D (:class:`RecvTicket`, ``_recvs``)::

    allocated ──► AWAITING ──finished_recving──► (gone)
       │ bad         │ aborted, or the watchdog expired
       ▼ params      ▼
    FAILING      CANCELLING ──finished_recving──► (gone)

* ``update_state_after_alloc`` of a push D leg hands a registration to the
  workers (``meta.push_registrations``) and arms the watchdog
  (``push_registration_timeout_s``, renewed when a producer's PUSH_HB reaches a
  worker: ``PushWorkerMeta.renewed``). When it expires, or the request is aborted,
  the workers are told (``push_expired`` / ``push_cancelled``): they ask P to stand
  down and keep the blocks until P answered, then report the request received
  (failed, for an expiry, unless P wrote after all).
* CANCELLING and FAILING wait for the workers' ``finished_recving``; their
  deadline is only a backstop (the workers' own deadlines end them first).

P (:class:`SendTicket`, ``_sends``)::

    on_new_request ──► LIVE ──last prompt token scheduled──► ANNOUNCED ──► HELD
                        │                                  request_finished   │
                        └──request_finished (max_tokens > 1)───────────────► HELD
                        └──aborted / not pushed──► (gone)       finished_sending ──► (gone)

* LIVE: queued or prefilling; the workers know it (``push_live_started``) so that
  P renews D's watchdog only for registrations a live request will serve.
* LIVE, streamed (``push_progressive``, S-PRG-1): each step that computes a prompt
  chunk of it that is not the last hands the chunk's blocks to the workers
  (``meta.push_chunks``), which write the full ones while the next chunks compute.
  Preempted after that (its blocks freed, then computed anew), it streams no more and
  is written whole (``PushFinishedMeta.whole``). Aborted before its prompt was
  computed, it is held as an announced one is, and the workers are told
  (``meta.push_prefill_stopped``): they end its WRITEs and report it sent.
* ANNOUNCED: its last prompt token runs in this step and it finishes with it
  (``max_tokens`` 1, as the proxy's P leg asks): the worker hands its blocks to the
  writer at the end of the forward pass (``meta.push_prefill_done``), a step before
  ``request_finished``, which then only keeps the blocks (``delay_free_blocks=True``,
  whatever the status: a WRITE may be reading them).
* ANNOUNCED, preempted: with async scheduling or PP, vLLM may preempt it before that
  step's output is processed and give its blocks to another request in the same step;
  the workers are told (``meta.push_announced_preempted``) and write nothing of it
  (S-SAFE-1). On vLLM 0.32 ``has_pending_block_frees`` holds such a preemption back.
* HELD: the blocks are held under vLLM's lease until the workers report the request
  sent; other P requests reach it from ``request_finished``, handed to the workers
  at the next step (``meta.push_finished_blocks``). The workers never hold them past
  the lease plus ``PushConfig.lease_overrun``; the ticket's deadline is a backstop.

``has_pending_push_work`` is True while any ticket but a LIVE one exists.

Per step, the work is in the requests that change, not in those tracked: deadlines
are kept in heaps (``DeadlineHeap``: the watchdog, the backstops), the ANNOUNCED and
HELD tickets in indexes of their own, so a step looks only at what is due.

A push P leg without ``transfer_id`` (a router that runs the legs one after the
other) gets one made here, with a secret, and P answers the push D leg from
``request_finished`` (``push_answer_sequential_legs``; nixl_push/answer.py).

All request content is validated here (S-LEG-2); a bad request fails alone.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING, Any

from vllm_ext import compat
from vllm_ext.compat_nixl import SchedulerBase
from vllm_ext.log import event, get_logger
from vllm_ext.nixl_push.answer import SequentialLegIds, d_leg_answer
from vllm_ext.nixl_push.config import (
    PushConfig,
    producer_lost_after_s,
    unrenewed_registration_hold_s,
)
from vllm_ext.nixl_push.deadlines import DeadlineHeap
from vllm_ext.nixl_push.descriptors import blocks_to_receive
from vllm_ext.nixl_push.leases import heartbeat_name
from vllm_ext.nixl_push.lifecycle import IllegalTransition
from vllm_ext.nixl_push.metadata import (
    PULL_LEG_REFUSED,
    DLegParams,
    LegError,
    PushConnectorMetadata,
    PushFinishedMeta,
    PushRegMeta,
    PushWorkerMeta,
    is_d_leg,
    is_pull_d_leg,
    is_push_d_leg,
    parse_d_leg,
    parse_p_leg,
)
from vllm_ext.nixl_push.wire import PromptKey

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)


#: How much longer than the workers' own bound a ticket may wait for them before the
#: scheduler gives up on it (logged as an error; only ``has_pending_push_work`` changes).
BACKSTOP_SLACK_S = 30.0


class RecvTicketState(enum.Enum):
    AWAITING = "awaiting"
    CANCELLING = "cancelling"
    FAILING = "failing"


@dataclasses.dataclass(eq=False)
class RecvTicket:
    """D: a push D leg with blocks allocated, until the workers report it received."""

    state: RecvTicketState
    #: AWAITING: the watchdog; otherwise the backstop (time.monotonic())
    deadline: float
    #: AWAITING: when a producer last renewed it (PUSH_HB); None: never
    renewed_at: float | None = None

    def cancel(self, backstop: float) -> None:
        """Aborted, or the watchdog expired: the workers cancel with P."""
        if self.state is not RecvTicketState.AWAITING:
            raise IllegalTransition(f"recv ticket: {self.state.value} -> cancelling")
        self.state, self.deadline = RecvTicketState.CANCELLING, backstop


class SendTicketState(enum.Enum):
    LIVE = "live"
    ANNOUNCED = "announced"
    HELD = "held"


@dataclasses.dataclass(eq=False)
class SendTicket:
    """P: a push P leg, from its arrival until the workers report it sent."""

    request: Request | None
    transfer_id: str | None
    state: SendTicketState = SendTicketState.LIVE
    #: the P leg's transfer_secret (S-LEG-3)
    secret: str | None = dataclasses.field(default=None, repr=False)
    #: its prompt's key (S-WRT-7)
    prompt: PromptKey | None = None
    #: announce it when its last prompt token is scheduled (push_at_forward_end)
    at_forward_end: bool = False
    #: its block ids per KV cache group, as the scheduler outputs give them
    block_ids: list[list[int]] = dataclasses.field(default_factory=list)
    #: HELD: the backstop (time.monotonic())
    deadline: float | None = None
    #: its leg had no transfer_id: P made one (and the secret) and answers the push
    #: D leg when it finishes (push_answer_sequential_legs)
    answers_d_leg: bool = False
    #: its prompt chunks go to the writer as they are computed (push_progressive)
    progressive: bool = False
    #: chunks of it went to the workers (its blocks may be read by a WRITE from then on)
    streamed: bool = False
    #: preempted after it streamed: no more chunks; its final hand-over is written whole
    whole: bool = False
    #: ANNOUNCED, then preempted before its step's output was processed (async
    #: scheduling, PP): its blocks went back to vLLM, so nothing of it is written
    preempted: bool = False

    def announce(self) -> None:
        """Its last prompt token runs in this step (it finishes with it)."""
        if self.state is not SendTicketState.LIVE:
            raise IllegalTransition(f"send ticket: {self.state.value} -> announced")
        self.state = SendTicketState.ANNOUNCED

    def hold(self, backstop: float) -> None:
        """Finished: its blocks are held under the lease until the workers report it."""
        self.state, self.deadline = SendTicketState.HELD, backstop
        self.request = None  # finished: nothing more is read from it


@dataclasses.dataclass
class _Outgoing:
    """What the next ``build_connector_meta`` hands the workers."""

    registrations: dict[str, PushRegMeta] = dataclasses.field(default_factory=dict)
    failed_recvs: dict[str, str] = dataclasses.field(default_factory=dict)
    cancelled: set[str] = dataclasses.field(default_factory=set)
    expired: set[str] = dataclasses.field(default_factory=set)
    finished_blocks: dict[str, PushFinishedMeta] = dataclasses.field(default_factory=dict)
    prefill_stopped: set[str] = dataclasses.field(default_factory=set)
    announced_preempted: set[str] = dataclasses.field(default_factory=set)
    live_started: dict[str, str | None] = dataclasses.field(default_factory=dict)
    live_ended: set[str] = dataclasses.field(default_factory=set)

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in dataclasses.fields(self))


def unstreamable(kv_cache_config: Any) -> str | None:
    """Why prompt chunks of this engine's requests cannot be written as they are
    computed (None: they can): it needs one KV cache group of full attention, whose
    blocks, once filled, stay the request's until it ends (a sliding window frees
    blocks that leave it; several groups are not streamed)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is None:
        return "no KV cache configuration"
    if len(groups) != 1:
        return f"{len(groups)} KV cache groups (streamed: one)"
    spec = groups[0].kv_cache_spec
    if not compat.is_full_attention(spec):
        return f"its KV cache group is {type(spec).__name__} (streamed: full attention)"
    return None


def finishes_with_prefill(request: Request) -> bool:
    """The step that computes this request's last prompt token also finishes it: it
    may emit one token (``max_tokens`` 1), whether it stops or hits the length cap."""
    return request.max_tokens == 1 and request.num_output_tokens == 0


class NixlPushConnectorScheduler(SchedulerBase):  # type: ignore[misc]
    def __init__(self, vllm_config, engine_id, kv_cache_config, push_config: PushConfig) -> None:  # type: ignore[no-untyped-def]
        super().__init__(
            vllm_config,
            engine_id,
            kv_cache_config,
        )
        self.push_config = push_config
        # D: push D legs parsed while they wait for blocks (the parse, or its error)
        self._d_legs: dict[str, DLegParams | LegError] = {}
        # D: push D legs with blocks allocated, until finished_recving.
        self._recvs: dict[str, RecvTicket] = {}
        # D: the deadline of each ticket in _recvs (the watchdog, the backstops)
        self._recv_deadlines = DeadlineHeap()
        # P: push P legs, from their arrival until finished_sending.
        self._sends: dict[str, SendTicket] = {}
        # P: the ANNOUNCED and the HELD tickets of _sends, and the HELD ones' backstops
        self._announced: dict[str, SendTicket] = {}
        self._held: set[str] = set()
        self._held_deadlines = DeadlineHeap()
        self._out = _Outgoing()
        # P: the ids made for P legs without one (push_answer_sequential_legs).
        self._made_ids = SequentialLegIds()
        # P: stream prompt chunks (push_progressive) where the KV layout allows it.
        self._progressive = push_config.push_progressive and push_config.push_at_forward_end
        if self._progressive and (why := unstreamable(kv_cache_config)) is not None:
            logger.info("push: prompts are written whole on this engine: %s", why)
            self._progressive = False
        # A sliding window's blocks are freed (nulled) while a request runs: only vLLM's
        # final block lists (request_finished) say which blocks it still holds, so such
        # an engine pushes from there, never from the scheduled block ids (S-HYB-1).
        self._positional = compat.has_sliding_groups(kv_cache_config)
        self._group_block_sizes = tuple(
            g.kv_cache_spec.block_size for g in getattr(kv_cache_config, "kv_cache_groups", ())
        )
        self._push_kv_groups = compat.kv_groups(kv_cache_config)

    def recv_ticket(self, request_id: str) -> RecvTicket | None:
        return self._recvs.get(request_id)

    def send_ticket(self, request_id: str) -> SendTicket | None:
        return self._sends.get(request_id)

    # -- D side ----------------------------------------------------------------------
    def _push_tcp_user_timeout_s(self) -> float:
        """The TCP user timeout this engine's NIXL agents use (its layout announces it)."""
        return compat.effective_tcp_user_timeout_s(self.push_config.ucx_tcp_user_timeout_s)

    def _push_peer_hosts(self) -> tuple[str, ...]:
        """The D hosts this producer connects to (its layout announces them); a consumer
        connects to no D and announces none."""
        if not self.vllm_config.kv_transfer_config.is_kv_producer:
            return ()
        return self.push_config.push_peer_hosts

    def get_num_new_matched_tokens(
        self,
        request: Request,
        num_computed_tokens: int,
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        rid = request.request_id
        if is_push_d_leg(params) and rid not in self._d_legs:
            # parsed once: update_state_after_alloc takes this result
            try:
                self._d_legs[rid] = parse_d_leg(params)  # type: ignore[arg-type]
            except LegError as e:
                self._d_legs[rid] = e
                logger.error("push: request %s rejected: %s", rid, e)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def _parsed_d_leg(self, rid: str, params: dict[str, Any]) -> DLegParams:
        """The D leg as ``get_num_new_matched_tokens`` parsed it (parsed now if it did
        not); raises its :class:`LegError`."""
        leg = self._d_legs.pop(rid, None)
        if leg is None:
            return parse_d_leg(params)
        if isinstance(leg, LegError):
            raise leg
        return leg

    def update_state_after_alloc(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
    ) -> None:
        params = request.kv_transfer_params
        # (vLLM calls this again once the KV is in: do_remote_prefill is cleared below)
        if not is_d_leg(params):
            return super().update_state_after_alloc(request, blocks, num_external_tokens)
        assert params is not None
        pull_leg = is_pull_d_leg(params)
        rid = request.request_id
        # Only one transfer per request, as in vLLM's pull path.
        params["do_remote_prefill"] = False
        params["_remote_blocks_processed"] = True
        now = time.monotonic()
        try:
            if pull_leg:  # vLLM's READ path would fail on tables a push worker never fills
                self._d_legs.pop(rid, None)
                raise LegError(PULL_LEG_REFUSED)
            leg: DLegParams | None = self._parsed_d_leg(rid, params)
        except LegError as e:  # fail it alone (the worker reports its blocks invalid)
            logger.error("push: request %s rejected: %s", rid, e, extra=event("push_rejected", rid))
            leg = None
            self._out.failed_recvs[rid] = str(e)
            self._add_recv(rid, RecvTicket(RecvTicketState.FAILING, now + BACKSTOP_SLACK_S))
        else:
            timeout = self.push_config.push_registration_timeout_s
            self._add_recv(rid, RecvTicket(RecvTicketState.AWAITING, now + timeout))
        self._out.registrations[rid] = self._registration(request, blocks, num_external_tokens, leg)
        return None

    def _add_recv(self, rid: str, ticket: RecvTicket) -> None:
        self._recvs[rid] = ticket
        self._recv_deadlines.push(rid, ticket.deadline)

    def _registration(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
        leg: DLegParams | None,
    ) -> PushRegMeta:
        starts: tuple[int, ...] | None = None
        prefix = 0
        if num_external_tokens <= 0:
            block_ids: Any = ()
        elif self._positional:
            block_ids, starts = blocks_to_receive(blocks.blocks, self._group_block_sizes)
            prefix = min(starts, default=0)
        else:
            allocated = blocks.get_unhashed_block_ids_all_groups()
            block_ids = self._push_clipped_blocks(allocated)  # type: ignore[arg-type]
            prefix = self._cached_prefix_tokens(blocks)
        return PushRegMeta(
            request_id=request.request_id,
            block_ids=block_ids,  # (made for this record above)
            p_engine_id=leg.p_engine_id if leg else "",
            p_host=leg.p_host if leg else "",
            p_port=leg.p_port if leg else 0,
            p_tp_size=leg.p_tp_size if leg else 1,
            transfer_id=leg.transfer_id if leg else None,
            prefix_tokens=prefix,
            p_pp_size=leg.p_pp_size if leg else 1,
            secret=leg.secret if leg else None,
            prompt=compat.prompt_key(request),
            group_starts=starts,
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

    def _cancel_recv(self, rid: str, ticket: RecvTicket, expired: bool, now: float) -> None:
        """The workers ask P to stand down and keep the blocks until P answered (a
        WRITE that already started may still land), then report the request."""
        cfg = self.push_config
        # the workers' bound: the answer deadline and a WRITE's (lease_overrun), or a
        # quarantine's (docs/design.md N-LIV-1: the cancel's send fails after the TCP
        # user timeout, seen at a re-ask, then the producer is lost, checked each period,
        # and not before P's hold of a registration it never renewed ends)
        answer_s, tcp_s = cfg.push_cancel_answer_timeout_s, cfg.ucx_tcp_user_timeout_s
        lost_s = max(0.0, producer_lost_after_s(tcp_s))
        bound = max(
            answer_s + cfg.lease_overrun,
            max(tcp_s, answer_s) + 2 * answer_s + lost_s,
            unrenewed_registration_hold_s(cfg, tcp_s) + answer_s,
        )
        ticket.cancel(now + bound + BACKSTOP_SLACK_S)
        self._recv_deadlines.push(rid, ticket.deadline)
        (self._out.expired if expired else self._out.cancelled).add(rid)

    def _check_watchdog(self, now: float) -> None:
        for rid, ticket in self._recv_deadlines.due(self._recvs, now):
            if ticket.state is RecvTicketState.AWAITING:
                cfg = self.push_config
                if ticket.renewed_at is None:
                    why = (f"no KV within push_registration_timeout_s="
                           f"{cfg.push_registration_timeout_s:g}s")  # fmt: skip
                else:
                    why = (f"no PUSH_HB from P for {now - ticket.renewed_at:.1f}s; "
                           f"push_heartbeat_timeout_s={cfg.push_heartbeat_timeout_s:g}s"
                           )  # fmt: skip
                logger.warning(
                    "push: registration of %s expired (%s); cancelling it with P, then "
                    "failing its KV load", rid, why, extra=event("push_reg_expired", rid),
                )  # fmt: skip
                self._cancel_recv(rid, ticket, expired=True, now=now)
            else:
                # The workers keep the blocks until no producer may write into them
                # (S-SAFE-1): a request past this backstop has a producer that could not
                # be removed from NIXL. The ticket stays (so does the engine's stepping,
                # which lets the workers try again); only the error is repeated.
                logger.error(
                    "push: the workers have not reported %s (%s) received %gs past its "
                    "bound: a producer may still write into its blocks, which stay held",
                    rid, ticket.state.value, BACKSTOP_SLACK_S,
                )  # fmt: skip
                ticket.deadline = now + BACKSTOP_SLACK_S
                self._recv_deadlines.push(rid, ticket.deadline)

    def _renew(self, renewed: frozenset[str], now: float) -> None:
        """Producers still hold these requests (PUSH_HB): renew their watchdog. Once
        renewed, a request's producers must keep renewing it: its deadline is then the
        last renewal plus ``push_heartbeat_timeout_s`` (if shorter than the watchdog)."""
        timeout = self.push_config.renewed_watchdog_s
        for rid in renewed:
            ticket = self._recvs.get(rid)
            if ticket is not None and ticket.state is RecvTicketState.AWAITING:
                ticket.renewed_at = now
                ticket.deadline = now + timeout
                self._recv_deadlines.push(rid, ticket.deadline)

    # -- P side ----------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        """D: a push D leg with a transfer id renews P's lease while it waits here for
        blocks (S-TMO-2). P: follow a push P leg from its arrival: the workers renew D's
        watchdog for it while it is queued or prefilling, and, if it finishes with its
        prefill, its blocks go to the writer as soon as its KV is computed (its block
        ids are collected from the scheduler outputs in ``build_connector_meta``)."""
        super().on_new_request(request)
        params = request.kv_transfer_params
        tid = params.get("transfer_id") if params else None
        if is_push_d_leg(params) and isinstance(tid, str) and tid:
            # D: while the request waits here for blocks, vLLM's lease heartbeat names
            # its transfer id, so that P holds the prefilled blocks past its lease
            # (S-TMO-2); vLLM stops it when the KV is in (finished_recving), at an abort.
            # With a secret in the legs it names a proof of it too, without which P
            # renews nothing (heartbeat_name).
            if not params.get("remote_request_id"):  # type: ignore[union-attr]
                secret = params.get("transfer_secret")  # type: ignore[union-attr]
                name = heartbeat_name(tid, secret if isinstance(secret, str) else None)
                self._push_track_lease_heartbeats(request.request_id, params, name)  # type: ignore[arg-type]
            return
        if not (params and params.get("do_remote_decode")):
            return
        try:
            leg = parse_p_leg(params)
        except LegError:
            return  # request_finished reports it
        at_forward_end = (
            self.push_config.push_at_forward_end
            and not self._positional
            and finishes_with_prefill(request)
        )
        tid, secret, answers = leg.transfer_id, leg.secret, False
        if tid is None and self.push_config.push_answer_sequential_legs:
            # The D leg will carry what P answers: P's send uses that transfer id as
            # if the P leg had carried it (and the leg's own secret, if any: S-LEG-3).
            tid, secret = self._made_ids.ids_for(request.request_id, leg.secret)
            answers = True
        self._sends[request.request_id] = SendTicket(
            request, tid, at_forward_end=at_forward_end, secret=secret, answers_d_leg=answers,
            progressive=self._progressive and at_forward_end, prompt=compat.prompt_key(request),
        )  # fmt: skip
        self._out.live_started[request.request_id] = tid

    def _announce_prefill_done(
        self, out: SchedulerOutput
    ) -> tuple[dict[str, PushFinishedMeta], dict[str, PushFinishedMeta]]:
        """P: the tracked requests whose last prompt token runs in this step, and
        (push_progressive) those of which it runs a prompt chunk that is not the last."""
        if not self._sends:
            return {}, {}

        def tracked(rid: str) -> SendTicket | None:
            t = self._sends.get(rid)
            ok = t is not None and t.at_forward_end and t.state is SendTicketState.LIVE
            return t if ok else None

        for new in out.scheduled_new_reqs:
            if (t := tracked(new.req_id)) is not None:
                t.block_ids = [list(g) for g in new.block_ids]
                t.whole = t.streamed  # vLLM 0.34 sends a resumed request as a new one
        cached = out.scheduled_cached_reqs
        resumed = compat.resumed_request_ids(cached)
        for rid, added in zip(cached.req_ids, cached.new_block_ids):
            if added is None or (t := tracked(rid)) is None:
                continue
            if rid in resumed:  # preempted, then resumed: all its blocks
                t.block_ids = [list(g) for g in added]
                t.whole = t.streamed
            else:
                for group, ids in zip(t.block_ids, added):
                    group.extend(ids)
        for rid in compat.preempted_request_ids(out):
            # Its blocks are freed now and may be reused in this very step, while a
            # WRITE of a chunk may still read them: it is written whole once its
            # prompt is computed anew, after every earlier WRITE of it ended (S-PRG-1).
            if (t := tracked(rid)) is not None and t.streamed:
                t.whole = True
        self._find_announced_preempted(compat.preempted_request_ids(out))
        done: dict[str, PushFinishedMeta] = {}
        chunks: dict[str, PushFinishedMeta] = {}
        for rid, n in out.num_scheduled_tokens.items():
            t = tracked(rid)
            # num_computed_tokens is advanced only after this method, in the scheduler.
            if t is None or t.request is None:
                continue
            computed = t.request.num_computed_tokens + n
            if computed < t.request.num_prompt_tokens:
                if t.progressive and not t.whole:
                    t.streamed = True
                    chunks[rid] = PushFinishedMeta(
                        request_id=rid,
                        block_ids=tuple(tuple(g) for g in t.block_ids),
                        transfer_id=t.transfer_id,
                        finished_at=0.0,
                        secret=t.secret,
                        kv_tokens=computed,
                        prompt=t.prompt,
                    )
                continue
            t.announce()
            self._announced[rid] = t
            done[rid] = PushFinishedMeta(
                request_id=rid,
                # (the ticket's lists: an announced ticket's are never changed again)
                block_ids=self._push_clipped_blocks(t.block_ids),
                transfer_id=t.transfer_id,
                finished_at=0.0,  # set by the worker when the forward pass ends
                secret=t.secret,
                streamed=t.streamed,
                prompt=t.prompt,
                whole=t.whole,
            )
        return done, chunks

    def _p_blocks(self, block_ids: Any) -> Any:
        """P: the block lists a WRITE reads, from vLLM's final ones (request_finished).
        With a sliding window every group keeps one entry per block position from the
        prompt's first token, the null block where vLLM freed one (S-HYB-1): the
        WRITE pairs them with D's by position and never reads a null one."""
        if self._positional:
            return block_ids
        return self._push_clipped_blocks(block_ids)

    def _find_announced_preempted(self, preempted: frozenset[str]) -> None:
        """P: announced requests vLLM preempted since its last schedule: the step that
        runs their last prompt token has not been processed yet (async scheduling, PP)
        and their blocks went back to vLLM, for other requests in this very step. The
        workers let no WRITE read them from now on (S-SAFE-1). Preempted in this
        schedule (``preempted``), or outside it (``reset_prefix_cache``, which vLLM
        0.23 does not report): vLLM then set its computed tokens back below its prompt,
        which nothing else does once the prompt ran."""
        for rid, t in self._announced.items():
            if t.preempted or t.request is None:
                continue
            if rid in preempted or t.request.num_computed_tokens < t.request.num_prompt_tokens:
                logger.warning(
                    "push: %s was preempted after its prompt was announced: not pushed", rid
                )
                t.preempted = True
                self._out.announced_preempted.add(rid)

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        ticket = self._sends.get(request.request_id)
        delay, out = self._request_finished(request, block_ids)
        if ticket is not None and ticket.answers_d_leg and delay and out:
            assert ticket.transfer_id is not None and ticket.secret is not None
            pp = self.vllm_config.parallel_config.pipeline_parallel_size
            out = d_leg_answer(out, pp, ticket.transfer_id, ticket.secret)
            logger.debug(
                "push: %s answers the push D leg (transfer_id %s)",
                request.request_id, ticket.transfer_id,
            )  # fmt: skip
        return delay, out

    def _request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        params = request.kv_transfer_params
        if is_d_leg(params):
            # Finished (aborted) before blocks were allocated: nothing was registered
            # with P, so there is nothing to release remotely (vLLM's pull path would
            # send P a notification here; P's blocks go back via its lease).
            self._stop_heartbeat(rid)
            self._d_legs.pop(rid, None)
            params["do_remote_prefill"] = False  # type: ignore[index]
            return False, None
        recv = self._recvs.get(rid)
        if recv is not None and recv.state is RecvTicketState.AWAITING:
            # D request finished (aborted) before its KV arrived. vLLM keeps its
            # blocks until finished_recving; the workers ask P to stand down and
            # report the request received once P answered (or wrote).
            self._cancel_recv(rid, recv, expired=False, now=time.monotonic())
        ticket = self._sends.get(rid)
        delay, out = super().request_finished(request, block_ids)
        if ticket is not None and ticket.state is SendTicketState.ANNOUNCED:
            return self._finish_announced(request, ticket, delay, out)
        if ticket is not None and ticket.streamed and ticket.state is SendTicketState.LIVE:
            # Ended (aborted) before its prompt was computed, with chunks of it at the
            # writer: keep the blocks until the workers report it sent (no WRITE of it
            # runs any more), as for an announced one.
            self._out.prefill_stopped.add(rid)
            return self._finish_announced(request, ticket, delay, out)
        if not (params and params.get("do_remote_decode")):
            return delay, out
        if not delay:
            self._drop_live(rid)  # aborted, or nothing to send
            return delay, out
        try:
            leg = parse_p_leg(params)
        except LegError as e:
            # Fail only this request: do not push; its blocks go back via the lease
            # (held, so that the engine keeps stepping until it ends).
            logger.error(
                "push: request %s not pushed: %s", rid, e, extra=event("push_refused", rid)
            )
            self._drop_live(rid)
            self._hold(rid, SendTicket(None, None))
            return delay, out
        if ticket is None:  # (on_new_request tracks every valid push P leg)
            ticket = SendTicket(
                None, leg.transfer_id, secret=leg.secret, prompt=compat.prompt_key(request)
            )
        self._out.finished_blocks[rid] = PushFinishedMeta(
            request_id=rid,
            block_ids=self._p_blocks(block_ids),  # (vLLM made these lists for this call)
            transfer_id=ticket.transfer_id,
            finished_at=time.monotonic(),
            secret=ticket.secret,
            prompt=ticket.prompt,
        )
        self._hold(rid, ticket)
        return delay, out

    def _finish_announced(
        self, request: Request, ticket: SendTicket, delay: bool, out: dict[str, Any] | None
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: the blocks of an announced request are with the writer already. Keep
        them until the worker reports the request sent (or its lease ends), whatever
        the status: vLLM frees an aborted request's blocks at once, and a WRITE may
        be reading them."""
        rid = request.request_id
        if not delay:
            self._reqs_not_processed.discard(rid)
            self._reqs_need_send[rid] = time.perf_counter() + self._kv_lease_duration
        self._hold(rid, ticket)
        return True, out

    def _hold(self, rid: str, ticket: SendTicket) -> None:
        ticket.hold(
            time.monotonic()
            + self._kv_lease_duration
            + self.push_config.lease_overrun
            + BACKSTOP_SLACK_S
        )
        self._sends[rid] = ticket
        self._announced.pop(rid, None)
        self._held.add(rid)
        assert ticket.deadline is not None
        self._held_deadlines.push(rid, ticket.deadline)

    def _forget_send(self, rid: str) -> SendTicket | None:
        """P: the ticket of ``rid`` leaves the table (and its indexes)."""
        self._announced.pop(rid, None)
        self._held.discard(rid)
        ticket = self._sends.pop(rid, None)
        if not self._sends:
            self._held_deadlines.table_emptied()
        return ticket

    def _drop_live(self, rid: str) -> None:
        """P: a live request ends without being pushed."""
        if self._forget_send(rid) is None:
            return
        if self._out.live_started.pop(rid, None) is None:  # the workers know it
            self._out.live_ended.add(rid)

    def _check_held(self, now: float) -> None:
        for rid, _ in self._held_deadlines.due(self._sends, now):
            logger.error("push: the workers never reported %s sent; forgetting it", rid)
            self._forget_send(rid)

    # -- both --------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PushConnectorMetadata:
        base = super().build_connector_meta(scheduler_output)
        meta = PushConnectorMetadata()
        meta.__dict__.update(base.__dict__)
        now = time.monotonic()
        self._check_watchdog(now)
        self._check_held(now)
        meta.push_prefill_done, meta.push_chunks = self._announce_prefill_done(scheduler_output)
        out, self._out = self._out, _Outgoing()
        meta.push_prefill_stopped = out.prefill_stopped
        meta.push_announced_preempted = out.announced_preempted
        meta.push_registrations = out.registrations
        meta.push_finished_blocks = out.finished_blocks
        meta.push_failed_recvs = out.failed_recvs
        meta.push_cancelled = out.cancelled
        meta.push_expired = out.expired
        meta.push_live_started = out.live_started
        meta.push_live_ended = out.live_ended
        meta.push_step_idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """P: a request reported sent ends its ticket; D: one reported received ends its
        watchdog (after vLLM's own bookkeeping)."""
        super().update_connector_output(output)
        for rid in output.finished_sending or ():
            self._forget_send(rid)
        for rid in output.finished_recving or ():
            self._recvs.pop(rid, None)
        if output.finished_recving and not self._recvs:
            self._recv_deadlines.table_emptied()
        worker_meta = compat.worker_metadata_of(output)
        if isinstance(worker_meta, PushWorkerMeta):
            self._renew(worker_meta.renewed, time.monotonic())

    def has_pending_block_frees(self) -> bool:
        """P: an announced request's step has not been processed yet (async scheduling,
        PP). vLLM (0.32) then leaves a request it cannot allocate for unscheduled in
        this step rather than preempt the last running one, which may be that request
        (its blocks would go to another request while its WRITE reads them, S-SAFE-1).
        Its output comes with the step in flight; then it is held and this ends."""
        return any(not t.preempted for t in self._announced.values())

    def has_pending_push_work(self) -> bool:
        return bool(self._recvs or self._out or self._announced or self._held)
