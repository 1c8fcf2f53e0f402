# SPDX-License-Identifier: Apache-2.0
"""Everything that crosses NIXL as a notification, in one place.

Seven kinds of notification reach a push worker:

* ``PUSH_REG:<msgpack map>`` (D -> P): D's pre-allocated blocks for one request,
  :class:`PushRegistration`. Versioned; unknown keys are ignored so newer
  senders stay readable; every required key is checked for presence and type.
* ``PUSH_FAIL:<msgpack map>`` (P -> D): P knows the push for a D request will
  not happen (S-FAIL-4); D fails the request at once instead of waiting out the
  watchdog. An older D ignores the unknown prefix.
* ``PUSH_CANCEL:<msgpack map>`` (D -> P): D's request was aborted before its
  KV arrived; P drops the registration if it did not start writing, and
  answers ``PUSH_FAIL`` (reason ``cancelled``) so D can free the blocks.
* ``PUSH_HB:<msgpack map>`` (P -> D): P still holds these D requests (their P
  request is queued, prefilling, or being written), so D renews their watchdog,
  :class:`PushHeartbeat`. Sent only to a D that asked for it (``heartbeat_s`` in
  its PUSH_REG); an older D would drop the unknown prefix.
* ``<request id>:<tp size>`` (P -> D, attached to the WRITE): vLLM's completion
  notification, for a D whose PUSH_REG carried no ``reply_token`` (an older one).
* ``HB:<id>,<id>,...``: vLLM's lease heartbeat, handed to the base worker as is.
* ``PUSH_DONE:<msgpack map>`` (P -> D, attached to the WRITE): the completion for a
  D whose PUSH_REG carried a ``reply_token``, with that token (S-WIR-3).

Every notification P sends D about a request carries the token D made for it (a
D that sent none, an older one, gets vLLM's completion and maps without it): NIXL
takes a notification's sender name from the message itself, so the token, not
the name, is what shows D a message comes from the P its registration reached.

Who may send what is checked by the receivers, against the NIXL agent each
notification came from (``get_new_notifs`` is keyed by it), not against the body.

Every inbound notification is untrusted (S-WIR-2): :func:`parse_notif` never
raises; anything malformed comes back as :class:`Malformed` with a reason
that the caller counts.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import msgpack

PUSH_REG_PREFIX = b"PUSH_REG:"
PUSH_FAIL_PREFIX = b"PUSH_FAIL:"
PUSH_CANCEL_PREFIX = b"PUSH_CANCEL:"
PUSH_HB_PREFIX = b"PUSH_HB:"
PUSH_DONE_PREFIX = b"PUSH_DONE:"
HEARTBEAT_PREFIX = b"HB:"

#: Current PUSH_REG format version. Bump on incompatible changes only.
WIRE_VERSION = 1
#: Oldest version this code reads.
MIN_WIRE_VERSION = 1
#: P keeps a PUSH_REG it has not renewed (no live P request awaited it) for at most
#: this fraction of the ``timeout_s`` it carries, counted from its arrival; D counts on
#: it before it takes P for gone (N-LIV-1, ``RecvTable``).
P_REGISTRATION_TTL_FRACTION = 0.8
#: Larger notifications are dropped unread (a registration of 100k blocks is ~500 KiB).
MAX_NOTIF_BYTES = 4 * 1024 * 1024


class WireError(ValueError):
    """A notification that cannot be accepted. ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class PromptKey:
    """What the KV of a request depends on, in short (S-WRT-7): how many prompt tokens
    it has and a digest of them (and of whatever else its KV depends on: multimodal
    inputs, the LoRA adapter). P writes a request's KV only into the blocks of a
    registration with the same key, so ids that collide (two client bodies under
    one X-Request-Id) can fail a request but never give it another prompt's KV.

    The digest is BLAKE2b (16 bytes) of the token ids as 64-bit integers, then of
    each extra item. :meth:`of` computes it at once; :meth:`later` takes a copy of the
    token ids and computes it when it is first read (the writer thread: it encodes
    the PUSH_REG on D and compares keys on P), so that the engine thread only copies.
    Keys compare by (tokens, digest); a deferred key pickles as its digest."""

    __slots__ = ("tokens", "_digest", "_ids", "_extra")

    def __init__(self, tokens: int, digest: str) -> None:
        self.tokens = tokens
        self._digest: str | None = digest
        self._ids: Any = None
        self._extra: tuple[str, ...] = ()

    @classmethod
    def of(cls, token_ids: Sequence[int], extra: Sequence[str] = ()) -> PromptKey:
        return cls(len(token_ids), _prompt_digest(_snapshot(token_ids), tuple(extra)))

    @classmethod
    def later(cls, token_ids: Sequence[int], extra: Sequence[str] = ()) -> PromptKey:
        """The key of ``token_ids`` as they are now (copied: a streaming session may
        extend the request's prompt later), its digest computed on first read."""
        key = cls.__new__(cls)
        key.tokens = len(token_ids)
        key._digest = None
        key._ids = _snapshot(token_ids)
        key._extra = tuple(extra)
        return key

    @property
    def digest(self) -> str:
        d = self._digest
        if d is None:
            ids = self._ids
            if ids is None:  # another thread computed it meanwhile
                return self._digest  # type: ignore[return-value]
            d = self._digest = _prompt_digest(ids, self._extra)
            self._ids = None
        return d

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PromptKey):
            return NotImplemented
        return self.tokens == other.tokens and self.digest == other.digest

    def __hash__(self) -> int:
        return hash((self.tokens, self.digest))

    def __repr__(self) -> str:
        return f"PromptKey(tokens={self.tokens}, digest={self.digest!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return PromptKey, (self.tokens, self.digest)


