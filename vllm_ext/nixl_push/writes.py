# SPDX-License-Identifier: Apache-2.0
"""P's WRITEs on the writer thread: from a match to a request reported sent.

``PushWritesMixin`` is mixed into ``PushWriter`` (writer.py) and runs on its
thread only. Per P request (``InflightPush``), a WRITE goes::

    match ─► descriptors + initialize_xfer ─┬─► transfer() ─► DONE ─► settle ─► SENT
                                            └─► armed (KV not final yet) ─► transfer() ...

A WRITE is posted only once the KV is final (``FinishedBlocks.final``): an announced
request's WRITEs are prepared during the forward pass and posted when it ends
(``_post_armed``). A request is reported sent (``SENT``) only when every matched
registration is resolved and its KV was final. Failures release the handle, count,
tell D (``PUSH_FAIL``, S-FAIL-4) and never touch vLLM's failure path on P (S-FAIL-3).
"""

from __future__ import annotations

import dataclasses
import queue
import time
from typing import TYPE_CHECKING, Any

from vllm_ext.log import get_logger
from vllm_ext.nixl_push.descriptors import DescriptorError
from vllm_ext.nixl_push.matching import FinishedBlocks, Match, Rendezvous
from vllm_ext.nixl_push.wire import Completion, PushFailed, PushRegistration

if TYPE_CHECKING:
    from vllm_ext.nixl_push.stats import PushCounters
    from vllm_ext.nixl_push.worker import NixlPushConnectorWorker

logger = get_logger(__name__)

# Results handed to the engine thread (the D-side ones are in writer.py).
SENT = "sent"  # (SENT, p_request_id): every WRITE of the request is done
WRITE_FAILED = "write_failed"  # (WRITE_FAILED, p_request_id)


@dataclasses.dataclass
class InflightPush:
    """P: the WRITEs of one request. Reported sent once no WRITE can touch its blocks."""

    finished: FinishedBlocks
    handles: list[tuple[Any, PushRegistration]] = dataclasses.field(default_factory=list)
    #: prepared WRITEs (handle, registration, bytes) waiting for the KV to be final
    armed: list[tuple[Any, PushRegistration, int]] = dataclasses.field(default_factory=list)
    #: matched registrations whose WRITE is not finished (incl. waiting for a handshake)
    pending: int = 0
    failed: bool = False

    def settled(self) -> bool:
        # Never before the KV is final: "sent" frees the blocks the forward pass writes.
        return self.pending == 0 and (self.finished.complete or self.failed) and self.finished.final


@dataclasses.dataclass(frozen=True)
class Abandoned:
    """A match whose P->D handshake failed; settles its accounting on the writer thread."""

    match: Match


