# SPDX-License-Identifier: Apache-2.0
"""D's PUSH_REGs on the writer thread: each D request's registration sent to its
producers (P's agents), its cancel (``PUSH_CANCEL``) and the re-asks of producers whose
answer is overdue. P's counterpart, what P does with a registration it receives, is
dlinks.py (and writes.py for the WRITEs it leads to).

Each request's PUSH_REG is a :class:`~vllm_ext.nixl_push.lifecycle.RegOut` (lifecycle.py
has its diagram) held in a :class:`RegOuts` table, the one place that moves a RegOut
from state to state: it keeps the count of those SENT (their producers' answers may
come), which the writer loop reads every pass (S-WRT-2).

Handshakes never block the writer (S-WRT-5): a PUSH_REG waits CONNECTING for the
handshake with P, whose callback hands the RegOut back (``RegConnected``); a failed
handshake fails the request, never retried (S-FAIL-1).
"""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from vllm_ext.log import get_logger
from vllm_ext.nixl_push.context import WriterContext, refuses_connections
from vllm_ext.nixl_push.layouts import leg_mismatch
from vllm_ext.nixl_push.lifecycle import RegOut, RegOutState
from vllm_ext.nixl_push.messages import (
    CancelRecv,
    Deferred,
    ProducersUnreachable,
    RecvFailed,
    RegConnected,
    RegPartlySent,
    RegSent,
    RegUnsent,
    ToEngine,
)
from vllm_ext.nixl_push.metadata import PushRegMeta
from vllm_ext.nixl_push.wire import PushCancel, PushRegistration

logger = get_logger("vllm_ext.nixl_push.writer")


class RegOuts:
    """Each D request's PUSH_REG, until the engine thread evicts the request. Its
    transitions (``sent``, ``cancel``, ``fail``) are made here only, so that the count
    of SENT ones is exact: ``awaiting_answers`` is O(1)."""

    def __init__(self) -> None:
        self._outs: dict[str, RegOut] = {}
        self._sent = 0

    def __len__(self) -> int:
        return len(self._outs)

    def __iter__(self) -> Iterator[RegOut]:
        return iter(self._outs.values())

    def __repr__(self) -> str:
        return repr({rid: out.state.value for rid, out in self._outs.items()})

    @property
    def awaiting_answers(self) -> bool:
        """A PUSH_REG went out (SENT) and its producers' answers may come."""
        return self._sent > 0

    def get(self, request_id: str) -> RegOut | None:
        return self._outs.get(request_id)

    def add(self, out: RegOut) -> RegOut:
        assert out.request_id not in self._outs and out.state is not RegOutState.SENT
        self._outs[out.request_id] = out
        return out

    def evict(self, request_id: str) -> None:
        out = self._outs.pop(request_id, None)
        if out is not None and out.state is RegOutState.SENT:
            self._sent -= 1

    def sent(self, out: RegOut, agents: frozenset[str]) -> None:
        out.sent(agents)
        self._sent += self._outs.get(out.request_id) is out

    def cancel(self, out: RegOut) -> frozenset[str]:
        was_sent = out.state is RegOutState.SENT
        agents = out.cancel()
        if was_sent and self._outs.get(out.request_id) is out:
            self._sent -= 1
        return agents

    def fail(self, out: RegOut) -> None:
        out.fail()  # (from CONNECTING only: never SENT)