def _snapshot(token_ids: Sequence[int]) -> Any:
    """A copy of ``token_ids`` that :func:`_prompt_digest` reads: the bytes of an
    integer array (vLLM 0.34's ``TokenBuffer``: a copy of memory), else a list."""
    if isinstance(token_ids, array.array) and token_ids.typecode in "bBhHiIlLqQ":
        return (token_ids.typecode, token_ids.tobytes())
    return list(token_ids)


def _prompt_digest(ids: Any, extra: tuple[str, ...]) -> str:
    h = hashlib.blake2b(digest_size=16)
    if isinstance(ids, tuple):  # (typecode, bytes): widened to 64-bit without Python ints
        import numpy as np

        typecode, raw = ids
        h.update(np.frombuffer(raw, dtype=np.dtype(typecode)).astype(np.int64).tobytes())
    else:
        h.update(array.array("q", ids).tobytes())
    for e in extra:
        h.update(b"\0" + e.encode())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class PushRegistration:
    """D's registration of one request's blocks with one P rank (S-WIR-1).

    ``block_ids`` are D's *logical* block ids, one list per KV cache group; P
    expands them to physical ids with the ratio it learned in the handshake.
    ``prefix_tokens`` is how many leading prompt tokens D already holds
    (local prefix-cache hit): D's first block starts at that token.
    """

    engine_id: str
    request_id: str
    block_ids: Sequence[Sequence[int]]  # read only (decoded: tuples)
    tp_rank: int
    tp_size: int
    host: str
    port: int
    block_size: int
    transfer_id: str | None = None
    prefix_tokens: int = 0
    #: D's push_registration_timeout_s: P drops the registration well before it.
    timeout_s: float | None = None
    #: D renews the registration on P's PUSH_HB (absent: an older D, no heartbeats);
    #: P sends one at least this often while it holds the request.
    heartbeat_s: float | None = None
    #: the transfer's secret from D's leg (the proxy put the same one in P's leg): P
    #: serves this registration only with a P request whose leg carries it
    secret: str | None = dataclasses.field(default=None, repr=False)
    #: the D request's prompt (absent: an older D): P serves this registration only
    #: with a P request whose prompt has the same key (S-WRT-7)
    prompt: PromptKey | None = None
    #: random, made by D for this registration: P puts it in every notification it
    #: sends D about the request (completion, PUSH_FAIL, PUSH_HB), and D counts none
    #: without it (S-WIR-3); absent: an older D
    reply_token: str | None = dataclasses.field(default=None, repr=False)
    #: per KV cache group, the prompt token at which its first block in ``block_ids``
    #: begins (S-HYB-1): a sliding-window group registers only the blocks inside its
    #: window, so its list starts later than ``prefix_tokens``. Absent: every group
    #: starts at ``prefix_tokens``. D sends it only to a P whose handshake announced
    #: the same KV cache groups (``PeerLayout.kv_groups``), which reads it.
    group_starts: tuple[int, ...] | None = None
    version: int = WIRE_VERSION

    def start_of(self, group: int) -> int:
        """The prompt token at which D's first block of ``group`` begins."""
        return self.prefix_tokens if self.group_starts is None else self.group_starts[group]

    # -- encode ---------------------------------------------------------------
    def encode(self) -> bytes:
        body: dict[str, Any] = {
            "v": self.version,
            "engine_id": self.engine_id,
            "request_id": self.request_id,
            "transfer_id": self.transfer_id,
            "block_ids": [list(g) for g in self.block_ids],
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "host": self.host,
            "port": self.port,
            "block_size": self.block_size,
            "prefix_tokens": self.prefix_tokens,
            "timeout_s": self.timeout_s,
        }
        if self.heartbeat_s is not None:
            body["heartbeat_s"] = self.heartbeat_s
        if self.secret is not None:
            body["secret"] = self.secret
        if self.prompt is not None:
            body["prompt_tokens"] = self.prompt.tokens
            body["prompt_digest"] = self.prompt.digest
        if self.reply_token is not None:
            body["reply_token"] = self.reply_token
        if self.group_starts is not None:
            body["group_starts"] = list(self.group_starts)
        return PUSH_REG_PREFIX + msgpack.packb(body, use_bin_type=True)

    # -- decode + validate ------------------------------------------------------
    @classmethod
    def decode(cls, payload: bytes) -> PushRegistration:
        """Decode the bytes after ``PUSH_REG:``; raises :class:`WireError`."""
        try:
            body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types
            raise WireError("bad_msgpack", f"{type(e).__name__}: {e}") from None
        if not isinstance(body, dict):
            raise WireError("bad_type", f"PUSH_REG body is {type(body).__name__}, not a map")
        version = _field(body, "v", int)
        if not version >= MIN_WIRE_VERSION:
            raise WireError("bad_version", f"PUSH_REG version {version} is too old")
        # A newer version is read as far as we understand it (unknown keys ignored).
        block_ids = _field(body, "block_ids", list)
        groups: list[tuple[int, ...]] = []
        for g in block_ids:
            if not isinstance(g, list) or not all(_is_int(b) and b >= 0 for b in g):
                raise WireError("bad_type", "block_ids must be a list of lists of ints >= 0")
            groups.append(tuple(g))
        tp_size = _field(body, "tp_size", int)
        tp_rank = _field(body, "tp_rank", int)
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise WireError("bad_value", f"tp_rank {tp_rank} / tp_size {tp_size}")
        port = _field(body, "port", int)
        if not 0 < port < 65536:
            raise WireError("bad_value", f"port {port}")
        block_size = _field(body, "block_size", int)
        prefix_tokens = _field(body, "prefix_tokens", int, default=0)
        if block_size < 1 or prefix_tokens < 0:
            raise WireError("bad_value", f"block_size {block_size}, prefix {prefix_tokens}")
        transfer_id = _field(body, "transfer_id", str, default=None)
        timeout = _positive(body, "timeout_s")
        heartbeat = _positive(body, "heartbeat_s")
        secret = _field(body, "secret", str, default=None)
        prompt_tokens = _field(body, "prompt_tokens", int, default=None)
        prompt_digest = _field(body, "prompt_digest", str, default=None)
        if (prompt_tokens is None) != (prompt_digest is None) or (
            prompt_tokens is not None and (prompt_tokens < 0 or not prompt_digest)
        ):
            raise WireError("bad_value", "prompt_tokens and prompt_digest go together")
        starts = _field(body, "group_starts", list, default=None)
        if starts is not None and (
            len(starts) != len(groups) or not all(_is_int(t) and t >= prefix_tokens for t in starts)
        ):
            raise WireError(
                "bad_value", "group_starts must be one int >= prefix_tokens per block_ids group"
            )
        return cls(
            engine_id=_nonempty(_field(body, "engine_id", str), "engine_id"),
            request_id=_nonempty(_field(body, "request_id", str), "request_id"),
            transfer_id=transfer_id or None,
            block_ids=tuple(groups),
            tp_rank=tp_rank,
            tp_size=tp_size,
            host=_nonempty(_field(body, "host", str), "host"),
            port=port,
            block_size=block_size,
            prefix_tokens=prefix_tokens,
            timeout_s=timeout,
            heartbeat_s=heartbeat,
            secret=secret or None,
            prompt=None if prompt_tokens is None else PromptKey(prompt_tokens, prompt_digest),
            reply_token=_field(body, "reply_token", str, default=None) or None,
            group_starts=None if starts is None else tuple(starts),
            version=version,
        )

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.block_ids)