class PushWritesMixin:
    """The P half of the writer thread's work after a match (see the module docstring)."""

    worker: NixlPushConnectorWorker
    nixl: Any
    counters: PushCounters
    rendezvous: Rendezvous
    results: queue.SimpleQueue[tuple]
    busy_ids: set[str]
    _inflight: dict[str, InflightPush]

    def _write(self, match: Match | Abandoned) -> None:
        """Prepare the WRITE of a match and post it, or keep it for when the KV is final."""
        if isinstance(match, Abandoned):  # its handshake failed (see _after_p_handshake)
            self._settle_one(match.match.finished.request_id, failed=True)
            return
        fin, reg = match.finished, match.registration
        w = self.worker
        agent = self._agent_of(reg)
        if fin.request_id not in self._inflight:
            # Evicted (P's lease ended) while this WRITE waited for its handshake: the
            # blocks are back in P's pool and may hold another request's KV by now.
            self.counters.inc("push_failed_lease_expired")
            logger.error(
                "push: lease of %s ended before its WRITE -> %s could start; not written",
                fin.request_id, reg.request_id,
            )  # fmt: skip
            self._tell_d_failed(reg, "P's lease on the blocks expired")
            return
        try:
            if agent is None:
                raise DescriptorError(
                    f"P rank {w.tp_rank}/{w.world_size} has no agent for D rank "
                    f"{reg.tp_rank}/{reg.tp_size}"
                )
            src, dst = w.push_descriptors(fin, reg)
        except (DescriptorError, KeyError) as e:
            self.counters.inc("push_failed_descriptors")
            logger.error("push: cannot write %s into D %s: %s", fin.request_id, reg.request_id, e)
            self._tell_d_failed(reg, str(e))
            self._settle_one(fin.request_id, failed=True)
            return
        if not src:  # D needs nothing (prefix hit): completion only, once the KV is final
            if fin.final:
                self._send_completion(fin, reg)
            else:
                self._inflight[fin.request_id].armed.append((None, reg, 0))
            return
        try:
            mem = w.nixl_memory_type
            handle = self.nixl.initialize_xfer(
                "WRITE",
                self.nixl.get_xfer_descs(src, mem),
                self.nixl.get_xfer_descs(dst, mem),
                agent,
                Completion(reg.request_id, w.world_size).encode(),
            )
        except Exception as e:
            self._submit_failed(fin, reg, None, e)
            return
        nbytes = sum(n for _, n, _ in src)
        if not fin.final:  # the forward pass still writes the KV: post when it is final
            self._inflight[fin.request_id].armed.append((handle, reg, nbytes))
            return
        if self._kv_ready(fin):
            self._post(fin, handle, reg, nbytes)
        else:
            self._submit_failed(fin, reg, handle, RuntimeError("KV not readable"))

    def _post_armed(self, fin: FinishedBlocks) -> None:
        """P: the announced request's KV is final: post its prepared WRITEs."""
        inflight = self._inflight.get(fin.request_id)
        if inflight is None or not inflight.armed:
            return
        armed, inflight.armed = inflight.armed, []
        ready = self._kv_ready(fin)
        for handle, reg, nbytes in armed:
            if handle is None:
                self._send_completion(fin, reg)
            elif ready:
                self._post(fin, handle, reg, nbytes)
            else:
                self._submit_failed(fin, reg, handle, RuntimeError("KV not readable"))

    def _send_completion(self, fin: FinishedBlocks, reg: PushRegistration) -> None:
        """The completion alone: D needs none of the blocks (it holds the prefix)."""
        notif = Completion(reg.request_id, self.worker.world_size).encode()
        failed = False
        try:
            self.nixl.send_notif(self._agent_of(reg), notif_msg=notif)
        except Exception as e:
            self.counters.inc("push_failed_send_notif")
            logger.error("push: completion for %s not sent: %s", reg.request_id, e)
            failed = True
        self._settle_one(fin.request_id, failed=failed)

    def _kv_ready(self, fin: FinishedBlocks) -> bool:
        """Wait for the forward pass that wrote the KV (a CUDA event; nothing on CPU)."""
        if fin.ready is None:
            return True
        try:
            fin.ready.synchronize()
        except Exception:
            logger.exception("push: waiting for the KV of %s failed", fin.request_id)
            return False
        return True

    def _post(self, fin: FinishedBlocks, handle: Any, reg: PushRegistration, nbytes: int) -> None:
        try:
            state = self.nixl.transfer(handle)
            if state == "ERR":
                raise RuntimeError("transfer() returned ERR")
        except Exception as e:
            self._submit_failed(fin, reg, handle, e)
            return
        inflight = self._inflight[fin.request_id]
        inflight.handles.append((handle, reg))
        self.counters.inc("push_writes")
        self.counters.inc("push_bytes", nbytes)
        if state == "DONE":  # done within the call (UCX copies same-host WRITEs inline)
            self._write_ended(fin.request_id, inflight, handle, reg, state)

    def _submit_failed(
        self, fin: FinishedBlocks, reg: PushRegistration, handle: Any, e: Exception
    ) -> None:
        # S-FAIL-3: release, count; never _handle_failed_transfer on P.
        if handle is not None:
            self._release(handle)
        self.counters.inc("push_failed_write_submit")
        self.results.put((WRITE_FAILED, fin.request_id))
        logger.error("push: WRITE of %s -> %s not submitted: %s", fin.request_id, reg.request_id, e)
        self._tell_d_failed(reg, f"WRITE submission failed: {e}")
        self._settle_one(fin.request_id, failed=True)

    def _poll_writes(self) -> None:
        for p_req, inflight in list(self._inflight.items()):
            for handle, reg in list(inflight.handles):
                try:
                    state = self.nixl.check_xfer_state(handle)
                except Exception as e:
                    state = f"exception: {e}"
                if state != "PROC":
                    self._write_ended(p_req, inflight, handle, reg, state)

    def _write_ended(
        self, p_req: str, inflight: InflightPush, handle: Any, reg: PushRegistration, state: str
    ) -> None:
        """A posted WRITE is no longer in flight (``state``: DONE, ERR, an exception)."""
        failed = state != "DONE"
        if failed:
            self.counters.inc("push_failed_write_state")
            self.results.put((WRITE_FAILED, p_req))
            logger.error("push: WRITE of %s -> %s ended %s", p_req, reg.request_id, state)
            self._tell_d_failed(reg, f"WRITE ended {state}")
        inflight.handles = [h for h in inflight.handles if h[0] is not handle]
        self._settle_one(p_req, failed=failed)  # first: it ends the hand-off clock
        if not failed:
            self._record_telemetry(handle)
        self._release(handle)

    def _settle_one(self, p_req: str, failed: bool) -> None:
        """One matched registration of ``p_req`` is resolved (written, or given up)."""
        inflight = self._inflight.get(p_req)
        if inflight is None:
            return
        inflight.pending -= 1
        inflight.failed |= failed
        self._settle_if_done(p_req)

    def _settle_if_done(self, p_req: str) -> None:
        """Report ``p_req`` sent once every matched WRITE of it is resolved."""
        inflight = self._inflight.get(p_req)
        if inflight is None or not inflight.settled():
            return
        if not inflight.failed:
            self.counters.observe(
                "push_handoff_seconds", time.monotonic() - inflight.finished.finished_at
            )
        del self._inflight[p_req]
        self.busy_ids.discard(p_req)
        self.rendezvous.evict(p_req)
        self.results.put((SENT, p_req))

    def _record_telemetry(self, handle: Any) -> None:
        try:
            t = self.nixl.get_xfer_telemetry(handle)
        except Exception:
            return
        self.counters.observe("transfer_duration", t.xferDuration / 1e6)
        self.counters.observe("post_duration", t.postDuration / 1e6)
        self.counters.observe("bytes_transferred", t.totalBytes)
        self.counters.observe("num_descriptors", t.descCount)

    def _agent_of(self, reg: PushRegistration) -> str | None:
        """The NIXL agent of the D rank that sent ``reg`` (None before the handshake)."""
        return self.worker.remote_agents_of(reg.engine_id).get(reg.tp_rank)

    def _tell_d_failed(self, reg: PushRegistration, reason: str) -> None:
        """S-FAIL-4: let D fail the request now instead of waiting out its watchdog."""
        agent = self._agent_of(reg)
        if agent is None:
            return
        try:
            self.nixl.send_notif(agent, notif_msg=PushFailed(reg.request_id, reason).encode())
        except Exception:
            logger.debug("push: PUSH_FAIL for %s not sent", reg.request_id, exc_info=True)

    def _release(self, handle: Any) -> None:
        try:
            self.nixl.release_xfer_handle(handle)
        except Exception:
            logger.warning("push: releasing a WRITE handle failed", exc_info=True)

    def _release_all(self) -> None:
        for inflight in self._inflight.values():
            for handle, *_ in (*inflight.handles, *inflight.armed):
                if handle is not None:
                    self._release(handle)
        self._inflight.clear()
        self.busy_ids.clear()
