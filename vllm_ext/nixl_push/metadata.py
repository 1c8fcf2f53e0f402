# SPDX-License-Identifier: Apache-2.0
"""Scheduler <-> worker metadata for push, and the validation of ``kv_transfer_params``.

``kv_transfer_params`` come from the client through the proxy and are
untrusted (S-LEG-2): :func:`parse_d_leg` / :func:`parse_p_leg` raise
:class:`LegError` naming the bad field, which fails that one request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

from vllm_ext import compat
from vllm_ext.nixl_push.wire import PromptKey

ReqId = str
#: per KV cache group, block ids; read only once built (the scheduler hands over lists
#: it made for this record and does not change afterwards, without copying them)
BlockIds = Sequence[Sequence[int]]


@dataclasses.dataclass(frozen=True)
class PushRegMeta:
    """D: blocks allocated for a request that P will write (one per request)."""

    request_id: ReqId
    block_ids: BlockIds  # D's logical block ids per KV cache group
    p_engine_id: str
    p_host: str
    p_port: int
    p_tp_size: int
    transfer_id: str | None
    prefix_tokens: int
    #: P's pipeline stages: each stage (x each P TP rank serving this rank) writes once.
    p_pp_size: int = 1
    #: the leg's ``transfer_secret``, sent to P in the PUSH_REG
    secret: str | None = dataclasses.field(default=None, repr=False)
    #: the request's prompt key, sent to P in the PUSH_REG (S-WRT-7)
    prompt: PromptKey | None = None
    #: per KV cache group, the prompt token its first block begins at (a sliding
    #: window registers only the blocks inside it, S-HYB-1); None: prefix_tokens
    group_starts: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class PushFinishedMeta:
    """P: a prefilled request whose blocks wait for D's registration."""

    request_id: ReqId
    block_ids: BlockIds  # P's logical block ids per KV cache group
    transfer_id: str | None
    #: time.monotonic() when the KV was complete: the end of the forward pass that
    #: ran the last prompt token (early hand-over), else when the scheduler finished it
    finished_at: float
    #: the P leg's ``transfer_secret``: only a PUSH_REG carrying it is served
    secret: str | None = dataclasses.field(default=None, repr=False)
    #: ``push_chunks``: the prompt tokens whose KV this step's pass makes final
    kv_tokens: int = 0
    #: ``push_prefill_done``: chunks of it went to the writer (its hand-overs follow them)
    streamed: bool = False
    #: ``push_prefill_done``: P preempted it after chunks of it went to the writer
    whole: bool = False
    #: the request's prompt key: only a PUSH_REG with the same one is served (S-WRT-7)
    prompt: PromptKey | None = None


class PushConnectorMetadata(NixlConnectorMetadata):
    """vLLM's NIXL metadata plus the push hand-over for one engine step."""

    def __init__(self) -> None:
        super().__init__()
        self.push_registrations: dict[ReqId, PushRegMeta] = {}
        self.push_finished_blocks: dict[ReqId, PushFinishedMeta] = {}
        #: P: requests whose prompt completes in this step's forward pass and that
        #: finish with it; the worker hands them to the writer in ``wait_for_save``.
        self.push_prefill_done: dict[ReqId, PushFinishedMeta] = {}
        #: P (push_progressive): requests of which this step's forward pass computes a
        #: prompt chunk that is not the last; handed over in ``wait_for_save`` too.
        self.push_chunks: dict[ReqId, PushFinishedMeta] = {}
        #: P: requests chunks of which were handed over and that ended (aborted)
        #: before their prompt was computed.
        self.push_prefill_stopped: set[ReqId] = set()
        #: P: announced requests (``push_prefill_done`` of an earlier step) that this
        #: step's schedule preempted: vLLM freed their blocks and may give them to
        #: another request in this step (S-SAFE-1, async scheduling and PP).
        self.push_announced_preempted: set[ReqId] = set()
        #: D requests to fail now, with the reason (bad params, watchdog expiry).
        self.push_failed_recvs: dict[ReqId, str] = {}
        #: D requests aborted while waiting for their push: tell P, then free.
        self.push_cancelled: set[ReqId] = set()
        #: D requests whose watchdog expired: tell P, then fail the KV load.
        self.push_expired: set[ReqId] = set()
        #: P: push requests the scheduler started (queued or prefilling; request id ->
        #: transfer id) or dropped without handing them over, since the last step. The
        #: writer renews D's watchdog only for registrations these (or WRITEs) will serve.
        self.push_live_started: dict[ReqId, str | None] = {}
        self.push_live_ended: set[ReqId] = set()
        #: The step runs no request (D: it only waits for KV), so the worker's
        #: get_finished may wait for a completion instead of returning at once.
        self.push_step_idle: bool = False