_MISSING = object()


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _field(body: dict, key: str, typ: type, default: Any = _MISSING) -> Any:
    v = body.get(key, _MISSING)
    if v is _MISSING or (v is None and default is not _MISSING):
        if default is _MISSING:
            raise WireError("missing_field", f"field {key!r} is missing")
        return default
    ok = _is_int(v) if typ is int else isinstance(v, typ)
    if not ok:
        raise WireError("bad_type", f"field {key!r} is {type(v).__name__}, not {typ.__name__}")
    return v


def _positive(body: dict, key: str) -> float | None:
    """An optional positive number (a duration in seconds), or None if absent."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
        raise WireError("bad_type", f"field {key!r} is {v!r}, not a positive number")
    return float(v)


def _nonempty(v: str, key: str) -> str:
    if not v:
        raise WireError("bad_value", f"field {key!r} is empty")
    return v


# -- the side channel's layout answer ------------------------------------------------

#: The message of the side-channel query (shaped like vLLM's metadata query for rank 0,
#: ``compat_nixl.query_peer_layout``) our engines answer with their :class:`PeerLayout`
#: (S-LEG-5), beside vLLM's per-rank metadata queries.
PUSH_LAYOUT_QUERY = "vllm_ext_push_layout"


@dataclasses.dataclass(frozen=True)
class PeerLayout:
    """An engine's parallel layout, as its side channel announces it (S-LEG-5): the
    peer's word on how many TP ranks and PP stages write or receive a request's KV.
    A leg or a notification that claims another layout fails its own request; it is
    never what a connection is built from."""

    engine_id: str
    tp_size: int
    pp_size: int
    #: the TCP user timeout its NIXL agents' UCX uses (0: unbounded): the bounds of
    #: N-REL-2 and N-LIV-1 on either side assume the peer's is the same
    tcp_user_timeout_s: float = 0.0
    #: its KV cache groups (``compat.kv_groups``: kind, sliding window, layers), in
    #: vLLM's order (S-HYB-1); empty from an older peer, which announces none
    kv_groups: tuple[tuple[str, int, tuple[str, ...]], ...] = ()
    #: its model identity (``model_id.identity``: S-LEG-6), as (key, value) pairs;
    #: empty from an older peer, which announces none
    model: tuple[tuple[str, str], ...] = ()
    #: a producer's ``push_peer_hosts``: the D hosts it connects to (empty: any), so a D
    #: outside them learns at its handshake that P would never connect back; empty from
    #: an older peer
    peer_hosts: tuple[str, ...] = ()

    def encode(self) -> bytes:
        body: dict[str, Any] = {"v": WIRE_VERSION, **dataclasses.asdict(self)}
        body["kv_groups"] = [[k, w, list(layers)] for k, w, layers in self.kv_groups]
        body["model"] = dict(self.model)
        body["peer_hosts"] = list(self.peer_hosts)
        return bytes(msgpack.packb(body, use_bin_type=True))

    @classmethod
    def decode(cls, payload: bytes) -> PeerLayout:
        """Raises :class:`WireError` (an empty payload: a peer that does not announce one)."""
        if not payload:
            raise WireError("no_layout", "the peer's side channel announces no layout")
        body = _unpack_map(payload, "layout")
        tp, pp = _field(body, "tp_size", int), _field(body, "pp_size", int)
        if tp < 1 or pp < 1:
            raise WireError("bad_value", f"layout tp_size {tp} / pp_size {pp}")
        timeout = _field(body, "tcp_user_timeout_s", float)
        if not timeout >= 0:  # (NaN too)
            raise WireError("bad_value", f"layout tcp_user_timeout_s {timeout}")
        groups = []
        for g in _field(body, "kv_groups", list, default=None) or ():
            ok = isinstance(g, list) and len(g) == 3 and isinstance(g[0], str)
            if not (ok and _is_int(g[1]) and g[1] >= 0 and isinstance(g[2], list)
                    and all(isinstance(n, str) for n in g[2])):  # fmt: skip
                raise WireError("bad_type", "layout kv_groups: [kind, window, [layers]] each")
            groups.append((g[0], g[1], tuple(g[2])))
        model = _field(body, "model", dict, default=None) or {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in model.items()):
            raise WireError("bad_type", "layout model: a map of strings")
        hosts = _field(body, "peer_hosts", list, default=None) or []
        if not all(isinstance(h, str) and h for h in hosts):
            raise WireError("bad_type", "layout peer_hosts: a list of host names or networks")
        engine = _nonempty(_field(body, "engine_id", str), "engine_id")
        return cls(
            engine, tp, pp, timeout, tuple(groups), tuple(sorted(model.items())), tuple(hosts)
        )


# -- the other notifications ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Completion:
    """The producer finished writing ``request_id``: vLLM's ``<request id>:<tp size>``,
    or, with the registration's ``reply_token`` (S-WIR-3), ``PUSH_DONE:`` and a map."""

    request_id: str
    tp_size: int
    token: str | None = dataclasses.field(default=None, repr=False)

    def encode(self) -> bytes:
        if self.token is None:
            return f"{self.request_id}:{self.tp_size}".encode()
        body = {"v": WIRE_VERSION, "request_id": self.request_id, "tp_size": self.tp_size,
                "token": self.token}  # fmt: skip
        return PUSH_DONE_PREFIX + msgpack.packb(body, use_bin_type=True)


