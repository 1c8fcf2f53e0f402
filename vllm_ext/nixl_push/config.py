# SPDX-License-Identifier: Apache-2.0
"""Push settings from ``kv_connector_extra_config``, validated once, with defaults.

Every key is optional::

    --kv-transfer-config '{"kv_connector": "ExtNixlPushConnector", "kv_role": "kv_consumer",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"push_registration_timeout_s": 120}}'

A bad value stops the engine at startup with an error naming the key; so does a key
of ours (:func:`is_our_key`) that does not exist, with the list of those that do.
Durations end in their unit (``_s``, ``_ms``, ``_us``); the names they had before
(:data:`RENAMED_KEYS`) still work, with a warning.

Defaults depend on the engine's device (:data:`DEVICE_DEFAULTS`): the CPU ones were
tuned for hosts where every engine owns one core, which a GPU engine is not.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import ipaddress
from collections.abc import Mapping
from typing import Any

from vllm_ext.log import get_logger
from vllm_ext.nixl_push.wire import P_REGISTRATION_TTL_FRACTION

logger = get_logger(__name__)

#: vLLM's default for ``decoder_kv_blocks_ttl`` (seconds), our watchdog default.
DEFAULT_DECODER_KV_BLOCKS_TTL = 480.0
#: Upper bound of the millisecond waits and poll periods below: longer would stall steps.
MAX_WAIT_MS = 1000.0


class PushConfigError(ValueError):
    pass


#: Old key -> its name now (one unit convention: a duration ends in ``_s``, ``_ms`` or
#: ``_us``). An old name still works, with a warning; setting both is an error.
RENAMED_KEYS: dict[str, str] = {
    "push_registration_timeout": "push_registration_timeout_s",
    "push_cancel_answer_timeout": "push_cancel_answer_timeout_s",
    "push_write_timeout": "push_write_timeout_s",
    "push_heartbeat_timeout": "push_heartbeat_timeout_s",
}
#: Key prefixes of ours in ``kv_connector_extra_config`` (besides :data:`OUR_KEYS`):
#: an unknown key that starts so is a mistake, never vLLM's.
OUR_PREFIXES = ("push_", "ucx_", "nixl_progress_")
#: vLLM's own keys that we read as well (they keep vLLM's meaning).
VLLM_KEYS_READ = ("decoder_kv_blocks_ttl", "enable_cross_layers_blocks")


#: Defaults that differ by the engine's device type (vLLM's ``device_config``); a key
#: set in ``kv_connector_extra_config`` always wins. On a GPU host an engine does not
#: share its core with the other engine: vLLM's CPU pinning of the worker thread is
#: the intended one and UCX's spinlock costs nothing. Chunk-progressive push is on: on
#: one H200 it lowered the hand-off after the last prompt token at every point whose
#: prompts span several chunks, TTFT equal within noise (docs/benchmarks.md); it is
#: unmeasured on CPU engines, whose prompts mostly fit one chunk.
#: (``push_handover_wait_ms`` keeps its default on a GPU: P's engine thread hands a
#: pass's requests to the KV-ready watcher and never waits for the writer.)
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {
        "keep_cpu_affinity": False,
        "ucx_use_mt_mutex": False,
        "enable_cross_layers_blocks": True,
        "push_progressive": True,
    },
}


@dataclasses.dataclass(frozen=True)
class PushConfig:
    #: D: seconds a registration may wait for P's WRITE before D stops waiting on it
    #: (defaults to ``decoder_kv_blocks_ttl``). P: seconds an unmatched PUSH_REG is kept.
    push_registration_timeout_s: float = DEFAULT_DECODER_KV_BLOCKS_TTL
    #: P writer self-poll period while finished blocks wait for a registration (S-WRT-2).
    push_writer_poll_interval_ms: float = 1.0
    #: NIXL progress-thread sleep between polls, microseconds. NIXL's Python API
    #: hard-codes 0 (a busy core per engine); None keeps NIXL's behaviour.
    nixl_progress_delay_us: int | None = 100
    #: UCX guards its worker with a mutex instead of a spinlock (``UCX_USE_MT_MUTEX``):
    #: NIXL's progress thread and the writer share a core here (compat.ucx_mt_mutex).
    ucx_use_mt_mutex: bool = True
    #: UCX on TCP declares a connection dead once sent data stayed unacknowledged this
    #: long (``UCX_TCP_USER_TIMEOUT``; 0: UCX's default, about 15 minutes). It bounds
    #: how long a WRITE to a peer that is gone holds P's and D's blocks (N-REL-1).
    ucx_tcp_user_timeout_s: float = 30.0
    #: D: a cancelled request (client abort, watchdog) ends this long after its
    #: PUSH_CANCEL (or after the last heartbeat of a P rank that has not answered yet)
    #: even if some P rank never answered (P gone).
    push_cancel_answer_timeout_s: float = 10.0
    #: P: a matched WRITE must be done this long after both its registration arrived
    #: and the KV was final (handshake with D and transfer included), else it is
    #: abandoned: D is told (PUSH_FAIL) and P's blocks are freed once NIXL no longer
    #: reads them (at most this long again if NIXL cannot cancel the transfer).
    push_write_timeout_s: float = 30.0
    #: Keep vLLM's NIXL worker from re-pinning the engine's main thread to the last
    #: core of each NUMA node (it would put P and D on the same core on CPU hosts).
    keep_cpu_affinity: bool = True
    #: P: hand a request's blocks to the writer at the end of the forward pass that
    #: ran its last prompt token (when that step also finishes it, ``max_tokens`` 1),
    #: instead of one engine step later from ``request_finished``.
    push_at_forward_end: bool = True
    #: P: at the end of that forward pass the engine thread waits up to this long for
    #: the writer to post those WRITEs (it yields the core and the GIL). P only: D's
    #: engine thread never waits for its writer. 0: no wait.
    push_handover_wait_ms: float = 5.0
    #: P, with ``push_at_forward_end``: match the registration, build the WRITE's
    #: descriptors and its NIXL request (``initialize_xfer``) while the forward pass
    #: that completes the prompt runs, so only ``transfer()`` follows that pass.
    push_prepare_at_announce: bool = True
    #: P, with ``push_at_forward_end``: chunk-progressive push (S-PRG-1). With chunked
    #: prefill, the blocks a chunk's forward pass filled are final; WRITE them (without
    #: a notification) while the next chunks compute, so that only the last chunk's
    #: blocks follow the end of the prefill. D is told once, by the last WRITE, posted
    #: when every earlier one of the request has ended. Engines with one KV cache group
    #: of full attention only; others push whole requests. On by default on CUDA.
    push_progressive: bool = False
    #: D, opt-in: in a step that runs no request while completions are awaited,
    #: get_finished waits up to this long for one (the writer reads notifications every
    #: 50 us meanwhile) instead of returning to an engine loop that steps again at
    #: once. 0 (default): D's engine thread never waits for a WRITE; what arrived is
    #: taken by the next step.
    push_recv_idle_wait_ms: float = 0.0
    #: vLLM's own ``enable_cross_layers_blocks`` (on by default on CUDA): one KV tensor
    #: whose blocks hold every layer, so a WRITE needs one descriptor per run of blocks
    #: instead of one per layer and run. Where vLLM's attention backend cannot lay the
    #: cache out so (the CPU backend; KV layout not HND), vLLM keeps per-layer tensors.
    cross_layer_blocks: bool = False
    #: Both: after a handshake with a peer failed, further requests to that peer fail
    #: at once for this long instead of each waiting out vLLM's handshake timeout
    #: (a dead peer costs one timeout, not one per request). 0: no memory.
    push_handshake_backoff_s: float = 5.0
    #: Both: handshakes with different peers run in parallel on this many threads
    #: (vLLM's executor has one: a slow peer delays every other peer's handshake).
    push_handshake_threads: int = 4
    #: P: a push P leg without ``transfer_id`` (a router that runs the legs one after
    #: the other, e.g. vllm-router) gets a fresh transfer id, and P answers the push D
    #: leg (S-LEG-1) instead of vLLM's pull answer (nixl_push/answer.py).
    push_answer_sequential_legs: bool = True
    #: D: a cancelled request whose producers have not answered keeps its blocks
    #: (quarantined) in case a WRITE is still on its way (S-SAFE-1). Negative (the
    #: default): until every producer answered or is known gone (restarted, or silent
    #: twice ``ucx_tcp_user_timeout_s`` since D's send to it failed: N-LIV-1); the request
    #: itself fails at that deadline. Re-asks go over new connections once a partition
    #: ends (S-FLT-2). A bound >= 0 frees them with an error that long after their
    #: answers were due (0: at the answer deadline): a WRITE that lands later could
    #: land in reused blocks.
    push_quarantine_s: float = -1.0
    #: D: once a producer renewed a registration (PUSH_HB: its P request is queued,
    #: prefilling or being written), its silence for this long ends the wait as the
    #: watchdog would (a P that hangs, is cut off or died is noticed in seconds, not
    #: at ``push_registration_timeout_s``). At least twice the heartbeat interval (the
    #: default grows to that); 0: off.
    push_heartbeat_timeout_s: float = 30.0
    #: P: the D hosts P may connect to (addresses, CIDR networks or host names, as D
    #: announces them in its PUSH_REG); a registration or cancel naming another host is
    #: refused without a connection (``push_peer_hosts_refused``). Empty: any host (the
    #: P/D network is trusted: docs/deploy.md, *The trust boundary*).
    push_peer_hosts: tuple[str, ...] = ()
    #: The device these defaults were resolved for.
    device: str = "cpu"

    def allows_peer_host(self, host: str) -> bool:
        """``host`` is one of :attr:`push_peer_hosts` (or none is configured)."""
        return peer_hosts_allow(self.push_peer_hosts, host)

    @property
    def heartbeat_interval(self) -> float:
        """D asks each producer rank to renew its registrations this often (``heartbeat_s``
        in PUSH_REG): four times per watchdog period and per cancel-answer period."""
        return min(self.push_registration_timeout_s, self.push_cancel_answer_timeout_s) / 4

    @property
    def renewed_watchdog_s(self) -> float:
        """D: a registration's watchdog from a producer's latest renewal (PUSH_HB)."""
        if self.push_heartbeat_timeout_s > 0:
            return min(self.push_registration_timeout_s, self.push_heartbeat_timeout_s)
        return self.push_registration_timeout_s

    @property
    def write_release_bound(self) -> float:
        """P: how long an abandoned WRITE may still be waited for (NIXL could not cancel
        it) before its blocks are freed anyway, with an error."""
        return self.push_write_timeout_s

    @property
    def lease_overrun(self) -> float:
        """P: how long past the end of vLLM's lease a finished request's blocks may be
        held while a WRITE may read them (its deadline and its release bound): the
        hard cap on lease extensions."""
        return self.push_write_timeout_s + self.write_release_bound

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, device: str = "cpu") -> PushConfig:
        extra = dict(extra or {})
        _check_keys(extra)
        for key, value in DEVICE_DEFAULTS.get(device, {}).items():
            extra.setdefault(key, value)
        ttl = _number(extra, "decoder_kv_blocks_ttl", DEFAULT_DECODER_KV_BLOCKS_TTL, minimum=0)
        timeout = _number(extra, "push_registration_timeout_s", ttl, minimum=0, exclusive=True)
        poll = _number(
            extra, "push_writer_poll_interval_ms", cls.push_writer_poll_interval_ms, minimum=0,
            exclusive=True, maximum=MAX_WAIT_MS,
        )  # fmt: skip
        delay: int | None = cls.nixl_progress_delay_us
        if "nixl_progress_delay_us" in extra:
            raw = extra["nixl_progress_delay_us"]
            if raw is None:
                delay = None
            else:
                delay = int(_number(extra, "nixl_progress_delay_us", 0, minimum=0))
        keep = _flag(extra, "keep_cpu_affinity", cls.keep_cpu_affinity)
        early = _flag(extra, "push_at_forward_end", cls.push_at_forward_end)
        mt_mutex = _flag(extra, "ucx_use_mt_mutex", cls.ucx_use_mt_mutex)
        tcp_user_timeout = _number(
            extra, "ucx_tcp_user_timeout_s", cls.ucx_tcp_user_timeout_s, minimum=0
        )
        prepare = _flag(extra, "push_prepare_at_announce", cls.push_prepare_at_announce)
        progressive = _flag(extra, "push_progressive", cls.push_progressive)
        answer_legs = _flag(extra, "push_answer_sequential_legs", cls.push_answer_sequential_legs)
        handover = _number(
            extra, "push_handover_wait_ms", cls.push_handover_wait_ms, minimum=0,
            maximum=MAX_WAIT_MS,
        )  # fmt: skip
        idle_wait = _number(
            extra, "push_recv_idle_wait_ms", cls.push_recv_idle_wait_ms, minimum=0,
            maximum=MAX_WAIT_MS,
        )  # fmt: skip
        answer = _number(
            extra, "push_cancel_answer_timeout_s", cls.push_cancel_answer_timeout_s, minimum=0,
            exclusive=True,
        )  # fmt: skip
        write_timeout = _number(
            extra, "push_write_timeout_s", cls.push_write_timeout_s, minimum=0, exclusive=True
        )
        backoff = _number(
            extra, "push_handshake_backoff_s", cls.push_handshake_backoff_s, minimum=0
        )
        quarantine = _number(extra, "push_quarantine_s", cls.push_quarantine_s, minimum=-1.0)
        silence = _number(
            extra, "push_heartbeat_timeout_s", cls.push_heartbeat_timeout_s, minimum=0
        )
        threads = _number(
            extra, "push_handshake_threads", cls.push_handshake_threads, minimum=1, maximum=64
        )
        if threads != int(threads):
            raise PushConfigError(
                f"kv_connector_extra_config['push_handshake_threads']={threads}: must be an integer"
            )
        peer_hosts = extra.get("push_peer_hosts", [])
        if not isinstance(peer_hosts, list | tuple) or not all(
            isinstance(h, str) and h.strip() for h in peer_hosts
        ):
            raise PushConfigError(
                f"kv_connector_extra_config['push_peer_hosts']={peer_hosts!r}: must be a list "
                "of addresses, CIDR networks or host names"
            )
        # vLLM's own key (it reads "true"/"false" strings too): one source of truth.
        cross_layer = str(extra.get("enable_cross_layers_blocks", False)).lower() == "true"
        cfg = cls(
            push_registration_timeout_s=timeout,
            push_writer_poll_interval_ms=poll,
            nixl_progress_delay_us=delay,
            ucx_use_mt_mutex=mt_mutex,
            ucx_tcp_user_timeout_s=tcp_user_timeout,
            push_cancel_answer_timeout_s=answer,
            push_write_timeout_s=write_timeout,
            keep_cpu_affinity=keep,
            push_at_forward_end=early,
            push_handover_wait_ms=handover,
            push_prepare_at_announce=prepare,
            push_progressive=progressive,
            push_recv_idle_wait_ms=idle_wait,
            cross_layer_blocks=cross_layer,
            push_handshake_backoff_s=backoff,
            push_quarantine_s=quarantine,
            push_heartbeat_timeout_s=silence,
            push_handshake_threads=int(threads),
            push_answer_sequential_legs=answer_legs,
            push_peer_hosts=tuple(h.strip() for h in peer_hosts),
            device=device,
        )
        if 0 < cfg.push_heartbeat_timeout_s < 2 * cfg.heartbeat_interval:
            if "push_heartbeat_timeout_s" not in extra:  # the default follows longer intervals
                return dataclasses.replace(cfg, push_heartbeat_timeout_s=2 * cfg.heartbeat_interval)
            raise PushConfigError(
                f"kv_connector_extra_config['push_heartbeat_timeout_s']={silence:g}: must be 0 "
                f"(off) or at least twice the heartbeat interval ({2 * cfg.heartbeat_interval:g}s:"
                " a quarter of push_registration_timeout_s or push_cancel_answer_timeout_s, "
                "whichever is less)"
            )
        return cfg


#: Every key of ours (a ``PushConfig`` field set from the key of the same name).
OUR_KEYS = tuple(
    f.name for f in dataclasses.fields(PushConfig) if f.name not in ("device", "cross_layer_blocks")
)


def is_our_key(key: str) -> bool:
    return key.startswith(OUR_PREFIXES) or key in OUR_KEYS


def _check_keys(extra: dict[str, Any]) -> None:
    """Refuse an unknown key of ours (a misspelt one would be silently ignored) and a
    key close to one of ours; rename the old names (:data:`RENAMED_KEYS`), warning."""
    unknown = []
    for key in list(extra):
        if key in OUR_KEYS or key in VLLM_KEYS_READ:
            continue
        if key in RENAMED_KEYS:
            new = RENAMED_KEYS[key]
            if new in extra:
                raise PushConfigError(
                    f"kv_connector_extra_config sets both {key!r} and {new!r}: {key!r} is the "
                    f"old name of {new!r}; keep {new!r} only"
                )
            logger.warning(
                "vllm-ext: kv_connector_extra_config[%r] is deprecated: it is now %r "
                "(durations end in their unit); using its value",
                key, new,
            )  # fmt: skip
            extra[new] = extra.pop(key)
            continue
        near = difflib.get_close_matches(key, (*OUR_KEYS, *RENAMED_KEYS), n=1, cutoff=0.85)
        if is_our_key(key) or near:
            unknown.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    if unknown:
        raise PushConfigError(
            f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}. The push "
            f"connector's keys are: {', '.join(OUR_KEYS)} (README.md, "
            "'kv_connector_extra_config keys')"
        )


#: ``VLLM_NIXL_SIDE_CHANNEL_HOST`` values that reach this host only.
_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def check_side_channel_host(host: str) -> str | None:
    """The side-channel host is the address this engine announces to its peers (D in
    every PUSH_REG, P in its answer): an address that binds every interface
    (``0.0.0.0``, ``::``) is refused, since a peer that connects to it reaches its own
    host; a loopback address (``127.0.0.1``, ``localhost``) works on one host only:
    the returned warning says so (None: nothing to say). Names are not resolved."""
    name = host.strip().strip("[]")
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        addr = None
    if addr is not None and addr.is_unspecified:
        raise PushConfigError(
            f"VLLM_NIXL_SIDE_CHANNEL_HOST={host!r} binds every interface, but it is also the "
            "address this engine announces to its peers, and a peer connecting to it reaches "
            "its own host. Set it to this host's address that the peers reach (the pod IP on "
            "Kubernetes), or 127.0.0.1 when P and D share one host (docs/deploy.md)"
        )
    if name.lower() in _LOOPBACK_NAMES or (addr is not None and addr.is_loopback):
        return (
            f"VLLM_NIXL_SIDE_CHANNEL_HOST={host!r} is a loopback address: push works only "
            "between engines on this host. With P and D on different hosts, set it to this "
            "host's address that the peers reach (docs/deploy.md)"
        )
    return None


def _flag(extra: dict[str, Any], key: str, default: bool) -> bool:
    v = extra.get(key, default)
    if not isinstance(v, bool):
        raise PushConfigError(f"kv_connector_extra_config[{key!r}]={v!r}: must be true or false")
    return v


def _number(
    extra: dict[str, Any],
    key: str,
    default: float,
    minimum: float,
    exclusive: bool = False,
    maximum: float | None = None,
) -> float:
    if key not in extra:
        return float(default)
    v = extra[key]
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            v = None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise PushConfigError(
            f"kv_connector_extra_config[{key!r}]={extra[key]!r}: must be a number"
        )
    if v < minimum or (exclusive and v == minimum):
        bound = ">" if exclusive else ">="
        raise PushConfigError(f"kv_connector_extra_config[{key!r}]={v}: must be {bound} {minimum}")
    if maximum is not None and v > maximum:
        raise PushConfigError(
            f"kv_connector_extra_config[{key!r}]={v}: must be at most {maximum:g}"
        )
    return float(v)


def producer_lost_after_s(tcp_user_timeout_s: float) -> float:
    """D: a silent producer is gone once this long passed since D's send to it failed
    (UCX's error on the endpoint) with no sign of life from it since: twice the TCP
    user timeout of the producers' UCX (the same as D's: one deployment), its own
    timeout, which ends any WRITE it still sends, and as much again (N-LIV-1).
    Negative (never) where that timeout is unbounded (0)."""
    return 2 * tcp_user_timeout_s if tcp_user_timeout_s > 0 else -1.0


def unrenewed_registration_hold_s(cfg: PushConfig, tcp_user_timeout_s: float) -> float:
    """D: how long after a PUSH_REG went out a producer may still hold it without
    having renewed it: UCX delivers it within the TCP user timeout or fails the
    endpoint, and P keeps it a fraction of the registration timeout from its arrival
    (N-LIV-1; P's timeout is at most D's, S-LEG-5)."""
    return tcp_user_timeout_s + P_REGISTRATION_TTL_FRACTION * cfg.push_registration_timeout_s


def check_write_timeout(cfg: PushConfig, tcp_user_timeout_s: float, source: str) -> None:
    """P: refuse a ``push_write_timeout_s`` not below 2 x the TCP user timeout *T* its
    NIXL agents use (``tcp_user_timeout_s``, the one in force; ``source`` says where it
    comes from). A WRITE NIXL reported failed is held 2 x *T* and then counted ended
    (N-REL-2): that is safe only while P gives up a WRITE before then, since a WRITE
    still running past 2 x *T* may land into blocks D freed. No rule where *T* is
    unbounded (0): that is warned of on its own."""
    limit = 2 * tcp_user_timeout_s
    if 0 < limit <= cfg.push_write_timeout_s:
        raise PushConfigError(
            f"kv_connector_extra_config['push_write_timeout_s']={cfg.push_write_timeout_s:g} "
            f"must be less than 2 x the TCP user timeout of P's NIXL agents ({source}: "
            f"{tcp_user_timeout_s:g}s, so less than {limit:g}s): a WRITE NIXL reported failed "
            "is counted ended 2 x that timeout after the error (docs/design.md N-REL-2), and "
            "one P still runs then could land in blocks D gave away. Set push_write_timeout_s "
            f"below {limit:g}, or raise the TCP user timeout above "
            f"{cfg.push_write_timeout_s / 2:g}s (on D as well: D refuses a P whose timeout "
            "is longer than its own)"
        )


def peer_hosts_allow(peer_hosts: tuple[str, ...], host: str) -> bool:
    """``host`` (as D names itself in its PUSH_REG) is among ``peer_hosts`` (a producer's
    ``push_peer_hosts``: addresses, networks, host names), or ``peer_hosts`` is empty.
    P's rule for whom it connects to; D applies the same to the list P announces."""
    if not peer_hosts:
        return True
    networks, names = _peer_host_rules(tuple(peer_hosts))
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host.lower() in names
    return any(address in network for network in networks)


@functools.cache
def _peer_host_rules(
    hosts: tuple[str, ...],
) -> tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...], frozenset[str]]:
    """``push_peer_hosts`` parsed once: its networks (an address is a /32 or /128) and
    its host names (lower case)."""
    networks, names = [], set()
    for entry in hosts:
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            names.add(entry.lower())
    return tuple(networks), frozenset(names)