class PushWorkerMeta(compat.worker_metadata_base()):  # type: ignore[misc]
    """Worker -> scheduler, once per engine step (vLLM aggregates the TP ranks' with
    :meth:`aggregate`): D requests whose watchdog a producer renewed (PUSH_HB)."""

    def __init__(self, renewed: frozenset[ReqId]) -> None:
        self.renewed = renewed

    def aggregate(self, other: PushWorkerMeta) -> PushWorkerMeta:  # type: ignore[override]
        return PushWorkerMeta(self.renewed | other.renewed)

    def __repr__(self) -> str:
        return f"PushWorkerMeta(renewed={sorted(self.renewed)})"


class LegError(ValueError):
    """Bad ``kv_transfer_params``: the message names the field (S-LEG-2)."""


@dataclasses.dataclass(frozen=True)
class DLegParams:
    p_engine_id: str
    p_host: str
    p_port: int
    p_tp_size: int
    p_pp_size: int
    transfer_id: str | None
    secret: str | None = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True)
class PLegParams:
    transfer_id: str | None
    secret: str | None = dataclasses.field(default=None, repr=False)


#: A ``transfer_secret`` shorter than this is refused (S-LEG-3): it must be unguessable.
MIN_SECRET_LEN = 16
MAX_SECRET_LEN = 256


def is_d_leg(params: dict[str, Any] | None) -> bool:
    """A D leg of either mode (``do_remote_prefill``): :func:`is_push_d_leg` or
    :func:`is_pull_d_leg`, in one look."""
    return bool(params and params.get("do_remote_prefill"))


def is_push_d_leg(params: dict[str, Any] | None) -> bool:
    """A D leg of push mode: ``do_remote_prefill`` without pull's ``remote_block_ids``."""
    if not params:
        return False
    return bool(params.get("do_remote_prefill")) and params.get("remote_block_ids") is None


def is_pull_d_leg(params: dict[str, Any] | None) -> bool:
    """A D leg of vLLM's pull mode (``remote_block_ids`` from P's answer): a push
    consumer cannot READ, so it fails such a request alone (S-LEG-2)."""
    if not params:
        return False
    return bool(params.get("do_remote_prefill")) and params.get("remote_block_ids") is not None


PULL_LEG_REFUSED = (
    "a pull-mode D leg (remote_block_ids from P's answer) reached a push consumer, which "
    "does not READ: send the push D leg (remote_engine_id, remote_host, remote_port, "
    "tp_size, transfer_id), e.g. through python -m vllm_ext.proxy"
)


def _typed(params: dict[str, Any], key: str, typ: type, required: bool) -> Any:
    v = params.get(key)
    if v is None:
        if required:
            raise LegError(f"kv_transfer_params[{key!r}] is required for a push D leg")
        return None
    if type(v) is typ:  # the common case: exactly str / int (a bool's type is bool)
        return v
    ok = (isinstance(v, int) and not isinstance(v, bool)) if typ is int else isinstance(v, typ)
    if not ok:
        raise LegError(
            f"kv_transfer_params[{key!r}]={v!r} must be {typ.__name__}, not {type(v).__name__}"
        )
    return v


def parse_d_leg(params: dict[str, Any]) -> DLegParams:
    """D leg fields (S-LEG-1); raises :class:`LegError` naming the bad field."""
    engine = _typed(params, "remote_engine_id", str, True)
    host = _typed(params, "remote_host", str, True)
    port = _typed(params, "remote_port", int, True)
    tp = _typed(params, "tp_size", int, True)
    pp = _typed(params, "pp_size", int, False) or 1
    tid = _typed(params, "transfer_id", str, False)
    secret = _secret(params)
    if not engine or not host:
        raise LegError("kv_transfer_params['remote_engine_id'/'remote_host'] is empty")
    if not 0 < port < 65536:
        raise LegError(f"kv_transfer_params['remote_port']={port} is not a port")
    if tp < 1 or pp < 1:
        raise LegError(f"kv_transfer_params tp_size={tp} / pp_size={pp} must be >= 1")
    return DLegParams(engine, host, port, tp, pp, tid or None, secret)


def parse_p_leg(params: dict[str, Any]) -> PLegParams:
    """P leg: the optional ``transfer_id`` and ``transfer_secret``; raises
    :class:`LegError` if ill-typed."""
    return PLegParams(_typed(params, "transfer_id", str, False) or None, _secret(params))


def _secret(params: dict[str, Any]) -> str | None:
    """The optional ``transfer_secret`` (S-LEG-3); never echoed in an error."""
    secret = _typed(params, "transfer_secret", str, False)
    if secret is None:
        return None
    if not MIN_SECRET_LEN <= len(secret) <= MAX_SECRET_LEN:
        raise LegError(
            f"kv_transfer_params['transfer_secret'] must have {MIN_SECRET_LEN}.."
            f"{MAX_SECRET_LEN} characters, not {len(secret)}"
        )
    return secret