@dataclasses.dataclass(frozen=True)
class PushFailed:
    """P will not write ``request_id`` (D's id); ``reason`` is for the log; ``token``
    the registration's ``reply_token`` (S-WIR-3). ``landing`` (a notice, not an
    answer): NIXL reported a WRITE of it failed, and the rest of that WRITE may still
    land (N-REL-2): D fails the request now but keeps its blocks until P's answer."""

    request_id: str
    reason: str
    token: str | None = dataclasses.field(default=None, repr=False)
    landing: bool = False

    def encode(self) -> bytes:
        body: dict[str, Any] = {
            "v": WIRE_VERSION, "request_id": self.request_id, "reason": self.reason[:200]
        }  # fmt: skip
        if self.token is not None:
            body["token"] = self.token
        if self.landing:
            body["landing"] = True
        return PUSH_FAIL_PREFIX + msgpack.packb(body, use_bin_type=True)


#: PushFailed.reason of P's answer to a PUSH_CANCEL.
CANCELLED = "cancelled"


@dataclasses.dataclass(frozen=True)
class PushCancel:
    """D aborted ``request_id``; carries D's coordinates so P can answer it."""

    engine_id: str
    request_id: str
    tp_rank: int
    tp_size: int
    host: str
    port: int
    #: the registration's reply_token, which P's answer carries (S-WIR-3)
    reply_token: str | None = dataclasses.field(default=None, repr=False)

    def encode(self) -> bytes:
        body = {"v": WIRE_VERSION, **dataclasses.asdict(self)}
        if self.reply_token is None:
            del body["reply_token"]
        return PUSH_CANCEL_PREFIX + msgpack.packb(body, use_bin_type=True)


