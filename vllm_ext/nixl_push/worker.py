# SPDX-License-Identifier: Apache-2.0
"""Worker side of push: the engine-thread half (the other half is writer.py).

Runs on the engine thread of each TP rank:

* ``start_load_kv`` hands the step's push work to the writer (registrations on
  D, finished blocks on P) and wakes it only when there is some.
* ``wait_for_save`` (P), at the end of the step's forward pass, hands over the
  blocks of requests whose prompt that pass completed (``push_prefill_done``):
  their KV is final, so the WRITE need not wait for the next engine step.
  ``start_load_kv`` announced them before the pass, so the writer has prepared
  those WRITEs meanwhile and only posts them now.
* ``get_finished`` turns what the writer reported into vLLM's
  ``(finished_sending, finished_recving)``: P requests whose WRITEs are done,
  D requests whose completions arrived from every producer rank (or that failed).
  While D awaits completions it first lets the writer read notifications
  (``PushWriter.hand_over``), so a completion is reported in the step it arrived;
  in a step that runs nothing it waits a little for one (``PushWriter.await_notifs``).
* Layouts and handshakes (``add_remote_agent``, PP stages) come from
  ``PushLayoutsMixin`` (layouts.py).

vLLM's base worker keeps doing everything else: KV registration, the
handshake listener and initiator, lease reaping, heartbeats, post-processing
and failure accounting (``_handle_failed_transfer``).
"""

from __future__ import annotations

import os
import queue
import time
from collections import defaultdict
from typing import Any

import torch
from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta, ReqMeta
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker import NixlConnectorWorker

from vllm_ext import compat
from vllm_ext.log import get_logger
from vllm_ext.nixl_push.config import PushConfig
from vllm_ext.nixl_push.descriptors import (
    Desc,
    DescriptorError,
    build_write_descs,
    d_ranks_for,
    expand_logical,
    pair_blocks,
    tp_slice,
)
from vllm_ext.nixl_push.kv_ready import KvReadyWatcher
from vllm_ext.nixl_push.layouts import PushLayoutsMixin
from vllm_ext.nixl_push.matching import FinishedBlocks
from vllm_ext.nixl_push.metadata import PushConnectorMetadata, PushRegMeta
from vllm_ext.nixl_push.stats import PushCounters, PushKVConnectorStats
from vllm_ext.nixl_push.wire import CANCELLED as CANCELLED_REASON
from vllm_ext.nixl_push.wire import (
    Completion,
    Heartbeat,
    Malformed,
    PushFailed,
    PushRegistration,
)
from vllm_ext.nixl_push.writer import CANCELLED, RECV_FAILED, SEND_FAILED, PushWriter
from vllm_ext.nixl_push.writes import SENT, WRITE_FAILED

logger = get_logger(__name__)

#: At most one malformed-notification warning per this many seconds (S-WIR-2).
_MALFORMED_LOG_INTERVAL_S = 10.0


