# SPDX-License-Identifier: Apache-2.0
"""Typed messages between the engine thread and the ``nixl-push-writer`` thread of one rank.

The two threads share no per-request state: the engine thread hands work over
through the writer's inboxes, and the writer reports back through one ordered
queue (``PushWriter.outbox``) that the engine thread drains in ``get_finished``.
One queue keeps causality: a request's :class:`RegSent` is always read before a
notification that answers that registration.

Engine thread -> writer (one inbox per kind, see writer.py):

* :class:`~vllm_ext.nixl_push.metadata.PushRegMeta` (D): send this PUSH_REG;
* :data:`HandOver` (P): a request's blocks: :class:`KvChunk` (a computed prompt chunk),
  :class:`Announced`, :class:`KvFinal`, or :class:`Stopped`;
* :class:`CancelRecv` (D): ask P to stand down for a request;
* :class:`LiveRequests` (P): P requests queued or prefilling (for heartbeats);
* a request id (both): the engine thread is done with it (evict).

Handshake callbacks -> writer (``_deferred_push_inbox``, :data:`Deferred`): a WRITE whose
handshake with D ended (:class:`Connected`), an answer to D waiting for one (:class:`ReplyToD`),
a PUSH_REG whose handshake with P ended (:class:`RegConnected`).

Writer -> engine thread (:data:`ToEngine`): :class:`RegSent`, :class:`RegPartlySent`,
:class:`RegUnsent`, :class:`RecvFailed` (D), :class:`Settled` (P) and
:class:`Inbound` (a notification for the engine thread, with the agent that sent it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm_ext.nixl_push.wire import Completion, Heartbeat, PromptKey, PushFailed, PushHeartbeat

if TYPE_CHECKING:
    from vllm_ext.nixl_push.lifecycle import RegOut
    from vllm_ext.nixl_push.send_lifecycle import Write

# -- engine thread -> writer ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KvChunk:
    """P, chunk-progressive push (S-PRG-1): a prompt chunk's forward pass ended; the KV of
    the first ``kv_tokens`` prompt tokens is final; the prompt goes on in later steps."""

    request_id: str
    #: the request's blocks so far (chunks only add blocks, unless P preempted it;
    #: read only)
    block_ids: Sequence[Sequence[int]]
    kv_tokens: int
    transfer_id: str | None = None
    #: the P leg's ``transfer_secret``: only a registration carrying it is served
    secret: str | None = dataclasses.field(default=None, repr=False)
    #: the request's prompt key: only a registration with the same one is served
    #: (S-WRT-7; None: not known, any)
    prompt: PromptKey | None = None
    #: something with ``synchronize()`` to wait on before reading the blocks (a CUDA
    #: event recorded after the forward pass that wrote them), or None
    ready: Any = None
    #: time.monotonic() when the KV was final on P
    finished_at: float = 0.0


@dataclasses.dataclass(frozen=True)
class Announced:
    """P: the forward pass now running completes the prompt (see PushWriter.announce):
    its WRITEs may be prepared, not posted, until its :class:`KvFinal`."""

    request_id: str
    block_ids: Sequence[Sequence[int]]  # read only
    transfer_id: str | None = None
    secret: str | None = dataclasses.field(default=None, repr=False)
    prompt: PromptKey | None = None
    #: P preempted the request after chunks of it were handed over: its blocks were
    #: computed anew, so it is written whole (S-PRG-1)
    whole: bool = False


@dataclasses.dataclass(frozen=True)
class KvFinal:
    """P: the prompt's KV is final (at the end of its forward pass, or, for a P leg that
    decoded on, when vLLM finished it): its WRITEs may be posted."""

    request_id: str
    block_ids: Sequence[Sequence[int]]  # read only
    transfer_id: str | None = None
    #: time.monotonic() when the KV was final on P (hand-off latency start)
    finished_at: float = 0.0
    secret: str | None = dataclasses.field(default=None, repr=False)
    prompt: PromptKey | None = None
    #: as :attr:`Announced.whole`
    whole: bool = False
    #: as :attr:`KvChunk.ready`
    ready: Any = None


@dataclasses.dataclass(frozen=True)
class Stopped:
    """P: a request chunks of which were handed over ended before its prompt was
    computed (aborted): no WRITE of it is started or completed any more."""

    request_id: str


#: P's hand-overs of a request's blocks, in the order the engine thread made them: chunks
#: (S-PRG-1), then its prompt's end (announced, then final; or final alone), or its stop.
HandOver = KvChunk | Announced | KvFinal | Stopped


@dataclasses.dataclass(frozen=True)
class CancelRecv:
    """D: the request was aborted (or its watchdog expired) before its KV arrived.
    ``again``: its answers are overdue; ask the producers that have not answered once
    more (an answer lost on a partitioned link would otherwise never come)."""

    request_id: str
    again: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class LiveRequests:
    """P: requests P's scheduler started (queued or prefilling: request id ->
    transfer id) or dropped without handing them over. P renews D's watchdog only
    for registrations that one of these, or a request being written, will serve."""

    started: dict[str, str | None]
    ended: frozenset[str]


# -- handshake callbacks -> writer ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Connected:
    """P: the handshake a WRITE waited for ended (``error`` None: connected). Carries the
    writer's own :class:`~vllm_ext.nixl_push.send_lifecycle.Write`; the handshake thread
    only passes it on."""

    request_id: str
    write: Write
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True)
class ReplyToD:
    """P: a notification for a D rank, to send once the handshake with it is done,
    to the agent ``sender`` only (the one that registered, or cancelled)."""

    engine_id: str
    tp_rank: int
    sender: str
    notif: bytes
    what: str


@dataclasses.dataclass(frozen=True)
class RegConnected:
    """D: the handshake a PUSH_REG waited for ended (``error`` None: connected; a
    failure is never retried, S-FAIL-1). Carries the writer's own
    :class:`~vllm_ext.nixl_push.lifecycle.RegOut`: the writer sends it only if that
    very object is still CONNECTING."""

    out: RegOut
    error: BaseException | None = None

    @property
    def request_id(self) -> str:
        return self.out.request_id


@dataclasses.dataclass(frozen=True)
class ProducersUnreachable:
    """D: sending to these producer agents failed at ``at`` (``time.monotonic()``):
    UCX's error on the endpoint, i.e. its TCP connection was declared dead; the
    writer removed P's agents from NIXL. Silent long enough after that, they are gone
    (N-LIV-1)."""

    agents: frozenset[str]
    at: float
    why: str


Deferred = Connected | ReplyToD | RegConnected


# -- writer -> engine thread -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RegSent:
    """D: the PUSH_REG reached these producer agents; each answers once."""

    request_id: str
    agents: frozenset[str]


@dataclasses.dataclass(frozen=True)
class RegPartlySent:
    """D: the PUSH_REG reached only ``agents`` (they may write); the request fails
    once they answered a cancel."""

    request_id: str
    agents: frozenset[str]
    reason: str


@dataclasses.dataclass(frozen=True)
class RegUnsent:
    """D: the request was cancelled before its PUSH_REG went out: nothing will be written."""

    request_id: str


@dataclasses.dataclass(frozen=True)
class RecvFailed:
    """D: no producer got the PUSH_REG (handshake or send failed, bad ``pp_size``)."""

    request_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Settled:
    """P: no WRITE reads the request's blocks any more; ``failed_writes`` of its WRITEs
    failed (each counts as a failed transfer, S-FAIL-3)."""

    request_id: str
    failed_writes: int = 0


@dataclasses.dataclass(frozen=True)
class Inbound:
    """A notification for the engine thread and the NIXL agent that sent it."""

    sender: str
    notif: Completion | PushFailed | PushHeartbeat | Heartbeat


ToEngine = (
    RegSent | RegPartlySent | RegUnsent | RecvFailed | ProducersUnreachable | Settled | Inbound
)
