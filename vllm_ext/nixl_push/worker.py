# SPDX-License-Identifier: Apache-2.0
"""Worker side of push: the engine-thread half (the other half is writer.py).

Runs on the engine thread of each TP rank:

* ``start_load_kv`` hands the step's push work to the writer (registrations and
  cancels on D, finished blocks and live requests on P) and wakes it only when
  there is some.
* ``wait_for_save`` (P), at the end of the step's forward pass, hands over the
  blocks of requests whose prompt that pass completed (``push_prefill_done``):
  their KV is final, so the WRITE need not wait for the next engine step.
  ``start_load_kv`` announced them before the pass, so the writer has prepared
  those WRITEs meanwhile and only posts them now. With ``push_progressive`` it also
  hands over the blocks of requests of which the pass computed a prompt chunk
  (``push_chunks``): the writer writes their full blocks while the next chunks run.
* ``get_finished`` reads what the writer reported (its ``outbox``, typed messages)
  and turns it into vLLM's ``(finished_sending, finished_recving)``: P requests
  whose WRITEs are settled, D requests whose every producer answered (recv.py
  holds their :class:`~vllm_ext.nixl_push.lifecycle.PushRecv`). D's engine thread
  never waits for a WRITE: while completions are awaited the writer reads
  notifications by itself (every ``push_writer_poll_interval_ms``), and
  ``get_finished`` takes what it has read; what arrives later is taken by the next
  step (``push_recv_idle_wait_ms``, off by default, opts into a bounded wait in a
  step that runs nothing).
* P's leases: vLLM reaps a finished request's blocks when its lease ends; never
  while a WRITE may read them (``LeaseClaims``), and never later than the lease
  plus ``PushConfig.lease_overrun`` (the hard cap).
* ``build_connector_worker_meta`` tells D's scheduler which watchdogs producers
  renewed (PUSH_HB).
* The overrides of vLLM's handshake (``add_remote_agent``, ``_nixl_handshake``)
  record each peer's layout (``KvLayouts``, layouts.py) and walk P's PP stages.

vLLM's base worker keeps doing everything else: KV registration, the
handshake listener and initiator, lease reaping, heartbeats, post-processing
and failure accounting (``_handle_failed_transfer``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.utils import EngineTransferInfo
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta, ReqMeta

from vllm_ext import compat, compat_nixl
from vllm_ext.compat_nixl import WorkerBase
from vllm_ext.log import get_logger
from vllm_ext.nixl_push.config import (
    PushConfig,
    peer_hosts_allow,
    producer_lost_after_s,
    unrenewed_registration_hold_s,
)
from vllm_ext.nixl_push.context import (
    ForgetPeer,
    Identity,
    NotifDrops,
    PeerAgents,
    RequestHandshake,
    WriterContext,
    agent_name,
)
from vllm_ext.nixl_push.kv_ready import KvReadyWatcher
from vllm_ext.nixl_push.layouts import KvLayouts, LocalKv
from vllm_ext.nixl_push.leases import LeaseClaims, LeaseKeeper, QueuedRenewals
from vllm_ext.nixl_push.lifecycle import CancelCause, PushRecv, RecvState
from vllm_ext.nixl_push.members import natural_key, producer_stage
from vllm_ext.nixl_push.messages import (
    Announced,
    HandOver,
    Inbound,
    KvChunk,
    KvFinal,
    LiveRequests,
    ProducersUnreachable,
    Settled,
    Stopped,
)
from vllm_ext.nixl_push.metadata import PushConnectorMetadata, PushWorkerMeta
from vllm_ext.nixl_push.model_id import identity_mismatch
from vllm_ext.nixl_push.recv import RecvTable, ReplyTokens
from vllm_ext.nixl_push.stats import PushCounters, PushGauges, PushKVConnectorStats
from vllm_ext.nixl_push.wire import Completion, Heartbeat, Malformed, PeerLayout, PushHeartbeat
from vllm_ext.nixl_push.writer import PushWriter

logger = get_logger(__name__)

#: A preempted announced request's WRITE still runs: how often the engine thread has the
#: writer poll NIXL while it waits, and how often it logs that it still waits.
PREEMPTED_WRITE_POLL_S = 0.005
PREEMPTED_WRITE_REPORT_S = 10.0


def _handshake_requester(worker: WorkerBase) -> RequestHandshake:
    """vLLM's ``_ensure_handshake`` (non-blocking, under vLLM's handshake lock) for the
    writer, without a reference from the writer back to the worker."""
    method = weakref.WeakMethod(worker._push_request_handshake)

    def request_handshake(engine_id: str, host: str, port: int, tp_size: int) -> Future[Any] | None:
        ensure = method()
        if ensure is None:
            raise RuntimeError("the push worker was shut down")
        return ensure(engine_id, host, port, tp_size)

    return request_handshake


def _peer_forgetter(worker: NixlPushConnectorWorker) -> ForgetPeer:
    """``worker.forget_peer`` for the writer, without a reference back to the worker."""
    method = weakref.WeakMethod(worker.forget_peer)

    def forget_peer(engine_id: str, why: str, remove: bool = False) -> bool:
        forget = method()
        return False if forget is None else forget(engine_id, why, remove)

    return forget_peer


class NixlPushConnectorWorker(WorkerBase):  # type: ignore[misc]
    def __init__(self, vllm_config, engine_id, kv_cache_config, push_config: PushConfig) -> None:  # type: ignore[no-untyped-def]
        affinity = os.sched_getaffinity(0) if push_config.keep_cpu_affinity else None
        with compat.tuned_nixl_agents(
            push_config.nixl_progress_delay_us,
            push_config.ucx_use_mt_mutex,
            tcp_user_timeout_s=push_config.ucx_tcp_user_timeout_s,
        ):
            super().__init__(
                vllm_config,
                engine_id,
                kv_cache_config,
            )
        if affinity is not None:
            # vLLM pins this thread to the last core of each NUMA node on CPU hosts,
            # which puts P and D on one core; the launcher already chose ours.
            os.sched_setaffinity(0, affinity)
        if self._has_mamba:
            raise NotImplementedError(
                "push mode does not write Mamba/SSM state (docs/design.md, S-HYB-1): serve "
                "this model with vLLM's pull-mode NixlConnector, or on one engine"
            )
        self.push_config = push_config
        # Handshakes with different peers in parallel (vLLM runs them one at a time, so
        # one slow or dead peer delayed every other one); the NIXL call they end with
        # is serialized by add_remote_agent's lock.
        serial: ThreadPoolExecutor = self._handshake_initiation_executor  # type: ignore[has-type]
        self._handshake_initiation_executor = ThreadPoolExecutor(
            max_workers=push_config.push_handshake_threads,
            thread_name_prefix="vllm-nixl-handshake-initiator",
        )
        serial.shutdown(wait=False)
        self._add_agent_lock = threading.Lock()
        #: (engine id, host, port, tp size) -> (until, why): a failed handshake, not
        #: retried before ``until`` (keyed by what a request asked for: a request with
        #: a bad tp_size does not hold back the others)
        self._handshake_failed: dict[tuple[str, str, int, int], tuple[float, str]] = {}
        self.push_counters = PushCounters()
        self.xfer_stats = PushKVConnectorStats()
        self.pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self.layouts = KvLayouts(
            tp_rank=self.tp_rank,
            tp_size=self.world_size,
            pp_size=self.pp_size,
            producer=self.is_producer(),
            replicated_kv=self.use_mla,
            total_kv_heads=self.model_config.get_total_num_kv_heads(),
            backend_name=self.backend_name,
            kv_groups=compat.kv_groups(kv_cache_config),
        )
        # The PP stage vLLM's _nixl_handshake is querying (handshake thread).
        self._handshake_stage = threading.local()
        self.claims = LeaseClaims()
        self.leases = LeaseKeeper(self.claims, push_config.lease_overrun)
        self.queued_renewals = QueuedRenewals(push_config.push_registration_timeout_s)
        self.drops = NotifDrops(self.push_counters)
        #: the TCP user timeout this rank's NIXL agents use (the environment's, if set)
        self._tcp_user_timeout_s = tcp_user_timeout = compat.effective_tcp_user_timeout_s(
            push_config.ucx_tcp_user_timeout_s
        )
        if tcp_user_timeout <= 0:
            logger.warning(
                "push: the NIXL agents' UCX has no bounded TCP user timeout "
                "(ucx_tcp_user_timeout_s 0, or UCX_TCP_USER_TIMEOUT unbounded): a WRITE to a "
                "peer that is gone runs until the kernel gives up (about 15 minutes), a WRITE "
                "NIXL reports failed holds P's and D's blocks until the engine stops, and D "
                "never gives up a silent P (quarantined blocks held until it answers: "
                "N-REL-2, N-LIV-1). Set ucx_tcp_user_timeout_s (default 30) on P and D."
            )
        # D: every request in flight (its PushRecv).
        self._reply_tokens = ReplyTokens()
        self.recvs = RecvTable(
            self.push_counters,
            push_config.push_cancel_answer_timeout_s,
            push_config.push_quarantine_s,
            producer_lost_after_s(tcp_user_timeout),
            unrenewed_registration_hold_s(push_config, tcp_user_timeout),
        )
        #: this step runs no request (from the metadata; see get_finished)
        self._step_idle = False
        # P: announced this step, handed to the writer when the forward pass ends.
        self._push_prefill_done: dict[str, KvChunk | KvFinal] = {}
        # This step's answers for vLLM's get_finished (its _get_new_notifs and
        # _pop_done_transfers hooks): P requests done sending, D requests done recving.
        self._sent_now: set[str] = set()
        self._recved_now: set[str] = set()
        # P: announced requests vLLM preempted before their step's output was processed
        # (they may run again, unfinished, on vLLM 0.32), and those of them the writer
        # settled before the scheduler finished them (reported once it did).
        self._preempted_announced: set[str] = set()
        self._settled_unfinished: set[str] = set()
        self.writer = PushWriter(
            WriterContext(
                nixl=self.nixl_wrapper,
                memory_type=self.nixl_memory_type,
                identity=Identity(
                    engine_id=self.engine_id,
                    tp_rank=self.tp_rank,
                    tp_size=self.world_size,
                    host=envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
                    port=envs.VLLM_NIXL_SIDE_CHANNEL_PORT
                    + vllm_config.parallel_config.data_parallel_index,
                    block_size=self.block_size,
                ),
                config=push_config,
                counters=self.push_counters,
                peers=PeerAgents(self._handshake_lock, self._remote_agents, compat_nixl.agent_rank),
                layouts=self.layouts,
                claims=self.claims,
                drops=self.drops,
                request_handshake=_handshake_requester(self),
                forget_peer=_peer_forgetter(self),
            )
        )
        # P on a GPU: waits for each forward pass off the engine thread (kv_ready.py).
        self._kv_watcher: KvReadyWatcher | None = None
        rendezvous = self.writer.writes.rendezvous
        self.push_gauges = PushGauges({
            "push_writes_in_flight": self.claims.running_writes,
            "push_regs_pending": rendezvous.pending_count,
            "push_recvs_pending": self.recvs.__len__,
            "push_leases_held": lambda: len(self._reqs_to_send),
            "push_blocks_quarantined_now": self.recvs.quarantined_blocks,
        })  # fmt: skip

    # -- setup ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._stage_aware_handshake_targets()
        self.layouts.set_local(
            LocalKv(
                base_addrs=self.kv_caches_base_addr[self.engine_id][self.tp_rank],
                block_lens=self.block_len_per_layer,
                num_blocks=self.num_blocks,
                region_members=getattr(self, "region_members", []),  # patch 0002
                device_id=self.device_id,
                block_size=self.block_size,
                physical_per_logical=self._physical_blocks_per_logical_kv_block,
            )
        )
        self.writer.start()
        if self.is_producer() and self._kv_written_async():
            self._kv_watcher = KvReadyWatcher(self.writer.deliver_final)

    def is_producer(self) -> bool:
        kv = self.vllm_config.kv_transfer_config
        return kv is not None and kv.is_kv_producer

    def _kv_written_async(self) -> bool:
        """Whether the forward pass writes the KV asynchronously (a GPU without a host
        buffer): its end on the engine thread is not the KV being final."""
        return self.device_type == "cuda" and not self.use_host_buffer

    def remote_agents_of(self, engine_id: str) -> dict[int, str]:
        """Agent names of ``engine_id`` by rank (thread-safe snapshot)."""
        return self.writer.ctx.peers.of(engine_id)

    # -- engine step ------------------------------------------------------------------------
    def start_load_kv(self, metadata: PushConnectorMetadata) -> None:  # type: ignore[override]
        super().start_load_kv(metadata)
        self.leases.track(self._reqs_to_send, metadata.reqs_to_send)  # vLLM set them
        # Before anything of this step runs: its forward pass may write other requests'
        # KV into the blocks of these (S-SAFE-1).
        for rid in metadata.push_announced_preempted:
            self._stop_preempted(rid)
        for rid in [r for r in self._settled_unfinished if r in self._reqs_to_send]:
            self._settled_unfinished.discard(rid)  # finished now: report it sent
            self._report_sent(rid)
        now = time.monotonic()
        self._step_idle = metadata.push_step_idle
        # A previous step's announcement whose wait_for_save never came (its forward
        # pass failed): its KV is as complete as it will get; hand it over now.
        handed = self._hand_over_prefilled()
        for rid in metadata.push_prefill_stopped:
            # (after the chunks already handed over: one order per request)
            self._hand_to_writer(Stopped(rid))
            handed = True
        if metadata.push_live_started or metadata.push_live_ended:
            self.writer.set_live(
                LiveRequests(dict(metadata.push_live_started), frozenset(metadata.push_live_ended))
            )
            handed = True
        held_at = time.perf_counter()  # vLLM's lease clock, for queued_renewals
        for rid, fin in metadata.push_prefill_done.items():
            self.queued_renewals.hold(rid, fin.transfer_id, held_at, fin.secret)
            self._push_prefill_done[rid] = KvFinal(
                rid, fin.block_ids, fin.transfer_id, secret=fin.secret, whole=fin.whole,
                prompt=fin.prompt,
            )  # fmt: skip
            if self.push_config.push_prepare_at_announce:
                announced = Announced(
                    rid, fin.block_ids, fin.transfer_id, fin.secret, fin.prompt, fin.whole
                )
                if fin.streamed:
                    # After its chunks: on a GPU the last one may still wait for the
                    # device (async scheduling runs a step ahead of it); announced
                    # first, the request would be written whole (S-PRG-1).
                    self._hand_to_writer(announced)
                else:
                    self.writer.announce(announced)
                handed = True
        for rid, fin in metadata.push_chunks.items():  # handed over with the others
            self._push_prefill_done[rid] = KvChunk(
                rid, fin.block_ids, fin.kv_tokens, fin.transfer_id, fin.secret, fin.prompt
            )
        for rid, reg in metadata.push_registrations.items():
            local = [list(g) for g in reg.block_ids]
            self._recving_metadata[rid] = ReqMeta(
                local_block_ids=local,
                # (the same lists where a logical block is one kernel block: read only)
                local_physical_block_ids=self._push_kernel_block_ids(local),
                tp_size=reg.p_tp_size,
                remote=RemoteMeta(
                    block_ids=[],
                    host=reg.p_host,
                    port=reg.p_port,
                    engine_id=reg.p_engine_id,
                    request_id="",
                ),  # fmt: skip
                **compat_nixl.PUSH_REQ_META_EXTRA,
            )
            token = self._reply_tokens.take()  # S-WIR-3, this rank's for this request
            blocks = sum(map(len, reg.block_ids))
            self.recvs.register(rid, reg.p_engine_id, now, blocks, token)
            if rid in metadata.push_failed_recvs:  # bad kv_transfer_params
                if (failed := self.recvs.fail(rid, metadata.push_failed_recvs[rid])) is not None:
                    self._end_recv(failed)
                continue
            self.writer.send_registration(reg, token)
            handed = True
        for rid in metadata.push_cancelled | metadata.push_expired:
            expired = rid in metadata.push_expired
            if expired:
                self.push_counters.inc("push_watchdog_expired")
            cause = CancelCause.EXPIRED if expired else CancelCause.ABORTED
            if self.recvs.cancel(rid, cause, now) is not None:
                self.writer.cancel(rid)
                handed = True
        for rid, fin in metadata.push_finished_blocks.items():
            self.queued_renewals.hold(rid, fin.transfer_id, held_at, fin.secret)
            self.writer.add_finished(
                KvFinal(
                    rid, fin.block_ids, fin.transfer_id, fin.finished_at, fin.secret, fin.prompt
                )
            )
            handed = True
        if handed:
            self.writer.wake()

    def _stop_preempted(self, rid: str) -> None:
        """vLLM preempted an announced request in this step's schedule: its blocks may
        be another request's in this step's forward pass. No WRITE of it starts from now
        on (``LeaseClaims.preempt``: the writer fails it to D, PUSH_FAIL), and this
        thread does not let the pass run while one already posted may still read them:
        it waits until NIXL ended it (its bytes were read before the blocks changed)."""
        self._preempted_announced.add(rid)
        if not self.claims.preempt(rid):
            return
        started = reported = time.monotonic()
        while self.claims.writing(rid) and self.writer.alive:
            self.writer.hand_over(PREEMPTED_WRITE_POLL_S)  # the writer polls NIXL
            now = time.monotonic()
            if now - reported >= PREEMPTED_WRITE_REPORT_S:
                reported = now
                logger.error(
                    "push: %s was preempted while NIXL runs its WRITE; the engine waits "
                    "for it (%.0fs so far): its blocks go to another request in this step",
                    rid, now - started,
                )  # fmt: skip
        if self.claims.writing(rid):  # (only at shutdown: the writer thread is gone)
            logger.error("push: %s: the writer stopped with a WRITE of it running", rid)

    def wait_for_save(self) -> None:
        """P: the forward pass of this step is done; the KV of the requests whose
        prompt it completed is final. Hand them to the writer now, and let it post
        their WRITEs before this thread goes on (``PushWriter.hand_over``)."""
        if self._hand_over_prefilled():
            self.writer.hand_over(self.push_config.push_handover_wait_ms / 1e3)

    def _hand_over_prefilled(self) -> bool:
        """Hand the requests whose prompt (or, push_progressive, a prompt chunk) this
        step's pass completed to the writer (True), or, where the device still runs the
        pass, to the KV-ready watcher, which hands them on once their KV is final
        (False: nothing for the writer yet)."""
        if not self._push_prefill_done:
            return False
        now, ready = time.monotonic(), self._kv_written_marker()
        for fin in self._push_prefill_done.values():
            self._hand_to_writer(dataclasses.replace(fin, finished_at=now, ready=ready))
        self._push_prefill_done.clear()
        return self._kv_watcher is None

    def _hand_to_writer(self, fin: HandOver) -> None:
        """To the writer, through the KV-ready watcher where there is one: a request's
        hand-overs reach the writer in the order they were made."""
        if self._kv_watcher is not None:
            self.claims.hand(fin.request_id)  # its lease must hold meanwhile
            self._kv_watcher.put(fin)
        else:
            self.writer.add_finished(fin)

    def _kv_written_marker(self) -> Any:
        """What must complete before the KV this step wrote is readable: nothing where
        kernels ran synchronously (CPU); an event on the current stream on CUDA."""
        if self._kv_written_async():
            event = torch.cuda.Event()
            event.record()
            return event
        return None

    def _push_before_finished(self) -> None:
        """vLLM's ``get_finished`` (``get_transfer_results`` on 0.32) is about to collect
        this step's results: take what the writer reported so far. D never waits here
        for the writer or for a WRITE (S-WRT-2): the writer reads notifications on its
        own while completions are awaited, and what it has not read yet is taken by the
        next step. (``push_recv_idle_wait_ms``, off by default, opts into a bounded
        wait in steps that run no request.)"""
        cfg = self.push_config
        if self._step_idle and cfg.push_recv_idle_wait_ms > 0 and len(self.recvs):
            # Nothing runs in this step: wait here rather than in the engine's loop of
            # empty steps; for a completion (the writer reads every 50 us meanwhile)
            # only while some KV may arrive: a quarantined request's answer is read at
            # the writer's own pace.
            wait_s = cfg.push_recv_idle_wait_ms / 1e3
            if self.recvs.awaiting_kv():
                self.writer.await_notifs(wait_s)
            else:
                self.writer.hand_over(0.0)
                time.sleep(wait_s)
        now = time.monotonic()
        if self._handshake_failed:  # forget back-offs that ended (a bounded table)
            for key in [k for k, (until, _) in self._handshake_failed.items() if until <= now]:
                self._handshake_failed.pop(key, None)
        self._drain_writer(now)
        # A producer that does not answer a PUSH_CANCEL keeps the request's blocks until
        # it answers (asked again each answer period) or is known gone (S-SAFE-1).
        for recv in self.recvs.check_deadlines(now, self.writer.cancel_again, self._agents_now):
            self._end_recv(recv)
        for recv in self.recvs.drain_fail_now():
            self._fail_quarantined(recv)
        self._hold_leases()

    def _push_after_finished(self, done_sending: set[str], done_recving: set[str]) -> None:
        """vLLM reports these requests done this step (it frees their blocks)."""
        for rid in done_sending | done_recving:
            self._preempted_announced.discard(rid)
            self._settled_unfinished.discard(rid)
            self.leases.forget(rid)
            self.queued_renewals.forget(rid)
            self.writer.evict(rid)
        self.writer.wake()  # read inbound notifications at least once per step

    def _drain_writer(self, now: float) -> None:
        """Everything the writer reported since the last step, in order."""
        outbox = self.writer.outbox
        while True:
            try:
                msg = outbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, Inbound):
                self._on_inbound(msg, now)
            elif isinstance(msg, Settled):
                self._on_settled(msg)
            elif isinstance(msg, ProducersUnreachable):
                self.recvs.producers_unreachable(msg.agents, msg.at, msg.why)
            elif (recv := self.recvs.on_writer(msg, now)) is not None:
                self._end_recv(recv)

    def _on_inbound(self, msg: Inbound, now: float) -> None:
        n = msg.notif
        if isinstance(n, Heartbeat):  # vLLM's lease heartbeat from a pull-mode D
            self._handle_heartbeat(n.payload)
        elif isinstance(n, PushHeartbeat) or n.request_id in self.recvs:
            for recv in self.recvs.on_notif(msg.sender, n, now):
                self._end_recv(recv)
        elif isinstance(n, Completion):
            self._on_pull_completion(n, msg.sender)
        # else: a PUSH_FAIL for a request this rank does not know (anymore): ignored

    def _handle_heartbeat(self, payload: str) -> None:
        """P: vLLM's lease heartbeat from a D names P request ids (a pull-mode D leg),
        or the transfer ids of push D legs waiting on D for blocks (S-TMO-2)."""
        super()._handle_heartbeat(payload)
        renewed, refused = self.queued_renewals.renew(
            self._reqs_to_send, payload.split(","), time.perf_counter(), self._lease_extension
        )
        if renewed:
            self.push_counters.inc("push_leases_renewed_queued", len(renewed))
        if refused:  # a transfer id with a secret, named without its proof
            self.push_counters.inc("push_notifs_forged", refused)

    def _on_settled(self, msg: Settled) -> None:
        """P: no WRITE reads the request's blocks any more: report it sent (vLLM frees them)."""
        rid = msg.request_id
        for _ in range(msg.failed_writes):
            self.xfer_stats.record_failed_transfer()  # S-FAIL-3
        if rid in self._preempted_announced and rid not in self._reqs_to_send:
            # Preempted after it was announced: vLLM may run it again (0.32); it may be
            # reported sent only once the scheduler finished it (reqs_to_send).
            self._settled_unfinished.add(rid)
        elif rid in self._reqs_to_send or rid in self._reqs_to_process:
            self._report_sent(rid)

    def _report_sent(self, rid: str) -> None:
        self._reqs_to_send.pop(rid, None)
        self._reqs_to_process.discard(rid)
        self._sent_now.add(rid)

    def _on_pull_completion(self, n: Completion, sender: str) -> None:
        """P: a pull-mode D read our blocks; one notification per consumer rank."""
        rid = n.request_id
        if rid not in self._reqs_to_send and rid not in self._reqs_to_process:
            self.drops.drop(sender, Malformed("unknown_request", f"completion for {rid!r}"))
            return
        assert self.transfer_topo is not None
        per_producer = compat_nixl.pull_consumers_expected(
            n.tp_size, self.transfer_topo.tp_ratio, self.world_size
        )
        self.consumer_notification_counts_by_req[rid] += 1
        if self.consumer_notification_counts_by_req[rid] >= per_producer:
            del self.consumer_notification_counts_by_req[rid]
            if not self.claims.reap(rid):
                # A push WRITE may read the blocks (S-SAFE-1): whoever sent this (any
                # agent can name a P request id), they stay until the writer settles.
                self.push_counters.inc("push_notifs_foreign")
                logger.warning(
                    "push: a completion for %s from agent %s dropped: a push WRITE may "
                    "read its blocks", rid, sender,
                )  # fmt: skip
                return
            self._reqs_to_process.discard(rid)
            self._reqs_to_send.pop(rid, None)
            self._sent_now.add(rid)

    def _agents_now(self, engine_id: str) -> frozenset[str] | None:
        """The agents ``engine_id`` has now (None: not connected)."""
        agents = self.remote_agents_of(engine_id)
        return frozenset(agents.values()) if agents else None

    def _fail_quarantined(self, recv: PushRecv) -> None:
        """D: vLLM still waits for ``recv``, whose producers have not answered by D's
        deadline: fail it in vLLM now (its blocks reported invalid; vLLM applies its
        ``kv_load_failure_policy`` and, as the request has not been reported received,
        keeps its blocks) and report it received only when the quarantine ends."""
        rid = recv.request_id
        if compat_nixl.report_blocks_invalid(self, rid):
            recv.failed_in_vllm = True
            self._log_failure("push_recv_failed", rid, msg="producers silent past D's "
                              "deadline; its blocks stay held (quarantined)")  # fmt: skip

    def _end_recv(self, recv: PushRecv) -> None:
        """D: ``recv`` reached a final state: report it to vLLM, exactly once."""
        rid = recv.request_id
        if recv.failed_in_vllm:  # failed at D's deadline already: now its blocks go
            self._push_drop_recv(rid)
            return
        if recv.state is RecvState.FAILED:
            self._log_failure("push_recv_failed", rid, msg=recv.failure or "failed")
            self._push_fail_recv(rid)  # blocks invalid; reported as recved
            return
        if not compat_nixl.engine_known(self, recv.p_engine_id):
            # Ended before P ever connected (aborted while its handshake failed): vLLM's
            # post-processing of a received request would look P up and raise. Nothing
            # was written; report it the way vLLM skips that.
            self._push_drop_recv(rid)
            return
        if recv.state is RecvState.DONE:
            self.push_counters.observe(
                "push_recv_wait_seconds", time.monotonic() - recv.registered_at
            )
        self._recved_now.add(rid)

    def _hold_leases(self) -> None:
        """P: vLLM reaps a finished request's blocks when its lease ends; never while
        a WRITE may still read them (``LeaseClaims``), and not past the lease plus
        ``lease_overrun`` unless NIXL still runs a WRITE on them: the blocks are freed
        then even if the writer has not settled the request (logged as an error).
        leases.py decides; this does vLLM's bookkeeping of a reaped lease."""
        # vLLM's lease clock is time.perf_counter (CLOCK_MONOTONIC, like monotonic()).
        ended, capped, pinned = self.leases.decide(self._reqs_to_send, time.perf_counter())
        for rid in capped:
            self.push_counters.inc("push_failed_lease_cap")
            logger.error(
                "push: %s: the writer has not settled it %gs past its lease (no WRITE "
                "of it runs); freeing its blocks", rid, self.push_config.lease_overrun,
            )  # fmt: skip
        for rid in pinned:
            self.push_counters.inc("push_lease_cap_pinned")
            logger.error(
                "push: %s: NIXL still runs a WRITE reading its blocks %gs past its lease; "
                "they stay held until NIXL ends it (S-SAFE-1)",
                rid, self.push_config.lease_overrun,
            )  # fmt: skip
        for rid in (*ended, *capped):
            count = self.consumer_notification_counts_by_req.pop(rid, 0)
            self.xfer_stats.record_kv_expired_req()
            logger.warning(
                "Releasing expired KV blocks for request %s which were retrieved by %d "
                "remote worker(s) before lease expired.", rid, count,
            )  # fmt: skip
            self._reqs_to_process.discard(rid)
            self._sent_now.add(rid)

    def _push_first_lease_expiry(self) -> float | None:
        """The earliest expiry (``time.perf_counter``) of the leases the keeper knows,
        every one of ``_reqs_to_send`` (None: there is none)."""
        return self.leases.next_expiry()

    def _push_done_sending(self) -> set[str]:
        """vLLM's ``_get_new_notifs`` (via compat_nixl): P requests done sending.

        NIXL notifications are read by the writer thread only; ``_drain_writer``
        consumed what it handed over."""
        done, self._sent_now = self._sent_now, set()
        return done

    def _push_done_recving(self) -> set[str]:
        """Added to vLLM's ``_pop_done_transfers`` (via compat_nixl): D requests done
        receiving."""
        done, self._recved_now = self._recved_now, set()
        return done

    # -- worker -> scheduler ----------------------------------------------------------------
    def build_connector_worker_meta(self) -> PushWorkerMeta | None:
        """D: the requests whose watchdog a producer renewed in this step (PUSH_HB)."""
        renewed = self.recvs.drain_renewed()
        return PushWorkerMeta(renewed) if renewed else None

    # -- handshakes and layouts (vLLM's handshake thread) ----------------------------------------
    def add_remote_agent(
        self,
        nixl_agent_meta: Any,
        remote_tp_rank: int = 0,
        remote_tp_size: int = 1,
        *_: Any,
    ) -> str:
        """Handshake thread: connect the peer and record its layout (no READ lists)."""
        with self._add_agent_lock:  # handshakes run in parallel; NIXL's call must not
            return self._add_remote_agent(nixl_agent_meta, remote_tp_rank, remote_tp_size)

    def _add_remote_agent(
        self, nixl_agent_meta: Any, remote_tp_rank: int, remote_tp_size: int
    ) -> str:
        engine_id = nixl_agent_meta.engine_id
        if (known := self._push_remote_agent(engine_id, remote_tp_rank)) is not None:
            return known
        mine = self.host_buffer_kv_cache_layout if self.use_host_buffer else self.kv_cache_layout
        theirs = getattr(nixl_agent_meta, "kv_cache_layout", None)
        if theirs and mine and theirs != mine:  # the same bytes would mean other positions
            raise RuntimeError(
                f"push: {engine_id} lays its KV blocks out as {theirs}, this engine as {mine}; "
                "use the same KV cache layout on P and D (VLLM_KV_CACHE_LAYOUT, attention "
                "backend)"
            )
        topo = self.transfer_topo
        assert topo is not None
        remote = self.layouts.connect(
            nixl_agent_meta, remote_tp_rank, remote_tp_size, compat_nixl.virtually_split_kv(topo)
        )
        topo.register_remote_engine(
            engine_id,
            EngineTransferInfo(
                remote_tp_size=remote_tp_size,
                remote_block_size=nixl_agent_meta.block_size,
                remote_block_len=nixl_agent_meta.block_lens[0],
                remote_physical_blocks_per_logical=remote.physical_per_logical,
                remote_pp_rank=producer_stage(remote_tp_rank, remote_tp_size)[0],
            ),
        )
        name = self.nixl_wrapper.add_remote_agent(nixl_agent_meta.agent_metadata)
        self.dst_num_blocks.setdefault(engine_id, nixl_agent_meta.num_blocks)
        self.kv_caches_base_addr[engine_id][remote_tp_rank] = list(remote.base_addrs)
        return name

    def _push_request_handshake(self, engine_id: str, host: str, port: int, tp_size: int) -> Any:
        """vLLM's non-blocking handshake, except with a peer whose handshake failed less
        than ``push_handshake_backoff_s`` ago: that fails at once (a dead peer costs
        one handshake timeout, not one per request)."""
        key = (engine_id, host, port, tp_size)
        failed = self._handshake_failed.get(key)
        if failed is not None:
            until, why = failed
            if time.monotonic() < until:
                self.push_counters.inc("push_handshakes_backed_off")
                fut: Future[Any] = Future()
                fut.set_exception(
                    RuntimeError(f"handshake with {engine_id} failed recently ({why}); "
                                 f"retried in {until - time.monotonic():.1f}s")
                )  # fmt: skip
                return fut
            self._handshake_failed.pop(key, None)
        fut = super()._push_request_handshake(engine_id, host, port, tp_size)
        if fut is not None and self.push_config.push_handshake_backoff_s > 0:
            fut.add_done_callback(functools.partial(self._note_handshake, key))
        return fut

    def _note_handshake(self, key: tuple[str, str, int, int], fut: Future[Any]) -> None:
        """Handshake thread: remember a failure for the back-off."""
        error = fut.exception()
        if error is not None:
            until = time.monotonic() + self.push_config.push_handshake_backoff_s
            self._handshake_failed[key] = (until, f"{type(error).__name__}: {error}")

    def forget_peer(self, engine_id: str, why: str, remove: bool = False) -> bool:
        """Any thread: drop ``engine_id``'s agents and layouts, so that the next request
        handshakes with it again (S-FLT-1). vLLM keys a peer by engine id and never
        handshakes twice, but a restarted engine keeps its id and gets a new NIXL agent.
        With ``remove`` its agents are also removed from NIXL (the connection is torn
        down: nothing it posts lands afterwards, and nothing of ours reaches it);
        otherwise they stay loaded (they may still have transfers in flight)."""
        with self._handshake_lock:
            agents = self._remote_agents.pop(engine_id, None)
            if agents is None:
                return False
            self.kv_caches_base_addr.pop(engine_id, None)
            self.dst_num_blocks.pop(engine_id, None)
            compat_nixl.forget_remote_engine(self, engine_id)
        self.layouts.forget(engine_id)
        self.push_counters.inc("push_peers_forgotten")
        if remove:
            self._remove_from_nixl(agents.values())
        logger.warning(
            "push: forgot %s (agents %s%s): %s; the next request handshakes with it again",
            engine_id, sorted(agent_name(a) for a in agents.values()),
            ", removed from NIXL" if remove else "", why,
        )  # fmt: skip
        return True

    def _remove_from_nixl(self, agents: Iterable[Any]) -> frozenset[str]:
        """``remove_remote_agent`` each agent; the names of those NIXL removed."""
        removed = set()
        for agent in agents:
            try:
                self.nixl_wrapper.remove_remote_agent(agent)
            except Exception as e:
                if "notfound" not in type(e).__name__.lower():  # else: out of NIXL already
                    logger.error(
                        "push: removing agent %s from NIXL failed: %s", agent_name(agent), e
                    )
                    continue
            removed.add(agent_name(agent))
            self.push_counters.inc("push_agents_removed")
        return frozenset(removed)

    def forget_agents(self, agents: Iterable[str], why: str) -> None:
        """Forget the engines these agent names belong to (see :meth:`forget_peer`)."""
        wanted = set(agents)
        with self._handshake_lock:
            engines = [
                e for e, by_rank in self._remote_agents.items()
                if wanted & {agent_name(a) for a in by_rank.values()}
            ]  # fmt: skip
        for engine_id in engines:
            self.forget_peer(engine_id, why)

    def _stage_aware_handshake_targets(self) -> None:
        """Let vLLM's ``_nixl_handshake`` query one PP stage of a producer at a time.

        A push producer's side channel serves stage ``s`` rank ``r`` as rank
        ``s * tp_size + r`` (``members.producer_rank``). vLLM's handshake asks for
        the ranks ``transfer_topo.handshake_target_ranks`` names; while
        :meth:`_nixl_handshake` queries stage ``s`` (a thread-local of the
        handshake thread) they are offset into that stage.
        """
        topo = self.transfer_topo
        assert topo is not None
        targets = topo.handshake_target_ranks
        local = self._handshake_stage

        def stage_targets(remote_tp_size: int, *rest: Any) -> list[int]:
            offset = getattr(local, "stage", 0) * remote_tp_size
            return [offset + r for r in targets(remote_tp_size, *rest)]

        topo.handshake_target_ranks = stage_targets  # type: ignore[method-assign]

    def _push_handshake(
        self, host: str, port: int, remote_tp_size: int, expected_engine_id: str
    ) -> dict[int, str]:
        """D: connect every pipeline stage of the producer (agents by side-channel rank).

        D learns P's stages from P itself, not from the request: it walks stage
        0, 1, ... until the stages together advertise every layer D holds. A D
        leg's ``pp_size`` is checked against that (``layouts.stage_mismatch``), so
        a wrong one fails only its own request. Without member metadata on either
        side there is one stage, as before.
        """
        announced = self._push_peer_layout(host, port, remote_tp_size, expected_engine_id)
        if self.kv_transfer_config.is_kv_producer:
            connected = self._push_query_stage(host, port, remote_tp_size, expected_engine_id)
            self.layouts.announce(announced)
            return connected
        missing = set(self.layouts.local_members)
        seen: set[str] = set()
        agents: dict[int, str] = {}
        stage = 0
        while True:
            self._handshake_stage.stage = stage
            try:
                got = self._push_query_stage(host, port, remote_tp_size, expected_engine_id)
            except Exception as e:
                if stage == 0:
                    raise
                raise RuntimeError(
                    f"push: P {expected_engine_id}'s pipeline stages 0..{stage - 1} hold no KV "
                    f"for {sorted(missing, key=natural_key)[:4]}, and stage {stage} did not "
                    f"answer the handshake: {e}"
                ) from e
            finally:
                self._handshake_stage.stage = 0
            agents.update(got)
            held = set().union(*(self.layouts.members_of(expected_engine_id, r) for r in got))
            if held & seen:
                raise RuntimeError(
                    f"push: stage {stage} of P {expected_engine_id} holds layers an earlier "
                    f"stage holds too: {sorted(held & seen, key=natural_key)[:4]}"
                )
            seen |= held
            missing -= held
            if not held or not missing:
                self.layouts.announce(announced)
                return agents
            stage += 1

    def _push_peer_layout(
        self, host: str, port: int, claimed_tp_size: int, expected_engine_id: str
    ) -> PeerLayout:
        """Handshake thread: the peer's layout from its side channel (S-LEG-5), checked
        against the TP size the request claims (a D leg's ``tp_size``, a PUSH_REG's)
        before any of its ranks is connected: a wrong claim fails its request and
        leaves nothing behind that a later request would reuse."""
        if expected_engine_id == self.engine_id:
            raise RuntimeError(
                f"push: a D leg names this engine ({self.engine_id}, a "
                f"{self.kv_transfer_config.kv_role}) as its P: the router sent it the "
                "decode leg (are the proxy's --prefill and --decode URLs swapped?)"
            )
        announced = compat_nixl.query_peer_layout(self, host, port)
        role = "P" if self.kv_transfer_config.is_kv_consumer else "D"
        if announced.engine_id != expected_engine_id:
            raise RuntimeError(
                f"push: {host}:{port} is engine {announced.engine_id!r}, not "
                f"{role} {expected_engine_id!r}"
            )
        mine, theirs = self._tcp_user_timeout_s, announced.tcp_user_timeout_s
        if role == "P" and mine > 0 and not 0 < theirs <= mine:
            # N-LIV-1: D gives up a silent P 2 x its own T after its send failed; that is
            # safe only if P's WRITEs end (and stop landing, N-REL-2) within P's T <= D's.
            raise RuntimeError(
                f"push: P {expected_engine_id}'s NIXL agents give up a dead TCP connection "
                f"after {_timeout_text(theirs)}, this engine's after {_timeout_text(mine)}: "
                "D would count a silent P gone while P's failed WRITEs may still land "
                "(N-LIV-1, N-REL-2). Set the same ucx_tcp_user_timeout_s (or "
                "UCX_TCP_USER_TIMEOUT) on P and D"
            )
        my_host = self.writer.ctx.identity.host
        if role == "P" and not peer_hosts_allow(announced.peer_hosts, my_host):
            # P refuses to connect to a D host outside its push_peer_hosts: the request
            # would wait for its watchdog; fail it now, naming both.
            raise RuntimeError(
                f"push: P {expected_engine_id} connects only to D hosts among its "
                f"push_peer_hosts {list(announced.peer_hosts)}, and this engine names "
                f"itself {my_host!r} (VLLM_NIXL_SIDE_CHANNEL_HOST) in its registrations: P "
                "would never connect back. Add this host to P's push_peer_hosts, or set "
                "VLLM_NIXL_SIDE_CHANNEL_HOST to an address among them"
            )
        if getattr(self, "enforce_compat_hash", True):  # vLLM's enforce_handshake_compat
            peer = f"{role} {expected_engine_id}"
            problem = identity_mismatch(
                compat_nixl.push_model_identity(self), dict(announced.model), peer
            )
            if problem is not None:  # S-LEG-6: its KV is not what this engine computes
                raise RuntimeError(problem)
        if announced.tp_size != claimed_tp_size:
            whose = "the D leg's kv_transfer_params say" if role == "P" else "its PUSH_REG says"
            hint = " (tell the proxy P's TP size: --p-tp-size)" if role == "P" else ""
            raise RuntimeError(
                f"push: {whose} tp_size={claimed_tp_size}, but {role} {expected_engine_id} "
                f"announces tensor parallel size {announced.tp_size}{hint}"
            )
        return announced

    # -- stats and shutdown -------------------------------------------------------------------
    def get_kv_connector_stats(self) -> PushKVConnectorStats | None:  # type: ignore[override]
        assert isinstance(self.xfer_stats, PushKVConnectorStats)
        self.xfer_stats.merge(self.push_counters.drain())
        self.xfer_stats.merge(self.push_gauges.drain())
        if self.xfer_stats.is_empty():
            return None
        return self.xfer_stats.clone_and_reset()  # type: ignore[return-value]

    def shutdown(self) -> None:
        if getattr(self, "_kv_watcher", None) is not None:
            self._kv_watcher.stop()  # type: ignore[union-attr]
        if hasattr(self, "writer"):
            self.writer.stop()
        super().shutdown()

    def debug_state(self) -> dict[str, Any]:
        """Sizes of every push table (tests assert they drain to zero)."""
        return {
            "recvs": len(self.recvs),
            "claims": len(self.claims),
            "leases": len(self.leases),
            "queued_renewals": len(self.queued_renewals),
            "recving_metadata": len(self._recving_metadata),
            "reqs_to_send": len(self._reqs_to_send),
            "reqs_to_process": len(self._reqs_to_process),
            "prefill_done": len(self._push_prefill_done),
            "answers_pending": len(self._sent_now) + len(self._recved_now),
            "writer_idle": self.writer.idle(),
        }


def _timeout_text(seconds: float) -> str:
    return f"{seconds:g}s" if seconds > 0 else "an unbounded time (UCX's default, about 15 min)"