class NixlPushConnectorWorker(PushLayoutsMixin, NixlConnectorWorker):
    def __init__(self, vllm_config, engine_id, kv_cache_config, push_config: PushConfig) -> None:  # type: ignore[no-untyped-def]
        affinity = os.sched_getaffinity(0) if push_config.keep_cpu_affinity else None
        with compat.tuned_nixl_agents(
            push_config.nixl_progress_delay_us, push_config.ucx_use_mt_mutex
        ):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        if affinity is not None:
            # vLLM pins this thread to the last core of each NUMA node on CPU hosts,
            # which puts P and D on one core; the launcher already chose ours.
            os.sched_setaffinity(0, affinity)
        if self._has_mamba:
            raise NotImplementedError("push mode does not support Mamba/SSM models yet")
        self.push_config = push_config
        self.push_counters = PushCounters()
        self.xfer_stats = PushKVConnectorStats()
        self.side_channel_host = envs.VLLM_NIXL_SIDE_CHANNEL_HOST
        self.side_channel_port = (
            envs.VLLM_NIXL_SIDE_CHANNEL_PORT + vllm_config.parallel_config.data_parallel_index
        )
        self._init_layouts(vllm_config)
        # D: completions still expected per request (one per producer rank).
        self._push_expected: dict[str, int] = {}
        #: this step runs no request (from the metadata; see get_finished)
        self._step_idle = False
        # D: why a request failed, while other producer ranks may still write into it.
        self._push_failed_reasons: dict[str, str] = {}
        # D: requests cancelled (aborted, or watchdog expired) waiting for P's answers.
        self._push_cancel_deadlines: dict[str, float] = {}
        self._push_expiring: set[str] = set()
        self._push_aborted: set[str] = set()
        self._push_stood_down: set[str] = set()
        self._push_done_recving: set[str] = set()
        self._push_sent: set[str] = set()
        # D: when each registration went to the writer (push_recv_wait_seconds).
        self._push_registered_at: dict[str, float] = {}
        # P: announced this step, handed to the writer when the forward pass ends.
        self._push_prefill_done: dict[str, FinishedBlocks] = {}
        self._malformed_counts: dict[str, int] = defaultdict(int)
        self._malformed_logged_at = 0.0
        self.writer = PushWriter(self)
        # P on a GPU: waits for each forward pass off the engine thread (kv_ready.py).
        self._kv_watcher: KvReadyWatcher | None = None

    # -- setup ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._init_local_layout()
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
        with self._handshake_lock:
            return dict(self._remote_agents.get(engine_id, {}))

    # -- writer helpers (called on the writer thread) --------------------------------------
    def make_registration(self, meta: PushRegMeta) -> PushRegistration:
        return PushRegistration(
            engine_id=self.engine_id,
            request_id=meta.request_id,
            transfer_id=meta.transfer_id,
            block_ids=meta.block_ids,
            tp_rank=self.tp_rank,
            tp_size=self.world_size,
            host=self.side_channel_host,
            port=self.side_channel_port,
            block_size=self.block_size,
            prefix_tokens=meta.prefix_tokens,
            timeout_s=self.push_config.push_registration_timeout,
        )

    def push_descriptors(
        self, fin: FinishedBlocks, reg: PushRegistration
    ) -> tuple[list[Desc], list[Desc]]:
        """Source and destination descriptors for writing ``fin`` into ``reg``'s blocks."""
        local = self.local_layout
        remote = self._remote_layouts[(reg.engine_id, reg.tp_rank)]
        assert local is not None
        if reg.block_size != local.block_size:
            raise DescriptorError(
                f"D's physical block is {reg.block_size} tokens, P's {local.block_size}"
            )
        if len(reg.block_ids) != len(fin.block_ids) and reg.num_blocks:
            raise DescriptorError(
                f"D sent {len(reg.block_ids)} KV cache groups, P has {len(fin.block_ids)}"
            )
        src: list[int] = []
        dst: list[int] = []
        for p_group, d_group in zip(fin.block_ids, reg.block_ids):
            s, d = pair_blocks(
                expand_logical(p_group, local.physical_per_logical),
                expand_logical(d_group, remote.physical_per_logical),
                reg.prefix_tokens,
                local.block_size,
            )
            src += s
            dst += d
        replicated = self.use_mla or max(self.world_size, reg.tp_size) > (
            self.model_config.get_total_num_kv_heads()
        )
        tp = tp_slice(self.tp_rank, self.world_size, reg.tp_rank, reg.tp_size, replicated)
        return build_write_descs(local, remote, src, dst, tp)

    def log_malformed(self, sender: str, n: Malformed) -> None:
        """Count a dropped notification; warn at most every few seconds (S-WIR-2)."""
        self._malformed_counts[n.reason] += 1
        now = time.monotonic()
        if now - self._malformed_logged_at >= _MALFORMED_LOG_INTERVAL_S:
            self._malformed_logged_at = now
            logger.warning(
                "push: dropped malformed notification from %s (%s: %s); totals %s",
                sender, n.reason, n.detail, dict(self._malformed_counts),
            )  # fmt: skip

    # -- engine step ------------------------------------------------------------------------
    def start_load_kv(self, metadata: PushConnectorMetadata) -> None:  # type: ignore[override]
        super().start_load_kv(metadata)
        self._step_idle = metadata.push_step_idle
        # A previous step's announcement whose wait_for_save never came (its forward
        # pass failed): its KV is as complete as it will get; hand it over now.
        handed = self._hand_over_prefilled()
        for rid, fin in metadata.push_prefill_done.items():
            self._push_prefill_done[rid] = FinishedBlocks(rid, fin.block_ids, fin.transfer_id)
            if self.push_config.push_prepare_at_announce:
                self.writer.announce(
                    FinishedBlocks(rid, fin.block_ids, fin.transfer_id, final=False)
                )
                handed = True
        for rid, reg in metadata.push_registrations.items():
            self._recving_metadata[rid] = ReqMeta(
                local_block_ids=[list(g) for g in reg.block_ids],
                local_physical_block_ids=self._logical_to_kernel_block_ids(
                    [list(g) for g in reg.block_ids]
                ),
                tp_size=reg.p_tp_size,
                remote=RemoteMeta(
                    block_ids=[],
                    host=reg.p_host,
                    port=reg.p_port,
                    engine_id=reg.p_engine_id,
                    request_id="",
                ),  # fmt: skip
            )
            if rid in metadata.push_failed_recvs:
                continue
            # One completion from every producer rank (PP stage x TP rank) writing here.
            self._push_expected[rid] = reg.p_pp_size * sum(
                self.tp_rank in d_ranks_for(p, reg.p_tp_size, self.world_size)
                for p in range(reg.p_tp_size)
            )
            self.writer.send_registration(reg)
            self._push_registered_at[rid] = time.monotonic()
            handed = True
        for rid, reason in metadata.push_failed_recvs.items():
            self._fail_recv(rid, reason)
        for rid in metadata.push_cancelled | metadata.push_expired:
            expired = rid in metadata.push_expired
            if expired:
                self.push_counters.inc("push_watchdog_expired")
            handed |= self._cancel(rid, expired=expired)
        for rid, fin in metadata.push_finished_blocks.items():
            self.writer.add_finished(
                FinishedBlocks(rid, fin.block_ids, fin.transfer_id, fin.finished_at)
            )
            handed = True
        if handed:
            self.writer.wake()

    def wait_for_save(self) -> None:
        """P: the forward pass of this step is done; the KV of the requests whose
        prompt it completed is final. Hand them to the writer now, and let it post
        their WRITEs before this thread goes on (``PushWriter.hand_over``)."""
        if self._hand_over_prefilled():
            self.writer.hand_over(self.push_config.push_handover_wait_ms / 1e3)

    def _hand_over_prefilled(self) -> bool:
        """Hand the requests whose prompt this step's pass completed to the writer
        (True), or, where the device still runs the pass, to the KV-ready watcher,
        which hands them on once their KV is final (False: nothing for the writer yet)."""
        if not self._push_prefill_done:
            return False
        now, ready = time.monotonic(), self._kv_written_marker()
        watcher = self._kv_watcher
        for fin in self._push_prefill_done.values():
            fin.finished_at, fin.ready = now, ready
            if watcher is not None:
                self.writer.mark_busy(fin.request_id)  # its lease must hold meanwhile
                watcher.put(fin)
            else:
                self.writer.add_finished(fin)
        self._push_prefill_done.clear()
        return watcher is None

    def _kv_written_marker(self) -> Any:
        """What must complete before the KV this step wrote is readable: nothing where
        kernels ran synchronously (CPU); an event on the current stream on CUDA."""
        if self._kv_written_async():
            event = torch.cuda.Event()
            event.record()
            return event
        return None

    def _cancel(self, rid: str, expired: bool) -> bool:
        """D: ask P to stand down for ``rid``; the request ends when every producer
        rank answered (or wrote), or at the cancel deadline. An expired request (watchdog,
        or a PUSH_REG that reached only some ranks) then fails its KV load unless every
        rank wrote after all; an aborted one just ends."""
        meta = self._recving_metadata.get(rid)
        if rid not in self._push_expected or meta is None or meta.remote is None:
            if expired:
                self._fail_recv(rid, "no push from P within push_registration_timeout")
            return False
        if expired:
            self._push_expiring.add(rid)
        else:
            self._push_aborted.add(rid)
        self._push_cancel_deadlines[rid] = (
            time.monotonic() + self.push_config.push_cancel_answer_timeout
        )
        self.writer.cancel(rid, meta.remote.engine_id)
        return True

    def _check_cancel_deadlines(self) -> None:
        """P never answered a PUSH_CANCEL (P gone): end the request anyway."""
        now = time.monotonic()
        for rid, t in list(self._push_cancel_deadlines.items()):
            if now >= t and rid in self._push_expected:
                self._push_expected[rid] = 0
                self._push_stood_down.add(rid)
                self._push_failed_reasons.setdefault(
                    rid,
                    "P did not answer PUSH_CANCEL within "
                    f"{self.push_config.push_cancel_answer_timeout:g}s",
                )
                self._count_down(rid)
            elif now >= t:
                del self._push_cancel_deadlines[rid]

    def _protect_leases_of_inflight_writes(self) -> None:
        """P: vLLM reaps a finished request's blocks when its lease ends; never while
        our WRITE may still read them. A lease ending within the next second (the
        reaper runs a moment after this) is pushed a second further."""
        # vLLM's lease clock is time.perf_counter (CLOCK_MONOTONIC, like monotonic()).
        soon = time.perf_counter() + 1.0
        for rid, expires in list(self._reqs_to_send.items()):
            if expires <= soon and rid in self.writer.busy_ids:
                del self._reqs_to_send[rid]
                self._reqs_to_send[rid] = soon

    def get_finished(self) -> tuple[set[str], set[str]]:
        if self._push_expected:
            cfg = self.push_config
            if self._step_idle and cfg.push_recv_idle_wait_ms > 0:
                # Nothing runs in this step: wait here for a completion rather than
                # in the engine's loop of empty steps (one every ~0.5-1 ms on CPU).
                self.writer.await_notifs(cfg.push_recv_idle_wait_ms / 1e3)
            else:
                # Have the writer read the notifications now, so one that arrived
                # during this step is reported by this step, not the next.
                self.writer.hand_over(cfg.push_handover_wait_ms / 1e3)
        self._drain_writer_results()
        self._check_cancel_deadlines()
        self._protect_leases_of_inflight_writes()
        done_sending, done_recving = super().get_finished()
        for rid in done_sending | done_recving:
            self.writer.evict(rid)
        self.writer.wake()  # read inbound notifications at least once per step
        return done_sending, done_recving

    def _drain_writer_results(self) -> None:
        while True:
            try:
                item = self.writer.results.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            if kind == SENT:
                self._push_sent.add(item[1])
            elif kind == WRITE_FAILED:
                self.xfer_stats.record_failed_transfer()
            elif kind == RECV_FAILED:
                self._fail_recv(item[1], item[2])
            elif kind == SEND_FAILED:
                # Ranks that got the PUSH_REG may write: cancel, fail once they answered.
                self._push_failed_reasons.setdefault(item[1], item[2])
                self._cancel(item[1], expired=True)
            elif kind == CANCELLED and self._push_expected.pop(item[1], None) is not None:
                # cancelled before PUSH_REG went out: nothing will be written
                self._push_registered_at.pop(item[1], None)
                self._push_done_recving.add(item[1])

    def _fail_recv(self, rid: str, reason: str) -> None:
        self._push_registered_at.pop(rid, None)
        self._push_failed_reasons.pop(rid, None)
        self._push_cancel_deadlines.pop(rid, None)
        self._push_expiring.discard(rid)
        self._push_aborted.discard(rid)
        self._push_stood_down.discard(rid)
        if rid not in self._recving_metadata or rid in self._push_done_recving:
            return  # already finished or failed
        self._push_expected.pop(rid, None)
        self._log_failure("push_recv_failed", rid, msg=reason)
        self._handle_failed_transfer(rid, None)

    def _get_new_notifs(self) -> set[str]:
        """Base hook, called by ``get_finished``: P requests done sending.

        NIXL notifications are read by the writer thread only; here we consume
        what it handed over.
        """
        done: set[str] = set()
        while True:
            try:
                n = self.writer.pending_completion_notifs.get_nowait()
            except queue.Empty:
                break
            if isinstance(n, Heartbeat):
                self._handle_heartbeat(n.payload)
            elif isinstance(n, PushFailed) and n.reason == CANCELLED_REASON:
                # P's answer to our PUSH_CANCEL: that rank will not write.
                if n.request_id in self._push_expected:
                    self._push_stood_down.add(n.request_id)
                    self._count_down(n.request_id)
            elif isinstance(n, PushFailed):
                if n.request_id in self._push_expected:
                    # That producer rank will not write. Others may still be writing
                    # into the same blocks: fail once every rank has answered.
                    self.push_counters.inc("push_failed_remote")
                    self._push_failed_reasons.setdefault(n.request_id, f"P reported: {n.reason}")
                    self._count_down(n.request_id)
            elif isinstance(n, Completion):
                self._on_completion(n, done)
        for rid in self._push_sent:
            if rid in self._reqs_to_send or rid in self._reqs_to_process:
                self._reqs_to_send.pop(rid, None)
                self._reqs_to_process.discard(rid)
                done.add(rid)
        self._push_sent.clear()
        return done

    def _on_completion(self, n: Completion, done_sending: set[str]) -> None:
        rid = n.request_id
        if rid in self._push_expected:  # D: a producer rank finished writing
            self.push_counters.inc("push_completions_received")
            self._count_down(rid)
            return
        if rid in self._reqs_to_send or rid in self._reqs_to_process:
            # P: a pull-mode D read our blocks; one notification per consumer rank.
            assert self.transfer_topo is not None
            per_producer = (
                -self.transfer_topo.tp_ratio(n.tp_size) if n.tp_size > self.world_size else 1
            )
            self.consumer_notification_counts_by_req[rid] += 1
            if self.consumer_notification_counts_by_req[rid] >= per_producer:
                del self.consumer_notification_counts_by_req[rid]
                self._reqs_to_process.discard(rid)
                self._reqs_to_send.pop(rid, None)
                done_sending.add(rid)
            return
        self.log_malformed("?", Malformed("unknown_request", f"completion for {rid!r}"))
        self.push_counters.inc("push_notifs_malformed")

    def _count_down(self, rid: str) -> None:
        """One producer rank is done with D request ``rid`` (wrote it, or stood down).

        When every rank is done the request ends: received, or failed if a rank
        reported a failure, or if the watchdog expired and a rank stood down (its
        part was never written). An aborted request just ends.
        """
        if rid not in self._push_expected:
            return
        self._push_expected[rid] -= 1
        if self._push_expected[rid] > 0:
            return
        del self._push_expected[rid]
        self._push_cancel_deadlines.pop(rid, None)
        reason = self._push_failed_reasons.pop(rid, None)
        stood_down = rid in self._push_stood_down
        self._push_stood_down.discard(rid)
        aborted = False
        if rid in self._push_expiring:
            self._push_expiring.discard(rid)
            if stood_down and reason is None:
                reason = "no push from P within push_registration_timeout"
        elif rid in self._push_aborted:
            aborted = True
            reason = None  # the request is gone; only its blocks wait for this
        self._push_aborted.discard(rid)
        registered_at = self._push_registered_at.pop(rid, None)
        if reason is None:
            self._push_done_recving.add(rid)
            if registered_at is not None and not aborted:
                self.push_counters.observe(
                    "push_recv_wait_seconds", time.monotonic() - registered_at
                )
        else:
            self._fail_recv(rid, reason)

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> set[str]:
        """Base hook, called by ``get_finished``: D requests done receiving."""
        done = super()._pop_done_transfers(transfers)
        done |= self._push_done_recving
        self._push_done_recving = set()
        return done

    # -- stats and shutdown -------------------------------------------------------------------
    def get_kv_connector_stats(self) -> PushKVConnectorStats | None:  # type: ignore[override]
        assert isinstance(self.xfer_stats, PushKVConnectorStats)
        self.xfer_stats.merge(self.push_counters.drain())
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
            "expected": len(self._push_expected),
            "registered_at": len(self._push_registered_at),
            "recving_metadata": len(self._recving_metadata),
            "reqs_to_send": len(self._reqs_to_send),
            "reqs_to_process": len(self._reqs_to_process),
            "writer_idle": self.writer.idle(),
        }