@dataclasses.dataclass(frozen=True)
class PushHeartbeat:
    """P still holds these D requests: D renews their watchdog (see the module doc).
    ``tokens``: each registration's ``reply_token`` ("" for an older D's), S-WIR-3."""

    request_ids: tuple[str, ...]
    tokens: tuple[str, ...] = ()

    def encode(self) -> bytes:
        body: dict[str, Any] = {"v": WIRE_VERSION, "request_ids": list(self.request_ids)}
        if any(self.tokens):
            body["tokens"] = list(self.tokens)
        return PUSH_HB_PREFIX + msgpack.packb(body, use_bin_type=True)

    def token_of(self) -> dict[str, str | None]:
        """request id -> the token the heartbeat carries for it (None: none)."""
        tokens = self.tokens or ("",) * len(self.request_ids)
        return {r: t or None for r, t in zip(self.request_ids, tokens)}


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """vLLM's ``HB:`` lease heartbeat; ``payload`` is passed to the base worker."""

    payload: str


@dataclasses.dataclass(frozen=True)
class Malformed:
    reason: str
    detail: str


Notif = (
    PushRegistration | PushCancel | PushHeartbeat | Completion | PushFailed | Heartbeat | Malformed
)


def parse_notif(raw: bytes) -> Notif:
    """Classify one inbound notification. Never raises (S-WIR-2)."""
    try:
        return _parse(raw)
    except WireError as e:
        return Malformed(e.reason, e.detail)
    except Exception as e:  # defensive: no content may stop the reading thread
        return Malformed("internal", f"{type(e).__name__}: {e}")