class Registrations:
    """D's side of the registrations of one rank; every method runs on the writer
    thread (see the module docstring). ``post`` reaches the engine thread (the
    writer's ordered outbox); ``deferred`` and ``cancels`` are the writer's inboxes
    that handshake callbacks hand their outcome to, ``wake`` wakes the writer."""

    def __init__(
        self,
        ctx: WriterContext,
        post: Callable[[ToEngine], None],
        deferred: queue.SimpleQueue[Deferred],
        cancels: queue.SimpleQueue[CancelRecv],
        wake: Callable[[], None],
    ) -> None:
        self.ctx = ctx
        self._post = post
        self._deferred = deferred
        self._cancels = cancels
        self._wake = wake
        self.table = RegOuts()

    @property
    def awaiting_answers(self) -> bool:
        return self.table.awaiting_answers

    def evict(self, request_id: str) -> None:
        """The engine thread is done with the request."""
        self.table.evict(request_id)

    # -- the writer's catch-all: settle what an item concerned -----------------------------
    def fail_after_error(self, item: tuple[PushRegMeta, str]) -> None:
        rid = item[0].request_id
        out = self.table.get(rid)
        if out is not None and out.state is RegOutState.CONNECTING:
            self.table.fail(out)  # nothing went out: D may fail it now
            self._post(RecvFailed(rid, "internal error in the push writer"))

    def fail_connected_after_error(self, item: RegConnected) -> None:
        if item.out.state is RegOutState.CONNECTING:
            self.table.fail(item.out)
            self._post(RecvFailed(item.request_id, "internal error in the push writer"))

    def send(self, item: tuple[PushRegMeta, str]) -> None:
        """A D request's PUSH_REG and this rank's reply token, from the engine thread
        (once per request); the scheduler's record is shared by the ranks (read only),
        the token is this rank's own (``RegOut.reply_token``)."""
        meta, token = item
        rid = meta.request_id
        out = self.table.get(rid)
        if out is None:
            out = self.table.add(RegOut(rid, meta, reply_token=token))
        elif out.state is RegOutState.CANCELLED and out.meta is None:
            # cancelled before it went out: nothing will be sent
            out.meta, out.reply_token = meta, token
            self.ctx.counters.inc("push_cancels_unsent")
            self._post(RegUnsent(rid))
            return
        else:
            logger.error("push: %s handed to the writer twice (%s); ignored", rid, out.state.value)
            return
        self._try_send(out)

    def _try_send(self, out: RegOut) -> None:
        """Send a CONNECTING PUSH_REG to every producer, or start the handshake first."""
        meta, rid = out.meta, out.request_id
        assert meta is not None and out.sendable
        try:
            fut = self.ctx.request_handshake(
                meta.p_engine_id, meta.p_host, meta.p_port, meta.p_tp_size
            )
        except Exception as e:  # e.g. an invalid tp_size in the D leg
            fut = Future()
            fut.set_exception(e)
        if fut is not None:
            fut.add_done_callback(functools.partial(self._after_d_handshake, out=out))
            return
        agents = self.ctx.peers.of(meta.p_engine_id)
        layouts = self.ctx.layouts
        problem = leg_mismatch(meta, layouts.announced(meta.p_engine_id), layouts.kv_groups)
        if problem is None and not agents:
            problem = f"P {meta.p_engine_id} has no agent"
        if problem is not None:  # e.g. the D leg's tp_size is wrong: fail this request only
            self.table.fail(out)
            self._recv_failed(rid, problem)
            return
        reg = self._registration(meta, out.reply_token).encode()
        reached: list[str] = []
        for p_rank, agent in sorted(agents.items()):
            try:
                self.ctx.nixl.send_notif(agent, notif_msg=reg)
            except Exception as e:
                self.ctx.counters.inc("push_failed_send_notif")
                reason = f"sending PUSH_REG to P rank {p_rank}: {e}"
                if not reached:  # reached no P rank: nothing can be written
                    # e.g. P restarted, or the connection broke: remove its agents (and
                    # their endpoints) and connect anew, once, for this request too
                    self.ctx.forget_peer(meta.p_engine_id, reason, True)
                    if not out.resent:
                        out.resent = True
                        self.ctx.counters.inc("push_regs_resent")
                        self._try_send(out)
                        return
                    self.table.fail(out)
                    self._recv_failed(rid, reason)
                else:  # some ranks may write: cancel with them before freeing
                    self.table.sent(out, frozenset(reached))
                    logger.error("push: request %s fails: %s", rid, reason)
                    self._post(RegPartlySent(rid, frozenset(reached), reason))
                    self.cancel(CancelRecv(rid))
                return
            reached.append(agent)
        self.table.sent(out, frozenset(reached))
        self.ctx.counters.inc("push_regs_sent")
        self._post(RegSent(rid, frozenset(reached)))

    def _registration(self, meta: PushRegMeta, reply_token: str | None) -> PushRegistration:
        me, cfg = self.ctx.identity, self.ctx.config
        return PushRegistration(
            engine_id=me.engine_id,
            request_id=meta.request_id,
            transfer_id=meta.transfer_id,
            block_ids=meta.block_ids,
            tp_rank=me.tp_rank,
            tp_size=me.tp_size,
            host=me.host,
            port=me.port,
            block_size=me.block_size,
            prefix_tokens=meta.prefix_tokens,
            group_starts=meta.group_starts,
            timeout_s=cfg.push_registration_timeout_s,
            heartbeat_s=cfg.heartbeat_interval,
            secret=meta.secret,
            prompt=meta.prompt,
            reply_token=reply_token,
        )

    def cancel(self, c: CancelRecv) -> None:
        """D: ask every producer the PUSH_REG reached to stand down (they answer). One
        that has not gone out yet never will: the engine thread is told at once."""
        rid = c.request_id
        out = self.table.get(rid)
        if c.again:
            if out is not None and out.state is RegOutState.CANCELLED and out.meta is not None:
                self._ask_again(out, out.agents & c.again)
            return
        if out is None:  # its PUSH_REG is still in the inbox: _send_registration reports it
            self.table.add(RegOut(rid, None, RegOutState.CANCELLED))
            return
        if out.state is RegOutState.CONNECTING:
            # Its handshake with P runs: when it ends it finds the PUSH_REG CANCELLED
            # and sends nothing; only then is the engine thread told (RegUnsent), so
            # that vLLM's bookkeeping of the request sees P connected (or failed).
            self.table.cancel(out)
            return
        agents = self.table.cancel(out)
        if not agents:
            return  # cancelled already, or it reached nobody
        self._send_cancel(out, agents)
        self.ctx.counters.inc("push_cancels_sent")

    def _ask_again(self, out: RegOut, producers: frozenset[str]) -> None:
        """Re-ask producers whose answer is overdue (S-SAFE-1, S-FLT-2). If a send to P
        failed, its endpoints were removed with it: connect anew first (a partition
        that outlasted UCX's keepalive leaves failed endpoints behind), then send to
        those of the producers P still has (one it no longer has is gone: the engine
        thread ends the request)."""
        meta = out.meta
        assert meta is not None
        if not self.ctx.peers.of(meta.p_engine_id):
            try:
                fut = self.ctx.request_handshake(
                    meta.p_engine_id, meta.p_host, meta.p_port, meta.p_tp_size
                )
            except Exception as e:  # noqa: BLE001 - asked again next answer period
                logger.warning("push: reconnecting to %s: %s", meta.p_engine_id, e)
                return
            if fut is not None:
                again = functools.partial(self._after_cancel_handshake, out, producers)
                fut.add_done_callback(again)
                return
        loaded = frozenset(self.ctx.peers.of(meta.p_engine_id).values())
        if producers & loaded:
            self.ctx.counters.inc("push_cancels_resent")
            self._send_cancel(out, producers & loaded)

    def _after_cancel_handshake(self, out: RegOut, producers: frozenset[str], fut: Future) -> None:
        """Handshake executor thread: connected anew, re-ask; else asked again next
        answer period (a refusal is counted: it does not prove P gone, N-LIV-1)."""
        error = fut.exception()
        if error is None:
            self._cancels.put(CancelRecv(out.request_id, producers))
            self._wake()
            return
        meta = out.meta
        assert meta is not None
        if refuses_connections(meta.p_host, meta.p_port):
            # Not proof that P is gone: a Service without ready endpoints refuses for a
            # P that only hangs (N-LIV-1). Asked again next answer period.
            self.ctx.counters.inc("push_producers_refused")
            logger.warning("push: P's side channel %s:%s refuses connections (%s)",
                           meta.p_host, meta.p_port, error)  # fmt: skip

    def _send_cancel(self, out: RegOut, agents: frozenset[str]) -> None:
        me, rid = self.ctx.identity, out.request_id
        msg = PushCancel(
            engine_id=me.engine_id, request_id=rid, tp_rank=me.tp_rank,
            tp_size=me.tp_size, host=me.host, port=me.port,
            reply_token=out.reply_token,
        ).encode()  # fmt: skip
        failed: dict[str, str] = {}
        for agent in sorted(agents):
            try:
                self.ctx.nixl.send_notif(agent, notif_msg=msg)
            except Exception as e:
                self.ctx.counters.inc("push_failed_send_notif")
                logger.warning("push: PUSH_CANCEL for %s to %s: %s", rid, agent, e)
                failed[agent] = str(e)
        if failed:
            # An unreachable producer cannot answer: the engine thread keeps the blocks
            # and asks again each answer period (S-SAFE-1), and counts from now how
            # long it stays silent (N-LIV-1). The endpoints failed for good: remove P's
            # agents so that the re-ask connects anew (S-FLT-2).
            # (Removed before the engine thread hears of it: P's agents loaded after
            # this come from a new handshake, a sign of life.)
            at, why = time.monotonic(), f"PUSH_CANCEL not sent: {next(iter(failed.values()))}"
            if out.meta is not None:
                self.ctx.forget_peer(out.meta.p_engine_id, why, True)
            self._post(ProducersUnreachable(frozenset(failed), at, why))

    def _after_d_handshake(self, fut: Future, out: RegOut) -> None:
        # Handshake executor thread: hand the outcome to the writer, touch nothing.
        self._deferred.put(RegConnected(out, fut.exception()))
        self._wake()

    def on_connected(self, item: RegConnected) -> None:
        """The handshake a PUSH_REG waited for ended (``_after_d_handshake``)."""
        out = item.out
        if self.table.get(out.request_id) is not out or not out.sendable:
            # Cancelled (or ended) while the handshake ran: never send it (the blocks
            # it names may belong to another request by then).
            self.ctx.counters.inc("push_regs_not_replayed")
            logger.debug("push: handshake for %s ended after it was %s; not sent",
                         out.request_id, out.state.value)  # fmt: skip
            if self.table.get(out.request_id) is out:
                self.ctx.counters.inc("push_cancels_unsent")
                self._post(RegUnsent(out.request_id))
            return
        if item.error is not None:
            self.ctx.counters.inc("push_failed_handshake")
            self.table.fail(out)
            meta = out.meta
            assert meta is not None
            self._recv_failed(
                out.request_id, f"handshake with P {meta.p_engine_id} failed: {item.error}"
            )
            return
        self._try_send(out)

    def _recv_failed(self, d_request_id: str, reason: str) -> None:
        logger.error("push: request %s fails: %s", d_request_id, reason)
        self._post(RecvFailed(d_request_id, reason))