def _parse(raw: bytes) -> Notif:
    if not isinstance(raw, (bytes, bytearray)):
        raise WireError("bad_type", f"notification is {type(raw).__name__}")
    if not raw:
        raise WireError("empty", "empty notification")
    if len(raw) > MAX_NOTIF_BYTES:
        raise WireError("oversized", f"{len(raw)} bytes > {MAX_NOTIF_BYTES}")
    raw = bytes(raw)
    if raw.startswith(PUSH_REG_PREFIX):
        return PushRegistration.decode(raw[len(PUSH_REG_PREFIX) :])
    if raw.startswith(PUSH_FAIL_PREFIX):
        return _decode_push_failed(raw[len(PUSH_FAIL_PREFIX) :])
    if raw.startswith(PUSH_CANCEL_PREFIX):
        return _decode_push_cancel(raw[len(PUSH_CANCEL_PREFIX) :])
    if raw.startswith(PUSH_HB_PREFIX):
        return _decode_push_heartbeat(raw[len(PUSH_HB_PREFIX) :])
    if raw.startswith(PUSH_DONE_PREFIX):
        return _decode_push_done(raw[len(PUSH_DONE_PREFIX) :])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("not_utf8", "notification is not UTF-8") from None
    if text.startswith(HEARTBEAT_PREFIX.decode()):
        return Heartbeat(text[len(HEARTBEAT_PREFIX) :])
    req_id, sep, tp = text.rpartition(":")
    if not sep or not req_id:
        raise WireError("bad_arity", f"no '<request id>:<tp size>' in {text[:80]!r}")
    if not (tp.isascii() and tp.isdigit()) or int(tp) < 1:  # "²".isdigit() is True
        raise WireError("bad_tp", f"tp size {tp[:20]!r} is not a positive integer")
    return Completion(req_id, int(tp))


def _decode_push_failed(payload: bytes) -> PushFailed:
    body = _unpack_map(payload, "PUSH_FAIL")
    req_id = _nonempty(_field(body, "request_id", str), "request_id")
    token = _field(body, "token", str, default=None) or None
    landing = _field(body, "landing", bool, default=False)
    return PushFailed(req_id, str(body.get("reason", ""))[:200], token, landing)


def _decode_push_done(payload: bytes) -> Completion:
    body = _unpack_map(payload, "PUSH_DONE")
    req_id = _nonempty(_field(body, "request_id", str), "request_id")
    tp_size = _field(body, "tp_size", int)
    if tp_size < 1:
        raise WireError("bad_tp", f"PUSH_DONE tp size {tp_size}")
    return Completion(req_id, tp_size, _nonempty(_field(body, "token", str), "token"))


def _decode_push_cancel(payload: bytes) -> PushCancel:
    body = _unpack_map(payload, "PUSH_CANCEL")
    tp_rank, tp_size = _field(body, "tp_rank", int), _field(body, "tp_size", int)
    port = _field(body, "port", int)
    if tp_size < 1 or not 0 <= tp_rank < tp_size or not 0 < port < 65536:
        raise WireError("bad_value", f"PUSH_CANCEL rank {tp_rank}/{tp_size} port {port}")
    return PushCancel(
        engine_id=_nonempty(_field(body, "engine_id", str), "engine_id"),
        request_id=_nonempty(_field(body, "request_id", str), "request_id"),
        tp_rank=tp_rank,
        tp_size=tp_size,
        host=_nonempty(_field(body, "host", str), "host"),
        port=port,
        reply_token=_field(body, "reply_token", str, default=None) or None,
    )


def _decode_push_heartbeat(payload: bytes) -> PushHeartbeat:
    body = _unpack_map(payload, "PUSH_HB")
    ids = _field(body, "request_ids", list)
    if not all(isinstance(r, str) and r for r in ids):
        raise WireError("bad_type", "PUSH_HB request_ids must be non-empty strings")
    tokens = _field(body, "tokens", list, default=[])
    if tokens and (len(tokens) != len(ids) or not all(isinstance(t, str) for t in tokens)):
        raise WireError("bad_type", "PUSH_HB tokens must be strings, one per request id")
    return PushHeartbeat(tuple(ids), tuple(tokens))


def _unpack_map(payload: bytes, what: str) -> dict:
    try:
        body = msgpack.unpackb(payload, raw=False)
    except Exception as e:
        raise WireError("bad_msgpack", f"{type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise WireError("bad_type", f"{what} body is not a map")
    return body
